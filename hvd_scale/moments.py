"""Adam's moment horizons counted in progress, not in optimizer steps (``adascale_adam``'s default).

Adam keeps two exponential moving averages, m <- b1 m + (1 - b1) g and v <- b2 v + (1 - b2) g^2,
each over about 1 / (1 - b) *steps*. A step at gain r is r baseline steps of progress (tau += r),
so with the betas left alone the moments of a run at scale average over r times more progress than
the baseline run's, v lags the gradients, and the steps come out smaller than sqrt(r) assumes
(measured on B4: 44 -> 72 BLEU at S = 128, see benchmarks/README.md). Keeping each horizon fixed
in baseline steps (Malladi et al., NeurIPS 2022, to first order: 1 - b -> r (1 - b)) gives, for
the step that applies gain r and ends at progress tau:

    b_i'   = b_i ** r                  the moments forget as r baseline steps would
    eps'   = eps / sqrt(r)             v of an r-times larger batch is ~r times smaller
    bias correction  1 - prod b_i' = 1 - b_i ** tau   (exponents add up to tau: no extra state)
    decoupled decay (AdamW)   w <- w (1 - lr wd) ** r  per step: the baseline's per unit of tau

Frameworks correct the bias with their own step count t, as 1 - b'^t, and differ in where eps
goes: torch divides by sqrt(v) / sqrt(1 - b2^t) + eps, Keras by sqrt(v) + eps after folding
sqrt(1 - b2^t) into the lr. ``adam_step`` returns the lr, betas, eps and weight decay to hand the
framework for one step so that its own formula computes the update above. With r = 1 and tau = t
(every step so far at gain 1) it returns the user's values untouched: plain Adam, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

# The framework's eps sits in the denominator beside sqrt(v_hat) (bias-corrected, torch) or
# beside sqrt(v) (uncorrected, Keras: its bias correction is folded into the lr).
EPS_CORRECTED = "corrected"
EPS_RAW = "raw"


@dataclasses.dataclass(frozen=True)
class AdamStep:
    """What to set on the framework's optimizer for one step (then restore the user's values)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float | None  # decoupled (AdamW) decay coefficient; None: leave it


def bias_correction(beta: float, progress: float) -> float:
    """1 - beta ** tau: the bias correction of an EMA after tau baseline steps of progress."""
    return 1.0 - beta ** progress


def moment_progress(progress: float, policy_steps: int, framework_steps: int, maximum=max) -> float:
    """The exponent of Adam's bias correction: tau, plus one for each update the framework made
    that the policy did not account (Horovod's ``broadcast_optimizer_state`` initializes Adam
    with one zero-gradient step; a state loaded from a plain run), taken as baseline steps. With
    every step at gain 1 it is the framework's own count: plain Adam, bit for bit. ``maximum``:
    a framework's elementwise maximum, for tensors inside a traced step (Keras)."""
    return progress + maximum(framework_steps - policy_steps, 0)


def adam_step(*, lr: float, base_lr: float, beta1: float, beta2: float, eps: float, gain: float,
              progress: float, framework_step: int, eps_placement: str = EPS_CORRECTED,
              weight_decay: float | None = None) -> AdamStep:
    """The framework's settings for one Adam step at gain r with horizons in progress.

    lr: the step's lr as the policy sets it (baseline lr x factor); base_lr: the baseline lr (the
    decoupled decay is the baseline's, per unit of tau); beta1, beta2, eps, weight_decay: the
    user's; gain: r of this step; progress: the bias correction's exponent after this step (tau,
    ``moment_progress``); framework_step: the step count t the framework will use for its bias
    correction (after its increment).
    """
    if not gain >= 1.0 or not math.isfinite(gain):
        raise ValueError(f"gain must be a finite number >= 1, got {gain!r}")
    if eps_placement not in (EPS_CORRECTED, EPS_RAW):
        raise ValueError(f"eps_placement must be {EPS_CORRECTED!r} or {EPS_RAW!r}, got {eps_placement!r}")
    b1, b2 = beta1 ** gain, beta2 ** gain
    # The update wanted:    lr / c1 * m / (sqrt(v) / sqrt(c2) + eps')    c_i = 1 - beta_i ** tau
    #   = lr sqrt(c2) / c1 * m / (sqrt(v) + eps' sqrt(c2))
    # The framework's:      lr' sqrt(f2) / f1 * m / (sqrt(v) + e)        f_i = 1 - b_i ** t
    # with e = eps'' sqrt(f2) (torch). Equal when lr' = lr x ratio and eps'' = eps' sqrt(c2 / f2).
    # Keras's eps sits beside sqrt(v) in its own baseline too, lr sqrt(f2) / f1 m / (sqrt(v) +
    # eps): the same lr' with eps'' = eps' gives lr sqrt(c2) / c1 m / (sqrt(v) + eps').
    c1, c2 = bias_correction(beta1, progress), bias_correction(beta2, progress)
    f1, f2 = 1.0 - b1 ** framework_step, 1.0 - b2 ** framework_step
    ratio = (math.sqrt(c2) / c1) / (math.sqrt(f2) / f1)
    if gain == 1.0 and ratio == 1.0:
        return AdamStep(lr, beta1, beta2, eps, weight_decay)  # plain Adam, bit for bit
    step_eps = eps / math.sqrt(gain)
    if eps_placement == EPS_CORRECTED:
        step_eps *= math.sqrt(c2 / f2)
    step_lr = lr * ratio
    decay = None
    if weight_decay is not None and not 0.0 <= base_lr * weight_decay < 1.0:
        raise ValueError(f"lr x weight_decay must be in [0, 1) for decoupled decay, got "
                         f"{base_lr!r} x {weight_decay!r}")
    if weight_decay is not None and weight_decay != 0.0 and step_lr != 0.0:
        # The baseline decays by (1 - base_lr wd) per baseline step: (1 - base_lr wd) ** r here.
        decay = -math.expm1(gain * math.log1p(-base_lr * weight_decay)) / step_lr
    elif weight_decay is not None:
        decay = weight_decay
    return AdamStep(step_lr, b1, b2, step_eps, decay)
