"""When does the statistics allreduce finish, relative to the step's last gradient? (Horovod timeline)

    .venv/bin/python benchmarks/investigations/stats_timeline.py                     # cnn and mlp, 1 ms and 5 ms cycles
    .venv/bin/python benchmarks/investigations/stats_timeline.py --cycles 5 --models cnn --steps 30

Runs ``torch_overhead.py --variants adascale`` under ``horovodrun -np 2 --gloo --timeline-filename``
and reads, for every step, the end of the ``hvd_scale.stats`` ALLREDUCE minus the end of the last
gradient ALLREDUCE. ``synchronize()`` waits for both, so this lag is what the statistics can add to
a step: ~0 when they ride in the same Horovod cycle, a whole cycle when they miss it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hvd_scale.launch.jobs import horovodrun_command

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
STATS = "allreduce.hvd_scale.stats"


def allreduce_spans(timeline: Path) -> dict[str, list[tuple[int, int]]]:
    """Tensor name -> [(start us, end us)] of its top-level ALLREDUCE activities, in order."""
    text = timeline.read_text().rstrip().rstrip(",")
    events = json.loads(re.sub(r",\s*\]$", "]", text if text.endswith("]") else text + "]"))
    names, stacks, spans = {}, {}, {}
    for e in events:
        pid = e.get("pid")
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {}):
            names[pid] = e["args"]["name"]
        elif e.get("ph") == "B":
            stacks.setdefault(pid, []).append((e["name"], e["ts"]))
        elif e.get("ph") == "E":
            name, start = stacks[pid].pop()
            if name == "ALLREDUCE":
                spans.setdefault(names[pid], []).append((start, e["ts"]))
    return spans


def lags_ms(spans: dict[str, list[tuple[int, int]]]) -> list[float]:
    stats = spans[STATS]
    grads = [v for k, v in spans.items() if k.startswith("allreduce.") and k != STATS]
    steps = min(len(stats), *(len(g) for g in grads))
    return [(stats[i][1] - max(g[i][1] for g in grads)) / 1000 for i in range(steps)]


def measure(model: str, cycle_ms: float, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        timeline = Path(tmp) / "timeline.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": str(cycle_ms)}
        subprocess.run(horovodrun_command([sys.executable, HERE / "torch_overhead.py", "--models",
                                           model, "--variants", "adascale", "--steps", steps,
                                           "--warmup", "5", "--rounds", "1"], 2, controller="gloo",
                                          extra_args=["--timeline-filename", timeline]),
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=600)
        lags = lags_ms(allreduce_spans(timeline))
    return {"model": model, "cycle_ms": cycle_ms, "steps": len(lags),
            "median_ms": statistics.median(lags), "mean_ms": statistics.mean(lags),
            "max_ms": max(lags), "over_1ms": sum(x > 1.0 for x in lags)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--cycles", default="1,5", help="HOROVOD_CYCLE_TIME values, ms")
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    print("| model | cycle | steps | lag median ms | mean ms | max ms | steps with lag > 1 ms |")
    print("|---|---|---|---|---|---|---|")
    for cycle in (float(c) for c in args.cycles.split(",")):
        for model in args.models.split(","):
            r = measure(model, cycle, args.steps)
            print(f"| {model} | {cycle:g} ms | {r['steps']} | {r['median_ms']:.2f} | "
                  f"{r['mean_ms']:.2f} | {r['max_ms']:.2f} | {r['over_1ms']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
