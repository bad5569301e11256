"""One torch engine's side of the contract (``adapters/torch/engine.py``), in a real 2-process job
(tests/test_engine_contract.py): its collectives on rank-dependent inputs, two steps at k = 2
through it, ``close()``. Every rank reports what it got; the test checks.

    horovodrun -np 2 python engine_contract_worker.py hvd_scale.adapters.torch none
    torchrun --nproc-per-node 2 engine_contract_worker.py hvd_scale.adapters.torch.ddp ddp

The second argument says how the model is wrapped for the engine: "none" (Horovod's
DistributedOptimizer takes named_parameters), "ddp" (DistributedDataParallel), "fully_shard"
(FSDP2 on a CPU mesh): the module's ``DistributedOptimizer(optimizer, model, ...)`` then.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import torch

from _report import emit_result


def world(wrap: str) -> tuple[int, int]:
    if wrap == "none":
        import horovod.torch as hvd

        hvd.init()
        return hvd.rank(), hvd.size()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def wrapped(model: torch.nn.Sequential, wrap: str):
    if wrap == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrap == "fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return model


def accumulating(model, wrap: str, last: bool):
    """DDP's way to hold the reduction back on a step's first passes. (Horovod counts the
    passes itself; FSDP2 reads every pass, samples="passes", from a reduce-scatter each.)"""
    return model.no_sync() if wrap == "ddp" and not last else contextlib.nullcontext()


def tensor_hooks(model) -> int:
    return sum(len(p._backward_hooks or {}) for p in model.parameters())


def main() -> int:
    module, wrap = sys.argv[1], sys.argv[2]
    rank, size = world(wrap)
    from hvd_scale.adapters.torch.engine import Engine

    torch.manual_seed(0)  # the same weights on every rank
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = wrapped(plain, wrap)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    cls = importlib.import_module(module).DistributedOptimizer
    k = 2
    if wrap == "none":
        opt = cls(inner, named_parameters=model.named_parameters(), policy="adascale",
                  backward_passes_per_step=k, measure=True, samples="passes")
    else:
        opt = cls(inner, model, policy="adascale", backward_passes_per_step=k, measure=True,
                  samples="passes")
    engine = opt._engine
    out = {"rank": rank, "size": size, "class": type(engine).__name__,
           "protocol": isinstance(engine, Engine), "name": engine.name,
           "types": [type(engine.name).__name__, type(engine.sharded).__name__,
                     type(engine.averaged).__name__, isinstance(engine.stats_dtype, torch.dtype)]}

    # The statistics' collectives: a sum over workers, exact on small whole numbers.
    local = torch.tensor([rank + 1.0, 10.0 * (rank + 1), -float(rank)], dtype=engine.stats_dtype)
    out["wait_sum"] = engine.wait_sum(engine.allreduce_async(local.clone(), "contract.sum")).tolist()
    out["wait_sum_dtype"] = str(engine.wait_sum(engine.allreduce_async(local.clone(),
                                                                       "contract.dtype")).dtype)
    engine.drop(engine.allreduce_async(local.clone(), "contract.drop"))  # completes everywhere
    engine.drop(None)
    out["average"] = engine.average(torch.tensor([float(rank + 1)], dtype=torch.float64)).tolist()
    out["in_step_between_steps"] = engine.in_step()

    # Two steps of k passes through the engine, rank-dependent data; then k = 1 (follow_passes).
    g = torch.Generator().manual_seed(rank)
    for passes in (k, k, 1):
        for i in range(passes):
            with accumulating(model, wrap, i == passes - 1):
                x = torch.randn(6, 4, generator=g)
                model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if passes == k and opt.steps == 2:
            out["hooks_before_close"] = tensor_hooks(plain)
            opt.set_passes(1)
    out.update(steps=opt.steps, scale=opt.scale, sigma2=opt.sigma2, gain=opt.gain,
               passes=opt.backward_passes_per_step,
               weights=None if engine.sharded else
               float(sum(p.detach().double().sum() for p in plain.parameters())))

    # close(): the tensor hooks gone; the engine's own reduction still averages the gradients.
    opt.close()
    opt.close()  # idempotent
    out["hooks_after_close"] = tensor_hooks(plain)
    try:
        opt.step()
        out["step_after_close"] = None
    except RuntimeError as e:
        out["step_after_close"] = str(e)
    if not engine.sharded:
        model.zero_grad()
        model(torch.randn(6, 4, generator=g)).square().mean().backward()
        if wrap == "none":
            opt._hvd_opt.synchronize()  # Horovod's own hook sent them
        grads = [p.grad.detach().double().clone() for p in plain.parameters()]
        averaged = [engine.average(t.clone()) for t in grads]
        out["after_close_spread"] = max(float((a - t).abs().max()) for a, t in zip(averaged, grads))
    emit_result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
