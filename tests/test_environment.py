"""The environment hvd_scale stands on: Horovod 0.28.1 built with PyTorch, TensorFlow, Gloo and MPI,
and its collectives giving the right values on 2 real processes, under both controllers.

Each rank reports what it received (tests/workers/collectives_*.py); the checks happen here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from hvdrun import HOROVODRUN, LAUNCHER, WORKERS_DIR, requires_horovod, run_horovod, worker_env, worker_results

NP = 2


# ----------------------------------------------------------------------------------------------
# What every rank should receive (the inputs are documented in workers/collectives_torch.py).

def _a(r):
    return np.array([r + 1.0, 10.0 * (r + 1), -float(r)])


def _b(r):
    return np.full((2, 2), float(r))


def _i(r):
    return np.array([r + 1, 7])


def _c(r):
    return np.array([100.0 * r + 1, 100.0 * r + 2])


def expected(n):
    ranks = range(n)
    return {
        "allreduce_avg": np.mean([_a(r) for r in ranks], axis=0),
        "allreduce_sum": np.sum([_a(r) for r in ranks], axis=0),
        "allreduce_sum_int": np.sum([_i(r) for r in ranks], axis=0),
        "grouped_avg": [np.mean([_a(r) for r in ranks], axis=0), np.mean([_b(r) for r in ranks], axis=0)],
        "grouped_sum": [np.sum([_a(r) for r in ranks], axis=0), np.sum([_b(r) for r in ranks], axis=0)],
        "broadcast_last": _c(n - 1),
        "broadcast0": _c(0),
        "allgather": np.array([[float(r), r + 0.5] for r in ranks]),
    }


def check_values(got: dict, want: dict, where: str) -> None:
    for key, w in want.items():
        assert key in got, f"{where}: no {key!r} reported"
        if isinstance(w, list):
            assert len(got[key]) == len(w), f"{where}: {key} has {len(got[key])} tensors"
            for j, (g_, w_) in enumerate(zip(got[key], w)):
                np.testing.assert_allclose(np.asarray(g_), w_, rtol=1e-6, err_msg=f"{where}: {key}[{j}]")
        else:
            np.testing.assert_allclose(np.asarray(got[key]), w, rtol=1e-6, err_msg=f"{where}: {key}")


def check_common(results: list[dict], controller: str) -> None:
    for res in results:
        where = f"rank {res['rank']}"
        assert res["size"] == NP, where
        assert res["local_rank"] == res["rank"], where  # one host
        assert res["horovod"] == "0.28.1", where
        # The controller the job really ran on, not only the one that was built.
        assert res["gloo_enabled"] is (controller == "gloo"), f"{where}: {res}"
        assert res["mpi_enabled"] is (controller == "mpi"), f"{where}: {res}"


# ----------------------------------------------------------------------------------------------

@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(120)
def test_check_build_lists_frameworks_and_controllers():
    proc = subprocess.run(
        [str(HOROVODRUN), "--check-build"],
        capture_output=True, text=True, timeout=90, env=worker_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    marks = dict((name, mark == "X") for mark, name in re.findall(r"\[(X| )\]\s+(\w+)", proc.stdout))
    assert "Horovod v0.28.1" in proc.stdout, proc.stdout
    for name in ("PyTorch", "TensorFlow", "Gloo", "MPI"):
        assert marks.get(name) is True, f"{name} not available in --check-build:\n{proc.stdout}"


@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(240)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_torch_collectives(controller):
    proc = run_horovod(
        [sys.executable, str(WORKERS_DIR / "collectives_torch.py")],
        np=NP, controller=controller, timeout=180,
    )
    results = worker_results(proc, np=NP)
    check_common(results, controller)
    want = expected(NP)
    want.pop("broadcast0")
    for res in results:
        where = f"torch/{controller} rank {res['rank']}"
        check_values(res, want, where)
        np.testing.assert_allclose(res["broadcast0_inplace"], _c(0), err_msg=where)
        np.testing.assert_allclose(res["allreduce_avg_async_inplace"], want["allreduce_avg"], err_msg=where)
        assert res["dtypes"] == ["torch.float64"], where
        # Integer sums must stay exact integers.
        assert all(isinstance(x, int) for x in res["allreduce_sum_int"]), where


@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(300)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_tensorflow_collectives_eager_and_tf_function(controller):
    proc = run_horovod(
        [sys.executable, str(WORKERS_DIR / "collectives_tf.py")],
        np=NP, controller=controller, timeout=240,
    )
    results = worker_results(proc, np=NP)
    check_common(results, controller)
    want = expected(NP)
    for res in results:
        for mode in ("eager", "function", "function_again"):
            check_values(res[mode], want, f"tf/{controller}/{mode} rank {res['rank']}")
            assert all(isinstance(x, int) for x in res[mode]["allreduce_sum_int"])
        np.testing.assert_allclose(res["broadcast_variables0"], _c(0), err_msg=f"rank {res['rank']}")


@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(120)
def test_the_launcher_asks_torch_whether_horovod_has_gloo(tmp_path):
    """hvd-scale-horovodrun (what hvd-scale run and these tests start jobs with) is horovodrun
    whose build check loads horovod.torch before TensorFlow (8 s of a 10.7 s launch here). A stand-in
    tensorflow package on the driver's path leaves a mark when imported, and fails to import
    (so plain horovodrun's check goes on to torch): plain horovodrun leaves it, the launcher not."""
    from hvd_scale.launch.jobs import find_horovodrun

    assert find_horovodrun() == str(LAUNCHER)
    fake = tmp_path / "fake" / "tensorflow"
    fake.mkdir(parents=True)
    mark = tmp_path / "tensorflow-imported"
    (fake / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\n"
                                      "raise ImportError('a stand-in tensorflow')\n")
    env = worker_env({"PYTHONPATH": str(fake.parent)})
    for launcher, imports_tf in ((HOROVODRUN, True), (LAUNCHER, False)):
        mark.unlink(missing_ok=True)
        proc = subprocess.run([str(launcher), "--gloo", "-np", "2", "-H", "localhost:2",
                               sys.executable, str(WORKERS_DIR / "misbehave.py"), "fail", str(tmp_path)],
                              capture_output=True, text=True, timeout=90, env=env)
        assert proc.returncode != 0 and "MISBEHAVE-MARKER" in proc.stdout, proc.stdout + proc.stderr
        assert mark.exists() is imports_tf, launcher


# ----------------------------------------------------------------------------------------------
# The helper itself: failures and hangs must surface as assertion errors, and leave no workers.

def test_worker_results_parses_prefixed_lines_sorted_by_rank():
    text = (
        "[1]<stdout>:RESULT {\"rank\": 1, \"x\": [2.0]}\n"
        "noise RESULT-ish line\n"
        "[1,0]<stdout>:RESULT {\"rank\": 0, \"x\": [1.0]}\n"
        "[0]<stderr>:some warning\n"
    )
    assert worker_results(text, np=2) == [{"rank": 0, "x": [1.0]}, {"rank": 1, "x": [2.0]}]
    with pytest.raises(AssertionError, match="ranks 0..2"):
        worker_results(text, np=3)
    assert worker_results(text, tag="METRICS") == []
    # OpenMPI tags chunks, not lines: another rank's output can cut a long line in two.
    chunked = (
        "[1,1]<stdout>:RESULT {\"rank\": 1, \"x\": [2.0, [1,0]<stdout>:RESULT {\"rank\": 0,"
        "[1,1]<stdout>:3.0]}\n[1,0]<stderr>:RESULT {\"rank\": 7}\n[1,0]<stdout>: \"x\": [1.0]}\n"
    )
    assert worker_results(chunked, np=2) == [{"rank": 0, "x": [1.0]}, {"rank": 1, "x": [2.0, 3.0]}]
    # Untagged output (a worker run by hand) parses too.
    assert worker_results('RESULT {"rank": 0}\n', np=1) == [{"rank": 0}]


@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(120)
def test_run_horovod_failure_raises_with_output(tmp_path):
    args = [sys.executable, str(WORKERS_DIR / "misbehave.py"), "fail", str(tmp_path)]
    with pytest.raises(AssertionError) as err:
        run_horovod(args, np=NP, timeout=90)
    assert "MISBEHAVE-MARKER" in str(err.value), str(err.value)
    proc = run_horovod(args, np=NP, timeout=90, check=False)
    assert proc.returncode != 0


@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(120)
def test_run_horovod_timeout_kills_every_worker(tmp_path):
    args = [sys.executable, str(WORKERS_DIR / "misbehave.py"), "hang", str(tmp_path)]
    with pytest.raises(AssertionError, match="timed out"):
        run_horovod(args, np=NP, timeout=10)
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(NP)]

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # A zombie left to init is dead for our purposes.
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), f"workers still alive: {[p for p in pids if alive(p)]}"
