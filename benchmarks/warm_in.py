"""AdaScale's warm-in: the first 50 steps' gain error before and after, on the same draws.

    .venv/bin/python benchmarks/warm_in.py       # a few seconds, one process, numpy only

The smoothed estimates after t steps average about t noisy per-step estimates, so without a
warm-in the first steps apply gains from one to a few of them (up to S). The engine now holds
r - 1 toward 0 by the young EMA's excess uncertainty (hvd_scale/estimate.py, ``estimated_gain``).
Here both gains are read from the same estimator state each step: "before" is the bare ratio of
the smoothed estimates (``gain_ratio(*smoothed(state), S)``, what a step applied before the
warm-in), "after" the gain a step applies now (``estimated_gain``).

Synthetic Gaussian micro-gradients g = mu + e, W = 2 workers x k = 8 passes, S = 16, a baseline
batch's covariance of low rank (eigenvalues 0.7, 0.3; sigma2 = 1), mu2 = 0.2 at 45 degrees to
the first (benchmarks/investigations/estimator_variance.py's "low-rank": true gain 4.57); the statistics read
per worker (samples = 2, the default from two workers on) or per pass (samples = 16). Two more
settings show what the warm-in costs where the estimates are good: the same noise spread over
256 dimensions (isotropic) and a signal-dominated mu2 = 2 (true gain 1.45). Each run has its own
seed; default smoothing (theta = 0.999 ** 16).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import time
from pathlib import Path

import numpy as np

from hvd_scale import GainEstimator
from hvd_scale.estimate import estimated_gain, gain_ratio, smoothed

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "warm_in.md"
W, K = 2, 8
SHOW = (1, 2, 3, 5, 10, 20, 30, 40, 50)


def setting(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(eigenvalues of C, mu) for a setting."""
    if name == "isotropic":
        return np.full(256, 1 / 256), math.sqrt(0.2) * np.eye(256)[0]
    mu2 = 2.0 if name == "low-rank, mu2 = 2" else 0.2
    return np.array([0.7, 0.3, 0.0]), math.sqrt(mu2 / 2) * np.array([1.0, 0.0, 1.0])


def draws(run: int, steps: int, lam: np.ndarray, mu: np.ndarray):
    """One run's per-step (per-worker sqnorm_sum, per-pass sqnorm_sum, |g_bar|^2), seed = run."""
    rng = np.random.default_rng(run)
    g = rng.standard_normal((steps, W, K, lam.size)) * np.sqrt(lam) + mu  # (n / S) C = C
    sums = g.sum(axis=2)
    per_worker = np.sum(sums * sums, axis=(1, 2)) / K     # sum_w |G_w|^2 / k_w
    per_pass = np.sum(g * g, axis=(1, 2, 3))
    mean = g.mean(axis=(1, 2))
    return per_worker, per_pass, np.sum(mean * mean, axis=1)


def measure(name: str, runs: int, steps: int) -> dict:
    lam, mu = setting(name)
    scale = W * K
    true_gain = (lam.sum() + mu @ mu) / (lam.sum() / scale + mu @ mu)
    out = {}
    for samples in ("workers", "passes"):
        before, after = np.empty((runs, steps)), np.empty((runs, steps))
        for run in range(runs):
            per_worker, per_pass, q = draws(run, steps, lam, mu)
            est = GainEstimator(scale)
            for t in range(steps):
                if samples == "workers":
                    est.update(per_worker[t], q[t], scale, samples=W)
                else:
                    est.update(per_pass[t], q[t], scale)
                before[run, t] = gain_ratio(*smoothed(est.state), scale)
                after[run, t] = estimated_gain(est.state, scale, est.smoothing)
        out[samples] = (before / true_gain, after / true_gain)
    return {"name": name, "true_gain": float(true_gain), "ratios": out}


def row(ratio: np.ndarray, t: int) -> str:
    x = ratio[:, t - 1]
    return (f"{100 * np.mean(x > 1.5):.0f}% | {100 * np.mean(x < 1 / 1.5):.0f}% | "
            f"{np.median(x):.2f} | {100 * math.sqrt(np.mean(np.log(x) ** 2)):.0f}%")


def report(results: list[dict], runs: int, steps: int, seconds: float) -> str:
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# AdaScale's warm-in: the first 50 steps' gain error before and after",
        "",
        f"Rerun: `.venv/bin/python benchmarks/warm_in.py` ({seconds:.0f} s here, {when}; seeded, "
        "numpy only).",
        "",
        f"W = {W} workers x k = {K} passes, S = {W * K}, {runs} runs of {steps} steps, each its own "
        "seed; the same draws and the same estimator state give both columns: **before** the bare "
        "ratio of the smoothed estimates (what a step applied before the warm-in), **after** the "
        "gain a step applies now (`hvd_scale.estimate.estimated_gain`: r - 1 held toward 0 by the "
        "young EMA's excess uncertainty). Per step t: the share of runs whose gain is above 1.5 x "
        "the true gain, the share below true / 1.5, the median of gain / true, and the RMS of "
        "log(gain / true). 'progress, steps 1-50': the tau the 50 steps credit over what the "
        "true gain would (mean over runs): what the warm-in costs.",
        "",
    ]
    for res in results:
        for samples, (before, after) in res["ratios"].items():
            lines += [
                f"## {res['name']}, {samples} (samples = {W if samples == 'workers' else W * K}"
                f"), true gain {res['true_gain']:.2f}",
                "",
                "| step | before: > 1.5x | < 1/1.5x | median | RMS log err. "
                "| after: > 1.5x | < 1/1.5x | median | RMS log err. |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for t in SHOW:
                if t <= before.shape[1]:
                    lines.append(f"| {t} | {row(before, t)} | {row(after, t)} |")
            worst_before = np.max(np.mean(before > 1.5, axis=0))
            worst_after = np.max(np.mean(after > 1.5, axis=0))
            lines += [
                "",
                f"Worst step's share above 1.5 x true: {100 * worst_before:.0f}% before, "
                f"{100 * worst_after:.0f}% after; progress, steps 1-50: "
                f"{np.mean(before.mean(axis=1)):.2f} before, {np.mean(after.mean(axis=1)):.2f} "
                "after.",
                "",
            ]
    worst = max(np.max(np.mean(after > 1.5, axis=0)) for res in results
                for _, after in res["ratios"].values())
    lines += [
        "## Reading",
        "",
        "Before, the first steps' gains were the estimates of one to a few steps: in a quarter of "
        "runs above 1.5 x the true gain at step 1 (up to S), the low-rank noise's error not under "
        f"20% before step 20. After, at most {100 * worst:.1f}% of runs at any step apply more "
        "than 1.5 x the true gain, at the price of less progress over the first ~40 steps: the "
        "gain is held low by "
        "design (the lower bound of what the estimates are sure of, allowed 1.5 x), and as long "
        "where the estimates were good from step 1 (isotropic noise, per-pass samples), since "
        "the bound takes the worst shape and the fewest samples. From ~step 40 the two columns "
        "are the same gain.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    start = time.perf_counter()
    results = [measure(name, args.runs, args.steps)
               for name in ("low-rank", "isotropic", "low-rank, mu2 = 2")]
    text = report(results, args.runs, args.steps, time.perf_counter() - start)
    args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
