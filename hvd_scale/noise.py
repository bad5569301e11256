"""The noise scale B_simple = sigma2 / mu2 with a confidence interval, overall and per group.

McCandlish et al. 2018's simple noise scale tr(Sigma) / |G|^2, here in baseline batches (sigma2
is the variance of one baseline-batch gradient): about the batch past which a larger one stops
paying. The engine's point estimate is the ratio of its smoothed estimates (``GainEstimator.
noise_scale``); this module says how far that ratio may be from the one its window measures.

How (Fieller's interval for a ratio of two means, the delta method without linearising in mu2):

    The smoothed estimates are debiased EMAs of the per-step estimates x_t = (s_t, m_t) =
    (sigma2_hat_t, mu2_hat_t) (``hvd_scale.estimate``): x_bar = sum_t w_t x_t / u with weights
    w_t = (1 - theta) theta^(T - t) and u = sum_t w_t (the estimator's bias weight). Taking the
    per-step estimates as independent with one covariance V over the EMA's window, x_bar has
    covariance V / n_eff, n_eff = u^2 / sum_t w_t^2 (the EMA's effective window, in steps).
    V is estimated over the same window from EMAs of the products, kept beside the estimator's:

        V_hat = (E_w[x x^T] - x_bar x_bar^T) / (1 - 1 / n_eff)      (unbiased under weights)

    The interval holds the B with  (s_bar - B m_bar)^2 <= z^2 (V_ss - 2 B V_sm + B^2 V_mm) / n_eff
    (Fieller 1954): the delta method's var(B) = (V_ss - 2 B V_sm + B^2 V_mm) / (n_eff m_bar^2)
    kept exact in m_bar, so it stays right where mu2 is uncertain and is open above (high = inf)
    where mu2 is not told apart from 0 at that level. The low end is at least 0. z is Student's
    t quantile at n_eff - 1 degrees of freedom (V is estimated from the same window: a young EMA's
    few steps widen it; 1.97 against the normal's 1.96 at n_eff = 250).

What it covers: the ratio of the window's mean sigma2 and mu2. Per-step estimates are
independent where each step's gradients are fresh samples; a trend within the window (mu2
falling through training) counts as spread, so the interval widens rather than narrows, and it
is about the window's average, which lags the present by about the EMA's horizon.

State (``NoiseState``, held in the run record ``hvd_scale.run.RunState``): per parameter group
and for the sum over groups (cross-group covariances count for the sum), the EMAs of s^2, m^2
and s m (not debiased; divided by u when read), its own bias weight and sum of squared weights,
all advanced with the estimator's theta at each step the estimator folds. The per-step estimate
is recovered from the estimator's EMA before and after the step, x_t = (b_t - theta b_{t-1}) /
(1 - theta), so this module holds no copy of the estimator's formula and follows it exactly.
A record that started after the estimator (a checkpoint of before this module) gives no
interval until its own window is full (its bias weight at least ``FULL``): the two windows
then weigh the same steps.

tests/test_noise.py: coverage and bias on synthetic gradients of known sigma2 and mu2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from .estimate import EstimatorState, check_keys, smoothed
from .metrics import GROUP_NOISE_METRICS, NOISE_METRICS, group_metric

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval
LEVEL = 0.95
FULL = 0.99              # a late-started record's window counts once its bias weight reaches it
_PRODUCTS = 3            # s^2, m^2, s m


@dataclasses.dataclass(frozen=True, eq=False)
class NoiseState:
    """EMAs of the per-step estimates' products, per group and (last) for the sum over groups."""

    products: np.ndarray | None = None  # float64[3, groups + 1]: s^2, m^2, s m (not debiased)
    bias_weight: float = 0.0            # u of these EMAs (the estimator's where in step)
    weight_sq: float = 0.0              # sum of squared weights: n_eff = u^2 / weight_sq
    updates: int = 0

    def __eq__(self, other) -> bool:  # the products are an array: compared whole
        if not isinstance(other, NoiseState):
            return NotImplemented
        same = (self.products is None and other.products is None) or (
            self.products is not None and other.products is not None
            and np.array_equal(self.products, other.products))
        return same and (self.bias_weight, self.weight_sq, self.updates) == \
            (other.bias_weight, other.weight_sq, other.updates)

    def to_dict(self) -> dict:
        return {"products": None if self.products is None else self.products.tolist(),
                "bias_weight": self.bias_weight, "weight_sq": self.weight_sq,
                "updates": self.updates}

    @classmethod
    def from_dict(cls, d: Mapping) -> "NoiseState":
        check_keys("noise state", d, {"products", "bias_weight", "weight_sq", "updates"})
        products = None if d["products"] is None else np.asarray(d["products"], np.float64)
        if products is not None and (products.ndim != 2 or products.shape[0] != _PRODUCTS):
            raise ValueError(f"noise state: products must be 3 rows of groups + 1 values, got "
                             f"shape {products.shape}")
        return cls(products, float(d["bias_weight"]), float(d["weight_sq"]), int(d["updates"]))

    # -- the vector (after the policy's record in the run's; zeros: nothing yet) ----------------
    @staticmethod
    def vector_size(groups: int) -> int:
        return 3 + _PRODUCTS * (groups + 1)

    def to_vector(self, groups: int) -> np.ndarray:
        products = np.zeros((_PRODUCTS, groups + 1)) if self.products is None else self.products
        if products.shape != (_PRODUCTS, groups + 1):
            raise ValueError(f"the noise record holds {products.shape[1] - 1} parameter "
                             f"group(s), the vector {groups}")
        return np.concatenate([[self.updates, self.bias_weight, self.weight_sq],
                               products.ravel()]).astype(np.float64)

    @classmethod
    def from_vector(cls, vector, groups: int) -> "NoiseState":
        v = np.asarray(vector, dtype=np.float64)
        if v.shape != (cls.vector_size(groups),):
            raise ValueError(f"a noise record for {groups} parameter group(s) holds "
                             f"{cls.vector_size(groups)} values, got shape {v.shape}")
        updates, bias_weight, weight_sq = v[:3].tolist()
        products = v[3:].reshape(_PRODUCTS, groups + 1).copy() if updates > 0 else None
        return cls(products, bias_weight, weight_sq, int(updates))


def t_quantile(dof: float, z: float = Z95) -> float:
    """Student's t quantile at ``dof`` degrees of freedom for the normal quantile ``z`` (Cornish-
    Fisher, Abramowitz and Stegun 26.7.5: 4.27 for 4.30 at dof 2, within 0.1% from dof 5 on)."""
    if dof < 1:
        return math.inf
    g = ((z ** 3 + z) / 4, (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96,
         (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384,
         (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160)
    return z + sum(gi / dof ** (i + 1) for i, gi in enumerate(g))


def _with_total(x: np.ndarray) -> np.ndarray:
    """Per-group values (..., G) and their sum over groups appended: (..., G + 1)."""
    return np.concatenate([x, x.sum(axis=-1, keepdims=True)], axis=-1)


def advance(noise: NoiseState, before: EstimatorState, after: EstimatorState,
            theta: float) -> NoiseState:
    """The record after a step that took the estimator from ``before`` to ``after`` with EMA
    weight ``theta`` (``Policy.theta`` at the step's S); unchanged where the step folded
    nothing. The step's estimates come back from the EMA: x = (b_t - theta b_{t-1}) / (1 - theta)
    (b_{t-1} = 0 at the first). Works on (..., G) arrays (the engine's are 1-D)."""
    if after.updates == before.updates or after.sigma2_biased is None:
        return noise
    if not 0.0 <= theta < 1.0:
        raise ValueError(f"theta must be in [0, 1), got {theta!r}")
    prior = (0.0, 0.0) if before.sigma2_biased is None else \
        (before.sigma2_biased, before.mu2_biased)
    s = (after.sigma2_biased - theta * prior[0]) / (1.0 - theta)
    m = (after.mu2_biased - theta * prior[1]) / (1.0 - theta)
    s, m = _with_total(np.asarray(s)), _with_total(np.asarray(m))
    step = np.stack([s * s, m * m, s * m], axis=-2)
    products = noise.products
    if products is None or products.shape != step.shape:  # the first, or the groups changed
        products, u, v, updates = np.zeros_like(step), 0.0, 0.0, 0
    else:
        u, v, updates = noise.bias_weight, noise.weight_sq, noise.updates
    return NoiseState(products=theta * products + (1.0 - theta) * step,
                      bias_weight=theta * u + (1.0 - theta),
                      weight_sq=theta * theta * v + (1.0 - theta) ** 2, updates=updates + 1)


def fieller(s, m, v_ss, v_mm, v_sm, z: float = Z95) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of B = s / m: the B with (s - B m)^2 <= z^2 (v_ss - 2 B v_sm + B^2 v_mm),
    the v's the variances of the means s and m. Elementwise. Where m is not apart from 0 at
    this z (m^2 <= z^2 v_mm) the set is unbounded: high = inf (low: 0, or the finite end where
    the set is a ray). low >= 0 (B is a ratio of a variance to a squared norm)."""
    s, m = np.asarray(s, np.float64), np.asarray(m, np.float64)
    z2 = z * z
    a = m * m - z2 * v_mm
    b = -2.0 * (s * m - z2 * v_sm)
    c = s * s - z2 * v_ss
    disc = b * b - 4.0 * a * c
    root = np.sqrt(np.maximum(disc, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        r1, r2 = (-b - root) / (2.0 * a), (-b + root) / (2.0 * a)
    bounded = (a > 0) & (disc >= 0)
    low = np.where(bounded, np.minimum(r1, r2), 0.0)
    high = np.where(bounded, np.maximum(r1, r2), np.inf)
    # a < 0 with real roots: the set is the outside of [r1, r2]. Where the estimate s / m lies
    # above both, its part is the ray [max(r1, r2), inf); else [0, inf) is reported.
    with np.errstate(divide="ignore", invalid="ignore"):
        ray = (a < 0) & (disc > 0) & (m > 0) & (s / m >= np.maximum(r1, r2))
    low = np.where(ray, np.maximum(r1, r2), low)
    return np.maximum(low, 0.0), high


def interval(estimator: EstimatorState, noise: NoiseState, z: float = Z95
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(B, low, high), each per group then (last) for the sum over groups, in baseline batches
    (``z``: the normal quantile of the level; Student's t at the window's n_eff is taken);
    None where no interval is known (no estimate yet, n_eff < 2 steps, or a record that has
    not yet filled its window: the module's docstring). B is sigma2 / mu2 of the smoothed
    estimates (inf where mu2 <= 0), as ``GainEstimator.noise_scale`` for the sum."""
    sigma2, mu2 = smoothed(estimator)
    if sigma2 is None or noise.products is None or noise.updates < 2:
        return None
    in_step = noise.updates == estimator.updates
    if not in_step and noise.bias_weight < FULL:
        return None
    s, m = _with_total(sigma2), _with_total(mu2)
    if noise.products.shape[-1] != s.shape[-1]:
        return None
    u, v = noise.bias_weight, noise.weight_sq
    inv_neff = v / (u * u)  # 1 / n_eff
    ss, mm, sm = (noise.products[..., i, :] for i in range(_PRODUCTS))
    correction = 1.0 / (1.0 - inv_neff) if inv_neff < 1.0 else math.inf
    # the covariance of the means: V_hat / n_eff
    v_ss = np.maximum(ss / u - s * s, 0.0) * correction * inv_neff
    v_mm = np.maximum(mm / u - m * m, 0.0) * correction * inv_neff
    v_sm = (sm / u - s * m) * correction * inv_neff
    quantile = t_quantile(1.0 / inv_neff - 1, z)  # n_eff - 1 degrees of freedom
    if not math.isfinite(quantile):  # the window holds less than two steps' worth
        return None
    low, high = fieller(np.maximum(s, 0.0), m, v_ss, v_mm, v_sm, quantile)
    # mu2's estimate at or below 0 (a group's gradient lost in its noise): nothing is bounded
    low, high = np.where(m > 0, low, 0.0), np.where(m > 0, high, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        point = np.where(m > 0, np.maximum(s, 0.0) / np.where(m > 0, m, 1.0), np.inf)
    return point, low, high


def metrics(estimator: EstimatorState, noise: NoiseState) -> dict[str, float]:
    """``hvd_scale.metrics.NOISE_METRICS`` (the sum's 95% interval) and, with two groups or
    more, ``GROUP_NOISE_METRICS`` of each group (``group_metric``): nan where none is known."""
    known = interval(estimator, noise)
    out = {name: math.nan for name in NOISE_METRICS}
    if known is not None:
        out.update(zip(NOISE_METRICS, (float(known[1][-1]), float(known[2][-1]))))
    sigma2, mu2 = smoothed(estimator)
    if sigma2 is not None and sigma2.size >= 2:
        for j in range(sigma2.size):
            point = max(float(sigma2[j]), 0.0) / float(mu2[j]) if mu2[j] > 0 else math.inf
            low, high = (math.nan, math.nan) if known is None else \
                (float(known[1][j]), float(known[2][j]))
            out.update({group_metric(name, j): value for name, value in
                        zip(GROUP_NOISE_METRICS, (point, low, high))})
    return out
