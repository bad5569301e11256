"""AdaScale's gain, step by step, with each worker's accumulated gradient read once (samples
'workers', the default from two workers on since #50) against every pass's (samples 'passes',
the estimator before #50): one seed of a fair-fight cell, the same code, the estimator chosen by
$HVD_SCALE_SAMPLES (unset: the default; 'passes': the per-pass one), nothing else changed.

    .venv/bin/python benchmarks/investigations/gain_trajectory.py --bench b1 --S 64 --source /tmp/snap50  # ~5 min
    .venv/bin/python benchmarks/investigations/gain_trajectory.py --bench b4 --S 32 --source /tmp/snap50  # ~25 min
    .venv/bin/python benchmarks/investigations/gain_trajectory.py --report-only

Each run is fair_fight.run's command (the bench's example under horovodrun -np 2, Gloo, untuned
AdaScale at the baseline lr, k = S / 2 passes per worker, evaluated every budget / 20 of tau) from
a snapshot of --source (a `git archive` of a commit where others edit the working tree), with
$HVD_SCALE_LOG_DIR set so that rank 0 writes metrics.csv (every step up to 1,000, the adapters'
default), and $HVD_SCALE_SAMPLES as above; rank 0's start line says which estimator ran (checked).
Runs are kept in results/gain_trajectory.json (by bench, S, seed, samples and code; a stored run is
not repeated); results/gain_trajectory.md and .png are made from all of them.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import shutil
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # benchmarks/
import fair_fight
import transformer_bleu as b4

from hvd_scale.launch.jobs import CPU_ENV_DEFAULTS, horovodrun_command, read_results

STORE = fair_fight.RESULTS / "gain_trajectory.json"
REPORT = fair_fight.RESULTS / "gain_trajectory.md"
PNG = "gain_trajectory.png"
# What the runs of 2026-12-05 (e45008d) show, written from them; --report-only keeps it.
READING = """\
## Reading (e45008d, 2026-12-05)

- `HVD_SCALE_SAMPLES=passes` at e45008d reproduces the code before #50 bit for bit where it was
  run: B1 S = 64 seed 0 95.20 in 426 steps, mean gain 7.15, as c430140c's rerun; B4 S = 32 seed 0
  99.87 in 417 steps, mean gain 5.77, as 9e7570ec's (after the v_hat floor). The two lines of
  each panel differ by the estimator alone.
- B1 S = 64 (k = 32, 2 samples a step against 64): the gains agree to tau ~1200; from there to
  ~1800 (the lr decays x0.1 at 1500) the per-worker gain runs higher (8.5 and 9.4 against 7.3 and 7.5 over those
  tenths), then both climb to S alike. 407 steps against 426 (-4.5%), 95.65 against 95.20 (the
  cell's spread over seeds: 0.3-0.8). The three-seed rerun shows the same shift: 407 / 399 / 418
  steps (gain 7.41) against c430140c's 426 / 437 / 438 (6.99) and the stored 451 / 403 / 413
  (7.19); accuracy 95.88 ± 0.28 against 95.85 ± 0.77 and 95.63 ± 0.66.
- Why higher, not measured here: both estimators are unbiased for sigma2 and mu2, but the gain
  S (sigma2 + mu2) / (sigma2 + S mu2) is nonlinear in them and mu2 is clipped at 0 where it is
  read, so a noisier estimate need not give the same mean gain; the shift sits where mu2 is small
  against sigma2 (late in the run). The step-to-step jitter of the gain is only ~10% larger.
- B4 S = 32 (adascale_adam, k = 16: 2 samples a step against 32): the same picture. The gains
  agree to tau ~1300; there the per-pass gain drops (5.1 and 6.7 over the
  next two tenths, 46 and 37 steps) while the per-worker one holds (7.5 and 8.0, 32 and 30
  steps): 21 of the 25 steps saved (392 against 417), 100.00 BLEU against 99.87. Both sit at
  adascale_adam's cap (8 at S = 32) over the last third. The logged runs equal their
  rerun_adascale.json seeds; the three seeds there: 392 / 378 / 370 steps (gain 6.34) against
  9e7570ec's 417 / 386 / 380 (6.11), -3.5%, BLEU 99.80 ± 0.19 against 99.88 ± 0.03 (stored
  99.76 ± 0.30).
"""
ESTIMATORS = {"workers": None, "passes": "passes"}  # samples -> $HVD_SCALE_SAMPLES (None: unset)
TENTHS = 10  # the report's table: each tenth of the budget in tau


def load() -> list[dict]:
    return json.loads(STORE.read_text())["runs"] if STORE.exists() else []


def run(name: str, S: int, seed: int, samples: str, snapshot: pathlib.Path, code: str,
        timeout: float) -> dict:
    bench = fair_fight.BENCHES[name]
    budget, lr = bench["budget"], bench["lr"]
    args = [str(fair_fight.BIN / "python"), str(snapshot / "examples" / bench["script"]), "--policy",
            bench["adascale"], "--seed", str(seed), "--lr", repr(lr), "--budget", str(budget),
            "--accumulate", str(S // 2), "--batch-size", "32", "--log-every", "0",
            "--eval-every", repr(budget / fair_fight.EVALS), *bench["extra"]]
    cmd = horovodrun_command(args, 2, controller="gloo")
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="gain-trajectory-"))
    env = {**os.environ, **CPU_ENV_DEFAULTS, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(snapshot),
           "TF_CPP_MIN_LOG_LEVEL": "2", "HVD_SCALE_LOG_DIR": str(log_dir)}
    env.pop("HVD_SCALE_LOG_EVERY", None)
    env.pop("HVD_SCALE_SAMPLES", None)
    if ESTIMATORS[samples]:
        env["HVD_SCALE_SAMPLES"] = ESTIMATORS[samples]
    row = {"bench": name, "policy": bench["adascale"], "S": S, "seed": seed, "lr": lr, "budget": budget,
           "samples": samples, "env": {"HVD_SCALE_SAMPLES": ESTIMATORS[samples]}, "code": code,
           "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=fair_fight.ROOT, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout:.0f} s"}
    output = proc.stdout + proc.stderr
    line = next((ln[ln.index("hvd_scale: policy"):] for ln in output.splitlines()
                 if "hvd_scale: policy" in ln), "")
    result = next((r for r in read_results(proc.stdout) if r["rank"] == 0), None)
    if result is None:
        return {**row, "error": f"exit {proc.returncode}: {output[-1200:].strip()}"}
    per_worker = "read once per worker" in line
    if per_worker != (samples == "workers"):
        return {**row, "error": f"the start line does not say samples {samples!r}: {line!r}"}
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    trajectory = {k: [float(r[k]) for r in rows] for k in ("step", "progress", "gain", "sigma2", "mu2")}
    trajectory["step"] = [int(s) for s in trajectory["step"]]
    shutil.rmtree(log_dir, ignore_errors=True)
    quality = result[bench["metric"]] * bench["times"]
    return {**row, "start_line": line, "quality": quality, "steps": result["steps"],
            "progress": result["progress"], "mean_gain": result["mean_gain"],
            "seconds": result["seconds"], "wall": time.perf_counter() - start,
            "curve": [(c[2], c[3] * bench["times"]) for c in result.get("curve", [])],
            "trajectory": trajectory}


def windows(r: dict) -> list[tuple[float, int, float]]:
    """(tau at the window's start, steps taken in it, the gain's mean over them) for each tenth of
    the budget in tau: the lr schedule (x0.1 at 50% and 75%) is alike at alike tau in every run."""
    t, width = r["trajectory"], r["budget"] / TENTHS
    out: dict[int, list[float]] = {}
    tau_before = 0.0
    for tau, g in zip(t["progress"], t["gain"]):
        out.setdefault(min(int(tau_before // width), TENTHS - 1), []).append(g)
        tau_before = tau
    return [(w * width, len(v), statistics.mean(v)) for w, v in sorted(out.items())]


def jitter(g: list[float]) -> float:
    """The gain's step-to-step noise: the standard deviation of the successive differences of its
    logarithm (relative changes, so that the late steps, where the gain climbs towards S, do not
    weigh more)."""
    d = [math.log(b / a) for a, b in zip(g, g[1:])]
    return statistics.stdev(d) if len(d) > 1 else 0.0


def report(runs: list[dict]) -> str:
    runs = [r for r in runs if "error" not in r]
    stored = fair_fight.load()
    reruns = json.loads(fair_fight.RESULTS.joinpath("rerun_adascale.json").read_text())["runs"]
    lines = ["# AdaScale's gain, per-worker against per-pass statistics (issue #50)", "",
             "One seed of a fair-fight cell (untuned AdaScale at the baseline lr, horovodrun -np 2, "
             "k = S / 2 passes per worker), twice at the same code: samples 'workers' (the default "
             "since #50: each worker's accumulated gradient once, W = 2 samples a step) and "
             "samples 'passes' (`HVD_SCALE_SAMPLES=passes`: every pass, W k samples a step, the "
             "estimator of the stored runs). Rank 0's metrics.csv gives the gain of every step; "
             "each run's start line was checked for the estimator it names. 'Jitter': the standard "
             "deviation of the gain's relative step-to-step change, log(r_t / r_t-1) (the EMA "
             "smooths the raw estimate; fewer samples would show here first).", "",
             "| bench | S | seed | samples | quality | steps | mean gain | final gain | jitter | "
             "code, date | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    cells = sorted({(r["bench"], r["S"], r["seed"]) for r in runs})
    for bench, S, seed in cells:
        for r in sorted((r for r in runs if (r["bench"], r["S"], r["seed"]) == (bench, S, seed)),
                        key=lambda r: r["samples"] != "workers"):
            t = r["trajectory"]
            lines.append(f"| {bench} | {S} | {seed} | {r['samples']} | {r['quality']:.2f} | {r['steps']} | "
                         f"{r['mean_gain']:.2f} | {t['gain'][-1]:.2f} | {jitter(t['gain']):.3f} | "
                         f"{r['code'][:8]}, {r['date']} | {r['wall']:.0f} |")
        ref = [x for x in stored if fair_fight.key(x) == (bench, fair_fight.BENCHES[bench]["adascale"], S, seed,
                                                          fair_fight.BENCHES[bench]["lr"],
                                                          fair_fight.BENCHES[bench]["budget"], "horovod")
               and "error" not in x]
        if ref:
            x = ref[-1]
            lines.append(f"| {bench} | {S} | {seed} | passes, stored fair fight ({x['code'][:8]}) | "
                         f"{x['quality']:.2f} | {x['steps']} | {x['mean_gain']:.2f} | - | - | {x['date']} | - |")
        re_ = [x for x in reruns if (x["bench"], x["S"], x["seed"], x.get("engine", "horovod"))
               == (bench, S, seed, "horovod") and "error" not in x]
        for x in re_:
            lines.append(f"| {bench} | {S} | {seed} | rerun_adascale.json ({x['code'][:8]}) | "
                         f"{x['quality']:.2f} | {x['steps']} | {x['mean_gain']:.2f} | - | - | {x['date']} | - |")
    lines += ["", "Each tenth of the budget in tau (the baseline schedule: lr x0.1 at 50% and 75%): the "
              "steps each run took in it and its gain's mean over them (a run's steps = budget / "
              "its gain, so the steps saved are where the gain is higher):", ""]
    for bench, S, seed in cells:
        pair = sorted((r for r in runs if (r["bench"], r["S"], r["seed"]) == (bench, S, seed)),
                      key=lambda r: r["samples"] != "workers")
        per = [{w[0]: w[1:] for w in windows(r)} for r in pair]
        names = [r["samples"] for r in pair]
        lines += [f"{bench}, S = {S}, seed {seed}:", "",
                  "| tau from | " + " | ".join(f"steps, {n} | gain, {n}" for n in names) + " |",
                  "|---|" + "---|---|" * len(names)]
        for tau in sorted(set().union(*[p.keys() for p in per])):
            lines.append(f"| {tau:.0f} | " + " | ".join(
                f"{p[tau][0]} | {p[tau][1]:.2f}" if tau in p else "- | -" for p in per) + " |")
        lines.append("")
    lines += [READING, ""]
    if cells:
        lines += [f"![gain against optimizer steps]({PNG})", ""]
    lines += ["- rerun: `.venv/bin/python benchmarks/investigations/gain_trajectory.py --bench b1 --S 64 --source "
              "<a git archive of the commit>` (and `--bench b4 --S 32`); `--report-only`"]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = [r for r in runs if "error" not in r]
    cells = sorted({(r["bench"], r["S"], r["seed"]) for r in runs})
    if not cells:
        return
    fig, axes = plt.subplots(2, len(cells), figsize=(5.2 * len(cells), 6.6), constrained_layout=True,
                             squeeze=False)
    for col, (bench, S, seed) in enumerate(cells):
        for r in sorted((r for r in runs if (r["bench"], r["S"], r["seed"]) == (bench, S, seed)),
                        key=lambda r: r["samples"] != "workers"):
            t = r["trajectory"]
            label = ("workers (default)" if r["samples"] == "workers" else "passes (HVD_SCALE_SAMPLES)")
            for row, x in enumerate((t["step"], t["progress"])):
                axes[row][col].plot(x, t["gain"], lw=1.0, alpha=0.85,
                                    label=f"{label}: {r['steps']} steps, {r['quality']:.2f}")
        for row, xlabel in enumerate(("optimizer step", "tau (baseline steps of progress)")):
            ax = axes[row][col]
            ax.set_title(f"{bench}, S = {S} (k = {S // 2} per worker), seed {seed}", fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("gain r")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_yticks([1, 2, 4, 8, 16, 32, 64, 128][:2 + S.bit_length() - 1])
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.savefig(fair_fight.RESULTS / PNG, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", choices=sorted(fair_fight.BENCHES), default="b1")
    p.add_argument("--S", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", default="workers,passes", help="the estimators to run, in order")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--source", type=pathlib.Path, default=fair_fight.ROOT,
                   help="the checkout to run and hash (a `git archive` of a commit)")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if not args.report_only:
        code = fair_fight.code_hash(fair_fight.BENCHES[args.bench], args.source)
        snapshot, _ = b4.snapshot(args.source)
        for samples in args.samples.split(","):
            if any((r["bench"], r["S"], r["seed"], r["samples"], r["code"]) ==
                   (args.bench, args.S, args.seed, samples, code) and "error" not in r for r in load()):
                continue
            row = run(args.bench, args.S, args.seed, samples, snapshot, code, args.timeout)
            b4.log(f"{args.bench} S {args.S} seed {args.seed} samples {samples}: " + (
                row.get("error") or f"{row['quality']:.2f} in {row['steps']} steps, mean gain "
                                    f"{row['mean_gain']:.2f}"))
            STORE.write_text(json.dumps({"runs": load() + [row]}) + "\n")
            if "error" in row:
                return 1
    runs = load()
    plot(runs)
    REPORT.write_text(report(runs))
    print(REPORT.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
