"""Step timing shared by the overhead benchmarks (B2, B3, the DDP anchor, the GPU script), and
running their jobs (their result lines: hvd_scale.launch.jobs).

On a shared 2-core machine a job's speed drifts by 10-20% within a minute, so one variant's
median against another's, each over the whole job, moves with the drift. Here the variants take
turns in short rounds (the order reversed every other round, so none always follows the same
one), and a variant's ratio to the baseline is the median over rounds of the per-round ratio of
medians: both sides of each ratio are measured within a second of each other.
The interquartile range of the per-round ratios is reported with it.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import subprocess
import time
from typing import Callable, Mapping, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent


def interleave(variants: dict[str, Callable[[], object]], rounds: int, per_round: int,
               warmup: int = 10) -> dict[str, list[list[float]]]:
    """Seconds per call of each variant, by round: {name: [[t, ...] per round]}. First `warmup`
    untimed calls of each variant (allocations, autotuning, traces)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    names = list(variants)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, out = variants[name], []
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            times[name].append(out)
    return times


def summarize(times: dict[str, list[list[float]]], baseline: str,
              also: Sequence[str] = ()) -> dict[str, dict]:
    """{name: {median_ms, steps, ratio_to_<baseline>, ratio_iqr}} from ``interleave``'s times;
    the ratio is the median over rounds of (this round's median / the baseline's). Each further
    baseline of `also` that was timed adds ratio_to_<it> and iqr_to_<it> to the other variants."""
    out = {}
    for name, by_round in times.items():
        flat = [t for r in by_round for t in r]
        out[name] = {"median_ms": 1000 * statistics.median(flat), "steps": len(flat)}
    for i, b in enumerate([baseline, *(a for a in also if a in times and a != baseline)]):
        base = [statistics.median(r) for r in times[b]]
        for name, by_round in times.items():
            if name == b:
                continue
            ratios = [statistics.median(r) / m for r, m in zip(by_round, base)]
            q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            out[name][f"ratio_to_{b}"] = statistics.median(ratios)
            out[name]["ratio_iqr" if i == 0 else f"iqr_to_{b}"] = [q1, q3]
    return out


def run_job(cmd: Sequence[str], env_extra: Mapping[str, str], timeout: float = 1800) -> str:
    """A benchmark job from the repository root, one thread per process unless `env_extra`
    says otherwise; its stdout, or an error with the end of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


# -- #50's results file: one table of several engines' drivers ----------------------------------
ENGINES = ("horovod", "ddp", "keras")


def per_k(value, passes: Sequence[int], what: str) -> list[int]:
    """One int per k from "N" (every k) or "N1,N2,..." (one per k of --passes)."""
    values = [int(v) for v in str(value).split(",")]
    if len(values) == 1:
        return values * len(passes)
    if len(values) != len(passes):
        raise SystemExit(f"--{what} {value}: one value, or one per k of --passes ({len(passes)})")
    return values


def job_record(cmd: Sequence[str], env_extra: Mapping[str, str], timeout: float = 3600) -> dict:
    """One job of a driver: its stdout's RESULT rows with their wall-clock and 1-minute load
    before and after (the machine is shared; the paired ratios are what to read)."""
    import datetime

    from hvd_scale.launch.jobs import read_results

    load0, t0 = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
    out = run_job(cmd, env_extra, timeout=timeout)
    load1, t1 = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
    return {"start": f"{t0:%Y-%m-%d %H:%M:%S}", "end": f"{t1:%H:%M:%S}",
            "loadavg_1min": [round(load0[0], 2), round(load1[0], 2)],
            "rows": [r for r in read_results(out) if "model" in r]}


def drive_samples_cost(cmd: Sequence[str], env_extra: Mapping[str, str], repeats: int, out: str,
                       engine: str, command: str, baseline: str) -> int:
    """A driver's run for #50's table: ``repeats`` jobs of ``cmd`` (``job_record``), each one's
    ratios to none printed, the table rewritten after each job (a run cut short keeps its
    finished jobs: ``record_samples_cost``)."""
    jobs = []
    for i in range(repeats):
        jobs.append(job_record(cmd, env_extra))
        j = jobs[-1]
        print(f"job {i + 1}: {j['start']}-{j['end']}, load {j['loadavg_1min']}",
              {f"{r['model']}/k={r['k']}": {v: round(f["ratio_to_none"], 3) for v, f in r.items()
                                            if isinstance(f, dict) and "ratio_to_none" in f}
               for r in j["rows"]}, flush=True)
        record_samples_cost(out, engine, command, baseline, jobs)
    return 0


def record_samples_cost(out: str, engine: str, command: str, baseline: str, jobs: list) -> None:
    """Put one driver run's jobs (``job_record``s; rows with model, k and each variant's
    ratio_to_<baseline> and ratio_to_none) into results/<out>.json, beside the engine's other runs
    (a run with the same command replaces its earlier one), and rewrite results/<out>.md from
    all the engines there (#50: the cost of the statistics against k)."""
    import json
    import platform
    import subprocess as sp

    results = ROOT / "benchmarks" / "results"
    path = results / f"{out}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    head = sp.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                  text=True).stdout.strip()
    runs = data.setdefault("engines", {}).setdefault(engine, [])
    runs[:] = [r for r in runs if r["command"] != command]
    runs.append({"command": command, "baseline": baseline, "code": head, "jobs": jobs})
    data["machine"] = f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.platform()}"
    summary = {}
    for eng in ENGINES:
        for key, variants in _collect(data["engines"].get(eng, [])).items():
            for v, by in variants.items():
                summary.setdefault(eng, {})[f"{key[0]}/k={key[1]}/{v}"] = by
    data["summary"] = summary
    path.write_text(json.dumps(data, indent=1) + "\n")
    (results / f"{out}.md").write_text(render_samples_cost(data))


def _collect(runs: list) -> dict:
    """{(model, k): {variant: {"to_none": [per job], "to_plain": [...], "plain_ms": [...]}}}."""
    table: dict = {}
    for e in runs:
        base = e["baseline"]
        for r in (r for j in e["jobs"] for r in j["rows"]):
            key = (r["model"], r.get("k", r.get("passes", 1)))
            for v, fig in r.items():
                if not isinstance(fig, dict) or "median_ms" not in fig or v == base:
                    continue
                cell = table.setdefault(key, {}).setdefault(v, {"to_none": [], "to_plain": [],
                                                                "plain_ms": [], "ms": []})
                if "ratio_to_none" in fig:
                    cell["to_none"].append(fig["ratio_to_none"])
                cell["to_plain"].append(fig[f"ratio_to_{base}"])
                cell["plain_ms"].append(r[base]["median_ms"])
                cell["ms"].append(fig["median_ms"])
    return table


def _cell(values: list) -> tuple[str, str]:
    if not values:
        return "-", "-"
    med = statistics.median(values)
    return (f"{med:.3f} [" + ", ".join(f"{v:.3f}" for v in values) + "]",
            f"{max(values) - min(values):.3f}")


def render_samples_cost(data: dict) -> str:
    names = {"horovod": "Horovod (horovodrun -np 2 --gloo, Horovod's default 1 ms cycle)",
             "ddp": "DDP (torchrun --nproc-per-node 2, Gloo)",
             "keras": "Keras 3 (horovodrun -np 2 --gloo, TensorFlow backend)"}
    lines = ["# #50: the cost of AdaScale's statistics against k, per-worker (default) and "
             "per-pass samples", "",
             "Paired step times (benchmarks/timing.py): in each job the variants take turns round "
             "by round, each a model of its own from the same weights; a variant's ratio is the "
             "median over rounds of (its round median / the baseline's round median). Median over "
             "the jobs, each job's ratio in brackets, spread = max - min over the jobs. A step is "
             "k forward/backward passes on fixed micro-batches (batch 32 per worker and pass) and "
             "one optimizer step; 2 workers, one thread each, CPU.", "",
             "Variants: `none` the adapter with policy none (no statistics); `adascale` policy "
             "adascale with the default samples ('auto': per-worker statistics from two workers "
             "on, read once per step where the gradient is sent); `adascale/passes` the same with "
             "samples='passes' (the per-pass estimator, a tensor hook per parameter per pass); "
             "`adascale_adam` and `adascale_adam/passes` likewise on `transformer_adam` (B4's "
             "Transformer with Adam as the inner optimizer for every variant, plain included). "
             "`plain` is the engine without hvd_scale: `hvd.DistributedOptimizer`, plain DDP "
             "(its `no_sync()` idiom at k > 1), or a Keras tf.function step with "
             "`hvd.grouped_allreduce` (k - 1 accumulating calls, then allreduce + apply). "
             "`plain ms` and `/ plain` are against that baseline (plain DDP for the ddp rows).", ""]
    lines += ["## Rerun", ""]
    for eng in ENGINES:
        for e in data.get("engines", {}).get(eng, []):
            lines.append(f"- {names[eng]}: `{e['command']}` (code {e['code']})")
    lines += ["", "## When, and the load", "",
              "The 1-minute load average before and after each job (2 cores; the job's own 2 "
              "processes count in it; above ~2.5 other work shared the cores, which moves the "
              "absolute milliseconds, not much the paired ratios).", "",
              "| engine | models, k | job | UTC | load before / after |", "|---|---|---|---|---|"]
    for eng in ENGINES:
        for e in data.get("engines", {}).get(eng, []):
            for i, j in enumerate(e["jobs"]):
                what = ", ".join(sorted({r["model"] for r in j["rows"]})) + "; k = " + \
                    ", ".join(str(k) for k in sorted({r.get("k", 1) for r in j["rows"]}))
                lines.append(f"| {eng} | {what} | {i + 1} | {j['start']}-{j['end']} | "
                             f"{j['loadavg_1min'][0]} / {j['loadavg_1min'][1]} |")
    if data.get("load_note"):
        lines += ["", data["load_note"]]
    lines += ["", "## Ratios", "",
              "| engine | model | k | variant | plain ms | / none | spread | / plain | spread |",
              "|---|---|---|---|---|---|---|---|---|"]
    for eng in ENGINES:
        table = _collect(data.get("engines", {}).get(eng, []))
        for key in sorted(table, key=lambda kk: (kk[0], kk[1])):
            for v, c in table[key].items():
                n, ns = _cell(c["to_none"])
                p, ps = _cell(c["to_plain"])
                lines.append(f"| {eng} | {key[0]} | {key[1]} | {v} | "
                             f"{statistics.median(c['plain_ms']):.1f} | {n} | {ns} | {p} | {ps} |")
    for part in data.get("partial", []):  # a run stopped before its driver wrote a job's rows
        lines += ["", f"### {part['title']}", "", part["text"], "",
                  "| engine | model | k | " + " | ".join(f"{v} / none" for v in part["variants"]) + " |",
                  "|---|---|---|" + "---|" * len(part["variants"])]
        for key, by in part["ratios_to_none"].items():
            model, k = key.split("/k=")
            lines.append(f"| {part['engine']} | {model} | {k} | "
                         + " | ".join(f"{by[v]:.3f}" if v in by else "-" for v in part["variants"]) + " |")
    if data.get("verdict"):
        lines += ["", "## Verdict against #50's targets", "", data["verdict"]]
    lines += ["", f"- machine: {data.get('machine', '?')}"]
    return "\n".join(lines) + "\n"
