"""#48 item 11: an install without make. A Horovod user has an environment already: `pip install .`
(with the `torch` / `keras` extras) into it, then `hvd-scale build-horovod` (or the Horovod it has),
and `pip wheel .` holds the package and nothing else (README, Install).

Nothing is downloaded. The wheel is built from a copy of the package's sources (`pip wheel
--no-build-isolation --no-index`, with decoys beside them: a venv, tests, a site), so the
repository is not written to. "An existing environment with torch and Horovod" is a new venv
(`python -m venv --without-pip`) whose site-packages holds a .pth file naming a view of this
environment's site-packages: links to each of its entries except hvd_scale's own (the editable
install) and, when this environment's Horovod wheel is in build-horovod's cache, Horovod's. The
new venv then has torch, TensorFlow, Keras and pip (this one's), but neither hvd_scale nor Horovod;
pip runs with no index, no find-links and no configuration file, so a requirement not already
present fails instead of downloading. With the cached wheel, `hvd-scale build-horovod` installs it
into the new venv (no build: a dry run must first say it would use the cache); without it, the
test takes the other path, the Horovod found in the environment.

pip installs `<wheel>[torch,keras]` with dependencies (not --no-deps): with no index, that shows
both that the wheel installs and that its requirements and extras resolve from what the
environment has. Everything lives in one temporary directory, removed at the end whatever
happened. Last, `hvd-scale check` in a torch-only (or TensorFlow-only) environment, in-process
with Horovod faked: a framework that is not installed is not counted against Horovod.

A DDP user's environment (no Horovod) is a second venv whose view holds only what the wheel's
requirements name, transitively, with the `torch` extra (then `plot` too), and pip: a module
the launcher imports but does not declare (psutil was one) is missing there as in a new
environment. In it: `hvd-scale check` (exit 0: torchrun ready), a 2-process `hvd-scale run
--engine torchrun` of examples/ddp_after.py with a metrics log, `advise` on it, and `plot`
without matplotlib (one line naming the extra) and with it.

A release: `python -m build --no-isolation` of a copy of the sources (the sdist, then the wheel
built from it) and `twine check --strict` of both, offline; its version has its changelog entry.
"""

from __future__ import annotations

import email.parser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGES: list[str] = SETUPTOOLS["packages"]
PACKAGE_DIRS: dict[str, str] = SETUPTOOLS["package-dir"]
PACKAGE_DATA: dict[str, list[str]] = SETUPTOOLS.get("package-data", {})
REQUIRE_ENV_VAR = "HVD_SCALE_REQUIRE_HOROVOD"  # set by `make test`: Horovod must be there
EXTRAS = "torch,keras"
VERSION = re.search(r'^__version__ = "([^"]+)"$',
                    (REPO_ROOT / "hvd_scale" / "__init__.py").read_text(encoding="utf-8"),
                    re.M).group(1)
STEP_TIMEOUT_S = 240  # one command; the module's tests take 1.5-2.5 minutes on 2 cores

pytestmark = pytest.mark.timeout(600)


def _required() -> bool:
    return os.environ.get(REQUIRE_ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


def _package_dir(package: str) -> Path:
    return REPO_ROOT / PACKAGE_DIRS.get(package, package.replace(".", "/"))


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def run(argv, env, cwd, timeout=STEP_TIMEOUT_S) -> subprocess.CompletedProcess:
    started = time.monotonic()
    out = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    print(f"[{time.monotonic() - started:5.1f} s] {' '.join(map(str, argv))} -> {out.returncode}")
    return out


def hermetic_env(bin_dir: Path | None = None) -> dict[str, str]:
    """The caller's environment without pip's settings (no index, no find-links, no config file)
    or anything that would put other code on sys.path; ``bin_dir`` first on PATH, this
    interpreter's bin directory off it."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "HVD_SCALE_POLICY",
            "HVD_SCALE_LOG_DIR"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in drop}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_INPUT="1", PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    ours = Path(sys.executable).parent
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != ours]
    if bin_dir is not None:
        path.insert(0, str(bin_dir))
        env["VIRTUAL_ENV"] = str(bin_dir.parent)
    env["PATH"] = os.pathsep.join(path)
    return env


# ---------------------------------------------------------------------------------------------
# The wheel

@pytest.fixture(scope="module")
def workdir():
    root = Path(tempfile.mkdtemp(prefix="hvd_scale_install_test_"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def expected_wheel_files() -> set[str]:
    """What the wheel must hold: every module of every package, and the package data."""
    want = set()
    for package in PACKAGES:
        base = package.replace(".", "/")
        directory = _package_dir(package)
        want |= {f"{base}/{p.name}" for p in directory.glob("*.py")}
        for pattern in PACKAGE_DATA.get(package, []):
            want |= {f"{base}/{p.name}" for p in directory.glob(pattern) if p.is_file()}
    return want


def test_every_module_is_in_a_listed_package():
    """pyproject.toml lists its packages: a new folder of modules left off the list would be
    left out of every install (`pip install -e .` does not show it: it maps the folders)."""
    listed = {_package_dir(p).resolve() for p in PACKAGES}
    roots = {REPO_ROOT / _package_dir(p).relative_to(REPO_ROOT).parts[0] for p in PACKAGES}
    unlisted = sorted(
        str(d.relative_to(REPO_ROOT)) for root in roots for d in [root, *root.rglob("*")]
        if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py"))
        and d.resolve() not in listed)
    assert not unlisted, (f"folders of modules in no package of pyproject.toml's "
                          f"[tool.setuptools] packages (and package-dir): {unlisted}")


@pytest.fixture(scope="module")
def wheel(workdir) -> Path:
    """`pip wheel` of a copy of the sources, decoys beside them; no download, no repo writes."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed here (pip wheel --no-build-isolation needs it)")
    src = copy_sources(workdir / "src")
    dist = workdir / "dist"
    out = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--no-index", "-w", dist, src], hermetic_env(), workdir)
    assert out.returncode == 0, f"pip wheel failed:\n{_tail(out.stdout)}"
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, f"pip wheel made {[w.name for w in wheels]}"
    return wheels[0]


SOURCE_FILES = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "setup.py", "setup.cfg")


def copy_sources(src: Path) -> Path:
    """The package's sources copied to src, with decoys beside them that no build may take."""
    src.mkdir()
    for name in SOURCE_FILES:
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, src / name)
    for top in sorted({PACKAGE_DIRS.get(p, p.replace(".", "/")).split("/")[0] for p in PACKAGES}):
        shutil.copytree(REPO_ROOT / top, src / top,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # What a checkout has beside the package and must never reach the wheel.
    decoys = [".venv/lib/python3/site-packages/decoy/__init__.py", "tests/test_decoy.py",
              "examples/decoy.py", "benchmarks/decoy.py", "site/decoy.js", "runs/decoy/x.csv",
              "launch/__pycache__/decoy.cpython-311.pyc", "docs/decoy.md"]
    for decoy in decoys:
        (src / decoy).parent.mkdir(parents=True, exist_ok=True)
        (src / decoy).write_text("# not part of the package\n")
    return src


def test_pip_wheel_holds_the_package_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = [n for n in names if n.split("/")[0].endswith(".dist-info")]
    files = set(names) - set(dist_info)
    want = expected_wheel_files()
    assert files == want, (f"in the wheel and not the package: {sorted(files - want)}; "
                           f"in the package and not the wheel: {sorted(want - files)}")
    assert {n.split("/")[0] for n in names} == {"hvd_scale", dist_info[0].split("/")[0]}
    # build-horovod needs its fix script beside it; setup_env.sh ships as package data.
    for needed in ("hvd_scale/launch/build_horovod.py", "hvd_scale/launch/horovod_build_fix.py",
                   "hvd_scale/launch/setup_env.sh", "hvd_scale/adapters/torch/__init__.py",
                   "hvd_scale/adapters/keras/__init__.py"):
        assert needed in files


def test_the_wheel_declares_the_commands_and_the_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.HeaderParser().parsestr(z.read(meta_name).decode())
        entry_points = z.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    extras = set(meta.get_all("Provides-Extra", []))
    assert {"torch", "keras", "tensorflow", "mpi"} <= extras, extras
    assert set(PYPROJECT["project"]["optional-dependencies"]) == extras
    requires = meta.get_all("Requires-Dist", [])
    assert any(r.startswith("torch") and 'extra == "torch"' in r for r in requires), requires
    assert any(r.startswith("keras") and 'extra == "keras"' in r for r in requires), requires
    # The keras extra leaves an installed TensorFlow alone: no tensorflow-cpu beside it.
    assert not any("tensorflow" in r.split(";")[0] and 'extra == "keras"' in r for r in requires)
    # No framework and no Horovod without an extra: an existing environment keeps its own.
    plain = [r.split(";")[0].strip() for r in requires if "extra ==" not in r]
    assert not [r for r in plain if re.match(r"(torch|tensorflow|keras|horovod)\b", r)], plain
    for name, target in PYPROJECT["project"]["scripts"].items():
        assert re.search(rf"^{re.escape(name)} = {re.escape(target)}$", entry_points, re.M), \
            entry_points


# ---------------------------------------------------------------------------------------------
# A release: `python -m build` (the sdist, then the wheel from it) and `twine check`, offline

def _release_tools() -> None:
    missing = [m for m in ("build", "twine") if importlib.util.find_spec(m) is None]
    if missing:
        message = (f"{', '.join(missing)} not installed here: pyproject.toml's dev extra has "
                   f"them (make setup installs it)")
        if _required():
            pytest.fail(message)
        pytest.skip(message)


def test_a_release_builds_an_sdist_and_a_wheel_that_pass_twine_check(workdir):
    _release_tools()
    src = copy_sources(workdir / "release-src")
    dist = workdir / "release-dist"
    out = run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src],
              hermetic_env(), workdir)
    assert out.returncode == 0, f"python -m build failed:\n{_tail(out.stdout)}"
    sdist, = dist.glob("*.tar.gz")
    wheel, = dist.glob("*.whl")
    assert sdist.name == f"hvd_scale-{VERSION}.tar.gz", sdist.name
    assert wheel.name == f"hvd_scale-{VERSION}-py3-none-any.whl", wheel.name
    # The wheel (built from the sdist) holds the package; the sdist its sources and no decoy.
    names = zipfile.ZipFile(wheel).namelist()
    assert {n for n in names if ".dist-info/" not in n} == expected_wheel_files()
    import tarfile

    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
    sources = {str((_package_dir(f.rsplit("/", 1)[0].replace("/", ".")) /
                    f.rsplit("/", 1)[1]).relative_to(REPO_ROOT)) for f in expected_wheel_files()}
    assert sources <= members, sorted(sources - members)
    assert {"pyproject.toml", "README.md", "PKG-INFO"} <= members
    assert not [m for m in members if "decoy" in m], sorted(members)
    out = run([sys.executable, "-m", "twine", "check", "--strict", sdist, wheel],
              hermetic_env(), workdir)
    assert out.returncode == 0, _tail(out.stdout)
    assert out.stdout.count("PASSED") == 2, _tail(out.stdout)


def test_the_version_has_its_changelog_entry():
    """One version (hvd_scale.__version__, which pyproject.toml reads), and docs/changelog.md's
    newest release is it: `## X.Y.Z (YYYY-MM-DD)`, newest first, under `## Unreleased`."""
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "hvd_scale.__version__"}
    text = (REPO_ROOT / "docs" / "changelog.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[0] == "Unreleased", headings
    releases = [re.fullmatch(r"(\d+)\.(\d+)\.(\d+) \((\d{4}-\d\d-\d\d)\)", h) for h in headings[1:]]
    assert releases and all(releases), headings
    assert releases[0].group(0).split()[0] == VERSION, (headings[1], VERSION)
    versions = [tuple(map(int, m.groups()[:3])) for m in releases]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert not re.search(r"#\d", text), "an issue number on a user-facing page"


# ---------------------------------------------------------------------------------------------
# An existing environment: pip install, the command, the imports, Horovod

def _site_packages_dirs() -> list[Path]:
    dirs = []
    for key in ("purelib", "platlib"):
        d = Path(sysconfig.get_path(key))
        if d.is_dir() and d.resolve() not in [x.resolve() for x in dirs]:
            dirs.append(d)
    return dirs


def _is_ours(name: str) -> bool:
    n = name.lower().replace("-", "_")
    return (n.startswith("hvd_scale") or n.startswith("__editable__") or n.endswith(".pth")
            or n == "__pycache__")


def _is_horovod(name: str) -> bool:
    n = name.lower()
    return n == "horovod" or (n.startswith("horovod-") and n.endswith(".dist-info"))


def _cached_horovod_wheel() -> Path | None:
    """The wheel build-horovod would install here, from its cache (None: not cached)."""
    if importlib.util.find_spec("horovod") is None:
        return None
    from hvd_scale.launch import build_horovod as bh

    try:
        plan = bh.make_plan(bh.probe(sys.executable), set(), set())
    except bh.BuildError:
        return None
    return bh.cached_wheel(bh.cache_root() / "wheels" / plan.key)


def _horovod_files() -> dict[str, int]:
    """This environment's Horovod, file by file (its sizes), to show the test leaves it alone."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return {}
    root = Path(list(spec.submodule_search_locations)[0])
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


class Fresh:
    """The new venv standing for the user's environment."""

    def __init__(self, root: Path, horovod_wheel: Path | None):
        self.root = root
        self.horovod_wheel = horovod_wheel  # None: Horovod is found in the environment instead
        self.bin = root / "bin"
        self.python = self.bin / "python"
        self.env = hermetic_env(self.bin)
        self.cwd = root.parent  # not the repository: nothing of it on sys.path
        self.site_packages: Path | None = None

    def run(self, *argv, timeout=STEP_TIMEOUT_S) -> subprocess.CompletedProcess:
        return run(argv, self.env, self.cwd, timeout)

    def assert_inside(self, files: dict[str, str]) -> None:
        """Each of ``files`` is in the environment's site-packages, none in the repository."""
        site = self.site_packages.resolve()
        for what, file in files.items():
            path = Path(file).resolve()
            assert site in path.parents or path == site, f"{what} from {path}, not {site}"
            assert REPO_ROOT not in path.parents, f"{what} from the repository: {path}"

    def python_json(self, code: str) -> dict:
        out = self.run(self.python, "-c", code)
        assert out.returncode == 0, _tail(out.stdout)
        return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fresh(workdir) -> Fresh:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("pip") is None:
        if _required():
            pytest.fail(f"torch or pip is not importable from {sys.executable} (run `make setup`)")
        pytest.skip("this environment has no torch or pip to stand for an existing environment")
    horovod_wheel = _cached_horovod_wheel()
    env = Fresh(workdir / "existing-env", horovod_wheel)
    out = run([sys.executable, "-m", "venv", "--without-pip", env.root], hermetic_env(), workdir)
    assert out.returncode == 0, _tail(out.stdout)
    env.site_packages = Path(env.python_json(
        "import json, sysconfig; print(json.dumps(sysconfig.get_path('purelib')))"))
    views = []
    for i, site in enumerate(_site_packages_dirs()):
        view = workdir / f"existing-site-packages-{i}"
        view.mkdir()
        for entry in site.iterdir():
            if _is_ours(entry.name) or (horovod_wheel and _is_horovod(entry.name)):
                continue
            (view / entry.name).symlink_to(entry)
        views.append(str(view))
    (env.site_packages / "existing_environment.pth").write_text("\n".join(views) + "\n")
    return env


@pytest.fixture(scope="module")
def installed(fresh, wheel) -> subprocess.CompletedProcess:
    """pip install '<wheel>[torch,keras]' with no index: the extras resolve from what is there."""
    out = fresh.run(fresh.python, "-m", "pip", "install", "--no-index", f"{wheel}[{EXTRAS}]")
    assert out.returncode == 0, f"pip install failed:\n{_tail(out.stdout)}"
    return out


def test_pip_install_into_an_existing_environment_adds_only_hvd_scale(fresh, installed):
    lines = installed.stdout.splitlines()
    done = [line for line in lines if line.startswith("Successfully installed")]
    assert done == [f"Successfully installed hvd-scale-{VERSION}"], _tail(installed.stdout)
    for dist in ("torch", "keras", "numpy"):
        assert any(re.match(rf"Requirement already satisfied: {dist}\b", line) for line in lines), \
            f"{dist} was not found in the environment:\n{_tail(installed.stdout)}"
    assert (fresh.site_packages / "hvd_scale" / "__init__.py").is_file()
    assert (fresh.bin / "hvd-scale").is_file() and (fresh.bin / "hvd-scale-horovodrun").is_file()


def test_the_command_and_the_package_come_from_the_environment(fresh, installed):
    script = fresh.bin / "hvd-scale"
    assert script.read_text().splitlines()[0] == f"#!{fresh.python}", "not the venv's python"
    out = fresh.run("hvd-scale", "--help")
    assert out.returncode == 0 and "build-horovod" in out.stdout, _tail(out.stdout)
    found = fresh.python_json(
        "import json, importlib.metadata as m, hvd_scale, hvd_scale.launch.cli as c\n"
        "print(json.dumps({'hvd_scale': hvd_scale.__file__, 'cli': c.__file__, "
        "'dist': str(m.distribution('hvd-scale').locate_file(''))}))")
    fresh.assert_inside(found)


def test_build_horovod_or_a_found_horovod_then_check(fresh, installed):
    before = _horovod_files()
    if fresh.horovod_wheel is None:
        # The other path: Horovod is found in the environment (none cached to install here).
        if importlib.util.find_spec("horovod") is None:
            if _required():
                pytest.fail("Horovod is not importable here (run `make setup`)")
            pytest.skip("no Horovod here, and none cached: build-horovod would download and build")
        out = fresh.run("hvd-scale", "build-horovod", "--dry-run")
        assert out.returncode == 0 and "cache key" in out.stdout, _tail(out.stdout)
    else:
        out = fresh.run("hvd-scale", "check", "--engine", "horovodrun")
        assert out.returncode == 1, _tail(out.stdout)
        assert "horovod is not importable" in out.stdout, _tail(out.stdout)
        assert "hvd-scale build-horovod" in out.stdout, "the hint names no build-horovod"
        # A dry run first: the real one must install the cached wheel, never download or build.
        out = fresh.run("hvd-scale", "build-horovod", "--dry-run")
        assert out.returncode == 0, _tail(out.stdout)
        assert f"would use the cached {fresh.horovod_wheel}" in out.stdout, _tail(out.stdout)
        out = fresh.run("hvd-scale", "build-horovod")
        assert out.returncode == 0, _tail(out.stdout)
        assert f"cached wheel: {fresh.horovod_wheel}" in out.stdout, _tail(out.stdout)
        assert "installed" in out.stdout.splitlines()[-1], _tail(out.stdout)
        assert (fresh.root / ".horovod-key").is_file() and (fresh.bin / "horovodrun").is_file()
        where = fresh.python_json("import horovod, json; print(json.dumps(horovod.__file__))")
        assert fresh.site_packages.resolve() in Path(where).resolve().parents, where
    # `hvd-scale check` (it imports TensorFlow: the slowest step) beside the adapter's import.
    check = subprocess.Popen(["hvd-scale", "check", "--engine", "horovodrun"], cwd=fresh.cwd,
                             env=fresh.env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
    try:
        # The torch adapter (it imports horovod.torch) from the environment, on its own torch.
        found = fresh.python_json(
            "import json, hvd_scale.adapters.torch as t, torch\n"
            "print(json.dumps({'adapter': t.__file__, 'torch': torch.__file__}))")
        started = time.monotonic()
        output = check.communicate(timeout=STEP_TIMEOUT_S)[0]
        print(f"[{time.monotonic() - started:5.1f} s more] hvd-scale check -> {check.returncode}")
    finally:
        if check.poll() is None:
            check.kill()
            check.wait()
    fresh.assert_inside({"adapter": found["adapter"]})
    assert fresh.site_packages.resolve() not in Path(found["torch"]).resolve().parents
    assert check.returncode == 0, _tail(output)
    assert "horovod[PyTorch]: built" in output, _tail(output)
    assert _horovod_files() == before, "this environment's Horovod was changed"


# ---------------------------------------------------------------------------------------------
# A DDP environment: what `pip install '.[torch]'` alone brings, no Horovod; then '.[torch,plot]'.
# Its site-packages view holds the distributions the wheel's requirements (with the extras)
# name, transitively, and pip: a module the package imports but does not declare is missing
# here, as it would be in a user's new environment.

DDP_EXTRAS = ("torch",)
DDP_STEPS = 30  # examples/ddp_after.py's steps: enough timed steps for `hvd-scale advise`


def _wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.HeaderParser().parsestr(z.read(meta_name).decode())
    return meta.get_all("Requires-Dist", [])


def _closure(requirements: list[str], extras: tuple[str, ...]) -> list:
    """The installed distributions that ``requirements`` (with ``extras``) need, transitively.
    A requirement not installed here fails the test: pip would need an index for it."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, object] = {}
    todo = [(r, e) for r in requirements for e in ("", *extras)]
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name in found:
            continue
        try:
            found[name] = dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.fail(f"{req.name} (required: {text}) is not installed here")
        todo += [(r, e) for r in dist.requires or [] for e in ("", *sorted(req.extras))]
    return list(found.values())


def _link_distributions(view: Path, dists) -> list[str]:
    """Link each distribution's top-level entries (its RECORD's) into view; their names."""
    linked = []
    for dist in dists:
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops - {"__pycache__"}):
            if not (view / top).exists() and (base / top).exists():
                (view / top).symlink_to(base / top)
                linked.append(top)
    return linked


@pytest.fixture(scope="module")
def ddp_env(workdir, wheel) -> Fresh:
    import importlib.metadata as md

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("pip") is None:
        if _required():
            pytest.fail(f"torch or pip is not importable from {sys.executable} (run `make setup`)")
        pytest.skip("this environment has no torch or pip for a DDP environment")
    env = Fresh(workdir / "ddp-env", None)
    out = run([sys.executable, "-m", "venv", "--without-pip", env.root], hermetic_env(), workdir)
    assert out.returncode == 0, _tail(out.stdout)
    env.site_packages = Path(env.python_json(
        "import json, sysconfig; print(json.dumps(sysconfig.get_path('purelib')))"))
    env.view = workdir / "ddp-site-packages"
    env.view.mkdir()
    _link_distributions(env.view, [md.distribution("pip"),
                                   *_closure(_wheel_requirements(wheel), DDP_EXTRAS)])
    (env.site_packages / "ddp_environment.pth").write_text(f"{env.view}\n")
    out = env.run(env.python, "-m", "pip", "install", "--no-index",
                  f"{wheel}[{','.join(DDP_EXTRAS)}]")
    assert out.returncode == 0, f"pip install failed:\n{_tail(out.stdout)}"
    done = [line for line in out.stdout.splitlines() if line.startswith("Successfully installed")]
    assert done == [f"Successfully installed hvd-scale-{VERSION}"], _tail(out.stdout)
    return env


def test_a_ddp_environment_has_no_horovod_and_check_says_torchrun_is_ready(ddp_env):
    """`hvd-scale check` without Horovod: exit 0, torchrun ready, Horovod what it would add."""
    out = ddp_env.run("hvd-scale", "check")
    assert out.returncode == 0, _tail(out.stdout)
    assert "torchrun engine: ready (torch.distributed" in out.stdout, _tail(out.stdout)
    assert "horovod is not installed: DDP scripts run without it" in out.stdout, out.stdout
    assert "hvd-scale build-horovod" in out.stdout, out.stdout
    out = ddp_env.run("hvd-scale", "check", "--engine", "horovodrun")
    assert out.returncode == 1 and "horovod is not importable" in out.stdout, _tail(out.stdout)


@pytest.fixture(scope="module")
def ddp_log(ddp_env) -> Path:
    """docs' DDP command in the DDP environment: `hvd-scale run --engine torchrun -np 2` of
    examples/ddp_after.py (copied beside the venv), with a metrics log."""
    script = ddp_env.cwd / "ddp_after.py"
    shutil.copy2(REPO_ROOT / "examples" / "ddp_after.py", script)
    log_dir = ddp_env.cwd / "ddp-log"
    out = ddp_env.run("hvd-scale", "run", "--engine", "torchrun", "-np", "2", "--policy",
                      "adascale", "--log-dir", log_dir, "--", "python", script, "--steps",
                      DDP_STEPS)
    assert out.returncode == 0, _tail(out.stdout)
    assert f"adascale at S = 2: {DDP_STEPS} steps" in out.stdout, _tail(out.stdout)
    return log_dir


def test_the_torchrun_engine_runs_and_records_the_workers_on_the_host(ddp_env, ddp_log):
    """The job runs (psutil, which the launcher uses to stop a job, is a requirement of
    hvd-scale, not Horovod's alone), and run.json says the 2 workers shared the host
    (torchrun's LOCAL_WORLD_SIZE), so advise does not take the log for an old one."""
    info = json.loads((ddp_log / "run.json").read_text())
    assert info["workers"] == 2 and info["workers_on_host"] == 2, info
    out = ddp_env.run("hvd-scale", "advise", ddp_log)
    assert out.returncode == 0, _tail(out.stdout)
    assert "recorded workers_on_host" not in out.stdout, _tail(out.stdout)
    assert "2 workers on" in out.stdout, _tail(out.stdout)


def test_plot_without_its_extra_names_it_then_runs_with_it(ddp_env, ddp_log, wheel):
    png = ddp_env.cwd / "ddp.png"
    out = ddp_env.run("hvd-scale", "plot", ddp_log, "-o", png)
    assert out.returncode == 2, _tail(out.stdout)
    assert out.stdout.strip() == ("hvd-scale plot: matplotlib is not installed: "
                                  "pip install 'hvd-scale[plot]'"), _tail(out.stdout)
    out = ddp_env.run("hvd-scale", "advise", ddp_log, "--plot", png)
    assert out.returncode == 2 and out.stdout.strip().endswith("'hvd-scale[plot]'"), out.stdout
    # The plot extra, as a user installs it: what it names comes into the environment.
    _link_distributions(ddp_env.view,
                        _closure(_wheel_requirements(wheel), (*DDP_EXTRAS, "plot")))
    out = ddp_env.run(ddp_env.python, "-m", "pip", "install", "--no-index",
                      f"{wheel}[{','.join((*DDP_EXTRAS, 'plot'))}]")
    assert out.returncode == 0, _tail(out.stdout)
    out = ddp_env.run("hvd-scale", "plot", ddp_log, "-o", png)
    assert out.returncode == 0, _tail(out.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = ddp_env.run("hvd-scale", "advise", ddp_log, "--plot", ddp_env.cwd / "eff.png")
    assert out.returncode == 0 and (ddp_env.cwd / "eff.png").is_file(), _tail(out.stdout)


# ---------------------------------------------------------------------------------------------
# `hvd-scale check` in an environment of one framework (in-process, Horovod faked)

def _fake_horovod(monkeypatch, broken: set[str] = frozenset()):
    import types

    for name in ("horovod", "horovod.common", "horovod.common.util"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name in ("horovod.torch", "horovod.tensorflow"):
        if name in broken:  # import fails: an extension built without it, or mismatched
            monkeypatch.setitem(sys.modules, name, None)
            continue
        module = types.ModuleType(name)
        module.mpi_built = module.gloo_built = lambda: True
        module.nccl_built = lambda: 0
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("installed_frameworks, broken, code, says", [
    ({"torch"}, {"horovod.tensorflow"}, 0, "horovod[TensorFlow]: not checked (tensorflow is not"),
    ({"tensorflow"}, {"horovod.torch"}, 0, "horovod[PyTorch]: not checked (torch is not"),
    ({"torch", "tensorflow"}, {"horovod.tensorflow"}, 1, "horovod[TensorFlow]: NOT usable"),
    (set(), set(), 1, "neither torch nor tensorflow is installed"),
])
def test_check_counts_only_the_installed_frameworks(monkeypatch, capsys, installed_frameworks,
                                                     broken, code, says):
    """A torch-only environment (`pip install .` beside torch, Horovod built without TensorFlow)
    passes `hvd-scale check --engine horovodrun`; a framework that is installed and whose
    Horovod library does not load fails it, with the hint naming build-horovod."""
    from hvd_scale.launch import cli

    _fake_horovod(monkeypatch, broken)
    monkeypatch.setattr(cli, "_importable", lambda module: module in installed_frameworks)
    assert cli.main(["check", "--engine", "horovodrun"]) == code
    out = capsys.readouterr().out
    assert says in out, out
    assert ("horovodrun engine: ready" in out) == (code == 0), out
    if "NOT usable" in says:
        assert "hvd-scale build-horovod" in out, out


@pytest.mark.parametrize("torch_ready, horovod, argv, code, says", [
    # A DDP environment: torch.distributed, no Horovod. Horovod is what it would add, no error.
    (True, False, ["check"], 0, "horovod is not installed: DDP scripts run without it"),
    (True, False, ["check", "--engine", "torchrun"], 0, "torchrun engine: ready"),
    (True, False, ["check", "--engine", "horovodrun"], 1, "horovod is not importable"),
    (True, False, ["check", "--engine", "ray"], 1, "ray engine: NOT usable (needs Horovod"),
    # Neither: nothing to run with.
    (False, False, ["check"], 1, "no engine is usable here"),
    # Horovod alone (a TensorFlow environment): usable, torchrun is not.
    (False, True, ["check"], 0, "horovodrun engine: ready"),
    (False, True, ["check", "--engine", "torchrun"], 1, "the torchrun engine is not usable here"),
])
def test_check_says_per_engine_what_is_ready(monkeypatch, capsys, torch_ready, horovod, argv,
                                             code, says):
    from hvd_scale.launch import cli

    if horovod:
        _fake_horovod(monkeypatch)
        monkeypatch.setattr(cli, "_importable", lambda module: module == "tensorflow")
    else:
        monkeypatch.setitem(sys.modules, "horovod", None)
    monkeypatch.setattr(cli, "_torch_distributed", lambda: (
        (True, "torch.distributed 2: Gloo True") if torch_ready else
        (False, "torch is not installed: pip install 'hvd-scale[torch]'")))
    assert cli.main(argv) == code
    out = capsys.readouterr().out
    assert says in out, out
    if not horovod and "--engine" not in argv or argv[-1] == "horovodrun":
        assert "hvd-scale build-horovod" in out, out  # what to do to get Horovod
    if torch_ready and argv == ["check"]:
        assert "torchrun engine: ready" in out and "horovodrun engine: NOT usable" in out, out
