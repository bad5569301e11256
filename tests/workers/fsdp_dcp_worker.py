"""Run under torchrun: hvd_scale's DDP or FSDP2 optimizer saved and loaded through
torch.distributed.checkpoint (hvd_scale.adapters.torch.dcp), for tests/test_fsdp_checkpoint.py.

    torchrun --nproc-per-node 2 tests/workers/fsdp_dcp_worker.py --engine fsdp --save DIR \
        --steps 3 --more 2
    torchrun --nproc-per-node 1 tests/workers/fsdp_dcp_worker.py --engine fsdp --load DIR --more 2

A float64 model (8 -> 16 tanh -> 3), the same initial weights everywhere, each micro-batch drawn
from (step, rank, pass) so that a resumed run at the same layout sees what the uninterrupted one
saw. --save: train --steps steps, save (the model's, the optimizer's and the run's sharded state
in one dcp.save), report the record, train --more steps; --load: the same model and optimizer
made fresh, dcp.load, report the record, train --more steps. Each rank reports the record after
the save or the load and each step's values.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before init: Gloo's exit, docs/troubleshooting.md)

from _report import emit_result, error_of

BATCH = 16


def build(engine, policy, passes):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).double()
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        from hvd_scale.adapters.torch.ddp import DistributedOptimizer
        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        from hvd_scale.adapters.torch.fsdp import DistributedOptimizer
        fully_shard(model[0])
        fully_shard(model)  # the parameters become DTensors: the optimizer is made after
    inner = torch.optim.AdamW(model.parameters(), lr=0.01) if policy == "adascale_adam" else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, DistributedOptimizer(inner, model, policy=policy,
                                       backward_passes_per_step=passes)


def micro_batch(rank, step, j):
    rng = np.random.default_rng(1000 * step + 10 * rank + j)
    return torch.from_numpy(rng.normal(size=(BATCH, 8))), torch.from_numpy(rng.integers(0, 3, BATCH))


def weights(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return float(sum(float(v.double().square().sum()) for v in full.values()))


def train(model, opt, steps, engine):
    import contextlib

    rank = dist.get_rank()
    rows = []
    for _ in range(steps):
        step = opt.steps
        k = opt.backward_passes_per_step
        opt.zero_grad()
        for j in range(k):
            last = j == k - 1
            if engine == "ddp":
                ctx = contextlib.nullcontext() if last else model.no_sync()
            else:
                # samples="workers" from two workers on: the k - 1 first passes unreduced;
                # "passes" at one worker (the default): a reduce-scatter every pass
                model.set_requires_gradient_sync(last or dist.get_world_size() == 1)
                ctx = contextlib.nullcontext()
            with ctx:
                x, y = micro_batch(rank, step, j)
                torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        rows.append({"step": opt.steps, "tau": opt.progress, "gain": opt.gain,
                     "lr_factor": opt.lr_factor, "sigma2": opt.sigma2, "mu2": opt.mu2,
                     "scale": opt.scale, "weights": weights(model)})
    return rows


def record(opt):
    run = opt.state_dict()["hvd_scale"]
    return {"run": run, "steps": opt.steps, "tau": opt.progress, "gain": opt.gain,
            "sigma2": opt.sigma2, "mu2": opt.mu2, "scale": opt.scale,
            "passes": opt.backward_passes_per_step, "factor": opt.factor()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("ddp", "fsdp"), required=True)
    parser.add_argument("--policy", default="adascale")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--bad-load", help="a dcp checkpoint without hvd_scale's record")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--more", type=int, default=2)
    args = parser.parse_args()

    import torch.distributed.checkpoint as dcp

    from hvd_scale.adapters.torch.dcp import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model, opt = build(args.engine, args.policy, args.passes)
    out = {"rank": rank, "size": size, "engine": args.engine}
    if args.bad_load:  # torch's own state dicts: refused on every rank, nothing changed
        from torch.distributed.checkpoint.state_dict import get_state_dict as torch_state

        before = record(opt)
        msd, osd = torch_state(model, opt._inner)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.bad_load)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        try:  # DCP's CheckpointException is a BaseException
            dcp.load(state, checkpoint_id=args.bad_load)
            out["dcp_load_error"] = None
        except BaseException as e:  # noqa: B036
            out["dcp_load_error"] = f"{type(e).__name__}: {e}"
        del osd["hvd_scale"]
        out["set_error"] = error_of(lambda: set_state_dict(
            model, opt, model_state_dict=msd, optim_state_dict=osd))
        out["unchanged"] = record(opt) == before
    elif args.save:
        out["before"] = train(model, opt, args.steps, args.engine)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.save)
        out["saved"] = record(opt)
        out["after"] = train(model, opt, args.more, args.engine)
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=args.load)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out["loaded"] = record(opt)
        out["after"] = train(model, opt, args.more, args.engine)
    emit_result(out)
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
