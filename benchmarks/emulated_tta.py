"""B1 time to accuracy on the emulated accelerator cluster: AdaScale untuned against the fixed
rules at their best tuned lr, W = 1, 2, 4, 8.

    .venv/bin/python benchmarks/emulated_tta.py --code /tmp/e_code --code-name <commit> --nice -15
    .venv/bin/python benchmarks/emulated_tta.py --report-only

The task is B1's (examples/torch_mnist1d.py: MNIST-1D, the 1-D CNN, SGD momentum 0.9, micro-batch
B0 = 32, baseline lr 0.05, T = 3000 baseline steps, x0.1 at 50% and 75% of the budget in tau),
each run the example itself under benchmarks/emulated.py (torchrun, --engine ddp, one process per
worker, k = 1 so S = W; the a100-resnet50 profile unless --profile). Stages:

1. S = 1 (W = 1, policy none) and adascale (untuned, lr 0.05) at each W, seed 0: N_W = adascale's
   optimizer steps at W.
2. Each fixed rule (linear, sqrt, linear with warm-up) at each W gets adascale's step count (its
   budget N_W x W in tau, its schedule's decays and warm-up placed in that budget, as in
   fair_fight.py), so it has the same time as adascale, its peak lr (the baseline lr x the rule's
   factor at S) swept over --peaks at seed 0, extended by doublings (halvings) while the best is
   at the grid's edge (twice at most); these tuning runs' seconds are counted and reported.
3. The other seeds: S = 1, adascale and each rule at its best lr (the best final accuracy at seed 0).

Each run evaluates the test accuracy every budget / 20 of tau (timed apart by the example). Time to
target: the training seconds (measured, evaluations excluded) to the first evaluation at or above
the target, and the modelled seconds, that evaluation's step count x the profile's modelled step
(benchmarks/emulated.py: k t(b) + the link's allreduce): what a cluster whose host keeps up would
take. Target: S = 1's final accuracy (mean over its seeds) less --margin points. Speed-up: S = 1's
time to target over the run's, the ideal (W) beside it.

Runs are stored in results/emulated_tta.json as they finish (a stored run is not repeated); --jobs
runs at once (their processes wait most of the time; each run's measured/modelled ratio is stored).
Writes results/emulated_tta.md and results/emulated_tta.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

from hvd_scale.launch.jobs import read_results

from emulated import PROFILES, ROOT, emulated_command, emulated_env, machine, read_emulated

RESULTS = ROOT / "benchmarks" / "results"
STORE = RESULTS / "emulated_tta.json"
LR = 0.05
BUDGET = 3000
RULES = ["linear", "sqrt", "warmup:rule=linear"]
LABELS = {"none": "S = 1", "adascale": "adascale (untuned)", "linear": "linear",
          "sqrt": "sqrt", "warmup:rule=linear": "linear + warm-up"}
_lock = threading.RLock()


def factor(rule: str, S: int) -> float:
    """The rule's lr factor at S once any warm-up is over."""
    return float(S) if "linear" in rule else S ** 0.5


def key(r: dict) -> tuple:
    return r["policy"], r["W"], r["seed"], round(r["lr"], 12), r["budget"]


def load() -> dict:
    with _lock:  # the pool's threads write it as runs finish
        return json.loads(STORE.read_text()) if STORE.exists() else {"runs": []}


def save_run(row: dict) -> None:
    with _lock:  # read, appended, written whole, then renamed: a reader never sees half a file
        data = load()
        data["runs"].append(row)
        tmp = STORE.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, STORE)


def run(args, policy: str, W: int, seed: int, lr: float, budget: int) -> dict:
    stored = {key(r): r for r in load()["runs"]}
    spec = {"policy": policy, "W": W, "seed": seed, "lr": lr, "budget": budget}
    if key(spec) in stored:
        return stored[key(spec)]
    script = [args.code / "examples" / "torch_mnist1d.py", "--engine", "ddp", "--policy", policy,
              "--seed", str(seed), "--lr", repr(lr), "--budget", str(budget), "--batch-size", "32",
              "--log-every", "0", "--eval-every", f"{budget / 20:g}"]
    env = emulated_env(**({"PYTHONPATH": str(args.code)} if args.code != ROOT else {}))
    cmd = emulated_command(script, W, profile=args.profile, nice=args.nice)
    load_before, start = os.getloadavg()[0], time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, cwd="/tmp")
    ranks = read_emulated(proc.stdout)
    try:
        result = next((r for r in read_results(proc.stdout) if r["rank"] == 0), None)
    except ValueError:  # a line the ranks' writes cut: the job's figures are not readable
        result = None
    if proc.returncode != 0 or result is None or not ranks:
        raise RuntimeError(f"{spec} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    e = ranks[0]
    row = {**spec, "steps": result["steps"], "accuracy": 100 * result["test_accuracy"],
           "diverged": result["diverged"], "mean_gain": result["mean_gain"],
           "seconds": result["seconds"], "curve": result["curve"],
           "step_modelled": PROFILES[args.profile].step_time(32, 1, W),
           "step_wall": e["step_wall"], "ratio": e["ratio"], "cpu_share": e["cpu_share"],
           "job_seconds": time.time() - start, "load": [load_before, os.getloadavg()[0]],
           "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
           "code": args.code_name, "profile": args.profile, "nice": args.nice}
    save_run(row)
    print(f"{policy:20s} W {W} seed {seed} lr {lr:.4g} budget {budget}: {row['accuracy']:.2f}% "
          f"{row['steps']} steps, {row['seconds']:.0f} s (x{row['ratio']:.2f} of modelled), "
          f"load {row['load'][0]:.1f}/{row['load'][1]:.1f}", flush=True)
    return row


def parallel(args, specs: list[tuple]) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(lambda s: run(args, *s), specs))


def best_lr(runs: list[dict]) -> float:
    return max(runs, key=lambda r: (r["accuracy"], -r["lr"]))["lr"]


def reached(row: dict, target: float) -> tuple[float, float, int] | None:
    """(measured seconds, modelled seconds, steps) at the first evaluation at or above target."""
    for seconds, _tau, steps, acc in row["curve"]:
        if 100 * acc >= target:
            return seconds, steps * row["step_modelled"], steps
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4,8")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--peaks", default="0.05,0.1,0.2", help="the peak lrs (lr x factor at S) swept")
    p.add_argument("--margin", type=float, default=1.0, help="target: S = 1's final less this (points)")
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--profile", choices=sorted(PROFILES), default="a100-resnet50")
    p.add_argument("--nice", type=int, default=0)
    p.add_argument("--code", type=pathlib.Path, default=ROOT)
    p.add_argument("--code-name", default=None)
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    rules = args.rules.split(",")
    peaks = [float(x) for x in args.peaks.split(",")]
    stages = args.stages.split(",")
    t_start = time.time()
    if not args.report_only:
        if "1" in stages:
            parallel(args, [("none", 1, 0, LR, BUDGET)] + [("adascale", W, 0, LR, BUDGET) for W in workers])
        ada = {r["W"]: r["steps"] for r in load()["runs"] if r["policy"] == "adascale" and r["seed"] == 0}
        if "2" in stages:
            parallel(args, [(rule, W, 0, peak / factor(rule, W), ada[W] * W)
                            for W in sorted(workers, reverse=True) for rule in rules for peak in peaks])
            for _ in range(2):  # a best peak at the grid's edge: the next doubling (halving) beyond it
                specs = []
                for W in sorted(workers, reverse=True):
                    for rule in rules:
                        grid = sorted((r for r in load()["runs"] if r["policy"] == rule
                                       and r["W"] == W and r["seed"] == 0), key=lambda r: r["lr"])
                        best = best_lr(grid)
                        if best == grid[-1]["lr"]:
                            specs.append((rule, W, 0, 2 * best, ada[W] * W))
                        elif best == grid[0]["lr"]:
                            specs.append((rule, W, 0, best / 2, ada[W] * W))
                parallel(args, specs)
        if "3" in stages:
            runs = load()["runs"]
            specs = []
            for seed in range(1, args.seeds):
                specs.append(("none", 1, seed, LR, BUDGET))
                for W in sorted(workers, reverse=True):
                    specs.append(("adascale", W, seed, LR, BUDGET))
                    for rule in rules:
                        grid = [r for r in runs if r["policy"] == rule and r["W"] == W and r["seed"] == 0]
                        if grid:
                            specs.append((rule, W, seed, best_lr(grid), ada[W] * W))
            parallel(args, specs)
    write_report(args, workers, rules, time.time() - t_start, argv)
    return 0


def write_report(args, workers, rules, seconds, argv) -> None:
    runs = load()["runs"]
    base = [r for r in runs if r["policy"] == "none" and r["W"] == 1]
    final = statistics.mean(r["accuracy"] for r in base)
    target = final - args.margin
    base_hit = [reached(r, target) for r in base]
    base_meas = statistics.mean(h[0] for h in base_hit if h)
    base_mod = statistics.mean(h[1] for h in base_hit if h)
    lines = ["# B1 time to accuracy on the emulated cluster (benchmarks/emulated.py)", "",
             f"MNIST-1D 1-D CNN, SGD momentum 0.9, micro-batch 32 per worker, k = 1 (S = W), DDP "
             f"under torchrun, profile {args.profile} "
             f"(t(32) = {1e3 * PROFILES[args.profile].pass_time(32):.1f} ms a pass; the link's "
             f"allreduce {', '.join(f'W = {w}: {1e3 * PROFILES[args.profile].allreduce_time(w):.1f} ms' for w in workers)}). "
             f"S = 1: {final:.2f}% (mean of {len(base)} seeds); **target {target:.2f}%** "
             f"(less {args.margin:g} point); S = 1 reaches it in {base_meas:.0f} s measured, "
             f"{base_mod:.0f} s modelled. Fixed rules: adascale's step count at that W, peak lr swept "
             "at seed 0 (tuning runs' training seconds counted), then the other seeds at the best. "
             "'measured': training seconds on this machine (evaluations excluded); 'modelled': "
             "the steps to the target x the modelled step (what a cluster whose hosts keep up "
             "takes). Speed-up: S = 1's time to target over the run's (ideal: W).", "",
             "| W | policy | lr (peak) | accuracy % (seeds) | steps | reached | s to target, measured "
             "| s modelled | speed-up measured | speed-up modelled (ideal) | measured / modelled step "
             "| tuning runs (s measured) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for W in [1] + workers:
        for policy in (["none"] if W == 1 else ["adascale"] + rules):
            cell_all = [r for r in runs if r["policy"] == policy and r["W"] == W]
            if not cell_all:
                continue
            if policy in ("none", "adascale"):
                lr, tuning = LR, []
            else:
                tuning = [r for r in cell_all if r["seed"] == 0]
                lr = best_lr(tuning)
            cell = [r for r in cell_all if abs(r["lr"] - lr) < 1e-12]
            hits = [reached(r, target) for r in cell]
            ok = [h for h in hits if h]
            meas = statistics.mean(h[0] for h in ok) if ok else None
            mod = statistics.mean(h[1] for h in ok) if ok else None
            accs = [r["accuracy"] for r in cell]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            summary[(W, policy)] = {"meas": meas, "mod": mod, "reached": len(ok), "n": len(cell)}
            peak = lr * factor(policy, W) if policy not in ("none", "adascale") else LR
            grid = "; ".join(f"{r['lr'] * factor(policy, W):.3g}: {r['accuracy']:.1f}"
                             for r in sorted(tuning, key=lambda r: r["lr"]))
            lines.append(
                f"| {W} | {LABELS.get(policy, policy)} | {lr:.4g} ({peak:.3g}) | {statistics.mean(accs):.2f} ± {sd:.2f} "
                f"({len(cell)}) | {statistics.mean(r['steps'] for r in cell):.0f} | {len(ok)} of {len(cell)} | "
                + (f"{meas:.0f} | {mod:.0f} | x{base_meas / meas:.2f} | x{base_mod / mod:.2f} ({W}) | "
                   if ok else "- | - | - | - | ")
                + f"{statistics.mean(r['ratio'] for r in cell):.2f} | "
                + (f"{len(tuning)} ({sum(r['seconds'] for r in tuning):.0f}): {grid}" if tuning else "0")
                + " |")
    m = machine()
    loads = [x for r in runs for x in r["load"]]
    lines += ["", "![speed-up against W](emulated_tta.png)", "",
              f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['isa']}), 1 torch "
              f"thread per process; load (1-minute) over the runs {min(loads):.1f}-{max(loads):.1f}, "
              "shared with other work; per-seed figures hold per machine, the seeds' spread is what "
              "carries over",
              f"- runs: {len(runs)}, {runs[0]['date']} to {runs[-1]['date']} UTC; code: "
              f"{', '.join(sorted({str(r['code']) for r in runs}))}; workers at nice "
              f"{', '.join(sorted({str(r['nice']) for r in runs}))}",
              f"- rerun: `.venv/bin/python benchmarks/emulated_tta.py {' '.join(sys.argv[1:] if argv is None else argv)}`"]
    (RESULTS / "emulated_tta.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(summary, workers, rules, base_meas, base_mod)


def plot(summary, workers, rules, base_meas, base_mod) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True, sharey=True)
    for ax, which, base, title in ((axes[0], "mod", base_mod, "modelled time"),
                                   (axes[1], "meas", base_meas, "measured on this machine")):
        ws = [1] + workers
        ax.plot(ws, ws, "k--", label="ideal (W)")
        for policy in ["adascale"] + rules:
            pts = [(1, 1.0)] + [(W, base / summary[(W, policy)][which]) for W in workers
                                if (W, policy) in summary and summary[(W, policy)][which]]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=LABELS[policy])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("workers W (S = W)")
        ax.set_title(f"B1 speed-up to target, {title}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("S = 1's time to target / the run's")
    axes[0].legend(fontsize=8)
    fig.savefig(RESULTS / "emulated_tta.png", dpi=70)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
