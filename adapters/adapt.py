"""adapt="goodput": where each step's time goes, and which k (passes per step) to take next.

The clock times each step from host stamps at points the adapter passes anyway; every
``every`` steps rank 0 fits ``hvd_scale.goodput``'s step-time model to its history and picks the k
of largest predicted goodput (``goodput.choose_passes``), within [the k the job started with,
``max_passes``] and among configurations that can run. ``core.Scaling`` broadcasts the choice and
applies it. No framework is imported here.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any

from hvd_scale import goodput

ADAPT = ("goodput",)
# Every this many steps the ranks agree on k; a change needs this much more predicted goodput
# than staying (estimates and timings are noisy: without it k would flap). The decision is rank
# 0's (its timings), broadcast: one small collective per interval.
ADAPT_EVERY = 50
ADAPT_HYSTERESIS = 0.05


def check_passes(backward_passes_per_step: Any) -> int:
    """k, the backward passes (micro-batches) per optimizer step: an int >= 1, not a bool."""
    k = backward_passes_per_step
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {k!r}")
    return k


class StepClock:
    """Where each step's time goes (``hvd_scale.goodput``'s model). The step's own work and its
    passes take from the previous step's end to the wait for its gradients (``waiting``); with
    k >= 2 the first gradient of each pass (``pass_started``) times one pass alone; the wait lasts
    until ``waited``, the update until the step's end (``ended``): known only after the step, so
    each step's row carries the previous step's update. Between ``reading`` and ``read`` the
    adapter takes the statistics' once-a-step read (each worker's gradient where it is sent):
    its seconds before the wait are the model's s, a step's cost (charged to the passes at k = 1
    it would be predicted to grow with k). The first step after construction has no previous
    end: its times are nan and not kept. No synchronisation is added."""

    HISTORY = 400  # steps kept for the model (``goodput.fit_step_time``)

    def __init__(self):
        self._end = self._wait = self._waited = None
        self._passes: list[float] = []  # the first gradient of each pass of this step
        self._update = math.nan
        self._reads, self._reading = 0.0, None  # this step's statistics read before the wait
        self.history: collections.deque = collections.deque(maxlen=self.HISTORY)

    def pass_started(self) -> None:
        self._passes.append(time.perf_counter())

    def reading(self) -> None:
        self._reading = time.perf_counter()

    def read(self) -> None:
        if self._reading is not None and self._wait is None:  # inside the passes' time
            self._reads += time.perf_counter() - self._reading
        self._reading = None

    def waiting(self) -> None:
        self._wait = time.perf_counter()

    def waited(self) -> None:
        self._waited = time.perf_counter()

    def ended(self) -> None:
        now = time.perf_counter()
        if self._waited is not None:
            self._update = now - self._waited
        self._end, self._wait, self._waited, self._passes = now, None, None, []
        self._reads, self._reading = 0.0, None

    def lap(self, passes: int, workers: int) -> dict[str, float]:
        """This step's ``hvd_scale.metrics.TIMING_METRICS``; a complete row joins the history."""
        compute = wait = one_pass = math.nan
        if None not in (self._end, self._wait, self._waited):
            compute, wait = self._wait - self._end, self._waited - self._wait
        starts = self._passes
        if len(starts) >= 2 and len(starts) == passes:  # first gradient to first gradient
            one_pass = (starts[-1] - starts[0]) / (passes - 1)
        row = (passes, compute, wait, self._update)
        if all(math.isfinite(x) for x in row):
            self.history.append((workers,) + row + (one_pass, self._reads))
        overhead = compute - passes * one_pass
        step_time = compute + wait + self._update
        return {"passes": float(passes), "workers": float(workers),
                "pass_time": compute / passes if math.isnan(one_pass) else one_pass,
                "overhead_time": overhead, "allreduce_time": wait, "update_time": self._update,
                "step_time": step_time, "statistics_time": self._reads}

    def model(self, workers: int) -> goodput.StepTimeModel | None:
        """The step-time model fitted to the kept steps at ``workers`` (None without any)."""
        rows = [r[1:6] + (r[6] if len(r) > 6 else 0.0,) for r in self.history if r[0] == workers]
        if not rows:
            return None
        k, compute, wait, update, one_pass, reads = zip(*rows)
        # One micro-batch size: the model is in passes (m = 1 in its own units).
        return goodput.fit_step_time(k, [1.0] * len(k), compute, wait, update, workers=workers,
                                     per_pass=one_pass, statistics=reads)


class Adaptation:
    """The settings of adapt="goodput", validated, and rank 0's choice of k.

    adapt None or "goodput"; with it, max_passes an int >= the starting k, every an int >= 1, and
    the statistics measured. k never goes below the k the job started with (``min_passes``): the
    baseline batch may be several micro-batches (``scale=``), and fewer micro-gradients may
    measure no variance."""

    def __init__(self, adapt: Any, max_passes: Any, every: Any, passes: int, measure: bool | None):
        if adapt is None:
            if max_passes is not None:
                raise ValueError(f"max_passes={max_passes!r} is for adapt='goodput' (adapt is None)")
            self.adapt, self.max_passes, self.every, self.min_passes = None, None, ADAPT_EVERY, passes
            return
        if adapt not in ADAPT:
            raise ValueError(f"adapt must be None or one of {list(ADAPT)}, got {adapt!r}")
        k = check_passes(max_passes) if max_passes is not None else None
        if k is None or k < passes:
            raise ValueError(f"adapt={adapt!r} needs max_passes, an integer >= "
                             f"backward_passes_per_step ({passes}), got {max_passes!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"adapt_every must be an integer >= 1, got {every!r}")
        if measure is False:
            raise ValueError("adapt='goodput' needs the gradient statistics (the gain at another "
                             "k): measure=False cannot go with it")
        self.adapt, self.max_passes, self.every, self.min_passes = adapt, k, every, passes

    def settings(self) -> dict[str, Any]:
        """What every rank must share (compared at set-up)."""
        return {"adapt": self.adapt, "max_passes": self.max_passes, "adapt_every": self.every}

    def due(self, steps: int) -> bool:
        """A decision after this many steps (alike on every rank)."""
        return self.adapt is not None and steps > 0 and steps % self.every == 0

    def choose(self, clock: StepClock, *, sigma2: float, mu2: float, scale: float, passes: int,
               workers: int, max_gain: float = math.inf) -> int:
        """The k of largest predicted goodput at ``workers`` (rank 0's timings), or ``passes``
        before there is a model or an estimate."""
        model = clock.model(workers)
        if model is None or math.isnan(sigma2):
            return passes
        # In units of one micro-batch: S = W k u, u = S / (W k) baseline batches.
        unit = scale / (workers * passes)
        return goodput.choose_passes(model, sigma2, mu2, current=passes,
                                     max_passes=self.max_passes, micro_batch=1.0,
                                     base_batch=1.0 / unit,
                                     min_passes=min(self.min_passes, passes), max_gain=max_gain,
                                     hysteresis=ADAPT_HYSTERESIS)
