"""Lightning's DDP strategy with hvd_scale's DDP optimizer (``ddp.py``): automatic optimization,
``accumulate_grad_batches`` and lr schedulers keep working (tests/test_ddp_integrations.py; saving
and resuming through Lightning's checkpoints is not tested yet).

    from hvd_scale.adapters.torch.lightning import DDPStrategy
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(policy="adascale"),
                      accumulate_grad_batches=4)
    trainer.fit(module, loader)        # configure_optimizers returns a plain torch optimizer
    trainer.optimizers[0].gain         # hvd_scale's DistributedOptimizer: gain, progress, ...

What the strategy translates, and only that:

* after Lightning has wrapped the LightningModule in DDP and called ``configure_optimizers``
  (``setup_optimizers``), its one optimizer is wrapped in ``ddp.DistributedOptimizer`` over the
  DDP model, with k = ``accumulate_grad_batches`` (Lightning runs the first k - 1 passes under
  ``no_sync()``, as hvd_scale's DDP engine expects); the lr scheduler keeps the plain optimizer,
  whose ``param_groups`` the wrapper shares;
* DDP takes one communication hook: hvd_scale's. ``DDPStrategy(ddp_comm_hook=...,
  ddp_comm_state=..., ddp_comm_wrapper=...)`` becomes its ``comm_hook=`` (the statistics
  compose with it), on every device (Lightning registers it on CUDA only);
* Lightning's closure (``training_step``, ``backward``, ``on_before_optimizer_step``) runs
  before hvd_scale's step, which plans from that backward pass's statistics (torch optimizers
  call it inside their step);
* Lightning divides each micro-batch's loss by ``accumulate_grad_batches``; hvd_scale takes each
  micro-batch's mean loss and divides by the passes itself, so ``backward`` multiplies it back.

Refused: more than one optimizer (DDP has one hook), gradient clipping with accumulation (it would
clip the sum of the passes, before hvd_scale makes it the mean), post-local SGD.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy

from .ddp import DistributedOptimizer


class LightningDistributedOptimizer(DistributedOptimizer):
    """``ddp.DistributedOptimizer`` stepped by Lightning: its closure (the forward and backward
    passes) runs first, then the policy's step. Returns the closure's loss."""

    def step(self, closure=None, **kwargs):
        if closure is None:
            return super().step(**kwargs)
        with torch.enable_grad():
            loss = closure()
        super().step(**kwargs)
        return loss


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` whose optimizer is hvd_scale's DDP ``DistributedOptimizer``.

    Args:
        policy: the lr scaling policy (as ``DistributedOptimizer``'s; None: the launcher's
            ``HVD_SCALE_POLICY``).
        optimizer_kwargs: further ``DistributedOptimizer`` arguments (``scale``, ``budget``,
            ``measure``, ``log_dir``, ``adapt``, ...); k is the Trainer's
            ``accumulate_grad_batches``, the communication hook the strategy's.
        **kwargs: Lightning's ``DDPStrategy`` arguments.
    """

    def __init__(self, policy: Any = None, *, optimizer_kwargs: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.policy = policy
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        for key in ("backward_passes_per_step", "comm_hook"):
            if key in self.optimizer_kwargs:
                raise ValueError(f"DDPStrategy: {key} is the Trainer's (accumulate_grad_batches) or "
                                 "the strategy's (ddp_comm_hook=...), not an optimizer_kwargs entry")

    def _register_ddp_hooks(self) -> None:
        """Nothing here: the optimizer registers its hook, composed with the user's."""

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"hvd_scale's DDPStrategy takes one optimizer (DDP has one "
                             f"communication hook), configure_optimizers gave {len(self.optimizers)}")
        k = trainer.accumulate_grad_batches
        if k > 1 and trainer.gradient_clip_val:
            raise ValueError("hvd_scale's DDPStrategy: gradient clipping with accumulate_grad_batches "
                             "> 1 would clip the sum of the passes; clip at one pass per step")
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
        if isinstance(self._ddp_comm_state, PostLocalSGDState):
            raise ValueError("hvd_scale's DDPStrategy: post-local SGD stops averaging the gradients")
        hook = self._ddp_comm_hook
        if hook is not None and self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        optimizer = self.optimizers[0]
        self.optimizers = [LightningDistributedOptimizer(
            optimizer, self.model, self.policy, backward_passes_per_step=k,
            comm_hook=None if hook is None else (self._ddp_comm_state, hook),
            **self.optimizer_kwargs)]

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any):
        module = self.lightning_module
        if module is not None and module.automatic_optimization:
            # Lightning's loss / accumulate_grad_batches, back to the micro-batch's mean loss
            closure_loss = closure_loss * module.trainer.accumulate_grad_batches
        return super().backward(closure_loss, optimizer, *args, **kwargs)
