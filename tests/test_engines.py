"""Launch engines (launch/engines.py): the protocol with a toy engine, the CLI's choices and errors,
and real Ray and Spark jobs.

The network rule (../shared/reference/multihost.md): Ray and Spark bind the machine's own address
unless confined, so every Ray or Spark job here runs as a subprocess inside a loopback-only network
namespace (`unshare -n`, loopback up), under a wall-clock limit that kills its whole process tree.
Those tests skip only where such a namespace cannot be made (not root, no unshare); a missing ray or
pyspark fails them when HVD_SCALE_REQUIRE_HOROVOD is set, and skips them otherwise.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hvd_scale.launch import cli, engines
from hvdrun import (REPO_ROOT, WORKERS_DIR, _horovod_required, requires_horovod, run_process,
                    worker_env, worker_results)

HVD_SCALE = Path(sys.executable).parent / "hvd-scale"
MNIST = ["examples/torch_mnist1d.py", "--budget", "200", "--samples", "2000", "--log-every", "0"]


# ---------------------------------------------------------------------------------------------
# The protocol, with a toy engine that only records what it is asked (no Ray, no Spark).

class ToyEngine:
    """Implements engines.Engine in memory: `np` "workers" are calls in this process, each with
    HOROVOD_RANK set as a real engine's worker has it."""

    name = "toy"

    def __init__(self, fail_in_run: bool = False, fail_in_start: bool = False, **options):
        self.calls: list[tuple] = []
        self.options = options
        self.fail_in_run, self.fail_in_start = fail_in_run, fail_in_start

    def start(self, job):
        self.calls.append(("start", job))
        if self.fail_in_start:
            raise engines.EngineUnavailable("no cluster")

    def run(self, fn, args, job):
        self.calls.append(("run", fn, tuple(args), job))
        if self.fail_in_run:
            raise RuntimeError("a worker died")
        results = []
        for rank in range(job.np or job.max_np):
            saved = dict(os.environ)
            os.environ.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(job.np))
            try:
                results.append(fn(*args))
            finally:
                os.environ.clear()
                os.environ.update(saved)
        return results

    def run_command(self, command, job):
        self.calls.append(("run_command", list(command), job))
        return engines.command_via_workers(self, command, job)

    def shutdown(self):
        self.calls.append(("shutdown",))


def test_toy_engine_implements_the_protocol():
    assert isinstance(ToyEngine(), engines.Engine)
    for cls in engines.ENGINES.values():
        assert {"start", "run", "run_command", "shutdown"} <= set(dir(cls)), cls


def test_run_calls_start_run_shutdown_with_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "0.5")  # the user's own value wins
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    toy = ToyEngine()
    results = engines.run(lambda x: (x, int(os.environ["HOROVOD_RANK"])), args=(7,), np=3,
                          engine=toy, policy="sqrt", log_dir=tmp_path / "logs")
    assert results == [(7, 0), (7, 1), (7, 2)]
    assert [c[0] for c in toy.calls] == ["start", "run", "shutdown"]
    job = toy.calls[0][1]
    assert job.np == 3 and not job.elastic and toy.calls[1][3] is job
    assert dict(job.env) == {"HVD_SCALE_POLICY": "sqrt",
                             "HVD_SCALE_LOG_DIR": str(tmp_path / "logs"),
                             "OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "0.5",
                             "TF_CPP_MIN_LOG_LEVEL": "2"}
    assert (tmp_path / "logs").is_dir()


def test_the_cpu_cycle_default_stays_off_gpu_machines(tmp_path, monkeypatch):
    """The 5 ms cycle was measured on CPUs: a driver with a GPU device file gets only the thread
    default; the user's own value wins either way."""
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    device = tmp_path / "nvidiactl"
    monkeypatch.setattr(engines, "GPU_DEVICE_FILES", (str(device),))
    # TensorFlow's notices off (#32 item 6: horovodrun's build check printed them in torch jobs).
    assert engines.worker_env() == {"OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "5",
                                    "TF_CPP_MIN_LOG_LEVEL": "2"}
    device.touch()
    assert engines.driver_has_gpu()
    assert engines.worker_env() == {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    assert engines.worker_env()["TF_CPP_MIN_LOG_LEVEL"] == "0"  # the user's own value wins
    assert engines.worker_env(gpu=False)["HOROVOD_CYCLE_TIME"] == "5"
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2")
    assert engines.worker_env(gpu=False)["HOROVOD_CYCLE_TIME"] == "2"


def test_shutdown_follows_a_failed_run_or_start():
    toy = ToyEngine(fail_in_run=True)
    with pytest.raises(RuntimeError, match="a worker died"):
        engines.run(print, np=2, engine=toy)
    assert [c[0] for c in toy.calls] == ["start", "run", "shutdown"]
    toy = ToyEngine(fail_in_start=True)
    with pytest.raises(engines.EngineUnavailable, match="no cluster"):
        engines.run_command(["true"], engine=toy)
    assert [c[0] for c in toy.calls] == ["start", "shutdown"]


def test_bad_job_fails_before_the_engine_starts():
    toy = ToyEngine()
    with pytest.raises(ValueError, match="'linaer'"):
        engines.run(print, engine=toy, policy="linaer")
    with pytest.raises(ValueError, match="min_np must be <= max_np"):
        engines.run(print, engine=toy, min_np=3, max_np=2)
    with pytest.raises(ValueError, match="needs min_np"):
        engines.run(print, engine=toy, max_np=2)
    with pytest.raises(ValueError, match="np must be an integer >= 1"):
        engines.run(print, engine=toy, np=0)
    with pytest.raises(ValueError, match="unknown engine 'dask'; choose one of horovodrun, ray"):
        engines.run(print, engine="dask")
    with pytest.raises(TypeError, match="implement Engine"):
        engines.run(print, engine=object())
    assert toy.calls == []


def test_elastic_job_and_default_np():
    assert engines.make_job().np == engines.DEFAULT_NP == 2
    job = engines.make_job(min_np=1, max_np=2)
    assert job.elastic and job.np is None and (job.min_np, job.max_np) == (1, 2)


def test_command_runs_in_every_worker_with_its_environment(capfd):
    """The shared command path: each worker's child sees the worker's HOROVOD_* variables and the
    job's env; output comes back tagged by rank; the exit status is the first failure's."""
    script = ("import os, sys; print('rank', os.environ['HOROVOD_RANK'], "
              "os.environ['HVD_SCALE_POLICY'], os.getcwd()); "
              "sys.exit(3 if os.environ['HOROVOD_RANK'] == '1' else 0)")
    toy = ToyEngine()
    code = engines.run_command([sys.executable, "-c", script], np=2, engine=toy, policy="linear")
    out = capfd.readouterr().out
    assert code == 3
    assert f"[0]<stdout>:rank 0 linear {os.getcwd()}" in out.splitlines()
    assert f"[1]<stdout>:rank 1 linear {os.getcwd()}" in out.splitlines()
    assert [c[0] for c in toy.calls] == ["start", "run_command", "run", "shutdown"]


def test_report_tags_lines_like_horovodrun_so_worker_results_parse_them():
    out, err = io.StringIO(), io.StringIO()
    status = engines.report([
        {"rank": 1, "returncode": 0, "stdout": 'RESULT {"rank": 1}\n', "stderr": "warn\n"},
        {"rank": 0, "returncode": -9, "stdout": 'x\nRESULT {"rank": 0}\n', "stderr": ""},
    ], out=out, err=err)
    assert status == 137  # killed by SIGKILL, as a shell reports it
    assert [r["rank"] for r in worker_results(out.getvalue(), np=2)] == [0, 1]
    assert err.getvalue() == "[1]<stderr>:warn\n"


# ---------------------------------------------------------------------------------------------
# The CLI: engine choice, options and bad combinations (the engine replaced by a toy).

@pytest.fixture
def toy_engines(monkeypatch):
    made: list[ToyEngine] = []

    def factory(**options):
        made.append(ToyEngine(**options))
        return made[-1]

    for name in engines.ENGINES:
        monkeypatch.setitem(engines.ENGINES, name, factory)
    return made


def test_cli_hands_ray_and_spark_options_to_their_engines(toy_engines, tmp_path, capfd):
    cmd = [sys.executable, "-c", "print('hi')"]
    assert cli.main(["run", "--engine", "ray", "-np", "2", "--ray-address", "auto",
                     "--policy", "linear", "--log-dir", str(tmp_path), "--", *cmd]) == 0
    assert cli.main(["run", "--engine", "spark", "-np", "2", "--spark-master", "local[2]",
                     "--", *cmd]) == 0
    assert cli.main(["run", "--engine", "ray", "--min-np", "1", "--max-np", "2", "--", *cmd]) == 0
    ray, spark, elastic = toy_engines
    assert ray.options == {"address": "auto"} and spark.options == {"master": "local[2]"}
    job = ray.calls[0][1]
    assert job.np == 2 and job.env["HVD_SCALE_POLICY"] == "linear"
    assert job.env["HVD_SCALE_LOG_DIR"] == str(tmp_path)
    job = elastic.calls[0][1]
    assert (job.np, job.min_np, job.max_np) == (None, 1, 2)
    assert capfd.readouterr().out.count("[1]<stdout>:hi") == 3  # three jobs of two "workers"


def test_cli_defaults_to_horovodrun_and_passes_elastic_bounds(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "_horovodrun", lambda: "/x/horovodrun")
    monkeypatch.setattr(engines, "run_stoppable", lambda cmd, env: seen.setdefault("cmd", cmd) and 0)
    assert cli.main(["run", "--min-np", "1", "--max-np", "2", "--host-discovery-script", "d.sh",
                     "--", "python", "t.py"]) == 0
    # -np: where the elastic job starts (--min-np; horovodrun requires it, #48 item 1).
    assert seen["cmd"] == ["/x/horovodrun", "-np", "1", "--min-np", "1", "--max-np", "2",
                           "--host-discovery-script", "d.sh", sys.executable, "t.py"]


@pytest.mark.parametrize("argv, message", [
    (["--engine", "ray", "--spark-master", "local[2]"], "--spark-master is for --engine spark"),
    (["--engine", "spark", "--ray-address", "auto"], "--ray-address is for --engine ray"),
    (["--ray-address", "auto"], "--ray-address is for --engine ray, not --engine horovodrun"),
    (["--engine", "spark", "--min-np", "1", "--max-np", "2"], "--min-np is for --engine"),
    (["--engine", "ray", "--gloo"], "--gloo/--mpi is for --engine horovodrun"),
    (["--engine", "spark", "-H", "a:1,b:1"], "-H/--hosts is for --engine horovodrun"),
    (["--engine", "ray", "--timeline-filename", "t.json"],
     "unrecognized arguments for --engine ray: --timeline-filename t.json"),
    (["--engine", "ray", "--max-np", "2"], "--max-np needs --min-np"),
    (["--engine", "ray", "--min-np", "3", "--max-np", "2"], "--min-np 3 is above --max-np 2"),
    (["--engine", "ray", "-np", "2", "--min-np", "1"], "-np does not go with --min-np"),
])
def test_cli_rejects_bad_combinations(toy_engines, capsys, argv, message):
    assert cli.main(["run", *argv, "--", "true"]) == 2
    assert message in capsys.readouterr().err
    assert toy_engines == []


def test_cli_rejects_engine_none_and_bad_bounds(capsys):
    for argv in (["--engine", "dask"], ["--min-np", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["run", *argv, "--", "true"])
        assert e.value.code == 2


@pytest.mark.parametrize("engine, modules, hint", [
    ("ray", ("ray",), "pip install 'hvd-scale[ray]'"),
    ("spark", ("pyspark", "pyspark.sql"), "pip install 'hvd-scale[spark]'"),
])
def test_cli_names_the_missing_package(monkeypatch, capsys, engine, modules, hint):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import` raises ImportError
    assert cli.main(["run", "--engine", engine, "--", "true"]) == 127
    err = capsys.readouterr().err
    assert f"the {engine} engine needs" in err and hint in err


def test_missing_horovodrun_is_engine_unavailable(monkeypatch):
    monkeypatch.setattr(engines, "find_horovodrun", lambda: None)
    with pytest.raises(engines.EngineUnavailable, match="make setup"):
        engines.run_command(["true"], engine="horovodrun")


def test_cli_reports_an_engine_failure(monkeypatch, capsys):
    monkeypatch.setitem(engines.ENGINES, "spark", lambda **o: ToyEngine(fail_in_run=True))
    assert cli.main(["run", "--engine", "spark", "-np", "2", "--", "true"]) == 1
    assert "the spark job failed: RuntimeError: a worker died" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Real Ray and Spark jobs, each in a loopback-only network namespace.

def _namespace_problem() -> str | None:
    if os.geteuid() != 0:
        return "a network namespace needs root"
    if not (shutil.which("unshare") and shutil.which("ip")):
        return "unshare or ip (iproute2) is missing"
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -n failed: {probe.stderr.strip()}"
    return None


NAMESPACE_PROBLEM = _namespace_problem()
requires_loopback_namespace = pytest.mark.skipif(
    NAMESPACE_PROBLEM is not None, reason=f"no loopback-only namespace: {NAMESPACE_PROBLEM}")


def need(module: str, install: str) -> None:
    """Skip without `module`, or fail when HVD_SCALE_REQUIRE_HOROVOD says it must be here."""
    if importlib.util.find_spec(module) is None:
        message = f"{module} is not importable from {sys.executable}: {install}"
        if _horovod_required():
            pytest.fail(f"{message} (HVD_SCALE_REQUIRE_HOROVOD is set)")
        pytest.skip(message)


@pytest.fixture
def confined(tmp_path):
    """Run a command in a fresh loopback-only network namespace, TMPDIR a short private
    directory; afterwards no process may remain that names that directory, and it is removed."""
    temp = tempfile.mkdtemp(prefix="hvdt-")  # short: Ray's Unix socket paths live below it

    def run(args, timeout: float, env=None) -> subprocess.CompletedProcess:
        cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', *map(str, args)]
        return run_process(cmd, timeout=timeout, cwd=REPO_ROOT,
                           env=worker_env({"TMPDIR": temp, "HVD_SCALE_TEST_DIR": str(tmp_path),
                                           **(env or {})}))

    yield run
    leftovers = _processes_naming(temp)
    for pid in leftovers:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    left_files = sorted(os.listdir(temp))
    shutil.rmtree(temp, ignore_errors=True)
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not [f for f in left_files if f.startswith(("hvdray-", "hvdspark-", "hvdcl-"))], \
        f"temporary directories left behind: {left_files}"


def _processes_naming(text: str, wait_s: float = 10) -> list[int]:
    """Processes whose command line contains `text` or whose TMPDIR is `text`, after up to
    wait_s for them to exit."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for p in psutil.process_iter(["pid", "cmdline", "environ"]):
            try:
                cmdline = " ".join(p.info["cmdline"] or [])
                env = p.info["environ"] or {}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if text in cmdline or env.get("TMPDIR") == text:
                found.append(p.info["pid"])
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _assert_equal_training(results, np: int = 2):
    assert [r["rank"] for r in results] == list(range(np))
    assert {r["workers"] for r in results} == {np}
    # The example prints each rank's parameter sum: broadcast then allreduced steps keep the
    # weights identical, so the sums agree to the last bit.
    assert len({r["params_checksum"] for r in results}) == 1, results
    assert len({r["steps"] for r in results}) == 1 and results[0]["progress"] >= 200


@requires_horovod
@requires_loopback_namespace
@pytest.mark.timeout(240)
def test_ray_cli_trains_two_workers_to_equal_weights(confined, tmp_path):
    need("ray", engines.INSTALL_HINTS["ray"])
    log_dir = tmp_path / "linear"
    proc = confined([HVD_SCALE, "run", "--engine", "ray", "-np", "2", "--policy", "linear",
                     "--log-dir", log_dir, "--", sys.executable, *MNIST], timeout=200)
    results = worker_results(proc, np=2)
    _assert_equal_training(results)
    assert {r["policy"] for r in results} == {"linear"}
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 100 and float(rows[-1]["lr_factor"]) == 2.0  # linear at S = 2


@requires_horovod
@requires_loopback_namespace
@pytest.mark.timeout(200)
def test_ray_python_api_on_two_simulated_nodes(confined):
    need("ray", engines.INSTALL_HINTS["ray"])
    proc = confined([sys.executable, WORKERS_DIR / "engine_jobs.py", "ray-two-nodes"], timeout=170)
    results = worker_results(proc, np=2)
    assert [(r["size"], r["local_size"], r["cross_size"]) for r in results] == [(2, 1, 2)] * 2
    assert {r["sum"] for r in results} == {3.0}
    assert {r["policy"] for r in results} == {"sqrt"} and {r["omp"] for r in results} == {"1"}
    assert len({r["pid"] for r in results}) == 2


@requires_horovod
@requires_loopback_namespace
@pytest.mark.timeout(200)
def test_ray_elastic_job_grows_to_max_np(confined, tmp_path):
    need("ray", engines.INSTALL_HINTS["ray"])
    proc = confined([sys.executable, WORKERS_DIR / "engine_jobs.py", "ray-elastic"], timeout=170)
    results = worker_results(proc, np=2)  # min 1, max 2 on a 2-CPU local cluster: 2 workers
    assert {(r["size"], r["sum"], r["elastic"]) for r in results} == {(2, 3.0, "1")}
    assert {r["policy"] for r in results} == {"adascale"}
    assert {r["log_dir"] for r in results} == {str(tmp_path)}


@requires_horovod
@requires_loopback_namespace
@pytest.mark.timeout(240)
def test_spark_cli_trains_two_workers_to_equal_weights(confined):
    need("pyspark", engines.INSTALL_HINTS["spark"])
    proc = confined([HVD_SCALE, "run", "--engine", "spark", "-np", "2", "--policy", "adascale",
                     "--", sys.executable, *MNIST], timeout=200)
    results = worker_results(proc, np=2)
    _assert_equal_training(results)
    assert {r["policy"] for r in results} == {"adascale"}


@requires_horovod
@requires_loopback_namespace
@pytest.mark.timeout(150)
def test_horovodrun_engine_runs_a_python_function(confined):
    proc = confined([sys.executable, WORKERS_DIR / "engine_jobs.py", "horovodrun-fn"], timeout=120)
    results = worker_results(proc, np=2)
    assert {(r["size"], r["sum"], r["policy"], r["omp"]) for r in results} == \
        {(2, 3.0, "sqrt", "1")}


def test_hosts_that_share_a_hostname_are_warned_about(monkeypatch, capsys):
    from hvd_scale.launch import engines

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        host = cmd[-2]
        return subprocess.CompletedProcess(cmd, 0, {"n1": "node\n", "n2": "node\n", "n3": "other\n"}[host], "")

    monkeypatch.setattr(engines.subprocess, "run", fake_run)
    assert engines.warn_shared_hostnames("n1:2,n2:2,n3:1", ["-p", "2222", "-i", "/k"])
    err = capsys.readouterr().err
    assert "hosts n1, n2 all report the hostname 'node'" in err and "n3" not in err
    assert calls[0][:-2] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                             "-p", "2222", "-i", "/k"]
    assert not engines.warn_shared_hostnames("localhost:2", [])  # one host: nothing to check


def test_a_hostfile_replaces_the_default_hosts():
    from hvd_scale.launch import engines

    engine = engines.HorovodrunEngine(controller="mpi", extra_args=["--hostfile", "/etc/mpi/hostfile"],
                                      executable="horovodrun")
    cmd = engine.command_line(["python", "x.py"], engines.make_job(np=4))
    assert "-H" not in cmd and cmd[-4:] == ["--hostfile", "/etc/mpi/hostfile", sys.executable,
                                            "x.py"]
