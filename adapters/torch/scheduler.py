"""torch lr schedulers stepped in scale-invariant iterations (baseline steps of progress)."""

from __future__ import annotations

import math

import torch

from .optimizer import TorchOptimizer


class ScaleInvariantScheduler:
    """Step any torch ``LRScheduler`` in scale-invariant iterations: lr = schedule(floor(tau)).

        sched = ScaleInvariantScheduler(torch.optim.lr_scheduler.StepLR(opt, 1000, 0.1), opt)
        ...; opt.step(); sched.step()

    The wrapped scheduler sees one of its steps per baseline step of progress, so a schedule
    written for S = 1 runs unchanged at any scale and with any policy.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: TorchOptimizer):
        if not isinstance(optimizer, TorchOptimizer):
            raise TypeError("optimizer must be hvd_scale's DistributedOptimizer (Horovod's or DDP's)")
        self.scheduler, self.optimizer = scheduler, optimizer
        self._base_epoch = scheduler.last_epoch  # 0 after construction

    def step(self) -> None:
        target = self._base_epoch + int(math.floor(self.optimizer.progress))
        while self.scheduler.last_epoch < target:
            self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "base_epoch": self._base_epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self._base_epoch = state_dict["base_epoch"]
