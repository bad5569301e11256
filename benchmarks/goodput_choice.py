"""The batch chosen while training, on the emulated accelerator cluster: adapt="goodput" (k chosen
at run time from the measured noise and step times) against every fixed (W, k) and a
hand-written linear batch ramp (Megatron-LM's --rampup-batch-size style), time to target.

    .venv/bin/python benchmarks/goodput_choice.py --task b1 --workers 2,4 --passes 1,2,4,8

Every run is B1 (examples/torch_mnist1d.py: SGD momentum 0.9, lr 0.05, adascale, T = 3000
baseline steps, B0 = 32) under ``benchmarks/emulated.py`` (torchrun, the DDP engine, each pass a
modelled device time t(b) = t0 + b t_sample and each bucket's allreduce a modelled link wait; the
profile is stated in every row): the quality is real, the seconds are the emulated cluster's.
Time to target: training seconds (evaluations excluded) to the first evaluation (every 100
baseline steps) at or above ``--target`` test accuracy. Rows:

* fixed (W, k): ``--accumulate k`` at W workers;
* adapt: ``--adapt goodput --max-passes 16`` from k = 1 at W;
* ramp: k from 1 to ``--ramp-to`` linearly in tau over the first ``--ramp-fraction`` of T
  (Megatron's --rampup-batch-size: the batch grows by equal steps over a stated number of
  samples; here by set_passes at the step boundary, as a user's loop would);

each run's metrics log gives the k it ran and the measured noise scale sigma2 / mu2 at every step
(the plot: k chosen beside the noise scale, for the adapt rows). Each row records the load (1 min)
before and after, the emulated fidelity (measured / modelled step time, ``emulated.read_emulated``)
and the machine. Writes benchmarks/results/goodput_choice.json, .md and _k.png.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

import emulated  # noqa: E402  (helper E's emulated cluster mode)

B1 = {"script": "examples/torch_mnist1d.py", "lr": 0.05, "budget": 3000, "policy": "adascale",
      "batch": 32, "eval_every": 100}
MAX_PASSES = 16


def machine() -> dict:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "isa": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "torch": torch.__version__, "torch_threads_per_worker": 1, "platform": platform.platform()}


def run(task: dict, *, workers: int, k: int = 1, adapt: bool = False, ramp: tuple | None = None,
        seed: int = 0, profile: str, budget: float | None = None, log: pathlib.Path) -> dict:
    """One emulated run; rank 0's RESULT, its EMULATED summaries and its log's k and noise."""
    from hvd_scale.launch.jobs import read_results

    args = [str(ROOT / task["script"]), "--engine", "ddp", "--policy",
            task["policy"] if workers * k > 1 or adapt or ramp else "none", "--seed", str(seed),
            "--lr", str(task["lr"]), "--budget", str(budget or task["budget"]), "--accumulate", str(k),
            "--batch-size", str(task["batch"]), "--log-every", "0", "--eval-every", str(task["eval_every"])]
    if adapt:
        args += ["--adapt", "goodput", "--max-passes", str(MAX_PASSES)]
    env = emulated.emulated_env(HVD_SCALE_LOG_DIR=str(log), TF_CPP_MIN_LOG_LEVEL="2")
    if ramp:
        env["G_RAMP"] = json.dumps(ramp)  # read by this file's --job wrapper
        cmd = emulated.emulated_command(args, workers, profile=profile)
        at = cmd.index(str(pathlib.Path(emulated.__file__).resolve()))
        cmd[at:at + 1] = [str(pathlib.Path(__file__).resolve()), "--job"]
    else:
        cmd = emulated.emulated_command(args, workers, profile=profile)
    before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, env=env, cwd=ROOT,
                          start_new_session=True)
    result = next((r for r in read_results(proc.stdout) if r["rank"] == 0), None)
    if result is None:
        raise RuntimeError(f"run failed ({' '.join(cmd)}): exit {proc.returncode}\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    emu = emulated.read_emulated(proc.stdout)
    return {**{k_: result[k_] for k_ in ("steps", "progress", "test_accuracy", "mean_gain", "seconds",
                                          "curve", "final_passes", "seed")},
            "workers": workers, "k": k, "adapt": adapt, "ramp": ramp, "profile": profile,
            "wall": time.perf_counter() - start, "load": [before, os.getloadavg()[0]],
            "fidelity": [e.get("ratio") for e in emu], "cpu_share": [e.get("cpu_share") for e in emu],
            "trace": trace(log)}


def trace(log: pathlib.Path) -> dict:
    """k, tau and the noise scale sigma2 / mu2 of each logged step."""
    path = log / "metrics.csv"
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    num = lambda r, key: float(r[key]) if r.get(key) not in ("", None) else math.nan  # noqa: E731
    return {"step": [num(r, "step") for r in rows],
            "progress": [num(r, "progress") for r in rows], "passes": [num(r, "passes") for r in rows],
            "noise": [num(r, "sigma2") / num(r, "mu2") if num(r, "mu2") > 0 else math.nan for r in rows],
            "step_time": [num(r, "step_time") for r in rows]}


def job(argv: list[str]) -> None:
    """Inside each worker: the emulated device (``emulated.main``), and the linear ramp of k over
    tau (``$G_RAMP``: [k_end, fraction of T]) by set_passes after each step."""
    ramp = json.loads(os.environ["G_RAMP"])
    from hvd_scale.adapters.torch import ddp

    emulated.install(emulated.PROFILES[argv[1]] if argv[:1] == ["--profile"] else
                     emulated.PROFILES["a100-resnet50"])
    if argv[:1] == ["--profile"]:
        argv = argv[2:]
    factory = ddp.DistributedOptimizer

    def optimizer(*a, **kw):
        opt = factory(*a, **kw)
        step, budget = opt.step, kw["budget"]

        def ramped(*sa, **skw):
            out = step(*sa, **skw)
            k = min(ramp[0], 1 + int((ramp[0] - 1) * opt.progress / (ramp[1] * budget)))
            if k != opt.backward_passes_per_step and not opt.done():
                opt.set_passes(k)
            return out
        opt.step = ramped
        return opt
    ddp.DistributedOptimizer = optimizer
    import runpy

    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def time_to(r: dict, target: float) -> float:
    """Measured training seconds to the target (the machine's: load slows the emulation)."""
    return next((pt[0] for pt in r["curve"] if pt[3] >= target), math.inf)


def modelled_to(r: dict, target: float) -> float:
    """The emulated cluster's seconds to the target: the profile's step time
    (``emulated.Profile.step_time``: k t(b) + the link's allreduce) summed over the steps to the
    first evaluation at the target, each step at the k it ran (the metrics log's passes, held
    between logged rows). What the run would take where the CPU keeps up (fidelity 1)."""
    at = next((pt[2] for pt in r["curve"] if pt[3] >= target), None)
    if at is None:
        return math.inf
    profile = emulated.PROFILES[r["profile"]]
    tr = r.get("trace") or {}
    if r["adapt"] or r["ramp"]:
        steps, ks = tr["step"], tr["passes"]
        total, j = 0.0, 0
        for step in range(1, int(at) + 1):
            while j + 1 < len(steps) and steps[j + 1] <= step:
                j += 1
            k = ks[j] if math.isfinite(ks[j]) else 1
            total += profile.step_time(32, int(k), r["workers"])
        return total
    return at * profile.step_time(32, r["k"], r["workers"])


def label(r: dict) -> str:
    if r["adapt"]:
        return f"W = {r['workers']}, adapt=goodput (k from 1, max {MAX_PASSES})"
    if r["ramp"]:
        return f"W = {r['workers']}, linear ramp k 1 -> {r['ramp'][0]} over {r['ramp'][1]:.0%} of T"
    return f"W = {r['workers']}, k = {r['k']}"


def report(out: dict) -> None:
    target = out["target"]
    runs = out["runs"]
    fixed = [r for r in runs if not r["adapt"] and not r["ramp"]]
    best = min(fixed, key=lambda r: modelled_to(r, target)) if fixed else None
    lines = ["# The batch chosen while training (emulated cluster)", "",
             f"B1 (examples/torch_mnist1d.py, adascale, lr 0.05, T = 3000, B0 = 32) on the emulated "
             f"cluster (benchmarks/emulated.py, DDP engine, profile {runs[0]['profile'] if runs else '?'}: "
             "**emulated seconds**, real quality). Time to target: training seconds to the first "
             f"evaluation (every 100 baseline steps) at >= {100 * target:.1f}% test accuracy. "
             "fidelity: measured / modelled step time per rank (1.0: the emulation held); load: "
             "the machine's 1-minute load before / after (2 cores shared by other work).", "",
             "| run | seed | final % | steps | final k | mean gain | training s (measured) | to target s (measured) | "
             "to target s (modelled) | vs best fixed (modelled) | fidelity | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        t, m = time_to(r, target), modelled_to(r, target)
        ref = modelled_to(best, target) if best else math.nan
        fid = [f"{x:.2f}" for x in r["fidelity"] if x]
        lines.append(f"| {label(r)} | {r['seed']} | {100 * r['test_accuracy']:.2f} | {r['steps']} | "
                     f"{r['final_passes']} | {r['mean_gain']:.2f} | {r['seconds']:.1f} | "
                     f"{t:.1f} | {m:.1f} | {m / ref:.2f}x | {'/'.join(fid[:2])}{'...' if len(fid) > 2 else ''} | "
                     f"{r['load'][0]:.1f} / {r['load'][1]:.1f} |")
    if best:
        lines += ["", f"Best fixed choice in hindsight (modelled): {label(best)} "
                  f"({modelled_to(best, target):.1f} s)."]
    lines += ["", f"- machine: {json.dumps(out['machine'])}",
              *(f"- `.venv/bin/python {c}` ({d})" for c, d in out["commands"])]
    (RESULTS / "goodput_choice.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in out["runs"] if (r["adapt"] or r["ramp"]) and r["trace"]]
    if not chosen:
        return
    fig, axes = plt.subplots(len(chosen), 1, figsize=(7, 2.6 * len(chosen)), squeeze=False,
                             constrained_layout=True)
    for ax, r in zip(axes[:, 0], chosen):
        tr = r["trace"]
        ax.step(tr["progress"], [r["workers"] * k for k in tr["passes"]], where="post",
                label="batch S = W k (baseline batches)")
        ax.plot(tr["progress"], tr["noise"], alpha=0.6, label="noise scale sigma2 / mu2 (measured)")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tau (baseline steps)")
        ax.set_title(label(r), fontsize=9)
        ax.legend(fontsize=7)
    fig.savefig(RESULTS / "goodput_choice_k.png", dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--job"]:
        job(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4")
    p.add_argument("--passes", default="1,2,4,8")
    p.add_argument("--adapt", default="", help="W values to run adapt=goodput at")
    p.add_argument("--ramp", default="", help="W values to run the linear ramp at")
    p.add_argument("--ramp-to", type=int, default=8)
    p.add_argument("--ramp-fraction", type=float, default=0.5)
    p.add_argument("--seeds", default="0")
    p.add_argument("--target", type=float, default=0.96)
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--profile", default="a100-resnet50", choices=sorted(emulated.PROFILES))
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    store = RESULTS / "goodput_choice.json"
    out = json.loads(store.read_text()) if store.exists() else {"runs": [], "commands": []}
    out["target"], out["machine"] = args.target, machine()
    if not args.report_only:
        work = pathlib.Path(tempfile.mkdtemp(prefix="g_choice-"))
        try:
            for seed in (int(s) for s in args.seeds.split(",")):
                configs = [dict(workers=w, k=k) for w in map(int, filter(None, args.workers.split(",")))
                           for k in map(int, filter(None, args.passes.split(",")))]
                configs += [dict(workers=int(w), adapt=True) for w in
                            args.adapt.split(",") if w]
                configs += [dict(workers=int(w), ramp=(args.ramp_to, args.ramp_fraction))
                            for w in args.ramp.split(",") if w]
                for i, cfg in enumerate(configs):
                    r = run(B1, seed=seed, profile=args.profile, budget=args.budget,
                            log=work / f"{seed}-{i}", **cfg)
                    out["runs"].append(r)
                    store.write_text(json.dumps(out, indent=1) + "\n")
                    print(f"{label(r)} seed {seed}: {100 * r['test_accuracy']:.2f}%, to target "
                          f"{time_to(r, args.target):.1f} s, fidelity {r['fidelity']}, load "
                          f"{r['load']}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out["commands"].append(("benchmarks/goodput_choice.py " + " ".join(argv),
                                f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"))
    store.write_text(json.dumps(out, indent=1) + "\n")
    report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
