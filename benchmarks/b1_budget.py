"""B1's S = 64 shortfall with twice the budget: is it a matter of budget? (issue #21)

    .venv/bin/python benchmarks/b1_budget.py        # adascale at S = 1 and 64, T = 6000, 3 seeds (~10 min)
    .venv/bin/python benchmarks/b1_budget.py --budget 3000 --scales 16,64   # B1's cells at today's code

B1 (benchmarks/quality_at_scale.py: MNIST-1D, 1-D CNN, SGD lr 0.05, momentum 0.9, horovodrun -np 2
with accumulation S / 2) at T = 6000 instead of 3000. At T = 3000 adascale reaches 95.6 at S = 64
against 97.3 at S = 1 (results/momentum_horizon.md). If the shortfall were progress not made in
time, doubling T would close it. Resumable: runs already in the results file are not repeated.
Writes benchmarks/results/b1_budget.json and b1_budget.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys

from quality_at_scale import RESULTS, ROOT, run_example


def code_version() -> str:
    """The commit the runs use, with '+' when the working tree differs from it."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout  # noqa: E731
    return git("rev-parse", "--short", "HEAD").strip() + ("+" if git("status", "--porcelain",
                                                                      "--untracked-files=no") else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="1,64")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--budget", type=int, default=6000)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)
    out = RESULTS / "b1_budget.json"
    rows = json.loads(out.read_text()) if out.exists() else []
    code = code_version()
    for S in (int(s) for s in args.scales.split(",")):
        for seed in range(args.seeds):
            if any(r["S"] == S and r["seed"] == seed and r["budget"] == args.budget
                   and r.get("code", "") == code for r in rows):
                continue
            r = run_example("torch_mnist1d.py", scale=S, policy="adascale", seed=seed, lr=args.lr,
                            budget=args.budget)
            rows.append({**r, "budget": args.budget, "seed": seed, "code": code,
                         "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"})
            out.write_text(json.dumps(rows, indent=1) + "\n")
            print(S, seed, r["test_accuracy"], r["steps"], r["mean_gain"], flush=True)
    lines = ["# B1 with twice the budget (adascale, MNIST-1D)", "",
             f"Test accuracy % (mean ± std over seeds), optimizer steps, mean gain; lr {args.lr}, "
             "momentum 0.9; the code the runs used (before the field was kept: 'older').", "",
             "| T | S | code | accuracy | steps | gain |", "|---|---|---|---|---|---|"]
    cells = sorted({(r["budget"], r["S"], r.get("code", "older")) for r in rows})
    for budget, S, version in cells:
        cell = [r for r in rows if r["budget"] == budget and r["S"] == S
                and r.get("code", "older") == version]
        acc = [100 * r["test_accuracy"] for r in cell]
        lines.append(f"| {budget} | {S} | {version} | {statistics.mean(acc):.1f} ± "
                     f"{statistics.stdev(acc) if len(acc) > 1 else 0:.1f} "
                     f"({len(cell)} seeds) | {statistics.mean(r['steps'] for r in cell):.0f} | "
                     f"{statistics.mean(r['mean_gain'] for r in cell):.2f} |")
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- rerun: `.venv/bin/python benchmarks/b1_budget.py {' '.join(argv or sys.argv[1:])}`"]
    (RESULTS / "b1_budget.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
