"""The fair fight's seconds to target, paired on a quiet machine (#50 item 3).

fair_fight.md's "seconds to target" are each run's own training seconds, taken while other work
shared the 2 cores and never paired between policies: its steps compare, its seconds do not. This
reruns each cell's finalists from one snapshot of this checkout, with nothing else running: for
each S, AdaScale untuned (baseline lr and budget) and each fixed rule at the lr its sweep found best
and the fight's budget (AdaScale's stored step count x S), one seed after another, the policies of
a seed back to back in an order rotated from seed to seed (so that no policy always runs first).
The target is fair_fight's (S = 1's stored quality minus the bench's margin). Reported per cell:
the mean over seeds of the steps and training seconds to the target and of the run's seconds, and
each policy's seconds divided by AdaScale's of the same seed (median over seeds: the pairing).
The load average is recorded before and after each run.

    .venv/bin/python benchmarks/fair_fight_seconds.py                 # B1 at S = 16 and 64, 3 seeds

Writes results/fair_fight_seconds.md and .json (another bench: fair_fight_seconds_<bench>). B4's
runs take 6-10 minutes each here (36 for one seed of its three S and four policies): not run by
default; `--bench b4 --scales 128 --seeds 1` took 41 minutes (#50: the cell where the tuned rules
catch up on speed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import fair_fight as ff
import transformer_bleu as b4

OUT = ff.RESULTS / "fair_fight_seconds"  # B1's; another bench's: fair_fight_seconds_<bench>


def out_of(name: str):
    return OUT if name == "b1" else OUT.with_name(f"{OUT.name}_{name}")


def target_of(name: str, runs: list[dict]) -> float:
    bench = ff.BENCHES[name]
    base = [r["quality"] for r in runs if r["bench"] == name and ff.ok(r) and r["S"] == 1
            and r["policy"] == "none" and r["lr"] == bench["lr"] and r["budget"] == bench["budget"]]
    if not base:
        raise SystemExit(f"no stored S = 1 runs of {name}: run benchmarks/fair_fight.py --bench {name}")
    return statistics.mean(base) - bench["margin"]


def finalists(name: str, S: int, runs: list[dict]) -> list[tuple[str, float, int]]:
    """(policy, lr, budget) of AdaScale and of each rule the stored fight at S tuned: the sweep's
    best lr at the fight's budget (as fair_fight.md reports it)."""
    bench = ff.BENCHES[name]
    mine = [r for r in runs if r["bench"] == name and r["S"] == S and ff.ok(r)
            and r.get("engine", "horovod") == "horovod"]
    ada = [r for r in mine if r["policy"] == bench["adascale"] and r["lr"] == bench["lr"]
           and r["budget"] == bench["budget"]]
    if not ada:
        raise SystemExit(f"no stored fight of {name} at S = {S}")
    budget = round(statistics.mean(r["steps"] for r in ada)) * S
    out = [(bench["adascale"], bench["lr"], bench["budget"])]
    for rule in ff.RULES:
        # the sweep's best at seed 0 (fair_fight.best_of), among the lrs its other seeds ran at
        seeded = {r["lr"] for r in mine if r["policy"] == rule and r["budget"] == budget and r["seed"] > 0}
        sweep = [r for r in mine if r["policy"] == rule and r["budget"] == budget and r["seed"] == 0
                 and r["lr"] in seeded]
        if sweep:
            out.append((rule, ff.best_of(sweep, [r["lr"] for r in sweep]), budget))
    return out


def stored_seconds(name: str, S: int, policy: str, lr: float, budget: int, runs: list[dict],
                   target: float) -> float | None:
    """fair_fight.md's figure for the cell: the stored runs' mean seconds to the target."""
    rows = [r for r in runs if r["bench"] == name and r["S"] == S and r["policy"] == policy
            and r["lr"] == lr and r["budget"] == budget and ff.ok(r) and r.get("engine", "horovod") == "horovod"]
    hits = [h for h in (ff.reached(r, target) for r in rows) if h]
    return statistics.mean(h[1] for h in hits) if hits else None


def measure(name: str, scales: list[int], seeds: int, timeout: float) -> dict:
    runs = ff.load()
    target = target_of(name, runs)
    bench = ff.BENCHES[name]
    snapshot, _ = b4.snapshot(ff.ROOT)
    code = ff.code_hash(bench)
    cells = {S: finalists(name, S, runs) for S in scales}
    done = []
    for seed in range(seeds):
        for S, policies in cells.items():
            order = policies[seed % len(policies):] + policies[:seed % len(policies)]
            for policy, lr, budget in order:
                load0 = os.getloadavg()[0]
                r = ff.run(name, policy=policy, S=S, seed=seed, lr=lr, budget=budget,
                           snapshot=snapshot, code=code, timeout=timeout)
                r["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
                r["reached"] = ff.reached(r, target) if ff.ok(r) else None
                r.pop("curve", None)
                done.append(r)
                b4.log(f"{name} S {S} seed {seed} {policy} lr {lr:g}: "
                       + (r["error"][:300] if "error" in r else
                          f"{r['quality']:.2f} in {r['steps']} steps, {r['seconds']:.1f} s, "
                          f"target at {r['reached']}, load {r['load']}"))
    stored = {f"{S}/{p}/{lr!r}/{b}": stored_seconds(name, S, p, lr, b, runs, target)
              for S, policies in cells.items() for p, lr, b in policies}
    return {"bench": name, "target": target, "code": code, "runs": done, "stored": stored,
            "cells": {str(S): [list(c) for c in policies] for S, policies in cells.items()},
            "machine": f"{os.cpu_count()} CPUs"}


def render(data: dict) -> str:
    name, target = data["bench"], data["target"]
    bench = ff.BENCHES[name]
    runs = [r for r in data["runs"] if ff.ok(r)]
    dates = [r["date"] for r in data["runs"]]
    loads = [x for r in data["runs"] for x in r["load"]]
    lines = ["# The fair fight's seconds to target, paired on a quiet machine (#50)", "",
             f"{bench['title']}; target {target:.2f} {bench['unit']} (fair_fight.md's: S = 1's "
             f"quality minus {bench['margin']:g}). Each cell's policies ran one seed after another "
             "from one snapshot of the code, back to back, in an order rotated from seed to seed, "
             "with nothing else running on the 2 cores (horovodrun -np 2, Gloo). Seconds are "
             "training seconds without the evaluations (fair_fight's). `/ adascale` is the median "
             "over seeds of the policy's seconds over AdaScale's of the same seed. `stored` is "
             "fair_fight.md's unpaired figure for the cell (runs timed while other work shared the "
             "cores). The rules' budgets are the fight's (AdaScale's stored step count x S); "
             "AdaScale runs at today's code (per-worker statistics since #50), so its step count "
             "may differ from the stored one.", "",
             f"Code {data['code']}; {len(data['runs'])} runs, {min(dates)} to {max(dates)} UTC; "
             f"1-minute load average {min(loads):.2f}-{max(loads):.2f} before and after the runs "
             "(the job's own 2 processes count in it).", "",
             f"| S | policy | lr | {bench['unit']} | steps | steps to target | seconds to target | "
             "/ adascale | seconds (run) | / adascale | stored seconds to target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for S, policies in data["cells"].items():
        ada_policy = policies[0][0]
        by_seed = {r["seed"]: r for r in runs if str(r["S"]) == S and r["policy"] == ada_policy}
        for policy, lr, budget in policies:
            rows = [r for r in runs if str(r["S"]) == S and r["policy"] == policy and r["lr"] == lr]
            if not rows:
                continue
            q = [r["quality"] for r in rows]
            hits = [r for r in rows if r["reached"]]
            to_steps = f"{statistics.mean(r['reached'][0] for r in hits):.0f}" if hits else "not reached"
            to_secs = f"{statistics.mean(r['reached'][1] for r in hits):.1f}" if hits else "-"
            if hits and len(hits) < len(rows):
                to_steps += f" ({len(hits)} of {len(rows)} seeds)"
            pair = [r["reached"][1] / by_seed[r["seed"]]["reached"][1] for r in hits
                    if r["seed"] in by_seed and by_seed[r["seed"]]["reached"]]
            whole = [r["seconds"] / by_seed[r["seed"]]["seconds"] for r in rows if r["seed"] in by_seed]
            stored = data["stored"].get(f"{S}/{policy}/{lr!r}/{budget}")
            ratio = f"{statistics.median(pair):.2f}" if pair else "-"
            whole_ratio = f"{statistics.median(whole):.2f}" if whole else "-"
            lines.append(f"| {S} | {ff.LABELS.get(policy, policy)} | {lr:g} | "
                         f"{statistics.mean(q):.2f}{f' ± {statistics.stdev(q):.2f}' if len(q) > 1 else ''} | "
                         f"{statistics.mean(r['steps'] for r in rows):.0f} | {to_steps} | {to_secs} | "
                         f"{ratio} | {statistics.mean(r['seconds'] for r in rows):.1f} | {whole_ratio} | "
                         f"{'-' if stored is None else f'{stored:.1f}'} |")
    scales = ",".join(data["cells"])
    seeds = len({r["seed"] for r in data["runs"]})
    lines += ["", "- rerun: `.venv/bin/python benchmarks/fair_fight_seconds.py "
              f"--bench {name} --scales {scales} --seeds {seeds}` ({len(data['runs'])} runs, "
              f"{sum(r.get('seconds', 0.0) for r in data['runs']) / 60:.0f} minutes of training "
              "here)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", default="b1", choices=sorted(ff.BENCHES))
    p.add_argument("--scales", default="", help="S to run (default: the bench's)")
    p.add_argument("--seeds", type=int, default=ff.SEEDS)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    out = out_of(args.bench)
    path = out.with_suffix(".json")
    if not args.report_only:
        scales = [int(s) for s in (args.scales or ff.BENCHES[args.bench]["scales"]).split(",")]
        data = measure(args.bench, scales, args.seeds, args.timeout)
        data["date"] = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
        path.write_text(json.dumps(data, indent=1) + "\n")
    data = json.loads(path.read_text())
    out.with_suffix(".md").write_text(render(data))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
