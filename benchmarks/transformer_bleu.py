"""B4: the seed's experiment: a small Transformer trained with Adam at scale, scored by BLEU.

    .venv/bin/python benchmarks/transformer_bleu.py            # full: S in 1,8,32,128, 2 seeds
    .venv/bin/python benchmarks/transformer_bleu.py --quick    # minutes: S in 1,8, 1 seed, short budget
    .venv/bin/python benchmarks/transformer_bleu.py --report-only

Task: examples/translation_data.py (a generated English-like -> SOV language pair: word mapping,
reordering, gender/number agreement; 40,000 training sentences, 500 held-out ones never seen in
training), the encoder-decoder Transformer of examples/torch_translate.py (d_model 64, 2 + 2
layers, 4 heads), Adam (0.9, 0.98), baseline batch B0 = 32 sentences, a baseline schedule written
for S = 1 in baseline steps (linear warm-up over 10% of T, cosine decay to 0 at T) run in tau.
BLEU: sacrebleu corpus BLEU, tokenize="none", greedy decoding of the held-out sentences.

S = workers x accumulation: S = 1 is one plain process, every S >= 2 is a real
`horovodrun --gloo -np 2` job with accumulation S / 2. Each run is the example script itself.
The baseline peak lr is tuned at S = 1 only (3 values, seed 0); the other policies reuse it.
Also run: adascale_adam at S = 32 with activation checkpointing (must match the plain run), and
the seed's claim as stated: x5 + warm-up at S = 8 for T / 5 optimizer steps (budget 8/5 T).

Every run has a wall-clock limit; a crash or time-out is recorded as an error (and the benchmark
goes on), a run that trains badly (BLEU near 0) is a result. Results are saved after every run,
so an interrupted benchmark leaves a usable bleu.json (`--report-only` rebuilds the report).

Writes benchmarks/results/bleu.json, bleu.md, bleu_vs_scale.png and bleu_adascale.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BIN = pathlib.Path(sys.executable).parent
LOG_DIR = RESULTS / "bleu_logs"
POLICIES = ["none", "warmup:rule=sqrt", "warmup:rule=linear", "warmup:rule=fixed,factor=5", "adascale_adam"]
LABELS = {"none": "none", "warmup:rule=sqrt": "sqrt + warm-up", "warmup:rule=linear": "linear + warm-up",
          "warmup:rule=fixed,factor=5": "x5 + warm-up (seed)", "adascale_adam": "adascale_adam"}


def run_translate(*, scale: int, policy: str, seed: int, lr: float, budget: int,
                  checkpointing: bool = False, log_dir: pathlib.Path | None = None,
                  timeout: float = 900) -> dict:
    """One run of examples/torch_translate.py; rank 0's RESULT, or a row with an 'error'."""
    workers = 1 if scale == 1 else 2
    accumulate = scale // workers
    args = [str(BIN / "python"), str(ROOT / "examples" / "torch_translate.py"), "--policy", policy,
            "--seed", str(seed), "--lr", str(lr), "--budget", str(budget),
            "--accumulate", str(accumulate), "--batch-size", "32", "--log-every", "0"]
    if checkpointing:
        args.append("--checkpointing")
    cmd = args if workers == 1 else \
        [str(BIN / "horovodrun"), "--gloo", "-np", str(workers), "-H", f"localhost:{workers}"] + args
    # HOROVOD_CYCLE_TIME=5: as `hvd-scale run` sets for CPU jobs (the 1 ms default costs wall-clock
    # on 2 shared cores; it changes no result).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HOROVOD_CYCLE_TIME="5")
    env.pop("HVD_SCALE_LOG_DIR", None)
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)
        env["HVD_SCALE_LOG_DIR"] = str(log_dir)
    row = {"policy": policy, "S": scale, "seed": seed, "lr": lr, "budget": budget,
           "checkpointing": checkpointing}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout:.0f} s", "wall": time.perf_counter() - start}
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            result = json.loads(line.split("RESULT ", 1)[1])
            if result["rank"] == 0:
                result.pop("policy", None)
                return {**row, **result, "wall": wall}
    return {**row, "error": f"exit {proc.returncode}, no RESULT from rank 0: "
            f"{(proc.stdout[-800:] + proc.stderr[-800:]).strip()}", "wall": wall}


def _ok(r):
    return "error" not in r and r.get("bleu") is not None


def summarize(rows: list[dict], scales: list[int], lr: float) -> dict:
    plain = [r for r in rows if _ok(r) and not r["checkpointing"] and r["lr"] == lr]
    base = [r for r in plain if r["S"] == 1]
    base_steps = statistics.mean(r["steps"] for r in base) if base else math.nan
    table = {}
    for policy in POLICIES:
        for s in scales:
            # S = 1 is one run for every policy: every factor is 1 there.
            cell = [r for r in plain if r["S"] == s and (s == 1 or r["policy"] == policy)]
            failed = [r for r in rows if "error" in r and r["S"] == s and r["policy"] == policy]
            if not cell and not failed:
                continue
            bleus = [r["bleu"] for r in cell]
            table[(policy, s)] = {
                "bleu_mean": statistics.mean(bleus) if bleus else math.nan,
                "bleu_std": statistics.stdev(bleus) if len(bleus) > 1 else 0.0,
                "steps": statistics.mean(r["steps"] for r in cell) if cell else math.nan,
                "speedup": base_steps / statistics.mean(r["steps"] for r in cell) if cell else math.nan,
                "seconds": statistics.mean(r["seconds"] for r in cell) if cell else math.nan,
                "wall": statistics.mean(r["wall"] for r in cell) if cell else math.nan,
                "gain": statistics.mean(r["mean_gain"] for r in cell) if cell else math.nan,
                "runs": len(cell), "errors": len(failed)}
    return table


def write_report(args, rows, sweep, table, scales, seconds):
    lines = ["# B4: the seed's experiment: a small Transformer with Adam at scale (BLEU)", "",
             f"Generated translation task (examples/translation_data.py: 40,000 training sentences, "
             f"500 held-out), encoder-decoder Transformer d_model 64, 2 + 2 layers, 4 heads "
             f"(examples/torch_translate.py), Adam (0.9, 0.98), B0 = 32 sentences, budget T = "
             f"{args.budget} baseline steps, warm-up over 10% of T then cosine decay to 0, run in "
             f"tau; seeds {args.seeds}; S = workers x accumulation (S >= 2: horovodrun -np 2, Gloo). "
             "BLEU: sacrebleu corpus BLEU, tokenize='none' (the target words are already split), "
             "greedy decoding of the held-out sentences.", "",
             "## Baseline peak lr sweep at S = 1 (seed 0)", "", "| lr | BLEU | steps | seconds |",
             "|---|---|---|---|"]
    lines += [f"| {r['lr']:g} | " + (f"{r['bleu']:.1f} | {r['steps']} | {r['seconds']:.0f} |" if _ok(r)
                                     else f"error: {r['error'][:80]} | | |") for r in sweep]
    lines += ["", f"Chosen baseline lr: **{args.lr:g}**", "",
              "## BLEU (mean ± std over seeds), optimizer steps (speed-up in steps vs S = 1), "
              "training seconds per run (mean gain for adascale_adam)", "",
              "S = 1 is the same run for every policy (the factor is 1 at S = 1). Seconds: the "
              "training loop of rank 0, 2 processes sharing 2 cores for S >= 2 (1 process for S = 1), "
              "on a machine shared with other jobs: compare them within a column only.", "",
              "| policy | " + " | ".join(f"S = {s}" for s in scales) + " |",
              "|---|" + "---|" * len(scales)]
    for policy in POLICIES:
        cells = []
        for s in scales:
            c = table.get((policy, s))
            if c is None:
                cells.append("not run")
                continue
            if not c["runs"]:
                cells.append(f"error ({c['errors']} runs)")
                continue
            cell = (f"{c['bleu_mean']:.1f} ± {c['bleu_std']:.1f}<br>{c['steps']:.0f} steps (x{c['speedup']:.1f}), "
                    f"{c['seconds']:.0f} s" + (f", gain {c['gain']:.2f}" if policy == "adascale_adam" else ""))
            if c["runs"] < args.seeds:
                cell += f" ({c['runs']} of {args.seeds} seeds)"
            if c["errors"]:
                cell += f" + {c['errors']} error(s)"
            cells.append(cell)
        lines.append(f"| {LABELS[policy]} | " + " | ".join(cells) + " |")
    ck = [r for r in rows if r["checkpointing"]]
    if ck:
        lines += ["", "## Activation checkpointing (every encoder/decoder layer recomputed in backward)", "",
                  "| S | policy | seed | checkpointing | BLEU | steps | tau | mean gain | seconds | params checksum |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in ck:
            twins = [p for p in rows if not p["checkpointing"] and p["S"] == r["S"] and p["seed"] == r["seed"]
                     and p["policy"] == r["policy"] and p["lr"] == r["lr"]]
            for x in twins[:1] + [r]:
                if _ok(x):
                    lines.append(f"| {x['S']} | {x['policy']} | {x['seed']} | {'yes' if x['checkpointing'] else 'no'} | "
                                 f"{x['bleu']:.2f} | {x['steps']} | {x['progress']:.1f} | {x['mean_gain']:.3f} | "
                                 f"{x['seconds']:.0f} | {x['params_checksum']:.4f} |")
                else:
                    lines.append(f"| {x['S']} | {x['policy']} | {x['seed']} | {'yes' if x['checkpointing'] else 'no'} | "
                                 f"error: {x['error'][:80]} | | | | | |")
    claim = getattr(args, "claim_rows", None) or []
    if claim:
        base = [r for r in rows if _ok(r) and r["S"] == 1 and not r["checkpointing"] and r["lr"] == args.lr]
        base_bleu = statistics.mean(r["bleu"] for r in base) if base else math.nan
        base_steps = statistics.mean(r["steps"] for r in base) if base else math.nan
        lines += ["", "## The seed's claim as stated: x5 + warm-up at S = 8 for T / 5 steps", "",
                  f"Budget {claim[0]['budget']} baseline steps (= 8/5 T), so the S = 8 run takes T / 5 "
                  f"optimizer steps: 5x fewer than S = 1 (the schedule, in tau, stretched to the longer "
                  f"budget). S = 1 reference: BLEU {base_bleu:.1f} in {base_steps:.0f} steps.", "",
                  "| policy | S | seed | budget | BLEU | steps | steps vs S = 1 | seconds |", "|---|---|---|---|---|---|---|---|"]
        for r in claim:
            lines.append(f"| {r['policy']} | {r['S']} | {r['seed']} | {r['budget']} | " +
                         (f"{r['bleu']:.1f} | {r['steps']} | /{base_steps / r['steps']:.1f} | {r['seconds']:.0f} |"
                          if _ok(r) else f"error: {r['error'][:80]} | | | |"))
    errors = [r for r in rows + sweep + claim if "error" in r]
    if errors:
        lines += ["", "## Errors", ""] + [f"- S = {r['S']} {r['policy']} seed {r['seed']}: {r['error'][:300]}"
                                          for r in errors]
    lines += ["", "![BLEU vs S](bleu_vs_scale.png)", "", "![adascale_adam gain and lr vs tau](bleu_adascale.png)",
              "", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
              + (f"; {seconds / 60:.0f} minutes" if seconds else ""),
              f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, {platform.platform()}",
              f"- rerun: `.venv/bin/python benchmarks/transformer_bleu.py {' '.join(args.argv)}`".rstrip()]
    (RESULTS / "bleu.md").write_text("\n".join(lines) + "\n")


def plot(table, scales):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quality_at_scale import plot_gain_and_lr

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for policy in POLICIES:
        pts = [(s, table[(policy, s)]) for s in scales if (policy, s) in table and table[(policy, s)]["runs"]]
        ax.errorbar([s for s, _ in pts], [c["bleu_mean"] for _, c in pts],
                    yerr=[c["bleu_std"] for _, c in pts], marker="o", capsize=3, label=LABELS[policy])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("scale S")
    ax.set_ylabel("held-out BLEU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(RESULTS / "bleu_vs_scale.png", dpi=70)
    plt.close(fig)

    runs = sorted((d for d in LOG_DIR.iterdir() if (d / "metrics.csv").exists()),
                  key=lambda d: int(d.name.rsplit("S", 1)[-1])) if LOG_DIR.exists() else []
    plot_gain_and_lr(runs, RESULTS / "bleu_adascale.png")


def save(args, sweep, rows, seconds):
    saved_args = {k: v for k, v in vars(args).items()
                  if k not in ("report_only", "claim_only", "claim_rows")}
    (RESULTS / "bleu.json").write_text(json.dumps({"args": saved_args, "sweep": sweep, "runs": rows,
                                                   "claim": getattr(args, "claim_rows", None) or [],
                                                   "seconds": seconds}, indent=1) + "\n")


def run_claim(args, log, describe, deadline=math.inf):
    """The seed's claim as stated: x5 + warm-up at S = 8 in T / 5 optimizer steps (budget 8/5 T)."""
    args.claim_rows = []
    for seed in range(args.seeds):
        if time.perf_counter() > deadline:
            log(f"claim seed {seed}: not run (--max-minutes)")
            continue
        r = run_translate(scale=8, policy="warmup:rule=fixed,factor=5", seed=seed, lr=args.lr,
                          budget=args.budget * 8 // 5, timeout=args.timeout)
        args.claim_rows.append(r)
        log(f"claim S 8 x5 + warm-up, budget {args.budget * 8 // 5}, seed {seed}: {describe(r)}")


def report(args, sweep, rows, seconds):
    scales = [int(s) for s in args.scales.split(",")]
    table = summarize(rows, scales, args.lr)
    write_report(args, rows, sweep, table, scales, seconds)
    plot(table, scales)
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="S in 1, 8; one seed; budget 600; lr sweep of 2 (~7 min)")
    p.add_argument("--budget", type=int, default=1200, help="T, baseline steps")
    p.add_argument("--lr", type=float, default=None, help="skip the sweep and use this baseline peak lr")
    p.add_argument("--sweep", default="0.002,0.004,0.008")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--scales", default="1,8,32,128")
    p.add_argument("--checkpointing-scale", type=int, default=32,
                   help="S of the activation-checkpointing variant (adascale_adam, seed 0; 0: none)")
    p.add_argument("--timeout", type=float, default=900, help="wall-clock limit of one run, seconds")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="start no run after this many minutes (0: no limit); the rest is 'not run'")
    p.add_argument("--no-claim", action="store_true",
                   help="skip the seed's claim as stated (x5 + warm-up at S = 8 for T / 5 steps)")
    p.add_argument("--claim-only", action="store_true",
                   help="run only the seed's-claim runs and add them to an existing bleu.json")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite bleu.md and the plots from bleu.json, running nothing")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    def log(msg):
        print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)

    def describe(r):
        if "error" in r:
            return f"ERROR {r['error'][:200]}"
        return (f"BLEU {r['bleu']:5.1f} steps {r['steps']} tau {r['progress']:.0f} gain {r['mean_gain']:.2f} "
                f"{r['seconds']:.0f} s (wall {r['wall']:.0f} s)")

    if args.report_only or args.claim_only:
        saved = json.loads((RESULTS / "bleu.json").read_text())
        claim_only = args.claim_only
        for key, value in saved["args"].items():  # argv too: the report's rerun line is the run's
            setattr(args, key, value)
        args.claim_rows = saved.get("claim", [])
        seconds = saved.get("seconds", 0)
        if claim_only:
            start = time.perf_counter()
            run_claim(args, log, describe)
            seconds += time.perf_counter() - start
            save(args, saved["sweep"], saved["runs"], seconds)
        report(args, saved["sweep"], saved["runs"], seconds)
        print((RESULTS / "bleu.md").read_text())
        return 0
    if args.quick:
        args.budget, args.seeds, args.scales = 600, 1, "1,8"
        args.sweep = "0.002,0.004"
        args.checkpointing_scale = 8
    scales = [int(s) for s in args.scales.split(",")]
    start = time.perf_counter()
    deadline = start + 60 * args.max_minutes if args.max_minutes else math.inf

    sweep, rows = [], []
    if args.lr is None:
        for lr in (float(x) for x in args.sweep.split(",")):
            sweep.append(run_translate(scale=1, policy="none", seed=0, lr=lr, budget=args.budget,
                                       timeout=args.timeout))
            log(f"sweep lr {lr:g}: {describe(sweep[-1])}")
        ok = [r for r in sweep if _ok(r)]
        if not ok:
            raise SystemExit("every run of the lr sweep failed")
        best = max(ok, key=lambda r: r["bleu"])
        args.lr = best["lr"]
        rows.append(best)  # the seed-0 S = 1 run
        log(f"chosen lr {args.lr:g}")
    shutil.rmtree(LOG_DIR, ignore_errors=True)
    save(args, sweep, rows, time.perf_counter() - start)

    plan = []
    for s in scales:
        for seed in range(args.seeds):
            for policy in (["none"] if s == 1 else POLICIES):
                if s == 1 and seed == 0 and rows:
                    continue  # from the sweep
                plan.append((s, policy, seed, False))
        if s == args.checkpointing_scale:
            plan.append((s, "adascale_adam", 0, True))
    claim_at = max([s for s in scales if s <= 32] or [0])
    for s, policy, seed, ck in plan:
        if s > claim_at and not args.no_claim and not args.quick and getattr(args, "claim_rows", None) is None:
            run_claim(args, log, describe, deadline)
            save(args, sweep, rows, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            log(f"S {s} {policy} seed {seed}{' checkpointing' if ck else ''}: not run (--max-minutes)")
            continue
        logged = LOG_DIR / f"adascale_adam-S{s}" if policy == "adascale_adam" and seed == 0 and not ck else None
        r = run_translate(scale=s, policy=policy, seed=seed, lr=args.lr, budget=args.budget,
                          checkpointing=ck, log_dir=logged, timeout=args.timeout)
        rows.append(r)
        save(args, sweep, rows, time.perf_counter() - start)
        log(f"S {s:3d} {policy:27s} seed {seed}{' ckpt' if ck else ''}: {describe(r)}")

    if not args.no_claim and not args.quick and getattr(args, "claim_rows", None) is None:
        run_claim(args, log, describe, deadline)
    seconds = time.perf_counter() - start
    save(args, sweep, rows, seconds)
    report(args, sweep, rows, seconds)
    print((RESULTS / "bleu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
