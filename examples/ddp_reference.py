"""What examples/ddp_lightning.py and examples/ddp_accelerate.py share: the model, the data, and
the plain DDP loop with hvd_scale's DDP optimizer that each recipe's ``--compare`` runs beside it
(the loop of docs/ddp.md), with the per-step rows both report."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

BATCH = 16
LR = 0.05


def dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, dtype=torch.float64, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()  # 3 classes, learnable
    flip = torch.rand(samples, generator=g) < 0.2             # with noise: sigma2 > 0
    return TensorDataset(x, torch.where(flip, torch.randint(0, 3, (samples,), generator=g), y))


def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def record(opt, seen: list, rows: list) -> None:
    rows.append({"gain": opt.gain, "lr_factor": opt.lr_factor, "lr": seen[-1],
                 "progress": opt.progress, "sigma2": opt.sigma2, "mu2": opt.mu2,
                 "steps": opt.steps})


def weights(net) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def plain_run(policy, k: int, batches: list, clip: float | None = None):
    """The plain DDP loop over this rank's ``batches`` (torch.distributed is up), k passes a
    step, the first k - 1 under ``no_sync()``; the lr the SGD sees is recorded (a step pre-hook).
    ``clip``: the gradients' norm clipped there before each step (p.grad is then the mean of
    the step's passes). Returns the trained network and the per-step rows."""
    from torch.nn.parallel import DistributedDataParallel

    from hvd_scale.adapters.torch.ddp import DistributedOptimizer

    model = DistributedDataParallel(network())
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    seen, rows = [], []
    sgd.register_step_pre_hook(lambda o, a, kw: seen.append(o.param_groups[0]["lr"]))
    opt = DistributedOptimizer(sgd, model, policy, backward_passes_per_step=k)
    for start in range(0, len(batches), k):
        step = batches[start:start + k]
        for i, (x, y) in enumerate(step):
            with model.no_sync() if i < len(step) - 1 else contextlib.nullcontext():
                F.cross_entropy(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        record(opt, seen, rows)
    return model.module, rows
