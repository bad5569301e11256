"""B2: step-time overhead of the torch adapter, its fairscale anchor, and Horovod's CPU settings.

    .venv/bin/python benchmarks/overhead.py            # every setting, 2 jobs each: ~45 minutes
    .venv/bin/python benchmarks/overhead.py --quick    # ~8 minutes

1. hvd_scale (policy none, adascale) against plain hvd.DistributedOptimizer: one horovodrun -np 2
   job per Horovod setting, the variants taking turns inside it (benchmarks/torch_overhead.py:
   the 1-D CNN, the 120-tensor MLP, the 2-D CNN, B4's Transformer; ratios paired round by round,
   benchmarks/timing.py); settings: Horovod's defaults (Gloo, cycle time 1 ms), the launcher's
   5 ms cycle, the same under MPI (horovodrun's own choice, so what `hvd-scale run` gets), and
   on the 5 ms cycle autotuning, no tensor fusion, and no response cache (every tensor
   negotiated every step); each job run `--repeats` times, alternating, median of the per-job
   ratios.
2. Plain DDP and fairscale 0.4.13's AdaScale over DDP (torch.distributed Gloo, 2 processes;
   benchmarks/ddp_fairscale.py); fairscale is installed into ~/.cache/hvd_scale only for this.
Writes benchmarks/results/overhead.md and overhead.json (``--out`` names them).
#31's shapes: ``--passes 4`` (accumulation: every parameter's tensor hook runs in Python on each
pass), ``--np 1`` (one process started as ``python train.py``: S = k), ``--models``, and
``--no-anchor`` (no DDP / fairscale jobs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BIN = pathlib.Path(sys.executable).parent
FAIRSCALE = pathlib.Path.home() / ".cache" / "hvd_scale" / "fairscale-0.4.13"
from hvd_scale.launch.jobs import CPU_ENV_DEFAULTS, horovodrun_command, read_results  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

CYCLE5 = {"HOROVOD_CYCLE_TIME": CPU_ENV_DEFAULTS["HOROVOD_CYCLE_TIME"]}  # `hvd-scale run`'s
SETTINGS = {"default (1 ms)": {}, "cycle 5 ms": CYCLE5,
            # horovodrun's own choice when Horovod has MPI (what `hvd-scale run` gets by default)
            "cycle 5 ms + MPI": CYCLE5,
            "cycle 5 ms + autotune": {**CYCLE5, "HOROVOD_AUTOTUNE": "1"},
            "cycle 5 ms + no fusion": {**CYCLE5, "HOROVOD_FUSION_THRESHOLD": "0"},
            "cycle 5 ms + no response cache": {**CYCLE5, "HOROVOD_CACHE_CAPACITY": "0"}}
CONTROLLER = {"cycle 5 ms + MPI": "mpi"}  # others: gloo
# Not a setting here: 2 torch threads per process (4 compute threads and Horovod's on 2 cores)
# did not finish one job in 11 minutes on 2026-11-30, against about 1 minute with 1 thread.
MODELS = ["cnn", "mlp", "cnn2d", "transformer"]


def _each(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=180)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--out", default="overhead", help="results/<out>.md and .json")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    p.add_argument("--passes", type=int, default=1, help="k backward passes per step (every variant)")
    p.add_argument("--np", type=int, default=2, choices=(1, 2),
                   help="1: one process started without horovodrun (S = k; the settings' cycle is Horovod's "
                        "background thread, idle there)")
    p.add_argument("--no-anchor", action="store_true", help="skip the DDP / fairscale jobs")
    args = p.parse_args(argv)
    models = args.models.split(",")
    settings = {name: SETTINGS[name] for name in args.settings.split(",")}
    if args.quick:
        args.steps, args.repeats = 60, 1
    step_args = ["--steps", str(args.steps), "--warmup", "10", "--rounds", str(args.steps // 6),
                 "--models", ",".join(models)]
    job_args = step_args + ["--passes", str(args.passes)]
    if not args.no_anchor and not (FAIRSCALE / "fairscale").exists():
        subprocess.run([str(BIN / "python"), "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--target", str(FAIRSCALE), "fairscale==0.4.13"], check=True)

    hvd_runs = {name: [] for name in settings}
    ddp_runs = []
    for _ in range(args.repeats):
        for name, env in settings.items():
            worker = [BIN / "python", "benchmarks/torch_overhead.py", *job_args]
            cmd = [str(a) for a in worker] if args.np == 1 else \
                horovodrun_command(worker, 2, controller=CONTROLLER.get(name, "gloo"))
            out = timing.run_job(cmd, env, timeout=1200)
            hvd_runs[name].append({r["model"]: r for r in read_results(out)})
            print(name, {m: round(r["plain"]["median_ms"], 1) for m, r in hvd_runs[name][-1].items()}, flush=True)
        if args.no_anchor:
            continue
        out = timing.run_job([str(BIN / "python"), "benchmarks/ddp_fairscale.py"] + step_args,
                             {"PYTHONPATH": str(FAIRSCALE)}, timeout=1200)
        ddp_runs.append(read_results(out)[0])
        print("ddp", {m: round(r["ddp"]["median_ms"], 1) for m, r in ddp_runs[-1].items() if m != "rank"}, flush=True)

    def med(values):
        return statistics.median(values)

    shape = (f"np {args.np}" if args.np == 2 else "one process, no horovodrun") + \
        (f", k = {args.passes} passes a step" if args.passes > 1 else "")
    lines = [f"# B2: step-time overhead (torch, {shape}, Gloo unless the setting says MPI, one thread per process)", "",
             f"Step time (forward + backward + step), {args.steps} steps per variant after 10 of "
             f"warm-up, the variants taking turns in {args.steps // 6} rounds inside each job; "
             "ratios paired round by round (benchmarks/timing.py); median over "
             f"{args.repeats} job(s) per setting, each job's ratio in brackets. cnn: 1.06M parameters in 12 tensors (1-D); mlp: "
             "62,890 parameters in 120 tensors; cnn2d: 1.42M parameters in 10 tensors (2-D, most "
             "in one Linear); transformer: B4's model, 182,080 parameters in 69 tensors; batch 32 per worker.", ""]
    lines += ["## hvd_scale against plain hvd.DistributedOptimizer (same job)", "",
              "| Horovod setting | model | plain ms | none / plain | adascale / plain |", "|---|---|---|---|---|"]
    summary = {}
    for name, runs in hvd_runs.items():
        for m in models:
            plain = med([r[m]["plain"]["median_ms"] for r in runs])
            nones = [r[m]["none"]["ratio_to_plain"] for r in runs]
            adas = [r[m]["adascale"]["ratio_to_plain"] for r in runs]
            none, ada = med(nones), med(adas)
            ada_ms = med([r[m]["adascale"]["median_ms"] for r in runs])
            summary[(name, m)] = {"plain": plain, "none": none, "adascale": ada, "adascale_ms": ada_ms}
            lines.append(f"| {name} | {m} | {plain:.1f} | {none:.3f} {_each(nones)} | "
                         f"{ada:.3f} {_each(adas)} |")
    if ddp_runs:
        ddp = {m: med([r[m]["ddp"]["median_ms"] for r in ddp_runs]) for m in models}
        fs = {m: med([r[m]["fairscale"]["median_ms"] for r in ddp_runs]) for m in models}
        lines += ["", "## The anchor: DDP and fairscale AdaScale over DDP (torch.distributed, Gloo)", "",
                  "| model | DDP ms | fairscale AdaScale / DDP | plain Horovod (first setting) / DDP |", "|---|---|---|---|"]
        first = next(iter(settings))
        for m in models:
            fs_ddp = med([r[m]["fairscale"]["ratio_to_ddp"] for r in ddp_runs])
            lines.append(f"| {m} | {ddp[m]:.1f} | {fs_ddp:.3f} | "
                         f"{summary[(first, m)]['plain'] / ddp[m]:.3f} |")
        lines += ["", "## End to end: hvd_scale adascale (horovodrun) against fairscale AdaScale over DDP", "",
                  "| Horovod setting | model | hvd_scale adascale ms | / fairscale AdaScale |", "|---|---|---|---|"]
        for name in settings:
            for m in models:
                a = summary[(name, m)]["adascale_ms"]
                lines.append(f"| {name} | {m} | {a:.1f} | {a / fs[m]:.3f} |")
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, {platform.platform()}",
              f"- rerun: `.venv/bin/python benchmarks/overhead.py {shlex.join(sys.argv[1:])}`".rstrip()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"hvd": hvd_runs, "ddp": ddp_runs}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
