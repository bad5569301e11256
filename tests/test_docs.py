"""The documentation site (mkdocs.yml, docs/) and the code blocks of README.md and docs/.

1. The site builds with ``mkdocs build --strict`` (a broken link, a missing API object or an
   unknown generated section fails it), its generated pages hold what the code says (every policy
   of the engine's registry, every ``hvd-scale`` command), and the built HTML loads nothing from
   elsewhere: no script, style sheet or font from another host.
2. Every fenced code block tagged ``python``, ``pycon``, ``bash``, ``sh``, ``shell`` or
   ``console`` in README.md and docs/**/*.md is run, unless the line before its fence says why
   not::

       <!-- not run: needs a horovodrun job -->

   ``<!-- run -->`` there says a block is meant to run (the default). How each kind runs:
   ``python``, a script of its own; ``pycon``, a doctest (its printed values are checked);
   ``bash``/``sh``/``shell``, ``bash -euo pipefail``; ``console``, the ``$ `` lines as commands,
   and each other line must appear in their output, in order (``...`` stands for any text). Each runs in a fresh process in an
   empty directory, with the venv's scripts first on PATH and no policy or log directory in the
   environment (``hvd-scale run --policy`` would set them).
3. Every ``hvd-scale`` command line that is not run (in a block marked not run, or an indented
   code block) is parsed by hvd-scale's own parser and checked as ``hvd-scale run`` checks its
   options before starting anything (for horovodrun: the command line it would start, -np in
   it); nothing is started. A block whose commands cannot be checked says why instead::

       <!-- not checked: REASON -->
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"
REQUIRE_ENV_VAR = "HVD_SCALE_REQUIRE_HOROVOD"  # set by `make test`: the docs extra must be there

# Languages whose blocks are run, and how.
RUNNABLE = {"python": "python", "py": "python", "pycon": "pycon", "bash": "bash", "sh": "bash",
            "shell": "bash", "console": "console"}
BLOCK_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 240
# The environment a block must not inherit: the launcher's hand-over to the workers.
DROPPED_ENV = ("HVD_SCALE_POLICY", "HVD_SCALE_LOG_DIR", "HOROVOD_RANK", "HOROVOD_SIZE")

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not[ -]run|not[ -]checked|run)\b\s*:?\s*"
                    r"(?P<reason>.*?)\s*-->\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int              # 1-based line of the opening fence
    language: str          # the info string's first word, lower case
    code: str
    marker: str | None     # 'run', 'not run', 'not checked' (not run either) or None
    reason: str            # a not-run marker's reason

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, each with the marker on the line before its
    fence (blank lines between them allowed)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        body, j = [], i + 1
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while j < len(lines) and not closing.match(lines[j]):
            text = lines[j]
            body.append(text[len(indent):] if text.startswith(indent) else text.lstrip())
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k]) if k >= 0 else None
        language = info.split()[0].lower().lstrip(".{") if info else ""
        blocks.append(Block(path, i + 1, language, "\n".join(body) + "\n",
                            None if marker is None else
                            re.sub(r"[ -]", " ", marker.group("kind").lower()),
                            marker.group("reason") if marker else ""))
        i = j + 1
    return blocks


def documents() -> list[Path]:
    return [REPO_ROOT / "README.md"] + sorted(
        p for p in DOCS.rglob("*.md") if "screenshots" not in p.relative_to(DOCS).parts)


ALL_BLOCKS = [b for doc in documents() for b in code_blocks(doc) if b.language in RUNNABLE]
TO_RUN = [b for b in ALL_BLOCKS if b.marker not in ("not run", "not checked")]


def block_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def console_script(code: str) -> tuple[str, list[str]]:
    """A console block's commands (``$ `` lines, with ``\\`` continuations) and expected lines."""
    commands, expected, continued = [], [], False
    for line in code.splitlines():
        if continued:
            commands[-1] += "\n" + line
        elif line.startswith("$ "):
            commands.append(line[2:])
        elif line.strip():
            expected.append(line.strip())
            continue
        else:
            continue
        continued = line.rstrip().endswith("\\")
    return "\n".join(commands) + "\n", expected


def run_block(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    kind = RUNNABLE[block.language]
    if kind == "python":
        (workdir / "block.py").write_text(block.code)
        argv = [sys.executable, "block.py"]
    elif kind == "pycon":
        (workdir / "block.txt").write_text(block.code)
        argv = [sys.executable, "-m", "doctest", "-o", "ELLIPSIS", "-o", "NORMALIZE_WHITESPACE",
                "block.txt"]
    else:
        script = console_script(block.code)[0] if kind == "console" else block.code
        (workdir / "block.sh").write_text(script)
        argv = ["bash", "-euo", "pipefail", "block.sh"]
    return subprocess.run(argv, cwd=workdir, env=block_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)  # one stream: a console block's order


def test_documents_have_runnable_blocks():
    """The collector finds the blocks (a parser that found none would pass everything)."""
    assert TO_RUN, "no runnable code block found in README.md or docs/"
    assert any(b.path.parent == DOCS for b in TO_RUN)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.marker in ("not run", "not checked")],
                         ids=lambda b: b.where)
def test_a_block_not_run_says_why(block):
    assert len(block.reason) >= 3, (
        f"{block.where}: a block marked {block.marker} must say why: "
        f"<!-- {block.marker}: REASON -->")


@pytest.mark.parametrize("block", TO_RUN, ids=lambda b: f"{b.where}-{b.language}")
def test_code_block_runs(block, tmp_path):
    done = run_block(block, tmp_path)
    output = done.stdout
    hint = (f"\n{block.where}: this ```{block.language} block failed (exit {done.returncode}). "
            "If it cannot run on its own (it needs a model, a horovodrun job, data), say so on the "
            "line before its fence: <!-- not run: REASON -->\n")
    assert done.returncode == 0, hint + output[-4000:]
    if RUNNABLE[block.language] == "console":
        position = 0
        for line in console_script(block.code)[1]:
            for piece in filter(None, (p.strip() for p in line.split("..."))):
                found = output.find(piece, position)
                assert found >= 0, f"{block.where}: expected output {piece!r} (of the line " \
                                   f"{line!r}) not found, in order, in:\n{output[-4000:]}"
                position = found + len(piece)


# -- the site -------------------------------------------------------------------------------------

EXTERNAL_ASSET = [
    re.compile(r"<script\b[^>]*\bsrc\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE),
    re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE),
    re.compile(r"<img\b[^>]*\bsrc\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE),
    re.compile(r"@import\s+(?:url\()?[\"']?(?:https?:)?//", re.IGNORECASE),
    re.compile(r"fonts\.(?:googleapis|gstatic)\.com", re.IGNORECASE),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    try:
        import mkdocs  # noqa: F401
        import material  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as e:
        message = f"the docs extra is not installed ({e}): pip install -e '.[docs]' (make setup)"
        if os.environ.get(REQUIRE_ENV_VAR, "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{message} ({REQUIRE_ENV_VAR} is set)")
        pytest.skip(message)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
                           "-f", str(REPO_ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    print(f"site built in {time.monotonic() - start:.1f} s")
    return out


def test_site_builds_strict_with_every_page(site):
    for page in ("index.html", "getting-started.html", "concepts.html", "torch.html", "keras.html",
                 "converting.html", "policies.html", "cli.html", "troubleshooting.html",
                 "benchmarks.html", "report/index.html", "changelog.html", "api/engine.html",
                 "api/torch.html", "api/keras.html"):
        assert (site / page).is_file(), page


def test_site_loads_nothing_from_elsewhere(site):
    found = []
    for path in sorted(site.rglob("*")):
        if path.suffix in (".html", ".css"):
            text = path.read_text(encoding="utf-8", errors="replace")
            for pattern in EXTERNAL_ASSET:
                found += [f"{path.relative_to(site)}: {m.group(0)}" for m in pattern.finditer(text)]
    assert found == []


def test_generated_pages_follow_the_code(site):
    from hvd_scale import describe_policies
    from hvd_scale.launch.cli import build_parser
    from hvd_scale.metrics import METRICS

    policies = (site / "policies.html").read_text()
    for name, description, options in describe_policies():
        assert re.search(rf"<code[^>]*>{name}</code>", policies), name
        for option in options:
            assert f"<code>{option}</code>" in policies, (name, option)
    cli = (site / "cli.html").read_text()
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in commands:
        assert f"hvd-scale {name}" in cli, name
    assert "--policy" in cli and "--log-dir" in cli
    metrics = (site / "metrics.html").read_text()
    assert all(re.search(rf"<code[^>]*>{name}</code>", metrics) for name in METRICS)
    # The benchmark report is the repository's, with its plots.
    assert (site / "report" / "results" / "quality_accuracy.png").is_file()
    assert "<!-- generated:" not in policies + cli + metrics


def test_api_reference_shows_the_schedules_fields(site):
    """#48 item 8: the schedules are dataclasses whose fields have no docstrings; the reference
    showed none of them. Each field and each class's signature are there."""
    import dataclasses as dc

    from hvd_scale import schedules

    engine = (site / "api" / "engine.html").read_text()
    classes = [c for c in vars(schedules).values()
               if isinstance(c, type) and dc.is_dataclass(c) and c.__module__ == schedules.__name__]
    assert {c.__name__ for c in classes} >= {"Constant", "StepDecay", "Exponential", "Cosine"}
    for cls in classes:
        for field in dc.fields(cls):
            assert f'id="hvd_scale.schedules.{cls.__name__}.{field.name}"' in engine, \
                (cls.__name__, field.name)
    text = re.sub(r"<[^>]+>", "", engine)
    assert "StepDecay(lr: float, milestones: Sequence[int], gamma: float = 0.1)" in text


# -- hvd-scale command lines that are not run ------------------------------------------------------

COMMAND_START = re.compile(r"^(?:\S*/)?hvd-scale\s")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>&1"}


@dataclasses.dataclass(frozen=True)
class CommandLine:
    where: str
    text: str

    def argv(self) -> list[str]:
        """hvd-scale's arguments: the shell words after it, up to a comment or an operator."""
        words = shlex.split(self.text.replace("\\\n", " "), comments=True)
        for i, word in enumerate(words):
            if word in SHELL_OPERATORS:
                words = words[:i]
                break
        return words[1:]


def _command_lines(text: str, first_line: int, path: Path, console: bool) -> list[CommandLine]:
    lines, found = text.splitlines(), []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if console:
            line = line[2:] if line.startswith("$ ") else ""
        start = i
        while line.endswith("\\") and i + 1 < len(lines):  # a continued command
            i += 1
            line += "\n" + lines[i].strip()
        if COMMAND_START.match(line):
            found.append(CommandLine(f"{path.relative_to(REPO_ROOT)}:{first_line + start}", line))
        i += 1
    return found


def unrun_command_lines() -> list[CommandLine]:
    """hvd-scale lines of shell blocks marked not run, and of indented code blocks (not run)."""
    found = []
    for doc in documents():
        for b in code_blocks(doc):
            if RUNNABLE.get(b.language) in ("bash", "console") and b.marker == "not run":
                found += _command_lines(b.code, b.line + 1, doc, b.language == "console")
        # An indented code block: 4 spaces in, after a blank line, until a line that is not.
        in_fence, in_block, after_blank = False, False, True
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if FENCE.match(line):
                in_fence = not in_fence
            if in_fence or FENCE.match(line) or not line.strip():
                after_blank = not in_fence
                continue
            in_block = line.startswith("    ") and (after_blank or in_block)
            after_blank = False
            if in_block:
                found += _command_lines(line, n, doc, console=False)
    return found


UNRUN_COMMANDS = unrun_command_lines()


def test_unrun_command_lines_are_found():
    """The collector finds them (one that found none would pass everything)."""
    assert any(c.where.startswith("README.md") for c in UNRUN_COMMANDS)
    assert any(c.where.startswith("docs/elastic.md") for c in UNRUN_COMMANDS)


@pytest.mark.parametrize("line", UNRUN_COMMANDS, ids=lambda c: c.where)
def test_command_line_parses(line, monkeypatch, capsys):
    """#48 item 1: docs/elastic.md's `hvd-scale run` had no -np and horovodrun refused it."""
    from hvd_scale.launch import cli, engines

    started = []

    def check_job(command, np=None, engine="horovodrun", policy=None, log_dir=None, *, min_np=None,
                  max_np=None, log_every=None, samples=None, **options):
        job = engines.make_job(np, policy, None, min_np, max_np, log_every, samples)  # no log dir
        if engine == "horovodrun":
            cmd = engines.HorovodrunEngine(**options).command_line(command, job)
            assert "-np" in cmd, cmd
        started.append(command)
        return 0

    monkeypatch.setattr(cli, "_horovodrun", lambda: "/x/horovodrun")
    monkeypatch.setattr(cli.engines, "run_command", check_job)
    argv = line.argv()
    hint = (f"{line.where}: `{line.text}` is refused by hvd-scale's parser. If it cannot be "
            "checked (a placeholder), say so on the line before its fence: "
            "<!-- not checked: REASON -->\n")
    try:
        if argv[:1] == ["run"]:
            assert cli.main(argv) == 0 and started, hint + capsys.readouterr().err
        else:
            cli.build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(hint + f"exit {e.code}: " + capsys.readouterr().err)
