"""The headline figures that README.md, docs/index.md and docs/benchmarks.md quote agree with the
results files they come from (#48 item 9: three pages had three versions of B1 at S = 16).

Each page must state each headline in the one form matched below (so that a reworded page is
not skipped silently); each figure it quotes must round to what the results file holds, at the
page's own precision (96.55 may be quoted as 96.55, 96.6 or 96.5, never as 96.4).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
PAGES = ("README.md", "docs/index.md", "docs/benchmarks.md")
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
        truth[f"bleu{s}"], truth[f"x{s}"] = float(m.group(1)), float(m.group(3))
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
