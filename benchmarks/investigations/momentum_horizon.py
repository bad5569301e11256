"""B1 with SGD momentum's horizon in progress: does momentum^r help adascale at S = 16 and 64?

    .venv/bin/python benchmarks/investigations/momentum_horizon.py          # 2 variants x S in 16, 64 x 3 seeds (~10 min)

Momentum 0.9 averages the gradient over ~10 optimizer steps; at gain r a step is r baseline steps
of progress, so at scale the average spans r times more progress than in the baseline run: the
same argument that took adascale_adam's betas to beta^r (hvd_scale/moments.py). The variant sets
momentum to 0.9^r before each step (r: the previous step's gain, all the example can see) and
the lr x (1 - 0.9^r) / (1 - 0.9), which keeps the steady-state step (lr / (1 - momentum) per unit
of gradient) at r baseline steps' worth. Everything else is B1 (benchmarks/quality_at_scale.py:
MNIST-1D, 1-D CNN, SGD lr 0.05, T = 3000, step decay, horovodrun -np 2 with accumulation S / 2).

Writes benchmarks/results/momentum_horizon.json and momentum_horizon.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # benchmarks/
from quality_at_scale import RESULTS, run_example

VARIANTS = {"momentum fixed (adascale)": [], "momentum^r (horizon in progress)": ["--momentum-horizon"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="1,16,64")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--budget", type=int, default=3000)
    args = p.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    rows = []
    for s in scales:
        for seed in range(args.seeds):
            for name, extra in VARIANTS.items():
                if s == 1 and extra:
                    continue  # r = 1: the variant is the plain run
                r = run_example("torch_mnist1d.py", scale=s, policy="adascale", seed=seed, lr=args.lr,
                                budget=args.budget, extra=extra, workers=1 if s == 1 else 2)
                rows.append({"variant": name, "S": s, "seed": seed, "accuracy": r["test_accuracy"],
                             "steps": r["steps"], "gain": r["mean_gain"], "diverged": r["diverged"]})
                print(f"S {s:3d} seed {seed} {name}: {100 * r['test_accuracy']:.1f}% in {r['steps']} "
                      f"steps, gain {r['mean_gain']:.2f}", flush=True)
    (RESULTS / "momentum_horizon.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# B1: SGD momentum's horizon in progress (adascale, MNIST-1D)", "",
             f"Test accuracy % (mean ± std over {args.seeds} seeds), optimizer steps, mean gain. "
             f"T = {args.budget}, lr {args.lr}, momentum 0.9.", "",
             "| variant | " + " | ".join(f"S = {s}" for s in scales) + " |", "|---|" + "---|" * len(scales)]
    for name in VARIANTS:
        cells = []
        for s in scales:
            cell = [r for r in rows if r["S"] == s and (r["variant"] == name or s == 1)]
            acc = [100 * r["accuracy"] for r in cell]
            cells.append(f"{statistics.mean(acc):.1f} ± {statistics.stdev(acc) if len(acc) > 1 else 0:.1f}"
                         f"<br>{statistics.mean(r['steps'] for r in cell):.0f} steps, gain "
                         f"{statistics.mean(r['gain'] for r in cell):.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- rerun: `.venv/bin/python benchmarks/investigations/momentum_horizon.py {' '.join(argv or sys.argv[1:])}`".rstrip()]
    (RESULTS / "momentum_horizon.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
