"""B5: time to accuracy with two workers on two cores: fixed and adaptive accumulation (issue #24).

    .venv/bin/python benchmarks/goodput_tta.py            # ~25 min on a quiet machine

Task A, compute-bound (B4's: examples/torch_translate.py, the Transformer, Adam (0.9, 0.98), T =
2400 baseline steps where S = 1 converges, lr 0.008, B0 = 32 sentences), for each seed:
  (a) one process at S = 1 with torch threads = 2 (both cores; the peer), and = 1;
  (b) 2 workers (horovodrun, Gloo, HOROVOD_CYCLE_TIME=5, 1 thread each) with adascale_adam at
      fixed k = 1, 2, 8 (S = 2, 4, 16);
  (c) 2 workers with adapt='goodput' (k from 1, max_passes 16).
A run's time is its training seconds to tau = T (the evaluation excluded); it reaches the S = 1
quality when its BLEU is within 1 of the seed's S = 1 (2 threads) BLEU. Medians over seeds.
Also: the ceiling (300 baseline steps: one process with 1 and 2 threads, two 1-thread processes
side by side), where a 2-worker step's time goes (per pass, allreduce wait, update: the adapters'
timing columns), and the step-time model (hvd_scale.goodput) fitted to the k = 1 run predicting
the mean step time at k = 2 and 8.
Task B, tiny steps (B1: examples/torch_mnist1d.py, SGD momentum 0.9, T = 3000, lr 0.05, adascale):
one process at S = 1 against 2 workers at k = 1 and with adapt='goodput', test accuracy every 100
baseline steps, time to the S = 1 final accuracy.
Task C, the case most favourable to workers found here (examples/torch_lm.py: a GRU language model
on the grammar's random sentences, Adam, T = 3000, lr 0.01, 64 sentences a micro-batch): the next
word's entropy keeps the gradient noisy (gain near S at small S) and a second thread speeds one
process up little. As task A with k = 1, 2, 4, 8 and adapt, the test loss every 250 baseline steps;
time: training seconds to the first evaluation within 0.01 nats (perplexity within 1%) of the same
seed's one-process (2 threads) final test loss; its own ceiling and step-time table.

--tasks picks tasks; the others' rows are kept from the stored JSON (each task has its date).
Writes benchmarks/results/goodput_tta.json and .md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from hvd_scale import goodput
from hvd_scale.launch.jobs import CPU_ENV_DEFAULTS, horovodrun_command, read_results
from hvd_scale.launch.plot import read_run

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BIN = pathlib.Path(sys.executable).parent
B4 = {"script": "torch_translate.py", "lr": 0.008, "budget": 2400, "policy": "adascale_adam", "batch": 32}
B1 = {"script": "torch_mnist1d.py", "lr": 0.05, "budget": 3000, "policy": "adascale", "batch": 32}
LM = {"script": "torch_lm.py", "lr": 0.01, "budget": 3000, "policy": "adascale_adam", "batch": 64}
FIXED = (1, 2, 8)
LM_FIXED = (1, 2, 4, 8)
LM_EVAL_EVERY = 250
LM_TOLERANCE = 0.01  # nats per word: perplexity within 1%
MAX_PASSES = 16
WARMUP_STEPS = 5  # not the run's pace (allocations, first allreduces)


def run(task: dict, *, workers: int, seed: int, k: int = 1, adapt: bool = False, threads: int = 1,
        budget: float | None = None, log_dir: pathlib.Path | None = None, extra=(),
        timeout: float = 1800) -> dict:
    """One run of the task's example; rank 0's RESULT with the wall time."""
    args = [str(BIN / "python"), str(ROOT / "examples" / task["script"]),
            "--policy", task["policy"] if workers > 1 or k > 1 else "none", "--seed", str(seed),
            "--lr", str(task["lr"]), "--budget", str(budget or task["budget"]),
            "--accumulate", str(k), "--batch-size", str(task["batch"]), "--log-every", "0", *extra]
    if adapt:
        args += ["--adapt", "goodput", "--max-passes", str(MAX_PASSES)]
    cmd = args if workers == 1 else horovodrun_command(args, workers, controller="gloo")
    env = {**os.environ, **CPU_ENV_DEFAULTS, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("HVD_SCALE_LOG_DIR", None)
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)
        env["HVD_SCALE_LOG_DIR"] = str(log_dir)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                          start_new_session=True)
    result = next((r for r in read_results(proc.stdout) if r["rank"] == 0), None)
    if result is None:
        raise RuntimeError(f"run failed ({' '.join(cmd)}): exit {proc.returncode}\n"
                           f"{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return {**result, "wall": time.perf_counter() - start, "threads": threads, "adapt": adapt,
            "k": k, "workers": workers}


def timings(log_dir: pathlib.Path) -> dict:
    """A run's step times by k (means after the warm-up) and the model fitted to all of them."""
    _, c = read_run(log_dir)
    keep = [i for i in range(len(c["step"])) if c["step"][i] > WARMUP_STEPS
            and all(np.isfinite(c[key][i]) for key in ("pass_time", "allreduce_time", "update_time"))]
    n = len(c["step"])
    col = {key: np.array([c.get(key, [np.nan] * n)[i] for i in keep]) for key in
           ("passes", "pass_time", "overhead_time", "allreduce_time", "update_time", "step_time",
            "statistics_time")}
    by_k = {}
    for k in sorted(set(col["passes"].tolist())):
        sel = col["passes"] == k
        by_k[int(k)] = {key: float(np.mean(col[key][sel])) for key in
                        ("pass_time", "allreduce_time", "update_time", "step_time")}
        by_k[int(k)]["steps"] = int(sel.sum())
    # As advise reads a log: with k >= 2 pass_time is one pass alone and overhead_time the rest
    # of the step's compute (dropped before: the per-step work vanished from the fit).
    alone = np.isfinite(col["overhead_time"])
    model = goodput.fit_step_time(col["passes"], np.ones(len(keep)),
                                  col["pass_time"] * col["passes"] + np.where(alone, col["overhead_time"], 0.0),
                                  col["allreduce_time"], col["update_time"], workers=2,
                                  per_pass=np.where(alone, col["pass_time"], np.nan),
                                  statistics=np.nan_to_num(col["statistics_time"]))
    return {"by_k": by_k, "model": model.__dict__,
            "passes_over_steps": [int(x) for x in c["passes"] if np.isfinite(x)]}


def ceiling(task: dict = B4, steps: int = 300) -> dict:
    """Seconds of `steps` baseline steps at S = 1: 1 process x 1 thread, x 2 threads, and two
    1-thread processes side by side (both timed)."""
    one = run(task, workers=1, seed=0, threads=1, budget=steps)["seconds"]
    two_threads = run(task, workers=1, seed=0, threads=2, budget=steps)["seconds"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pair = [r["seconds"] for r in pool.map(
            lambda s: run(task, workers=1, seed=s, threads=1, budget=steps), (0, 1))]
    return {"steps": steps, "one_thread": one, "two_threads": two_threads, "side_by_side": pair,
            "work_ratio": 2 * one / max(pair)}


def time_runs(task: dict, fixed, seeds: int, logs: pathlib.Path, extra: list, quality) -> list[dict]:
    """Per seed: one process with 2 and 1 threads, 2 workers at each fixed k and with adapt; the
    workers' step times from their logs."""
    runs = []
    for seed in range(seeds):
        configs = [dict(workers=1, threads=2), dict(workers=1, threads=1)] + \
                  [dict(workers=2, k=k) for k in fixed] + [dict(workers=2, adapt=True)]
        for cfg in configs:
            log = logs / f"{seed}-{len(runs)}" if cfg["workers"] == 2 else None
            r = run(task, seed=seed, log_dir=log, extra=extra, **cfg)
            if log is not None:
                r["timings"] = timings(log)
            r.pop("sample", None)
            runs.append(r)
            print(f"{task['script']} seed {seed} {cfg}: {quality(r)}, {r['steps']} steps, "
                  f"{r['seconds']:.1f} s, final k {r.get('final_passes')}", flush=True)
    return runs


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--tasks", default="a,b,c,c-budget",
                   help="comma-separated, of a, b, c, c-budget (task C's S = 1 at twice the budget)")
    args = p.parse_args(argv)
    tasks = set(args.tasks.split(","))
    if not tasks <= {"a", "b", "c", "c-budget"}:
        p.error(f"--tasks takes a comma-separated subset of a, b, c, c-budget; got {args.tasks!r}")
    store = RESULTS / "goodput_tta.json"
    out = json.loads(store.read_text()) if store.exists() else {}
    out.setdefault("dates", {})
    now = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
    out["machine"] = f"{os.cpu_count()} CPUs, {platform.platform()}"
    logs = pathlib.Path(tempfile.mkdtemp(prefix="b5logs-"))
    try:
        if "a" in tasks:
            out["dates"]["a"], out["ceiling"] = now, ceiling(B4)
            out["b4"] = time_runs(B4, FIXED, args.seeds, logs / "b4", [], lambda r: f"BLEU {r['bleu']:.1f}")
        if "b" in tasks:
            out["dates"]["b"], out["b1"] = now, []
            for seed in range(args.seeds):
                for cfg in (dict(workers=1, threads=2), dict(workers=2, k=1), dict(workers=2, adapt=True)):
                    r = run(B1, seed=seed, extra=["--eval-every", "100"], **cfg)
                    out["b1"].append(r)
                    print(f"B1 seed {seed} {cfg}: acc {100 * r['test_accuracy']:.1f}%, "
                          f"{r['seconds']:.1f} s, final k {r.get('final_passes')}", flush=True)
        if "c" in tasks:
            out["dates"]["c"], out["lm_ceiling"] = now, ceiling(LM)
            out["lm"] = time_runs(LM, LM_FIXED, args.seeds, logs / "lm", ["--eval-every", str(LM_EVAL_EVERY)],
                                  lambda r: f"test loss {r['test_loss']:.4f}")
        if "c-budget" in tasks:  # is T converged? S = 1 at 2T, seed 0
            out["dates"]["c-budget"] = now
            out["lm_budget"] = run(LM, workers=1, threads=2, seed=0, budget=2 * LM["budget"],
                                   extra=["--eval-every", str(LM_EVAL_EVERY)])
            print(f"LM at T = {2 * LM['budget']}: test loss {out['lm_budget']['test_loss']:.4f}", flush=True)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    store.write_text(json.dumps(out, indent=1) + "\n")
    report(out, argv if argv is not None else sys.argv[1:])
    return 0


def label(r) -> str:
    if r["workers"] == 1:
        return f"1 process, {r['threads']} thread{'s' if r['threads'] > 1 else ''}, S = 1"
    return f"2 workers, {'adapt=goodput (k from 1, max 16)' if r['adapt'] else 'k = ' + str(r['k'])}"


def peers(runs: list[dict]) -> dict[int, dict]:
    """Each seed's one-process run with 2 threads: the peer the other runs are measured against."""
    return {r["seed"]: r for r in runs if r["workers"] == 1 and r["threads"] == 2}


def by_label(runs: list[dict]) -> dict[str, list[dict]]:
    """The runs grouped by kind (one per seed each), in the order they ran."""
    groups: dict[str, list] = {}
    for r in runs:
        groups.setdefault(label(r), []).append(r)
    return groups


def ceiling_line(c: dict) -> str:
    return (f"Ceiling ({c['steps']} baseline steps at S = 1): one process {c['one_thread']:.1f} s "
            f"with 1 thread, {c['two_threads']:.1f} s with 2; two 1-thread processes side by side "
            f"{c['side_by_side'][0]:.1f} and {c['side_by_side'][1]:.1f} s: the two cores do "
            f"**x{c['work_ratio']:.2f}** the work of one (one process with 2 threads: "
            f"x{c['one_thread'] / c['two_threads']:.2f}).")


def step_table(runs: list[dict]) -> list[str]:
    """Where a 2-worker step's time goes (the first seed), and the model fitted to k = 1."""
    seed = min(r["seed"] for r in runs)
    runs0 = [r for r in runs if r["seed"] == seed and r["workers"] == 2]
    model = goodput.StepTimeModel(**next(r for r in runs0 if r["k"] == 1 and not r["adapt"])
                                  ["timings"]["model"])
    lines = ["Where a 2-worker step's time goes (seed 0, means after the first 5 steps; ms; per "
             "micro-batch: the step over its 2k micro-batches), and the step-time model fitted to "
             "the k = 1 run predicting the others' mean step time:", "",
             "| run | k | steps | per pass | allreduce wait | update | step | per micro-batch | predicted from k = 1 | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs0:
        for k, t in r["timings"]["by_k"].items():
            pred = model.step_time(int(k))
            lines.append(f"| {label(r)} | {k} | {t['steps']} | {1e3 * t['pass_time']:.1f} | "
                         f"{1e3 * t['allreduce_time']:.1f} | {1e3 * t['update_time']:.1f} | "
                         f"{1e3 * t['step_time']:.1f} | {1e3 * t['step_time'] / (2 * int(k)):.1f} | {1e3 * pred:.1f} | "
                         f"{100 * (pred - t['step_time']) / t['step_time']:+.0f}% |")
    one = peers(runs)[seed]
    return lines + ["", f"One process with 2 threads: {1e3 * one['seconds'] / one['steps']:.1f} ms per "
                    "step (one pass, no allreduce)."]


def time_to(runs: list[dict], reached) -> list[str]:
    """Per run kind: finals per seed, steps, final k, training s, and the median time to the
    first evaluation where `reached(run, curve point)` holds against the same seed's S = 1 run."""
    lines = []
    for name, rs in by_label(runs).items():
        reach = [next((point[0] for point in r["curve"] if reached(r, point)), None) for r in rs]
        hit = [x for x in reach if x is not None]
        lines.append(f"| {name} | {' / '.join(final(r) for r in rs)} | "
                     f"{median([r['steps'] for r in rs]):.0f} | {median([r['mean_gain'] for r in rs]):.2f} | "
                     f"{'/'.join(str(r.get('final_passes', r['k'])) for r in rs)} | "
                     f"{median([r['seconds'] for r in rs]):.1f} | "
                     + (f"{median(hit):.1f} s ({len(hit)} of {len(rs)} seeds)" if hit else "not reached")
                     + " |")
    return lines


def final(r: dict) -> str:
    return f"{r['test_loss']:.4f}" if "test_loss" in r else f"{100 * r['test_accuracy']:.1f}"


def report(out: dict, argv) -> None:
    dates = out["dates"]
    lines = ["# B5: time to accuracy with two workers on two cores (issue #24)", "",
             f"Task A ({dates['a']} UTC): B4's Transformer (examples/torch_translate.py), T = 2400 "
             "(S = 1 converged), lr 0.008; adascale_adam for 2 workers (Gloo, HOROVOD_CYCLE_TIME=5, "
             "1 thread each). Time: training seconds to tau = T (evaluation excluded); reached: BLEU "
             "within 1 of the same seed's one-process (2 threads) run. Medians over seeds "
             f"({len({r['seed'] for r in out['b4']})}).", "",
             "| run | BLEU (per seed) | steps | final k | training s | reached | vs 1 process, 2 threads |",
             "|---|---|---|---|---|---|---|"]
    base = peers(out["b4"])
    for name, rs in by_label(out["b4"]).items():
        hit = all(r["bleu"] >= base[r["seed"]]["bleu"] - 1 for r in rs)
        t = median([r["seconds"] for r in rs])
        speed = median([base[r["seed"]]["seconds"] for r in rs]) / t
        bleus = " / ".join(f"{r['bleu']:.1f}" for r in rs)
        lines.append(f"| {name} | {bleus} | "
                     f"{median([r['steps'] for r in rs]):.0f} | "
                     f"{'/'.join(str(r.get('final_passes', r['k'])) for r in rs)} | {t:.1f} | "
                     f"{'yes' if hit else 'no'} | x{speed:.2f} |")
    lines += ["", ceiling_line(out["ceiling"]), "", *step_table(out["b4"])]
    if out.get("b1"):
        b1base = peers(out["b1"])
        lines += ["", f"Task B ({dates['b']} UTC): B1 (examples/torch_mnist1d.py, SGD momentum 0.9, "
                  "T = 3000, lr 0.05, adascale for 2 workers), test accuracy every 100 baseline "
                  "steps; time: training seconds to the first evaluation at the same seed's "
                  "one-process final accuracy.", "",
                  "| run | final % (per seed) | steps | mean gain | final k | training s | to the S = 1 final |",
                  "|---|---|---|---|---|---|---|",
                  *time_to(out["b1"], lambda r, pt: pt[3] >= b1base[r["seed"]]["test_accuracy"])]
    if out.get("lm"):
        lmbase = peers(out["lm"])
        lines += ["", f"Task C ({dates['c']} UTC): a GRU language model (examples/torch_lm.py: the "
                  f"grammar's random sentences, Adam, T = {LM['budget']} (converged? the budget "
                  f"line below), lr {LM['lr']}, {LM['batch']} sentences a micro-batch; "
                  "adascale_adam for 2 workers as in "
                  f"task A), the test loss every {LM_EVAL_EVERY} baseline steps; time: training "
                  f"seconds to the first evaluation within {LM_TOLERANCE} nats (perplexity within "
                  "1%) of the same seed's one-process (2 threads) final test loss.", "",
                  "| run | final test loss (per seed) | steps | mean gain | final k | training s | to the S = 1 final + 0.01 |",
                  "|---|---|---|---|---|---|---|",
                  *time_to(out["lm"], lambda r, pt: pt[3] <= lmbase[r["seed"]]["test_loss"] + LM_TOLERANCE),
                  "", ceiling_line(out["lm_ceiling"]), "", *step_table(out["lm"])]
    if out.get("lm_budget"):
        twice, once = out["lm_budget"], peers(out["lm"])[0]
        lines += ["", f"Task C's budget ({dates['c-budget']} UTC): one process (2 threads, seed 0) at "
                  f"T = {twice['progress']:.0f} ends at test loss {twice['test_loss']:.4f} against "
                  f"{once['test_loss']:.4f} at T = {once['progress']:.0f}: "
                  + ("more steps do not help." if twice["test_loss"] > once["test_loss"] - LM_TOLERANCE
                     else "**more steps help: T is not converged**.")]
    lines += ["", f"- {out['machine']}",
              "- rerun: `.venv/bin/python benchmarks/goodput_tta.py` (all tasks); `--tasks c` reruns "
              "task C alone and keeps the other tasks' rows; this report's last run: "
              f"`.venv/bin/python benchmarks/goodput_tta.py {' '.join(argv)}`"]
    (RESULTS / "goodput_tta.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "goodput_tta.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
