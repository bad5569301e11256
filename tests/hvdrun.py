"""Run real multi-process Horovod jobs from tests, and read back what each rank reported.

    from hvdrun import run_horovod, worker_results, requires_horovod

    @requires_horovod
    @pytest.mark.timeout(180)
    def test_something():
        proc = run_horovod([sys.executable, str(WORKERS / "my_worker.py"), "--steps", "3"], np=2)
        results = worker_results(proc, np=2)     # one dict per rank, sorted by rank

Worker convention: each rank prints one line ``RESULT {json}`` to stdout, the JSON object holding
at least ``"rank"``. Workers under tests/workers/ use ``from _report import emit_result`` (the
script's folder is on sys.path), which writes it with hvd_scale.launch.jobs.print_result.
horovodrun prefixes every worker line (``[0]<stdout>:`` under Gloo, ``[1,0]<stdout>:`` under MPI,
where OpenMPI tags chunks, not lines, so a long line can be cut by another rank's output);
``worker_results`` reads them with hvd_scale.launch.jobs.read_results, which reassembles each
rank's stdout first. A worker may use another tag (``worker_results(proc, tag="METRICS")``) for a
second kind of line. The command line is hvd_scale.launch.jobs.horovodrun_command's, as the
launcher's.

Every run has a wall-clock limit. On time-out, or when the test itself is interrupted (e.g. by
pytest-timeout), horovodrun and every process below it are killed, so no worker outlives the test.
A failed or timed-out job raises AssertionError carrying the tail of its stdout and stderr.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pytest

from hvd_scale.launch import jobs
from hvd_scale.launch.jobs import demux_output  # noqa: F401  (tests import it from here)

TESTS_DIR = Path(__file__).resolve().parent
WORKERS_DIR = TESTS_DIR / "workers"
REPO_ROOT = TESTS_DIR.parent

# The venv's bin/ (not resolved: .venv/bin/python is a link to the base interpreter).
BIN_DIR = Path(sys.executable).parent
HOROVODRUN = BIN_DIR / "horovodrun"
# What the tests start jobs with, as `hvd-scale run` does (jobs.find_horovodrun): horovodrun with
# its build check asked of torch before TensorFlow (hvd_scale/launch/horovodrun.py).
LAUNCHER = BIN_DIR / jobs.LAUNCHER_SCRIPT

DEFAULT_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}

# Set (as `make test` does) where Horovod must be present: then `requires_horovod` never skips,
# and a missing Horovod fails the tests loudly instead of skipping them.
REQUIRE_ENV_VAR = "HVD_SCALE_REQUIRE_HOROVOD"

TAIL_CHARS = 6000


def horovod_missing_reason() -> str | None:
    """Why Horovod jobs cannot run here, or None when they can."""
    if importlib.util.find_spec("horovod") is None:
        return f"horovod is not importable from {sys.executable} (run `make setup`)"
    for path in (HOROVODRUN, LAUNCHER):
        if not path.exists():
            return f"{path.name} not found at {path} (run `make setup`)"
    return None


def _horovod_required() -> bool:
    return os.environ.get(REQUIRE_ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


_MISSING = horovod_missing_reason()

# Skips only when Horovod is absent AND not required; when it is present the test always runs.
requires_horovod = pytest.mark.skipif(
    _MISSING is not None and not _horovod_required(),
    reason=f"Horovod unavailable: {_MISSING}",
)


def worker_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the workers get: ours, the defaults above, then `env` on top."""
    out = dict(os.environ)
    out.update(DEFAULT_WORKER_ENV)
    # Workers (and horovodrun's own `python` look-ups) see the venv first.
    out["PATH"] = str(BIN_DIR) + os.pathsep + out.get("PATH", "")
    if env:
        out.update({k: str(v) for k, v in env.items()})
    return out


def horovodrun_command(
    args: Sequence[str],
    np: int = 2,
    controller: str = "gloo",
    hosts: str | bool | None = None,
    hvd_args: Iterable[str] = (),
) -> list[str]:
    """horovodrun for the tests: LAUNCHER, a controller always (gloo or mpi), -H localhost:np
    unless hosts says otherwise (False: none, e.g. elastic jobs with discovery scripts)."""
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', not {controller!r}")
    return jobs.horovodrun_command(args, np, hosts=hosts, controller=controller,
                                   extra_args=hvd_args, executable=LAUNCHER)


def _tail(text: str | bytes | None, n: int = TAIL_CHARS) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text if len(text) <= n else "...[truncated]...\n" + text[-n:]


def _describe(cmd: Sequence[str], what: str, stdout: Any, stderr: Any) -> str:
    return (
        f"{what}\ncommand: {' '.join(map(str, cmd))}\n"
        f"----- stdout (tail) -----\n{_tail(stdout)}\n"
        f"----- stderr (tail) -----\n{_tail(stderr)}"
    )


def _descendants(pid: int) -> list[int]:
    try:
        import psutil  # a Horovod dependency; optional here
    except ImportError:
        return []
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill horovodrun, its process group and every descendant (some start their own session)."""
    pids = _descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the group id is horovodrun's pid
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + 5
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)


def run_horovod(
    args: Sequence[str],
    np: int = 2,
    controller: str = "gloo",
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
    hosts: str | bool | None = None,
    hvd_args: Iterable[str] = (),
) -> subprocess.CompletedProcess:
    """Run `args` on `np` local Horovod processes through horovodrun, capture its output.

    controller: "gloo" (horovodrun --gloo) or "mpi" (horovodrun --mpi; as root horovodrun adds
    OpenMPI's --allow-run-as-root itself). hvd_args: extra horovodrun flags (e.g.
    ["--timeline-filename", path]); hosts: the -H value (default localhost:np, False to omit).
    Raises AssertionError, with the output tails, on time-out and (if check) on a non-zero exit.
    """
    missing = horovod_missing_reason()
    if missing:
        raise AssertionError(missing)
    cmd = horovodrun_command(args, np=np, controller=controller, hosts=hosts, hvd_args=hvd_args)
    return run_process(cmd, timeout=timeout, env=worker_env(env), cwd=cwd, check=check,
                       what="Horovod job")


TORCHRUN = BIN_DIR / "torchrun"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a torchrun rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(args: Sequence[str], nproc: int = 2, timeout: float = 120,
                 env: Mapping[str, str] | None = None, torchrun_args: Iterable[str] = (),
                 check: bool = True) -> subprocess.CompletedProcess:
    """Run ``args`` (a script and its arguments) on ``nproc`` local torch.distributed processes
    through torchrun (a standalone rendezvous on 127.0.0.1), capturing their output. Each rank's
    stdout and stderr go to a file of its own (torchrun's --redirects), read back rank by rank
    into the result's stdout and stderr, so that two ranks' long lines never interleave."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hvd_scale_torchrun_") as logs:
        cmd = [TORCHRUN, f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--redirects=3", f"--log-dir={logs}",
               *torchrun_args, *args]
        proc = run_process(cmd, timeout=timeout, env=worker_env(env), check=False,
                           what="torchrun job")
        streams = {"stdout": [proc.stdout or ""], "stderr": [proc.stderr or ""]}
        for path in sorted(Path(logs).rglob("*.log"), key=lambda p: (len(p.parts), str(p))):
            if path.stem in streams:
                streams[path.stem].append(path.read_text(errors="replace"))
    result = subprocess.CompletedProcess(proc.args, proc.returncode, "".join(streams["stdout"]),
                                         "".join(streams["stderr"]))
    if check and result.returncode != 0:
        raise AssertionError(_describe(proc.args, f"torchrun job failed with exit code "
                                       f"{result.returncode}", result.stdout, result.stderr))
    return result


def run_process(cmd: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike | None = None, check: bool = True,
                what: str = "command") -> subprocess.CompletedProcess:
    """Run cmd in a session of its own with a wall-clock limit, capturing its output. On
    time-out, interruption (pytest-timeout) or a failure with check, its whole process tree is
    killed (a rank may outlive a failed launcher) and AssertionError carries the output tails."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else worker_env(),
        cwd=str(cwd) if cwd is not None else str(REPO_ROOT),
        start_new_session=True,
        text=True,
        errors="replace",
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            _describe(cmd, f"{what} timed out after {timeout} s (process tree killed)",
                      stdout, stderr)
        ) from None
    except BaseException:  # pytest-timeout, KeyboardInterrupt: leave no workers behind
        _kill_tree(proc)
        proc.communicate()
        raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and result.returncode != 0:
        _kill_tree(proc)
        raise AssertionError(
            _describe(cmd, f"{what} failed with exit code {result.returncode}", stdout, stderr)
        )
    return result


def worker_results(
    proc: subprocess.CompletedProcess | str,
    np: int | None = None,
    tag: str = jobs.RESULT_TAG,
) -> list[dict]:
    """Parse the workers' ``<tag> {json}`` lines; a list of dicts sorted by their "rank".

    With `np`, asserts exactly one line per rank 0..np-1. Without it, every line is returned
    (a rank may report several), in a stable order: by rank, then by order of appearance.
    """
    text = proc if isinstance(proc, str) else (proc.stdout or "")
    try:
        found = jobs.read_results(text, tag)
    except ValueError as e:
        raise AssertionError(str(e)) from None
    for payload in found:
        if "rank" not in payload:
            raise AssertionError(f"{tag} line without a 'rank' field: {tag} {payload}")
    results = sorted(found, key=lambda p: p["rank"])  # stable: a rank's lines stay in order
    if np is not None:
        ranks = [r["rank"] for r in results]
        if ranks != list(range(np)):
            stderr = "" if isinstance(proc, str) else proc.stderr
            raise AssertionError(
                _describe(getattr(proc, "args", ["?"]),
                          f"expected one {tag} line from each of ranks 0..{np - 1}, got ranks {ranks}",
                          text, stderr)
            )
    return results



def run_cases(worker: Path, np: int, timeout: float, test_dir: Path,
              single: Sequence[str] = (), single_timeout: float = 180, cases: Sequence[str] = (),
              env: Mapping[str, str] | None = None) -> dict[str, dict[int, dict]]:
    """A case worker (tests/workers/*_adapter_worker.py): its `cases` (default: its default
    cases) in one horovodrun job of np ranks, then each case in `single` as one plain process
    (e.g. resuming the job's checkpoint with another layout). Both see HVD_SCALE_TEST_DIR=test_dir
    and `env`. Every report carries "case" and "rank"; returns {case: {rank: report}}."""
    env = {**(env or {}), "HVD_SCALE_TEST_DIR": str(test_dir)}
    reports = worker_results(run_horovod([sys.executable, str(worker), *cases], np=np,
                                         timeout=timeout, env=env))
    for case in single:
        proc = subprocess.run([sys.executable, str(worker), case], capture_output=True, text=True,
                              timeout=single_timeout, env=worker_env(env))
        if proc.returncode != 0:
            raise AssertionError(_describe(proc.args, f"case {case} exited {proc.returncode}",
                                           proc.stdout, proc.stderr))
        reports += worker_results(proc.stdout)
    by_case: dict[str, dict[int, dict]] = {}
    for r in reports:
        by_case.setdefault(r["case"], {})[r["rank"]] = r
    return by_case


def per_rank(results: Mapping[str, Mapping[int, dict]], case: str, np: int) -> list[dict]:
    """The reports of `case` from ranks 0..np-1, in rank order; every rank must have reported."""
    ranks = results.get(case, {})
    assert sorted(ranks) == list(range(np)), f"{case}: reports from ranks {sorted(ranks)}"
    return [ranks[r] for r in range(np)]
