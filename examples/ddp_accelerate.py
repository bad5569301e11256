"""Hugging Face Accelerate with hvd_scale: Accelerate wraps the model in DDP, shards the data and
gates the optimizer step under gradient accumulation; hvd_scale's DDP optimizer is built over the
prepared (DDP) model, then prepared itself.

    torchrun --nproc-per-node 2 examples/ddp_accelerate.py --policy adascale --accumulate 4

Accelerate reads torchrun's environment (any launcher that starts the processes with it will do;
``accelerate launch --cpu --num_processes 2`` starts one process on a machine without MPI). In
one process Accelerate does not wrap the model in DDP, and hvd_scale's DDP optimizer refuses the
bare model (TypeError): there is no DDP to carry the statistics.

The recipe (``train``):

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model, loader = accelerator.prepare(model, loader)        # DDP first: the optimizer needs it
    opt = accelerator.prepare(DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                                   model, policy, backward_passes_per_step=k))
    for x, y in loader:
        with accelerator.accumulate(model):                    # no_sync() for k - 1 passes
            loss = F.cross_entropy(model(x), y)                # the micro-batch's mean loss
            accelerator.backward(loss * accelerator.gradient_accumulation_steps)
            opt.step()                                         # the k-th pass only
            opt.zero_grad()

``accelerator.backward`` divides the loss by ``gradient_accumulation_steps``; hvd_scale takes
each micro-batch's mean loss and divides by the passes itself, hence the product (the same
as ``loss.backward()`` without mixed precision). ``--compare`` then trains the same model on the
same micro-batches in a plain DDP loop with hvd_scale's DDP optimizer, and each rank prints one
``RESULT {json}`` line per run (tests/test_ddp_integrations.py compares them).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from ddp_reference import BATCH, LR, dataset, network, plain_run, record, weights
from torch.utils.data import DataLoader

from hvd_scale.adapters.torch.ddp import DistributedOptimizer

def train(accelerator, policy, samples):
    """The recipe; the lr the SGD sees is recorded (a step pre-hook on it)."""
    k = accelerator.gradient_accumulation_steps
    model, loader = accelerator.prepare(network(), DataLoader(dataset(samples), batch_size=BATCH))
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    seen, rows = [], []
    sgd.register_step_pre_hook(lambda o, a, kw: seen.append(o.param_groups[0]["lr"]))
    opt = accelerator.prepare(DistributedOptimizer(sgd, model, policy, backward_passes_per_step=k))
    hvd_opt = opt.optimizer  # Accelerate's AcceleratedOptimizer holds hvd_scale's
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss * accelerator.gradient_accumulation_steps)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            record(hvd_opt, seen, rows)
    accelerator.print(f"accelerate: {hvd_opt.policy.spec} at S = {hvd_opt.scale:g}: "
                      f"{hvd_opt.steps} steps, tau {hvd_opt.progress:.2f}, gain {hvd_opt.gain:.3f}, "
                      f"lr {seen[-1]:.4f}")
    return accelerator.unwrap_model(model), rows, hvd_opt.scale


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", default="adascale")
    p.add_argument("--accumulate", default="1", help="gradient_accumulation_steps (k); a list "
                   "(1,2): one run after the other")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compare", action="store_true", help="also the plain DDP loop; RESULT lines")
    args = p.parse_args()
    accelerator = Accelerator(cpu=True)
    for k in map(int, args.accumulate.split(",")):
        accelerator.gradient_accumulation_steps = k
        samples = accelerator.num_processes * BATCH * k * args.steps
        net, rows, scale = train(accelerator, args.policy, samples)
        if not args.compare:
            continue
        # Accelerate's shards: rank r takes batches r, r + W, ... of the loader
        shards = list(DataLoader(dataset(samples), batch_size=BATCH))[
            dist.get_rank()::dist.get_world_size()]
        plain_net, plain_rows = plain_run(args.policy, k, shards)
        for run, n, r in (("accelerate", net, rows), ("plain", plain_net, plain_rows)):
            print("RESULT " + json.dumps({"rank": accelerator.process_index, "run": run, "k": k,
                                          "scale": scale, "rows": r, "weights": weights(n)}),
                  flush=True)


if __name__ == "__main__":
    main()
