"""Build (once) and install the patched Horovod 0.28.1 for the Python environment this runs in.

    python -m hvd_scale.launch.build_horovod          # or: hvd-scale build-horovod
    python launch/build_horovod.py --without tensorflow

Horovod 0.28.1 ships no wheels, and its sdist does not build against torch >= 2.1 or TensorFlow
2.21 as it is. This detects the Python, torch and TensorFlow of the environment, downloads the
sdist (checked against a pinned sha256), applies launch/horovod_build_fix.py, builds the wheel with
`pip wheel --no-build-isolation` (Horovod's CMake must see the installed torch) and caches it in
``$HVD_SCALE_CACHE/wheels/<KEY>/`` (default ``~/.cache/hvd_scale``), where KEY names what the
wheel was built against:

    horovod-0.28.1-torch-2.13.0-tf-2.21.0-py311-fix-dfaf58c223c8

(``none`` in a framework's slot when it is left out; ``-nompi``, ``-gloo17`` (torch without
TensorFlow: one more edit, see TORCH_ONLY_EDITS), ``-cuda12.6`` or ``-gpuops-nccl`` appended for
what that format cannot tell apart.) A later run with the same KEY only installs the
cached wheel; when it is already installed (recorded in ``<venv>/.horovod-key``) it does nothing.

launch/setup_env.sh runs this file with the new venv's Python before the project itself is
installed, once pip has put filelock and packaging (pyproject.toml's dependencies) there; both are
imported where they are used, so the module imports, and ``--help`` runs, on the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from packaging.version import Version

HOROVOD_VERSION = "0.28.1"
HOROVOD_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
FIX_SCRIPT = Path(__file__).resolve().parent / "horovod_build_fix.py"
CACHE_ENV = "HVD_SCALE_CACHE"
KEY_FILE = ".horovod-key"  # in the venv's prefix, as launch/setup_env.sh has always written it
NONE = "none"  # the key's slot for a framework the wheel is built without

# Distributions that provide each framework, in the order they are looked for.
FRAMEWORK_DISTS = {
    "torch": ("torch",),
    "tensorflow": ("tensorflow-cpu", "tensorflow", "tensorflow-gpu"),
}
FRAMEWORK_NAMES = {"torch": "PyTorch", "tensorflow": "TensorFlow", "mpi": "MPI"}
ALIASES = {"torch": "torch", "pytorch": "torch", "tensorflow": "tensorflow", "tf": "tensorflow",
           "mpi": "mpi"}
# What the build fix was written and tested for; other versions in the supported range get a note.
TESTED = {"torch": "2.13", "tensorflow": "2.21"}
# (lowest supported, first unsupported): Horovod 0.28.1's own minimums; a new major is unknown API.
SUPPORTED = {"torch": ((1, 5), (3, 0)), "tensorflow": ((1, 15), (3, 0))}
# Horovod's CMake reads these: they are always set by this script, whatever the caller exported.
CONTROLLED_FLAGS = re.compile(r"HOROVOD_WITH(OUT)?_(PYTORCH|TENSORFLOW|MXNET|GLOO|MPI)")
# Checked (and pip-installed when missing) before a build: --no-build-isolation uses the env's own.
BUILD_REQUIREMENTS = {"setuptools": "setuptools>=68", "wheel": "wheel", "packaging": "packaging"}
CMAKE_MIN = "3.13"

# Edits of our own for builds without TensorFlow, made after horovod_build_fix.py (whose sha256 is
# in every key) and in the same way: each old text must be there exactly once. Builds that get
# them carry the suffix in their key; rename it whenever an edit here changes.
TORCH_ONLY_SUFFIX = "gloo17"
TORCH_ONLY_EDITS = [
    (
        "CMakeLists.txt",
        "    target_compile_definitions(gloo PRIVATE _GLIBCXX_USE_CXX11_ABI=1)\n",
        "    target_compile_definitions(gloo PRIVATE _GLIBCXX_USE_CXX11_ABI=1)\n"
        "    # hvd_scale fix (builds without TensorFlow): the C++17 torch library links this Gloo,\n"
        "    # there being no C++17 copy (compatible17_gloo) without TensorFlow. Compiled as C++14,\n"
        "    # its store.cc defines gloo::rendezvous::Store::kDefaultTimeout out of line, and the\n"
        "    # link fails with 'multiple definition' of it. As C++17 that line defines nothing.\n"
        "    set_target_properties(gloo PROPERTIES CXX_STANDARD 17)\n",
        "compile Gloo as C++17 for the torch library when TensorFlow is not built",
    ),
]

DESCRIPTION = ("Build the patched Horovod 0.28.1 wheel for this Python environment's Python, torch "
               "and TensorFlow (once: the wheel is cached), then install it.")
EPILOG = f"""\
Frameworks are detected from the installed distributions (torch; tensorflow-cpu or tensorflow).
Gloo is always built; MPI when mpicxx is on PATH. The wheel is cached in
${CACHE_ENV}/wheels/KEY/ (default ~/.cache/hvd_scale), KEY naming the Horovod, torch, TensorFlow
and Python versions and the build fix, for example
  horovod-{HOROVOD_VERSION}-torch-2.13.0-tf-2.21.0-py311-fix-dfaf58c223c8
so a second environment with the same versions only installs it. A build needs a C++ compiler,
Python's headers and cmake >= 3.13 (pip-installed into the environment when missing) and takes
about 10 minutes on 2 cores.

examples:
  hvd-scale build-horovod                          # what is installed, with MPI if found
  hvd-scale build-horovod --without tensorflow     # a torch-only Horovod
  hvd-scale build-horovod --no-install --wheel-dir dist/   # a wheel for a cluster image
"""


class BuildError(Exception):
    """A clear reason to stop; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def log(message: str) -> None:
    print(f"[build-horovod {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# What the environment has

# Runs in the target interpreter: versions from importlib.metadata (no framework is imported,
# except torch when its version does not say whether it is a CPU build).
PROBE = r"""
import importlib.metadata as m, json, os, sys, sysconfig
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
names = sys.argv[1].split(",")
out = {
    "python": "%d.%d.%d" % sys.version_info[:3],
    "executable": sys.executable,
    "prefix": sys.prefix,
    "base_prefix": sys.base_prefix,
    "scripts": sysconfig.get_path("scripts"),
    "python_h": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    "dists": {n: v(n) for n in names},
}
torch_v = out["dists"].get("torch")
out["torch_cuda"] = out["torch_hip"] = None
if torch_v and "+cpu" not in torch_v:
    try:
        import torch
        out["torch_cuda"] = torch.version.cuda
        out["torch_hip"] = getattr(torch.version, "hip", None)
    except Exception as e:
        out["torch_error"] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
"""
PROBED_DISTS = sorted({d for dists in FRAMEWORK_DISTS.values() for d in dists}
                      | {"horovod", "pip", "cmake", *BUILD_REQUIREMENTS})


@dataclass
class Environment:
    """What the target interpreter has (``dists``: distribution name -> version or None)."""

    python: str  # the interpreter to build for and install into, as given
    python_version: str  # "3.11.7"
    prefix: str
    base_prefix: str
    scripts: str
    python_h: bool
    dists: dict[str, str | None]
    torch_cuda: str | None = None
    torch_hip: str | None = None
    torch_error: str | None = None

    @property
    def py_tag(self) -> str:
        major, minor = self.python_version.split(".")[:2]
        return f"py{major}{minor}"

    @property
    def is_venv(self) -> bool:
        """A virtual or conda environment: the place for the key record."""
        prefix = Path(self.prefix)
        return (self.prefix != self.base_prefix or (prefix / "pyvenv.cfg").exists()
                or (prefix / "conda-meta").is_dir())

    def framework(self, name: str) -> tuple[str, str] | None:
        """(distribution, version) providing framework ``name``, or None."""
        for dist in FRAMEWORK_DISTS[name]:
            version = self.dists.get(dist)
            if version:
                return dist, version
        return None


def probe(python: str) -> Environment:
    try:
        out = subprocess.run([python, "-c", PROBE, ",".join(PROBED_DISTS)], capture_output=True,
                             text=True, check=False)
    except OSError as e:
        raise BuildError(f"cannot run the Python interpreter {python!r}: {e}") from None
    if out.returncode != 0:
        raise BuildError(f"probing {python} failed:\n{out.stderr.strip()}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return Environment(python=python, python_version=info["python"], prefix=info["prefix"],
                       base_prefix=info["base_prefix"], scripts=info["scripts"],
                       python_h=info["python_h"], dists=info["dists"],
                       torch_cuda=info.get("torch_cuda"), torch_hip=info.get("torch_hip"),
                       torch_error=info.get("torch_error"))


# ---------------------------------------------------------------------------------------------
# What to build

@dataclass
class Plan:
    """The frameworks, controllers and flags of one build, and its cache key."""

    torch: str | None  # version built against (local part dropped), None when left out
    tensorflow: str | None
    tensorflow_dist: str | None
    mpi: bool
    mpicxx: str | None
    key: str
    flags: dict[str, str]
    notes: list[str] = field(default_factory=list)


def parse_frameworks(values: Sequence[str] | None, option: str) -> set[str]:
    """``["torch,tensorflow", "mpi"]`` -> {"torch", "tensorflow", "mpi"}; unknown names exit 2."""
    chosen: set[str] = set()
    for value in values or ():
        for item in value.split(","):
            item = item.strip().lower()
            if not item:
                continue
            if item not in ALIASES:
                raise BuildError(f"{option}: unknown {item!r}: choose from torch, tensorflow, mpi",
                                 code=2)
            chosen.add(ALIASES[item])
    return chosen


def _major_minor(version: str) -> tuple[int, int]:
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        raise BuildError(f"cannot read the version {version!r}") from None
    return (release + (0,))[:2]


def check_supported(framework: str, version: str) -> str | None:
    """Raise for a version Horovod 0.28.1 cannot build for; return a note for an untested one."""
    low, high = SUPPORTED[framework]
    mm = _major_minor(version)
    name = FRAMEWORK_NAMES[framework]
    if not low <= mm < high:
        raise BuildError(
            f"{name} {version} is not supported: Horovod {HOROVOD_VERSION} with the build fix "
            f"builds for {name} {low[0]}.{low[1]} up to (not including) {high[0]}.{high[1]} "
            f"(tested with {TESTED[framework]}); install a supported version or pass "
            f"--without {framework}")
    if f"{mm[0]}.{mm[1]}" != TESTED[framework]:
        return (f"{name} {version}: the build fix was tested with {name} {TESTED[framework]}; "
                f"other versions may need another fix")
    return None


def cache_key(torch: str | None, tensorflow: str | None, py_tag: str, fix_sha: str,
              suffixes: Sequence[str] = ()) -> str:
    """launch/setup_env.sh's key: horovod-V-torch-T-tf-TF-pyXY-fix-SHA12 (+ -suffix...)."""
    key = (f"horovod-{HOROVOD_VERSION}-torch-{torch or NONE}-tf-{tensorflow or NONE}-{py_tag}"
           f"-fix-{fix_sha[:12]}")
    return key + "".join(f"-{s}" for s in suffixes)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def which(program: str, env: Environment | None = None, path: str | None = None) -> str | None:
    """``program`` on PATH, the environment's own scripts directory first."""
    search = path if path is not None else os.environ.get("PATH", "")
    if env is not None:
        search = env.scripts + os.pathsep + search
    return shutil.which(program, path=search)


def make_plan(env: Environment, with_: set[str], without: set[str],
              path: str | None = None, environ: dict[str, str] | None = None) -> Plan:
    """Decide what to build from what is installed and --with/--without."""
    environ = os.environ if environ is None else environ
    both = with_ & without
    if both:
        raise BuildError(f"both --with and --without name {', '.join(sorted(both))}", code=2)
    notes: list[str] = []
    versions: dict[str, str | None] = {}
    dists: dict[str, str | None] = {}
    for fw in ("torch", "tensorflow"):
        found = env.framework(fw)
        if fw in without:
            versions[fw] = dists[fw] = None
            continue
        if found is None:
            if fw in with_:
                dists_ = " or ".join(FRAMEWORK_DISTS[fw])
                raise BuildError(f"--with {fw}: {FRAMEWORK_NAMES[fw]} is not installed in "
                                 f"{env.python} (no {dists_} distribution)")
            versions[fw] = dists[fw] = None
            continue
        dist, version = found
        note = check_supported(fw, version)
        if note:
            notes.append(note)
        versions[fw] = version.split("+")[0]
        dists[fw] = dist
    if versions["torch"] is None and versions["tensorflow"] is None:
        raise BuildError("nothing to build Horovod for: neither torch nor TensorFlow "
                         "(tensorflow-cpu or tensorflow) is installed in "
                         f"{env.python}, or both are left out")
    mpicxx = which("mpicxx", env, path)
    if "mpi" in without:
        mpi = False
    elif mpicxx:
        mpi = True
    elif "mpi" in with_:
        raise BuildError("--with mpi: mpicxx is not on PATH (Debian: apt-get install "
                         "libopenmpi-dev openmpi-bin)")
    else:
        mpi = False
        notes.append("mpicxx not found: building without MPI (Gloo only; Debian: apt-get install "
                     "libopenmpi-dev openmpi-bin for MPI)")

    flags = {"HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_MXNET": "1"}
    flags["HOROVOD_WITH_PYTORCH" if versions["torch"] else "HOROVOD_WITHOUT_PYTORCH"] = "1"
    flags["HOROVOD_WITH_TENSORFLOW" if versions["tensorflow"] else "HOROVOD_WITHOUT_TENSORFLOW"] = "1"
    flags["HOROVOD_WITH_MPI" if mpi else "HOROVOD_WITHOUT_MPI"] = "1"

    # The key keeps setup_env.sh's format; what that format cannot tell apart is appended.
    suffixes = []
    if not mpi:
        suffixes.append("nompi")
    if versions["torch"] and not versions["tensorflow"]:
        suffixes.append(TORCH_ONLY_SUFFIX)
    if versions["torch"] and env.torch_cuda:
        suffixes.append(f"cuda{env.torch_cuda}")
    if versions["torch"] and env.torch_hip:
        suffixes.append(f"rocm{env.torch_hip.split('-')[0]}")
    gpu_ops = environ.get("HOROVOD_GPU_OPERATIONS") or environ.get("HOROVOD_GPU_ALLREDUCE")
    if gpu_ops:
        suffixes.append(f"gpuops-{gpu_ops.lower()}")
    key = cache_key(versions["torch"], versions["tensorflow"], env.py_tag,
                    sha256_file(FIX_SCRIPT), suffixes)
    return Plan(torch=versions["torch"], tensorflow=versions["tensorflow"],
                tensorflow_dist=dists["tensorflow"], mpi=mpi, mpicxx=mpicxx if mpi else None,
                key=key, flags=flags, notes=notes)


def build_environ(plan: Plan, env: Environment, jobs: int,
                  base: dict[str, str] | None = None) -> dict[str, str]:
    """The build's environment: the caller's, less any HOROVOD_WITH(OUT)_* of theirs, plus ours."""
    base = dict(os.environ if base is None else base)
    out = {k: v for k, v in base.items() if not CONTROLLED_FLAGS.fullmatch(k)}
    out.update(plan.flags)
    out["MAKEFLAGS"] = f"-j{jobs}"
    out["PATH"] = env.scripts + os.pathsep + base.get("PATH", "")
    return out


# ---------------------------------------------------------------------------------------------
# The cache

def cache_root(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hvd_scale").expanduser()


def cached_wheel(wheel_dir: Path) -> Path | None:
    """The newest Horovod HOROVOD_VERSION wheel in ``wheel_dir``, by its file name."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import Version

    def is_ours(wheel: Path) -> bool:
        try:
            name, version, _, _ = parse_wheel_filename(wheel.name)
        except InvalidWheelFilename:
            return False
        return name == "horovod" and version == Version(HOROVOD_VERSION)

    wheels = sorted((w for w in wheel_dir.glob("*.whl") if is_ours(w)),
                    key=lambda p: p.stat().st_mtime)
    return wheels[-1] if wheels else None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One build per key at a time (two set-ups on one machine wait for each other)."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"another build holds {path}: waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


# ---------------------------------------------------------------------------------------------
# The build

def pip(env: Environment, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([env.python, "-m", "pip", "--disable-pip-version-check", *args],
                          **kwargs)


def check_toolchain(env: Environment, path: str | None = None,
                    environ: dict[str, str] | None = None) -> list[str]:
    """Raise when the C/C++ compiler or Python's headers are missing; return what cmake needs
    pip-installed (empty when a cmake >= 3.13 is on PATH)."""
    environ = os.environ if environ is None else environ
    search = path if path is not None else environ.get("PATH", "")
    missing = []
    cxx = environ.get("CXX") or next((c for c in ("c++", "g++", "clang++")
                                      if shutil.which(c, path=search)), None)
    cc = environ.get("CC") or next((c for c in ("cc", "gcc", "clang")
                                    if shutil.which(c, path=search)), None)
    if not cxx or not cc:
        missing.append("a C and C++ compiler (Debian: apt-get install build-essential)")
    if not env.python_h:
        major_minor = ".".join(env.python_version.split(".")[:2])
        missing.append(f"Python {major_minor}'s headers, Python.h (Debian: apt-get install "
                       f"python{major_minor}-dev)")
    if missing:
        raise BuildError("cannot build Horovod: missing " + "; ".join(missing))
    if env.torch_error:
        raise BuildError(f"torch is installed but does not import: {env.torch_error}")
    if (env.torch_cuda or env.torch_hip) and not (
            which("nvcc", env, search) or which("hipcc", env, search)):
        kind = f"CUDA {env.torch_cuda}" if env.torch_cuda else f"ROCm {env.torch_hip}"
        raise BuildError(f"torch {env.dists.get('torch')} is a {kind} build, so Horovod builds "
                         f"its GPU code, but no nvcc/hipcc is on PATH: install the toolkit, or "
                         f"a CPU build of torch, or pass --without torch")
    from packaging.version import Version

    cmake = which("cmake", env, search)
    if cmake and cmake_version(cmake) >= Version(CMAKE_MIN):
        return []
    return [f"cmake>={CMAKE_MIN}"]


def cmake_version(cmake: str) -> Version:
    """The version ``cmake --version`` prints first ("cmake version 3.25.1"); 0 if unreadable."""
    from packaging.version import InvalidVersion, Version

    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return Version("0")
    first = next(iter(out.splitlines()), "")
    try:
        return Version(first.partition("version")[2].strip())
    except InvalidVersion:
        return Version("0")


def verify_sdist(path: Path) -> None:
    got = sha256_file(path)
    if got != HOROVOD_SHA256:
        raise BuildError(
            f"sha256 mismatch for {path}:\n  expected {HOROVOD_SHA256} (horovod-{HOROVOD_VERSION}"
            f".tar.gz as published)\n  got      {got}\nrefusing to build from it")


def obtain_sdist(env: Environment, cache: Path, workdir: Path, sdist: str | None) -> Path:
    """The checked sdist: --sdist, else the cached copy, else downloaded with pip."""
    name = f"horovod-{HOROVOD_VERSION}.tar.gz"
    if sdist:
        path = Path(sdist).expanduser()
        if not path.is_file():
            raise BuildError(f"--sdist {sdist}: no such file")
        verify_sdist(path)
        log(f"sdist {path}: sha256 checked")
        return path
    cached = cache / "sdist" / name
    if cached.is_file():
        try:
            verify_sdist(cached)
            log(f"sdist {cached}: cached, sha256 checked")
            return cached
        except BuildError:
            log(f"cached {cached} has the wrong sha256: removing it, downloading again")
            cached.unlink()
    log(f"downloading horovod=={HOROVOD_VERSION} (sdist) with pip")
    download = workdir / "download"
    out = pip(env, "download", "-q", "--no-deps", "--no-binary", ":all:",
              f"horovod=={HOROVOD_VERSION}", "-d", str(download),
              capture_output=True, text=True)
    path = download / name
    if out.returncode != 0 or not path.is_file():
        raise BuildError(f"pip could not download horovod=={HOROVOD_VERSION}:\n"
                         f"{(out.stdout + out.stderr).strip()}")
    verify_sdist(path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".part")
    shutil.copyfile(path, tmp)
    tmp.replace(cached)
    log(f"sdist sha256 checked, kept in {cached}")
    return cached


def extract(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.10.12 / 3.11.4
            tar.extractall(dest)
    source = dest / f"horovod-{HOROVOD_VERSION}"
    if not (source / "setup.py").is_file():
        raise BuildError(f"{sdist} does not unpack to horovod-{HOROVOD_VERSION}/setup.py")
    return source


def apply_edits(source: Path, edits: list[tuple[str, str, str, str]]) -> list[str]:
    """horovod_build_fix.py's patch loop: each old text must be there exactly once."""
    spec = importlib.util.spec_from_file_location("_hvd_scale_build_fix", FIX_SCRIPT)
    fix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fix)
    try:
        return fix.apply_edits(source, edits)
    except ValueError as e:
        raise BuildError(str(e)) from None


def run_logged(cmd: list[str], logfile: Path, env: dict[str, str], cwd: Path,
               what: str, every: float = 120.0) -> int:
    """Run ``cmd`` with its output in ``logfile``, saying every ``every`` s that it still runs."""
    start = time.monotonic()
    with open(logfile, "w") as out:
        # Its own process group, so that an interrupt stops pip, cmake, make and the compilers.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            next_note = start + every
            while proc.poll() is None:
                time.sleep(1.0)
                if time.monotonic() >= next_note:
                    log(f"{what}: still running ({(time.monotonic() - start) / 60:.0f} min)")
                    next_note += every
        except KeyboardInterrupt:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    return proc.returncode


def build_wheel(env: Environment, plan: Plan, args: argparse.Namespace, cache: Path,
                target_dir: Path) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="hvd_scale_horovod_build_"))
    try:
        sdist = obtain_sdist(env, cache, workdir, args.sdist)  # a bad sdist stops here, first
        need = check_toolchain(env)
        need += [req for dist, req in BUILD_REQUIREMENTS.items() if not env.dists.get(dist)]
        if need:
            log(f"installing the build requirements into {env.prefix}: {' '.join(need)}")
            out = pip(env, "install", "-q", *need)
            if out.returncode != 0:
                raise BuildError(f"pip could not install {' '.join(need)}")
        source = extract(sdist, workdir)
        fix = subprocess.run([env.python, str(FIX_SCRIPT), str(source)], capture_output=True,
                             text=True)
        if fix.returncode != 0:
            raise BuildError(f"{FIX_SCRIPT.name} failed:\n{(fix.stdout + fix.stderr).strip()}")
        for line in fix.stdout.strip().splitlines():
            log(f"build fix: {line}")
        if plan.torch and not plan.tensorflow:
            for line in apply_edits(source, TORCH_ONLY_EDITS):
                log(f"build fix (without TensorFlow): {line}")
        wheel_out = workdir / "wheel"
        logfile = workdir / "build.log"
        flags = " ".join(f"{k}=1" for k in sorted(plan.flags))
        log(f"building the wheel with {flags}, -j{args.jobs} (about 10 minutes on 2 cores; "
            f"log: {logfile})")
        started = time.monotonic()
        code = run_logged([env.python, "-m", "pip", "--disable-pip-version-check", "wheel", "-v",
                           "--no-build-isolation", "--no-deps", "-w", str(wheel_out), "."],
                          logfile, build_environ(plan, env, args.jobs), source, "build")
        if code != 0:
            kept = cache / "logs" / f"{plan.key}.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(logfile, kept)
            tail = logfile.read_text(errors="replace").splitlines()[-50:]
            print("\n".join(tail), file=sys.stderr)
            raise BuildError(f"the Horovod build failed (exit {code}); the whole log is in {kept}")
        wheels = list(wheel_out.glob("horovod-*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"the build made {len(wheels)} Horovod wheels in {wheel_out}")
        log(f"built {wheels[0].name} in {time.monotonic() - started:.0f} s")
        target_dir.mkdir(parents=True, exist_ok=True)
        for old in target_dir.glob("horovod-*.whl"):
            old.unlink()
        tmp = target_dir / (wheels[0].name + ".part")
        shutil.copyfile(wheels[0], tmp)
        final = target_dir / wheels[0].name
        tmp.replace(final)
        log(f"cached {final}")
        return final
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The install

def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional dependencies (distribution names)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    requirements = [Requirement(r) for r in
                    email.parser.HeaderParser().parsestr(text).get_all("Requires-Dist", [])]
    return [r.name for r in requirements if r.marker is None]


def installed_key(env: Environment) -> str | None:
    if not env.is_venv or env.dists.get("horovod") != HOROVOD_VERSION:
        return None
    try:
        return (Path(env.prefix) / KEY_FILE).read_text().strip()
    except OSError:
        return None


def install(env: Environment, wheel: Path, key: str) -> None:
    log(f"installing {wheel.name} into {env.prefix}")
    out = pip(env, "install", "-q", "--no-deps", "--force-reinstall", str(wheel))
    if out.returncode != 0:
        raise BuildError(f"pip could not install {wheel}")
    missing = missing_dists(env, wheel_requirements(wheel))
    if missing:
        # Horovod itself is now installed at this version: pip only adds what is missing.
        log(f"installing Horovod's dependencies: {' '.join(missing)}")
        if pip(env, "install", "-q", str(wheel)).returncode != 0:
            raise BuildError(f"pip could not install Horovod's dependencies {missing}")
    if env.is_venv:
        (Path(env.prefix) / KEY_FILE).write_text(key + "\n")


def missing_dists(env: Environment, names: Sequence[str]) -> list[str]:
    """Those of ``names`` not installed in the environment."""
    code = ("import importlib.metadata as m, sys\n"
            "for n in sys.argv[1:]:\n"
            "    try: m.version(n)\n"
            "    except m.PackageNotFoundError: print(n)")
    out = subprocess.run([env.python, "-c", code, *names], capture_output=True, text=True)
    return out.stdout.split()


# ---------------------------------------------------------------------------------------------
# The command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--with", dest="with_", action="append", metavar="LIST", default=[],
        help="Comma-separated frameworks the wheel must include: torch, tensorflow, mpi. "
             "Fails when one is not installed (mpi: when mpicxx is not on PATH). By default each "
             "installed framework is included, and MPI when mpicxx is found.")
    parser.add_argument(
        "--without", action="append", metavar="LIST", default=[],
        help="Comma-separated frameworks to leave out even when installed: torch, tensorflow, "
             "mpi (the key then says none, or -nompi).")
    parser.add_argument(
        "--python", default=sys.executable, metavar="PYTHON",
        help="The environment to build for and install into, by its interpreter "
             "(default: the one running this).")
    parser.add_argument(
        "--install", action=argparse.BooleanOptionalAction, default=True,
        help="Install the wheel into the environment (default). With --no-install, only build "
             "or find the cached wheel.")
    parser.add_argument(
        "--wheel-dir", metavar="DIR", default=None,
        help="Also copy the wheel into DIR (for a cluster image or another machine).")
    parser.add_argument(
        "--force-rebuild", action="store_true",
        help="Build even when a wheel is cached for this key (it replaces the cached one), and "
             "reinstall.")
    parser.add_argument(
        "--cache-dir", metavar="DIR", default=None,
        help=f"Where wheels and the sdist are cached (default: ${CACHE_ENV}, else "
             "~/.cache/hvd_scale); wheels go to DIR/wheels/KEY/.")
    parser.add_argument(
        "--sdist", metavar="FILE", default=None,
        help=f"Build from this horovod-{HOROVOD_VERSION}.tar.gz instead of downloading it (its "
             "sha256 is checked all the same).")
    parser.add_argument(
        "-j", "--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
        help="Parallel compile jobs (default: the number of cores).")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="Say what was detected, the cache key and what would be done, and change nothing.")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    # A SIGTERM (a killed job, a timeout) stops the build and removes its directory, as Ctrl-C does.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args)
    except BuildError as e:
        print(f"build-horovod: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("build-horovod: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    with_ = parse_frameworks(args.with_, "--with")
    without = parse_frameworks(args.without, "--without")
    if args.jobs < 1:
        raise BuildError(f"--jobs must be >= 1, got {args.jobs}", code=2)
    env = probe(args.python)
    log(f"Python {env.python_version} ({env.python}, environment {env.prefix})")
    plan = make_plan(env, with_, without)
    for fw, version, dist in (("torch", plan.torch, "torch"),
                              ("tensorflow", plan.tensorflow, plan.tensorflow_dist)):
        found = env.framework(fw)
        name = FRAMEWORK_NAMES[fw]
        if version:
            log(f"{name}: {dist} {env.dists[dist]}: building with {name}")
        elif found:
            log(f"{name}: {found[0]} {found[1]} installed, left out (--without {fw})")
        else:
            log(f"{name}: not installed: building without {name}")
    log(f"MPI: {'mpicxx at ' + plan.mpicxx + ': building with MPI' if plan.mpi else 'no'}; "
        "Gloo: yes")
    for note in plan.notes:
        log(f"note: {note}")
    cache = cache_root(args.cache_dir)
    target_dir = cache / "wheels" / plan.key
    log(f"cache key {plan.key}")
    wheel = None if args.force_rebuild else cached_wheel(target_dir)

    if args.dry_run:
        flags = " ".join(f"{k}=1" for k in sorted(plan.flags))
        if wheel:
            log(f"dry run: would use the cached {wheel}")
        else:
            log(f"dry run: would build with {flags} into {target_dir}/")
        if args.install:
            state = ("already installed: nothing to install"
                     if installed_key(env) == plan.key and not args.force_rebuild
                     else f"would install it into {env.prefix}")
            log(f"dry run: {state}")
        if args.wheel_dir:
            log(f"dry run: would copy the wheel into {args.wheel_dir}")
        return 0

    up_to_date = args.install and not args.force_rebuild and installed_key(env) == plan.key
    if up_to_date and not args.wheel_dir:
        log(f"Horovod {HOROVOD_VERSION} for {plan.key} is already installed: nothing to do")
        return 0

    if wheel is None:
        with locked(cache / "locks" / f"{plan.key}.lock"):
            wheel = None if args.force_rebuild else cached_wheel(target_dir)
            if wheel is None:
                log(f"no cached wheel for this key: building it")
                wheel = build_wheel(env, plan, args, cache, target_dir)
            else:
                log(f"another process built {wheel}")
    else:
        log(f"cached wheel: {wheel}")

    if args.wheel_dir:
        out_dir = Path(args.wheel_dir).expanduser()
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheel, out_dir / wheel.name)
        log(f"copied {wheel.name} to {out_dir}/")
    if up_to_date:
        log(f"Horovod {HOROVOD_VERSION} for {plan.key} is already installed")
    elif args.install:
        install(env, wheel, plan.key)
        log(f"Horovod {HOROVOD_VERSION} installed ({plan.key})")
    return 0


def build_parser(prog: str = "hvd-scale build-horovod") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
