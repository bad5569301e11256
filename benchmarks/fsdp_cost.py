"""The FSDP2 engine's cost: hvd_scale's FSDP2 optimizer against plain FSDP2 (``fully_shard``, Gloo,
CPU), paired round by round in the same torchrun job (benchmarks/ddp_overhead.py's design).

    .venv/bin/python benchmarks/fsdp_cost.py --repeats 3                       # 3 torchrun jobs
    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_cost.py   # one job

Run without torchrun, the script is the driver: ``--repeats`` jobs of itself under
``torchrun --standalone --nproc-per-node 2`` (one thread per process), then
benchmarks/results/<out>.md and .json (rewritten after each job: a run cut short keeps its
finished jobs). Under torchrun it is one job:

For each model of benchmarks/torch_overhead.py (the 1-D CNN, the 120-tensor MLP, B4's
Transformer; ``transformer_adam``: the Transformer with Adam) and each k of ``--passes``, the
variants, each an FSDP2 model of its own from the same weights, take turns round by round:

    fsdp       plain FSDP2 + torch.optim.SGD(momentum 0.9) (Adam on transformer_adam), no
               hvd_scale: the first k - 1 passes under ``set_requires_gradient_sync(False)``,
               each pass's loss / k
    none       hvd_scale.adapters.torch.fsdp.DistributedOptimizer(the same, model,
               policy="none", backward_passes_per_step=k) (the same passes, each micro-batch's
               mean loss)
    adascale   the same with policy="adascale" (samples "auto": each worker's sum read once)
    adascale_adam   policy adascale_adam on Adam's model (refused by the FSDP2 engine today:
               reported as refused, with its reason, not timed)

FSDP2 units: ``fully_shard`` on each child of the Sequential models that holds parameters (the
MLP: 60 units, 120 tensors) and on each encoder and decoder layer of the Transformer, then on the
model. A step is zero_grad, k x (forward, backward) on the rank's k fixed micro-batches, step.
Reported per (model, k): each variant's median step time and its ratio to plain FSDP2 (median
over rounds of the per-round ratio of medians; each job's in brackets). After the timed steps:
``none`` against plain FSDP2, |w_none - w_fsdp| / |w_fsdp - w_0| (the same update up to float
rounding), and adascale's gain.
"""

from __future__ import annotations

import argparse
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
MODELS = ["cnn", "mlp", "transformer", "transformer_adam"]
VARIANTS = ["fsdp", "none", "adascale", "adascale_adam"]
TARGET = 1.05

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402


# -- one job (under torchrun) -------------------------------------------------------------------
def shard(model, fully_shard):
    """FSDP2 units as the module docstring says, then the root."""
    import torch

    if isinstance(model, torch.nn.Sequential):
        units = [m for m in model if any(True for _ in m.parameters())]
    else:  # torch_overhead._TransformerBench
        units = [*model.model.encoder, *model.model.decoder]
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    return model


def fsdp_step(kind, model, opt, xs, ys, k, loss_fn) -> None:
    """One step of k passes, the first k - 1 without gradient sync: plain FSDP2 takes the mean of
    the passes' losses, hvd_scale's optimizer each micro-batch's mean loss."""
    divide = kind == "fsdp" and k > 1
    opt.zero_grad()
    for j in range(k):
        model.set_requires_gradient_sync(j == k - 1)
        loss = loss_fn(model(xs[j]), ys[j])
        (loss / k if divide else loss).backward()
    opt.step()


def job(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hvd_scale.adapters.torch.fsdp import DistributedOptimizer
    from hvd_scale.launch.jobs import print_result
    from torch_overhead import inner_optimizer, model_spec

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn = torch.nn.CrossEntropyLoss()

    def full(model):
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p)
                          .detach().reshape(-1).double() for p in model.parameters()])

    passes = [int(v) for v in args.passes.split(",")]
    steps_k, warmup_k, rounds_k = (timing.per_k(getattr(args, w), passes, w)
                                   for w in ("steps", "warmup", "rounds"))
    for name in args.models.split(","):
        build, shape, inner = model_spec(name)
        for ik, k in enumerate(passes):
            variants, refused = {}, {}
            for kind in args.variants.split(","):
                if kind != "fsdp" and kind.startswith("adascale") and \
                        (kind == "adascale_adam") != (inner == "adam"):
                    continue  # adascale is SGD's, adascale_adam Adam's
                torch.manual_seed(0)
                model = shard(build(), fully_shard)
                opt = inner_optimizer(model, inner)
                if kind != "fsdp":
                    try:
                        opt = DistributedOptimizer(opt, model, policy=kind,
                                                   backward_passes_per_step=k)
                    except ValueError as e:
                        refused[kind] = str(e).removeprefix("hvd_scale: ")[:400]
                        continue
                variants[kind] = (model, opt)
            g = torch.Generator().manual_seed(1000 + rank)
            xs = [torch.randn(args.batch, *shape, generator=g) for _ in range(k)]
            ys = [torch.randint(0, 10, (args.batch,), generator=g) for _ in range(k)]

            def step_of(kind, model, opt, k=k, xs=xs, ys=ys):
                return lambda: fsdp_step(kind, model, opt, xs, ys, k, loss_fn)

            steps, rounds, warmup = steps_k[ik], min(rounds_k[ik], steps_k[ik]), warmup_k[ik]
            per_round = max(1, steps // rounds)
            t0 = time.perf_counter()
            times = timing.interleave({kind: step_of(kind, *v) for kind, v in variants.items()},
                                      rounds, per_round, warmup)
            summary = timing.summarize(times, "fsdp")
            wall = time.perf_counter() - t0
            checks = {}
            with torch.no_grad():
                if "none" in variants:
                    torch.manual_seed(0)
                    start = torch.cat([p.detach().reshape(-1).double()
                                       for p in build().parameters()])
                    a, b = full(variants["fsdp"][0]), full(variants["none"][0])
                    checks["none_vs_fsdp_weights_rel"] = float((a - b).norm() / (a - start).norm())
            for kind in variants:
                if kind.startswith("adascale"):
                    checks[f"gain_{kind}"] = float(variants[kind][1].gain)
            out = {"model": name, "k": k, "workers": world, "batch": args.batch, "inner": inner,
                   "steps_each": warmup + rounds * per_round, "rounds": rounds, "wall_s": wall,
                   **summary, "checks": checks, "refused": refused}
            if rank == 0:
                print_result({"rank": 0, **out})
            del variants
    dist.destroy_process_group()
    return 0


# -- the driver ---------------------------------------------------------------------------------
def _git(*cmd) -> str:
    try:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def report(args, argv, jobs, code) -> str:
    command = f".venv/bin/python benchmarks/fsdp_cost.py {shlex.join(argv)}".rstrip()
    keys = [(r["model"], r["k"]) for r in jobs[0]["rows"]]
    by = [{(r["model"], r["k"]): r for r in j["rows"]} for j in jobs]
    lines = [
        "# The FSDP2 engine against plain FSDP2 (fully_shard, Gloo, 2 processes, CPU)", "",
        f"Rerun: `{command}`", "",
        f"Step time (zero_grad, k x (forward, backward), step), {jobs[0]['rows'][0]['steps_each']}"
        f" steps per variant per (model, k) with {args.warmup} of warm-up, the variants taking "
        f"turns in {args.rounds} rounds inside each job; ratios to plain FSDP2 paired round by "
        "round (benchmarks/timing.py), median over rounds; each job's ratio in brackets. "
        "`torchrun --standalone --nproc-per-node 2`, one torch thread per process, batch "
        f"{args.batch} per worker and pass; the units and variants: the script's docstring. "
        f"Target: at most {TARGET}.", "",
        "**The machine**: 2 CPU cores shared with other work during these jobs (the 1-minute "
        "load average before and after each job is listed below: the job's own 2 processes "
        "count in it, above ~2.5 other work shared the cores). Absolute milliseconds move "
        "between jobs; read the paired ratios, and treat the spread between jobs as the noise.",
        "",
        "| model | k | FSDP2 ms (job 1) | none / FSDP2 | adascale / FSDP2 | adascale_adam / FSDP2 |",
        "|---|---|---|---|---|---|"]
    summary = {}
    for key in keys:
        cells = []
        for v in ("none", "adascale", "adascale_adam"):
            ratios = [b[key][v]["ratio_to_fsdp"] for b in by if v in b.get(key, {})]
            why = by[0][key].get("refused", {}).get(v)
            if not ratios:
                cells.append(f"refused: {why}" if why else "-")
                continue
            med = statistics.median(ratios)
            summary.setdefault(f"{key[0]}/k={key[1]}", {})[v] = {"median": med, "jobs": ratios}
            cells.append(f"{med:.3f} [" + ", ".join(f"{r:.3f}" for r in ratios) + "]")
        lines.append(f"| {key[0]} | {key[1]} | {by[0][key]['fsdp']['median_ms']:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Each job:", "", "| job | when (UTC) | load 1 min before / after |", "|---|---|---|"]
    lines += [f"| {i + 1} | {j['start']}-{j['end']} | {j['loadavg_1min'][0]} / "
              f"{j['loadavg_1min'][1]} |" for i, j in enumerate(jobs)]
    lines += ["", "Checks after the timed steps (job 1): `none` against plain FSDP2, "
              "|w_none - w_fsdp| / |w_fsdp - w_0|; adascale's gain (of S = 2k):", "",
              "| model | k | none vs FSDP2 weights | gain adascale |", "|---|---|---|---|"]
    for r in jobs[0]["rows"]:
        c = r["checks"]
        w = f"{c['none_vs_fsdp_weights_rel']:.1e}" if "none_vs_fsdp_weights_rel" in c else "-"
        gain = next((f"{v:.3f}" for key, v in c.items() if key.startswith("gain_")), "-")
        lines.append(f"| {r['model']} | {r['k']} | {w} | {gain} |")
    lines += ["", f"- code: {code['head']}" + (" (adapters/torch/fsdp.py uncommitted in the shared "
                                                 "tree)" if code["uncommitted"] else ""),
              f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
              f"{platform.platform()}, shared (see the load averages)"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(
        {"command": command, "code": code, "summary": summary, "jobs": jobs}, indent=1) + "\n")
    return "\n".join(lines) + "\n"


def drive(args, argv) -> int:
    job_args = ["--models", args.models, "--passes", args.passes, "--variants", args.variants,
                "--steps", str(args.steps), "--rounds", str(args.rounds),
                "--warmup", str(args.warmup), "--batch", str(args.batch)]
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "benchmarks/fsdp_cost.py", *job_args]
    code = {"head": _git("rev-parse", "--short", "HEAD"),
            "uncommitted": bool(_git("status", "--porcelain", "adapters/torch/fsdp.py"))}
    jobs = []
    for i in range(args.repeats):
        jobs.append(timing.job_record(cmd, {}))
        j = jobs[-1]
        print(f"job {i + 1}: {j['start']}-{j['end']}, load {j['loadavg_1min']}",
              {f"{r['model']}/k={r['k']}": {v: round(f["ratio_to_fsdp"], 3) for v, f in r.items()
                                            if isinstance(f, dict) and "ratio_to_fsdp" in f}
               for r in j["rows"]}, flush=True)
        text = report(args, argv, jobs, code)
        (RESULTS / f"{args.out}.md").write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"of: {', '.join(MODELS)}")
    p.add_argument("--passes", default="1,4", help="values of k, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS), help="the first the baseline (fsdp)")
    p.add_argument("--steps", default="60", help="measured steps per variant (one, or one per k)")
    p.add_argument("--rounds", default="10", help="interleaving rounds (one, or one per k)")
    p.add_argument("--warmup", default="3", help="untimed steps (one, or one per k)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="driver: torchrun jobs")
    p.add_argument("--out", default="fsdp_cost", help="driver: results/<out>.md and .json")
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # started by torchrun: one job
        return job(args)
    return drive(args, argv)


if __name__ == "__main__":
    sys.exit(main())
