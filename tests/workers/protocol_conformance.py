"""One process (Horovod of size 1): build an adapter's optimizer, check it against
``adapters/protocol.FrameworkOptimizer`` and take two steps of two micro-batches, recording the
hooks ``core.run_step`` calls. Prints one JSON line. Usage: protocol_conformance.py
torch|torch/ddp|keras (Keras runs on the backend $KERAS_BACKEND names; torch/ddp: a
torch.distributed group of one process), or under ``torchrun --nproc-per-node 2``: torch/fsdp."""

from __future__ import annotations

import contextlib
import inspect
import sys

import numpy as np

from hvd_scale.adapters.protocol import HOOKS, FrameworkOptimizer
from hvd_scale.launch.jobs import print_result


def signatures(cls) -> dict:
    return {hook: list(inspect.signature(getattr(cls, hook)).parameters) for hook in HOOKS}


def check(opt, micro_step, weights) -> dict:
    """The protocol checks, alike for every adapter."""
    calls = []
    for hook in HOOKS:
        def recorded(*args, _hook=hook, _bound=getattr(opt, hook), **kw):
            calls.append(_hook)
            return _bound(*args, **kw)
        object.__setattr__(opt, hook, recorded)
    before = weights()
    for step in range(2):
        for micro in range(2):
            micro_step(step * 2 + micro)
    return {"is_protocol": isinstance(opt, FrameworkOptimizer),
            "signatures": signatures(type(opt)), "expected": signatures(FrameworkOptimizer),
            "calls": calls, "steps": opt.steps, "progress": opt.progress,
            "moved": float(np.abs(weights() - before).max())}


def data(i):
    rng = np.random.default_rng(i)
    return rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")


def torch_case() -> dict:
    import horovod.torch as hvd
    import torch

    from hvd_scale.adapters.torch import DistributedOptimizer

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), policy="adascale_adam",
                               backward_passes_per_step=2)

    def micro_step(i):
        x, y = (torch.from_numpy(a) for a in data(i))
        torch.nn.functional.mse_loss(model(x), y).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()

    return check(opt, micro_step, lambda: torch.cat([p.detach().flatten() for p in model.parameters()]).numpy())


def ddp_case() -> dict:
    """torch under torch.distributed: a group of one process, the model in DDP."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hvd_scale.adapters.torch.ddp import DistributedOptimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model,
                               policy="adascale_adam", backward_passes_per_step=2)

    def micro_step(i):
        x, y = (torch.from_numpy(a) for a in data(i))
        with model.no_sync() if i % 2 == 0 else contextlib.nullcontext():
            torch.nn.functional.mse_loss(model(x), y).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()

    return check(opt, micro_step, lambda: torch.cat([p.detach().flatten() for p in model.parameters()]).numpy())


def fsdp_case() -> dict:
    """torch under FSDP2 (``fully_shard``), two processes of torchrun (the reduce-scatter path;
    a mesh of one reads FSDP2's all-reduce hook instead): adascale over SGD (the engine refuses
    adascale_adam)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hvd_scale.adapters.torch.fsdp import DistributedOptimizer

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 1))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model,
                               policy="adascale", backward_passes_per_step=2)

    def micro_step(i):
        x, y = (torch.from_numpy(a) for a in data(i + 100 * dist.get_rank()))
        model.set_requires_gradient_sync(i % 2 == 1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()

    return check(opt, micro_step, lambda: torch.cat(
        [p.full_tensor().detach().flatten() for p in model.parameters()]).numpy())


def keras_case() -> dict:
    import keras

    from hvd_scale.adapters.keras import DistributedOptimizer, hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = DistributedOptimizer(keras.optimizers.Adam(0.01), policy="adascale_adam",
                               backward_passes_per_step=2)
    opt.build(model.trainable_variables)

    def grads(x, y):
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((model(x) - y) ** 2)
            return tape.gradient(loss, model.trainable_variables)
        import torch
        for v in model.trainable_variables:
            v.value.grad = None
        loss = keras.ops.mean((model(x) - keras.ops.convert_to_tensor(y)) ** 2)
        loss.backward()
        return [v.value.grad for v in model.trainable_variables]

    def micro_step(i):
        x, y = data(i)
        opt.apply(grads(x, y), model.trainable_variables)

    return check(opt, micro_step, lambda: np.concatenate([w.reshape(-1) for w in model.get_weights()]))


if __name__ == "__main__":
    out = {"torch": torch_case, "torch/ddp": ddp_case, "torch/fsdp": fsdp_case,
           "keras": keras_case}[sys.argv[1]]()
    print_result(out)
