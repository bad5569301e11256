"""A tiny DDP training script for the torchrun engine's tests: started by torchrun (through
``hvd-scale run --engine torchrun`` or a torchrun of its own), one process per rank, Gloo.

The policy is never named here: it comes from ``HVD_SCALE_POLICY`` (the launcher's --policy), as a
user's unchanged script gets it. A float64 linear regression (8 -> 1) on noisy data, each rank its
own micro-batches per (rank, step, pass), ``--passes`` k backward passes per step (the first k - 1
under ``no_sync``), until the optimizer has taken ``--steps`` steps.

Each rank prints ``RESULT {...}`` lines (tests/hvdrun.worker_results):

* ``{"event": "start", ...}`` once it is set up: rank, world size, torchelastic's restart count,
  the policy it got (the environment's and the optimizer's), and what it resumed from;
* ``{"event": "step", ...}`` per step: tau (progress), gain, lr factor, sigma2, mu2, S, the
  inner optimizer's lr, the loss and a checksum of the weights (equal on every rank after DDP's
  step).

``--checkpoint FILE``: load it at start when it exists (model and optimizer: tau, the estimates
and the lr continue, at this job's world size), and rank 0 saves it after every step (written
aside, then renamed). ``--fail-once MARKER --fail-at STEP``: the rank ``--fail-rank`` exits 1
after that many steps, once (it creates MARKER first), for torchrun's restart. ``--sleep S``
after each step (time for a test to act on a running job).

    torchrun --nproc-per-node 2 ddp_train_worker.py --steps 3
    hvd-scale run --engine torchrun -np 2 --policy adascale -- python ddp_train_worker.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (DDP imports it: before init, so it holds no group)
from torch.nn.parallel import DistributedDataParallel

from _report import emit_result

BATCH = 8
LR = 0.05


def micro_batch(rank, step, k_pass):
    rng = np.random.default_rng(1000 * step + 10 * rank + k_pass)
    x = rng.normal(size=(BATCH, 8))
    y = x @ np.linspace(-1, 1, 8) + rng.normal(0, 0.5, BATCH)
    return torch.from_numpy(x), torch.from_numpy(y).unsqueeze(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--budget", type=float, default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--fail-once", default=None, metavar="MARKER")
    parser.add_argument("--fail-at", type=int, default=2)
    parser.add_argument("--fail-rank", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from hvd_scale.adapters.torch.ddp import DistributedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).double()
    ddp = DistributedDataParallel(model)
    opt = DistributedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), ddp,
                               backward_passes_per_step=args.passes, budget=args.budget)
    resumed = None
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])  # every rank reads the file: no broadcast needed
        opt.load_state_dict(saved["opt"])
        resumed = saved["row"]
    emit_result(event="start", rank=rank, world=world,
                restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                policy_env=os.environ.get("HVD_SCALE_POLICY"), policy=opt.policy.spec,
                log_dir=os.environ.get("HVD_SCALE_LOG_DIR"), resumed=resumed,
                progress=opt.progress, steps=opt.steps, scale=opt.scale,
                sigma2=opt.sigma2, mu2=opt.mu2, lr_factor=opt.lr_factor, gain=opt.gain,
                master_addr=os.environ.get("MASTER_ADDR"), host=socket.gethostname())

    while opt.steps < args.steps:
        step = opt.steps
        if (args.fail_once and rank == args.fail_rank and step == args.fail_at
                and not os.path.exists(args.fail_once)):
            open(args.fail_once, "w").close()
            print(f"rank {rank}: failing once at step {step}", file=sys.stderr, flush=True)
            os._exit(1)
        opt.zero_grad()
        losses = []
        for j in range(args.passes):
            quiet = ddp.no_sync() if j < args.passes - 1 else contextlib.nullcontext()
            with quiet:
                x, y = micro_batch(rank, step, j)
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        row = {"steps": opt.steps, "progress": opt.progress, "gain": opt.gain,
               "lr_factor": opt.lr_factor, "sigma2": opt.sigma2, "mu2": opt.mu2,
               "scale": opt.scale, "lr": opt.param_groups[0]["lr"], "world": world,
               "loss": float(np.mean(losses)),
               "weights": float(sum(p.detach().double().sum() for p in model.parameters()))}
        if rank == 0 and args.checkpoint:
            aside = f"{args.checkpoint}.{os.getpid()}.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "row": row}, aside)
            os.replace(aside, args.checkpoint)
        emit_result(event="step", rank=rank,
                    restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **row)
        if args.sleep:
            time.sleep(args.sleep)
    del ddp, opt  # DDP's last references to the group, then the group itself: freed now, not
    gc.collect()  # during the interpreter's exit (a Gloo thread busy then aborts: troubleshooting)
    dist.destroy_process_group()  # as DDP scripts end: the metrics log is flushed after it
    return 0


if __name__ == "__main__":
    sys.exit(main())
