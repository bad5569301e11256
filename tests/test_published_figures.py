"""The headline figures that README.md, docs/index.md and docs/benchmarks.md quote agree with the
results files they come from (three pages once had three versions of B1 at S = 16).

docs/index.md and docs/benchmarks.md state each headline in the one form matched below, README.md
in its results table (a row per task and S); so that a reworded page is not skipped silently,
each must be found. Each figure a page quotes must round to what the results file holds, at the
page's own precision (96.55 may be quoted as 96.55, 96.6 or 96.5, never as 96.4).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
PAGES = ("docs/index.md", "docs/benchmarks.md")  # README.md: its table, below
NUMBER = r"(\d+(?:\.\d+)?)"


def _section(text: str, heading: str) -> str:
    """The text of the `## heading...` section (to the next `## `)."""
    m = re.search(rf"^## {re.escape(heading)}.*?(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, f"no section '## {heading}' in the results file"
    return m.group(0)


def b1_truth() -> dict[str, float]:
    """B1 at today's code: the fair fight's S = 1 baseline and AdaScale's rows (fair_fight.md)."""
    text = _section((RESULTS / "fair_fight.md").read_text(), "B1:")
    base = re.search(rf"S = 1 \([^)]*\): {NUMBER} accuracy %", text)
    assert base, "fair_fight.md's B1 section lost its S = 1 line"
    truth = {"acc1": float(base.group(1))}
    for s in (16, 64):
        row = re.search(rf"^\| {s} \| \*\*adascale\*\* [^|]*\| [^|]*\| {NUMBER} ± [\d.]+ \| (\d+) \|",
                        text, re.MULTILINE)
        assert row, f"fair_fight.md's B1 table lost AdaScale's S = {s} row"
        truth[f"acc{s}"], truth[f"steps{s}"] = float(row.group(1)), float(row.group(2))
    return truth


def b4_truth() -> dict[str, float]:
    """B4, converged baseline: adascale_adam's row of bleu.md (BLEU, speed-up in steps)."""
    text = _section((RESULTS / "bleu.md").read_text(), "Converged baseline")
    row = re.search(r"^\| \*\*adascale_adam\*\* \(horizons in progress\) \|(.*)$", text,
                    re.MULTILINE)
    assert row, "bleu.md's converged table lost adascale_adam's row"
    cells = [c.strip() for c in row.group(1).split("|") if c.strip()]
    truth = {}
    for s, cell in zip((1, 8, 32, 128), cells):
        m = re.match(rf"{NUMBER} ± [\d.]+<br>(\d+) steps \(x{NUMBER}\)", cell)
        assert m, f"bleu.md: unexpected cell for S = {s}: {cell!r}"
        truth[f"bleu{s}"], truth[f"steps{s}"], truth[f"x{s}"] = map(float, m.groups())
    return truth


# The one form each page states a headline in; the groups name the figures of the truth above.
HEADLINES = {
    "B1": (b1_truth, re.compile(
        rf"AdaScale reaches {NUMBER}% (?:test accuracy )?against {NUMBER}% at S = 1 in (\d+) "
        rf"(?:optimizer )?steps instead of 3000; at S = 64, {NUMBER}% in (\d+)"),
        ("acc16", "acc1", "steps16", "acc64", "steps64")),
    "B4": (b4_truth, re.compile(
        rf"holds BLEU {NUMBER} / {NUMBER} / {NUMBER} at S = 8 / 32 / 128 in {NUMBER}x / "
        rf"{NUMBER}x / {NUMBER}x fewer steps(?: \([\d / ]+\))?, against {NUMBER} at S = 1"),
        ("bleu8", "bleu32", "bleu128", "x8", "x32", "x128", "bleu1")),
}


def agrees(quoted: str, true: float) -> bool:
    """The quoted figure is the true one rounded to the quote's decimals (either way at a tie)."""
    decimals = len(quoted.partition(".")[2])
    return abs(float(quoted) - true) <= 0.5 * 10 ** -decimals + 1e-9


def test_agrees_rounds_at_the_quotes_precision():
    assert agrees("96.55", 96.55) and agrees("96.6", 96.55) and agrees("96.5", 96.55)
    assert not agrees("96.4", 96.55) and not agrees("97.4", 97.32) and not agrees("684", 683)


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("bench", sorted(HEADLINES))
def test_headline_figures_match_the_results_files(page, bench):
    truth_of, pattern, names = HEADLINES[bench]
    truth = truth_of()
    text = " ".join((REPO_ROOT / page).read_text(encoding="utf-8").split())
    found = pattern.search(text)
    assert found, (f"{page}: no {bench} headline in the checked form (tests/"
                   f"test_published_figures.py, HEADLINES['{bench}']): state it that way")
    wrong = [f"{name}: quoted {quoted}, the results file says {truth[name]:g}"
             for name, quoted in zip(names, found.groups()) if not agrees(quoted, truth[name])]
    assert not wrong, f"{page}'s {bench} headline disagrees with its results file: {wrong}"


# README.md's results table: | task | S | AdaScale | S = 1 | steps (S = 1's) | results |, a task's
# first row naming it (B1: ..., B4: ...), its other rows leaving the cell empty.
README_ROWS = {  # bench: its truth, the S that must have a row, the results file it links
    "B1": (b1_truth, (16, 64), "fair_fight.md", ("acc", "acc1", "steps")),
    "B4": (b4_truth, (8, 32, 128), "bleu.md", ("bleu", "bleu1", "steps")),
}
ROW = re.compile(rf"^\| *(B\d)?[^|]*\| *(\d+) *\| *{NUMBER}%? *\| *{NUMBER}%? *\| *(\d+) "
                 rf"\((\d+)\) *\| *\[[^]]*\]\(benchmarks/results/([\w.]+)\) *\|$")


def readme_rows() -> dict[tuple[str, int], tuple[str, ...]]:
    rows, bench = {}, None
    for line in (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        m = ROW.match(line.strip())
        if m:
            bench = m.group(1) or bench
            rows[(bench, int(m.group(2)))] = m.group(3, 4, 5, 6, 7)
    return rows


def test_readme_table_is_read():
    rows = readme_rows()
    assert rows, "README.md lost its results table (| task | S | AdaScale | S = 1 | steps ...)"
    assert set(rows) >= {(b, s) for b, (_, scales, _, _) in README_ROWS.items() for s in scales}


@pytest.mark.parametrize("bench", sorted(README_ROWS))
def test_readme_table_matches_the_results_files(bench):
    truth_of, scales, results, (quality, base, steps) = README_ROWS[bench]
    truth, rows, wrong = truth_of(), readme_rows(), []
    for s in scales:
        q, q1, n, n1, linked = rows[(bench, s)]
        for name, quoted in ((f"{quality}{s}", q), (base, q1), (f"{steps}{s}", n),
                             (f"{steps}1" if bench == "B4" else None, n1)):
            if name and not agrees(quoted, truth[name]):
                wrong.append(f"S = {s}, {name}: quoted {quoted}, the results file says "
                             f"{truth[name]:g}")
        if bench == "B1" and n1 != "3000":
            wrong.append(f"S = {s}: B1's S = 1 runs 3000 steps, quoted {n1}")
        if linked != results:
            wrong.append(f"S = {s}: links {linked}, its figures are in {results}")
    assert not wrong, f"README.md's {bench} rows disagree with their results file: {wrong}"
