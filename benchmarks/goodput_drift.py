"""The step-time model at k = 8, term by term: which term drifted since B5 (goodput_tta.md) was
measured (issue 61 item 3: "the model now predicts k = 8 16-29% slower than measured").

    .venv/bin/python benchmarks/goodput_drift.py --code HEAD,ca393a8 [--samples workers,passes]

For each code revision (``git archive`` of it, laid out as it installs, as B4's snapshot) and each
``$HVD_SCALE_SAMPLES`` setting: B5's task A (B4's Transformer, 2 workers, Gloo, adascale_adam,
one thread each) at fixed k = 1, 2, 8 for ``--budget`` baseline steps, each step's timing columns
from the metrics log (means after the warm-up): one pass timed alone (k >= 2), the step's own
work outside its passes (o = compute - k x one pass), the allreduce wait, the update, the step.
The model fitted to the k = 1 run as B5 fits it (``goodput_tta.timings``) predicts the others;
the model fitted to all of a run's rows (as adapt's clock would once it has seen k >= 2) beside.
Writes benchmarks/results/goodput_drift.json and .md (each run with uptime's load and the
machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BIN = pathlib.Path(sys.executable).parent
WARMUP_STEPS = 5
COLUMNS = ("passes", "pass_time", "overhead_time", "allreduce_time", "update_time", "step_time")


def machine() -> str:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo")
                  if line.startswith("flags")), [])
    isa = ",".join(f for f in ("avx2", "avx512f", "amx_tile") if f in flags) or "no avx2"
    return (f"{os.cpu_count()} CPUs ({model}; {isa}), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads here; 1 per worker in the runs), "
            f"{platform.platform()}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def snapshot(rev: str, into: pathlib.Path) -> pathlib.Path:
    """The package at ``rev`` as it installs (hvd_scale/ with adapters/ and launch/ inside), and
    its examples/, under ``into``: for PYTHONPATH."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    code = into / "code"
    shutil.copytree(tree / "hvd_scale", code / "hvd_scale")
    for sub in ("adapters", "launch"):
        shutil.copytree(tree / sub, code / "hvd_scale" / sub)
    shutil.copytree(tree / "examples", code / "examples")
    return code


def run(code: pathlib.Path, k: int, budget: int, seed: int, samples: str | None,
        log: pathlib.Path) -> dict:
    args = [str(BIN / "python"), str(pathlib.Path(__file__).resolve()), "--job",
            str(code / "examples" / "torch_translate.py"), "--policy",
            "adascale_adam", "--seed", str(seed), "--lr", "0.008", "--budget", str(budget),
            "--accumulate", str(k), "--batch-size", "32", "--log-every", "0"]
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "5",
           "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(code),
           "HVD_SCALE_LOG_DIR": str(log)}
    env.pop("HVD_SCALE_SAMPLES", None)
    env.pop("HVD_SCALE_LOG_EVERY", None)
    if samples:
        env["HVD_SCALE_SAMPLES"] = samples
    before = load()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=code,
                          start_new_session=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    probe = next(json.loads(line[line.index(MARK) + len(MARK):]) for line in proc.stdout.splitlines()
                 if MARK in line)
    return {"wall": time.perf_counter() - start, "load_before": before, "load_after": load(),
            **summarize(probe)}


# -- inside the job: the step clock's stamps in wall and thread-CPU seconds, and the per-step
# work the model cannot see at k = 1 timed by function -------------------------------------------
MARK = "DRIFT_PROBE "
TIMED = {  # (module, class): (method, label): time (wall, this thread's CPU) summed per step
    # today's torch engines (3abecb5 on): the step's statistics and Horovod's engine apart
    ("hvd_scale.adapters.torch.statistics", "StepStatistics"): (("take_norms", "stats"),),
    ("hvd_scale.adapters.torch.horovod", "HorovodEngine"): (("_flush_bucket", "flush"),),
    ("hvd_scale.adapters.torch.horovod", "DistributedOptimizer"): (("zero_grad", "zero_grad"),
                                                                   ("log_loss", "log")),
    # before: one DistributedOptimizer class (B5's code, ca393a8)
    ("hvd_scale.adapters.torch.optimizer", "DistributedOptimizer"): (
        ("_take_norms", "stats"), ("_flush_bucket", "flush"), ("zero_grad", "zero_grad"),
        ("log_loss", "log")),
}
HOOKS = (("hvd_scale.adapters.torch.statistics", "StepStatistics", "_norm_hook"),
         ("hvd_scale.adapters.torch.optimizer", "DistributedOptimizer", "_make_norm_hook"))


def job(argv: list[str]) -> None:
    import atexit
    import importlib
    import runpy

    # The clock the adapters use, wherever it is defined (core.py before 444f7d7, adapt.py since):
    # asked of core, which imports it, so an older snapshot is never patched through the
    # installed tree's newer module.
    clocks = [importlib.import_module("hvd_scale.adapters.core").StepClock]
    now = lambda: (time.perf_counter(), time.thread_time())  # noqa: E731
    state = {"stamps": {}, "passes": [], "sums": {}, "rows": []}

    def stamp(cls, name):
        original = getattr(cls, name, None)
        if original is None:
            return

        def stamped(self, *a, **kw):
            t = now()
            if name == "pass_started":
                state["passes"].append(t)
            else:
                state["stamps"][name] = t
            if name == "ended":
                close_step(t)
            return original(self, *a, **kw)
        setattr(cls, name, stamped)

    def close_step(end):
        st, prev = state["stamps"], state.get("end")
        if prev is not None and "waiting" in st and "waited" in st:
            row = {"compute": [st["waiting"][i] - prev[i] for i in (0, 1)],
                   "wait": [st["waited"][i] - st["waiting"][i] for i in (0, 1)],
                   "update": [end[i] - st["waited"][i] for i in (0, 1)],
                   "passes_seen": len(state["passes"])}
            ps = state["passes"]
            if len(ps) >= 2:
                row["one_pass"] = [(ps[-1][i] - ps[0][i]) / (len(ps) - 1) for i in (0, 1)]
            row.update({f: v for f, v in state["sums"].items()})
            state["rows"].append(row)
        state["end"], state["stamps"], state["passes"], state["sums"] = end, {}, [], {}

    for cls in clocks:
        for name in ("pass_started", "waiting", "waited", "ended"):
            stamp(cls, name)

    def timed(original, label):
        def wrapper(*a, **kw):
            t = now()
            try:
                return original(*a, **kw)
            finally:
                e = now()
                acc = state["sums"].setdefault(label, [0.0, 0.0, 0])
                acc[0] += e[0] - t[0]
                acc[1] += e[1] - t[1]
                acc[2] += 1
        return wrapper

    for (module, cls_name), methods in TIMED.items():
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            continue
        for method, label in methods:
            if hasattr(cls, method):
                setattr(cls, method, timed(getattr(cls, method), label))
    for module, cls_name, method in HOOKS:  # the per-pass norm hooks: each call timed as stats
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            continue
        if method in cls.__dict__:
            make = cls.__dict__[method]
            setattr(cls, method,
                    lambda self, *a, _make=make, **kw: timed(_make(self, *a, **kw), "stats"))

    def report():
        if os.environ.get("HOROVOD_RANK", "0") == "0":
            print(MARK + json.dumps({"rows": state["rows"]}), flush=True)
    atexit.register(report)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def summarize(probe: dict) -> dict:
    """Means over the steps after the warm-up of each term, wall ('') and thread CPU ('_cpu'):
    compute, one pass (k >= 2), o = compute - k x one pass, wait, update, step, and the timed
    functions per step."""
    rows = probe["rows"][WARMUP_STEPS:]
    out = {"steps": len(rows)}
    keys = sorted({key for r in rows for key in r if key != "passes_seen"})
    for i, suffix in enumerate(("", "_cpu")):
        for key in keys:
            vals = [r[key][i] if key in r else 0.0 for r in rows]
            if key == "one_pass" and not all(key in r for r in rows):
                continue
            out[key + suffix] = float(np.mean(vals))
            out[key + suffix + "_median"] = float(np.median(vals))
        step = [r["compute"][i] + r["wait"][i] + r["update"][i] for r in rows]
        out["step" + suffix], out["step" + suffix + "_median"] = float(np.mean(step)), float(np.median(step))
    out["passes"] = float(np.mean([r["passes_seen"] for r in rows]))
    return out


def predict(k1: dict, k: int, suffix: str = "") -> float:
    """B5's model fitted to the k = 1 run: o = 0 (one k, no pass timed alone), c = compute."""
    return k * k1["compute" + suffix] + k1["wait" + suffix] + k1["update" + suffix]


def predict_apart(k1: dict, k: int, suffix: str = "") -> float:
    """Today's model fitted to the k = 1 run: the statistics' read (timed apart) a step's cost,
    k (compute - s) + s + a + u."""
    s = k1.get("stats" + suffix, 0.0)
    return k * (k1["compute" + suffix] - s) + s + k1["wait" + suffix] + k1["update" + suffix]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--job"]:
        job(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--code", default="HEAD,ca393a8", help="comma-separated git revisions")
    p.add_argument("--samples", default="", help="comma-separated $HVD_SCALE_SAMPLES values "
                   "('' = unset); 'passes' reads each pass's norm, 'workers' each worker's sum")
    p.add_argument("--passes", default="1,2,8")
    p.add_argument("--budget", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="rounds of all configurations")
    p.add_argument("--out", default="goodput_drift")
    p.add_argument("--report-only", action="store_true", help="the .md from the stored .json")
    args = p.parse_args(argv)
    store = RESULTS / f"{args.out}.json"
    out = json.loads(store.read_text()) if store.exists() else {"runs": []}
    if args.report_only:
        report(out)
        return 0
    out["machine"], out["name"] = machine(), args.out
    work = pathlib.Path(tempfile.mkdtemp(prefix="g_drift-"))
    try:
        codes = {rev: snapshot(rev, work / rev.replace("/", "_")) for rev in args.code.split(",")}
        shas = {rev: subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, text=True,
                                    capture_output=True, check=True).stdout.strip() for rev in codes}
        for rep in range(args.repeats):
            for rev, code in codes.items():
                for samples in args.samples.split(","):
                    for k in (int(x) for x in args.passes.split(",")):
                        r = run(code, k, args.budget, args.seed, samples or None,
                                work / f"log-{rev}-{samples}-{k}-{rep}")
                        r.update(code=shas[rev], samples=samples or "auto", k=k, budget=args.budget,
                                 seed=args.seed, date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}")
                        out["runs"].append(r)
                        print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.setdefault("commands", []).append("benchmarks/goodput_drift.py " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    store.write_text(json.dumps(out, indent=1) + "\n")
    report(out)
    return 0


def ms(x) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{1e3 * x:.1f}"


def report(out: dict) -> None:
    lines = ["# The step-time model's terms at k = 1, 2, 8 (B5's task A), by code and samples", "",
             "B4's Transformer, 2 workers (horovodrun, Gloo, HOROVOD_CYCLE_TIME=5, 1 thread each), "
             "adascale_adam, seed 0, rank 0; means over the steps after the first 5, in ms, of "
             "wall time and (second row) of the main thread's CPU time (time.thread_time: what "
             "load on the machine inflates least). compute = the previous step's end to the "
             "allreduce wait (o + k c); one pass = first gradient to first gradient (k >= 2; the "
             "clock stamps it since 517607f); o = compute - k x one pass; stats = the statistics' "
             "norm reads (per worker: `_take_norms` in the buckets; per pass: the norm hooks); "
             "log = `log_loss` (the metrics row); sends = Horovod's enqueue of the buckets. "
             "Predicted: B5's model fitted to the same code's k = 1 run (o = 0: k (o + c) + a + u); "
             "with s apart: the model since b8a30b3, the once-a-step read kept a step's cost "
             "(k (compute - s) + s + a + u). The CPU rows' wait is Horovod's synchronize polling "
             "(CPU spent waiting), so compare the CPU rows on compute.", "",
             "| date | load | code | samples | k | steps | time | compute | one pass | o | stats | log | "
             "zero_grad | sends | wait | update | step | predicted from k = 1 | error | with s apart | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    runs = out["runs"]
    for i, r in enumerate(runs):
        base = next((b for b in reversed(runs[:i + 1]) if b["k"] == 1 and b["code"] == r["code"]
                     and b["samples"] == r["samples"] and b["budget"] == r["budget"]), None)
        for suffix, what in (("", "wall"), ("_cpu", "CPU")):
            g = lambda key: r.get(key + suffix)  # noqa: E731
            one = g("one_pass")
            o = g("compute") - r["k"] * one if one is not None else None
            stats = g("stats") or 0.0
            sends = g("flush") - (g("stats") or 0.0) if g("flush") and r["samples"] != "passes" else None
            pred = predict(base, r["k"], suffix) if base else float("nan")
            err = 100 * (pred - g("step")) / g("step")
            apart = predict_apart(base, r["k"], suffix) if base else float("nan")
            lines.append(
                f"| {r['date'] if not suffix else ''} | {r['load_before'] if not suffix else ''} | "
                f"{r['code']} | {r['samples']} | {r['k']} | {r['steps']} | {what} | {ms(g('compute'))} | "
                f"{ms(one)} | {ms(o)} | {ms(stats)} | {ms(g('log'))} | {ms(g('zero_grad'))} | "
                f"{ms(sends)} | {ms(g('wait'))} | {ms(g('update'))} | {ms(g('step'))} | {ms(pred)} | "
                f"{err:+.0f}% | {ms(apart)} | {100 * (apart - g('step')) / g('step'):+.0f}% |")
    lines += ["", f"- machine: {out['machine']}", *(f"- `.venv/bin/python {c}`" for c in out["commands"])]
    (RESULTS / f"{out.get('name', 'goodput_drift')}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
