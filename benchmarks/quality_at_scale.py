"""B1: model quality at scale for every policy (the AdaScale paper's Table 2, small).

    .venv/bin/python benchmarks/quality_at_scale.py            # full: S in 1,4,16,64, 3 seeds
    .venv/bin/python benchmarks/quality_at_scale.py --quick    # minutes: S in 1,16, 1 seed

Task: MNIST-1D (10,000 samples generated locally), the 1-D CNN of examples/torch_mnist1d.py, SGD with
momentum 0.9, baseline batch B0 = 32, a baseline budget T in baseline steps with a step decay
(x0.1 at 50% and 75%) run in tau. S = workers x accumulation: S = 1 is one process, every S >= 2 is
a real `horovodrun -np 2` job with accumulation S / 2. Each run is the example script itself.

Writes benchmarks/results/quality.json (every run), quality.md (the tables) and two plots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

from hvd_scale.launch.jobs import horovodrun_command, read_results

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BIN = pathlib.Path(sys.executable).parent
POLICIES = ["none", "linear", "warmup", "sqrt", "adascale"]


def run_example(script: str, *, scale: int, policy: str, seed: int, lr: float, budget: int,
                log_dir: pathlib.Path | None = None, timeout: float = 1200,
                extra: list[str] | tuple[str, ...] = (), workers: int | None = None) -> dict:
    workers = workers or (1 if scale == 1 else 2)
    accumulate = scale // workers
    args = [str(BIN / "python"), str(ROOT / "examples" / script), "--policy", policy,
            "--seed", str(seed), "--lr", str(lr), "--budget", str(budget),
            "--accumulate", str(accumulate), "--batch-size", "32"]
    if script.startswith("torch"):
        args += ["--log-every", "0"]
    args += list(extra)  # the script's own options
    cmd = horovodrun_command(args, workers, controller="gloo")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    if log_dir is not None:
        env["HVD_SCALE_LOG_DIR"] = str(log_dir)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    result = next((r for r in read_results(proc.stdout) if r["rank"] == 0), None)
    if result is not None:
        return {**result, "framework": script.split("_")[0], "lr": lr, "S": scale}
    raise RuntimeError(f"no RESULT line from rank 0:\n{proc.stdout[-2000:]}")


def summarize(rows: list[dict], scales: list[int]) -> dict:
    base_steps = statistics.mean(r["steps"] for r in rows if r["S"] == 1)
    table = {}
    for policy in POLICIES:
        for s in scales:
            cell = [r for r in rows if r["S"] == s and (s == 1 or r["policy"].split(":")[0] == policy)
                    and r["framework"] == "torch"]
            if not cell:
                continue
            accs = [100 * r["test_accuracy"] for r in cell]
            table[(policy, s)] = {
                "acc_mean": statistics.mean(accs),
                "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "steps": statistics.mean(r["steps"] for r in cell),
                "speedup": base_steps / statistics.mean(r["steps"] for r in cell),
                "gain": statistics.mean(r["mean_gain"] for r in cell), "runs": len(cell)}
    return table


def write_report(args, rows, sweep, table, scales, seconds):
    lines = ["# B1: quality at scale (MNIST-1D, 1-D CNN, SGD momentum 0.9, B0 = 32)", "",
             f"Budget T = {args.budget} baseline steps, step decay x0.1 at 50% and 75% of T run in "
             f"tau; seeds {args.seeds}; S = workers x accumulation (S >= 2: horovodrun -np 2, Gloo).",
             "", "## Baseline lr sweep at S = 1 (seed 0)", "", "| lr | test accuracy % |", "|---|---|"]
    lines += [f"| {r['lr']:g} | {100 * r['test_accuracy']:.1f} |" for r in sweep]
    lines += ["", f"Chosen baseline lr: **{args.lr:g}**", "",
              "## Final test accuracy % (mean ± std over seeds), optimizer steps, speed-up in steps vs S = 1, mean gain (adascale)", "",
              "S = 1 is the same run for every policy (the factor is 1 at S = 1).", "",
              "| policy | " + " | ".join(f"S = {s}" for s in scales) + " |",
              "|---|" + "---|" * len(scales)]
    for policy in POLICIES:
        cells = []
        for s in scales:
            c = table.get((policy, s))
            cells.append("" if c is None else
                         f"{c['acc_mean']:.1f} ± {c['acc_std']:.1f}<br>{c['steps']:.0f} steps, "
                         f"x{c['speedup']:.1f}" + (f", gain {c['gain']:.2f}" if policy == "adascale" else ""))
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    keras_rows = [r for r in rows if r["framework"] == "keras"]
    if keras_rows:
        lines += ["", "## Through the Keras adapter", "", "| policy | S | test accuracy % | steps | mean gain |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['policy']} | {r['S']} | {100 * r['test_accuracy']:.1f} | {r['steps']} | "
                  f"{r['mean_gain']:.2f} |" for r in keras_rows]
    lines += ["", "![accuracy vs S](quality_accuracy.png)", "", "![adascale gain and lr vs tau](quality_adascale.png)",
              "", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
              + (f"; {seconds / 60:.0f} minutes" if seconds else ""),
              f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, {platform.platform()}",
              f"- rerun: `.venv/bin/python benchmarks/quality_at_scale.py {' '.join(sys.argv[1:])}`".rstrip()]
    (RESULTS / "quality.md").write_text("\n".join(lines) + "\n")


def plot(table, scales, log_dir: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hvd_scale.launch.plot import read_run

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for policy in POLICIES:
        pts = [(s, table[(policy, s)]) for s in scales if (policy, s) in table]
        ax.errorbar([s for s, _ in pts], [c["acc_mean"] for _, c in pts],
                    yerr=[c["acc_std"] for _, c in pts], marker="o", capsize=3, label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("scale S")
    ax.set_ylabel("test accuracy %")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(RESULTS / "quality_accuracy.png", dpi=70)
    plt.close(fig)

    plot_gain_and_lr(sorted(log_dir.iterdir()), RESULTS / "quality_adascale.png")


def plot_gain_and_lr(runs, path: pathlib.Path) -> None:
    """Gain and effective lr against tau, one line per metrics log directory (B1 and B4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hvd_scale.launch.plot import read_run

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5), constrained_layout=True)
    for run in runs:
        label, cols = read_run(run)
        a1.plot(cols["progress"], cols["gain"], label=label)
        a2.plot(cols["progress"], cols["lr"], label=label)
    a1.set_title("gain vs tau")
    a2.set_title("effective lr vs tau")
    for a in (a1, a2):
        a.set_xlabel("tau (baseline steps)")
        a.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="S in 1, 16; one seed; budget 1000")
    p.add_argument("--budget", type=int, default=3000)
    p.add_argument("--lr", type=float, default=None, help="skip the sweep and use this baseline lr")
    p.add_argument("--sweep", default="0.02,0.05,0.1,0.2")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--scales", default="1,4,16,64")
    p.add_argument("--keras", action="store_true", default=True)
    p.add_argument("--report-only", action="store_true",
                   help="rewrite quality.md and the plots from quality.json, running nothing")
    args = p.parse_args(argv)
    if args.report_only:
        saved = json.loads((RESULTS / "quality.json").read_text())
        for key, value in saved["args"].items():
            setattr(args, key, value)
        scales = [int(s) for s in args.scales.split(",")]
        table = summarize(saved["runs"], scales)
        write_report(args, saved["runs"], saved["sweep"], table, scales, saved.get("seconds", 0))
        plot(table, scales, RESULTS / "quality_logs")
        print((RESULTS / "quality.md").read_text())
        return 0
    if args.quick:
        args.budget, args.seeds, args.scales = 1000, 1, "1,16"
    scales = [int(s) for s in args.scales.split(",")]
    start = datetime.datetime.now()
    RESULTS.mkdir(parents=True, exist_ok=True)

    sweep = []
    if args.lr is None:
        for lr in (float(x) for x in args.sweep.split(",")):
            sweep.append(run_example("torch_mnist1d.py", scale=1, policy="none", seed=0, lr=lr,
                                     budget=args.budget))
            print(f"sweep lr {lr:g}: {100 * sweep[-1]['test_accuracy']:.1f}%", flush=True)
        args.lr = max(sweep, key=lambda r: r["test_accuracy"])["lr"]

    log_dir = RESULTS / "quality_logs"
    rows = []
    for seed in range(args.seeds):
        for s in scales:
            for policy in (["none"] if s == 1 else POLICIES):
                logged = log_dir / f"adascale-S{s}" if policy == "adascale" and seed == 0 else None
                r = run_example("torch_mnist1d.py", scale=s, policy=policy, seed=seed, lr=args.lr,
                                budget=args.budget, log_dir=logged)
                rows.append(r)
                print(f"seed {seed} S {s:3d} {policy:9s} acc {100 * r['test_accuracy']:.1f}% "
                      f"steps {r['steps']} gain {r['mean_gain']:.2f}", flush=True)
    if args.keras:
        s = max(scales)
        r = run_example("keras_mnist1d.py", scale=s, policy="adascale", seed=0, lr=args.lr,
                        budget=args.budget)
        rows.append(r)
        print(f"keras S {s} adascale acc {100 * r['test_accuracy']:.1f}%", flush=True)

    table = summarize(rows, scales)
    seconds = (datetime.datetime.now() - start).total_seconds()
    (RESULTS / "quality.json").write_text(json.dumps({"args": vars(args), "sweep": sweep, "runs": rows,
                                                      "seconds": seconds}, indent=1) + "\n")
    write_report(args, rows, sweep, table, scales, seconds)
    plot(table, scales, log_dir)
    print((RESULTS / "quality.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
