"""A GradScaler's skipped step, counted at the step it skipped (issue #58 item 7): one process,
each engine (``--engine horovod``: hvd.init() alone; ``ddp``: a Gloo group of one), adascale at
k = 2. Three steps, the second overflowing: ``opt.skipped`` is read right after each
``scaler.step`` (the documented idioms of docs/torch.md and docs/ddp.md)."""

from __future__ import annotations

import argparse
import contextlib

import torch

from _report import emit_result

PASSES = 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=("horovod", "ddp"), required=True)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.engine == "horovod":
        import horovod.torch as hvd

        from hvd_scale.adapters.torch import DistributedOptimizer
        hvd.init()
        opt = DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   policy="adascale", backward_passes_per_step=PASSES,
                                   grad_scaler=scaler)
        net = model
    else:
        import torch.distributed as dist

        from hvd_scale.adapters.torch.ddp import DistributedOptimizer
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0,
                                world_size=1)
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = DistributedOptimizer(inner, net, policy="adascale",
                                   backward_passes_per_step=PASSES, grad_scaler=scaler)
    rows = []
    for step in range(3):
        opt.zero_grad()
        for i in range(PASSES):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + i))
            if step == 1:
                x = x * float("inf")  # an overflow: the scaler skips this step
            last = i == PASSES - 1
            sync = contextlib.nullcontext() if args.engine == "horovod" or last else net.no_sync()
            with sync:
                scaler.scale(net(x).pow(2).mean()).backward()
        if args.engine == "horovod":
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        rows.append({"step": step, "skipped": opt.skipped, "steps": opt.steps,
                     "progress": opt.progress})
        scaler.update()
    emit_result(rank=0, engine=args.engine, rows=rows)
    if args.engine == "ddp":
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
