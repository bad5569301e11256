"""The emulated cluster's fidelity: measured step time against the modelled one, W = 1, 2, 4, 8.

    .venv/bin/python benchmarks/emulated_fidelity.py                 # ~3 min
    .venv/bin/python benchmarks/emulated_fidelity.py --workers 1,2 --steps 50 --out emulated_fidelity_quick

Each cell is B1's training (examples/torch_mnist1d.py, --engine ddp, adascale, micro-batch 32)
on W emulated workers (benchmarks/emulated.py: torchrun, one process per worker, Gloo) for
--steps optimizer steps at k passes a step. Per cell: the modelled step (k x t(b) + the link's
allreduce), the measured one (each rank's mean over its steps after the first 5, the ranks
averaged), their ratio, the CPU's share of a step (a process's CPU seconds over its step's wall
seconds, and the machine's: all W processes' CPU seconds over the wall seconds x the cores), and
the 1-minute load before and after (the machine is shared). --code: a checkout laid out as it
installs (``benchmarks/emulated_tta.py --snapshot``), for a stable copy of the code.

Writes benchmarks/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys

from emulated import PROFILES, ROOT, emulated_command, emulated_env, machine, read_emulated

RESULTS = ROOT / "benchmarks" / "results"


def run_cell(workers: int, passes: int, steps: int, profile: str, link: bool, code: pathlib.Path,
             policy: str = "adascale", batch: int = 32, nice: int = 0) -> dict:
    script = [code / "examples" / "torch_mnist1d.py", "--engine", "ddp", "--policy", policy,
              "--accumulate", str(passes), "--batch-size", str(batch), "--log-every", "0",
              "--budget", str(steps * workers * passes)]
    env = emulated_env(**({"PYTHONPATH": str(code)} if code != ROOT else {}))
    load = os.getloadavg()[0]
    proc = subprocess.run(emulated_command(script, workers, profile=profile, link=link, nice=nice),
                          capture_output=True, text=True, env=env, timeout=900, cwd="/tmp")
    ranks = read_emulated(proc.stdout)
    if proc.returncode != 0 or len(ranks) != workers:
        raise RuntimeError(f"W {workers} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    p = PROFILES[profile] if link else PROFILES[profile].without_link()
    wall = statistics.mean(r["step_wall"] for r in ranks)
    cpu = sum(r["cpu"] for r in ranks)
    return {"workers": workers, "passes": passes, "batch": batch, "steps": ranks[0]["steps"],
            "profile": profile, "link": link, "policy": policy, "nice": nice,
            "modelled_ms": 1e3 * p.step_time(batch, passes, workers),
            "measured_ms": 1e3 * wall, "ratio": wall / p.step_time(batch, passes, workers),
            "ratio_median": statistics.mean(r["ratio_median"] for r in ranks),
            "cpu_share": statistics.mean(r["cpu_share"] for r in ranks),
            "machine_share": cpu / (statistics.mean(r["wall"] for r in ranks) * os.cpu_count()),
            "cpu_ms": 1e3 * statistics.mean(r["cpu"] / r["timed_steps"] for r in ranks),
            "overrun_ms": 1e3 * statistics.mean(r["overrun"] / r["steps"] for r in ranks),
            "after_ms": 1e3 * statistics.mean(r["after"] / r["timed_steps"] for r in ranks),
            "load_before": load, "load_after": os.getloadavg()[0], "ranks": ranks}


def report(rows: list[dict], meta: dict) -> str:
    lines = ["# The emulated cluster's fidelity (B1's CNN, DDP, adascale, micro-batch 32)", "",
             "Measured step time against the modelled one (benchmarks/emulated.py), W processes on "
             f"this machine's {meta['machine']['cores']} cores. 'CPU share': a process's CPU seconds "
             "over its steps' wall seconds (mean over ranks); 'machine': all processes' CPU seconds "
             "over wall x cores. 'Residual': measured - modelled, the host's work outside the "
             "modelled passes (hvd_scale's step, DDP's bookkeeping, the real collectives) plus what "
             "the CPU could not hide under the passes ('overrun'). Load: `uptime`'s 1-minute "
             "average before / after the cell (the machine is shared with other work).", "",
             "| W | k | profile | link | nice | steps | modelled ms | measured ms | ratio (median) | "
             "residual ms | overrun ms | after backward ms | CPU ms / step | CPU share | machine | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['passes']} | {r['profile']} | {'yes' if r['link'] else 'no'} | {r.get('nice', 0)} | "
            f"{r['steps']} | {r['modelled_ms']:.1f} | {r['measured_ms']:.1f} | "
            f"{r['ratio']:.3f} ({r['ratio_median']:.3f}) | {r['measured_ms'] - r['modelled_ms']:.1f} | "
            f"{r['overrun_ms']:.1f} | {r.get('after_ms', float('nan')):.1f} | {r['cpu_ms']:.1f} | {100 * r['cpu_share']:.0f}% | "
            f"{100 * r['machine_share']:.0f}% | {r['load_before']:.2f} / {r['load_after']:.2f} |")
    m = meta["machine"]
    lines += ["", f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['isa']}), "
              f"{m['torch_threads']} torch thread per process",
              f"- date: {meta['date']} UTC; code: {meta['code']}",
              f"- rerun: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--passes", default="1", help="k values, comma-separated")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile", choices=sorted(PROFILES), default="a100-resnet50")
    p.add_argument("--no-link", action="store_true")
    p.add_argument("--code", type=pathlib.Path, default=ROOT)
    p.add_argument("--code-name", default=None, help="the commit --code was taken from")
    p.add_argument("--out", default="emulated_fidelity")
    p.add_argument("--nice", type=int, default=0,
                   help="run the workers at this niceness (e.g. -10 as root, on a shared machine)")
    args = p.parse_args(argv)
    rows = []
    for k in (int(x) for x in args.passes.split(",")):
        for w in (int(x) for x in args.workers.split(",")):
            r = run_cell(w, k, args.steps, args.profile, not args.no_link, args.code, nice=args.nice)
            rows.append(r)
            print(f"W {w} k {k}: modelled {r['modelled_ms']:.1f} ms, measured {r['measured_ms']:.1f} ms "
                  f"(x{r['ratio']:.3f}), overrun {r['overrun_ms']:.1f} after {r['after_ms']:.1f} ms, CPU share {100 * r['cpu_share']:.0f}%, machine "
                  f"{100 * r['machine_share']:.0f}%, load {r['load_before']:.2f}/{r['load_after']:.2f}",
                  flush=True)
    meta = {"machine": machine(), "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
            "code": args.code_name or str(args.code),
            "command": ".venv/bin/python benchmarks/emulated_fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(report(rows, meta))
    print(report(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
