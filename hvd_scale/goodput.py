"""Goodput: the batch that finishes soonest (AdaptDL's goodput, Qiao et al., OSDI 2021).

Legend (as in ``estimate.py``; W workers, k backward passes per step, m samples per micro-batch,
B0 the baseline batch in samples):

    S = W k m / B0                       the step's batch in baseline batches
    r(S) = (sigma2 + mu2) / (sigma2 / S + mu2)   the gain: baseline steps of progress per step
                                         (capped where the policy caps it: adascale_adam)
    T(W, k, m)                           seconds per step (the model below)
    goodput = r(S) / T                   progress per second, in baseline steps
            = throughput (S B0 / T samples/s) x efficiency (r / S) / B0

The efficiency comes from the same sigma2 and mu2 whatever the policy: a fixed rule counts S
baseline steps per step, but r(S) is what the step is worth, so goodput says where linear
scaling stops paying too.

Step-time model, measured in the job (the adapters time each step; no extra synchronisation):

    T = o + k c(m) + s + a(W) + u  o  the step's own work outside its passes (zero_grad, the
                                     adapt decision, evaluation, logging: what the user's loop
                                     does once per step)
                               c(m) = c0 + c1 m   one forward + backward pass (its data included)
                               s     the statistics' read taken once a step inside the last
                                     pass (each worker's accumulated gradient, read where it is
                                     sent: samples="workers"), timed apart by the adapter; 0
                                     where none is timed (reads of every pass stay in c)
                               a(W)  the wait for the gradients' allreduce after the last pass
                               u     the update and the host's work of the step

AdaptDL fits T_compute and T_network to step times with a gamma-norm for their overlap (7
parameters, several (W, m) needed before it is identified). Here each part is timed directly:
the time from the previous step's end to ``step()`` is o + k c, and with k >= 2 the torch adapter
also times one pass alone (from the first gradient of the first pass to that of the last, over
k - 1), so one configuration identifies c and o apart; with k = 1 only, o is identified across
steps of several k (a least-squares line o + k c), else taken as 0 and stated (``identified``):
charged to the passes, a per-step cost would be predicted to grow with k. s is taken out of the
passes' time before that split, so even one k keeps the read per step (charged to the pass at
k = 1, it made B4's k = 8 predicted too slow once the read moved from every pass to one a step:
benchmarks/results/goodput_drift.md). a is the wait inside
``synchronize``, u the rest of ``step()``. c0 and c1 are a least-squares line over the
micro-batch sizes seen (one size: another m is assumed to cost in proportion, c(m) = c m /
m_seen). Another W is an extrapolation, stated wherever it is used: a ring allreduce moves
2 (W - 1) / W of the gradients per worker, so a(W) = a(W_seen) x [(W - 1) / W] / [(W_seen - 1) /
W_seen] and a(1) = 0; the wait measured is only what the passes did not hide, and a ring's
latency grows with W too, so the further from W_seen, the less it says.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Sequence

import numpy as np

from .estimate import gain_ratio


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """T(k, m, W) = o + k (c0 + c1 m) + s + a(W) + u, fitted at ``workers`` (see the module's
    docstring)."""

    compute: float         # c0 + c1 m_seen: seconds of one pass at the micro-batch seen
    per_sample: float | None  # c1; None when one micro-batch size was seen
    micro_batch: float     # m_seen: the (mean) micro-batch the compute was timed at
    allreduce: float       # a(W_seen): the wait for the gradients after the last pass
    update: float          # u: the rest of the step
    workers: int           # W_seen
    error: float = math.nan  # largest relative error of the mean step time of a configuration seen
    per_step: float = 0.0  # o: the step's own work outside its passes
    identified: bool = True  # o and c measured apart (else o = 0 was assumed: one k, no pass timed)
    statistics: float = 0.0  # s: the statistics' read once a step, timed apart (0: none timed)

    def pass_time(self, micro_batch: float | None = None) -> float:
        """c(m): one pass at ``micro_batch`` samples (default: the size seen)."""
        m = self.micro_batch if micro_batch is None else float(micro_batch)
        if self.per_sample is None:
            return self.compute * m / self.micro_batch  # one size seen: in proportion
        return self.compute + self.per_sample * (m - self.micro_batch)

    def allreduce_time(self, workers: int | None = None) -> float:
        """a(W), from the measured wait by the ring's traffic 2 (W - 1) / W (0 for one worker)."""
        w = self.workers if workers is None else int(workers)
        if w == self.workers:
            return self.allreduce
        if w <= 1:
            return 0.0
        if self.workers <= 1:
            raise ValueError("the allreduce time of more workers cannot be predicted from a "
                             "one-worker job (it had none)")
        return self.allreduce * ((w - 1) / w) / ((self.workers - 1) / self.workers)

    def step_time(self, passes: float, micro_batch: float | None = None,
                  workers: int | None = None) -> float:
        """Predicted seconds of one step of k passes."""
        return (self.per_step + passes * self.pass_time(micro_batch) + self.statistics
                + self.allreduce_time(workers) + self.update)


def fit_step_time(passes: Sequence[float], micro_batch: Sequence[float], compute: Sequence[float],
                  allreduce: Sequence[float], update: Sequence[float], *, workers: int,
                  per_pass: Sequence[float] | None = None,
                  statistics: Sequence[float] | None = None) -> StepTimeModel:
    """Fit the model to per-step timings (one entry per step: its passes k, micro-batch m, the
    seconds from the previous step's end to the wait (o + k c + s), of its allreduce wait and of
    its update; ``per_pass``: one pass timed alone, nan where it was not (k = 1); ``statistics``:
    the seconds of the step's once-a-step statistics read within that compute, nan or 0 where
    none was timed). Raises ValueError on empty or non-finite input, or a step with no
    passes."""
    k, m, c, a, u = (np.asarray(x, dtype=np.float64) for x in (passes, micro_batch, compute,
                                                                 allreduce, update))
    if not k.size or len({x.shape for x in (k, m, c, a, u)}) != 1 or k.ndim != 1:
        raise ValueError(f"expected one timing per step in each of passes, micro_batch, compute, "
                         f"allreduce, update, got lengths {[len(x) for x in (k, m, c, a, u)]}")
    values = np.concatenate([k, m, c, a, u])
    if not np.all(np.isfinite(values)) or np.any(values < 0) or np.any(k < 1) or np.any(m <= 0):
        raise ValueError("timings must be finite and >= 0, with passes >= 1 and micro_batch > 0")
    p = np.full(k.shape, np.nan) if per_pass is None else np.asarray(per_pass, dtype=np.float64)
    s = np.zeros(k.shape) if statistics is None else np.asarray(statistics, dtype=np.float64)
    if s.shape != k.shape:
        raise ValueError(f"expected one statistics time per step, got {s.size} for {k.size} steps")
    s = np.where(np.isfinite(s) & (s > 0), np.minimum(s, c), 0.0)
    c = c - s  # o + k c: the read is a step's, not a pass's
    timed = np.isfinite(p) & (p > 0)
    identified = True
    if timed.any():  # passes timed alone: o is the rest of each step's compute
        per_step = max(float(np.mean(c[timed] - k[timed] * p[timed])), 0.0)
    elif np.ptp(k) > 0:  # several k: the line o + k c through the steps' compute
        per_step = max(float(np.polyfit(k, c, 1)[1]), 0.0)
    else:  # one k and no pass timed alone: o cannot be told from c
        per_step, identified = 0.0, False
    per_pass_time = (c - per_step) / k
    # c(m) = c0 + c1 m by least squares: the line passes through the means, so c(m_seen) is the
    # mean pass time; a slope below 0 (noise) is taken as none.
    c1 = max(float(np.polyfit(m, per_pass_time, 1)[0]), 0.0) if np.ptp(m) > 0 else None
    model = StepTimeModel(compute=float(np.mean(per_pass_time)), per_sample=c1,
                          micro_batch=float(np.mean(m)), allreduce=float(np.mean(a)),
                          update=float(np.mean(u)), workers=int(workers), per_step=per_step,
                          identified=identified, statistics=float(np.mean(s)))
    # The error of the mean step time of each configuration seen (single steps scatter far more
    # on shared cores than their means, which is what goodput uses): with one configuration the
    # model reproduces its mean exactly, so the error says something only across k or m.
    measured = c + s + a + u
    errors = [abs(model.step_time(ki, mi) - np.mean(measured[(k == ki) & (m == mi)]))
              / max(float(np.mean(measured[(k == ki) & (m == mi)])), 1e-12)
              for ki, mi in set(zip(k.tolist(), m.tolist()))]
    return dataclasses.replace(model, error=float(max(errors)))


def gain_at(sigma2: float, mu2: float, scale: float, max_gain: float = math.inf) -> float:
    """r(S) from the current estimates (``estimate.gain_ratio``), capped at ``max_gain``; 1
    before any estimate (nan). S < 1 (a batch below the baseline) has no gain: ValueError."""
    if not scale >= 1.0:
        raise ValueError(f"the gain is defined for S >= 1 (the baseline batch or more), got S = "
                         f"{scale!r}")
    if math.isnan(sigma2) or math.isnan(mu2) or scale == 1.0:
        return 1.0
    return min(gain_ratio(sigma2, mu2, scale), max_gain)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration and what the model predicts for it."""

    workers: int
    passes: int
    micro_batch: float
    scale: float           # S = W k m / B0
    gain: float            # r(S): baseline steps of progress per step
    step_time: float       # T, seconds
    goodput: float         # r / T: baseline steps of progress per second

    @property
    def efficiency(self) -> float:
        return self.gain / self.scale

    @property
    def throughput(self) -> float:
        """Samples per second, in baseline batches: S / T."""
        return self.scale / self.step_time


def evaluate(model: StepTimeModel, sigma2: float, mu2: float, *, workers: int, passes: int,
             micro_batch: float, base_batch: float, max_gain: float = math.inf) -> Candidate:
    """The predicted gain, step time and goodput of one configuration."""
    scale = workers * passes * micro_batch / base_batch
    gain = gain_at(sigma2, mu2, scale, max_gain)
    seconds = model.step_time(passes, micro_batch, workers)
    return Candidate(int(workers), int(passes), float(micro_batch), scale, gain, seconds,
                     gain / seconds if seconds > 0 else math.inf)


def runnable(workers: int, passes: int, micro_batch: float, base_batch: float) -> bool:
    """A configuration a policy can run: S >= 1 (no policy is defined below the baseline batch:
    the lr would shrink and tau fall behind the data), and at S > 1 two micro-gradients or more,
    the fewest that measure a variance (AdaptDL too never goes below the initial batch and keeps
    two micro-batches or more at one replica)."""
    scale = workers * passes * micro_batch / base_batch
    return scale >= 1.0 and (scale == 1.0 or workers * passes >= 2)


def candidates(model: StepTimeModel, sigma2: float, mu2: float, *, workers: Iterable[int],
               passes: Iterable[int], micro_batches: Iterable[float], base_batch: float,
               max_gain: float = math.inf) -> list[Candidate]:
    """Every configuration of the grid that can run (``runnable``), evaluated (in the grid's
    order)."""
    return [evaluate(model, sigma2, mu2, workers=w, passes=k, micro_batch=m, base_batch=base_batch,
                     max_gain=max_gain)
            for w, k, m in itertools.product(workers, passes, micro_batches)
            if runnable(w, k, m, base_batch)]


def best(options: Sequence[Candidate]) -> Candidate:
    """The configuration of largest goodput (ties: the smallest batch, then the fewest workers)."""
    if not options:
        raise ValueError("no configuration to choose from")
    return max(options, key=lambda c: (c.goodput, -c.scale, -c.workers))


def choose_passes(model: StepTimeModel, sigma2: float, mu2: float, *, current: int,
                  max_passes: int, micro_batch: float, base_batch: float,
                  max_gain: float = math.inf, hysteresis: float = 0.05,
                  min_passes: int = 1) -> int:
    """The k in [min_passes, max_passes] of largest goodput at the model's W and m among those
    that can run (``runnable``), keeping ``current`` unless the best predicts ``hysteresis`` (a
    fraction) more goodput than it (the estimates and timings are noisy: without it k would flap
    between near-equal choices)."""
    if not 1 <= min_passes <= current <= max_passes:
        raise ValueError(f"current passes {current!r} must be in [min_passes = {min_passes}, "
                         f"max_passes = {max_passes}]")
    grid = candidates(model, sigma2, mu2, workers=[model.workers],
                      passes=range(min_passes, max_passes + 1), micro_batches=[micro_batch],
                      base_batch=base_batch, max_gain=max_gain)
    now = evaluate(model, sigma2, mu2, workers=model.workers, passes=current,
                   micro_batch=micro_batch, base_batch=base_batch, max_gain=max_gain)
    if not grid:
        return current
    top = best(grid)
    return top.passes if top.goodput > (1.0 + hysteresis) * now.goodput else current
