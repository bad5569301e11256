"""AdaScale's gain: unbiased variance estimates from one step's micro-gradients, smoothed.

Legend (Johnson et al., "AdaScale SGD", ICML 2020, section 3 and appendix B.3):

    n      micro-gradients g_1..g_n averaged in one optimizer step (workers x backward passes)
    S      scale: the step's batch over the baseline batch B0 (S = n when a micro-batch is B0)
    m      mean_i |g_i|^2               q = |g_bar|^2, g_bar = mean_i g_i
    sigma2 trace of the covariance of one *baseline-batch* gradient (``grad_var``)
    mu2    |grad F|^2, the squared norm of the true gradient (``grad_sqr``)
    r      gain ratio (sigma2 + mu2) / (sigma2 / S + mu2), always within [1, S]

A micro-gradient has variance sigma2 * n / S, so E[m - q] = (sigma2 * n / S) (n - 1) / n and
E[q] = mu2 + sigma2 / S, which give the unbiased estimators

    sigma2_hat = S (m - q) / (n - 1)        mu2_hat = (n q - m) / (n - 1) = q - sigma2_hat / S

They are smoothed as they are, by a debiased exponential moving average
b <- theta b + (1 - theta) x,  u <- theta u + (1 - theta),  x_bar = b / u,  and clipped only when
read (sum over groups of mu2_bar >= 0; AdaptDL does the same). Clipping each step's mu2_hat at 0
first would bias the EMA upwards wherever the noise dominates: with n = S = 2 and sigma2 / mu2 =
100 the clipped steps average ~3x the true mu2, and the gain predicted at S = 16 comes out 21%
low (tests/test_estimate.py). sigma2_hat >= 0 holds for every step (m >= q); it is floored at
SIGMA2_FLOOR * m only against a step whose micro-gradients are all equal.

Cheaper statistics, whose reads per step do not grow with the k backward passes per worker
(W workers, n = W k micro-gradients, S unchanged; q is always |g_bar|^2 of the full average):

    workers   each worker reads once the sum G_w of its k_w passes, when it sends it:
              s = sum_w |G_w|^2 / k_w, n = sum_w k_w, handed with samples = W. G_w / k_w is
              one i.i.d. sample of k_w micro-batches, so E[s] = n mu_b^2 + W V (V: one micro-
              gradient's variance) and E[m - q] = (W - 1) V / n: the estimators above with
              samples - 1 in place of n - 1 stay unbiased, for any k_w. Needs W >= 2. Still
              m >= q (Cauchy-Schwarz). The adapters' default from two workers on (``SAMPLES``).
    sampled   one pass per worker chosen at random, r = W of the n micro-gradients, handed as
              s = (n / r) sum_{i in R} |g_i|^2 with n = W k: for a subset R chosen without
              looking at the gradients E[s / n] = E|g|^2, so both estimators keep their means.
              But m >= q no longer holds: a step's sigma2_hat can be < 0, and the floor above
              then clips it, biasing the smoothed sigma2 upwards where that is frequent (few
              reads; noise of low rank with the signal along it). Not offered: measured only.

``estimate_variances`` gives each one's per-step variance for Gaussian micro-gradients
(tests/test_estimator_sampling.py, benchmarks/investigations/estimator_variance.py).

Everything here is numpy. Statistics are floats, or 1-D arrays with one entry per parameter group;
the gain uses the sums over groups (one lr factor for the whole model, as in the paper).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

# A relative floor, in units of the step's own mean squared micro-gradient norm m: an absolute
# floor (the paper's 1e-6) would dominate a model whose gradients are tiny, and a zero variance
# estimate would make mu2 alone decide the gain from a single lucky step.
SIGMA2_FLOOR = 1e-6

# Default smoothing: theta = DEFAULT_DECAY ** S keeps the EMA's horizon at ~1000 *baseline*
# batches at every scale (the paper's max(1 - S/1000, 0) agrees for small S but drops to no
# smoothing at all for S >= 1000).
DEFAULT_DECAY = 0.999

STATE_VERSION = 1


def _as_stat(name: str, value: Any) -> np.ndarray:
    """Turn a float or 1-D array into a float64 1-D array, rejecting NaN, Inf and negatives."""
    arr = np.atleast_1d(np.asarray(value, dtype=np.float64))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a float or a non-empty 1-D array (one entry per "
                         f"parameter group), got shape {np.shape(value)}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {arr.tolist()}: a non-finite gradient "
                         "must be skipped before its statistics reach the estimator")
    if np.any(arr < 0):
        raise ValueError(f"{name} is a sum of squared norms and must be >= 0, got {arr.tolist()}")
    return arr


def check_scale(scale: Any) -> float:
    """Validate a scale S: a finite number >= 1."""
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number >= 1, got {scale!r}") from None
    if not math.isfinite(s) or s < 1:
        raise ValueError(f"scale must be a finite number >= 1 (the step's batch over the "
                         f"baseline batch), got {scale!r}")
    return s


# What a step's sqnorm_sum reads (an adapter's ``samples=``): "passes", every micro-gradient
# (a hook per tensor and pass: cost grows with k); "workers", each worker's accumulated gradient
# once (cost flat in k; needs W >= 2); "auto", workers from two workers on, else passes.
# benchmarks/results/estimator_variance.md measures what each costs in variance.
SAMPLES = ("auto", "workers", "passes")
# The environment's choice where the code leaves samples="auto" (a job's script unchanged).
SAMPLES_ENV = "HVD_SCALE_SAMPLES"


def check_samples(samples: Any, environment: str | None = None) -> str:
    """The user's ``samples=`` request, one of ``SAMPLES``; ``environment``:
    ``$HVD_SCALE_SAMPLES``, taken where ``samples`` is "auto". ValueError naming the source."""
    if samples == "auto" and environment:
        where, samples = f"${SAMPLES_ENV}={environment!r}", environment
    else:
        where = f"samples={samples!r}"
    if samples not in SAMPLES:
        raise ValueError(f"{where}: must be one of {SAMPLES}")
    return samples


def samples_read(request: str, workers: int) -> str:
    """What a step's statistics read at W = ``workers`` for the request ``request``
    (``check_samples``): "workers" from two workers on unless "passes" was asked; with one
    worker every pass (its k >= 2 passes are the samples: one worker's sum has no variance),
    "workers" included (the job shrank to one worker under Horovod elastic). It follows the
    layout: a change of W switches it at the next step."""
    return "passes" if request == "passes" or workers < 2 else "workers"


def resolve_samples(samples: Any, workers: int, environment: str | None = None) -> str:
    """"workers" or "passes" for an adapter's ``samples=`` at a fixed W = ``workers``
    (``check_samples``, ``samples_read``): an explicit "workers" with one worker is refused (a
    job that stays at one worker could never read it; under Horovod elastic, where W changes,
    the adapters take ``samples_read`` instead)."""
    request = check_samples(samples, environment)
    if request == "workers" and workers < 2:
        raise ValueError(f"samples={samples!r} reads one accumulated gradient per worker and "
                         f"needs at least 2 workers to see a variance, got {workers}: use "
                         "'passes' (or 'auto')")
    return samples_read(request, workers)


def check_smoothing(smoothing: Any) -> float | None:
    if smoothing is None:
        return None
    theta = float(smoothing)
    if not 0.0 <= theta < 1.0:
        raise ValueError(f"smoothing (the EMA's theta) must be in [0, 1), got {smoothing!r}")
    return theta


def default_smoothing(scale: float) -> float:
    """theta = 0.999 ** S: the EMA forgets at the same pace in baseline batches at every scale."""
    return DEFAULT_DECAY ** scale


def estimate_moments(sqnorm_sum, mean_sqnorm, n: int, scale: float,
                     samples: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One step's unbiased (sigma2_hat, mu2_hat), per parameter group; mu2_hat may be < 0 (the
    EMA takes it as it is; ``summed_moments`` clips when reading).

    sqnorm_sum: sum over the n micro-gradients of |g_i|^2 (summed over all workers).
    mean_sqnorm: |g_bar|^2 of their average.
    samples: the independent samples sqnorm_sum sums over (None: the n micro-gradients). With
        per-worker statistics, W workers each read once: sqnorm_sum = sum_w |G_w|^2 / k_w, G_w
        the sum of worker w's k_w passes (sum_w k_w = n), and samples = W. Then
        E[sqnorm_sum] = n mu_b^2 + W V (V: one micro-gradient's variance, mu_b^2 = |E g|^2) and
        E[n q] = n mu_b^2 + V, so E[m - q] = (W - 1) V / n for any k_w: the same estimator with
        samples - 1 in place of n - 1 (at W = n, today's).
    """
    sqnorm_sum = _as_stat("sqnorm_sum", sqnorm_sum)
    mean_sqnorm = _as_stat("mean_sqnorm", mean_sqnorm)
    if sqnorm_sum.shape != mean_sqnorm.shape:
        raise ValueError(f"sqnorm_sum and mean_sqnorm need one entry per parameter group each, "
                         f"got shapes {sqnorm_sum.shape} and {mean_sqnorm.shape}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) and not float(n).is_integer():
        raise ValueError(f"n (micro-gradients in the step) must be a whole number, got {n!r}")
    n = int(n)
    if n < 2:
        raise ValueError(
            f"n = {n} micro-gradients give no variance estimate (need n >= 2; got scale {scale}): "
            "use at least 2 workers or backward_passes_per_step >= 2, or a fixed policy "
            "(none, linear, sqrt, warmup)")
    samples = n if samples is None else int(samples)
    if not 2 <= samples <= n:
        raise ValueError(f"samples = {samples!r}: the independent samples of a step's statistics "
                         f"must be between 2 and its n = {n} micro-gradients")
    m = sqnorm_sum / n
    q = mean_sqnorm
    # sigma2 = S V / n (a baseline batch is n / S micro-batches) and E[m - q] = (samples - 1) V / n
    sigma2 = np.maximum(scale * (m - q) / (samples - 1), SIGMA2_FLOOR * m)
    mu2 = (samples * q - m) / (samples - 1)  # q - sigma2_hat / S unfloored: E[q] = mu2 + V / n
    return sigma2, mu2


def estimate_variances(n: int, scale: float, trace_c2: float, mu_c_mu: float = 0.0,
                       reads: int | None = None) -> tuple[float, float]:
    """Predicted variances of one step's (sigma2_hat, mu2_hat) for Gaussian micro-gradients.

    C is the covariance of one baseline-batch gradient (tr C = sigma2), mu the true gradient:
    trace_c2 = tr(C^2), mu_c_mu = mu^T C mu. n and scale are what the engine is handed (n = W for
    the per-worker statistics); reads = r <= n is how many micro-gradients' norms enter
    sqnorm_sum, scaled by n / r (None: all n).
    """
    r = n if reads is None else reads
    if not 2 <= n or not 1 <= r <= n:
        raise ValueError(f"need n >= 2 and 1 <= reads <= n, got n = {n}, reads = {reads}")
    # A micro-gradient is mu + e, e ~ N(0, C'), C' = (n / S) C. m_R - q (m_R: the mean over the r
    # read) is 2 mu.(e_R_bar - e_bar), variance 4 (1/r - 1/n) mu^T C' mu, plus sum_ij B_ij e_i.e_j,
    # variance 2 tr(B^2) tr(C'^2) with tr(B^2) = 1/r - 1/n^2; for Gaussian e the two are
    # uncorrelated. Reading all n the linear term cancels: a chi-square, 2 tr(C^2) / (n - 1).
    var_sigma2 = (2 * (n * n / r - 1) * trace_c2
                  + 4 * scale * (n / r - 1) * mu_c_mu) / (n - 1) ** 2
    # q = |mu + e_bar|^2 with e_bar ~ N(0, C / S), uncorrelated with sigma2_hat for every r
    # (the covariance's terms cancel), so mu2_hat = q - sigma2_hat / S adds the two.
    var_q = 4 * mu_c_mu / scale + 2 * trace_c2 / scale ** 2
    var_mu2 = var_q + var_sigma2 / scale ** 2
    return var_sigma2, var_mu2


def summed_moments(sigma2, mu2) -> tuple[float, float]:
    """(sigma2, mu2) summed over parameter groups and clipped at 0: the values every reading of
    the estimates uses (the EMAs hold the unclipped per-step estimates)."""
    return max(float(np.sum(sigma2)), 0.0), max(float(np.sum(mu2)), 0.0)


def gain_ratio(sigma2, mu2, scale: float) -> float:
    """r = (sigma2 + mu2) / (sigma2 / S + mu2), from the sums over parameter groups.

    With no signal at all (both zero) the gain is 1: nothing justifies a larger step.
    """
    var, sqr = summed_moments(sigma2, mu2)
    denominator = var / scale + sqr
    if denominator <= 0.0:
        return 1.0
    # Clip only rounding: mathematically r is within [1, S] for any sigma2, mu2 >= 0.
    return min(max((var + sqr) / denominator, 1.0), scale)


@dataclasses.dataclass(frozen=True)
class EstimatorState:
    """Debiased EMAs of sigma2 and mu2 (per parameter group) and their shared bias weight u."""

    sigma2_biased: np.ndarray | None = None  # float64[groups], b for sigma2
    mu2_biased: np.ndarray | None = None     # float64[groups], b for mu2
    bias_weight: float = 0.0                 # u; the estimate is b / u
    updates: int = 0

    def to_dict(self) -> dict:
        return {
            "sigma2_biased": None if self.sigma2_biased is None else self.sigma2_biased.tolist(),
            "mu2_biased": None if self.mu2_biased is None else self.mu2_biased.tolist(),
            "bias_weight": self.bias_weight,
            "updates": self.updates,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "EstimatorState":
        check_keys("estimator state", d, {"sigma2_biased", "mu2_biased", "bias_weight", "updates"})
        arr = lambda v: None if v is None else np.asarray(v, dtype=np.float64)  # noqa: E731
        return cls(arr(d["sigma2_biased"]), arr(d["mu2_biased"]), float(d["bias_weight"]),
                   int(d["updates"]))


def ema_update(state: EstimatorState, sigma2: np.ndarray, mu2: np.ndarray,
               theta: float) -> EstimatorState:
    """b <- theta b + (1 - theta) x for both estimates; u <- theta u + (1 - theta)."""
    if state.sigma2_biased is None:
        zeros = np.zeros_like(sigma2)
        state = dataclasses.replace(state, sigma2_biased=zeros, mu2_biased=zeros)
    elif state.sigma2_biased.shape != sigma2.shape:
        raise ValueError(f"the estimator tracks {state.sigma2_biased.size} parameter group(s), "
                         f"got statistics for {sigma2.size}")
    return EstimatorState(
        sigma2_biased=theta * state.sigma2_biased + (1 - theta) * sigma2,
        mu2_biased=theta * state.mu2_biased + (1 - theta) * mu2,
        bias_weight=theta * state.bias_weight + (1 - theta),
        updates=state.updates + 1,
    )


def fold(state: EstimatorState, sqnorm_sum, mean_sqnorm, n: int, scale: float,
         theta: float, samples: int | None = None) -> EstimatorState:
    """The estimator's state after one step's statistics at scale S (``estimate_moments``, then
    ``ema_update``; ``samples``: per-worker statistics). At S = 1 with one micro-gradient nothing
    is estimated (the gain is 1); the statistics are still checked. Bad input raises ValueError."""
    if scale == 1.0 and int(n) == 1:
        _as_stat("sqnorm_sum", sqnorm_sum), _as_stat("mean_sqnorm", mean_sqnorm)
        return state
    sigma2, mu2 = estimate_moments(sqnorm_sum, mean_sqnorm, n, scale, samples)
    return ema_update(state, sigma2, mu2, theta)


def smoothed(state: EstimatorState) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """The debiased EMAs b / u of sigma2 and mu2 per group (None, None before any update)."""
    if state.sigma2_biased is None:
        return None, None
    return state.sigma2_biased / state.bias_weight, state.mu2_biased / state.bias_weight


# -- the warm-in: the gain from young estimates ---------------------------------------------------
#
# The smoothed sigma2 and mu2 after t steps average about t noisy per-step estimates, so the first
# steps' gains would come from one to a few of them: with noise of low rank and two samples a step
# (W 2 x k 8) step 1's gain is off by more than x 1.5 in ~70% of runs, up to S
# (benchmarks/results/warm_in.md). Write the gain as
#
#     r - 1 = (1 - 1/S) sigma2 / q,       q = sigma2 / S + mu2 = E|g_bar|^2 at S
#
# sigma2_hat and q_hat are uncorrelated (``estimate_variances``), so the variance of log(r - 1) is
# the sum of their relative variances. For Gaussian micro-gradients, whatever the covariance's
# shape (tr C^2 <= sigma2^2 and mu^T C mu <= mu2 sigma2: noise of rank one is the worst case),
# one step's
#
#     var(sigma2_hat) / sigma2^2 <= 2 / (samples - 1) <= 2        (two samples a step: the fewest)
#     var(q_hat) / q^2 <= (4 mu2 sigma2 / S + 2 sigma2^2 / S^2) / q^2 <= 2
#
# V, their sum, taken at the estimates. The debiased EMA of t steps at theta (bias weight
# u = 1 - theta^t) holds n_eff = (sum w)^2 / sum w^2 = u (1 + theta) / ((1 - theta)(2 - u)) steps'
# worth, tending to its horizon's (1 + theta) / (1 - theta); the variance V / n_eff exceeds what
# the EMA keeps at its horizon (the noise chosen with theta, which stays) by
#
#     v = V (1 / n_eff - (1 - theta) / (1 + theta)) = V 2 (1 - theta)(1 - u) / ((1 + theta) u)
#
# (about V / t early on). The gain applied is the lower z-sigma bound of r - 1 allowed F times
# over, which is the estimate itself once that bound is within x F of it:
#
#     r_applied - 1 = (r_hat - 1) min(1, F exp(-z sqrt(v)))          z = 2, F = 1.5
#
# So the warm-in's length is the estimates' own: how many steps the EMA holds at S's theta, and
# how noisy the estimates say a step is (a signal-dominated q needs fewer). No state beyond the
# EMA's; without smoothing (theta = 0: each step's own estimate asked for) v = 0, no warm-in. The
# samples a step read are not in the record, so its variance is taken at the fewest (2): per-pass
# statistics warm in as long as per-worker ones. At a change of S, theta's is taken.
WARM_IN_Z = 2.0       # z = 0: no warm-in (the engine's tests of other mechanics)
WARM_IN_FACTOR = 1.5


def estimated_gain(state: EstimatorState, scale: float, theta: float) -> float:
    """The gain a step at scale S applies from the estimates smoothed at ``theta``: r in [1, S],
    held toward 1 while the EMA is young (the warm-in above); 1 before any estimate (and always
    at S = 1). The bare ratio of the smoothed estimates is ``gain_ratio(*smoothed(state), S)``."""
    if scale == 1.0 or state.sigma2_biased is None:
        return 1.0
    gain = gain_ratio(*smoothed(state), scale)
    u = state.bias_weight
    if gain <= 1.0 or theta == 0.0 or u >= 1.0:
        return gain
    sigma2, mu2 = summed_moments(*smoothed(state))
    q = sigma2 / scale + mu2  # > 0 where the gain is > 1
    noise, signal = sigma2 / scale / q, mu2 / q  # in parts of q (q^2 could underflow)
    var = 2.0 + min(4 * noise * signal + 2 * noise ** 2, 2.0)
    excess = var * 2 * (1 - theta) * (1 - u) / ((1 + theta) * u)
    return 1.0 + (gain - 1.0) * min(1.0, WARM_IN_FACTOR * math.exp(-WARM_IN_Z * math.sqrt(excess)))


def check_keys(what: str, d: Mapping, expected: set) -> None:
    if not isinstance(d, Mapping):
        raise TypeError(f"{what} must be a dict, got {type(d).__name__}")
    missing, unknown = expected - set(d), set(d) - expected
    if missing or unknown:
        raise ValueError(f"{what}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                         f"expected {sorted(expected)}")


class GainEstimator:
    """AdaScale's gain ratio r_t from per-step gradient statistics.

    Four micro-gradients with |g_i|^2 = 2 each (m = 2) and |g_bar|^2 = q = 1.25, at S = 4:
    sigma2 = 4 (2 - 1.25) / 3 = 1, mu2 = (4 * 1.25 - 2) / 3 = 1, r = (1 + 1) / (1/4 + 1) = 1.6.

    >>> est = GainEstimator(scale=4, smoothing=0.0)
    >>> est.update(sqnorm_sum=8.0, mean_sqnorm=1.25, n=4)
    1.6

    ``smoothing`` is theta of the EMA; None means ``0.999 ** scale`` (recomputed on ``rescale``).
    ``scale`` may differ from n: S = n b / B0 for micro-batches of b samples and a baseline B0.
    """

    def __init__(self, scale: float, smoothing: float | None = None):
        self._scale = check_scale(scale)
        self._smoothing = check_smoothing(smoothing)
        self.state = EstimatorState()

    # -- the update ---------------------------------------------------------------------------
    def update(self, sqnorm_sum, mean_sqnorm, n: int, samples: int | None = None) -> float:
        """Fold one step's statistics into the smoothed estimates and return the new gain
        (``samples``: per-worker statistics, ``estimate_moments``).

        With S = 1 the gain is exactly 1 and nothing is estimated (n may then be 1).
        Bad input (NaN, Inf, negative norms, n < 2 with S > 1, a changed number of groups)
        raises ValueError and leaves the state untouched.
        """
        self.state = fold(self.state, sqnorm_sum, mean_sqnorm, n, self._scale, self.smoothing,
                          samples)
        return self.gain

    # -- what it knows ------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return self._scale

    @property
    def smoothing(self) -> float:
        return default_smoothing(self._scale) if self._smoothing is None else self._smoothing

    @property
    def group_sigma2(self) -> np.ndarray | None:
        """Smoothed sigma2 per parameter group (None before the first update)."""
        return smoothed(self.state)[0]

    @property
    def group_mu2(self) -> np.ndarray | None:
        """Smoothed mu2 per parameter group, unclipped (a group's may be < 0; the sum is clipped)."""
        return smoothed(self.state)[1]

    @property
    def sigma2(self) -> float:
        """Smoothed variance of a baseline-batch gradient, summed over groups (nan before data)."""
        if self.state.sigma2_biased is None:
            return math.nan
        return summed_moments(*smoothed(self.state))[0]

    @property
    def mu2(self) -> float:
        """Smoothed squared norm of the true gradient, summed over groups and clipped at 0 (nan
        before data)."""
        if self.state.mu2_biased is None:
            return math.nan
        return summed_moments(*smoothed(self.state))[1]

    @property
    def gain(self) -> float:
        """r in [1, S], held toward 1 while the estimates are young (``estimated_gain``); 1
        before any statistics (and always at S = 1)."""
        return estimated_gain(self.state, self._scale, self.smoothing)

    @property
    def noise_scale(self) -> float:
        """B_simple / B0 = sigma2 / mu2: the batch, in baseline batches, past which scaling stops paying."""
        sigma2, mu2 = self.sigma2, self.mu2
        if math.isnan(sigma2):
            return math.nan
        return math.inf if mu2 == 0 else sigma2 / mu2

    @property
    def efficiency(self) -> float:
        """gain / S: the fraction of the ideal linear speed-up a step at this scale delivers."""
        return self.gain / self._scale

    # -- resizing and checkpoints -------------------------------------------------------------
    def rescale(self, new_scale: float) -> None:
        """Change S (workers joined or left). sigma2 and mu2 are in baseline-batch units: kept."""
        self._scale = check_scale(new_scale)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "scale": self._scale, "smoothing": self._smoothing,
                **self.state.to_dict()}

    def load_state_dict(self, d: Mapping) -> None:
        check_keys("GainEstimator state", d, {"version", "scale", "smoothing", "sigma2_biased",
                                               "mu2_biased", "bias_weight", "updates"})
        if d["version"] != STATE_VERSION:
            raise ValueError(f"GainEstimator state version {d['version']!r} is not supported "
                             f"(expected {STATE_VERSION})")
        state = EstimatorState.from_dict({k: d[k] for k in
                                          ("sigma2_biased", "mu2_biased", "bias_weight", "updates")})
        if (self.state.sigma2_biased is not None and state.sigma2_biased is not None
                and state.sigma2_biased.shape != self.state.sigma2_biased.shape):
            raise ValueError(f"checkpoint has {state.sigma2_biased.size} parameter group(s), "
                             f"this estimator tracks {self.state.sigma2_biased.size}")
        scale = check_scale(d["scale"])
        smoothing = check_smoothing(d["smoothing"])
        # Validate everything before changing anything.
        self._scale, self._smoothing, self.state = scale, smoothing, state
