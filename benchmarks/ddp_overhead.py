"""#49: the DDP engine's cost: hvd_scale's torch.distributed optimizer against plain DDP (Gloo, CPU).

    .venv/bin/python benchmarks/ddp_overhead.py --repeats 3          # 3 torchrun jobs
    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/ddp_overhead.py   # one job

#50 (the statistics' cost against k, per-worker and per-pass samples; 3 torchrun jobs, written
beside the other engines into results/samples_cost, the driver recording after each job; ~6
minutes on a quiet 2-core machine):

    .venv/bin/python benchmarks/ddp_overhead.py --repeats 3 --out samples_cost \
        --models mlp,transformer_adam --passes 1,4,16,64 --steps 60,24,6,3 --rounds 10,6,6,3 \
        --warmup 2,1,1,1 \
        --variants ddp,none,adascale,adascale/passes,adascale_adam,adascale_adam/passes

Run without torchrun, the script is the driver: it starts ``--repeats`` jobs of itself under
``torchrun --standalone --nproc-per-node 2`` (one thread per process, fairscale on the
PYTHONPATH when ~/.cache/hvd_scale/fairscale-0.4.13 holds it: benchmarks/overhead.py installs it
there) and writes benchmarks/results/<out>.md and .json. Under torchrun it is one job:

For each model of benchmarks/torch_overhead.py (the 1-D CNN, the 120-tensor MLP, the 2-D CNN,
B4's Transformer) and each k of ``--passes`` (1 and 4), the variants, each a DDP model of its
own from the same weights, take turns round by round in the job (benchmarks/timing.py: the
ratios are paired round by round):

    ddp        plain DDP + torch.optim.SGD(momentum 0.9), no hvd_scale (at k > 1: the first
               k - 1 passes under ``model.no_sync()``, each pass's loss / k: DDP's idiom)
    none       hvd_scale.adapters.torch.ddp.DistributedOptimizer(SGD, model, policy="none",
               backward_passes_per_step=k) (the same no_sync passes, each micro-batch's loss)
    adascale   the same with policy="adascale" (samples "auto": per-worker statistics from two
               workers on, read in the comm hook at the synchronizing pass)
    adascale/passes   the same with samples="passes" (a tensor hook per parameter per pass; #50)
    adascale_adam[/passes]   policy adascale_adam, on Adam's models (transformer_adam: B4's
               Transformer with Adam as every variant's inner optimizer) in place of adascale
    fairscale  fairscale 0.4.13's AdaScale(SGD) over DDP, at k = 1 only, where importable

A step is zero_grad, k x (forward, backward) on the rank's k fixed micro-batches, step.
Reported per (model, k): median step time of each variant and its ratio to plain DDP (median
over rounds of the per-round ratio of medians, with the interquartile range of those ratios).

Quality checks after the timed steps (every variant has then taken the same number of steps
on the same micro-batches): ``none`` against plain DDP, relative L2 distance of the weights
(the same update up to float rounding: DDP's sum of the k passes' loss / k against hvd_scale's
mean of the micro-gradients); each variant's loss on its rank's first micro-batch; adascale's
and fairscale's gain. Rank 0 prints one ``RESULT {json}`` line per (model, k).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BIN = pathlib.Path(sys.executable).parent
FAIRSCALE = pathlib.Path.home() / ".cache" / "hvd_scale" / "fairscale-0.4.13"
MODELS = ["cnn", "mlp", "cnn2d", "transformer"]
VARIANTS = ["ddp", "none", "adascale", "fairscale"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

# B2, the Horovod engine, measured apart (not rerun here): adascale / plain hvd.DistributedOptimizer,
# 3 paired jobs each, code daa9c3e (before the DDP engine's commit 2e671b1), and the DDP anchor.
B2_CITED = """\
## The Horovod engine and fairscale, cited (B2, not rerun here)

The Horovod engine's adascale against plain `hvd.DistributedOptimizer` (horovodrun -np 2, Gloo,
Horovod's default 1 ms cycle; median of 3 paired jobs, each job's ratio in brackets), from
[overhead_31.md](overhead_31.md) (k = 1, 2026-12-04 04:08 UTC) and
[overhead_31_k4.md](overhead_31_k4.md) (k = 4, CNN and MLP only, 2026-12-04 04:27 UTC), both at
code daa9c3e, before this engine existed; fairscale's AdaScale over DDP against plain DDP from
[overhead.md](overhead.md) (2026-11-30, 3 jobs; k = 1):

| model | Horovod adascale / plain, k = 1 | Horovod adascale / plain, k = 4 | fairscale / DDP (B2, 2026-11-30) |
|---|---|---|---|
| cnn | 1.019 [1.010, 1.019, 1.019] | 1.012 [0.961, 1.012, 1.064] | 1.044 |
| mlp | 1.025 [1.025, 1.002, 1.159] | 1.338 [1.277, 1.338, 1.430] | 1.450 |
| cnn2d | 1.029 [1.029, 1.092, 0.995] | not run | 1.089 |
| transformer | 1.063 [1.063, 1.073, 0.975] | not run | 1.069 |
"""


# -- one job (under torchrun) -------------------------------------------------------------------
def ddp_step(kind, model, opt, xs, ys, k, loss_fn) -> None:
    """One step of k passes on a DDP model, the first k - 1 under ``no_sync()`` (also
    benchmarks/gpu.py's): plain DDP ("ddp") takes the mean of the passes' losses, hvd_scale's
    optimizer each micro-batch's mean loss (it averages over the passes itself)."""
    divide = kind == "ddp" and k > 1
    opt.zero_grad()
    for j in range(k):
        with model.no_sync() if j < k - 1 else contextlib.nullcontext():
            loss = loss_fn(model(xs[j]), ys[j])
            (loss / k if divide else loss).backward()
    opt.step()


def job(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvd_scale.adapters.torch.ddp import DistributedOptimizer
    from hvd_scale.launch.jobs import print_result
    from torch_overhead import inner_optimizer, kinds_for, model_spec, variant_kind

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        from fairscale.optim import AdaScale
    except ImportError:
        AdaScale = None
    loss_fn = torch.nn.CrossEntropyLoss()

    passes = [int(v) for v in args.passes.split(",")]
    steps_k, warmup_k, rounds_k = (timing.per_k(getattr(args, w), passes, w)
                                   for w in ("steps", "warmup", "rounds"))
    for name in args.models.split(","):
        build, shape, inner = model_spec(name)
        for ik, k in enumerate(passes):
            kinds = [v for v in kinds_for(name, args.variants.split(","))
                     if v != "fairscale" or (k == 1 and AdaScale is not None and inner == "sgd")]
            variants = {}
            for kind in kinds:
                torch.manual_seed(0)
                model = DDP(build())
                opt = inner_optimizer(model, inner)
                if kind == "fairscale":
                    opt = AdaScale(opt)
                elif kind != "ddp":
                    policy, samples = variant_kind(kind)
                    opt = DistributedOptimizer(opt, model, policy=policy, backward_passes_per_step=k,
                                               samples=samples)
                variants[kind] = (model, opt)
            g = torch.Generator().manual_seed(1000 + rank)
            xs = [torch.randn(args.batch, *shape, generator=g) for _ in range(k)]
            ys = [torch.randint(0, 10, (args.batch,), generator=g) for _ in range(k)]

            def step_of(kind, model, opt, k=k, xs=xs, ys=ys):
                return lambda: ddp_step(kind, model, opt, xs, ys, k, loss_fn)

            steps, rounds, warmup = steps_k[ik], min(rounds_k[ik], steps_k[ik]), warmup_k[ik]
            per_round = max(1, steps // rounds)
            t0 = time.perf_counter()
            times = timing.interleave({kind: step_of(kind, *v) for kind, v in variants.items()},
                                      rounds, per_round, warmup)
            summary = timing.summarize(times, kinds[0], also=("none",))
            wall = time.perf_counter() - t0

            def flat(model):
                return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])

            checks = {}
            with torch.no_grad():
                for kind, (model, _) in variants.items():
                    checks[f"loss_{kind}"] = float(loss_fn(model(xs[0]), ys[0]))
                if "ddp" in variants and "none" in variants:
                    a, b = flat(variants["ddp"][0]), flat(variants["none"][0])
                    start = flat(_initial(build, torch))
                    checks["none_vs_ddp_weights_rel"] = float((a - b).norm() / (a - start).norm())
            for kind in variants:
                if kind.startswith("adascale"):
                    checks[f"gain_{kind}"] = float(variants[kind][1].gain)
                    checks[f"scale_{kind}"] = float(variants[kind][1].scale)
            if "fairscale" in variants:
                checks["gain_fairscale"] = float(variants["fairscale"][1].gain())
            first = variants[kinds[0]][0].module
            out = {"model": name, "k": k, "workers": world, "batch": args.batch,
                   "params": sum(p.numel() for p in first.parameters()),
                   "tensors": sum(1 for _ in first.parameters()),
                   "inner": inner, "steps_each": warmup + rounds * per_round, "rounds": rounds,
                   "wall_s": wall, **summary, "checks": checks}
            if rank == 0:
                print_result({"rank": 0, **out})
            del variants
    dist.destroy_process_group()
    return 0


def _initial(build, torch):
    """The variants' starting weights (the same seed), for the weights' relative distance."""
    torch.manual_seed(0)
    return build()


# -- the driver: --repeats jobs, the report ------------------------------------------------------
def _each(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _git(*cmd) -> str:
    try:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def drive(args, argv) -> int:
    from hvd_scale.launch.jobs import read_results

    env = {}
    if (FAIRSCALE / "fairscale").exists():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAIRSCALE), os.environ.get("PYTHONPATH")) if p)
    job_args = ["--models", args.models, "--passes", args.passes, "--variants", args.variants,
                "--steps", str(args.steps), "--rounds", str(args.rounds),
                "--warmup", str(args.warmup), "--batch", str(args.batch)]
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "benchmarks/ddp_overhead.py", *job_args]
    code = {"head": _git("rev-parse", "--short", "HEAD"),
            "ddp.py uncommitted": bool(_git("status", "--porcelain", "adapters/torch/ddp.py"))}
    if args.out != "ddp_overhead":  # #50's table (timing.record_samples_cost)
        return timing.drive_samples_cost(
            cmd, env, args.repeats, args.out, "ddp",
            f".venv/bin/python benchmarks/ddp_overhead.py {shlex.join(argv)}", "ddp")
    jobs = []
    for i in range(args.repeats):
        load0, t0 = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
        out = timing.run_job(cmd, env, timeout=3600)
        load1, t1 = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
        rows = [r for r in read_results(out) if "model" in r]
        jobs.append({"start": f"{t0:%Y-%m-%d %H:%M:%S}", "end": f"{t1:%H:%M:%S}",
                     "loadavg_1min": [round(load0[0], 1), round(load1[0], 1)], "rows": rows})
        print(f"job {i + 1}: {t0:%H:%M:%S}-{t1:%H:%M:%S}, load {load0[0]:.1f} -> {load1[0]:.1f}",
              {f"{r['model']}/k={r['k']}": {v: round(r[v]["ratio_to_ddp"], 3)
                                            for v in VARIANTS if v in r and v != "ddp"}
               for r in rows}, flush=True)

    keys = [(r["model"], r["k"]) for r in jobs[0]["rows"]]
    by = [{(r["model"], r["k"]): r for r in j["rows"]} for j in jobs]
    first = jobs[0]["rows"]
    lines = [
        "# #49: the DDP engine against plain DDP (torch.distributed, Gloo, 2 processes, CPU)", "",
        f"Rerun: `.venv/bin/python benchmarks/ddp_overhead.py {shlex.join(argv)}`".rstrip(), "",
        f"Step time (zero_grad, k x (forward, backward), step), {first[0]['steps_each']} steps per "
        f"variant per (model, k) after {args.warmup} of warm-up, the variants taking turns in "
        f"{args.rounds} rounds inside each job; ratios to plain DDP paired round by round "
        "(benchmarks/timing.py), median over rounds; each job's ratio in brackets, the spread is "
        "max - min over the jobs. `torchrun --standalone --nproc-per-node 2`, one torch thread "
        f"per process, batch {args.batch} per worker and pass. plain DDP: `torch.optim.SGD` "
        "(momentum 0.9) on a `DistributedDataParallel` model, the first k - 1 passes under "
        "`no_sync()`; none / adascale: `hvd_scale.adapters.torch.ddp.DistributedOptimizer` over the "
        "same; fairscale: fairscale 0.4.13's `AdaScale` over DDP (k = 1 only).", "",
        "The 1-minute load average before and after each job is listed below (2 cores; the "
        "job's own 2 processes count in it: above ~2.5, other work shared the cores and the "
        "absolute milliseconds move between jobs); the paired ratios are what to read.", "",
        "| model | k | DDP ms (job 1) | none / DDP | spread | adascale / DDP | spread | fairscale / DDP | spread |",
        "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for key in keys:
        cells = []
        for v in ("none", "adascale", "fairscale"):
            ratios = [b[key][v]["ratio_to_ddp"] for b in by if v in b.get(key, {})]
            if not ratios:
                cells += ["-", "-"]
                continue
            med = statistics.median(ratios)
            summary.setdefault(f"{key[0]}/k={key[1]}", {})[v] = {"median": med, "jobs": ratios}
            cells += [f"{med:.3f} {_each(ratios)}", f"{max(ratios) - min(ratios):.3f}"]
        lines.append(f"| {key[0]} | {key[1]} | {by[0][key]['ddp']['median_ms']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "Each job's figures:", "",
              "| job | when (UTC) | load 1 min before / after | model | k | DDP ms | none ms | adascale ms | fairscale ms | none / DDP IQR | adascale / DDP IQR |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, j in enumerate(jobs):
        for r in j["rows"]:
            ms = [f"{r[v]['median_ms']:.1f}" if v in r else "-" for v in VARIANTS]
            iqr = [("[" + ", ".join(f"{q:.3f}" for q in r[v]["ratio_iqr"]) + "]") if v in r else "-"
                   for v in ("none", "adascale")]
            lines.append(f"| {i + 1} | {j['start']}-{j['end']} | {j['loadavg_1min'][0]} / {j['loadavg_1min'][1]} | "
                         f"{r['model']} | {r['k']} | " + " | ".join(ms) + " | " + " | ".join(iqr) + " |")
    lines += ["", "Quality checks (after the timed steps, each job): `none` against plain DDP, "
              "|w_none - w_ddp| / |w_ddp - w_0| (the same update up to float rounding); the loss "
              "on rank 0's first micro-batch; adascale's gain (of S = 2k) and fairscale's:", "",
              "| job | model | k | none vs DDP weights | loss DDP | loss none | loss adascale | loss fairscale | gain adascale | gain fairscale |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for i, j in enumerate(jobs):
        for r in j["rows"]:
            c = r["checks"]

            def f(key, fmt="{:.4f}"):
                return fmt.format(c[key]) if key in c else "-"
            lines.append(f"| {i + 1} | {r['model']} | {r['k']} | {f('none_vs_ddp_weights_rel', '{:.1e}')} | "
                         f"{f('loss_ddp')} | {f('loss_none')} | {f('loss_adascale')} | {f('loss_fairscale')} | "
                         f"{f('gain_adascale', '{:.3f}')} | {f('gain_fairscale', '{:.3f}')} |")
    lines += ["", B2_CITED,
              f"- code: {code['head']}" + (" (adapters/torch/ddp.py had uncommitted changes in the "
                                            "shared tree)" if code["ddp.py uncommitted"] else ""),
              f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, {platform.platform()}",
              f"- fairscale: {'0.4.13 from ' + str(FAIRSCALE).replace(str(pathlib.Path.home()), '~') if env else 'not importable: no fairscale column'}"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps(
        {"command": f".venv/bin/python benchmarks/ddp_overhead.py {shlex.join(argv)}".rstrip(),
         "code": code, "summary": summary, "jobs": jobs}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    p.add_argument("--passes", default="1,4", help="values of k, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, the first the baseline (ddp); fairscale at k = 1 only")
    p.add_argument("--steps", default="120",
                   help="measured steps per variant per (model, k): one, or one per k")
    p.add_argument("--rounds", default="20", help="interleaving rounds (one, or one per k)")
    p.add_argument("--warmup", default="10", help="untimed steps (one, or one per k)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="driver: torchrun jobs")
    p.add_argument("--out", default="ddp_overhead",
                   help="driver: results/<out>.md and .json; a name other than ddp_overhead: "
                        "#50's table (timing.record_samples_cost)")
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # started by torchrun: one job
        return job(args)
    return drive(args, argv)


if __name__ == "__main__":
    sys.exit(main())
