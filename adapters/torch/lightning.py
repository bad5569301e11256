"""Lightning's DDP strategy with hvd_scale's DDP optimizer (``ddp.py``), and a callback for what
the torch loop does around it: automatic optimization, ``accumulate_grad_batches``, Lightning's
checkpoints and resume keep working (tests/test_ddp_integrations.py).

    from hvd_scale.adapters.torch.lightning import DDPStrategy, ScalingCallback
    from hvd_scale.schedules import StepDecay
    trainer = Trainer(accelerator="cpu", devices=2, max_epochs=-1, accumulate_grad_batches=4,
                      strategy=DDPStrategy(policy="adascale", optimizer_kwargs={"budget": 3000}),
                      callbacks=[ScalingCallback(schedule=StepDecay(0.1, [2000]))])
    trainer.fit(module, loader)        # configure_optimizers returns a plain torch optimizer
    trainer.optimizers[0].gain         # hvd_scale's DistributedOptimizer: gain, progress, ...

The strategy stops the Trainer once tau reaches the budget (``trainer.should_stop``, as
``while not opt.done()``); ``ScalingCallback`` sets the baseline lr from a schedule at tau
before each step and logs the policy's metrics to the Trainer's logger.

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
  micro-batch's mean loss and divides by the passes itself, so ``backward`` multiplies it back;
* at the end of the step's synchronizing pass the DDP optimizer makes p.grad the mean of the
  step's passes (``ddp.DistributedOptimizer.synchronize``), so Lightning's gradient clipping and
  ``on_before_optimizer_step`` see the mean, as they do under Lightning's own DDP.

Refused: more than one optimizer (DDP has one hook), post-local SGD.
"""

from __future__ import annotations

from typing import Any, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy

from hvd_scale.metrics import check_names
from hvd_scale.schedules import Schedule, lr_at

from .ddp import DistributedOptimizer

# What ScalingCallback logs to the Trainer's logger after each optimizer step, as
# ``hvd_scale/<name>`` (the names and meanings: hvd_scale.metrics.METRICS).
LOGGED_METRICS = ("gain", "progress", "scale", "noise_scale", "lr_factor", "lr", "short_step")
check_names(LOGGED_METRICS)


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

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        """Lightning's step, then the budget: once tau has reached it the Trainer stops (its
        epoch loop ends at this step; checkpoints at the end of the epoch are saved as usual)."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        opt = self.optimizers[0] if self.optimizers else None
        if isinstance(opt, DistributedOptimizer) and opt.policy.budget is not None and opt.done():
            self.lightning_module.trainer.should_stop = True
        return result


def _hvd_optimizer(trainer) -> LightningDistributedOptimizer:
    opt = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
    if not isinstance(opt, LightningDistributedOptimizer):
        raise TypeError("hvd_scale's ScalingCallback needs the Trainer's strategy to be "
                        "hvd_scale.adapters.torch.lightning.DDPStrategy (its one optimizer "
                        f"hvd_scale's), got strategy {type(trainer.strategy).__name__}")
    return opt


class ScalingCallback(pl.Callback):
    """What the torch loop does around hvd_scale's optimizer, for a Trainer with ``DDPStrategy``.

    Args:
        schedule: the baseline lr as a function of tau, written for one worker (a
            ``hvd_scale.schedules`` schedule, a callable baseline step -> lr, or a float), or one
            per parameter group; set in the optimizer's ``param_groups`` before each step at
            ``lr_at(schedule, tau)``, which the policy then multiplies (and a resumed run
            continues at its tau). None: the lr stays the module's (and its lr scheduler's,
            which steps in Lightning's steps or epochs, not in tau). A schedule with a Lightning
            lr scheduler as well is refused (the two would set the same lr).
        log: after each optimizer step, ``LOGGED_METRICS`` (gain, tau, S, the noise scale, the
            lr factor and lr applied, short_step) to the Trainer's logger as ``hvd_scale/<name>``
            (``LightningModule.log``: at Lightning's ``log_every_n_steps``).
    """

    def __init__(self, schedule: Schedule | float | Sequence[Schedule | float] | None = None, *,
                 log: bool = True):
        self.schedule, self._log = schedule, log
        self._logged_step = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        opt = _hvd_optimizer(trainer)
        if self.schedule is None:
            return
        if trainer.lr_scheduler_configs:
            raise ValueError("hvd_scale's ScalingCallback(schedule=...) sets the baseline lr at "
                             "each step, and configure_optimizers returned an lr scheduler that "
                             "sets it too: keep one of the two")
        if isinstance(self.schedule, (list, tuple)) and len(self.schedule) != len(opt.param_groups):
            raise ValueError(f"ScalingCallback: {len(self.schedule)} schedules for "
                             f"{len(opt.param_groups)} parameter groups (give one, or one each)")

    def on_train_start(self, trainer, pl_module) -> None:
        self._logged_step = trainer.global_step  # a resumed fit's steps so far

    def _set_lr(self, opt) -> None:
        schedules = self.schedule if isinstance(self.schedule, (list, tuple)) else \
            [self.schedule] * len(opt.param_groups)
        for group, schedule in zip(opt.param_groups, schedules):
            group["lr"] = lr_at(schedule, opt.progress)  # lr(floor(tau)), as the torch loop's

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.schedule is not None:
            self._set_lr(_hvd_optimizer(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._log or trainer.global_step == self._logged_step:
            return  # a pass under accumulation, not a step
        self._logged_step = trainer.global_step
        metrics = _hvd_optimizer(trainer).metrics()
        # the same values on every rank (the statistics are allreduced): no sync
        pl_module.log_dict({f"hvd_scale/{k}": float(metrics[k]) for k in LOGGED_METRICS},
                           on_step=True, on_epoch=False, logger=True, prog_bar=False)
