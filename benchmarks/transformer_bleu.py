"""B4: the seed's experiment: a small Transformer trained with Adam at scale, scored by BLEU.

    .venv/bin/python benchmarks/transformer_bleu.py --phase curve       # S = 1: BLEU against T
    .venv/bin/python benchmarks/transformer_bleu.py --phase sweep       # S = 1: peak lr at T
    .venv/bin/python benchmarks/transformer_bleu.py --phase converged   # policies x S x seeds at T
    .venv/bin/python benchmarks/transformer_bleu.py --phase short       # the same at T = 1200
    .venv/bin/python benchmarks/transformer_bleu.py --phase claim       # x5 + warm-up, T / 5 steps
    .venv/bin/python benchmarks/transformer_bleu.py --phase variants    # adascale_adam's choices
    .venv/bin/python benchmarks/transformer_bleu.py --phase verify      # older runs still exact?
    .venv/bin/python benchmarks/transformer_bleu.py --report-only

Task: examples/translation_data.py (a generated English-like -> SOV language pair: word mapping,
reordering, gender/number agreement; 40,000 training sentences, 500 held-out ones never seen in
training), the encoder-decoder Transformer of examples/torch_translate.py (d_model 64, 2 + 2
layers, 4 heads), Adam (0.9, 0.98) (AdamW, weight decay 0.01, as a row), baseline batch B0 = 32
sentences, a baseline schedule written for S = 1 in baseline steps (linear warm-up over 10% of T,
cosine decay to 0 at T) run in tau. BLEU: sacrebleu corpus BLEU, tokenize="none", greedy decoding.

S = workers x accumulation: S = 1 is one plain process (two at a time: one per core), every
S >= 2 a real `horovodrun --gloo -np 2` job with accumulation S / 2. Each run is the example
script itself and is deterministic (the same BLEU on a rerun).

The converged budget T is chosen from the S = 1 curve (the first T where doubling it gains under
1 BLEU), the baseline lr by a bracketed sweep at that T (its best value must be inside the
bracket). Every run is stored in results/bleu_runs.json with a hash of the code that decides its
numbers (engine, adapters, example); a run stored for the same configuration and code is not
repeated, so an interrupted benchmark resumes, and the report marks cells run on other code.
Runs are deterministic, so an older code's runs count as today's where `--phase verify` reran
that policy (seed 0, at S = 32 where it runs at scale) at today's code and got the same weights
to the last bit (the sum of every parameter, the BLEU and the step count): the report names the
code and the run that showed it.
`--max-minutes` starts no run after that many minutes: cells not run show as such.

Writes benchmarks/results/bleu_runs.json, bleu.md, bleu_vs_scale.png and bleu_adascale.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
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

from hvd_scale.launch.jobs import CPU_ENV_DEFAULTS, horovodrun_command, read_results

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STORE = RESULTS / "bleu_runs.json"
BIN = pathlib.Path(sys.executable).parent
LOG_DIR = RESULTS / "bleu_logs"
ADASCALE = "adascale_adam"
ADAPTDL = "adascale_adam:moments=steps"
POLICIES = ["none", "warmup:rule=sqrt", "warmup:rule=linear", "warmup:rule=fixed,factor=5", ADAPTDL,
            ADASCALE]
LABELS = {"none": "none", "warmup:rule=sqrt": "sqrt + warm-up", "warmup:rule=linear": "linear + warm-up",
          "warmup:rule=fixed,factor=5": "x5 + warm-up (seed)",
          ADAPTDL: "adascale_adam, betas fixed (AdaptDL's AdamScale)",
          ADASCALE: "**adascale_adam** (horizons in progress)"}
# The files whose contents decide a run's numbers (the torch path: no Keras module is imported).
# (adapters/torch.py: the adapter before it became the package adapters/torch/; an entry a
# checkout lacks is skipped.)
CODE = ["hvd_scale", "adapters/__init__.py", "adapters/core.py", "adapters/protocol.py",
        "adapters/environment.py", "adapters/adapt.py", "adapters/agreement.py",
        "adapters/checkpoint.py", "adapters/readout.py", "adapters/torch.py", "adapters/torch",
        "examples/torch_translate.py", "examples/translation_data.py"]
# Where the runs import them from: a copy laid out as installed (adapters/ inside hvd_scale/), made
# when the benchmark starts, so that edits to the tree during a long benchmark reach no run.
SNAPSHOT: pathlib.Path | None = None
CODE_HASH = ""
# adascale_adam's choices measured against its default (issues #21, #30): the lr factor's power
# with the betas scaled, and a capped step's lr (drift per unit of tau kept). (#21 also measured
# horizon=previous, the betas following the previous step's gain: equal; removed in #30.)
VARIANTS = ["adascale_adam:lr_power=0.625", "adascale_adam:lr_power=0.75",
            "adascale_adam:capped=drift"]
LABELS.update({"adascale_adam:horizon=previous": "betas follow the previous step's gain (removed)",
               "adascale_adam:capped=drift": "capped step's lr x R / sqrt(r): drift kept",
               "adascale_adam:lr_power=0.625": "lr x r^0.625", "adascale_adam:lr_power=0.75": "lr x r^0.75",
               "adascale_adam:max_gain=inf": "no gain cap"})
VERIFY_SCALE = 32  # the scale at which --phase verify reruns each policy (the gain cap binds there)
SHORT_BUDGET = 1200  # the first B4's budget: S = 1 still gains ~12 BLEU by doubling it
CURVE = (600, 1200, 2400, 4800)
SEEDS = 3


def code_hash(source: pathlib.Path = ROOT) -> str:
    h = hashlib.sha256()
    for entry in CODE:
        path = source / entry
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []:
            h.update(str(f.relative_to(source)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def snapshot(source: pathlib.Path) -> tuple[pathlib.Path, str]:
    """Copy the code of ``source`` (a checkout) to a temporary directory as it installs; returns
    the directory (for PYTHONPATH, and its examples/) and the code's hash. The directory is removed
    when this process exits (a caller may move it elsewhere first)."""
    import atexit
    import tempfile

    out = pathlib.Path(tempfile.mkdtemp(prefix="b4code-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(source / "hvd_scale", out / "hvd_scale", ignore=ignore)
    for sub in ("adapters", "launch"):
        shutil.copytree(source / sub, out / "hvd_scale" / sub, ignore=ignore)
    shutil.copytree(source / "examples", out / "examples", ignore=ignore)
    return out, code_hash(source)


def key(row: dict) -> tuple:
    return (row["policy"], row["S"], row["seed"], row["lr"], row["budget"], row["optimizer"],
            row.get("checkpointing", False))


def load_store() -> list[dict]:
    return json.loads(STORE.read_text())["runs"] if STORE.exists() else []


def save_store(runs: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    STORE.write_text(json.dumps({"runs": runs}, indent=1) + "\n")


def run_translate(*, scale: int, policy: str, seed: int, lr: float, budget: int,
                  optimizer: str = "adam", checkpointing: bool = False,
                  log_dir: pathlib.Path | None = None, timeout: float = 3600) -> dict:
    """One run of examples/torch_translate.py; rank 0's RESULT, or a row with an 'error'."""
    workers = 1 if scale == 1 else 2
    code = SNAPSHOT or ROOT
    args = [str(BIN / "python"), str(code / "examples" / "torch_translate.py"), "--policy", policy,
            "--seed", str(seed), "--lr", str(lr), "--budget", str(budget), "--optimizer", optimizer,
            "--accumulate", str(scale // workers), "--batch-size", "32", "--log-every", "0"]
    if checkpointing:
        args.append("--checkpointing")
    cmd = args if workers == 1 else horovodrun_command(args, workers, controller="gloo")
    # CPU_ENV_DEFAULTS' 5 ms cycle, as `hvd-scale run` sets for CPU jobs (the 1 ms default costs
    # wall-clock on 2 shared cores; it changes no result).
    env = {**os.environ, **CPU_ENV_DEFAULTS, "PYTHONUNBUFFERED": "1"}
    if SNAPSHOT is not None:
        env["PYTHONPATH"] = str(SNAPSHOT)
    env.pop("HVD_SCALE_LOG_DIR", None)
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)
        env["HVD_SCALE_LOG_DIR"] = str(log_dir)
    row = {"policy": policy, "S": scale, "seed": seed, "lr": lr, "budget": budget,
           "optimizer": optimizer, "checkpointing": checkpointing, "code": CODE_HASH,
           "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout:.0f} s", "wall": time.perf_counter() - start}
    wall = time.perf_counter() - start
    result = next((r for r in read_results(proc.stdout) if r["rank"] == 0), None)
    if result is not None:
        for k in ("policy", "optimizer", "seed"):
            result.pop(k, None)
        return {**row, **result, "wall": wall}
    return {**row, "error": f"exit {proc.returncode}, no RESULT from rank 0: "
            f"{(proc.stdout[-800:] + proc.stderr[-800:]).strip()}", "wall": wall}


def ok(r):
    return "error" not in r and r.get("bleu") is not None


def family(r: dict) -> tuple[str, str]:
    """What decides a run's code path besides its numbers: the policy (every policy is 'none' at
    S = 1, one plain process) and the optimizer."""
    return ("none" if r["S"] == 1 else r["policy"]), r["optimizer"]


def reproduced(runs: list[dict], code: str) -> dict[tuple, dict]:
    """{(older code, policy, optimizer): the run at ``code`` that reproduced a run of that code
    to the last bit}: the same configuration, the same weights (sum of all parameters), BLEU and
    steps. Only --phase verify's configurations count (S = 1, or VERIFY_SCALE, where
    adascale_adam's gain cap binds): a match at a scale where some code path is idle (the cap at
    S = 8) would say nothing about it."""
    out = {}
    for new in (r for r in runs if ok(r) and r.get("code") == code and r["S"] in (1, VERIFY_SCALE)):
        for old in runs:
            if ok(old) and old.get("code") != code and key(old) == key(new) and \
                    (old.get("params_checksum"), old["bleu"], old["steps"]) == \
                    (new.get("params_checksum"), new["bleu"], new["steps"]) and \
                    new.get("params_checksum") is not None:
                out[(old["code"],) + family(old)] = new
    return out


def current_code(r: dict | None, code: str, same: dict) -> bool:
    """The run (None: none stored) ran at ``code``, or at a code reproduced there."""
    return r is not None and (r.get("code") == code or (r.get("code"),) + family(r) in same)


class Runner:
    """Runs what the store lacks (at this code), S = 1 runs two at a time, and keeps the store."""

    def __init__(self, args):
        self.args, self.runs, self.code = args, load_store(), CODE_HASH
        start = time.perf_counter()
        self.deadline = start + 60 * args.max_minutes if args.max_minutes else math.inf

    def find(self, s: dict) -> dict | None:
        """The stored run of this spec: at this code (or one reproduced at it) if there is
        one, else the latest."""
        matches = [r for r in self.runs if key(r) == key({**s, "S": s["scale"]})]
        same = reproduced(self.runs, self.code)
        current = [r for r in matches if current_code(r, self.code, same)]
        return (current or matches or [None])[-1]

    def ensure(self, specs: list[dict], *, rerun: bool = False) -> None:
        """Run the specs the store lacks at this code (``rerun``: those not run at this very code)."""
        same = {} if rerun else reproduced(self.runs, self.code)
        todo = [s for s in specs
                if not current_code(self.find(s), self.code, same)
                or (rerun and self.find(s).get("code") != self.code)]
        if self.args.any_code and not rerun:  # a run stored at any code counts (marked older)
            todo = [s for s in todo if self.find(s) is None]
        singles = [s for s in todo if s["scale"] == 1]
        for i in range(0, len(singles), 2):
            self._run_batch(singles[i:i + 2])
        for s in todo:
            if s["scale"] > 1:
                self._run_batch([s])

    def _run_batch(self, specs: list[dict]) -> None:
        if time.perf_counter() > self.deadline:
            for s in specs:
                log(f"not run (--max-minutes): {describe_spec(s)}")
            return
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
            rows = list(pool.map(lambda s: run_translate(**s, timeout=self.args.timeout), specs))
        for s, r in zip(specs, rows):
            self.runs = [x for x in self.runs if not (key(x) == key(r) and x.get("code") == r["code"])]
            self.runs.append(r)
            log(f"{describe_spec(s)}: {describe(r)}")
        save_store(self.runs)


def log_dir(policy: str, scale: int) -> pathlib.Path:
    return LOG_DIR / f"{policy.replace(':', '-').replace('=', '-')}-S{scale:03d}"


def spec(policy, S, seed, lr, budget, optimizer="adam", **kw) -> dict:
    return {"policy": policy, "scale": S, "seed": seed, "lr": lr, "budget": budget,
            "optimizer": optimizer, **kw}


def describe_spec(s):
    return (f"S {s['scale']:3d} {s['policy']:27s} seed {s['seed']} lr {s['lr']:g} T {s['budget']} "
            f"{s['optimizer']}{' ckpt' if s.get('checkpointing') else ''}")


def describe(r):
    if "error" in r:
        return f"ERROR {r['error'][:200]}"
    return (f"BLEU {r['bleu']:5.1f} steps {r['steps']} tau {r['progress']:.0f} gain {r['mean_gain']:.2f} "
            f"{r['seconds']:.0f} s (wall {r['wall']:.0f} s)")


def log(msg):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


# -- the phases ----------------------------------------------------------------------------------

def chosen_budget(runs, lr) -> int | None:
    """The first T of the S = 1 curve (seed 0) where doubling it gains under 1 BLEU."""
    bleu = {r["budget"]: r["bleu"] for r in runs if ok(r) and r["S"] == 1 and r["seed"] == 0
            and r["lr"] == lr and r["optimizer"] == "adam"}
    for t in CURVE:
        if t in bleu and 2 * t in bleu and bleu[2 * t] - bleu[t] < 1.0:
            return t
    return None


def phase_specs(args, phase: str) -> list[dict]:
    scales = [int(s) for s in args.scales.split(",")]
    policies = args.policies.split(";") if args.policies else POLICIES
    seeds = range(args.seeds)
    if phase == "curve":
        return [spec("none", 1, 0, args.curve_lr, t) for t in CURVE]
    if phase == "sweep":
        return [spec("none", 1, 0, float(lr), args.budget) for lr in args.sweep.split(",")]
    budget = SHORT_BUDGET if phase == "short" else args.budget
    if phase == "variants":
        return [spec(p, s, seed, args.lr, budget) for p in (args.variants.split(";")
                                                            if args.variants else VARIANTS)
                for s in [int(x) for x in args.variant_scales.split(",")]
                for seed in (seeds if s <= args.variant_seeds_max_scale else range(1))]
    if phase == "verify":  # seed 0 of each policy and optimizer, at S = 1 or VERIFY_SCALE
        return [spec(p, 1 if o.endswith("-s1") else VERIFY_SCALE, 0, args.lr, budget,
                     optimizer=o.removesuffix("-s1"))
                for p, o in [("none", "adam-s1"), ("none", "adamw-s1")] + [(p, "adam") for p in POLICIES]
                + [(ADASCALE, "adamw")] + [(p, "adam") for p in VARIANTS]]
    if phase == "claim":
        return [spec("warmup:rule=fixed,factor=5", 8, seed, args.lr, budget * 8 // 5) for seed in seeds]
    out = [spec("none", 1, seed, args.lr, budget) for seed in seeds]
    for s in (s for s in scales if s > 1):
        for policy in policies:
            for seed in (seeds if policy in args.all_seeds.split(";") else range(1)):
                out.append(spec(policy, s, seed, args.lr, budget))
    if phase == "converged" and args.adamw:
        out += [spec(p, s, seed, args.lr, budget, optimizer="adamw")
                for s in [1] + [s for s in scales if s > 1] for p in (["none"] if s == 1 else [ADASCALE])
                for seed in (seeds if s <= args.adamw_max_scale else range(1))]
    return out


# -- the report ----------------------------------------------------------------------------------

def latest(runs, code) -> list[dict]:
    """One run per configuration: the latest at ``code`` where there is one, else the latest."""
    best: dict[tuple, dict] = {}
    for r in runs:
        k = key(r)
        if k not in best or r.get("code") == code or best[k].get("code") != code:
            best[k] = r
    return list(best.values())


def cell_rows(runs, *, policy, S, lr, budget, optimizer="adam"):
    return [r for r in runs if ok(r) and r["S"] == S and r["lr"] == lr and r["budget"] == budget
            and r["optimizer"] == optimizer and not r.get("checkpointing")
            and (S == 1 or r["policy"] == policy)]


def fmt_cell(rows, base_steps, code, seeds, gain=False, same=None) -> str:
    if not rows:
        return "not run"
    bleus = [r["bleu"] for r in rows]
    std = statistics.stdev(bleus) if len(bleus) > 1 else 0.0
    steps = statistics.mean(r["steps"] for r in rows)
    text = (f"{statistics.mean(bleus):.1f} ± {std:.1f}<br>{steps:.0f} steps (x{base_steps / steps:.1f})"
            + (f", gain {statistics.mean(r['mean_gain'] for r in rows):.2f}" if gain else ""))
    if len(rows) < seeds:
        text += f" ({len(rows)} of {seeds} seeds)"
    if any(not current_code(r, code, same or {}) for r in rows):
        text += " (older code)"
    return text


def table(runs, title, *, lr, budget, scales, seeds, code, optimizer="adam", policies=POLICIES,
          same=None):
    base = cell_rows(runs, policy="none", S=1, lr=lr, budget=budget, optimizer=optimizer)
    base_steps = statistics.mean(r["steps"] for r in base) if base else math.nan
    lines = [title, "", "| policy | " + " | ".join(f"S = {s}" for s in scales) + " |",
             "|---|" + "---|" * len(scales)]
    for policy in policies:
        cells = [fmt_cell(cell_rows(runs, policy=policy, S=s, lr=lr, budget=budget, optimizer=optimizer),
                          base_steps, code, seeds, gain=policy.startswith(ADASCALE), same=same)
                 for s in scales]
        lines.append(f"| {LABELS.get(policy, policy)} | " + " | ".join(cells) + " |")
    return lines


def write_report(args, runs, code, seconds=None):
    same = reproduced(runs, code)
    runs = latest(runs, code)
    scales = [int(s) for s in args.scales.split(",")]
    s1 = sorted((r for r in runs if ok(r) and r["S"] == 1 and r["seed"] == 0 and r["optimizer"] == "adam"),
                key=lambda r: (r["lr"], r["budget"]))
    lines = ["# B4: the seed's experiment: a small Transformer with Adam at scale (BLEU)", "",
             "Generated translation task (examples/translation_data.py: 40,000 training sentences, 500 "
             "held-out), encoder-decoder Transformer d_model 64, 2 + 2 layers, 4 heads "
             "(examples/torch_translate.py), Adam (0.9, 0.98, eps 1e-9), B0 = 32 sentences, warm-up over "
             "10% of T then cosine decay to 0, run in tau. S = workers x accumulation (S >= 2: "
             "horovodrun -np 2, Gloo). BLEU: sacrebleu corpus BLEU, tokenize='none', greedy decoding "
             "of the held-out sentences. Each cell: BLEU mean ± std over seeds, optimizer steps "
             "(speed-up in steps against S = 1), mean gain for adascale_adam. S = 1 is one run for "
             "every policy (every factor is 1 there).", "",
             "## S = 1: BLEU against the budget T, and the lr sweep (seed 0)", "",
             "| lr | T | BLEU | steps | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {r['lr']:g} | {r['budget']} | {r['bleu']:.1f} | {r['steps']} | {r['seconds']:.0f} |"
              for r in s1]
    t = chosen_budget(runs, args.curve_lr)
    lines += ["", f"Converged budget: **T = {args.budget}** (the first T of the curve where doubling it "
              f"gains under 1 BLEU: {t if t else 'not measured yet'}); baseline peak lr **{args.lr:g}** "
              f"(bracket {args.sweep}).", ""]
    lines += table(runs, f"## Converged baseline: T = {args.budget}", lr=args.lr, budget=args.budget,
                   scales=scales, seeds=args.seeds, code=code, same=same)
    adamw = table(runs, "", lr=args.lr, budget=args.budget, scales=scales, seeds=args.seeds, code=code,
                  optimizer="adamw", policies=[ADASCALE], same=same)
    lines += [adamw[-1].replace("| **adascale_adam** (horizons in progress)",
                                "| AdamW (wd 0.01): adascale_adam (horizons in progress)")]
    lines += [""] + table(runs, f"## Short-budget regime: T = {SHORT_BUDGET} (S = 1 is not converged: "
                          "doubling T still gains ~12 BLEU)", lr=args.lr, budget=SHORT_BUDGET,
                          scales=scales, seeds=args.seeds, code=code, same=same)
    variants = [int(x) for x in args.variant_scales.split(",")]
    lines += [""] + table(runs, f"## adascale_adam's choices (issue #21), converged T = {args.budget}: "
                          "the default against one change each", lr=args.lr, budget=args.budget,
                          scales=[1] + variants, seeds=args.seeds, code=code,
                          policies=[ADASCALE] + VARIANTS, same=same)
    lines += [""] + table(runs, f"## adascale_adam's choices, short budget T = {SHORT_BUDGET}",
                          lr=args.lr, budget=SHORT_BUDGET, scales=[1] + variants, seeds=args.seeds,
                          code=code, policies=[ADASCALE] + VARIANTS, same=same)
    claim = [r for r in runs if ok(r) and r["policy"] == "warmup:rule=fixed,factor=5" and r["S"] == 8
             and r["budget"] == args.budget * 8 // 5 and r["lr"] == args.lr]
    if claim:
        lines += ["", "## The seed's claim as stated: x5 + warm-up at S = 8 for T / 5 steps", "",
                  "| seed | budget | BLEU | steps |", "|---|---|---|---|"]
        lines += [f"| {r['seed']} | {r['budget']} | {r['bleu']:.1f} | {r['steps']} |" for r in claim]
    lines += loss_at_equal_progress(args.budget)
    errors = [r for r in runs if "error" in r]
    if errors:
        lines += ["", "## Errors", ""] + [f"- S = {r['S']} {r['policy']} seed {r['seed']} T {r['budget']}: "
                                          f"{r['error'][:300]}" for r in errors]
    codes = sorted({r.get("code") for r in runs if ok(r) and not current_code(r, code, same)})
    shown = {(c, p, o): r for (c, p, o), r in same.items() if any(
        r2.get("code") == c and family(r2) == (p, o) for r2 in runs)}
    if shown:
        lines += ["", "## Runs of older code counted as today's (reproduced to the last bit)", "",
                  "| code | policy | optimizer | rerun at today's code (same weights, BLEU, steps) |",
                  "|---|---|---|---|"]
        lines += [f"| {c} | {p} | {o} | S = {r['S']} seed {r['seed']}: BLEU {r['bleu']:.2f}, "
                  f"{r['steps']} steps |" for (c, p, o), r in sorted(shown.items())]
    lines += ["", "![BLEU vs S](bleu_vs_scale.png)", "",
              "![adascale_adam gain and lr vs tau](bleu_adascale.png)", "",
              f"- code: {code} (hash of {', '.join(CODE)})"
              + (f"; cells marked '(older code)' ran at {', '.join(codes)}" if codes else ""),
              f"- runs: {len(runs)} stored in bleu_runs.json, dated {min((r['date'] for r in runs), default='-')}"
              f" to {max((r['date'] for r in runs), default='-')} UTC",
              f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
              f"{platform.platform()}",
              f"- rerun: `.venv/bin/python benchmarks/transformer_bleu.py --phase PHASE` for each of curve, "
              f"sweep, converged, short, claim, variants, verify (the defaults are this report's settings)"]
    (RESULTS / "bleu.md").write_text("\n".join(lines) + "\n")
    plot(runs, args, scales)


def loss_at_equal_progress(budget: int) -> list[str]:
    """Is progress counted right at scale? The training loss (rank 0's last micro-batch of each
    step, averaged over a window of tau) of each logged run at equal tau: a run at scale whose
    loss stays above S = 1's at equal tau made less progress than tau counts (over-counted)."""
    import csv

    logged = sorted((d for d in LOG_DIR.iterdir() if (d / "metrics.csv").exists()),
                    key=lambda d: d.name) if LOG_DIR.exists() else []
    if not logged:
        return []
    taus = [round(budget * f) for f in (0.1, 0.25, 0.5, 0.75, 1.0)]
    window = budget * 0.05
    lines = ["", f"## Progress at scale: training loss at equal tau (seed 0, T = {budget})", "",
             "Mean training loss over tau in (tau - 5% T, tau]: a run whose loss stays above S = 1's "
             "at equal tau made less progress than its tau counts.", "",
             "| run | " + " | ".join(f"tau {t}" for t in taus) + " |", "|---|" + "---|" * len(taus)]
    for d in logged:
        with open(d / "metrics.csv") as f:
            rows = [(float(r["progress"]), float(r["loss"])) for r in csv.DictReader(f) if r["loss"]]
        cells = []
        for t in taus:
            xs = [loss for tau, loss in rows if t - window < tau <= t + (1 if t == taus[-1] else 0) * window]
            cells.append(f"{statistics.mean(xs):.3f}" if xs else "-")
        lines.append(f"| {d.name} | " + " | ".join(cells) + " |")
    return lines


def plot(runs, args, scales):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quality_at_scale import plot_gain_and_lr

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for policy in POLICIES:
        pts = [(s, [r["bleu"] for r in cell_rows(runs, policy=policy, S=s, lr=args.lr, budget=args.budget)])
               for s in scales]
        pts = [(s, b) for s, b in pts if b]
        ax.errorbar([s for s, _ in pts], [statistics.mean(b) for _, b in pts],
                    yerr=[statistics.stdev(b) if len(b) > 1 else 0 for _, b in pts], marker="o",
                    capsize=3, label=LABELS[policy].replace("*", ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("scale S")
    ax.set_ylabel(f"held-out BLEU (T = {args.budget})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(RESULTS / "bleu_vs_scale.png", dpi=70)
    plt.close(fig)
    logged = sorted((d for d in LOG_DIR.iterdir() if (d / "metrics.csv").exists()),
                    key=lambda d: d.name) if LOG_DIR.exists() else []
    plot_gain_and_lr(logged, RESULTS / "bleu_adascale.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=["curve", "sweep", "converged", "short", "claim", "variants",
                                       "verify"], action="append",
                   default=[], help="what to run (repeatable); none: only the report")
    p.add_argument("--budget", type=int, default=2400, help="T of the converged table (from the curve)")
    p.add_argument("--lr", type=float, default=0.008, help="the baseline peak lr (from the sweep)")
    p.add_argument("--curve-lr", type=float, default=0.008, help="the lr of the S = 1 curve")
    p.add_argument("--sweep", default="0.004,0.008,0.016", help="the lr bracket at T")
    p.add_argument("--seeds", type=int, default=SEEDS)
    p.add_argument("--all-seeds", default=";".join(POLICIES),
                   help="';'-separated policies run with every seed (the others: seed 0 only)")
    p.add_argument("--policies", default="", help="';'-separated subset of the policies at S > 1")
    p.add_argument("--scales", default="1,8,32,128")
    p.add_argument("--no-adamw", dest="adamw", action="store_false", help="skip the AdamW row")
    p.add_argument("--adamw-max-scale", type=int, default=32,
                   help="the AdamW row runs every seed up to this S (seed 0 above)")
    p.add_argument("--variants", default="", help="';'-separated subset of --phase variants' "
                                                   "policies (default: all)")
    p.add_argument("--variant-scales", default="32,128",
                   help="S of --phase variants")
    p.add_argument("--variant-seeds-max-scale", type=int, default=32,
                   help="--phase variants runs every seed up to this S (seed 0 above)")
    p.add_argument("--log-scales", default="8,32,128",
                   help="adascale_adam runs (seed 0, converged) that keep a metrics log for the plot")
    p.add_argument("--timeout", type=float, default=3600, help="wall-clock limit of one run, seconds")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="start no run after this many minutes (0: no limit)")
    p.add_argument("--report-only", action="store_true", help="only rewrite bleu.md and the plots")
    p.add_argument("--any-code", action="store_true",
                   help="run only configurations with no stored run at any code (the report marks "
                        "cells of older code)")
    p.add_argument("--code", type=pathlib.Path, default=ROOT,
                   help="the checkout whose code the runs use (default: this one), copied at start")
    args = p.parse_args(argv)
    global SNAPSHOT, CODE_HASH
    if args.report_only:
        CODE_HASH = code_hash(args.code)
    else:
        SNAPSHOT, CODE_HASH = snapshot(args.code)
    runner = Runner(args)
    start = time.perf_counter()
    if not args.report_only:
        logged = {int(s) for s in args.log_scales.split(",") if s}
        for phase in args.phase:
            specs = phase_specs(args, phase)
            for s in specs:
                if phase in ("converged", "verify") and s["policy"] == ADASCALE and s["seed"] == 0 \
                        and s["scale"] in logged and s["optimizer"] == "adam":
                    s["log_dir"] = log_dir(s["policy"], s["scale"])
            runner.ensure(specs, rerun=phase == "verify")
    write_report(args, runner.runs, runner.code, time.perf_counter() - start)
    print((RESULTS / "bleu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
