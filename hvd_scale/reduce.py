"""The statistics of one step: what crosses workers, how it is summed, what the host reads.

The local vector each worker contributes, summed over workers (the contract between adapters):

    [ s_0, s_1, ..., s_{G-1}, c, w ]

    s_j  sum of squared norms in parameter group j of the samples this worker read
         (``hvd_scale.estimate``: with per-pass statistics, |g_i|^2 of each of its micro-
         gradients; with per-worker statistics, |G|^2 / c of the sum G of its c passes)
    c    number of micro-gradients this worker produced (its backward passes in the step)
    w    the independent samples s holds: c per pass, 1 per worker (0 without a pass)

Summed over workers it gives ``sqnorm_sum`` per group, n and the step's samples. |g_bar|^2 needs
no reduction: every worker computes it from the averaged gradient that the gradient allreduce
already produced, and appends it, so the step's statistics reach the host as one vector (one
transfer):

    [ s_0, ..., s_{G-1}, c, w, q_0, ..., q_{G-1} ]      q_j = |g_bar|^2 in group j

A reducer is anything with ``sum(vector) -> vector`` across workers: ``LocalReducer`` (one
process), ``MPIReducer`` (mpi4py: the engine alone, for a framework without an adapter);
Horovod's are with the adapters (``hvd_scale.adapters.reducers``). The adapters pack the local
vector into their own (asynchronous) allreduce instead, so it is fused with the gradients; the
layout is what must agree.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

# On the wire: the adapters' sums ride in the gradients' allreduce, in the gradients' dtype
# (Horovod fuses one dtype; a float64 tensor beside float32 gradients would be an allreduce of its
# own every step). In float32 a sum of squared norms overflows from 3.4e38 on (|g| ~ 1.8e19), which
# finite gradients can reach, and loses its digits below float32's smallest normal 1.2e-38 (|g| ~
# 1e-19: a loss scaled far down), so each sum also travels times WIRE_WIDE (sums up to 5e98) and
# times WIRE_NARROW (sums down to 1e-98). The receiver takes the plain sum where it is finite and
# at least SMALLEST_PLAIN (well above the smallest normal, far below any sum a trained model's
# gradients make), else whichever copy is.
WIRE_WIDE = 2.0 ** -200
WIRE_NARROW = 2.0 ** 200
SMALLEST_PLAIN = 2.0 ** -100

# A float32 norm (or sum of squares) is taken again in float64 where its mean square falls below
# this: squares under float32's smallest normal lose digits (an element of 1e-22 squares to a
# subnormal) and under 1.4e-45 vanish (at 1e-24 the float32 norm is 0).
SMALLEST_MEAN_SQUARE = 2.0 ** -100


def wire_copies(sums):
    """What travels for ``sums`` (any array type): the plain sums, then times WIRE_WIDE, then
    times WIRE_NARROW. The adapters concatenate them, in that order, before [c, w]."""
    return sums, sums * WIRE_WIDE, sums * WIRE_NARROW


def wire_sums(plain, wide, narrow, xp):
    """The sums back from the three copies summed over workers (float64), in the array library
    ``xp`` (torch, keras.ops, numpy: anything with ``where`` and ``isfinite``): the plain sum
    wherever it is finite and at least SMALLEST_PLAIN; else the scaled-down copy (overflow),
    or the scaled-up one (digits lost below the smallest normal)."""
    sums = xp.where(xp.isfinite(plain), plain, wide / WIRE_WIDE)
    return xp.where((sums < SMALLEST_PLAIN) & xp.isfinite(narrow), narrow / WIRE_NARROW, sums)


COUNTS = 2  # c and w, after the sums


def pack_local(group_sqnorms, micro_batches: int, samples: int | None = None) -> np.ndarray:
    """This worker's vector: per-group sums of squared norms, its count c and its samples w
    (None: c, each micro-gradient read)."""
    sq = np.atleast_1d(np.asarray(group_sqnorms, dtype=np.float64))
    w = micro_batches if samples is None else samples
    return np.concatenate([sq, [float(micro_batches), float(w)]])


def unpack_summed(vector, num_groups: int) -> tuple[np.ndarray, int, int]:
    """(sqnorm_sum per group, n, samples) from the vector summed over workers."""
    vector = np.asarray(vector, dtype=np.float64)
    if vector.shape != (num_groups + COUNTS,):
        raise ValueError(f"statistics vector must have {num_groups} group entries, the count and "
                         f"the samples ({num_groups + COUNTS} values), got shape {vector.shape}")
    # A non-finite count cannot be rounded; the caller's finiteness check rejects the step.
    n, samples = (int(round(v)) if np.isfinite(v) else 0 for v in vector[num_groups:])
    return vector[:num_groups], n, samples


def step_vector_size(num_groups: int) -> int:
    return 2 * num_groups + COUNTS


def unpack_step(vector, num_groups: int, loss_scale: float | None = None
                ) -> tuple[np.ndarray, int, int, np.ndarray]:
    """(sqnorm_sum per group, n, samples, mean_sqnorm per group) from the step's host vector.

    ``loss_scale``: the gradients were those of loss x scale (mixed precision); squared norms
    are divided by its square, the counts stay.
    """
    vector = np.asarray(vector, dtype=np.float64)
    if vector.shape != (step_vector_size(num_groups),):
        raise ValueError(f"step statistics must hold {num_groups} sums, the count, the samples "
                         f"and {num_groups} mean norms ({step_vector_size(num_groups)} values), "
                         f"got shape {vector.shape}")
    sqnorm_sum, n, samples = unpack_summed(vector[:num_groups + COUNTS], num_groups)
    mean_sqnorm = vector[num_groups + COUNTS:]
    if loss_scale is not None:
        inv = 1.0 / float(loss_scale) ** 2
        sqnorm_sum, mean_sqnorm = sqnorm_sum * inv, mean_sqnorm * inv
    return sqnorm_sum, n, samples, mean_sqnorm


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
