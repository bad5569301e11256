"""Train a small 1-D CNN on MNIST-1D with Horovod and an hvd_scale policy.

    horovodrun --gloo -np 2 -H localhost:2 python examples/torch_mnist1d.py --policy adascale
    torchrun --nproc-per-node 2 examples/torch_mnist1d.py --policy adascale --engine ddp

With --engine ddp the model is a DistributedDataParallel on torch.distributed (Gloo, from
torchrun's environment) and the optimizer hvd_scale's DDP one (hvd_scale.adapters.torch.ddp): the
first k - 1 passes of a step under no_sync(), the data dealt by rank and world size as Horovod's.

The baseline (S = 1) schedule is written once, in baseline steps: lr, then x0.1 at 50% and 75% of
the budget. Every policy runs it in scale-invariant iterations, lr(floor(tau)) x factor, and stops
when tau reaches the budget, so runs at different scales and with different policies compare.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist1d_data  # noqa: E402

from hvd_scale import lr_at, schedules  # noqa: E402
from hvd_scale.adapters.torch import DistributedOptimizer, broadcast_state  # noqa: E402
from hvd_scale.guard import SharpnessGuard  # noqa: E402
from hvd_scale.launch.jobs import print_result  # noqa: E402


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 40)),
        torch.nn.Conv1d(1, 32, 5, padding=2), torch.nn.ReLU(),
        torch.nn.Conv1d(32, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv1d(32, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 10, 10),
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["horovod", "ddp"], default="horovod",
                   help="horovod (horovodrun) or ddp (torchrun: torch.distributed, Gloo)")
    p.add_argument("--policy", default=None, help="policy spec (default: $HVD_SCALE_POLICY or adascale)")
    p.add_argument("--batch-size", type=int, default=32, help="micro-batch per worker and pass")
    p.add_argument("--baseline-batch", type=int, default=None, help="B0 (default: --batch-size)")
    p.add_argument("--accumulate", type=int, default=1, help="backward passes per step")
    p.add_argument("--adapt", choices=["goodput"], default=None,
                   help="adapt the passes per step while training (from --accumulate up to --max-passes)")
    p.add_argument("--max-passes", type=int, default=None, help="the largest k --adapt may choose")
    p.add_argument("--budget", type=float, default=3000, help="baseline (S = 1) steps to train for")
    p.add_argument("--lr", type=float, default=0.05, help="baseline learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--momentum-horizon", action="store_true",
                   help="experiment (#21): before each step set momentum to momentum^r and the lr x "
                        "(1 - momentum^r) / (1 - momentum), r the previous step's gain, so the "
                        "momentum's horizon stays fixed in baseline steps and its steady-state step "
                        "is unchanged (not adopted: see benchmarks/README.md, B1)")
    p.add_argument("--samples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="print every N optimizer steps (0: never)")
    p.add_argument("--guard-every", type=int, default=0,
                   help="lr guard: measure the sharpness every N steps and cap the lr (0: off)")
    p.add_argument("--guard-margin", type=float, default=0.5, help="fraction of the stability limit")
    p.add_argument("--eval-every", type=float, default=0,
                   help="test accuracy every N baseline steps of progress, timed apart (0: at the end)")
    return p.parse_args(argv)


def evaluate(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(torch.from_numpy(x)).argmax(1) == torch.from_numpy(y)).float().mean().item()
    model.train()
    return acc


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.engine == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from hvd_scale.adapters.torch import ddp

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)
    data = mnist1d_data.load(args.samples)

    model = make_model()
    baseline = args.baseline_batch or args.batch_size
    scale = size * args.accumulate * args.batch_size / baseline
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    kw = dict(policy=args.policy, backward_passes_per_step=args.accumulate, scale=scale, budget=args.budget,
              guard=SharpnessGuard(args.guard_every, margin=args.guard_margin) if args.guard_every else None,
              adapt=args.adapt, max_passes=args.max_passes)
    if args.engine == "ddp":  # DDP broadcasts the weights when it wraps the model
        net = DistributedDataParallel(model)  # trains; model (its module) evaluates
        opt = ddp.DistributedOptimizer(inner, net, **kw)
    else:
        net = model
        opt = DistributedOptimizer(inner, named_parameters=model.named_parameters(), **kw)
        broadcast_state(model, opt)
    schedule = schedules.StepDecay(args.lr, milestones=[int(0.5 * args.budget), int(0.75 * args.budget)])
    batches = mnist1d_data.shard_batches(data["x"], data["y"], args.batch_size, rank, size,
                                         seed=args.seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    gains, sharpness, capped, guard_steps, plain_steps = [], [], 0, [], []
    # (training seconds without the evaluations, tau, steps, test accuracy): time to accuracy.
    curve, eval_seconds, next_eval = [], 0.0, args.eval_every
    start = time.perf_counter()
    diverged = False
    try:
        while not opt.done():
            for group in opt.param_groups:
                group["lr"] = lr_at(schedule, opt.progress)  # the baseline lr at floor(tau)
                if args.momentum_horizon:
                    mu = args.momentum ** opt.gain
                    group["momentum"] = mu
                    group["lr"] *= (1 - mu) / (1 - args.momentum)
            opt.zero_grad()
            k = opt.backward_passes_per_step  # adapt='goodput' may change it
            for i in range(k):
                x, y = next(batches)
                # Each micro-batch's mean loss, not divided by k: hvd_scale applies the mean of the
                # k micro-gradients (as Keras does). DDP: the first k - 1 passes unsynchronized.
                with net.no_sync() if args.engine == "ddp" and i < k - 1 else contextlib.nullcontext():
                    loss = loss_fn(net(torch.from_numpy(x)), torch.from_numpy(y))
                    loss.backward()
            due, t0 = opt.scaling.guard_due(), time.perf_counter()
            # With --guard-every: the guard's steps take the Hessian of this batch's loss.
            opt.step(guard_loss=lambda: loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)))
            (guard_steps if due else plain_steps).append(time.perf_counter() - t0)
            opt.log_loss(loss.detach())  # the step's metrics row (with --log-dir)
            gains.append(opt.gain)
            metrics = opt.metrics()
            capped += opt.last_learning_rate >= metrics["lr_cap"] * (1 - 1e-9)
            sharpness.append(metrics["sharpness"])
            if args.eval_every and opt.progress >= next_eval:
                t0 = time.perf_counter()
                curve.append((t0 - start - eval_seconds, opt.progress, opt.steps,
                              evaluate(model, data["x_test"], data["y_test"])))
                eval_seconds += time.perf_counter() - t0
                next_eval = (math.floor(opt.progress / args.eval_every) + 1) * args.eval_every
            if rank == 0 and args.log_every and opt.steps % args.log_every == 0:
                print(f"step {opt.steps:5d}  tau {opt.progress:8.1f}/{args.budget:g}  "
                      f"gain {opt.gain:5.2f}  lr {group['lr'] * opt.lr_factor:.4f}  loss {loss.item():.3f}",
                      flush=True)
    except FloatingPointError as e:  # hvd_scale stops a run whose steps all overflow
        diverged = True
        if rank == 0:
            print(f"diverged: {e}", flush=True)
    elapsed = time.perf_counter() - start - eval_seconds
    summary = {
        "rank": rank, "policy": opt.policy.spec, "scale": opt.scale, "workers": size,
        "accumulate": args.accumulate, "final_passes": opt.backward_passes_per_step, "steps": opt.steps, "progress": opt.progress,
        "test_accuracy": evaluate(model, data["x_test"], data["y_test"]),
        "mean_gain": float(np.mean(gains)) if gains else 1.0, "seconds": elapsed, "seed": args.seed,
        "diverged": diverged, "curve": curve,
        "params_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        # The guard: steps whose lr it capped, its largest estimate, and its time beyond a step's.
        "capped_steps": capped, "max_sharpness": float(np.max(sharpness)) if args.guard_every else math.nan,
        "guard_seconds": sum(guard_steps) - len(guard_steps) * float(np.median(plain_steps or [0])),
    }
    if rank == 0:
        print(f"done: policy {summary['policy']}, S = {summary['scale']:g}, {summary['steps']} steps "
              f"(tau {summary['progress']:.0f}), test accuracy {summary['test_accuracy']:.3f}, "
              f"mean gain {summary['mean_gain']:.2f}, {elapsed:.1f} s", flush=True)
    print_result(summary)
    if args.engine == "ddp":
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
