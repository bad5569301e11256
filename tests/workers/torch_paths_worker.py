"""Run under horovodrun -np 2: the paths real training takes with the torch adapter (activation
checkpointing, short and uneven steps, unfreezing, unmeasured non-finite steps), each printing
RESULT lines for tests/test_training_paths.py."""

import sys

import horovod.torch as hvd
import torch
import torch.utils.checkpoint as ckpt

from _reference import read_worker_sums
from _report import emit_result
from hvd_scale import GainEstimator
from hvd_scale.adapters.torch import DistributedOptimizer

LR = 0.05


def emit(case, **values):
    emit_result({"case": case, "rank": hvd.rank(), **values})


def micro_batch(rank, step, k_pass, size=16):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k_pass)
    return torch.randn(size, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (size,), generator=g)


class Blocks(torch.nn.Module):
    """Four Linear+Tanh blocks and a head, each checkpointed ("reentrant", "non_reentrant") or
    not (None)."""

    def __init__(self, checkpointing=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                          for _ in range(4))
        self.head = torch.nn.Linear(8, 3)
        self.checkpointing = checkpointing
        self.double()

    def forward(self, x):
        if self.checkpointing == "reentrant":
            # Reentrant checkpointing gives no gradient to a segment whose inputs need none.
            x = x.detach().requires_grad_(True)
        # The head too: every parameter's gradient then comes from a nested (reentrant) backward.
        for block in [*self.blocks, self.head]:
            if self.checkpointing is None:
                x = block(x)
            else:
                x = ckpt.checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return x


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def case_checkpointing():
    """The same run, k = 2, with and without activation checkpointing (both kinds)."""
    for variant in (None, "reentrant", "non_reentrant"):
        model = Blocks(variant)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(), policy="adascale",
                                   backward_passes_per_step=2)
        rows = []
        for step in range(3):
            opt.zero_grad()
            for j in range(2):
                loss_fn(model, *micro_batch(hvd.rank(), step, j)).backward()
            opt.step()
            rows.append({"gain": opt.gain, "sigma2": opt.sigma2, "mu2": opt.mu2,
                         "progress": opt.progress})
        emit("checkpointing", variant=str(variant), rows=rows, weights=flat(model).tolist())


def short_step(passes_by_rank, k=4):
    """A fresh optimizer's first step with fewer passes than k: against the reference built from
    every rank's micro-gradients (gathered), at the step's own scale."""
    model = Blocks()
    w0 = flat(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(), policy="adascale",
                               backward_passes_per_step=k)
    mine = []
    for j in range(passes_by_rank[hvd.rank()]):
        loss_fn(model, *micro_batch(hvd.rank(), 0, j)).backward()
        mine.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]) - sum(mine, torch.zeros_like(w0)))
    opt.step()
    grads = hvd.allgather(torch.stack(mine), name=f"short{passes_by_rank}")  # every micro-gradient
    n = grads.shape[0]
    mean = grads.mean(0)
    ref = GainEstimator(scale=hvd.size() * k * n / (hvd.size() * k))
    # Each rank's sum of its passes read once (the default at two workers): |G_w|^2 / k_w.
    per_rank = list(torch.split(grads, list(passes_by_rank)))
    sqnorm_sum, samples = read_worker_sums([list(g) for g in per_rank])
    gain = ref.update(sqnorm_sum, float(mean @ mean), n, samples=samples)
    emit("short", passes=passes_by_rank, n=n, scale=opt.scale, progress=opt.progress,
         lr_factor=opt.lr_factor, ref_gain=gain, sigma2=opt.sigma2, ref_sigma2=ref.sigma2,
         mu2=opt.mu2, ref_mu2=ref.mu2,
         max_weight_diff=float((flat(model) - (w0 - LR * gain * mean)).abs().max()))


def case_short():
    short_step((1, 1))   # a leftover batch on both ranks: 2 of 8 micro-batches
    short_step((3, 1))   # uneven: 4 of 8


def case_unfreeze():
    """A layer unfrozen after the optimizer was built: refused at the next step, on every rank."""
    model = Blocks()
    model.head.requires_grad_(False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(), policy="adascale",
                               backward_passes_per_step=2)
    for step in range(2):
        if step == 1:
            model.head.requires_grad_(True)  # gradual unfreezing
        opt.zero_grad()
        for j in range(2):
            loss_fn(model, *micro_batch(hvd.rank(), step, j)).backward()
        try:
            opt.step()
        except ValueError as e:
            emit("unfreeze", step=step, error=str(e), steps=opt.steps)
            return
    emit("unfreeze", step=None, error=None, steps=opt.steps)


def case_unmeasured_nonfinite():
    """measure=False (a fixed rule): a NaN gradient on one rank skips the step on every rank."""
    model = Blocks()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters(), policy="linear",
                               measure=False)
    rows = []
    for step in range(3):
        opt.zero_grad()
        x, y = micro_batch(hvd.rank(), step, 0)
        if step == 1 and hvd.rank() == 1:
            x[0, 0] = float("nan")
        loss_fn(model, x, y).backward()
        before = flat(model)
        opt.step()
        rows.append({"moved": bool((flat(model) != before).any()),
                     "finite": bool(flat(model).isfinite().all()), "progress": opt.progress})
    emit("unmeasured_nonfinite", rows=rows, skipped=opt.skipped)


CASES = {"checkpointing": case_checkpointing, "short": case_short, "unfreeze": case_unfreeze,
         "unmeasured_nonfinite": case_unmeasured_nonfinite}


def main():
    hvd.init()
    torch.set_num_threads(1)
    for name in sys.argv[1:] or CASES:
        CASES[name]()


if __name__ == "__main__":
    main()
