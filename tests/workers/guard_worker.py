"""Run under horovodrun -np 2: the lr guard of the torch adapter (hvd_scale.guard) on least
squares, where the Hessian of each worker's batch loss is known exactly: 2 X^T X / B.
Prints RESULT lines for tests/test_guard.py."""

import math
import sys

import horovod.torch as hvd
import numpy as np
import torch
from _report import emit_result

from hvd_scale.adapters.torch import DistributedOptimizer
from hvd_scale.guard import SharpnessGuard

DIM, BATCH, K = 6, 16, 2


def batch(rank, step, k_pass):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k_pass)
    # Columns of different scales: a spread of curvatures, the top one well separated.
    x = torch.randn(BATCH, DIM, generator=g, dtype=torch.float64) * torch.linspace(0.3, 2.0, DIM,
                                                                                   dtype=torch.float64)
    return x, x @ torch.ones(DIM, dtype=torch.float64)


def model_and_opt(kind="SGD", policy="linear", guard=None, lr=0.05):
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1, bias=False).double()
    inner = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if kind == "SGD"
             else torch.optim.Adam(model.parameters(), lr=lr))
    opt = DistributedOptimizer(inner, named_parameters=model.named_parameters(), policy=policy,
                               backward_passes_per_step=K, measure=True, guard=guard)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def loss_of(model, x, y):
    return torch.mean((model(x).squeeze(1) - y) ** 2)


def train(model, opt, steps, guarded=True):
    rows = []
    for step in range(steps):
        opt.zero_grad()
        before = model.weight.detach().clone()
        grad = torch.zeros(DIM, dtype=torch.float64)  # this rank's sum of its K micro-gradients
        for k in range(K):
            x, y = batch(hvd.rank(), step, k)
            # d/dw mean((x w - y)^2) = 2 x^T (x w - y) / B, written out: p.grad cannot be read
            # after the last pass, Horovod averages it in place in its background thread.
            grad += 2 * x.T @ (x @ before.reshape(-1) - y) / BATCH
            loss = loss_of(model, x, y)
            loss.backward()
        opt.step(guard_loss=(lambda: loss_of(model, x, y)) if guarded else None)
        m = opt.metrics()
        # The reference: the top eigenvalue of this rank's Hessian on the batch given to the guard.
        local = float(np.linalg.eigvalsh((2 * x.T @ x / BATCH).numpy()).max())
        rows.append({"loss": loss.item(), "gain": m["gain"], "sigma2": m["sigma2"], "mu2": m["mu2"],
                     "lr": m["lr"], "lr_factor": m["lr_factor"], "sharpness": m["sharpness"],
                     "lr_cap": m["lr_cap"], "local_sharpness": local,
                     "moved": (before - model.weight.detach()).reshape(-1).tolist(),
                     "local_grad_sum": grad.reshape(-1).tolist()})
    return rows


def main():
    hvd.init()
    torch.set_num_threads(1)
    # 1. SGD momentum 0.9, linear rule at S = 4 with a base lr that scaled is past the limit.
    # margin 0.5: at the limit itself (margin 1) the top direction neither grows nor shrinks.
    model, opt = model_and_opt(guard=SharpnessGuard(every=3, iterations=100, tol=1e-10, margin=0.5),
                               lr=0.2)
    guarded = train(model, opt, 20)
    emit_result(case="sgd", rank=hvd.rank(), rows=guarded, measured_at=opt.scaling.guard.measured_at,
                state=opt.state_dict()["guard"])
    model, opt = model_and_opt(lr=0.2)
    emit_result(case="sgd_unguarded", rank=hvd.rank(), rows=train(model, opt, 20, guarded=False))

    # 2. A due step without guard_loss: a clear error on every rank, no hang.
    model, opt = model_and_opt(guard=SharpnessGuard(every=5))
    try:
        train(model, opt, 1, guarded=False)
        error = None
    except ValueError as e:
        error = str(e)
    emit_result(case="missing", rank=hvd.rank(), error=error, steps=opt.steps)

    # 3. Adam: no second moment before the first step, so the guard measures before the second.
    model, opt = model_and_opt(kind="Adam", policy="linear",
                               guard=SharpnessGuard(every=10, iterations=100, tol=1e-10), lr=0.01)
    rows = train(model, opt, 3)
    emit_result(case="adam", rank=hvd.rank(), rows=rows, measured_at=opt.scaling.guard.measured_at)

    # 4. A checkpoint carries the estimate; a fresh optimizer loading it caps at once.
    model, opt = model_and_opt(guard=SharpnessGuard(every=3, iterations=100, tol=1e-10))
    train(model, opt, 2)
    saved = opt.state_dict()
    model2, opt2 = model_and_opt(guard=SharpnessGuard(every=3, iterations=100, tol=1e-10))
    opt2.load_state_dict(saved)
    emit_result(case="checkpoint", rank=hvd.rank(), saved=saved["guard"],
                loaded=opt2.scaling.guard.state_dict(), due=opt2.scaling.guard_due())
    assert not math.isnan(saved["guard"]["sharpness"])


if __name__ == "__main__":
    sys.exit(main())
