"""Baseline learning-rate schedules evaluated in scale-invariant iterations.

A schedule is written once for the baseline run (S = 1) as lr(t), t in baseline steps. At any
scale the step with progress tau uses lr(floor(tau)) times the policy's factor, and training ends
at tau >= T, so one schedule and one budget serve every policy and every scale.

Schedules are small frozen dataclasses (their hyperparameters show in reprs and configs) that map a
step count to an lr; ``lr_at(schedule, tau)`` does the flooring.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence, Union


def _check_lr(lr: float) -> float:
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"learning rate must be a finite number > 0, got {lr!r}")
    return float(lr)


@dataclasses.dataclass(frozen=True)
class Constant:
    """lr(t) = lr."""

    lr: float

    def __post_init__(self):
        _check_lr(self.lr)

    def __call__(self, t: int) -> float:
        return self.lr


@dataclasses.dataclass(frozen=True)
class StepDecay:
    """lr(t) = lr * gamma ** (number of milestones <= t)   (torch's MultiStepLR)."""

    lr: float
    milestones: Sequence[int]
    gamma: float = 0.1

    def __post_init__(self):
        _check_lr(self.lr)
        if list(self.milestones) != sorted(self.milestones) or any(m < 0 for m in self.milestones):
            raise ValueError(f"milestones must be non-negative and increasing, got {list(self.milestones)}")
        if not 0 < self.gamma:
            raise ValueError(f"gamma must be > 0, got {self.gamma!r}")
        object.__setattr__(self, "milestones", tuple(int(m) for m in self.milestones))

    def __call__(self, t: int) -> float:
        return self.lr * self.gamma ** sum(1 for m in self.milestones if t >= m)


@dataclasses.dataclass(frozen=True)
class Exponential:
    """lr(t) = lr * decay_rate ** (t / decay_steps)   (the AdaScale paper's CIFAR grid)."""

    lr: float
    decay_rate: float
    decay_steps: float = 1.0

    def __post_init__(self):
        _check_lr(self.lr)
        if not 0 < self.decay_rate or not 0 < self.decay_steps:
            raise ValueError(f"decay_rate and decay_steps must be > 0, got "
                             f"{self.decay_rate!r}, {self.decay_steps!r}")

    def __call__(self, t: int) -> float:
        return self.lr * self.decay_rate ** (t / self.decay_steps)


@dataclasses.dataclass(frozen=True)
class Cosine:
    """lr(t) = final + (lr - final) (1 + cos(pi min(t, T) / T)) / 2   over T = total baseline steps."""

    lr: float
    total: int
    final: float = 0.0

    def __post_init__(self):
        _check_lr(self.lr)
        if self.total <= 0:
            raise ValueError(f"total (baseline steps) must be > 0, got {self.total!r}")
        if not 0 <= self.final <= self.lr:
            raise ValueError(f"final lr must be in [0, lr], got {self.final!r}")

    def __call__(self, t: int) -> float:
        frac = min(t, self.total) / self.total
        return self.final + (self.lr - self.final) * 0.5 * (1.0 + math.cos(math.pi * frac))


Schedule = Union[Constant, StepDecay, Exponential, Cosine, Callable[[int], float]]


def lr_at(schedule: Schedule | float, tau: float) -> float:
    """The baseline lr for the step at progress tau: schedule(floor(tau)); a float is constant."""
    if isinstance(schedule, (int, float)):
        return _check_lr(schedule)
    if not callable(schedule):
        raise TypeError(f"schedule must be a float or a callable step -> lr, got {type(schedule).__name__}")
    return float(schedule(int(math.floor(tau))))
