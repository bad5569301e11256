"""Step timing shared by the overhead benchmarks (B2, B3, the DDP anchor, the GPU script), and
running their jobs (their result lines: hvd_scale.launch.jobs).

On a shared 2-core machine a job's speed drifts by 10-20% within a minute, so one variant's
median against another's, each over the whole job, moves with the drift. Here the variants take
turns in short rounds (the order reversed every other round, so none always follows the same
one), and a variant's ratio to the baseline is the median over rounds of the per-round ratio of
medians: both sides of each ratio are measured within a second of each other.
The interquartile range of the per-round ratios is reported with it.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import subprocess
import time
from typing import Callable, Mapping, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent


def interleave(variants: dict[str, Callable[[], object]], rounds: int, per_round: int,
               warmup: int = 10) -> dict[str, list[list[float]]]:
    """Seconds per call of each variant, by round: {name: [[t, ...] per round]}. First `warmup`
    untimed calls of each variant (allocations, autotuning, traces)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    names = list(variants)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, out = variants[name], []
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            times[name].append(out)
    return times


def summarize(times: dict[str, list[list[float]]], baseline: str) -> dict[str, dict]:
    """{name: {median_ms, steps, ratio_to_<baseline>, ratio_iqr}} from ``interleave``'s times;
    the ratio is the median over rounds of (this round's median / the baseline's)."""
    base = [statistics.median(r) for r in times[baseline]]
    out = {}
    for name, by_round in times.items():
        flat = [t for r in by_round for t in r]
        out[name] = {"median_ms": 1000 * statistics.median(flat), "steps": len(flat)}
        if name != baseline:
            ratios = [statistics.median(r) / b for r, b in zip(by_round, base)]
            q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            out[name][f"ratio_to_{baseline}"] = statistics.median(ratios)
            out[name]["ratio_iqr"] = [q1, q3]
    return out


def run_job(cmd: Sequence[str], env_extra: Mapping[str, str], timeout: float = 1800) -> str:
    """A benchmark job from the repository root, one thread per process unless `env_extra`
    says otherwise; its stdout, or an error with the end of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout
