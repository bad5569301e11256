"""Rerun a bench's untuned AdaScale cells (3 seeds) at the code as it is, beside the runs the fair
fight stored (results/fair_fight_runs.json), to show what a change of the code moved: each seed's
quality and steps, the cell's mean and spread, before and after.

    .venv/bin/python benchmarks/rerun_adascale.py --bench b1 --scales 16,64    # ~10 min here
    .venv/bin/python benchmarks/rerun_adascale.py --bench b4 --scales 32       # ~25 min here
    .venv/bin/python benchmarks/rerun_adascale.py --bench b1 --scales 16 --engine ddp   # torchrun, DDP

Each run is fair_fight.run's (the example script under horovodrun -np 2, from a snapshot of the
code; ``--engine ddp``: under torchrun --nproc-per-node 2 with the example's --engine ddp); the
reruns are kept in results/rerun_adascale.json (by bench, S, seed, engine and code; a run without
"engine" ran under Horovod), the table in results/rerun_adascale.md is made from all of them,
always against the fair fight's Horovod runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import fair_fight
import transformer_bleu as b4

STORE = fair_fight.RESULTS / "rerun_adascale.json"
REPORT = fair_fight.RESULTS / "rerun_adascale.md"


def _engine(r: dict) -> str:
    return r.get("engine", "horovod")


def _load() -> list[dict]:
    return json.loads(STORE.read_text())["runs"] if STORE.exists() else []


def _cell(rows: list[dict]) -> str:
    quality = [r["quality"] for r in rows]
    spread = statistics.stdev(quality) if len(quality) > 1 else 0.0
    return (f"{statistics.mean(quality):.2f} ± {spread:.2f} "
            f"({' / '.join(f'{q:.2f}' for q in quality)}); steps "
            f"{' / '.join(str(r['steps']) for r in rows)} (mean "
            f"{statistics.mean(r['steps'] for r in rows):.0f}, gain "
            f"{statistics.mean(r['mean_gain'] for r in rows):.2f})")


def report(reruns: list[dict]) -> str:
    stored = fair_fight.load()
    lines = ["# AdaScale's fair-fight cells rerun at later code", "",
             "Untuned AdaScale (the bench's baseline lr), 3 seeds, as `fair_fight.py` runs them, "
             "against the runs the fair fight stored. Quality: mean ± standard deviation over the "
             "seeds (each seed's), and each seed's steps (their mean, and the mean gain).", "",
             "| bench | S | stored, Horovod (code) | rerun (engine, code, date) | identical seeds |",
             "|---|---|---|---|---|"]
    for bench, S in sorted({(r["bench"], r["S"]) for r in reruns}):
        policy = fair_fight.BENCHES[bench]["adascale"]
        for engine, code in sorted({(_engine(r), r["code"]) for r in reruns
                                    if (r["bench"], r["S"]) == (bench, S)},
                                   key=lambda ec: (ec[0] != "horovod", min(
                                       r["date"] for r in reruns if (_engine(r), r["code"]) == ec))):
            new = sorted((r for r in reruns if (r["bench"], r["S"], _engine(r), r["code"])
                          == (bench, S, engine, code)), key=lambda r: r["seed"])
            old = []
            for r in new:
                match = [x for x in stored if fair_fight.key(x) == fair_fight.key({**r, "engine": "horovod"})
                         and "error" not in x]
                if match:
                    old.append(match[-1])
            same = sum(1 for a, b in zip(old, new) if a["quality"] == b["quality"]
                       and a["steps"] == b["steps"] and a["progress"] == b["progress"])
            lines.append(f"| {bench} ({policy}) | {S} | {_cell(old)} ({old[0]['code'][:8]}) | "
                         f"{_cell(new)} ({engine}, {code[:8]}, {new[-1]['date']}) | {same} of {len(new)} |")
    lines += ["", "- rerun: `.venv/bin/python benchmarks/rerun_adascale.py --bench b1 --scales "
              "16,64` and `--bench b4 --scales 32` (`--engine ddp`: torchrun and DDP)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", choices=sorted(fair_fight.BENCHES), required=True)
    p.add_argument("--scales", required=True, help="S to rerun, e.g. 16,64")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--engine", choices=["horovod", "ddp"], default="horovod")
    p.add_argument("--source", type=pathlib.Path, default=fair_fight.ROOT,
                   help="the checkout to run and hash (default this one; a `git archive` of a commit "
                        "where others edit the working tree: a snapshot may catch a half-made edit)")
    p.add_argument("--seeds", default=",".join(map(str, range(fair_fight.SEEDS))),
                   help="the seeds to run here, e.g. 1 (separate processes may run the others)")
    args = p.parse_args(argv)
    bench = fair_fight.BENCHES[args.bench]
    code = fair_fight.code_hash(bench, args.source)
    reruns = _load()
    snapshot, _ = b4.snapshot(args.source)
    for S in (int(s) for s in args.scales.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            spec = {"policy": bench["adascale"], "S": S, "seed": seed, "lr": bench["lr"],
                    "budget": bench["budget"]}
            if any(fair_fight.key(r) == fair_fight.key({"bench": args.bench, **spec, "engine": args.engine})
                   and r["code"] == code for r in reruns):
                continue
            row = fair_fight.run(args.bench, **spec, snapshot=snapshot, code=code,
                                 timeout=args.timeout, engine=args.engine)
            b4.log(f"{args.bench} S {S} seed {seed}: " + (row.get("error") or
                   f"{row['quality']:.2f} in {row['steps']} steps"))
            if "error" in row:
                return 1
            reruns = _load() + [row]  # another rerun may have stored runs meanwhile
            STORE.write_text(json.dumps({"runs": reruns}, indent=1))
    REPORT.write_text(report(_load()))
    print(REPORT.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
