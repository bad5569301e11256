"""Extra memory of the torch adapter: peak RSS growth while training, against plain Horovod.

    .venv/bin/python benchmarks/memory.py            # ~1 min; writes benchmarks/results/memory.md
    .venv/bin/python benchmarks/memory.py --repeats 1 --steps 5  # quick

One ``horovodrun -np 2 --gloo`` job per variant (peak RSS only grows, so variants cannot share a
process). Each job builds an MLP of 64 layers 512 x 512 (64 MB of gradients in 1 MB tensors: a
gradient-sized buffer would stand out, and the peak's jitter is about one tensor), then trains: the growth is rank 0's peak RSS
(``ru_maxrss``) at the end minus its RSS just before the first step; it holds the gradients, the
optimizer's state and every temporary of a step. Variants: plain ``hvd.DistributedOptimizer`` and
hvd_scale with ``none`` and ``adascale`` (SGD momentum), and plain against ``adascale_adam`` (Adam).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from hvd_scale.launch.jobs import horovodrun_command, print_result, read_results

HERE = Path(__file__).resolve().parent
VARIANTS = (("sgd", "plain"), ("sgd", "none"), ("sgd", "adascale"), ("adam", "plain"),
            ("adam", "adascale_adam"))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(optimizer: str, variant: str, width: int, depth: int, steps: int) -> None:
    import horovod.torch as hvd
    import torch

    from hvd_scale.adapters.torch import DistributedOptimizer

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    base = (torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9) if optimizer == "sgd"
            else torch.optim.Adam(model.parameters(), lr=1e-4))
    if variant == "plain":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        opt = DistributedOptimizer(base, named_parameters=model.named_parameters(), policy=variant)
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(32, width, generator=g)
    before = rss_mb()
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    params = sum(p.numel() for p in model.parameters())
    if hvd.rank() == 0:
        print_result({"optimizer": optimizer, "variant": variant, "params": params,
                      "tensors": 2 * depth, "grad_mb": params * 4 / 2**20, "before_mb": before,
                      "peak_mb": peak, "growth_mb": peak - before})


def run_job(optimizer: str, variant: str, args) -> dict:
    # Two sources of jitter removed, alike for every variant: glibc's dynamic mmap threshold (every
    # allocation of 64 KiB or more becomes its own mmap, unmapped on free, so RSS follows the live
    # tensors), and Horovod's 64 MB fusion buffer, of which a step touches as many pages as the
    # largest set of gradients that happened to be fused in one cycle (fusion off).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "HOROVOD_FUSION_THRESHOLD": "0"}
    proc = subprocess.run(
        horovodrun_command([sys.executable, __file__, "--worker", optimizer, variant, "--width",
                            args.width, "--depth", args.depth, "--steps", args.steps],
                           2, controller="gloo"),
        env=env, capture_output=True, text=True, timeout=600)
    found = read_results(proc.stdout)
    if found:
        return found[0]
    raise RuntimeError(f"{optimizer}/{variant} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=2, metavar=("OPTIMIZER", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2, help="jobs per variant (median kept)")
    p.add_argument("--out", default=str(HERE / "results" / "memory.md"))
    args = p.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.width, args.depth, args.steps)
        return 0
    rows = {}
    for _ in range(args.repeats):  # interleaved, so drift on the machine hits every variant
        for optimizer, variant in VARIANTS:
            r = run_job(optimizer, variant, args)
            rows.setdefault((optimizer, variant), []).append(r)
            print(f"{optimizer}/{variant}: growth {r['growth_mb']:.1f} MB", flush=True)
    first = next(iter(rows.values()))[0]
    lines = [
        "# Extra memory (torch, np 2, Gloo): peak RSS growth while training", "",
        f"Model: {args.depth} x Linear({args.width}, {args.width}) + Tanh, {first['params']:,} "
        f"parameters in {first['tensors']} tensors; float32 gradients {first['grad_mb']:.1f} MB; "
        f"batch 32, {args.steps} steps; growth = rank 0's peak RSS minus its RSS before the first "
        f"step (gradients, optimizer state, every temporary); median of {args.repeats} jobs per "
        "variant, variants interleaved; `MALLOC_MMAP_THRESHOLD_=65536` and "
        "`HOROVOD_FUSION_THRESHOLD=0` in every job, so that RSS follows the live tensors.", "",
        "| optimizer | variant | growth MB | minus plain, MB | minus plain, in gradient sizes |",
        "|---|---|---|---|---|"]
    for optimizer in ("sgd", "adam"):
        plain = _median([r["growth_mb"] for r in rows[(optimizer, "plain")]])
        for (opt_name, variant), results in rows.items():
            if opt_name != optimizer:
                continue
            growth = _median([r["growth_mb"] for r in results])
            extra = growth - plain
            in_grads = extra / first["grad_mb"]
            extra_cells = ("", "") if variant == "plain" else (f"{extra:+.1f}", f"{in_grads:+.3f}")
            lines.append(f"| {optimizer} | {variant} | {growth:.1f} | {extra_cells[0]} | "
                         f"{extra_cells[1]} |")
    lines += ["", f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
              f"- machine: {os.cpu_count()} CPUs, {platform.machine()}, {platform.platform()}",
              f"- rerun: `.venv/bin/python benchmarks/memory.py`"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


if __name__ == "__main__":
    sys.exit(main())
