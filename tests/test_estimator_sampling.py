"""Cheaper gradient statistics (#50 item 1) against the analytic truth, through the engine.

Synthetic Gaussian micro-gradients g = mu + e, e ~ N(0, (n / S) C), with a known baseline-batch
covariance C (sigma2 = tr C = 1) and true gradient mu (mu2 = |mu|^2 = 0.2, a noise scale of 5 as
in B1). W workers x k backward passes, n = W k micro-gradients, S = n (micro-batch = B0). Each
step hands the engine (``GainEstimator.update``) one of three statistics, q = |g_bar|^2 always:

    passes    s = sum of |g_i|^2 over all n micro-gradients, n = W k       (today's)
    workers   s = sum_w |h_w|^2, h_w = mean of worker w's k passes, n = W
    sampled   s = (n / W) sum_w |g_(w, j_w)|^2, one random pass j_w per worker, n = W k

``hvd_scale.estimate.estimate_variances`` predicts each one's per-step variance; the smoothed
estimates must lie within the error that predicts, deliberately wrong statistics outside it.
Replicas of a run are the engine's parameter groups (the EMAs are elementwise), so one
GainEstimator runs all of them. Seeded; ~3 s on one core.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hvd_scale import GainEstimator
from hvd_scale.estimate import (EstimatorState, ema_update, estimate_moments, estimate_variances,
                                fold, gain_ratio, smoothed)

SIGMA2, MU2 = 1.0, 0.2
REPLICAS = 16
Z = 4.0  # how many predicted standard errors a correct estimator may be off


@dataclasses.dataclass(frozen=True)
class Truth:
    """Eigenvalues of C (axis-aligned) and mu, in the same coordinates."""
    lam: np.ndarray
    mu: np.ndarray

    @property
    def trace_c2(self) -> float:
        return float(np.sum(self.lam ** 2))

    @property
    def mu_c_mu(self) -> float:
        return float(np.sum(self.lam * self.mu ** 2))


def low_rank(mu2: float = MU2) -> Truth:
    # Noise in 2 directions (0.7, 0.3; effective rank 1.7), mu at 45 degrees to the first one.
    return Truth(SIGMA2 * np.array([0.7, 0.3, 0.0]), math.sqrt(mu2 / 2) * np.array([1.0, 0.0, 1.0]))


def isotropic(d: int = 256) -> Truth:
    return Truth(np.full(d, SIGMA2 / d), math.sqrt(MU2) * np.eye(d)[0])


TRUTHS = {"low-rank": low_rank(), "isotropic": isotropic()}
SHAPES = [(w, k) for w in (2, 4, 16) for k in (1, 4, 8)]  # n = 2 ... 128


def simulate(rng: np.random.Generator, w: int, k: int, truth: Truth, steps: int,
             replicas: int) -> dict[str, np.ndarray]:
    """Per-step statistics, each of shape (replicas, steps): the three s's and q."""
    n = w * k
    scale = n
    sd = np.sqrt(truth.lam * n / scale)
    out = {key: np.empty((replicas, steps)) for key in ("passes", "workers", "sampled", "q")}
    chunk = max(1, int(4e6 // (steps * n * truth.lam.size)))  # bound the memory
    for a in range(0, replicas, chunk):
        b = min(replicas, a + chunk)
        g = rng.standard_normal((b - a, steps, w, k, truth.lam.size)) * sd + truth.mu
        sq = np.sum(g * g, axis=-1)                    # |g_i|^2, (reps, steps, W, k)
        h = g.mean(axis=3)                             # each worker's accumulated gradient
        g_bar = h.mean(axis=2)
        out["passes"][a:b] = sq.sum(axis=(2, 3))
        out["workers"][a:b] = np.sum(h * h, axis=(2, 3))
        out["q"][a:b] = np.sum(g_bar * g_bar, axis=-1)
        pick = rng.integers(k, size=(b - a, steps, w, 1))
        out["sampled"][a:b] = n / w * np.take_along_axis(sq, pick, axis=3).sum(axis=(2, 3))
    return out


def handed(name: str, stats: dict, w: int, k: int) -> tuple:
    """(s, q, n, reads) as the adapter would hand them to the engine, for each estimator; the
    deliberately wrong ones too."""
    n = w * k
    return {
        "passes": (stats["passes"], stats["q"], n, None),
        "workers": (stats["workers"], stats["q"], w, None),
        "sampled": (stats["sampled"], stats["q"], n, w),
        # Wrong on purpose: the per-worker sum with the passes' n; the sampled sum without n / r;
        # q omitted.
        "workers, n = W k": (stats["workers"], stats["q"], n, None),
        "sampled, no n / r": (stats["sampled"] * w / n, stats["q"], n, w),
        "passes, q = 0": (stats["passes"], np.zeros_like(stats["q"]), n, None),
    }[name]


def ema_weight_sq(theta: float, steps: int) -> float:
    """sum_t w_t^2 for the debiased EMA's weights w_t = (1 - theta) theta^(T - t) / (1 - theta^T):
    the smoothed value's variance over one step's, for independent steps."""
    w = (1 - theta) * theta ** np.arange(steps) / (1 - theta ** steps)
    return float(np.sum(w * w))


def gains(sigma2: np.ndarray, mu2: np.ndarray, scale: float) -> np.ndarray:
    """gain_ratio elementwise (one replica per entry): sums clipped at 0, r within [1, S]."""
    var, sqr = np.maximum(sigma2, 0.0), np.maximum(mu2, 0.0)
    return np.clip((var + sqr) / (var / scale + sqr), 1.0, scale)


def predicted_gain_spread(var_sigma2: float, var_mu2: float, scale: float) -> float:
    """Var of the gain's step-to-step change, up to a factor every estimator shares (the EMA's
    weights): r's gradient is (mu2, -sigma2) (1 - 1/S) / (sigma2/S + mu2)^2, and q =
    mu2_hat + sigma2_hat / S is uncorrelated with sigma2_hat, so Var = Var(sigma2_hat)
    (mu2 + sigma2/S)^2 + sigma2^2 Var(q)."""
    var_q = var_mu2 - var_sigma2 / scale ** 2
    return var_sigma2 * (MU2 + SIGMA2 / scale) ** 2 + SIGMA2 ** 2 * var_q


@dataclasses.dataclass
class Run:
    truth: Truth
    w: int
    k: int
    name: str
    raw_sigma2: np.ndarray      # per-step, unclipped, (reps, steps)
    raw_mu2: np.ndarray
    ema_sigma2: np.ndarray      # the engine's smoothed estimates after every step, (steps, reps)
    ema_mu2: np.ndarray
    var_sigma2: float           # predicted per-step variances
    var_mu2: float
    steps: int

    @property
    def scale(self) -> int:
        return self.w * self.k

    def ema_sd(self, var: float) -> float:
        return math.sqrt(var * ema_weight_sq(0.999 ** self.scale, self.steps))

    def spread(self) -> float:
        """The std of the gain's step-to-step change over the run's second half."""
        r = gains(self.ema_sigma2, self.ema_mu2, self.scale)
        return float(np.std(np.diff(r[self.steps // 2:], axis=0)))


def run_engine(stats: dict, truth: Truth, w: int, k: int, name: str, steps: int) -> Run:
    s, q, n, reads = handed(name, stats, w, k)
    scale = w * k
    est = GainEstimator(scale=scale)  # theta = 0.999 ** S
    ema_sigma2, ema_mu2 = [], []
    for t in range(steps):
        est.update(s[:, t], q[:, t], n)
        ema_sigma2.append(est.group_sigma2)
        ema_mu2.append(est.group_mu2)
    m = s / n
    var_sigma2, var_mu2 = estimate_variances(n, scale, truth.trace_c2, truth.mu_c_mu, reads)
    return Run(truth, w, k, name, scale * (m - q) / (n - 1), (n * q - m) / (n - 1),
               np.array(ema_sigma2), np.array(ema_mu2), var_sigma2, var_mu2, steps)


ESTIMATORS = ("passes", "workers", "sampled")
BIASED = ("workers, n = W k", "sampled, no n / r", "passes, q = 0")


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every (covariance, W, k, estimator): ~1000 baseline batches (at least 32 steps)."""
    rng = np.random.default_rng(50)
    out = {}
    for cov, truth in TRUTHS.items():
        for w, k in SHAPES:
            steps = max(math.ceil(1000 / (w * k)), 32)
            stats = simulate(rng, w, k, truth, steps, REPLICAS)
            for name in ESTIMATORS + BIASED:
                if k == 1 and name in BIASED[:2]:
                    continue  # with one pass these are the right statistics
                out[cov, w, k, name] = run_engine(stats, truth, w, k, name, steps)
    return out


def test_variance_formula_covers_passes_and_workers_alike():
    # "workers" is "passes" with n = W: one formula; reading all (reads = n) is the default.
    assert estimate_variances(4, 32, 0.5, 0.1) == estimate_variances(4, 32, 0.5, 0.1, reads=4)
    var, _ = estimate_variances(8, 8, 0.5, 0.3)
    assert var == pytest.approx(2 * 0.5 / 7)  # the chi-square's: no mu term when all are read
    with pytest.raises(ValueError):
        estimate_variances(8, 8, 0.5, reads=9)


def test_predicted_per_step_variance_matches_empirical(runs):
    # The formula against the simulated steps' own variance, within 5 of its standard errors
    # (from the empirical fourth moment: the low-rank steps are far from Gaussian).
    for key, run in runs.items():
        if key[3] not in ESTIMATORS:
            continue
        for raw, pred in ((run.raw_sigma2, run.var_sigma2), (run.raw_mu2, run.var_mu2)):
            x = raw.ravel() - raw.mean()
            var = np.mean(x * x)
            se = math.sqrt(max(np.mean(x ** 4) - var ** 2, 0.0) / x.size)
            assert abs(var - pred) <= 5 * se + 1e-12, (key, var, pred, se)


def test_smoothed_estimates_within_predicted_error(runs):
    # Each estimator's smoothed sigma2 and mu2, after the last step, averaged over the replicas:
    # within Z predicted standard errors of the truth; and the replicas' spread is the predicted
    # one (the EMA of independent steps).
    for key, run in runs.items():
        if key[3] not in ESTIMATORS:
            continue
        for ema, var, truth in ((run.ema_sigma2[-1], run.var_sigma2, SIGMA2),
                                (run.ema_mu2[-1], run.var_mu2, MU2)):
            sd = run.ema_sd(var)
            assert abs(ema.mean() - truth) <= Z * sd / math.sqrt(REPLICAS), (key, ema.mean(), sd)
            assert 0.5 * sd <= ema.std(ddof=1) <= 1.6 * sd, (key, ema.std(ddof=1), sd)


def test_biased_statistics_are_detected(runs):
    # The bound has teeth: wrong statistics land outside it in every setting they apply to,
    # judged by the correct estimator's predicted error.
    for (cov, w, k, name), run in runs.items():
        if name not in BIASED:
            continue
        right = runs[cov, w, k, {"workers, n = W k": "workers", "sampled, no n / r": "sampled",
                                 "passes, q = 0": "passes"}[name]]
        sd = right.ema_sd(right.var_sigma2) / math.sqrt(REPLICAS)
        assert abs(run.ema_sigma2[-1].mean() - SIGMA2) > Z * sd, (cov, w, k, name)


def test_gain_spread_against_the_full_estimator(runs, capsys):
    # The applied gain's step-to-step change (second half of each run), over the full
    # estimator's: the predicted ratio within 30%, and never below the full one's.
    rows = []
    for (cov, w, k, name), run in runs.items():
        if name not in ESTIMATORS[1:] or k == 1:
            continue
        full = runs[cov, w, k, "passes"]
        measured = run.spread() / full.spread()
        predicted = math.sqrt(predicted_gain_spread(run.var_sigma2, run.var_mu2, run.scale)
                              / predicted_gain_spread(full.var_sigma2, full.var_mu2, full.scale))
        rows.append((cov, w, k, name, measured, predicted))
    with capsys.disabled():
        print("\ngain's step-to-step spread over the full estimator's (measured / predicted)")
        for cov, w, k, name, measured, predicted in rows:
            print(f"  {cov:9s} W={w:2d} k={k} {name:8s} {measured:6.2f} / {predicted:6.2f}")
    for cov, w, k, name, measured, predicted in rows:
        assert measured == pytest.approx(predicted, rel=0.3), (cov, w, k, name)
        assert measured > 0.9, (cov, w, k, name)


def test_engine_gain_matches_elementwise_gains(runs):
    # The spread above uses `gains` elementwise; it is the engine's gain_ratio per replica.
    run = runs["low-rank", 4, 8, "sampled"]
    for j in range(REPLICAS):
        assert gains(run.ema_sigma2[-1, j], run.ema_mu2[-1, j], run.scale) == pytest.approx(
            gain_ratio(run.ema_sigma2[-1, j], run.ema_mu2[-1, j], run.scale))


def test_engine_floor_biases_the_sampled_estimator():
    # Where the sampled statistic's steps are often < 0 (signal-dominated, mu along low-rank
    # noise, W = 2 reads of n = 16) the engine's per-step floor (sigma2_hat >= 1e-6 m) clips
    # them and the smoothed sigma2 comes out far above the truth; the same steps' unclipped
    # estimates, smoothed by the engine's own ema_update, are within the predicted error.
    truth = Truth(SIGMA2 * np.array([0.7, 0.3]), math.sqrt(10.0) * np.array([1.0, 0.0]))
    w, k, steps, reps = 2, 8, 200, 64
    stats = simulate(np.random.default_rng(7), w, k, truth, steps, reps)
    n = scale = w * k
    s, q = stats["sampled"], stats["q"]
    clipped, unclipped = EstimatorState(), EstimatorState()
    theta = 0.999 ** scale
    for t in range(steps):
        clipped = fold(clipped, s[:, t], q[:, t], n, scale, theta)
        m = s[:, t] / n
        unclipped = ema_update(unclipped, scale * (m - q[:, t]) / (n - 1),
                               (n * q[:, t] - m) / (n - 1), theta)
    var_sigma2, _ = estimate_variances(n, scale, truth.trace_c2, truth.mu_c_mu, reads=w)
    sd = math.sqrt(var_sigma2 * ema_weight_sq(theta, steps) / reps)
    raw = scale * (s / n - q) / (n - 1)
    assert np.mean(raw < 0) > 0.2                   # a fifth of the steps or more are clipped
    assert abs(smoothed(unclipped)[0].mean() - SIGMA2) <= Z * sd
    assert smoothed(clipped)[0].mean() - SIGMA2 > 10 * sd
    # The full statistic of the same steps is never clipped (m >= q): unbiased.
    full_sigma2, _ = estimate_moments(stats["passes"].ravel(), q.ravel(), n, scale)
    assert np.all(stats["passes"] / n >= q)
    assert abs(full_sigma2.mean() - SIGMA2) <= Z * math.sqrt(
        estimate_variances(n, scale, truth.trace_c2, truth.mu_c_mu)[0] / full_sigma2.size)


def test_workers_needs_two_workers():
    # W = 1 with k passes: the per-worker statistic is one sample, no variance estimate.
    with pytest.raises(ValueError, match="n = 1"):
        GainEstimator(scale=8).update(sqnorm_sum=3.0, mean_sqnorm=3.0, n=1)
