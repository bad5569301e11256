"""The statistics of one step: what crosses workers, how it is summed, what the host reads.

The local vector each worker contributes, summed over workers (the contract between adapters):

    [ s_0, s_1, ..., s_{G-1}, c, w ]

    s_j  sum of squared norms in parameter group j of the samples this worker read
         (``hvd_scale.estimate``: with per-pass statistics, |g_i|^2 of each of its micro-
         gradients; with per-worker statistics, |G|^2 / c of the sum G of its c passes)
    c    number of micro-gradients this worker produced (its backward passes in the step)
    w    the independent samples s holds: c per pass, 1 per worker (0 without a pass)

Summed over workers it gives ``sqnorm_sum`` per group, n and the step's samples. Where every
worker holds the whole averaged gradient (Horovod, DDP), |g_bar|^2 needs no reduction: each
computes it from what the gradient allreduce produced and appends it; where each holds a shard
(FSDP2), the shards' squared norms ride in the same allreduce and add up to it. Either way the
step's statistics reach the host as one vector (one transfer):

    [ s_0, ..., s_{G-1}, c, w, q_0, ..., q_{G-1} ]      q_j = |g_bar|^2 in group j

``StepRecord`` names these parts and is the one place that packs and slices the vector (for
numpy, torch and keras.ops alike).

A reducer is anything with ``sum(vector) -> vector`` across workers: ``LocalReducer`` (one
process), ``MPIReducer`` (mpi4py: the engine alone, for a framework without an adapter);
Horovod's are with the adapters (``hvd_scale.adapters.reducers``). The adapters pack the local
vector into their own (asynchronous) allreduce instead, so it is fused with the gradients; the
layout is what must agree.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

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


class StepRecord(NamedTuple):
    """One step's statistics, named; the vector's layout and its slicing live here and only here.

        [ s_0, ..., s_{G-1}, c, w ]                          a worker's, and its sum over workers
        [ s_0, ..., s_{G-1}, c, w, q_0, ..., q_{G-1} ]      the step's, as the host reads it

    sums          s_j = sum_i |g_ij|^2 over the samples read in group j (summed: ``sqnorm_sum``)
    count         c, the micro-gradients (summed over workers: n)
    samples       w, the independent samples in s (c per pass, 1 per worker; summed: the step's)
    mean_sqnorms  q_j = |g_bar_j|^2 of the mean micro-gradient; None where it is not known yet
                  (a worker's vector before the gradients' reduction)

    Values are any array library's (numpy, torch, keras.ops): ``xp`` is the library's module,
    which has ``concatenate``, ``stack``, ``round``, ``where`` and ``isfinite``. ``unpack`` and
    ``from_wire`` return views (0-d for c and w), ``pack`` and ``to_wire`` one vector.
    """

    sums: Any
    count: Any
    samples: Any
    mean_sqnorms: Any = None

    def pack(self, xp=np):
        """[s..., c, w] or, with q, [s..., c, w, q...]."""
        tail = () if self.mean_sqnorms is None else (self.mean_sqnorms,)
        return xp.concatenate([self.sums, xp.stack([self.count, self.samples]), *tail])

    @classmethod
    def unpack(cls, vector, groups: int) -> "StepRecord":
        """The record of ``pack``'s vector (G + 2 values, or 2 G + 2 with q), as views."""
        q = vector[groups + COUNTS:] if vector.shape[0] > groups + COUNTS else None
        return cls(vector[:groups], vector[groups], vector[groups + 1], q)

    def to_wire(self, xp=np):
        """What travels in an allreduce in the gradients' dtype: each group's sums three times
        (``wire_copies``: plain, x WIRE_WIDE, x WIRE_NARROW), then [c, w], then q's three
        copies where q is known (a sharded engine sums its shards' q over ranks)."""
        tail = () if self.mean_sqnorms is None else wire_copies(self.mean_sqnorms)
        return xp.concatenate([*wire_copies(self.sums), xp.stack([self.count, self.samples]),
                               *tail])

    @classmethod
    def from_wire(cls, vector, groups: int, xp=np) -> "StepRecord":
        """The record of ``to_wire``'s vector summed over workers (float64 in): each sum taken
        from the copy that fits (``wire_sums``), the counts rounded back to whole numbers (a
        reduction in float32, or an average times W, leaves them a rounding away)."""
        def sums(at):
            return wire_sums(vector[at:at + groups], vector[at + groups:at + 2 * groups],
                             vector[at + 2 * groups:at + 3 * groups], xp)
        counts = 3 * groups
        q = sums(counts + COUNTS) if vector.shape[0] > counts + COUNTS else None
        return cls(sums(0), xp.round(vector[counts]), xp.round(vector[counts + 1]), q)


def pack_local(group_sqnorms, micro_batches: int, samples: int | None = None) -> np.ndarray:
    """This worker's vector: per-group sums of squared norms, its count c and its samples w
    (None: c, each micro-gradient read)."""
    sq = np.atleast_1d(np.asarray(group_sqnorms, dtype=np.float64))
    w = micro_batches if samples is None else samples
    return StepRecord(sq, float(micro_batches), float(w)).pack().astype(np.float64)


def _host_counts(record: StepRecord) -> tuple[int, int]:
    # A non-finite count cannot be rounded; the caller's finiteness check rejects the step.
    return tuple(int(round(float(v))) if np.isfinite(v) else 0
                 for v in (record.count, record.samples))


def unpack_summed(vector, num_groups: int) -> tuple[np.ndarray, int, int]:
    """(sqnorm_sum per group, n, samples) from the vector summed over workers."""
    vector = np.asarray(vector, dtype=np.float64)
    if vector.shape != (num_groups + COUNTS,):
        raise ValueError(f"statistics vector must have {num_groups} group entries, the count and "
                         f"the samples ({num_groups + COUNTS} values), got shape {vector.shape}")
    record = StepRecord.unpack(vector, num_groups)
    return (record.sums, *_host_counts(record))


def step_vector_size(num_groups: int) -> int:
    return 2 * num_groups + COUNTS


def unpack_step(vector, num_groups: int, loss_scale: float | None = None) -> StepRecord:
    """The step's host vector as a record: (sqnorm_sum per group, n, samples, mean_sqnorm per
    group), n and samples Python ints.

    ``loss_scale``: the gradients were those of loss x scale (mixed precision); squared norms
    are divided by its square, the counts stay.
    """
    vector = np.asarray(vector, dtype=np.float64)
    if vector.shape != (step_vector_size(num_groups),):
        raise ValueError(f"step statistics must hold {num_groups} sums, the count, the samples "
                         f"and {num_groups} mean norms ({step_vector_size(num_groups)} values), "
                         f"got shape {vector.shape}")
    record = StepRecord.unpack(vector, num_groups)
    n, samples = _host_counts(record)
    inv = 1.0 if loss_scale is None else 1.0 / float(loss_scale) ** 2
    return StepRecord(record.sums * inv, n, samples, record.mean_sqnorms * inv)


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
