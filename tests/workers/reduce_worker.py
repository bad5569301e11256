"""Sum each rank's statistics vector with one of hvd_scale.reduce's reducers; report what came back.

    python reduce_worker.py mpi4py|torch|tensorflow      (under horovodrun, 2 or more ranks)

Every rank packs a *different* local vector (``local_stats``: depends on rank and step) with
hvd_scale.reduce.pack_local, sums it over the workers ``STEPS`` times with the same reducer, and
prints one RESULT line; tests/test_reduce_distributed.py checks the sums. The values are chosen so
that the float64 sums are exact and would not be in float32 (the 2**-40 term).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The engine from this checkout, installed or not.
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from hvd_scale.launch.jobs import print_result, result_line  # noqa: E402

STEPS = 3
GROUPS = 3


def local_stats(rank: int, step: int) -> tuple[list[float], int]:
    """(per-group sums of squared micro-gradient norms, micro-batch count) of one rank at one step."""
    sq = [
        (rank + 1) * (1.0 + 2.0 ** -40),  # needs float64 to survive the sum
        10.5 * (rank + 1) * (step + 1),
        0.25 * rank + 2.0 ** -30 * step,
    ]
    return sq, rank + 2  # ranks run different numbers of backward passes


def make_reducer(backend: str):
    """(reducer, rank, size, teardown) for a backend."""
    from hvd_scale import reduce

    if backend == "mpi4py":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        return reduce.MPIReducer(), comm.Get_rank(), comm.Get_size(), lambda: None
    if backend == "torch":
        import horovod.torch as hvd

        hvd.init()
        from hvd_scale.adapters.reducers import HorovodTorchReducer
        return HorovodTorchReducer(), hvd.rank(), hvd.size(), hvd.shutdown
    if backend == "tensorflow":
        import horovod.tensorflow as hvd

        hvd.init()
        from hvd_scale.adapters.reducers import HorovodTensorFlowReducer
        return HorovodTensorFlowReducer(), hvd.rank(), hvd.size(), hvd.shutdown
    raise SystemExit(f"unknown backend {backend!r}: mpi4py, torch or tensorflow")


def emit_result(**fields) -> None:
    """One ``RESULT {json}`` line, short enough (under PIPE_BUF) for print_result's one write(2)
    to be atomic: mpirun cannot splice the other rank's output into it."""
    assert len(result_line(fields)) < 4096, len(result_line(fields))
    print_result(fields)


def main(argv: list[str]) -> int:
    from hvd_scale.reduce import pack_local, unpack_summed

    backend = argv[1]
    reducer, rank, size, teardown = make_reducer(backend)
    steps = []
    for step in range(STEPS):
        sq, count = local_stats(rank, step)
        local = pack_local(sq, count)
        sent = local.copy()
        summed = reducer.sum(local)
        sqnorm_sum, n, _ = unpack_summed(summed, GROUPS)
        steps.append({
            "local": local.tolist(),
            "summed": np.asarray(summed).tolist(),
            "dtype": str(np.asarray(summed).dtype),
            "shape": list(np.shape(summed)),
            "sqnorm_sum": sqnorm_sum.tolist(),
            "n": n,
            "n_type": type(n).__name__,
            "input_unchanged": bool(np.array_equal(local, sent)),
        })
    teardown()
    emit_result(rank=rank, size=size, backend=backend, reducer=type(reducer).__name__, steps=steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
