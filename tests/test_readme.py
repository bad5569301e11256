"""README.md is a front page, not a lab notebook: a newcomer reads it in two minutes.

It stays within a line budget, every relative link on it resolves to a file of the repository,
it shows `make test` as the test command (.ci/run runs it), and neither it nor a page of the
site (docs/) cites the project's issue tracker: "#50's default", "issue 31", "turn 5" mean
nothing to a user. The results table's figures are checked against the results files by
tests/test_published_figures.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
MAX_LINES = 150

# [text](target) and ![alt](target); the target up to a space (a title) or the closing paren.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A reference to the tracker: "#50", "#50's", "(#31)", "issue 31", "issue #33", "turn 5",
# "PR 12". Not an anchor (cli.md#run), an HTML entity (&#39;) or a word ending in "turn" (return 2).
ISSUE_REFERENCE = re.compile(
    r"(?<![\w&/.#-])#\d+\b|\b(?:[Ii]ssues?|PR|[Pp]ull request)\s+#?\d+\b|\b[Tt]urn\s+\d+\b")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a comment in code may say `# 2 workers`)."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = m.group(1) if fence is None else None
            out.append("")
            continue
        out.append("" if fence else line)
    return "\n".join(out)


def relative_links(path: Path) -> list[str]:
    targets = LINK.findall(_prose(path.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^(?:[a-z][a-z0-9+.-]*:|#|//)", t, re.I)]


def user_pages() -> list[Path]:
    return [README] + sorted(p for p in (REPO_ROOT / "docs").rglob("*.md"))


def test_readme_is_within_its_line_budget():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, (
        f"README.md has {len(lines)} lines, the front page's budget is {MAX_LINES}: move the "
        "detail to the site (docs/) or benchmarks/README.md and link it")


def test_readme_links_resolve():
    links = relative_links(README)
    assert len(links) >= 5, links  # the collector finds them (one that found none passes all)
    broken = []
    for target in links:
        file = target.split("#", 1)[0]
        if file and not (README.parent / file).resolve().exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_readme_links_its_results_files():
    """Every figure on the front page comes from a results file, linked beside it."""
    results = [t for t in relative_links(README) if t.startswith("benchmarks/results/")]
    assert len(results) >= 2, results


def test_readme_shows_the_test_command():
    text = README.read_text(encoding="utf-8")
    assert "make test" in text
    assert "make setup" in text and "pip install ." in text


def test_the_issue_reference_pattern():
    for cited in ("at #50's default", "issue #31's rerun", "(#31)", "issue 31", "turn 5",
                  "in issue #33's trial", "Issue 60"):
        assert ISSUE_REFERENCE.search(cited), cited
    for fine in ("docs/cli.md#hvd-scale-run", "&#39;", "return 2 * X", "S = 16", "B4", "#",
                 "color #fff", "k = 4 (4 passes)", "[link](page.md#1-setup)"):
        assert not ISSUE_REFERENCE.search(fine), fine


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_issue_numbers_on_user_facing_pages(page):
    text = _prose(page.read_text(encoding="utf-8"))
    found = [f"{page.relative_to(REPO_ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)!r}"
             for m in ISSUE_REFERENCE.finditer(text)]
    assert not found, ("a user-facing page cites the issue tracker; say what changed instead "
                       f"(the changelog dates releases): {found}")
