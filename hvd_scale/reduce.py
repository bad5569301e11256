"""The statistics that cross workers, and how they are summed.

Layout of the flat float64 vector each worker contributes (the contract between adapters):

    [ s_0, s_1, ..., s_{G-1}, c ]

    s_j  sum of |g_i|^2 over this worker's micro-gradients g_i in parameter group j
    c    number of micro-gradients this worker produced (its backward passes in the step)

Summed over workers it gives ``sqnorm_sum`` per group and n. |g_bar|^2 needs no reduction: every
worker computes it from the averaged gradient that the gradient allreduce already produced.

A reducer is anything with ``sum(vector) -> vector`` across workers. Adapters may instead pack the
vector into their own (asynchronous) Horovod allreduce: the layout is what must agree.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


def pack_local(group_sqnorms, micro_batches: int) -> np.ndarray:
    """This worker's vector: per-group sums of squared micro-gradient norms, then the count."""
    sq = np.atleast_1d(np.asarray(group_sqnorms, dtype=np.float64))
    return np.concatenate([sq, [float(micro_batches)]])


def unpack_summed(vector, num_groups: int) -> tuple[np.ndarray, int]:
    """(sqnorm_sum per group, n) from the vector summed over workers."""
    vector = np.asarray(vector, dtype=np.float64)
    if vector.shape != (num_groups + 1,):
        raise ValueError(f"statistics vector must have {num_groups} group entries plus the count "
                         f"({num_groups + 1} values), got shape {vector.shape}")
    return vector[:num_groups], int(round(vector[num_groups]))


class Reducer(Protocol):
    def sum(self, vector: np.ndarray) -> np.ndarray:
        """Elementwise sum of a 1-D float64 array over all workers (every worker gets the result)."""


class LocalReducer:
    """One process: the sum over workers is the vector itself."""

    def sum(self, vector: np.ndarray) -> np.ndarray:
        return np.array(vector, dtype=np.float64)


class MPIReducer:
    """mpi4py's Allreduce on a communicator (default COMM_WORLD)."""

    def __init__(self, comm=None):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm

    def sum(self, vector: np.ndarray) -> np.ndarray:
        send = np.ascontiguousarray(vector, dtype=np.float64)
        out = np.empty_like(send)
        self.comm.Allreduce(send, out, op=self._mpi.SUM)
        return out


class HorovodTorchReducer:
    """horovod.torch.allreduce with op=Sum, in float64 (exact for counts)."""

    def __init__(self, name: str = "hvd_scale.stats"):
        import horovod.torch as hvd
        import torch

        self._hvd, self._torch, self.name = hvd, torch, name

    def sum(self, vector: np.ndarray) -> np.ndarray:
        t = self._torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float64))
        return self._hvd.allreduce(t, op=self._hvd.Sum, name=self.name).numpy()


class HorovodTensorFlowReducer:
    """horovod.tensorflow.allreduce with op=Sum, in float64 (eager)."""

    def __init__(self, name: str = "hvd_scale.stats"):
        import horovod.tensorflow as hvd
        import tensorflow as tf

        self._hvd, self._tf, self.name = hvd, tf, name

    def sum(self, vector: np.ndarray) -> np.ndarray:
        t = self._tf.constant(np.asarray(vector, dtype=np.float64))
        return self._hvd.allreduce(t, op=self._hvd.Sum, name=self.name).numpy()
