"""Horovod collectives in PyTorch: every rank reports what it got; tests/test_environment.py checks.

Inputs depend on the rank r (size n) so that a wrong reduction cannot pass by accident:
    a = [r + 1, 10 (r + 1), -r]          b = 2x2 filled with r          i = [r + 1, 7] (int64)
    c = [100 r + 1, 100 r + 2]           g = [[r, r + 0.5]] (allgather)
"""

import sys

import horovod
import horovod.torch as hvd
import torch

from _report import emit_result


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    a = torch.tensor([r + 1.0, 10.0 * (r + 1), -float(r)], dtype=torch.float32)
    b = torch.full((2, 2), float(r), dtype=torch.float64)
    i = torch.tensor([r + 1, 7], dtype=torch.int64)
    c = torch.tensor([100.0 * r + 1, 100.0 * r + 2])
    g = torch.tensor([[float(r), r + 0.5]])

    out = {
        "rank": r,
        "size": n,
        "local_rank": hvd.local_rank(),
        "gloo_enabled": bool(hvd.gloo_enabled()),
        "mpi_enabled": bool(hvd.mpi_enabled()),
        "horovod": horovod.__version__,
        "torch": torch.__version__,
        "allreduce_avg": hvd.allreduce(a, op=hvd.Average, name="avg").tolist(),
        "allreduce_sum": hvd.allreduce(a, op=hvd.Sum, name="sum").tolist(),
        "allreduce_sum_int": hvd.allreduce(i, op=hvd.Sum, name="sum_int").tolist(),
        "grouped_avg": [t.tolist() for t in hvd.grouped_allreduce([a, b], op=hvd.Average, name="gavg")],
        "grouped_sum": [t.tolist() for t in hvd.grouped_allreduce([a, b], op=hvd.Sum, name="gsum")],
        "broadcast_last": hvd.broadcast(c, root_rank=n - 1, name="bcast_last").tolist(),
        "allgather": hvd.allgather(g, name="gather").tolist(),
    }
    # In-place variants, and the async handle path that DistributedOptimizer relies on.
    c0 = c.clone()
    hvd.broadcast_(c0, root_rank=0, name="bcast0_inplace")
    out["broadcast0_inplace"] = c0.tolist()
    a2 = a.clone()
    handle = hvd.allreduce_async_(a2, op=hvd.Average, name="avg_async")
    hvd.synchronize(handle)
    out["allreduce_avg_async_inplace"] = a2.tolist()
    out["dtypes"] = [str(hvd.allreduce(b, op=hvd.Sum, name="dt").dtype)]
    hvd.shutdown()
    emit_result(out)


if __name__ == "__main__":
    sys.exit(main())
