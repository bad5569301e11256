"""One training script, four ways: under Horovod (``horovodrun -np 2``), under torch.distributed
(``torchrun --nproc-per-node 2``, DDP or FSDP2's ``fully_shard``) and in one process (``--engine reference``: the engine's
own functions over the same micro-gradients, computed one after the other). tests/test_ddp.py
compares them per step.

Every policy at k = 1 and 4 (at k = 4 with each worker's accumulated gradient read once, the
default at two workers; adascale and adascale_adam also with every pass read), each run 6 steps of a float64 MLP (8 -> 16 tanh -> 3) from the same
weights, on the same micro-batch per (rank, step, pass). SGD policies use SGD; adascale_adam
AdamW. Each rank prints ``RESULT {...}`` per run: the per-step gain, lr factor, tau, sigma2,
mu2, and the weights after.

Checkpoints across engines (``--save DIR`` / ``--resume FILE``): a run of adascale at k = 2
saves its optimizer and model after step 3 (rank 0, ``DIR/<engine>.pt``) and goes on to step 6
(run "uninterrupted": steps 4..6); ``--resume`` loads the other engine's checkpoint and takes
steps 4..6, reported as run "resumed".

Gradient clipping between the last backward pass and ``step()`` (adascale, k = 2, run "clip
..."): each engine's documented idioms, ``opt.synchronize()`` then ``clip_grad_norm_`` (with a
GradScaler at 2^10, exact in float64: ``synchronize``, ``unscale_``, clip, ``scaler.step``), and
under DDP also PyTorch's own idiom without ``synchronize()``; the reference clips the mean
micro-gradient (run "clip").

    horovodrun --gloo -np 2 -H localhost:2 python engines_worker.py --engine horovod
    torchrun --nproc-per-node 2 engines_worker.py --engine ddp    # or --engine fsdp
    python engines_worker.py --engine reference
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np
import torch

from _report import emit_result
from parity_worker import LR, initial_weights
from parity_worker import micro_batch as parity_micro_batch

WORKERS = 2
STEPS = 6  # the model, weights, micro-batches, batch and lr: parity_worker's
POLICIES = ("none", "linear", "sqrt", "power:alpha=0.7", "fixed:factor=1.5", "warmup:fraction=0.5",
            "legw:steps=4", "adascale", "adascale_adam")
BUDGET = 40
CHECKPOINT_AFTER = 3
RESUME_K = 2
# Also run with per-pass statistics (samples="passes") at k = 4.
PER_PASS = ("adascale", "adascale_adam")
# adascale_adam measures from its 20th step on (AdaScaleAdam.MIN_ADAM_HISTORY): longer runs.
ADAM_STEPS = 24
# (run, GradScaler, synchronize()): clipped at CLIP_NORM, between the mean micro-gradient's
# norms here (0.39 to 0.62) and twice them (k x the mean: what DDP's p.grad held before the mean
# was made at the last backward pass), so some steps clip and some do not. Horovod's need
# synchronize().
CLIP_K, CLIP_NORM = 2, 0.5
CLIP_RUNS = (("clip synchronize", False, True), ("clip scaler", True, True),
             ("clip unsynchronized", False, False), ("clip scaler unsynchronized", True, False))


def micro_batch(rank, step, k_pass):
    x, y = parity_micro_batch(rank, step, k_pass)
    return torch.from_numpy(x), torch.from_numpy(y)


def new_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    with torch.no_grad():
        for p, w in zip(model.parameters(), initial_weights()):
            p.copy_(torch.from_numpy(w))
    return model


def inner_optimizer(policy, params):
    if policy == "adascale_adam":
        return torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.98), eps=1e-12, weight_decay=0.05)
    return torch.optim.SGD(params, lr=LR)


def loss_of(model, rank, step, j):
    x, y = micro_batch(rank, step, j)
    return torch.nn.functional.cross_entropy(model(x), y)


def row(opt):
    return {"gain": opt.gain, "lr_factor": opt.lr_factor, "progress": opt.progress,
            "sigma2": opt.sigma2, "mu2": opt.mu2, "steps": opt.steps}


def weights(model):
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return np.concatenate([p.detach().numpy().reshape(-1) for p in whole]).tolist()


class Engine:
    """Horovod's, DDP's or FSDP2's: the model and optimizer, and one step of k passes."""

    def __init__(self, name):
        self.name = name
        if name == "horovod":
            import horovod.torch as hvd
            hvd.init()
            self.rank = hvd.rank()
        else:
            import torch.distributed as dist
            dist.init_process_group("gloo")
            self.rank = dist.get_rank()

    def build(self, policy, k, samples="auto", scaler=None):
        model = new_model()
        if self.name == "horovod":
            from hvd_scale.adapters.torch import DistributedOptimizer
            opt = DistributedOptimizer(inner_optimizer(policy, model.parameters()),
                                       named_parameters=model.named_parameters(), policy=policy,
                                       backward_passes_per_step=k, budget=BUDGET, samples=samples,
                                       grad_scaler=scaler)
            return model, model, opt
        if self.name == "fsdp":  # the first layer a unit of its own, the rest the root's
            from torch.distributed.fsdp import fully_shard

            from hvd_scale.adapters.torch.fsdp import DistributedOptimizer
            fully_shard(model[0])
            fully_shard(model)
            self.every_pass = samples == "passes"  # per-pass samples: a reduce-scatter each
            opt = DistributedOptimizer(inner_optimizer(policy, model.parameters()), model,
                                       policy=policy, backward_passes_per_step=k, budget=BUDGET,
                                       samples=samples, grad_scaler=scaler)
            return model, model, opt
        from torch.nn.parallel import DistributedDataParallel

        from hvd_scale.adapters.torch.ddp import DistributedOptimizer
        ddp = DistributedDataParallel(model)
        opt = DistributedOptimizer(inner_optimizer(policy, ddp.parameters()), ddp, policy=policy,
                                   backward_passes_per_step=k, budget=BUDGET, samples=samples,
                                   grad_scaler=scaler)
        return model, ddp, opt

    def quiet(self, wrapped, j, k):
        """The first k - 1 passes without gradient communication (DDP's no_sync, FSDP2's
        set_requires_gradient_sync(False)); Horovod's passes never communicate."""
        if self.name == "fsdp":
            wrapped.set_requires_gradient_sync(j == k - 1 or self.every_pass)
        elif self.name == "ddp" and j < k - 1:
            return wrapped.no_sync()
        return contextlib.nullcontext()

    def step(self, wrapped, opt, step, k):
        opt.zero_grad()
        for j in range(k):
            with self.quiet(wrapped, j, k):
                loss_of(wrapped, self.rank, step, j).backward()
        opt.step()

    def clipped_step(self, model, wrapped, opt, step, k, scaler, synchronize):
        """One step of k passes clipped before the update: the norm clip_grad_norm_ saw."""
        opt.zero_grad()
        for j in range(k):
            with self.quiet(wrapped, j, k):
                loss = loss_of(wrapped, self.rank, step, j)
                (loss if scaler is None else scaler.scale(loss)).backward()
        if synchronize:
            opt.synchronize()
        if scaler is not None:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2's
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        return norm


def runs():
    """(run name, policy, k, samples): every policy at k = 1 and 4 with the default statistics
    (two workers: each worker's accumulated gradient read once), and the per-pass ones at k = 4."""
    for policy in POLICIES:
        for k in (1, 4):
            yield f"{policy}/k={k}", policy, k, "auto"
    for policy in PER_PASS:
        yield f"{policy}/k=4/passes", policy, 4, "passes"


def run_engine(name, save, resume):
    engine = Engine(name)
    for run, policy, k, samples in runs():
        if name == "fsdp" and policy == "adascale_adam":
            continue  # refused under FSDP2 (Adam's second moment is sharded): tests/test_fsdp.py
        model, wrapped, opt = engine.build(policy, k, samples)
        rows = []
        for step in range(ADAM_STEPS if policy == "adascale_adam" else STEPS):
            engine.step(wrapped, opt, step, k)
            rows.append(row(opt))
        emit_result({"rank": engine.rank, "engine": name, "run": run,
                     "scale": opt.scale, "rows": rows, "weights": weights(model)})
    for run, scaled, synchronize in CLIP_RUNS:
        if name == "horovod" and not synchronize or name == "fsdp" and scaled:
            continue  # Horovod averages the gradients in synchronize(): clipping needs it
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000) \
            if scaled else None
        model, wrapped, opt = engine.build("adascale", CLIP_K, scaler=scaler)
        rows = []
        for step in range(STEPS):
            norm = engine.clipped_step(model, wrapped, opt, step, CLIP_K, scaler, synchronize)
            rows.append({**row(opt), "clip_norm": norm})
        emit_result({"rank": engine.rank, "engine": name, "run": run,
                     "scale": opt.scale, "rows": rows, "weights": weights(model)})
    if save:  # the run uninterrupted, saved after step 3
        model, wrapped, opt = engine.build("adascale", RESUME_K)
        rows = []
        for step in range(STEPS):
            engine.step(wrapped, opt, step, RESUME_K)
            rows.append(row(opt))
            if step + 1 == CHECKPOINT_AFTER and engine.rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                           os.path.join(save, f"{name}.pt"))
        emit_result({"rank": engine.rank, "engine": name, "run": "uninterrupted",
                     "scale": opt.scale, "rows": rows[CHECKPOINT_AFTER:], "weights": weights(model)})
    if resume:
        model, wrapped, opt = engine.build("adascale", RESUME_K)
        saved = torch.load(resume, weights_only=False)
        model.load_state_dict(saved["model"])  # on every rank, then the optimizer's record
        opt.load_state_dict(saved["opt"])
        rows = []
        for step in range(CHECKPOINT_AFTER, STEPS):
            engine.step(wrapped, opt, step, RESUME_K)
            rows.append(row(opt))
        emit_result({"rank": engine.rank, "engine": name, "run": "resumed", "scale": opt.scale,
                     "rows": rows, "weights": weights(model)})


def run_reference():
    """One process, no engine: each step's W x k micro-gradients one after the other, their
    statistics handed to the policy (``Policy.transition``), SGD by hand with lr x factor."""
    from hvd_scale.spec import make_policy

    for run, policy_spec, k, samples in [*runs(), ("clip", "adascale", CLIP_K, "auto")]:
        if policy_spec == "adascale_adam":
            continue  # Adam's moment horizons: compared between the engines only
        model = new_model()
        params = list(model.parameters())
        policy = make_policy(policy_spec, budget=BUDGET, optimizer="SGD")
        state, scale, rows = policy.init(), float(WORKERS * k), []
        for step in range(STEPS):
            micro = []
            for rank in range(WORKERS):
                for j in range(k):
                    grads = torch.autograd.grad(loss_of(model, rank, step, j), params)
                    micro.append(torch.cat([g.reshape(-1) for g in grads]))
            micro = torch.stack(micro)
            mean = micro.mean(0)
            if samples == "passes" or k == 1:  # every micro-gradient read
                sqsum, reads = float(micro.square().sum()), len(micro)
            else:  # each worker's sum G of its k passes read once: |G|^2 / k, W samples
                sums = micro.view(WORKERS, k, -1).sum(1)
                sqsum, reads = float(sums.square().sum()) / k, WORKERS
            measured = policy.uses_statistics  # the adapters' default: measure where needed
            state, info = policy.transition(
                state, sqsum if measured else None,
                float(mean.square().sum()) if measured else None, len(micro), scale=scale,
                samples=reads if measured else None)
            clipped = {}
            if run == "clip":  # clip_grad_norm_'s coefficient, of the mean micro-gradient
                clipped["clip_norm"] = float(mean.norm())
                mean = mean * min(1.0, CLIP_NORM / (clipped["clip_norm"] + 1e-6))
            with torch.no_grad():
                at = 0
                for p in params:
                    p -= LR * info.lr_factor * mean[at:at + p.numel()].view_as(p)
                    at += p.numel()
            estimator = policy.estimator(state, scale)
            rows.append({"gain": policy.gain(state, scale), "lr_factor": info.lr_factor,
                         "progress": state.progress, "sigma2": estimator.sigma2,
                         "mu2": estimator.mu2, "steps": state.steps, **clipped})
        emit_result({"rank": 0, "engine": "reference", "run": run,
                     "scale": scale, "rows": rows, "weights": weights(model)})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["horovod", "ddp", "fsdp", "reference"], required=True)
    parser.add_argument("--save", help="folder: save a checkpoint after step 3 there")
    parser.add_argument("--resume", help="a checkpoint to resume from (the other engine's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.engine == "reference":
        run_reference()
    else:
        run_engine(args.engine, args.save, args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
