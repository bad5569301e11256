"""B2 anchor: plain DDP and fairscale 0.4.13's AdaScale over DDP (torch.distributed, Gloo, 2 processes).

    PYTHONPATH=~/.cache/hvd_scale/fairscale-0.4.13 .venv/bin/python benchmarks/ddp_fairscale.py

fairscale is installed for the benchmark only (benchmarks/overhead.py does it, into the cache
folder above). Same models, batch and interleaving as benchmarks/torch_overhead.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_overhead import MODELS, time_interleaved  # noqa: E402

from hvd_scale.launch.jobs import print_result  # noqa: E402


def worker(rank: int, world: int, args, port: int, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from fairscale.optim import AdaScale
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for name in args.models.split(","):
        build, shape = MODELS[name]
        variants = {}
        for kind in ("ddp", "fairscale"):
            torch.manual_seed(0)
            model = DDP(build())
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if kind == "fairscale":
                opt = AdaScale(opt)
            variants[kind] = (model, opt)
        results[name] = time_interleaved(variants, shape, args.batch, rank, args.steps,
                                         args.warmup, args.rounds, baseline="ddp")
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--steps", type=int, default=180)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--port", type=int, default=29511)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, args, args.port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = out.get(timeout=1800)
    for proc in procs:
        proc.join(timeout=60)
    print_result({"rank": 0, **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
