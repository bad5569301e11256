"""Run under horovodrun: checks of the torch adapter, each printing RESULT lines for the parent.

Every rank draws its own micro-batches from a seed that depends on (rank, step, pass), and can
therefore also rebuild *all* ranks' micro-batches to compute a single-process reference.
"""

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import tempfile

import horovod.torch as hvd
import numpy as np
import torch

from _reference import read_sums
from _report import emit_result, error_of
from hvd_scale import GainEstimator
from hvd_scale.metrics import TIMING_METRICS
from hvd_scale.adapters.torch import DistributedOptimizer, ScaleInvariantScheduler, broadcast_state

LR = 0.05


def emit(case, **values):
    emit_result({"case": case, "rank": hvd.rank(), **values})


class WithUnused(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body
        self.extra = torch.nn.Linear(4, 4)  # never used in forward: its grad stays None

    def forward(self, x):
        return self.body(x)


def make_model(seed=0, unused=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return (WithUnused(model) if unused else model).double()


def micro_batch(rank, step, k_pass, size=16):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k_pass)
    x = torch.randn(size, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (size,), generator=g)
    return x, y


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def flat_grads(model, groups):
    """Per-group flattened gradient of the current .grad."""
    return [torch.cat([p.grad.reshape(-1) for p in g if p.grad is not None]) for g in groups]


def params_vector(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def two_groups(model):
    return [[model[0].weight, model[0].bias], [model[2].weight, model[2].bias]]


def reference_step(ref, groups, batches, estimator, lrs, shrink=1.0):
    """One step of the one-process reference: every micro-batch's gradient (``batches``: every
    rank's, rank-major), read as the adapter reads them (``_reference``), the estimator's gain,
    and SGD with lr x gain x shrink x the mean micro-gradient, per group. Returns the gain."""
    per_micro = []
    for x, y in batches:
        ref.zero_grad()
        loss_fn(ref, x, y).backward()
        per_micro.append(flat_grads(ref, groups(ref)))
    count = len(per_micro[0])
    read = [read_sums([g[i] for g in per_micro], hvd.size()) for i in range(count)]
    mean = [torch.stack([g[i] for g in per_micro]).mean(0) for i in range(count)]
    gain = estimator.update([s for s, _ in read], [float(m.square().sum()) for m in mean],
                            len(batches), samples=read[0][1])
    with torch.no_grad():
        for i, group in enumerate(groups(ref)):
            offset = 0
            for p in group:
                if p.grad is not None:  # an unused parameter has none
                    p -= lrs[i] * gain * shrink * mean[i][offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
    return gain


def case_reference(k, divide_loss):
    """Adapter vs one-process reference; SGD without momentum, two parameter groups."""
    size = hvd.size()
    model = make_model()
    ref = copy.deepcopy(model)
    groups = two_groups(model)
    opt = torch.optim.SGD([{"params": groups[0]}, {"params": groups[1], "lr": LR / 2}], lr=LR)
    opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(), policy="adascale",
                               backward_passes_per_step=k)
    ref_est = GainEstimator(scale=size * k)
    ref_opt_lrs = [LR, LR / 2]
    rows = []
    for step in range(4):
        opt.zero_grad()
        for j in range(k):
            x, y = micro_batch(hvd.rank(), step, j)
            loss = loss_fn(model, x, y)
            (loss / k if divide_loss else loss).backward()
        opt.step()
        # Reference: all ranks' micro-batches in one process, groups with their own lr.
        # hvd_scale applies the mean of the user's micro-gradients: with loss / k they are k
        # times smaller than the reference's (a Horovod habit that hvd_scale does not need).
        batches = [micro_batch(r, step, j) for r in range(size) for j in range(k)]
        gain = reference_step(ref, two_groups, batches, ref_est, ref_opt_lrs,
                              shrink=1 / k if divide_loss else 1)
        rows.append({"gain": opt.gain, "ref_gain": gain, "sigma2": opt.sigma2,
                     "ref_sigma2": ref_est.sigma2, "mu2": opt.mu2, "ref_mu2": ref_est.mu2,
                     "progress": opt.progress,
                     "max_param_diff": float((params_vector(model) - params_vector(ref)).abs().max()),
                     "lrs_after": [g["lr"] for g in opt.param_groups]})
    emit(f"reference_k{k}_{'mean' if divide_loss else 'sum'}", scale=opt.scale, rows=rows)


def case_policies():
    """Each policy's factor is what the parameters moved by; the user's lr comes back."""
    out = {}
    for spec in ["none", "linear", "sqrt", "warmup:baseline_steps=4", "adascale", "power:alpha=0.7",
                 "fixed:factor=3", "warmup:rule=sqrt,baseline_steps=4", "legw:steps=2"]:
        model = make_model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(), policy=spec)
        factors, lrs = [], []
        for step in range(3):
            opt.zero_grad()
            x, y = micro_batch(hvd.rank(), step, 0)
            loss_fn(model, x, y).backward()
            before = params_vector(model).clone()
            opt.step()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # averaged
            moved = before - params_vector(model)
            factors.append(float(moved.dot(grad) / grad.dot(grad)) / LR)
            lrs.append(opt.param_groups[0]["lr"])
        out[spec] = {"factors": factors, "lrs": lrs, "gain": opt.gain, "progress": opt.progress}
    emit("policies", scale=hvd.size(), policies=out)


def train(model, opt, steps, start=0, scheduler=None):
    losses = []
    for step in range(start, steps):
        opt.zero_grad()
        x, y = micro_batch(hvd.rank(), step, 0)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(hvd.allreduce(loss.detach(), name=f"loss{step}")))
    return losses


def new_run():
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                               named_parameters=model.named_parameters(), policy="adascale")
    sched = ScaleInvariantScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5), opt)
    return model, opt, sched


def case_checkpoint():
    """Resuming from a checkpoint reproduces the uninterrupted run."""
    model, opt, sched = new_run()
    full = train(model, opt, 8, scheduler=sched)
    full_state = opt.state_dict()["hvd_scale"]

    model, opt, sched = new_run()
    first = train(model, opt, 4, scheduler=sched)
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/ckpt.pt"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict()}, path)
        model, opt, sched = new_run()
        ckpt = torch.load(path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
    rest = train(model, opt, 8, start=4, scheduler=sched)
    emit("checkpoint", full=full, resumed=first + rest,
         full_progress=full_state["policy"]["progress"], resumed_progress=opt.progress,
         lr=opt.param_groups[0]["lr"])


def case_amp():
    """GradScaler: statistics unscaled; an overflowing step changes neither weights nor tau."""
    model = make_model().float()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(), policy="adascale",
                               grad_scaler=scaler)
    plain = make_model().float()
    plain_opt = DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=LR),
                                     named_parameters=plain.named_parameters(), policy="adascale")
    rows = []
    for step in range(4):
        x, y = micro_batch(hvd.rank(), step, 0)
        x = x.float()
        if step == 2 and hvd.rank() == 1:
            x = x * float("inf")  # one worker overflows: every rank must skip
        opt.zero_grad()
        scaler.scale(loss_fn(model, x, y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        before = params_vector(model).clone()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        moved = float((params_vector(model) - before).abs().max())
        if step != 2:
            plain_opt.zero_grad()
            loss_fn(plain, x, y).backward()
            plain_opt.step()
        rows.append({"step": step, "moved": moved, "progress": opt.progress, "gain": opt.gain,
                     "sigma2": opt.sigma2, "plain_sigma2": plain_opt.sigma2})
    # The skip is counted when the next step synchronizes.
    emit("amp", rows=rows, skipped=opt.skipped)


def case_nonfinite():
    """Without AMP a non-finite gradient skips the step on every rank, weights untouched."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(), policy="adascale")
    rows = []
    for step in range(3):
        x, y = micro_batch(hvd.rank(), step, 0)
        if step == 1 and hvd.rank() == 0:
            x = x * float("nan")
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        before = params_vector(model).clone()
        opt.step()
        after = params_vector(model)
        rows.append({"moved": float((after - before).abs().max()) if torch.isfinite(after).all()
                     else float("nan"), "progress": opt.progress})
    emit("nonfinite", rows=rows, skipped=opt.skipped)


def case_unused():
    """A parameter with no gradient and set_to_none zeroing: runs, gain from the used ones."""
    model = make_model(unused=True)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(), policy="adascale")
    extra_before = model.extra.weight.detach().clone()
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = micro_batch(hvd.rank(), step, 0)
        loss_fn(model, x, y).backward()
        opt.step()
    emit("unused", gain=opt.gain, progress=opt.progress,
         extra_unchanged=bool(torch.equal(extra_before, model.extra.weight.detach())))


def case_many_tensors():
    """Gradients sent in several buckets (48 used tensors, one of 2**18 elements), two parameter
    groups, and an unused layer whose gradients never come: the statistics and the update
    still equal a one-process reference."""
    size = hvd.size()
    torch.manual_seed(1)
    layers = [torch.nn.Linear(8, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
              torch.nn.Linear(512, 16)]
    for _ in range(20):
        layers += [torch.nn.Tanh(), torch.nn.Linear(16, 16)]
    layers += [torch.nn.Tanh(), torch.nn.Linear(16, 3)]
    model = WithUnused(torch.nn.Sequential(*layers)).double()
    ref = copy.deepcopy(model)

    def groups(m):
        params = [p for p in m.body.parameters()]
        return [params[:24], params[24:] + list(m.extra.parameters())]

    opt = DistributedOptimizer(torch.optim.SGD([{"params": g} for g in groups(model)], lr=LR),
                               named_parameters=model.named_parameters(), policy="adascale")
    ref_est = GainEstimator(scale=size)
    rows = []
    for step in range(3):
        opt.zero_grad()
        x, y = micro_batch(hvd.rank(), step, 0)
        loss_fn(model, x, y).backward()
        opt.step()
        gain = reference_step(ref, groups, [micro_batch(r, step, 0) for r in range(size)],
                              ref_est, [LR, LR])
        rows.append({"gain": opt.gain, "ref_gain": gain, "sigma2": opt.sigma2,
                     "ref_sigma2": ref_est.sigma2, "mu2": opt.mu2, "ref_mu2": ref_est.mu2,
                     "max_param_diff": float((params_vector(model) - params_vector(ref)).abs().max())})
    emit("many_tensors", rows=rows, tensors=sum(1 for _ in model.parameters()))


def case_bad_policy():
    model = make_model()
    try:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), policy="adascale:smooth=1")
        emit("bad_policy", error=None)
    except ValueError as e:
        emit("bad_policy", error=str(e))
    try:
        DistributedOptimizer(torch.optim.Adam(model.parameters()), policy="adascale")
        emit("bad_optimizer", error=None)
    except ValueError as e:
        emit("bad_optimizer", error=str(e))


def case_adam():
    """adascale_adam: statistics of the preconditioned gradient once Adam's second moment has
    history (step 21 on), lr x sqrt(gain), tau += gain; and plain adascale's sigma2 beside it."""
    plain = make_model()
    sgd = DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=LR),
                               named_parameters=plain.named_parameters(), policy="adascale")
    for step in range(4):
        sgd.zero_grad()
        loss_fn(plain, *micro_batch(hvd.rank(), step, 0)).backward()
        sgd.step()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                               named_parameters=model.named_parameters(), policy="adascale_adam")
    rows = []
    for step in range(24):
        opt.zero_grad()
        x, y = micro_batch(hvd.rank(), step, 0)
        loss_fn(model, x, y).backward()
        opt.step()
        rows.append({"gain": opt.gain, "lr_factor": opt.lr_factor, "progress": opt.progress,
                     "sigma2": opt.sigma2})
    # The preconditioned gradient, computed in a reused buffer, is exactly g / (sqrt(v_hat) + eps)
    # and leaves g as it was.
    group = opt.param_groups[0]
    p = group["params"][0]
    g = torch.randn_like(p)
    g_before = g.clone()
    # Adam's v after these steps, its horizons in progress: bias correction 1 - beta2 ** tau.
    bias_correction2 = 1 - group["betas"][1] ** opt.progress
    v_hat = opt.state[p]["exp_avg_sq"] / bias_correction2
    # v_hat floored at (1 - beta2) / c2 x its mean (core.precondition: weights whose v is empty)
    v_hat = torch.maximum(v_hat, (1 - group["betas"][1]) / bias_correction2 * v_hat.mean())
    expected = g / (v_hat.sqrt() + group["eps"])
    exact = torch.equal(opt._statistics.preconditioned(p, g, group), expected)
    # The statistics' batched path (foreach ops over a bucket, in chunks) gives each tensor's
    # |P g| as the one-tensor path does, to float32 rounding (the floor's mean summed in
    # another order); with chunks of one element, every tensor in a chunk of its own.
    params = [q for q in model.parameters()]
    grads = [torch.randn_like(q) for q in params]
    single = torch.stack([torch.linalg.vector_norm(opt._statistics.preconditioned(q, h, group)).double()
                          for q, h in zip(params, grads)])
    batched = opt._statistics.grad_norms(params, grads)
    from hvd_scale.adapters.torch import statistics as statistics_module
    chunk = statistics_module.PRECONDITION_CHUNK
    statistics_module.PRECONDITION_CHUNK = 1
    try:
        one_by_one = opt._statistics.grad_norms(params, grads)
    finally:
        statistics_module.PRECONDITION_CHUNK = chunk
    batched_error = max(float((batched / single - 1).abs().max()),
                        float((one_by_one / single - 1).abs().max()))
    emit("adam", rows=rows, lr=opt.param_groups[0]["lr"], precondition_exact=exact,
         batched_error=batched_error, tensors=len(params),
         plain_sigma2=sgd.sigma2, history=opt.policy.MIN_ADAM_HISTORY,
         grad_untouched=torch.equal(g, g_before))


def case_adam_horizons():
    """adascale_adam's default, Adam's moment horizons in progress: every step sets betas^r and
    eps / sqrt(r), the bias correction is 1 - beta^tau, AdamW decays by (1 - lr wd)^r; the weights
    equal a one-process reference that applies this rule by hand to all ranks' micro-batches, and
    the user's betas, eps and weight decay are what param_groups and state_dict() show, also after
    a resume. AdamW goes through broadcast_state first, as the docs show: a fresh optimizer's
    state after it is a single worker's (issue 58 item 4: Horovod's broadcast took a step on zero
    gradients, which Adam counted: t one ahead of one process's), so the same reference holds."""
    k, size, lr, betas, eps = 2, hvd.size(), 0.01, (0.9, 0.98), 1e-6
    out = {}
    # "capped": a cap below the gains measured here (S = 4), so it binds (issue #21's cap);
    # "power": #21's measured alternative (lr x r^0.75), a path to the lr of its own.
    for label, kind, wd, spec in (("Adam", "Adam", 0.0, "adascale_adam"),
                                  ("AdamW", "AdamW", 0.05, "adascale_adam"),
                                  ("capped", "Adam", 0.0, "adascale_adam:max_gain=1.5"),
                                  ("power", "Adam", 0.0, "adascale_adam:lr_power=0.75")):
        model = make_model()
        inner = getattr(torch.optim, kind)(model.parameters(), lr=lr, betas=betas, eps=eps,
                                           weight_decay=wd)
        opt = DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   policy=spec, backward_passes_per_step=k)
        if kind == "AdamW":
            broadcast_state(model, opt)
        ref = copy.deepcopy(model)
        moments = [[torch.zeros_like(p), torch.zeros_like(p)] for p in ref.parameters()]
        rows = []
        for step in range(26):
            opt.zero_grad()
            for j in range(k):
                loss_fn(model, *micro_batch(hvd.rank(), step, j)).backward()
            before = opt.progress
            opt.step()
            tau = opt.progress
            r = tau - before  # the step's gain: tau advances by it
            # The gain the betas and eps follow, and the bias correction's exponent.
            horizon, exponent = r, tau
            grads = []
            for rank in range(size):
                for j in range(k):
                    ref.zero_grad()
                    loss_fn(ref, *micro_batch(rank, step, j)).backward()
                    grads.append([p.grad.clone() for p in ref.parameters()])
            with torch.no_grad():
                for i, p in enumerate(ref.parameters()):
                    g = torch.stack([gs[i] for gs in grads]).mean(0)
                    m, v = moments[i]
                    b1, b2 = betas[0] ** horizon, betas[1] ** horizon
                    p.mul_((1 - lr * wd) ** r)
                    m.mul_(b1).add_(g, alpha=1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    c1, c2 = 1 - betas[0] ** exponent, 1 - betas[1] ** exponent
                    p.sub_(lr * opt.lr_factor / c1 * m / ((v / c2).sqrt() + eps / math.sqrt(horizon)))
            rows.append({"gain": r, "lr_factor": opt.lr_factor, "progress": tau,
                         "measured": opt.policy.estimator(opt.run_state.policy, opt.scale).gain,
                         "diff": float((params_vector(model) - params_vector(ref)).abs().max())})
        group = opt.param_groups[0]
        saved = opt.state_dict()
        model2 = make_model()
        opt2 = DistributedOptimizer(getattr(torch.optim, kind)(model2.parameters(), lr=lr, betas=betas,
                                                               eps=eps, weight_decay=wd),
                                    named_parameters=model2.named_parameters(),
                                    policy=spec, backward_passes_per_step=k)
        opt2.load_state_dict(saved)
        out[label] = {"rows": rows, "scale": opt.scale,
                     "after": [list(group["betas"]), group["eps"], group["weight_decay"], group["lr"]],
                     "saved": [list(saved["inner"]["param_groups"][0][key]) if key == "betas"
                               else saved["inner"]["param_groups"][0][key]
                               for key in ("betas", "eps", "weight_decay", "lr")],
                     "resumed": [list(opt2.param_groups[0]["betas"]), opt2.param_groups[0]["eps"],
                                 opt2.param_groups[0]["weight_decay"], opt2.param_groups[0]["lr"]],
                     "resumed_progress": opt2.progress}
    emit("adam_horizons", **out)


def case_passes_change():
    """set_passes mid-run (what adapt='goodput' does): k = 1, 3, 2 on both ranks; gain, tau and
    weights equal the one-process reference replaying the same micro-batches at S = 2k; then a
    checkpoint saved at k = 3 resumes at k = 3 (S = 6) in an optimizer built at k = 1."""
    size = hvd.size()

    def build(model):
        groups = two_groups(model)
        opt = torch.optim.SGD([{"params": groups[0]}, {"params": groups[1], "lr": LR / 2}], lr=LR)
        return DistributedOptimizer(opt, named_parameters=model.named_parameters(), policy="adascale",
                                    adapt="goodput", max_passes=4, adapt_every=10_000)

    model = make_model()
    ref = copy.deepcopy(model)
    opt = build(model)
    ref_est = GainEstimator(scale=size)
    rows, saved = [], None
    for step, k in enumerate([1, 1, 3, 3, 2, 2]):
        if step == 4:  # before the change to k = 2: the state at k = 3
            saved = (copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict()))
        if k != opt.backward_passes_per_step:
            opt.set_passes(k)
            ref_est.rescale(size * k)
        opt.zero_grad()
        for j in range(opt.backward_passes_per_step):
            loss_fn(model, *micro_batch(hvd.rank(), step, j)).backward()
        opt.step()
        batches = [micro_batch(r, step, j) for r in range(size) for j in range(k)]
        gain = reference_step(ref, two_groups, batches, ref_est, [LR, LR / 2])
        rows.append({"k": k, "scale": opt.scale, "gain": opt.gain, "ref_gain": gain,
                     "progress": opt.progress,
                     "timing": {k: v for k, v in opt.metrics().items() if k in TIMING_METRICS},
                     "diff": float((params_vector(model) - params_vector(ref)).abs().max())})
    resumed_model = make_model()
    resumed_model.load_state_dict(saved[1])
    resumed = build(resumed_model)
    resumed.load_state_dict(saved[0])
    emit("passes_change", rows=rows, saved_passes=saved[0]["hvd_scale"]["passes"],
         resumed={"k": resumed.backward_passes_per_step, "scale": resumed.scale,
                  "progress": resumed.progress, "horovod_k": resumed._hvd_opt.backward_passes_per_step})


def case_adapt_goodput():
    """adapt='goodput' on a model whose allreduce dwarfs its passes (a 1M-parameter layer, 4
    samples a pass, random labels: gradients of pure noise, so the gain is ~S): the ranks agree
    on k every 5 steps and the job ends with k > 1; every rank takes the same k at every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.Linear(4096, 2))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                               named_parameters=model.named_parameters(), policy="adascale",
                               adapt="goodput", max_passes=8, adapt_every=5)
    ks = []
    for step in range(40):
        k = opt.backward_passes_per_step
        ks.append(k)
        opt.zero_grad()
        for j in range(k):
            g = torch.Generator().manual_seed(1000 * step + 10 * hvd.rank() + j)
            x, y = torch.randn(4, 256, generator=g), torch.randint(0, 2, (4,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    emit("adapt_goodput", ks=ks, scale=opt.scale, final_k=opt.backward_passes_per_step,
         checksum=float(sum(p.double().sum() for p in model.parameters())),
         model=dataclasses.asdict(opt.scaling.clock.model(hvd.size())))


def case_one_rank_load():
    """A checkpoint loaded on rank 0 only (no broadcast_state after it): the first step raises a
    ValueError on every rank naming each rank's state; loaded on every rank, training goes on."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(), policy="adascale")
    train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    out = {}
    for name, loaders in (("every_rank", (0, 1)), ("rank0_only", (0,))):
        model = make_model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(), policy="adascale")
        if hvd.rank() in loaders:
            opt.load_state_dict(saved)
        try:
            train(model, opt, 3, start=2)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    emit("one_rank_load", **out)


def case_misuse():
    """Bad set-ups raise the same clear error on every rank, and nothing hangs."""
    model = make_model()
    errors = {}
    attempts = {
        "differ": lambda: DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                               policy=["adascale", "linear"][hvd.rank()]),
        "one_bad": lambda: DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                                policy=["adascale", "adascal"][hvd.rank()]),
        "zero_lr": lambda: DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0)),
    }
    for name, make in attempts.items():
        try:
            make()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    # nonfinite="raise": every rank raises on the same step.
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(), nonfinite="raise")
    x, y = micro_batch(hvd.rank(), 0, 0)
    if hvd.rank() == 0:
        x = x * float("nan")
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    try:
        opt.step()
        errors["raise_nonfinite"] = None
    except FloatingPointError as e:
        errors["raise_nonfinite"] = str(e)
    # A checkpoint from another model (two parameter groups) is refused, nothing changes.
    groups = two_groups(model)
    two = DistributedOptimizer(torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=LR))
    one = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    before = json.dumps(one.state_dict()["hvd_scale"])
    try:
        one.load_state_dict(two.state_dict())
        errors["wrong_checkpoint"] = None
    except ValueError as e:
        errors["wrong_checkpoint"] = str(e)
    emit("misuse", errors=errors, unchanged=json.dumps(one.state_dict()["hvd_scale"]) == before)


def case_hardening():
    """Issue #22, items 1, 4, 5, 6: what the ranks must agree on, bounds on budget and lr, large
    finite gradients, checkpoints of another model. Each part says what every rank saw."""
    rank = hvd.rank()
    out = {}

    def sgd(model, **kw):
        return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                    named_parameters=model.named_parameters(), **kw)

    # 1. Set-up values that differ between ranks: one error on every rank, naming each value.
    model = make_model()
    out["differ_scale"] = error_of(lambda: sgd(model, policy="linear", scale=[2, 4][rank]))
    out["differ_budget"] = error_of(lambda: sgd(model, policy="linear", budget=[100, 200][rank]))
    # 4. Budget bounds.
    out["budget_zero"] = error_of(lambda: sgd(model, policy="linear", budget=0))
    out["budget_nan"] = error_of(lambda: sgd(model, policy="linear", budget=float("nan")))

    # 4. An lr made negative or nan after construction: refused on every rank, nothing applied
    # or counted, and the job goes on in step (the next step's collectives match).
    model = make_model()
    groups = two_groups(model)
    opt = DistributedOptimizer(torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}],
                                               lr=LR, momentum=0.9),
                               named_parameters=model.named_parameters(), policy="adascale")
    bad_lr = {}
    for step, lr in enumerate([None, -LR, float("nan"), None]):
        opt.zero_grad()
        loss_fn(model, *micro_batch(rank, step, 0)).backward()
        if lr is not None:
            opt.param_groups[1]["lr"] = lr
        before = params_vector(model).clone()
        error = error_of(opt.step)
        opt.param_groups[1]["lr"] = LR
        bad_lr[str(step)] = {"error": error, "moved": float((params_vector(model) - before).abs().max()),
                             "steps": opt.steps, "skipped": opt.skipped,
                             "progress": opt.progress}
    bad_lr["weights_sum"] = float(hvd.allreduce(params_vector(model).sum(), op=hvd.Sum,
                                                name="hardening.weights")) / hvd.size()
    bad_lr["mine_sum"] = float(params_vector(model).sum())
    out["bad_lr"] = bad_lr

    # 5. Finite float32 gradients with |g| ~ 1e21 (float32 squares overflow above ~1.8e19): the
    # step is applied, with finite statistics; one pass (bucketed norms), two (hooks), unmeasured.
    large = {}
    for name, kw in {"k1": {"policy": "adascale"}, "k2": {"policy": "adascale",
                                                           "backward_passes_per_step": 2},
                     "unmeasured": {"policy": "linear", "measure": False}}.items():
        model, ref = make_model().float(), make_model().float()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-23),
                                   named_parameters=model.named_parameters(), **kw)
        k = kw.get("backward_passes_per_step", 1)
        opt.zero_grad()
        before = params_vector(model).clone()
        for j in range(k):
            x, y = micro_batch(rank, 0, j)
            (loss_fn(model, x.float(), y) * 1e21).backward()
            (loss_fn(ref, x.float(), y) * 1e21).backward()  # p.grad here is not Horovod's
        grad_norm = float(torch.stack([p.grad.double().norm() for p in ref.parameters()]).norm())
        error = error_of(opt.step)
        after = params_vector(model)
        large[name] = {"error": error, "grad_norm": grad_norm, "skipped": opt.skipped,
                       "steps": opt.steps, "progress": opt.progress,
                       "moved": float((after - before).abs().max()),
                       "finite": bool(torch.isfinite(after).all()),
                       "sigma2": opt.sigma2, "mu2": opt.mu2}
    out["large_gradients"] = large

    # 6. A checkpoint of another model (same number of groups, other shapes): refused at load,
    # before anything changes, on every rank; neither the optimizer nor the checkpoint changes.
    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).double()
    model = make_model()
    other_opt, opt = (DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9),
                                           named_parameters=m.named_parameters())
                      for m in (other, model))
    for m, o in ((other, other_opt), (model, opt)):
        o.zero_grad()
        loss_fn(m, *micro_batch(rank, 0, 0)).backward()
        o.step()
    saved = other_opt.state_dict()
    saved_copy = copy.deepcopy(saved)
    mine = copy.deepcopy(opt.state_dict())
    load_error = error_of(lambda: opt.load_state_dict(saved))
    first_step_error = None
    if load_error is None:  # what the first step then does (the issue: it fails inside torch)
        opt.zero_grad()
        loss_fn(model, *micro_batch(rank, 1, 0)).backward()
        first_step_error = error_of(opt.step)

    def same(a, b):
        if torch.is_tensor(a):
            return torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    out["other_model"] = {"load_error": load_error, "first_step_error": first_step_error,
                          "optimizer_unchanged": same(opt.state_dict(), mine),
                          "checkpoint_unchanged": same(saved, saved_copy)}
    # Every rank is still in step: a collective completes.
    out["alive"] = float(hvd.allreduce(torch.tensor(1.0), op=hvd.Sum, name="hardening.alive"))
    emit("hardening", **out)


class EmbeddingModel(torch.nn.Module):
    """A bag of token embeddings and a linear head: nn.Embedding(sparse=True) gives sparse
    gradients (with duplicate indices within a batch and across passes)."""

    def __init__(self, sparse, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = torch.nn.Embedding(20, 4, sparse=sparse)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(1))


def token_batch(rank, step, k_pass):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k_pass)
    return torch.randint(0, 20, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)


def run_options(model, batch, steps=3, k=1, dtype=None, **kw):
    """A few SGD steps through DistributedOptimizer(**kw); what every rank saw."""
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(),
                               backward_passes_per_step=k, **kw)
    rows = []
    for step in range(steps):
        opt.zero_grad()
        for j in range(k):
            x, y = batch(hvd.rank(), step, j)
            x = x if dtype is None else x.to(dtype)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        rows.append({"gain": opt.gain, "sigma2": opt.sigma2, "mu2": opt.mu2,
                     "progress": opt.progress})
    weights = params_vector(model)
    mean = hvd.allreduce(weights, op=hvd.Average)
    return {"rows": rows, "scale": opt.scale, "finite": bool(torch.isfinite(weights).all()),
            "weights": weights.tolist(), "spread": float((weights - mean).abs().max())}


def case_options():
    """Issue #22, item 3: each option hvd_scale passes through to hvd.DistributedOptimizer
    trains (equal weights on every rank, gain in [1, S]); sparse gradients give the statistics
    of the same model with a dense embedding; Adasum is refused up front, on every rank."""
    out = {}

    def attempt(key, *args, **kw):
        """out[key]: what each rank raised (None), out[key + '_run']: the run's results."""
        try:
            out[f"{key}_run"], out[key] = run_options(*args, **kw), None
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out[key] = f"{type(e).__name__}: {e}"

    for name, k, kw in (("fp16", 1, {"compression": hvd.Compression.fp16}),
                        ("predivide", 1, {"gradient_predivide_factor": 2.0}),
                        ("groups", 1, {"groups": 2}), ("groups_k2", 2, {"groups": 2})):
        attempt(name, make_model().float(), micro_batch, k=k, dtype=torch.float32,
                policy="adascale", **kw)
    for k in (1, 2):
        for policy, measure in (("adascale", None), ("linear", False)):
            dense = run_options(EmbeddingModel(sparse=False), token_batch, k=k, policy=policy,
                                measure=measure)
            for kind, kw in (("sparse", {}), ("sparse_as_dense", {"sparse_as_dense": True})):
                key = f"{kind}_k{k}_{policy}"
                attempt(key, EmbeddingModel(sparse=True), token_batch, k=k, policy=policy,
                        measure=measure, **kw)
                out[f"{key}_dense"] = dense
    for policy in ("adascale", "linear", "none"):
        out[f"adasum_{policy}"] = error_of(lambda: run_options(
            make_model(), micro_batch, op=hvd.Adasum, policy=policy, measure=False))
    out["alive"] = float(hvd.allreduce(torch.tensor(1.0), op=hvd.Sum, name="options.alive"))
    emit("options", **out)


def case_join():
    """Issue #22, item 7: uneven data with hvd.join(). Rank 0 has 4 steps of data, rank 1 has 2
    and joins when out of it; the steps rank 0 takes alone count only its own micro-batches
    (a joined rank's allreduce contributes zeros: no micro-batch of it may count). Reference:
    the same steps in one process over the micro-batches each step really had."""
    out = {}
    for name, k, kw in (("adascale_k2", 2, {"policy": "adascale"}),
                        ("linear_k1", 1, {"policy": "linear", "measure": True}),
                        ("adascale_k1", 1, {"policy": "adascale"})):
        model = make_model()
        ref = copy.deepcopy(model)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=k, **kw)
        rows, error = [], None
        try:
            for step in range(4 if hvd.rank() == 0 else 2):
                opt.zero_grad()
                for j in range(k):
                    loss_fn(model, *micro_batch(hvd.rank(), step, j)).backward()
                opt.step()
                ranks = range(hvd.size()) if step < 2 else [0]
                batches = [micro_batch(r, step, j) for r in ranks for j in range(k)]
                mean = None
                for x, y in batches:
                    ref.zero_grad()
                    loss_fn(ref, x, y).backward()
                    g = [p.grad.clone() for p in ref.parameters()]
                    mean = g if mean is None else [a + b for a, b in zip(mean, g)]
                with torch.no_grad():  # plain SGD with the mean of the step's micro-gradients
                    for p, g in zip(ref.parameters(), mean):
                        p -= LR * opt.lr_factor * g / len(batches)
                rows.append({"gain": opt.gain, "lr_factor": opt.lr_factor, "progress": opt.progress,
                             "diff": float((params_vector(model) - params_vector(ref)).abs().max())})
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            error = f"{type(e).__name__}: {e}"
        last = hvd.join()
        out[name] = {"rows": rows, "error": error, "last_joined": last, "scale": opt.scale}
    emit("join", **out)


def steps_for_resize(model, opt, start, stop, passes):
    """Steps whose micro-batches are (rank r, step) for r in 0..1, whatever the layout:
    2 workers x 1 pass, or 1 worker x 2 passes (each pass's mean loss: hvd_scale applies the
    mean micro-gradient in both layouts)."""
    losses = []
    for step in range(start, stop):
        opt.zero_grad()
        total = 0.0
        for j in range(passes):
            x, y = micro_batch(hvd.rank() if passes == 1 else j, step, 0)
            loss = loss_fn(model, x, y)
            loss.backward()
            total += float(loss) / passes
        opt.step()
        total = float(hvd.allreduce(torch.tensor(total, dtype=torch.float64), name=f"rl{step}")) \
            if passes == 1 else total
        losses.append([total, opt.gain, float(params_vector(model).sum())])
    return losses


def case_save_for_resize():
    """np 2: run 8 steps, saving a checkpoint after 4 (for the np 1 x accumulation 2 resume)."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                               named_parameters=model.named_parameters(), policy="adascale")
    steps_for_resize(model, opt, 0, 4, 1)
    path = os.environ["HVD_SCALE_TEST_DIR"]
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}/resize.pt")
    rest = steps_for_resize(model, opt, 4, 8, 1)
    emit("save_for_resize", rest=rest, progress=opt.progress, gain=opt.gain)


def case_resume_np1():
    """np 1 x 2 passes (same S = 2) resumes the np 2 checkpoint and continues identically."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                               named_parameters=model.named_parameters(), policy="adascale",
                               backward_passes_per_step=2)
    ckpt = torch.load(f"{os.environ['HVD_SCALE_TEST_DIR']}/resize.pt", weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    rest = steps_for_resize(model, opt, 4, 8, 2)
    try:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), policy="adascale", scale=2)
        n1_error = None
    except ValueError as e:
        n1_error = str(e)
    emit("resume_np1", rest=rest, progress=opt.progress, gain=opt.gain, scale=opt.scale,
         n1_error=n1_error)


def case_one_process():
    """One process, one pass a step (S = 1), measure left to its default: nothing to measure,
    no hook (measure=True asks for the statistics, so that k may change later: #47 item 3)."""
    out = {}
    for policy in ("adascale", "none"):
        model = make_model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                   named_parameters=model.named_parameters(), policy=policy)
        steps_for_resize(model, opt, 0, 3, 1)
        # The one-process reference: plain SGD on the same micro-batches (S = 1: factor 1).
        ref = make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
        for step in range(3):
            ref_opt.zero_grad()
            loss_fn(ref, *micro_batch(0, step, 0)).backward()
            ref_opt.step()
        out[policy] = {"progress": opt.progress, "gain": opt.gain, "steps": opt.steps,
                       "hooks": len(opt._statistics.hooks), "measured": opt.scaling.measure,
                       "skipped": opt.skipped, "lr": opt.param_groups[0]["lr"],
                       "max_diff_to_reference": float((params_vector(model) - params_vector(ref)).abs().max())}
    emit("one_process", **out)


def case_soundness():
    """#30's adapter items. Tiny float32 gradients: the same model and data with the loss (and
    so every gradient) times 1e-22 or 1e-30, the lr divided by it, give the gain of the unscaled
    run (at daf194d: gain 4 = S at 1e-22, and 1 below ~1e-23). A fresh Adam under a restored
    adascale_adam policy is refused on every rank, nothing applied nor counted."""
    out = {}
    for factor in (1.0, 1e-22, 1e-30):
        model = make_model().float()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR / factor),
                                   named_parameters=model.named_parameters(), policy="adascale",
                                   backward_passes_per_step=2)
        gains = []
        for step in range(4):
            opt.zero_grad()
            for j in range(2):
                x, y = micro_batch(hvd.rank(), step, j)
                (loss_fn(model, x.float(), y) * factor).backward()
            opt.step()
            gains.append(opt.gain)
        out[f"tiny_{factor:g}"] = {"gains": gains, "sigma2": opt.sigma2 / factor ** 2,
                                   "mu2": opt.mu2 / factor ** 2}
    model = make_model()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), policy="adascale_adam",
                               backward_passes_per_step=2)
    for step in range(25):
        opt.zero_grad()
        for j in range(2):
            loss_fn(model, *micro_batch(hvd.rank(), step, j)).backward()
        opt.step()
    saved = opt.state_dict()
    model2 = make_model()
    fresh = torch.optim.Adam(model2.parameters(), lr=0.01)
    saved["inner"] = fresh.state_dict()  # a fresh Adam state under the restored policy
    opt2 = DistributedOptimizer(fresh, named_parameters=model2.named_parameters(),
                                policy="adascale_adam", backward_passes_per_step=2)
    opt2.load_state_dict(saved)
    before = params_vector(model2).clone()
    opt2.zero_grad()
    for j in range(2):
        loss_fn(model2, *micro_batch(hvd.rank(), 30, j)).backward()
    out["fresh_adam"] = {"error": error_of(opt2.step), "steps": opt2.steps,
                         "unchanged": torch.equal(before, params_vector(model2)),
                         "tau": opt2.progress, "saved_tau": opt.progress}
    emit("soundness", **out)


CASES = {
    "misuse": case_misuse,
    "hardening": case_hardening,
    "options": case_options,
    "join": case_join,
    "save_for_resize": case_save_for_resize,
    "adam": case_adam,
    "adam_horizons": case_adam_horizons,
    "one_rank_load": case_one_rank_load,
    "passes_change": case_passes_change,
    "adapt_goodput": case_adapt_goodput,
    "soundness": case_soundness,
    "reference": lambda: case_reference(1, False),
    "accumulate": lambda: (case_reference(2, False), case_reference(2, True)),
    "policies": case_policies,
    "checkpoint": case_checkpoint,
    "amp": case_amp,
    "nonfinite": case_nonfinite,
    "unused": case_unused,
    "many_tensors": case_many_tensors,
    "bad_policy": case_bad_policy,
    "resume_np1": case_resume_np1,  # single process, after save_for_resize
    "one_process": case_one_process,  # single process
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=[c for c in CASES if c not in ("resume_np1", "one_process")])
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    for name in args.cases:
        CASES[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
