"""Cheaper gradient statistics (#50 item 1): their error and the gain's spread, on synthetic data.

    .venv/bin/python benchmarks/investigations/estimator_variance.py     # ~20 s, one process, numpy only

Today each step reads all n = W k micro-gradients (W workers x k backward passes) for
m = mean_i |g_i|^2. Two statistics whose reads do not grow with k, both handed to the engine
unchanged (hvd_scale/estimate.py's docstring says why they are unbiased):

    passes    s = sum_i |g_i|^2 over all n, n = W k                       (today's; n reads)
    workers   s = sum_w |h_w|^2, h_w = mean of worker w's k passes, n = W  (W reads; W >= 2)
    sampled   s = (n / r) sum of |g_i|^2 over j random passes per worker, r = W j reads, n = W k

Synthetic Gaussian micro-gradients g = mu + e, e ~ N(0, (n / S) C), S = n: sigma2 = tr C = 1,
mu2 = 0.2 (noise scale B_simple / B0 = 5, about B1's: its gains 4.4 at S = 16 and 7.2 at S = 64
give 4.7 and 7.0); C of low effective rank (eigenvalues 0.7, 0.3; mu at 45 degrees to the
first) or isotropic over 256 dimensions (mu along one axis). Replicas of a run are the engine's
parameter groups: one ``GainEstimator`` (theta = 0.999 ** S) smooths them all. Reported: the
smoothed sigma2's and mu2's relative error after ~1000 baseline batches (RMS over replicas, and
as ``estimate_variances`` predicts it), the bias of sigma2 (mean over replicas), the share of
steps whose sigma2_hat < 0 (the engine floors those: sampled only), the applied gain's
step-to-step change (std of r_t - r_(t-1) over the true gain, from 1000 to 3000 baseline
batches), its RMS error over the same steps, and the spread over the passes estimator's
(measured, and predicted from the per-step variances). A third case, low rank with mu2 = 2,
shows where the signal dominates.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import math
import time
from pathlib import Path

import numpy as np

from hvd_scale import GainEstimator
from hvd_scale.estimate import estimate_variances

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "estimator_variance.md"
SIGMA2, MU2 = 1.0, 0.2


@dataclasses.dataclass(frozen=True)
class Truth:
    lam: np.ndarray  # eigenvalues of C, axis-aligned
    mu: np.ndarray

    @property
    def sigma2(self) -> float:
        return float(np.sum(self.lam))

    @property
    def mu2(self) -> float:
        return float(np.sum(self.mu ** 2))

    @property
    def trace_c2(self) -> float:
        return float(np.sum(self.lam ** 2))

    @property
    def mu_c_mu(self) -> float:
        return float(np.sum(self.lam * self.mu ** 2))


def low_rank(mu2: float) -> Truth:
    return Truth(SIGMA2 * np.array([0.7, 0.3, 0.0]), math.sqrt(mu2 / 2) * np.array([1.0, 0.0, 1.0]))


TRUTHS = {
    "low-rank": low_rank(MU2),
    "isotropic": Truth(np.full(256, SIGMA2 / 256), math.sqrt(MU2) * np.eye(256)[0]),
    "low-rank, mu2 = 2": low_rank(10 * MU2),  # signal-dominated: noise scale 0.5
}
# (W, k): the tests' shapes with k > 1 (at k = 1 the three are the same statistic), B1's
# accumulation at S = 16 and 64 (2 workers), and one process with k passes; a few for the
# signal-dominated case, where sampled's own term (mu^T C mu) and the floor show.
SHAPES = [(2, 4), (2, 8), (4, 4), (4, 8), (16, 4), (16, 8), (2, 32), (1, 8), (1, 32)]
SETTINGS = [("low-rank", SHAPES), ("isotropic", SHAPES),
            ("low-rank, mu2 = 2", [(2, 8), (16, 8), (2, 32), (1, 8)])]


def estimators(w: int, k: int) -> list[tuple[str, int]]:
    """(name, passes read per worker; 0 = the per-worker statistic, k = all) for a shape."""
    out = [("passes", k)]
    if w >= 2:
        out += [("workers", 0), ("sampled", 1)]
    else:
        out += [("sampled", 1), ("sampled, 4 passes", 4)]
    return out


def statistics(rng, w: int, k: int, truth: Truth, steps: int, reps: int, reads: list[int]):
    """Per-step s for each entry of `reads` (passes read per worker, 0 = per-worker), and q;
    arrays of shape (reps, steps)."""
    n = w * k
    sd = np.sqrt(truth.lam * n / n)  # (n / S) C with S = n
    d = truth.lam.size
    out = {j: np.empty((reps, steps)) for j in reads}
    q = np.empty((reps, steps))
    chunk = max(1, int(4e6 // (reps * n * d)))
    for a in range(0, steps, chunk):
        b = min(steps, a + chunk)
        g = rng.standard_normal((reps, b - a, w, k, d)) * sd + truth.mu
        sq = np.sum(g * g, axis=-1)
        h = g.mean(axis=3)
        g_bar = h.mean(axis=2)
        q[:, a:b] = np.sum(g_bar * g_bar, axis=-1)
        for j in reads:
            if j == 0:
                out[j][:, a:b] = np.sum(h * h, axis=(2, 3))
            elif j == k:
                out[j][:, a:b] = sq.sum(axis=(2, 3))
            else:  # j distinct passes per worker, at random
                pick = np.argsort(rng.random(sq.shape), axis=3)[..., :j]
                out[j][:, a:b] = n / (w * j) * np.take_along_axis(sq, pick, axis=3).sum(axis=(2, 3))
    return out, q


def gains(sigma2, mu2, scale):
    """The engine's gain_ratio, elementwise (one replica per entry)."""
    var, sqr = np.maximum(sigma2, 0.0), np.maximum(mu2, 0.0)
    return np.clip((var + sqr) / (var / scale + sqr), 1.0, scale)


def ema_weight_sq(theta: float, steps: int) -> float:
    w = (1 - theta) * theta ** np.arange(steps) / (1 - theta ** steps)
    return float(np.sum(w * w))


def gain_spread_var(truth: Truth, var_sigma2: float, var_mu2: float, scale: float) -> float:
    # r's gradient is (mu2, -sigma2) (1 - 1/S) / (sigma2/S + mu2)^2 and q = mu2_hat + sigma2_hat/S
    # is uncorrelated with sigma2_hat: the change's variance up to the EMA's factor, alike for all.
    var_q = var_mu2 - var_sigma2 / scale ** 2
    return var_sigma2 * (truth.mu2 + truth.sigma2 / scale) ** 2 + truth.sigma2 ** 2 * var_q


def run_setting(rng, cov: str, w: int, k: int, reps: int, at: int, until: int) -> list[dict]:
    truth = TRUTHS[cov]
    n = scale = w * k
    steps_at, steps = math.ceil(at / scale), math.ceil(until / scale)
    names = estimators(w, k)
    stats, q = statistics(rng, w, k, truth, steps, reps, [j for _, j in names])
    sigma2, mu2 = truth.sigma2, truth.mu2
    true_gain = (sigma2 + mu2) / (sigma2 / scale + mu2)
    rows = []
    for name, j in names:
        s = stats[j]
        n_handed, reads = (w, None) if j == 0 else (n, w * j)
        est = GainEstimator(scale=scale)
        r_t = np.empty((steps, reps))
        for t in range(steps):
            est.update(s[:, t], q[:, t], n_handed)
            sig, mu = est.group_sigma2, est.group_mu2
            r_t[t] = gains(sig, mu, scale)
            if t == steps_at - 1:
                sig_at, mu_at = sig.copy(), mu.copy()
        raw = scale * (s / n_handed - q) / (n_handed - 1)
        var_sigma2, var_mu2 = estimate_variances(n_handed, scale, truth.trace_c2, truth.mu_c_mu,
                                                 reads)
        ws = ema_weight_sq(0.999 ** scale, steps_at)
        rows.append({
            "cov": cov, "W": w, "k": k, "S": scale, "estimator": name,
            "reads": w if j == 0 else reads,
            "sigma2_err": float(np.sqrt(np.mean((sig_at - sigma2) ** 2)) / sigma2),
            "sigma2_err_pred": math.sqrt(var_sigma2 * ws) / sigma2,
            "sigma2_bias": float(np.mean(sig_at) - sigma2) / sigma2,
            "sigma2_bias_se": float(np.std(sig_at, ddof=1) / math.sqrt(reps)) / sigma2,
            "mu2_err": float(np.sqrt(np.mean((mu_at - mu2) ** 2)) / mu2),
            "mu2_err_pred": math.sqrt(var_mu2 * ws) / mu2,
            "clipped": float(np.mean(raw < 0)),
            "gain": true_gain,
            "spread": float(np.std(np.diff(r_t[steps_at - 1:], axis=0))) / true_gain,
            "gain_err": float(np.sqrt(np.mean((r_t[steps_at - 1:] - true_gain) ** 2))) / true_gain,
            "spread_var_pred": gain_spread_var(truth, var_sigma2, var_mu2, scale),
            "steps_at": steps_at,
        })
    full = rows[0]
    for row in rows:
        row["ratio"] = row["spread"] / full["spread"]
        row["ratio_pred"] = math.sqrt(row["spread_var_pred"] / full["spread_var_pred"])
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| C | W | k | S | estimator | reads/step | sigma2 rel. err. (pred.) | sigma2 bias (± se) "
        "| mu2 rel. err. (pred.) | steps < 0 | true gain | gain rel. err. "
        "| gain step-to-step spread | spread / passes' (pred.) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cov']} | {r['W']} | {r['k']} | {r['S']} | {r['estimator']} | {r['reads']} "
            f"| {100 * r['sigma2_err']:.1f}% ({100 * r['sigma2_err_pred']:.1f}%) "
            f"| {100 * r['sigma2_bias']:+.1f}% (± {100 * r['sigma2_bias_se']:.1f}) "
            f"| {100 * r['mu2_err']:.1f}% ({100 * r['mu2_err_pred']:.1f}%) "
            f"| {100 * r['clipped']:.1f}% | {r['gain']:.2f} | {100 * r['gain_err']:.1f}% "
            f"| {100 * r['spread']:.3f}% "
            f"| {r['ratio']:.2f} ({r['ratio_pred']:.2f}) |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=64, help="independent runs (default 64)")
    parser.add_argument("--at", type=int, default=1000,
                        help="baseline batches at which the error is read (default 1000)")
    parser.add_argument("--until", type=int, default=3000,
                        help="baseline batches per run; the spread is read after --at "
                        "(default 3000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    rows = []
    for cov, shapes in SETTINGS:
        for w, k in shapes:
            rows += run_setting(rng, cov, w, k, args.replicas, args.at, args.until)
            print(f"{cov} W={w} k={k} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    elapsed = time.perf_counter() - t0

    defaults = {"replicas": 64, "at": 1000, "until": 3000, "seed": 0}
    command = ".venv/bin/python benchmarks/investigations/estimator_variance.py" + "".join(
        f" --{key} {getattr(args, key)}" for key in defaults if getattr(args, key) != defaults[key])
    if args.output.resolve() != DEFAULT_OUTPUT:
        command += f" --output {args.output}"
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "# Cheaper gradient statistics: error and gain spread (#50 item 1)",
        "",
        f"Rerun: `{command}` ({elapsed:.0f} s here, {now}; seeded, numpy only).",
        "",
        "Synthetic Gaussian micro-gradients, sigma2 = 1, mu2 = 0.2 (noise scale 5, about B1's), "
        "S = n = W k; C of low effective rank (eigenvalues 0.7, 0.3; mu at 45 degrees to the "
        "first) or isotropic over 256 dimensions. Each estimator's statistics go through "
        "`GainEstimator` (theta = 0.999 ** S), "
        f"{args.replicas} independent replicas. Errors after ceil({args.at} / S) steps "
        f"(~{args.at} baseline batches), RMS over replicas relative to the truth, next to "
        "`estimate_variances`'s prediction; the gain's step-to-step spread is the std of "
        f"r_t - r_(t-1) over the true gain, from {args.at} to {args.until} baseline batches, "
        "and its ratio to the passes estimator's, next to the ratio the per-step variances "
        "predict. 'gain rel. err.': RMS of r_t / r - 1 over the same steps and the replicas. "
        "'steps < 0': the share of steps whose sigma2_hat < 0, which the engine floors "
        "(possible for sampled only). W = 2, k = 8 and k = 32 are B1's accumulation at S = 16 "
        "and 64.",
        "",
        *table(rows),
        "",
        "## Verdict",
        "",
        VERDICT,
        "",
    ])
    args.output.write_text(text)
    print(text)
    return 0


# Figures quoted: the default run (seeded).
VERDICT = """\
**W >= 2: make `workers` the default.** It reads W norms per step whatever k (the gradient each
worker has accumulated before the allreduce: no per-pass hook), it is exactly the engine's model
with n = W (unbiased; m >= q always, so the engine's per-step floor never touches it: its bias is
within about two standard errors in every row) and needs no random choice. Its price: sigma2's
per-step variance is 2 tr(C^2) / (W - 1) instead of 2 tr(C^2) / (n - 1); mu2's error hardly moves
(q's own noise dominates it, the same for all three). The applied gain's step-to-step spread is
1.2-2.0x the passes estimator's wherever W >= 4 or k <= 8 (noise-dominated, both covariances),
2.6-3.2x at B1's W = 2, k = 32 (S = 64), where the gain's RMS error goes from 0.6% to 1.5%
(isotropic) and from 5.7% to 19% (effective rank 1.7). `sampled` reads the same W norms and is a
little steadier at W = 2 while noise dominates (r instead of r - 1 degrees of freedom: 1.68x
against 1.99x at k = 8, low rank), not at W >= 4; but it needs the norm of one chosen pass
(a per-pass hook), its variance has a term 4 S (n / r - 1) mu^T C mu / (n - 1)^2 that grows
with the signal (signal-dominated: 3.9x against workers' 3.2x at W = 2, k = 8; 3.9x against
2.4x at W = 16), and its steps can be < 0, which the engine floors: it comes out biased
(+15.1% ± 2.1 at W = 2, k = 8 with 25% of the steps floored, signal-dominated; +3.1% ± 1.3 at
W = 2, k = 4, noise-dominated). Keep `passes` selectable: at W = 2 with large k and few noise
directions `workers`' gain wobbles several times more.

**W = 1: keep `passes`.** `workers` has n = 1 there (the engine refuses it at S > 1). `sampled`
with one pass has 1.75-2.8x the spread and is biased by the floor (+4.4% ± 1.5, low rank,
k = 8; +32% signal-dominated, 39% of steps floored). If the per-pass reads must stop growing
with k, `sampled` with 4 passes per step costs 1.15-1.8x the spread, but is still floored where
the signal dominates (+4.7% ± 0.9, 11% of steps): only worth it once the engine takes such
statistics unfloored (hvd_scale/estimate.py's floor assumes m >= q, which holds for `passes` and
`workers` only).\
"""

if __name__ == "__main__":
    raise SystemExit(main())
