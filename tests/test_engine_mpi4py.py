"""The engine alone, for a framework without an adapter: examples/numpy_mpi.py over mpi4py.

A plain-numpy model runs on 2 MPI processes (mpirun, then horovodrun --mpi) with the statistics
summed by hvd_scale.reduce.MPIReducer, and once as one process playing both ranks with
LocalReducer (--reference-world 2). Every micro-batch depends on (seed, rank, step, pass) only,
so the gains and weights of all three runs must agree (bit for bit at 2 ranks; the tolerance
leaves room for MPI's summation order at more ranks).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hvdrun import (BIN_DIR, HOROVODRUN, REPO_ROOT, _horovod_required, run_horovod, run_process,
                    worker_env, worker_results)

EXAMPLE = REPO_ROOT / "examples" / "numpy_mpi.py"
NP, PASSES, BUDGET = 2, 2, 120
SCALE = NP * PASSES
ARGS = ["--passes", str(PASSES), "--budget", str(BUDGET), "--seed", "3", "--report"]
# The checkout's engine, whether or not it is installed in the venv yet.
ENV = {"PYTHONPATH": str(REPO_ROOT), "HVD_SCALE_POLICY": "adascale"}
TIMEOUT = 60  # seconds per run; each takes a few

MPIRUN = shutil.which("mpirun", path=str(BIN_DIR) + os.pathsep + os.environ.get("PATH", ""))


def mpi_missing_reason() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:  # find only: importing MPI would init it here
        return f"mpi4py is not importable from {sys.executable} (run `make setup`)"
    if MPIRUN is None:
        return "mpirun not found on PATH (OpenMPI; run `make setup`)"
    return None


requires_mpi = pytest.mark.skipif(mpi_missing_reason() is not None and not _horovod_required(),
                                  reason=f"MPI unavailable: {mpi_missing_reason()}")
requires_horovodrun = pytest.mark.skipif(not HOROVODRUN.exists() and not _horovod_required(),
                                         reason=f"horovodrun not found at {HOROVODRUN}")


def run(cmd: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run cmd in its own session; on time-out, failure or interruption kill its whole tree."""
    return run_process(cmd, timeout=timeout, env=worker_env(ENV), cwd=REPO_ROOT)


def mpirun_command(np_: int) -> list[str]:
    # --tag-output: "[job,rank]<stdout>:" prefixes let worker_results reassemble long lines.
    cmd = [MPIRUN or "mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", "--tag-output"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process playing ranks 0 and 1 (LocalReducer): no MPI needed."""
    proc = run([sys.executable, str(EXAMPLE), *ARGS, "--reference-world", str(NP)])
    (ref,) = worker_results(proc, np=1)
    assert ref["reference"] and ref["size"] == NP
    return ref


def check_against_reference(results: list[dict], ref: dict) -> None:
    first = results[0]
    for res in results:
        assert res["size"] == NP and not res["reference"], res["rank"]
        # Replicas: identical, bit for bit (same averaged gradient, same gains).
        assert res["gains"] == first["gains"], f"rank {res['rank']} measured other gains"
        assert res["weights"] == first["weights"] and res["checksum"] == first["checksum"]
    gains = np.array(first["gains"])
    assert first["scale"] == SCALE and first["policy"] == "adascale"
    assert np.all((gains >= 1.0) & (gains <= SCALE)), gains
    assert np.any(gains > 1.0 + 1e-6), "AdaScale measured no gain at all"
    assert first["progress"] >= BUDGET and first["steps"] == len(gains) < BUDGET
    assert first["loss_after"] < 0.8 * first["loss_before"], (first["loss_before"], first["loss_after"])
    # The one-process replay of the same micro-batches measures the same gains.
    assert len(ref["gains"]) == len(gains)
    np.testing.assert_allclose(gains, ref["gains"], rtol=1e-9, atol=0)
    np.testing.assert_allclose(first["weights"], ref["weights"], rtol=1e-9, atol=1e-12)
    assert first["progress"] == pytest.approx(ref["progress"], rel=1e-9)


@pytest.mark.timeout(120)
def test_reference_plays_the_ranks(reference):
    """Sanity of the reference itself: a real run, with gains in (1, S]."""
    gains = np.array(reference["gains"])
    assert reference["scale"] == SCALE and np.all((gains >= 1) & (gains <= SCALE))
    assert np.any(gains > 1.0 + 1e-6) and reference["loss_after"] < reference["loss_before"]


@requires_mpi
@pytest.mark.timeout(120)
def test_mpirun_two_ranks_match_the_reference(reference):
    proc = run([*mpirun_command(NP), sys.executable, str(EXAMPLE), *ARGS])
    check_against_reference(worker_results(proc, np=NP), reference)


@pytest.mark.horovod
@requires_mpi
@requires_horovodrun
@pytest.mark.timeout(180)
def test_horovodrun_mpi_two_ranks_match_the_reference(reference):
    """The launch line the docs name: horovodrun --mpi -np 2 -H localhost:2."""
    proc = run_horovod([sys.executable, str(EXAMPLE), *ARGS], np=NP, controller="mpi",
                       timeout=120, env=ENV)
    check_against_reference(worker_results(proc, np=NP), reference)
