"""The lr safety guard on B1: linear and warm-up at S = 16 and 64, with and without the guard.

    .venv/bin/python benchmarks/guard.py            # ~15 min: 2 seeds
    .venv/bin/python benchmarks/guard.py --quick    # S = 16, 1 seed

The B1 task and runs (benchmarks/quality_at_scale.py: MNIST-1D, the 1-D CNN, SGD momentum 0.9,
B0 = 32, T = 3000, baseline lr 0.05, `horovodrun -np 2` with accumulation S / 2), each policy
run without the guard and with it at margin 1 (the stability limit 2 (1 + beta) / lambda itself)
and at margin 0.5 (the default, the seed's 1/L), measured every 5 steps. Also S = 1 with the
guard, to see that it leaves a tuned baseline alone. The guard's cost is its measured time
beyond an ordinary step, per optimizer step.

Writes benchmarks/results/guard.json and guard.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

from quality_at_scale import RESULTS, run_example

EVERY = 5
VARIANTS = {"off": [], "margin 1": ["--guard-every", str(EVERY), "--guard-margin", "1"],
            "margin 0.5": ["--guard-every", str(EVERY), "--guard-margin", "0.5"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05, help="B1's baseline lr (tuned at S = 1)")
    p.add_argument("--budget", type=int, default=3000)
    args = p.parse_args(argv)
    scales = [16] if args.quick else [16, 64]
    seeds = 1 if args.quick else args.seeds
    runs = []
    for seed in range(seeds):
        configs = [("none", 1, v) for v in ("off", "margin 0.5")]
        configs += [(pol, s, v) for pol in ("linear", "warmup") for s in scales for v in VARIANTS]
        for policy, s, variant in configs:
            r = run_example("torch_mnist1d.py", scale=s, policy=policy, seed=seed, lr=args.lr,
                            budget=args.budget, extra=VARIANTS[variant])
            r["variant"] = variant
            runs.append(r)
            print(f"seed {seed} {policy:7s} S {s:3d} guard {variant:10s} acc "
                  f"{100 * r['test_accuracy']:.1f}% capped {r['capped_steps']}/{r['steps']} "
                  f"guard {r['guard_seconds']:.2f} s of {r['seconds']:.1f} s", flush=True)
    (RESULTS / "guard.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")
    write_report(runs, seeds)
    print((RESULTS / "guard.md").read_text())
    return 0


def write_report(runs, seeds):
    lines = ["# The lr guard on B1 (MNIST-1D CNN, SGD momentum 0.9, B0 = 32, T = 3000, lr 0.05)", "",
             f"Guard every {EVERY} steps (power iteration, <= 20 Hessian-vector products, tol 1e-3, "
             f"on the last micro-batch of each worker, averaged). Test accuracy %, mean ± std over "
             f"{seeds} seed(s); steps capped / optimizer steps; the guard's time per optimizer step "
             "as a fraction of the median unguarded step of the same run. A run whose steps are all "
             "non-finite 100 times in a row stops as diverged (its accuracy is that of its last "
             "finite weights).", "",
             "| policy | S | guard | accuracy % | capped steps | max sharpness | guard cost / step |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["policy"], r["S"], r["variant"]) for r in runs},
                  key=lambda k: (k[1] != 1, k[0], k[1], list(VARIANTS).index(k[2])))
    for policy, s, variant in keys:
        cell = [r for r in runs if (r["policy"], r["S"], r["variant"]) == (policy, s, variant)]
        accs = [100 * r["test_accuracy"] for r in cell]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        guarded = variant != "off"
        capped = f"{statistics.mean(r['capped_steps'] for r in cell):.0f} / {cell[0]['steps']}" if guarded else ""
        sharp = f"{statistics.mean(r['max_sharpness'] for r in cell):.1f}" if guarded else ""
        cost = ""
        if guarded:  # guard seconds per step over (run seconds - guard seconds) per step
            cost = statistics.mean(r["guard_seconds"] / (r["seconds"] - r["guard_seconds"]) for r in cell)
            cost = f"+{100 * cost:.0f}%"
        diverged = sum(r.get("diverged", False) for r in cell)
        note = f" (diverged {diverged}/{len(cell)})" if diverged else ""
        lines.append(f"| {policy} | {s} | {variant} | {statistics.mean(accs):.1f} ± {std:.1f}{note} | "
                     f"{capped} | {sharp} | {cost} |")
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- rerun: `.venv/bin/python benchmarks/guard.py {' '.join(sys.argv[1:])}`".rstrip()]
    (RESULTS / "guard.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
