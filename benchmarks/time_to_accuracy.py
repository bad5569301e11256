"""B1 time to accuracy: wall-clock to reach the S = 1 accuracy, with 1 and 2 workers.

    .venv/bin/python benchmarks/time_to_accuracy.py      # ~5 min on a quiet machine

Steps are what the quality table counts; seconds are what users judge scaling by. The B1 task
(benchmarks/quality_at_scale.py: MNIST-1D, the 1-D CNN, SGD momentum 0.9, B0 = 32, T = 3000,
lr 0.05), test accuracy every 100 baseline steps of progress (the evaluations timed apart), for:
np 1 at S = 1 (the baseline), np 1 at S = 2 (accumulation alone), and np 2 (`horovodrun`, Gloo,
the launcher's HOROVOD_CYCLE_TIME=5) at S = 2 and 16 with adascale and the fixed rules. Targets:
the S = 1 run's final accuracy, and that minus 1 point. Speed-up: the baseline's time to the
target over the run's. On this 2-core machine np 2 uses both cores and np 1 one.

Writes benchmarks/results/time_to_accuracy.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from quality_at_scale import RESULTS, run_example

RUNS = [(1, 1, "none"), (1, 2, "adascale")] + \
       [(2, s, p) for s in (2, 16) for p in ("adascale", "linear", "sqrt", "warmup")]


def reached(curve, target):
    """(seconds, steps) of the first evaluation at or above target, else None."""
    for seconds, _tau, steps, acc in curve:
        if acc >= target:
            return seconds, steps
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=float, default=100)
    args = p.parse_args(argv)
    os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")  # as `hvd-scale run` sets for CPU jobs
    rows = []
    for workers, s, policy in RUNS:
        r = run_example("torch_mnist1d.py", scale=s, policy=policy, seed=args.seed, lr=0.05,
                        budget=3000, workers=workers, extra=["--eval-every", str(args.eval_every)])
        r["workers"] = workers
        rows.append(r)
        print(f"np {workers} S {s:2d} {policy:8s} acc {100 * r['test_accuracy']:.1f}% "
              f"{r['steps']} steps {r['seconds']:.1f} s", flush=True)
    (RESULTS / "time_to_accuracy.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1) + "\n")
    base = rows[0]
    final = base["test_accuracy"]
    targets = [final, final - 0.01]
    base_at = [reached(base["curve"], t) for t in targets]
    lines = ["# B1 time to accuracy (MNIST-1D CNN, SGD momentum 0.9, B0 = 32, T = 3000, lr 0.05)", "",
             f"Seed {args.seed}; test accuracy every {args.eval_every:g} baseline steps of progress; "
             "seconds of training (evaluations excluded) to the first evaluation at the target; "
             "np 2 under horovodrun (Gloo, HOROVOD_CYCLE_TIME=5).", "",
             f"| workers | S | policy | final % | steps | training s | to {100 * targets[0]:.1f}% "
             f"(S = 1 final) | to {100 * targets[1]:.1f}% |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for t, b in zip(targets, base_at):
            hit = reached(r["curve"], t)
            cells.append("not reached" if hit is None else
                         f"{hit[0]:.1f} s, {hit[1]} steps" + (f" (x{b[0] / hit[0]:.2f})" if b else ""))
        lines.append(f"| {r['workers']} | {r['S']} | {r['policy']} | {100 * r['test_accuracy']:.1f} | "
                     f"{r['steps']} | {r['seconds']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
              f"{os.cpu_count()} CPUs",
              f"- rerun: `.venv/bin/python benchmarks/time_to_accuracy.py {' '.join(sys.argv[1:])}`".rstrip()]
    (RESULTS / "time_to_accuracy.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "time_to_accuracy.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
