"""MkDocs hooks for hvd_scale's documentation site (mkdocs.yml ``hooks:``).

What the site shows that the code already says is generated here at build time, never copied:

* ``<!-- generated: policies -->``: the policy table, from the engine's registry
  (``hvd_scale.describe_policies()``: names, descriptions, options and their help);
* ``<!-- generated: cli -->``: each ``hvd-scale`` command's usage and help, from the argparse
  parser that the command line itself uses (``hvd_scale.launch.cli.build_parser()``);
* ``<!-- generated: metrics -->``: the columns of ``metrics.csv``, from ``hvd_scale.metrics.METRICS``;
* ``<!-- generated: conversion-diff -->``: examples/horovod_torch_before.py against its conversion,
  examples/horovod_torch_after.py, as a diff (``conversion-diff-keras``: the Keras pair);
* ``report/``: benchmarks/README.md and benchmarks/results/ (reports and plots) mirrored into the
  site as they are in the repository, so numbers are read from the results files themselves;
* the API reference's sources: ``hvd_scale.adapters`` and ``hvd_scale.launch`` are installed from
  ``adapters/`` and ``launch/`` (pyproject.toml's package-dir), a layout griffe (mkdocstrings'
  static reader) does not follow through an editable install; a temporary tree of symbolic
  links puts them where the import names say, and the python handler reads that tree.

Nothing here reaches the network; the build is run strict by tests/test_docs.py.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import posixpath
import re
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files, InclusionLevel

log = logging.getLogger("mkdocs.hooks.hvd_scale")

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
REPORT = "report"  # where benchmarks/README.md and benchmarks/results/ appear in the site
MIRRORED = (".md", ".png")
MARKER = re.compile(r"<!--\s*generated:\s*([a-z_-]+)\s*-->")

_api_tree: str | None = None


# -- the API reference's source tree ------------------------------------------------------------

def _api_source_tree() -> str:
    """A temporary directory holding ``hvd_scale/`` as it is installed: the engine's modules, with
    ``adapters`` and ``launch`` inside it. Directories are made, each module is a symbolic link
    to its source (griffe does not descend into linked directories)."""
    tree = Path(tempfile.mkdtemp(prefix="hvd_scale_docs_"))
    for source, dest in ((ROOT / "hvd_scale", tree / "hvd_scale"),
                         (ROOT / "adapters", tree / "hvd_scale" / "adapters"),
                         (ROOT / "launch", tree / "hvd_scale" / "launch")):
        for module in source.rglob("*.py"):
            link = dest / module.relative_to(source)
            if "__pycache__" not in link.parts:
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(module)
    atexit.register(shutil.rmtree, tree, True)  # also when the build stops before on_shutdown
    return str(tree)


@event_priority(100)  # before mkdocstrings' own on_config, which builds the python handler
def on_config(config):
    global _api_tree
    mkdocstrings = config.plugins.get("mkdocstrings")
    if mkdocstrings is not None:
        _api_tree = _api_source_tree()
        python = mkdocstrings.config.handlers.setdefault("python", {})
        python["paths"] = [_api_tree]
    return config


def on_shutdown():
    global _api_tree
    if _api_tree:
        shutil.rmtree(_api_tree, ignore_errors=True)
        _api_tree = None


# -- the benchmark report, mirrored -----------------------------------------------------------

def on_files(files: Files, config) -> Files:
    sources = [BENCHMARKS / "README.md"] + sorted(
        p for p in (BENCHMARKS / "results").iterdir() if p.suffix in MIRRORED)
    for path in sources:
        rel = path.relative_to(BENCHMARKS).as_posix()
        uri = f"{REPORT}/index.md" if rel == "README.md" else f"{REPORT}/{rel}"
        # The report is in the nav; each results page is reached from it.
        inclusion = InclusionLevel.INCLUDED if rel == "README.md" or path.suffix != ".md" \
            else InclusionLevel.NOT_IN_NAV
        files.append(File.generated(config, uri, abs_src_path=str(path), inclusion=inclusion))
    return files


_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _unlink_missing(markdown: str, page, files: Files) -> str:
    """In a mirrored page, a relative link to something outside the site (a script, the
    repository's README) becomes the path in code, so the strict build does not fail on it."""
    base = posixpath.dirname(page.file.src_uri)

    def fix(m: re.Match) -> str:
        bang, text, target = m.groups()
        if re.match(r"^[a-z]+:|^#", target):
            return m.group(0)
        path = posixpath.normpath(posixpath.join(base, target.split("#")[0]))
        if files.get_file_from_path(path) is not None:
            return m.group(0)
        source = posixpath.normpath(posixpath.join("benchmarks", posixpath.relpath(
            posixpath.join(base, target.split("#")[0]), REPORT)))
        return f"{text} (`{source}`)" if text and text != target else f"`{source}`"

    return _LINK.sub(fix, markdown)


# -- generated sections -------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _name(name: str) -> str:
    """A table's first cell: the name in code, on one line (docs/stylesheets/extra.css)."""
    return f'<code class="nowrap">{name}</code>'


def policies_markdown() -> str:
    from hvd_scale import describe_policies

    rows = ["| policy | what it does | options (`name:key=value,...`) |", "|---|---|---|"]
    for name, description, options in describe_policies():
        opts = "<br>".join(f"`{key}`: {_cell(help_)}" for key, help_ in options.items()) or "none"
        rows.append(f"| {_name(name)} | {_cell(description)} | {opts} |")
    return "\n".join(rows)


@contextlib.contextmanager
def _columns(width: int):
    """argparse wraps help to the terminal's width ($COLUMNS): fix it, so the page is the same
    wherever it is built."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


HELP_WIDTH = 100


def _wrap_usage(help_text: str) -> str:
    """A usage line that a parser gives as one string (``hvd-scale run``'s) is not wrapped by
    argparse: wrap it as argparse would, continuation lines under the first option."""
    lines = []
    for line in help_text.splitlines():
        if not (line.startswith("usage: ") and len(line) > HELP_WIDTH):
            lines.append(line)
            continue
        tokens, depth = [], 0  # an option in brackets is one token: "[--policy SPEC]"
        for word in line.split(" "):
            if depth > 0:
                tokens[-1] += " " + word
            else:
                tokens.append(word)
            depth += word.count("[") - word.count("]")
        indent = " " * len(" ".join(tokens[:3]) + " ")  # under the first option
        current = " ".join(tokens[:3])
        for token in tokens[3:]:
            if len(current) + 1 + len(token) > HELP_WIDTH:
                lines.append(current)
                current = indent + token
            else:
                current += " " + token
        lines.append(current)
    return "\n".join(lines)


def cli_markdown() -> str:
    from hvd_scale.launch.cli import build_parser

    with _columns(HELP_WIDTH):
        parser = build_parser()
        out = ["## `hvd-scale`", "", "```text", _wrap_usage(parser.format_help().rstrip()),
               "```", ""]
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        summaries = {a.dest: a.help for a in commands._choices_actions}
        for name, sub in commands.choices.items():
            out += [f"## `hvd-scale {name}`", ""]
            if summaries.get(name):
                out += [summaries[name], ""]
            out += ["```text", _wrap_usage(sub.format_help().rstrip()), "```", ""]
    return "\n".join(out)


def metrics_markdown() -> str:
    from hvd_scale.metrics import LOGS_METRICS, METRICS

    rows = ["| column | meaning | in Keras `logs` |", "|---|---|---|"]
    rows += [f"| {_name(name)} | {_cell(meaning)} | {'yes' if name in LOGS_METRICS else ''} |"
             for name, meaning in METRICS.items()]
    return "\n".join(rows)


def conversion_diff_markdown(framework: str) -> str:
    """The conversion guide's example: examples/horovod_<framework>_before.py (a script in
    Horovod's own style) against examples/horovod_<framework>_after.py (the same, converted), as a
    unified diff."""
    import difflib

    before, after = (ROOT / "examples" / f"horovod_{framework}_{n}.py" for n in ("before", "after"))
    diff = difflib.unified_diff(before.read_text().splitlines(), after.read_text().splitlines(),
                                f"examples/{before.name}", f"examples/{after.name}", lineterm="")
    return "```diff\n" + "\n".join(diff) + "\n```"


GENERATORS = {"policies": policies_markdown, "cli": cli_markdown, "metrics": metrics_markdown,
              "conversion-diff": lambda: conversion_diff_markdown("torch"),
              "conversion-diff-keras": lambda: conversion_diff_markdown("keras"),
              "conversion-diff-tape": lambda: conversion_diff_markdown("tape")}


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    if page.file.src_uri.startswith(f"{REPORT}/"):
        return _unlink_missing(markdown, page, files)

    def generate(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: unknown generated section {name!r}; "
                             f"known: {sorted(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(generate, markdown)
