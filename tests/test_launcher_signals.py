"""Stopping the launcher stops the job (issue #22, item 2): SIGINT, SIGTERM or SIGHUP to the
driver alone (what a job manager or Popen.terminate() sends) goes on to every process of the job,
which gets STOP_TIMEOUT_S to exit before the rest is killed; the driver exits with 128 + signum.

Real `hvd-scale run -np 2` jobs under Gloo and MPI; the Ray/Spark code path (ranks that
command_worker starts under cluster processes) with a stand-in engine whose "cluster workers" are
plain processes; the bounded wait with a process tree that ignores SIGTERM. Every test kills
whatever it started, also when it fails. Nothing here uses the network beyond horovodrun's
localhost rendezvous.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_scale.launch import engines
from hvdrun import REPO_ROOT, requires_horovod, worker_env

psutil = pytest.importorskip("psutil")  # a Horovod dependency

HVD_SCALE = Path(sys.executable).parent / "hvd-scale"
START_S = 120  # for the job's ranks to be up (2 shared cores)
# The driver's bound: the job's STOP_TIMEOUT_S (10), SIGKILL's wait (2) and slack for a loaded
# machine (a literal, so that this module imports on a launcher without them; checked below).
DRIVER_EXIT_S = 30
GONE_S = 5  # after the driver exits, for the kernel to finish off what it killed

# A rank: writes its pid to the directory it is given, then prints a line per step until stopped.
RANK = """\
import os, sys, time
with open(os.path.join(sys.argv[1], str(os.getpid())), "w"):
    pass
step = 0
while True:
    print("step", step, flush=True)
    step += 1
    time.sleep(0.2)
"""


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(procs) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return "; ".join(out)


def _survivors(procs, wait_s: float) -> list:
    deadline = time.monotonic() + wait_s
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _kill_everything(procs) -> None:
    """SIGKILL procs and their descendants (cleanup: the test may have failed half-way)."""
    every = list(procs)
    for p in procs:
        try:
            every += p.children(recursive=True)
        except psutil.Error:
            pass
    for p in every:
        try:
            p.kill()
        except psutil.Error:
            pass


def _wait_for_pid_files(pid_dir: Path, n: int, driver: subprocess.Popen, log: Path) -> list:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        names = os.listdir(pid_dir)
        if len(names) >= n:
            return [psutil.Process(int(name)) for name in names]
        assert driver.poll() is None, f"the driver exited {driver.returncode}:\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start within {START_S} s:\n{log.read_text()}")


def _stop_and_check(driver: subprocess.Popen, job: list, signum: int, log: Path) -> None:
    """Signal the driver's PID alone; the driver must exit with 128 + signum within its bound
    and no process of the job may survive it."""
    started = time.monotonic()
    os.kill(driver.pid, signum)
    try:
        driver.wait(timeout=DRIVER_EXIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the driver still runs {DRIVER_EXIT_S} s after "
                             f"{signal.Signals(signum).name}:\n{log.read_text()}") from None
    took = time.monotonic() - started
    left = _survivors(job, GONE_S)
    assert not left, (f"{len(left)} of the job's {len(job)} processes survived the driver "
                      f"(exit {driver.returncode} after {took:.2f} s): {_describe(left)}")
    assert driver.returncode == 128 + signum, (driver.returncode, log.read_text())
    assert f"the job was stopped by {signal.Signals(signum).name}" in log.read_text()
    # #32: Ctrl-C reaches the ranks as SIGTERM (as horovodrun's does): no traceback per rank.
    assert "KeyboardInterrupt" not in log.read_text(), log.read_text()


@requires_horovod
@pytest.mark.timeout(START_S + DRIVER_EXIT_S + 60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_signal_to_the_driver_stops_the_whole_job(tmp_path, controller, signum):
    script, pid_dir, log = tmp_path / "rank.py", tmp_path / "pids", tmp_path / "driver.log"
    script.write_text(RANK)
    pid_dir.mkdir()
    job: list = []
    with open(log, "w") as out:
        # A session of its own, as a job manager starts it; the signal goes to its PID only.
        driver = subprocess.Popen(
            [str(HVD_SCALE), "run", "-np", "2", f"--{controller}", "--", sys.executable,
             str(script), str(pid_dir)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            env=worker_env(), start_new_session=True)
    try:
        ranks = _wait_for_pid_files(pid_dir, 2, driver, log)
        # horovodrun, mpirun or Gloo's per-rank shells, and the ranks: all of it must go.
        job = psutil.Process(driver.pid).children(recursive=True)
        job += [r for r in ranks if r.pid not in {p.pid for p in job}]
        assert len(job) > 2, _describe(job)
        _stop_and_check(driver, job, signum, log)
    finally:
        if driver.poll() is None:
            driver.kill()
        _kill_everything(job)
        driver.wait()


# The Ray/Spark code path: engines.run_command with an engine whose run() starts one plain
# process per "cluster worker", each calling command_worker as a Ray actor or Spark task does,
# with SIGINT blocked as in Ray's processes. The ranks trap SIGTERM and SIGINT (leaving a file),
# so the test sees that the signal reached them.
CLUSTER_DRIVER = """\
import os, subprocess, sys
from hvd_scale.launch import engines

WORKER = ("import json, os, signal, sys; from hvd_scale.launch.engines import command_worker; "
          "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
          "print(json.dumps(command_worker(json.loads(sys.argv[1]), {}, None)))")
out_dir = sys.argv[1]


class ProcessEngine:
    name = "processes"

    def start(self, job):
        pass

    def run(self, fn, args, job):
        assert fn is engines.command_worker
        import json
        workers = [subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(args[0])],
                                    env=dict(os.environ, HOROVOD_RANK=str(r)),
                                    stdout=subprocess.PIPE, text=True) for r in range(job.np)]
        return [json.loads(w.communicate()[0]) for w in workers]

    def run_command(self, command, job):
        return engines.command_via_workers(self, command, job)

    def shutdown(self):
        open(os.path.join(out_dir, "shutdown"), "w").close()


rank = ("import os, signal, sys, time\\n"
        "out = sys.argv[1]\\n"
        "def stop(signum, frame):\\n"
        "    open(os.path.join(out, 'stopped-%d' % os.getpid()), 'w').close()\\n"
        "    sys.exit(0)\\n"
        "signal.signal(signal.SIGTERM, stop)\\n"
        "signal.signal(signal.SIGINT, stop)\\n"
        "open(os.path.join(out, 'pids', str(os.getpid())), 'w').close()\\n"
        "while True:\\n"
        "    time.sleep(0.1)\\n")
try:
    sys.exit(engines.run_command([sys.executable, "-c", rank, out_dir], np=2,
                                 engine=ProcessEngine()))
except engines.JobStopped as e:
    print(f"hvd-scale run: the job was {e}", file=sys.stderr)
    sys.exit(e.exit_code)
"""


@pytest.mark.timeout(START_S + DRIVER_EXIT_S + 60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_cluster_engines_ranks_get_the_signal_and_the_engine_shuts_down(tmp_path, signum):
    script, log = tmp_path / "driver.py", tmp_path / "driver.log"
    script.write_text(CLUSTER_DRIVER)
    (tmp_path / "pids").mkdir()
    job: list = []
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  cwd=REPO_ROOT, env=worker_env(), start_new_session=True)
    try:
        ranks = _wait_for_pid_files(tmp_path / "pids", 2, driver, log)
        job = psutil.Process(driver.pid).children(recursive=True)
        assert {r.pid for r in ranks} <= {p.pid for p in job}, _describe(job)
        _stop_and_check(driver, job, signum, log)
        assert sorted(f.name for f in tmp_path.glob("stopped-*")) == \
            sorted(f"stopped-{r.pid}" for r in ranks)  # each rank got the signal itself
        assert (tmp_path / "shutdown").exists()
    finally:
        if driver.poll() is None:
            driver.kill()
        _kill_everything(job)
        driver.wait()


@pytest.mark.timeout(60)
def test_what_ignores_the_signal_is_killed_after_the_bounded_wait(monkeypatch):
    """A child and a grandchild in a session of its own (as Gloo's per-rank shells are), both
    ignoring SIGTERM: stop_processes waits STOP_TIMEOUT_S, then SIGKILLs both."""
    assert DRIVER_EXIT_S >= engines.STOP_TIMEOUT_S + engines.KILL_WAIT_S + 15
    monkeypatch.setattr(engines, "STOP_TIMEOUT_S", 1)
    stubborn = ("import os, signal, subprocess, sys, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
                "start_new_session=True) if len(sys.argv) > 1 else None; time.sleep(300)")
    child = subprocess.Popen([sys.executable, "-c", stubborn, "parent"])
    job = [psutil.Process(child.pid)]
    try:
        deadline = time.monotonic() + 30
        while len(job) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            job = [job[0], *job[0].children()]
        assert len(job) == 2, "the grandchild did not start"
        started = time.monotonic()
        engines.stop_processes(signal.SIGTERM, job[:1])
        took = time.monotonic() - started
        assert not _survivors(job, 0), _describe(job)
        assert 1 <= took < 1 + engines.KILL_WAIT_S + 2, took
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        _kill_everything(job)
        child.wait()


class _SignalsItself:
    """An engine whose job is over at once: the driver gets `signum` while it "runs"."""

    name = "signals-itself"

    def __init__(self, signum):
        self.signum, self.calls = signum, []

    def start(self, job):
        self.calls.append("start")

    def run(self, fn, args, job):
        raise AssertionError("not used")

    def run_command(self, command, job):
        self.calls.append("run_command")
        os.kill(os.getpid(), self.signum)
        time.sleep(5)  # the handler raises JobStopped here
        self.calls.append("not stopped")
        return 0

    def shutdown(self):
        self.calls.append("shutdown")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_run_command_raises_job_stopped_and_restores_the_handlers(signum):
    got = []
    # Ours while the test runs: a run_command that installs no handler of its own would leave
    # the signal to this one (and the test fails) rather than to the default, which ends pytest.
    previous = signal.signal(signum, lambda s, f: got.append(s))
    try:
        engine = _SignalsItself(signum)
        with pytest.raises(engines.JobStopped) as e:
            engines.run_command(["true"], np=2, engine=engine)
        assert e.value.exit_code == 128 + signum and e.value.signum == signum
        assert engine.calls == ["start", "run_command", "shutdown"] and got == []
        os.kill(os.getpid(), signum)  # the test's handler is back
        time.sleep(0.1)
        assert got == [signum]
    finally:
        signal.signal(signum, previous)


class _TakesTheSignal(_SignalsItself):
    """Like horovod.spark's launch_gloo: sets a SIGTERM handler of its own, which ends the job
    as a failure."""

    def run_command(self, command, job):
        self.calls.append("run_command")
        took = []
        signal.signal(signal.SIGTERM, lambda s, f: took.append(s))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        raise RuntimeError(f"a rank exited with {128 + took[0]}")


@pytest.mark.timeout(60)
def test_a_stop_signal_that_another_handler_took_still_stops_the_job():
    got = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        engine = _TakesTheSignal(signal.SIGTERM)
        with pytest.raises(engines.JobStopped) as e:
            engines.run_command(["true"], np=2, engine=engine)
        assert e.value.exit_code == 143
        assert engine.calls == ["start", "run_command", "shutdown"] and got == []
        os.kill(os.getpid(), signal.SIGTERM)  # the test's handler is back
        time.sleep(0.1)
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
