"""The maintained benchmark suite and its one entry point: list it, run one entry (or its quick mode).

    .venv/bin/python benchmarks/run.py                  # the suite: name, what, how long, results
    .venv/bin/python benchmarks/run.py b1 --quick       # one entry's quick mode
    .venv/bin/python benchmarks/run.py b1 -- --seeds 1  # extra arguments after --, to the script

Each run appends a line to benchmarks/results/suite_runs.jsonl: the entry, the command, when, how
long, its exit status and the machine it ran on (``benchmarks/machine.py``: CPU model and
instruction set, CPUs, load, torch's threads). Per-seed figures hold per machine; what carries
over between machines is the seeds' spread (benchmarks/README.md). One-off investigations live in
benchmarks/investigations/ and are not part of the suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from machine import describe, machine  # noqa: E402

LOG = HERE / "results" / "suite_runs.jsonl"

# name -> (what, script and its arguments, quick mode's arguments, how long, results)
SUITE: dict[str, tuple[str, list[str], list[str] | None, str, str]] = {
    "b1": ("B1 quality at scale: MNIST-1D CNN, SGD, every policy at S = 1..64",
           ["quality_at_scale.py"], ["--quick"], "~30 min", "results/quality.md"),
    "b2": ("B2 overhead, torch under Horovod (np 2, Gloo), fairscale beside it",
           ["overhead.py", "--repeats", "3", "--steps", "360"], ["--quick"], "~37 min",
           "results/overhead.md"),
    "b2-ddp": ("B2's DDP engine against plain DDP (k = 1 and 4)",
               ["ddp_overhead.py", "--repeats", "3", "--steps", "20", "--rounds", "10",
                "--warmup", "3"],
               ["--models", "mlp", "--passes", "1", "--repeats", "1", "--out",
                "ddp_overhead_quick"], "~4 min", "results/ddp_overhead.md"),
    "b3": ("B3 overhead, Keras 3 (np 2, Gloo)",
           ["keras_overhead.py", "--steps", "360", "--rounds", "60"],
           ["--repeats", "1", "--steps", "60", "--rounds", "10"], "~8 min",
           "results/keras_overhead.md"),
    "b4": ("B4 the seed's experiment: Transformer + Adam, BLEU at S = 1..128",
           ["transformer_bleu.py", "--phase", "verify", "--phase", "curve", "--phase", "sweep",
            "--phase", "converged", "--phase", "short", "--phase", "claim"],
           ["--phase", "short", "--scales", "1,8", "--seeds", "1"], "~2 h (resumable)",
           "results/bleu.md"),
    "b5": ("B5 time to accuracy: one process against 2 workers at fixed and adaptive k",
           ["goodput_tta.py"], ["--seeds", "1", "--tasks", "a"], "~25 min",
           "results/goodput_tta.md"),
    "fair-fight": ("The fair fight: fixed rules at AdaScale's step count, lr tuned (B1)",
                   ["fair_fight.py", "--bench", "b1"], ["--scales", "16", "--rules",
                                                         "warmup:rule=sqrt"], "~40 min",
                   "results/fair_fight.md"),
    "cost": ("Engine cost per step (numpy, one process)", ["engine_cost.py"], None, "~1 min",
             "results/engine_cost.md"),
    "cost-memory": ("B2 extra memory (torch)", ["memory.py"], ["--repeats", "1", "--steps", "5"],
                    "~3 min", "results/memory.md"),
    "cost-samples": ("What the statistics read: per-worker against per-pass, cost against k",
                     ["torch_overhead.py", "--repeats", "3", "--out", "samples_cost", "--models",
                      "mlp,transformer_adam", "--passes", "1,4,16,64"],
                     ["--models", "mlp", "--passes", "1,4", "--repeats", "1"], "~55 min",
                     "results/samples_cost.md"),
    "emulated": ("The emulated accelerator cluster's fidelity: measured step time against the "
                 "model at W = 1, 2, 4, 8", ["emulated_fidelity.py", "--nice", "-15"],
                 ["--workers", "1,2", "--steps", "50", "--out", "emulated_fidelity_quick"],
                 "~3 min", "results/emulated_fidelity.md"),
    "emulated-tta": ("B1 time to accuracy on the emulated cluster, W = 1..8, against the tuned "
                     "fixed rules (tuning counted)",
                     ["emulated_tta.py", "--nice", "-15", "--rules", "linear,warmup:rule=linear"],
                     ["--report-only"], "~45 min (resumable)", "results/emulated_tta.md"),
    "warm-in": ("AdaScale's warm-in: the first 50 steps' gain error (numpy)", ["warm_in.py"],
                ["--runs", "100"], "~1 min", "results/warm_in.md"),
    "gain-lag": ("The gain's lag against an oracle: noisy quadratic and digits MLP (numpy)",
                 ["gain_lag.py"], ["--seeds", "5", "--digits-seeds", "0", "--out",
                                   "gain_lag_quick"], "~5 min", "results/gain_lag.md"),
}


def listing() -> str:
    lines = [f"{'name':13s} {'how long':17s} what (results)"]
    for name, (what, script, quick, duration, results) in SUITE.items():
        missing = "" if (HERE / script[0]).exists() else "  [not in this tree yet]"
        lines.append(f"{name:13s} {duration:17s} {what} ({results}){missing}")
    lines.append("\nrun one: benchmarks/run.py NAME [--quick] [-- extra arguments]")
    return "\n".join(lines)


def command(name: str, quick: bool, extra: list[str]) -> list[str]:
    if name not in SUITE:
        raise SystemExit(f"unknown suite entry {name!r}; the suite: {', '.join(SUITE)}")
    _, script, quick_args, _, _ = SUITE[name]
    if not (HERE / script[0]).exists():
        raise SystemExit(f"{name}: benchmarks/{script[0]} is not in this tree")
    if quick and quick_args is None:
        raise SystemExit(f"{name} has no quick mode: run it as it is")
    args = list(quick_args) if quick else list(script[1:])
    return [sys.executable, str(HERE / script[0]), *args, *extra]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", nargs="?", help="a suite entry (none: list the suite)")
    p.add_argument("--quick", action="store_true", help="the entry's quick mode")
    args = p.parse_args(argv)
    if args.name is None:
        print(listing())
        return 0
    cmd = command(args.name, args.quick, extra)
    record = {"entry": args.name, "quick": args.quick,
              "command": " ".join(str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c
                                  for c in cmd[1:]),
              "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              "machine": machine(torch=True)}
    print(f"{args.name}: {record['command']}\non {describe(record['machine'])}", flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    record.update(seconds=round(time.perf_counter() - start, 1), exit=rc)
    with open(LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
