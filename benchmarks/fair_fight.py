"""The fair fight (issue #33): fixed rules at AdaScale's step count, their lr tuned, against
AdaScale untuned, and what the tuning costs.

    .venv/bin/python benchmarks/fair_fight.py --bench b1                 # MNIST-1D, SGD: S = 16, 64
    .venv/bin/python benchmarks/fair_fight.py --bench b4                 # Transformer, Adam: S = 8, 32, 128
    .venv/bin/python benchmarks/fair_fight.py --bench b4short            # the same, T = 1200
    .venv/bin/python benchmarks/fair_fight.py --report-only

B1 and B4 give every policy the same budget in tau (baseline steps of progress): a fixed rule at S
then takes T / S optimizer steps, far fewer than AdaScale, whose gain r <= S credits less per step.
A practitioner who doubts a fixed rule's loss gives it AdaScale's step count instead and tunes its
lr. This does that, for each bench and S:

1. S = 1 (the rule-free baseline, 3 seeds): the target is its final quality minus a margin (B4:
   1 BLEU, B1: 0.5 accuracy points).
2. AdaScale untuned (``adascale`` / ``adascale_adam`` at the baseline lr, 3 seeds): N = its mean
   step count.
3. Each fixed rule at budget N x S (so N optimizer steps, the rule's warm-up over its share of it)
   with the baseline peak lr swept at seed 0 over a grid of halvings of the baseline's, extended
   until the best lr is inside it (bracketed); then seeds 1 and 2 at the best lr. The first rule's
   grid is (1/4, 1/2, 1) x the baseline lr; a later rule's is the power of two nearest the lr whose
   peak (lr x the rule's factor at S) equals the previous rule's best peak, and its neighbours, so
   that linear at S = 128 does not spend its first runs at 128 x an lr that sqrt already found
   too high. The tuning counts of the later rules are therefore counts after the first rule's.

Each run evaluates every budget / 20 of tau (training seconds counted without the evaluations), so
the steps and the seconds to reach the target are read off its curve. The tuning cost of a rule is
the number of sweep runs and their seconds. Every run is stored (results/fair_fight_runs.json) with
the hash of the code that decides its numbers; a stored run is not repeated (at any code: the
report names the codes). Writes results/fair_fight.md and results/fair_fight_<bench>.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

import transformer_bleu as b4

from hvd_scale.launch.jobs import CPU_ENV_DEFAULTS, horovodrun_command, read_results
from hvd_scale.spec import make_policy

ROOT = b4.ROOT
RESULTS = b4.RESULTS
STORE = RESULTS / "fair_fight_runs.json"
BIN = pathlib.Path(sys.executable).parent
RULES = ["warmup:rule=sqrt", "warmup:rule=linear", "warmup:rule=fixed,factor=5"]
LABELS = {"warmup:rule=sqrt": "sqrt + warm-up", "warmup:rule=linear": "linear + warm-up",
          "warmup:rule=fixed,factor=5": "x5 + warm-up (seed)", "adascale": "adascale",
          "adascale_adam": "adascale_adam", "none": "S = 1"}
BENCHES = {
    "b1": {"title": "B1: MNIST-1D, 1-D CNN, SGD momentum 0.9", "script": "torch_mnist1d.py",
           "data": "mnist1d_data.py", "adascale": "adascale", "lr": 0.05, "budget": 3000,
           "scales": "16,64", "metric": "test_accuracy", "unit": "accuracy %", "times": 100.0,
           "margin": 0.5, "extra": []},
    "b4": {"title": "B4: Transformer translation, Adam (0.9, 0.98)", "script": "torch_translate.py",
           "data": "translation_data.py", "adascale": "adascale_adam", "lr": 0.008, "budget": 2400,
           "scales": "8,32,128", "metric": "bleu", "unit": "BLEU", "times": 1.0, "margin": 1.0,
           "extra": []},
}
# B4's short-budget regime, where S = 1 is not converged (its own table in B4); everything but
# the budget as B4.
BENCHES["b4short"] = {**BENCHES["b4"], "budget": b4.SHORT_BUDGET,
                      "title": f"B4, short budget: T = {b4.SHORT_BUDGET} (S = 1 not converged; "
                               "doubling T still gains ~12 BLEU)"}
# Changes of the code that moved a policy's runs beyond their seeds' spread (rerun_adascale.py
# measured it): the report marks that policy's cells whose runs all ran before the change, as
# bleu.md marks cells of older code. (bench, policy) -> (UTC date of the change, the change).
MOVED = {(b, "adascale_adam"): ("2026-12-05 00:33", "#50 item 4's v_hat floor") for b in ("b4", "b4short")}
SEEDS = 3
EVALS = 20  # evaluations per run (every budget / EVALS of tau)
GRID = (0.25, 0.5, 1.0)  # the first sweep: these multiples of the baseline lr
GRID_LIMITS = (1 / 256, 4.0)  # the sweep's extension stops here, bracketed or not


def code_files(bench: dict) -> list[str]:
    return b4.CODE[:-2] + [f"examples/{bench['script']}", f"examples/{bench['data']}"]


def code_hash(bench: dict, source: pathlib.Path = ROOT) -> str:
    saved = b4.CODE
    try:
        b4.CODE = code_files(bench)
        return b4.code_hash(source)
    finally:
        b4.CODE = saved


def key(r: dict) -> tuple:
    """A run's identity; a run without "engine" (all before #49) ran under Horovod."""
    return r["bench"], r["policy"], r["S"], r["seed"], r["lr"], r["budget"], r.get("engine", "horovod")


def load() -> list[dict]:
    return json.loads(STORE.read_text())["runs"] if STORE.exists() else []


def save(runs: list[dict]) -> None:
    STORE.write_text(json.dumps({"runs": runs}, indent=1) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, *, policy: str, S: int, seed: int, lr: float, budget: int, snapshot: pathlib.Path,
        code: str, timeout: float, engine: str = "horovod") -> dict:
    """One run of the bench's example script (S = 1: one process; else horovodrun -np 2, Gloo, or
    with engine "ddp" torchrun --nproc-per-node 2: the example's --engine ddp, DDP on Gloo)."""
    bench = BENCHES[name]
    workers = 1 if S == 1 else 2
    args = [str(BIN / "python"), str(snapshot / "examples" / bench["script"]), "--policy", policy,
            "--seed", str(seed), "--lr", repr(lr), "--budget", str(budget), "--accumulate",
            str(S // workers), "--batch-size", "32", "--log-every", "0",
            "--eval-every", repr(budget / EVALS), *bench["extra"]]
    if workers == 1:
        cmd = args
    elif engine == "ddp":
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(workers), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *args[1:], "--engine", "ddp"]
    else:
        cmd = horovodrun_command(args, workers, controller="gloo")
    env = {**os.environ, **CPU_ENV_DEFAULTS, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(snapshot),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("HVD_SCALE_LOG_DIR", None)
    row = {"bench": name, "policy": policy, "S": S, "seed": seed, "lr": lr, "budget": budget,
           "engine": engine, "code": code,
           "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout:.0f} s"}
    result = next((r for r in read_results(proc.stdout) if r["rank"] == 0), None)
    if result is None:
        return {**row, "error": f"exit {proc.returncode}: {(proc.stdout[-600:] + proc.stderr[-600:]).strip()}"}
    quality = result[bench["metric"]] * bench["times"]
    curve = [(c[0], c[1], c[2], c[3] * bench["times"]) for c in result.get("curve", [])]
    if not curve or curve[-1][2] != result["steps"]:  # the final evaluation closes the curve
        curve.append((result["seconds"], result["progress"], result["steps"], quality))
    return {**row, "quality": quality, "steps": result["steps"], "progress": result["progress"],
            "diverged": bool(result.get("diverged")),
            "mean_gain": result["mean_gain"], "seconds": result["seconds"], "curve": curve,
            "wall": time.perf_counter() - start}


def ok(r: dict | None) -> bool:
    return r is not None and "error" not in r and r.get("quality") is not None \
        and math.isfinite(r["quality"])


def diverged(r: dict) -> bool:
    """Stopped before its budget (the example stops a run whose steps all overflow)."""
    return bool(r.get("diverged")) or r["progress"] < r["budget"] * (1 - 1e-9)


def best_of(runs: list[dict], keys: list):
    """The key of the best run: the highest quality (a run that diverged counts as none), and of
    equals (runs that all ended at chance) the smallest lr, the side where a diverging rule can
    train."""
    return max(zip(runs, keys), key=lambda rk: (
        rk[0]["quality"] if ok(rk[0]) and not diverged(rk[0]) else -math.inf, -rk[0]["lr"]))[1]


class Runner:
    def __init__(self, name: str, args):
        self.name, self.args, self.bench = name, args, BENCHES[name]
        self.runs = load()
        self.code = code_hash(self.bench)
        self.snapshot: pathlib.Path | None = None
        self.deadline = time.perf_counter() + 60 * args.max_minutes if args.max_minutes else math.inf

    def find(self, **spec) -> dict | None:
        k = (self.name, spec["policy"], spec["S"], spec["seed"], spec["lr"], spec["budget"], "horovod")
        matches = [r for r in self.runs if key(r) == k]
        current = [r for r in matches if r["code"] == self.code]
        return (current or matches or [None])[-1]

    def ensure(self, specs: list[dict]) -> list[dict | None]:
        """Run the specs not stored (S = 1 two at a time); the stored or new run of each."""
        todo = [s for s in specs if self.find(**s) is None]
        batches = [todo[i:i + 2] for i in range(0, len(todo), 2)] if all(s["S"] == 1 for s in todo) \
            else [[s] for s in todo]
        for batch in batches:
            if time.perf_counter() > self.deadline:
                b4.log(f"not run (--max-minutes): {batch}")
                continue
            if self.snapshot is None:
                self.snapshot, _ = b4.snapshot(ROOT)
            with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                rows = list(pool.map(lambda s: run(self.name, **s, snapshot=self.snapshot, code=self.code,
                                                   timeout=self.args.timeout), batch))
            for s, r in zip(batch, rows):
                self.runs = [x for x in self.runs if not (key(x) == key(r) and x["code"] == r["code"])]
                self.runs.append(r)
                b4.log(f"{self.name} S {s['S']} {s['policy']} seed {s['seed']} lr {s['lr']:g} "
                       f"T {s['budget']}: " + (f"ERROR {r['error'][:300]}" if "error" in r else
                                              f"{r['quality']:.2f} in {r['steps']} steps, {r['seconds']:.0f} s"))
            save(self.runs)
        return [self.find(**s) for s in specs]

    def spec(self, policy, S, seed, lr, budget):
        return {"policy": policy, "S": S, "seed": seed, "lr": lr, "budget": budget}

    def baseline(self) -> list[dict | None]:
        b = self.bench
        return self.ensure([self.spec("none", 1, seed, b["lr"], b["budget"]) for seed in range(SEEDS)])

    def adascale(self, S: int) -> list[dict | None]:
        b = self.bench
        return self.ensure([self.spec(b["adascale"], S, seed, b["lr"], b["budget"]) for seed in range(SEEDS)])

    def sweep(self, rule: str, S: int, steps: int, mults: list[float]) -> tuple[float | None, list[dict]]:
        """The seed-0 sweep of the rule's baseline lr at ``steps`` optimizer steps from the grid
        ``mults`` (multiples of the baseline lr), extended by halvings (or doublings) until the best
        lr is inside it: (best lr, the sweep's runs)."""
        lr0, budget = self.bench["lr"], steps * S
        while True:
            runs = self.ensure([self.spec(rule, S, 0, lr0 * m, budget) for m in mults])
            if any(r is None for r in runs):
                return None, [r for r in runs if r]
            best = best_of(runs, mults)
            if best == mults[0] and best / 2 >= GRID_LIMITS[0]:
                mults.insert(0, best / 2)
            elif best == mults[-1] and best * 2 <= GRID_LIMITS[1]:
                mults.append(best * 2)
            else:
                return lr0 * best, runs

    def fight(self, S: int, rules: list[str]) -> None:
        ada = self.adascale(S)
        if not all(ok(r) for r in ada):
            return
        steps = round(statistics.mean(r["steps"] for r in ada))
        before = None  # (rule, best multiple of the baseline lr) of the rule swept before
        for rule in rules:
            mults = list(GRID) if before is None else matched_grid(*before, rule, S, steps * S)
            lr, _ = self.sweep(rule, S, steps, mults)
            if lr is None:
                return
            self.ensure([self.spec(rule, S, seed, lr, steps * S) for seed in range(1, SEEDS)])
            before = rule, lr / self.bench["lr"]


def peak_factor(rule: str, S: int, budget: int) -> float:
    """The rule's lr factor at S once its warm-up is over (the engine's own formula)."""
    return make_policy(rule, budget=budget).rule_factor(budget, S, 1.0)


def matched_grid(rule: str, best: float, nxt: str, S: int, budget: int) -> list[float]:
    """The first grid of rule ``nxt`` after ``rule`` was best at ``best`` x the baseline lr: the
    power of two nearest the multiple whose peak equals that best peak, and its neighbours."""
    centre = 2.0 ** round(math.log2(best * peak_factor(rule, S, budget) / peak_factor(nxt, S, budget)))
    return [centre / 2, centre, centre * 2]


# -- the report ----------------------------------------------------------------------------------

def reached(r: dict, target: float) -> tuple[int, float] | None:
    """(optimizer steps, training seconds) at the first evaluation at or above the target."""
    return next(((steps, secs) for secs, _, steps, q in r["curve"] if q >= target), None)


def summary(rows: list[dict], target: float) -> dict:
    q = [r["quality"] for r in rows]
    hit = [reached(r, target) for r in rows]
    got = [h for h in hit if h]
    return {"n": len(rows), "mean": statistics.mean(q), "std": statistics.stdev(q) if len(q) > 1 else 0.0,
            "steps": statistics.mean(r["steps"] for r in rows),
            "seconds": statistics.mean(r["seconds"] for r in rows),
            "hit": len(got), "to_steps": statistics.mean(h[0] for h in got) if got else None,
            "to_seconds": statistics.mean(h[1] for h in got) if got else None,
            "gain": statistics.mean(r["mean_gain"] for r in rows)}


def older(name: str, policy: str, rows: list[dict]) -> str:
    """' (older code: before <change>)' where the runs all ran before a change that moved them."""
    date, change = MOVED.get((name, policy), (None, None))
    return f" (older code: before {change})" if date and all(r["date"] < date for r in rows) else ""


def fmt_reach(s: dict) -> tuple[str, str]:
    if not s["hit"]:
        return "not reached", "-"
    note = "" if s["hit"] == s["n"] else f" ({s['hit']} of {s['n']} seeds)"
    return f"{s['to_steps']:.0f}{note}", f"{s['to_seconds']:.0f}"


def bench_report(name: str, runs: list[dict], code: str) -> tuple[list[str], dict]:
    bench = BENCHES[name]
    mine = [r for r in runs if r["bench"] == name and ok(r) and r.get("engine", "horovod") == "horovod"]
    base = [r for r in mine if r["policy"] == "none" and r["S"] == 1 and r["lr"] == bench["lr"]
            and r["budget"] == bench["budget"]]
    lines = [f"## {bench['title']}", ""]
    if not base:
        return lines + ["Not run yet.", ""], {}
    s1 = statistics.mean(r["quality"] for r in base)
    target = s1 - bench["margin"]
    lines += [f"S = 1 (baseline lr {bench['lr']:g}, T = {bench['budget']}, {len(base)} seeds): "
              f"{s1:.2f} {bench['unit']}; **target {target:.2f}** (S = 1's minus {bench['margin']:g}).", "",
              f"| S | policy | baseline lr | {bench['unit']} (3 seeds) | steps | steps to target | "
              "seconds to target | tuning runs (seconds) |", "|---|---|---|---|---|---|---|---|"]
    plots = {}
    for S in sorted({r["S"] for r in mine if r["S"] > 1}):
        ada = [r for r in mine if r["policy"] == bench["adascale"] and r["S"] == S and r["lr"] == bench["lr"]
               and r["budget"] == bench["budget"]]
        if not ada:
            continue
        sa = summary(ada, target)
        steps = round(statistics.mean(r["steps"] for r in ada))
        to_steps, to_secs = fmt_reach(sa)
        lines.append(f"| {S} | **{bench['adascale']}** (untuned), gain {sa['gain']:.2f}"
                     f"{older(name, bench['adascale'], ada)} | {bench['lr']:g} | "
                     f"{sa['mean']:.2f} ± {sa['std']:.2f} | {sa['steps']:.0f} | {to_steps} | {to_secs} | 0 |")
        plots[S] = {bench["adascale"]: ada}
        for rule in RULES:
            sweep = [r for r in mine if r["policy"] == rule and r["S"] == S and r["budget"] == steps * S
                     and r["seed"] == 0]
            if not sweep:
                continue
            best = best_of(sweep, sweep)
            seeds = [r for r in mine if r["policy"] == rule and r["S"] == S and r["budget"] == steps * S
                     and r["lr"] == best["lr"]]
            sr = summary(seeds, target)
            to_steps, to_secs = fmt_reach(sr)
            lrs = sorted(r["lr"] for r in sweep)
            inside = lrs[0] < best["lr"] < lrs[-1]
            tried = ", ".join(f"{r['lr']:g}: {r['quality']:.1f}" for r in sorted(sweep, key=lambda r: r["lr"]))
            lines.append(
                f"| {S} | {LABELS[rule]}, best of {len(sweep)} lr ({tried}){'' if inside else ' (best at the edge)'} "
                f"| {best['lr']:g} | {sr['mean']:.2f} ± {sr['std']:.2f}"
                f"{'' if len(seeds) >= SEEDS else f' ({len(seeds)} of {SEEDS} seeds)'} | {sr['steps']:.0f} | "
                f"{to_steps} | {to_secs} | {len(sweep)} ({sum(r['seconds'] for r in sweep):.0f}) |")
            plots[S][rule] = seeds
    codes = sorted({r["code"] for r in mine})
    lines += ["", f"Code of these runs: {', '.join(codes)} (today's: {code})."]
    if any("(older code: " in line for line in lines):
        date, change = MOVED[(name, bench["adascale"])]
        lines += ["", f"Cells marked '(older code: before {change})' ran before that change ({date} "
                  "UTC). Rerun after it, B4's cell at S = 32 moved beyond its seeds' spread (more "
                  "steps, a lower gain; BLEU within the spread): [rerun_adascale.md]"
                  "(rerun_adascale.md); the other cells were not rerun. The fixed rules' step "
                  "count is the older AdaScale's."]
    lines += [""]
    return lines, plots


def plot(name: str, plots: dict, target: float | None) -> str | None:
    if not plots:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bench = BENCHES[name]
    fig, axes = plt.subplots(1, len(plots), figsize=(4.2 * len(plots), 3.4), constrained_layout=True,
                             squeeze=False)
    for ax, (S, by_policy) in zip(axes[0], sorted(plots.items())):
        for i, (policy, rows) in enumerate(by_policy.items()):
            for j, r in enumerate(sorted(rows, key=lambda r: r["seed"])):
                ax.plot([c[2] for c in r["curve"]], [c[3] for c in r["curve"]], color=f"C{i}", alpha=0.8,
                        lw=1.2, label=f"{LABELS[policy]} (lr {r['lr']:g})" if j == 0 else None)
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=0.8, label="target")
        ax.set_title(f"S = {S}")
        ax.set_xlabel("optimizer steps")
        ax.set_ylabel(bench["unit"])
        ax.set_ylim(bottom=max(0, target - 30) if target is not None else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    out = f"fair_fight_{name}.png"
    fig.savefig(RESULTS / out, dpi=70)
    plt.close(fig)
    return out


def write_report(runs: list[dict]) -> None:
    lines = ["# The fair fight: fixed rules at AdaScale's step count, lr tuned (issue #33)", "",
             "Each fixed rule gets AdaScale's mean optimizer step count at that S (budget = steps x S "
             "in tau; its warm-up is its share of that budget) and a sweep of the baseline peak lr at "
             "seed 0 (the first rule: 1/4, 1/2, 1 x the baseline's; a later rule: around the lr whose "
             "peak matches the previous rule's best peak; extended by halvings or doublings until "
             "the best is inside), then 3 seeds at the best lr. AdaScale runs untuned, at the baseline lr. 'Steps / seconds to target': "
             f"the first of {EVALS} evaluations per run at or above the target (mean over the seeds "
             "that reach it); seconds are training time without the evaluations, on this machine "
             "(2 cores, np 2, Gloo; other work may have shared it). 'Tuning runs': the sweep's runs "
             "at seed 0 and their training seconds (AdaScale: none; the S = 1 lr sweep is shared).", ""]
    for name, bench in BENCHES.items():
        part, plots = bench_report(name, runs, code_hash(bench))
        lines += part
        base = [r["quality"] for r in runs if r["bench"] == name and ok(r) and r["S"] == 1]
        png = plot(name, plots, statistics.mean(base) - bench["margin"] if base else None)
        if png:
            lines += [f"![{name}: quality against steps]({png})", ""]
    dates = [r["date"] for r in runs]
    lines += [f"- runs: {len(runs)} in fair_fight_runs.json, dated {min(dates, default='-')} to "
              f"{max(dates, default='-')} UTC",
              "- rerun: `.venv/bin/python benchmarks/fair_fight.py --bench b1`, `--bench b4 "
              "[--scales 8,32,128] [--rules ...]` and `--bench b4short` (stored runs are kept; "
              "delete the store to rerun)"]
    (RESULTS / "fair_fight.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", choices=sorted(BENCHES), action="append", default=[])
    p.add_argument("--scales", default="", help="S to run (default: the bench's)")
    p.add_argument("--rules", default=";".join(RULES), help="';'-separated fixed rules")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--max-minutes", type=float, default=0, help="start no run after this many minutes")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if not args.report_only:
        for name in args.bench:
            runner = Runner(name, args)
            runner.baseline()
            for S in (int(s) for s in (args.scales or BENCHES[name]["scales"]).split(",")):
                runner.fight(S, args.rules.split(";"))
    write_report(load())
    print((RESULTS / "fair_fight.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
