"""FSDP2's engine against the one-process reference, in one torchrun job (tests/test_fsdp.py).

``torchrun --nproc-per-node 2 fsdp_worker.py`` (1-D mesh) or ``--nproc-per-node 4 ... --hsdp``
(2 replicas x 2 shards). Each rank builds engines_worker's float64 MLP (8 -> 16 tanh -> 3, the
same weights and micro-batch per (rank, step, pass)), shards it (``fully_shard`` on each Linear
and the root) and trains it 6 steps under hvd_scale's FSDP2 ``DistributedOptimizer``; every rank
also replays the step in one process (``reference``: all W x k micro-gradients of an unsharded
copy, the statistics and ``Policy.transition`` by hand, SGD with lr x factor). Each rank prints
``RESULT {...}`` per run: its rows (gain, lr factor, tau, sigma2, mu2), the step vectors the
policy got ([s..., c, w, q...]), the gathered weights, and the reference's.

Runs: adascale and linear at k = 1 and 4 in both accumulation modes (samples="workers": the first
k - 1 passes under ``set_requires_gradient_sync(False)``; "passes": a reduce-scatter every pass),
two optimizer groups (weights, biases), mixed precision (float32 model, fp16 and bf16 reduce),
the collectives counted, and the refusals.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from _report import emit_result
from engines_worker import BUDGET, LR, loss_of, new_model

STEPS = 6
MODES = ("workers", "passes")


def mesh_of(hsdp: bool):
    world = dist.get_world_size()
    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


class Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant checkpointing)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def sharded(mesh, dtype=torch.float64, reduce_dtype=None, variant=""):
    model = new_model().to(dtype)
    if variant == "checkpointed":
        model[0] = Checkpointed(model[0])
    elif variant == "compiled":  # torchtitan's way: each block compiled, then sharded
        model[0].compile(backend="aot_eager")
        model[2].compile(backend="aot_eager")
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype is not None else MixedPrecisionPolicy()
    fully_shard(model[0], mesh=mesh, mp_policy=mp)
    fully_shard(model[2], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def param_groups(model, groups: int):
    params = list(model.parameters())
    if groups == 1:
        return params
    return [{"params": [p for p in params if p.dim() == 2]},  # weights
            {"params": [p for p in params if p.dim() == 1]}]  # biases


def group_index(groups: int):
    """The reference's parameter order (weight0, bias0, weight2, bias2) -> group."""
    return [0, 0, 0, 0] if groups == 1 else [0, 1, 0, 1]


def full_weights(model):
    return np.concatenate([p.full_tensor().detach().double().numpy().reshape(-1)
                           for p in model.parameters()]).tolist()


def row(opt):
    return {"gain": opt.gain, "lr_factor": opt.lr_factor, "progress": opt.progress,
            "sigma2": opt.sigma2, "mu2": opt.mu2, "steps": opt.steps}


def build(mesh, policy, k, samples, groups=1, dtype=torch.float64, reduce_dtype=None, variant=""):
    from hvd_scale.adapters.torch.fsdp import DistributedOptimizer

    model = sharded(mesh, dtype, reduce_dtype, variant)
    opt = DistributedOptimizer(torch.optim.SGD(param_groups(model, groups), lr=LR), model,
                               policy=policy, backward_passes_per_step=k, budget=BUDGET,
                               samples=samples)
    vectors = []
    plan = opt.scaling.plan

    def recorded(statistics, *args, **kwargs):
        vectors.append(list(statistics))
        return plan(statistics, *args, **kwargs)
    opt.scaling.plan = recorded
    return model, opt, vectors


def train_step(model, opt, rank, step, k, mode, dtype=torch.float64, seen=None):
    """k passes and the step; ``seen``: |p.grad|^2 over the whole model before ``step()`` (what
    clipping there would see: the mean micro-gradient's) appended to it."""
    opt.zero_grad()
    for j in range(k):
        if mode == "workers":
            model.set_requires_gradient_sync(j == k - 1)
        loss = loss_of(model, rank, step, j) if dtype == torch.float64 else \
            _loss32(model, rank, step, j)
        loss.backward()
    model.set_requires_gradient_sync(True)
    if seen is not None:
        seen.append(float(sum(p.grad.full_tensor().square().sum() for p in model.parameters())))
    opt.step()


def _loss32(model, rank, step, j):
    from engines_worker import micro_batch
    x, y = micro_batch(rank, step, j)
    return torch.nn.functional.cross_entropy(model(x.float()), y)


def reference(policy_spec, k, mode, workers, groups=1, dtype=torch.float64, steps=STEPS):
    """One process: each step's W x k micro-gradients of an unsharded copy, the statistics per
    group as the engine's vector [s..., c, w, q...], ``Policy.transition``, SGD by hand."""
    from hvd_scale.spec import make_policy

    model = new_model().to(dtype)
    params = list(model.parameters())
    index = torch.tensor(sum(([g] * p.numel() for g, p in zip(group_index(groups), params)), []))
    policy = make_policy(policy_spec, budget=BUDGET, optimizer="SGD")
    state, scale, rows, vectors = policy.init(), float(workers * k), [], []

    def per_group(flat_sq):  # flat_sq: (..., P) squares -> per group sums
        return [float(flat_sq[..., index == g].sum()) for g in range(groups)]
    for step in range(steps):
        micro = []
        for rank in range(workers):
            for j in range(k):
                loss = loss_of(model, rank, step, j) if dtype == torch.float64 else \
                    _loss32(model, rank, step, j)
                grads = torch.autograd.grad(loss, params)
                micro.append(torch.cat([g.reshape(-1) for g in grads]).double())
        micro = torch.stack(micro)
        mean = micro.mean(0)
        if mode == "passes" or k == 1:
            s, reads = per_group(micro.square()), len(micro)
        else:
            sums = micro.view(workers, k, -1).sum(1)
            s, reads = [v / k for v in per_group(sums.square())], workers
        q = per_group(mean.square())
        vectors.append([*s, float(len(micro)), float(reads), *q])
        state, info = policy.transition(state, sum(s), sum(q), len(micro), scale=scale,
                                        samples=reads)
        with torch.no_grad():
            at = 0
            for p in params:
                p -= (LR * info.lr_factor * mean[at:at + p.numel()].view_as(p)).to(dtype)
                at += p.numel()
        st = state.estimator
        rows.append({"gain": info.gain, "lr_factor": info.lr_factor, "progress": state.progress,
                     "steps": state.steps})
    weights = np.concatenate([p.detach().double().numpy().reshape(-1) for p in params]).tolist()
    return {"rows": rows, "vectors": vectors, "weights": weights}


def runs(layout):
    """(run, policy, k, samples, groups, variant)."""
    if layout == "hsdp":
        for k in (1, 4):
            for mode in MODES:
                yield f"adascale/k={k}/{mode}", "adascale", k, mode, 1, ""
        return
    if layout == "alone":  # one process: every pass read (one worker has no variance)
        for k in (1, 4):
            yield f"adascale/k={k}/passes", "adascale", k, "passes", 1, ""
        return
    for policy in ("adascale", "linear"):
        for k in (1, 4):
            for mode in MODES:
                yield f"{policy}/k={k}/{mode}", policy, k, mode, 1, ""
    for mode in MODES:
        yield f"adascale/k=4/{mode}/groups", "adascale", 4, mode, 2, ""
    for variant in ("checkpointed", "compiled", "clipped"):
        yield f"adascale/k=2/workers/{variant}", "adascale", 2, "workers", 1, variant


class Counted:
    """Calls of torch.distributed's collectives by name while counting."""

    def __init__(self, names):
        self.calls = {n: 0 for n in names}
        self.saved = {}
        for name in names:
            inner = getattr(dist, name)
            self.saved[name] = inner

            def counted(*args, _name=name, _inner=inner, **kwargs):
                self.calls[_name] += 1
                return _inner(*args, **kwargs)
            setattr(dist, name, counted)

    def close(self):
        for name, inner in self.saved.items():
            setattr(dist, name, inner)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=("fsdp", "hsdp", "alone"), default="fsdp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = mesh_of(args.layout == "hsdp")
    for run, policy, k, mode, groups, variant in runs(args.layout):
        model, opt, vectors = build(mesh, policy, k, mode, groups,
                                    variant="" if variant == "clipped" else variant)
        rows, seen = [], [] if variant == "clipped" else None
        counted = Counted(["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
                           "broadcast", "all_gather"]) if run.startswith("adascale/k=4") else None
        try:
            for step in range(STEPS):
                train_step(model, opt, rank, step, k, mode, seen=seen)
                rows.append(row(opt))
        finally:
            if counted is not None:
                counted.close()
        emit_result({"rank": rank, "run": run, "scale": opt.scale, "rows": rows,
                     "vectors": vectors, "weights": full_weights(model),
                     "collectives": None if counted is None else counted.calls, "seen": seen,
                     "reference": reference(policy, k, mode, world, groups)})
        del model, opt
    if args.layout == "fsdp":
        for reduce_dtype in (torch.float16, torch.bfloat16):
            name = str(reduce_dtype).rpartition(".")[2]
            model, opt, vectors = build(mesh, "adascale", 2, "workers", 2, torch.float32, reduce_dtype)
            for step in range(3):
                train_step(model, opt, rank, step, 2, "workers", torch.float32)
            emit_result({"rank": rank, "run": f"mixed/{name}", "vectors": vectors,
                         "reference": reference("adascale", 2, "workers", world, 2, torch.float32,
                                                steps=3)})
            del model, opt
        emit_result({"rank": rank, "run": "short", **short_step(mesh, rank, world)})
        emit_result({"rank": rank, "run": "user comm", **user_comm(mesh, rank, world)})
        emit_result({"rank": rank, "run": "refusals", "refused": refusals(mesh, rank)})
    dist.destroy_process_group()
    return 0


def short_step(mesh, rank, world):
    """A fresh optimizer's first step at k = 3 where every rank takes two passes (the last
    batches; FSDP2's all-gathers in each forward leave no room for ranks to differ),
    samples="workers": n = 2 W micro-gradients at the step's own S = W k n / (W k) = 2 W, each
    rank's sum read once (|G_r|^2 / 2, W samples), p.grad the mean; the same by hand."""
    from hvd_scale.spec import make_policy

    k, passes = 3, [2] * world
    model, opt, vectors = build(mesh, "adascale", k, "workers")
    for j in range(passes[rank]):
        model.set_requires_gradient_sync(j == passes[rank] - 1)
        loss_of(model, rank, 0, j).backward()
    model.set_requires_gradient_sync(True)
    opt.step()
    twin = new_model()
    params = list(twin.parameters())
    sums, micro = [], []
    for r in range(world):
        grads = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            loss_of(twin, r, 0, j), params)]) for j in range(passes[r])]
        micro += grads
        sums.append(float(sum(grads).square().sum()) / passes[r])
    n, mean = len(micro), torch.stack(micro).mean(0)
    policy = make_policy("adascale", budget=BUDGET, optimizer="SGD")
    _, info = policy.transition(policy.init(), sum(sums), float(mean.square().sum()), n,
                                scale=float(world * k * n / (world * k)), samples=world)
    with torch.no_grad():
        at = 0
        for p in params:
            p -= LR * info.lr_factor * mean[at:at + p.numel()].view_as(p)
            at += p.numel()
    return {"vectors": vectors, "gain": opt.gain, "scale": opt.scale, "weights": full_weights(model),
            "reference": {"vectors": [[sum(sums), float(n), float(world),
                                       float(mean.square().sum())]],
                          "gain": info.gain, "weights": full_weights_of(params)}}


class UsersReduceScatter:
    """A user's own reduce-scatter (set_custom_reduce_scatter before hvd_scale): counts its calls."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
        self.inner, self.calls = DefaultReduceScatter(), 0

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return self.inner(output_tensor, input_tensor, group, op, async_op=async_op)


def user_comm(mesh, rank, world):
    """The user's own reduce-scatter set on each unit first: hvd_scale wraps it (it still runs,
    and the statistics are the reference's); one set after the optimizer is refused at the
    step. adascale, k = 2, samples="workers", 3 steps."""
    from hvd_scale.adapters.torch.fsdp import DistributedOptimizer

    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    ReduceScatter.register(UsersReduceScatter)  # an ABC: the user's class is one
    model = sharded(mesh)
    comms = [UsersReduceScatter(), UsersReduceScatter()]
    model[0].set_custom_reduce_scatter(comms[0])
    model[2].set_custom_reduce_scatter(comms[1])
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model,
                               policy="adascale", backward_passes_per_step=2, budget=BUDGET,
                               samples="workers")
    vectors, plan = [], opt.scaling.plan
    opt.scaling.plan = lambda st, *a, **kw: (vectors.append(list(st)), plan(st, *a, **kw))[1]
    for step in range(3):
        train_step(model, opt, rank, step, 2, "workers")
    model[2].set_custom_reduce_scatter(UsersReduceScatter())  # after: hvd_scale's is gone
    try:
        train_step(model, opt, rank, 3, 2, "workers")
        replaced = "accepted"
    except (ValueError, RuntimeError) as e:
        replaced = str(e)[:200]
    return {"vectors": vectors, "calls": [c.calls for c in comms], "replaced": replaced,
            "reference": reference("adascale", 2, "workers", world, steps=3)}


def full_weights_of(params):
    return np.concatenate([p.detach().double().numpy().reshape(-1) for p in params]).tolist()


def refusals(mesh, rank):
    """Each refusal's message (the first 80 characters), or "accepted"."""
    from hvd_scale.adapters.torch import fsdp

    out = {}

    def attempt(name, make, train=None):
        try:
            model, opt = make()
            if train is not None:
                train(model, opt)
            out[name] = "accepted"
        except (ValueError, TypeError, RuntimeError) as e:
            out[name] = str(e)[:160]

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=LR)

    def divided():
        model = sharded(mesh)
        model[0].set_gradient_divide_factor(4.0)
        return model, fsdp.DistributedOptimizer(sgd(model), model)
    attempt("divide factor", divided)
    attempt("adascale_adam", lambda: (lambda m: (m, fsdp.DistributedOptimizer(
        torch.optim.AdamW(m.parameters()), m, policy="adascale_adam")))(sharded(mesh)))
    attempt("grad_scaler", lambda: (lambda m: (m, fsdp.DistributedOptimizer(
        sgd(m), m, grad_scaler=torch.amp.GradScaler("cpu"))))(sharded(mesh)))
    attempt("measure=False", lambda: (lambda m: (m, fsdp.DistributedOptimizer(
        sgd(m), m, measure=False)))(sharded(mesh)))
    attempt("not sharded", lambda: (lambda m: (m, fsdp.DistributedOptimizer(sgd(m), m)))(new_model()))

    def workers_reduced_every_pass(model, opt):  # samples="workers" but no gradient sync off
        for step in range(2):
            opt.zero_grad()
            for j in range(2):
                loss_of(model, rank, step, j).backward()
            opt.step()
    attempt("workers, reduced every pass", lambda: (lambda m: (m, fsdp.DistributedOptimizer(
        sgd(m), m, backward_passes_per_step=2, samples="workers")))(sharded(mesh)),
        workers_reduced_every_pass)

    def passes_accumulated(model, opt):  # samples="passes" but sync off on the first pass
        opt.zero_grad()
        for j in range(2):
            model.set_requires_gradient_sync(j == 1)
            loss_of(model, rank, 0, j).backward()
        opt.step()
    attempt("passes, accumulated", lambda: (lambda m: (m, fsdp.DistributedOptimizer(
        sgd(m), m, backward_passes_per_step=2, samples="passes")))(sharded(mesh)),
        passes_accumulated)
    return out


if __name__ == "__main__":
    sys.exit(main())
