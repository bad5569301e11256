"""The statistics vector's layout, and its sum over 2 real processes with every reducer.

pack_local / unpack_summed / LocalReducer are checked in-process. MPIReducer (mpi4py) runs under
horovodrun's MPI controller; HorovodTorchReducer and HorovodTensorFlowReducer under Gloo. Each rank
(tests/workers/reduce_worker.py) packs a different vector and reports the sums it received; the
exact expected sums are computed here from the worker's own ``local_stats``.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from hvd_scale.reduce import LocalReducer, pack_local, unpack_summed
from hvdrun import WORKERS_DIR, requires_horovod, run_horovod, worker_results

NP = 2
WORKER = WORKERS_DIR / "reduce_worker.py"


def _load_worker():
    spec = importlib.util.spec_from_file_location("reduce_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports numpy only at module level
    return module


worker = _load_worker()


def expected_sum(step: int, np_: int = NP) -> np.ndarray:
    return sum(pack_local(*worker.local_stats(r, step)) for r in range(np_))


# ----------------------------------------------------------------------------------------------
# In-process: the layout.

def test_pack_local_layout():
    v = pack_local([1.5, 2.0, 0.0], 3)
    assert v.dtype == np.float64
    assert v.tolist() == [1.5, 2.0, 0.0, 3.0, 3.0]  # the sums, c, then w (per pass: w = c)
    assert pack_local(4.0, 1).tolist() == [4.0, 1.0, 1.0]  # one group given as a float
    assert pack_local([4.0], 5, samples=1).tolist() == [4.0, 5.0, 1.0]  # read once per worker
    assert pack_local(np.float32(0.5), 2).dtype == np.float64


def test_unpack_summed_round_trip_and_count_rounding():
    sq, n, samples = unpack_summed(pack_local([1.0, 2.0], 2) + pack_local([3.0, 4.0], 3, 1), 2)
    assert sq.tolist() == [4.0, 6.0] and n == 5 and isinstance(n, int)
    assert samples == 3 and isinstance(samples, int)
    # Counts that went through a float reduction come back as the nearest whole numbers.
    assert unpack_summed([1.0, 4.9999999, 2.0000001], 1)[1:] == (5, 2)


@pytest.mark.parametrize("vector, groups", [([1.0, 2.0, 3.0], 2), ([1.0, 2.0, 3.0, 4.0, 5.0], 2),
                                            ([1.0], 0), ([[1.0, 2.0, 3.0]], 1)])
def test_unpack_summed_rejects_wrong_length(vector, groups):
    with pytest.raises(ValueError, match=rf"{groups} group entries, the count and the samples") \
            as err:
        unpack_summed(vector, groups)
    assert f"got shape {np.shape(vector)}" in str(err.value)


def test_local_reducer_is_identity_on_a_copy():
    v = pack_local([1.0, 2.0], 4)
    out = LocalReducer().sum(v)
    assert out.tolist() == v.tolist() and out is not v
    out[0] = 99.0
    assert v[0] == 1.0


def test_worker_inputs_differ_per_rank_and_need_float64():
    for step in range(worker.STEPS):
        total = expected_sum(step)
        locals_ = [pack_local(*worker.local_stats(r, step)) for r in range(NP)]
        # A broadcast or a mean instead of a sum could not pass.
        for local in locals_:
            assert not np.array_equal(local, total)
        assert not np.array_equal(total / NP, total)
        # float32 would not reproduce the sums exactly.
        f32 = sum(v.astype(np.float32) for v in locals_).astype(np.float64)
        assert not np.array_equal(f32, total)


# ----------------------------------------------------------------------------------------------
# Two processes.

def check_results(results: list[dict], backend: str, reducer: str) -> None:
    assert len(results) == NP
    for res in results:
        where = f"{backend} rank {res['rank']}"
        assert res["size"] == NP, where
        assert res["backend"] == backend and res["reducer"] == reducer, where
        assert len(res["steps"]) == worker.STEPS, where
        for step, got in enumerate(res["steps"]):
            want = expected_sum(step)
            own = pack_local(*worker.local_stats(res["rank"], step))
            assert got["local"] == own.tolist(), f"{where} step {step}: sent {got['local']}"
            assert got["input_unchanged"], f"{where} step {step}: the reducer modified its input"
            assert got["dtype"] == "float64" and got["shape"] == [worker.GROUPS + 2], where
            # Exact: float64 sums of these values have no rounding.
            assert got["summed"] == want.tolist(), f"{where} step {step}: {got['summed']} != {want.tolist()}"
            sq, n, _ = unpack_summed(np.array(got["summed"]), worker.GROUPS)
            assert sq.tolist() == want[:-2].tolist() and n == sum(r + 2 for r in range(NP))
            assert got["sqnorm_sum"] == sq.tolist() and got["n"] == n, where
            assert got["n_type"] == "int", where


@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(240)
@pytest.mark.parametrize("controller, backend, reducer", [
    ("mpi", "mpi4py", "MPIReducer"),
    ("gloo", "torch", "HorovodTorchReducer"),
    ("gloo", "tensorflow", "HorovodTensorFlowReducer"),
])
def test_reducers_sum_over_two_processes(controller, backend, reducer):
    proc = run_horovod([sys.executable, str(WORKER), backend], np=NP, controller=controller,
                       timeout=180)
    check_results(worker_results(proc, np=NP), backend, reducer)
