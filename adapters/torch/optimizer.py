"""The torch optimizer: the hooks of ``adapters/protocol.py`` in torch, whichever engine averages
the gradients (the math is in the engine, the sequence of a step and everything that is not a
tensor operation in ``adapters/core.py``). An engine plugs in by subclassing ``TorchOptimizer``:

* ``horovod.py``: Horovod's ``hvd.DistributedOptimizer`` (its hooks, its buckets);
* ``ddp.py``: ``torch.distributed``'s ``DistributedDataParallel`` (a communication hook).

Both gather the same statistics (``statistics.py``, their norms in ``norms.py``): the norm of
each backward pass's own gradient, the per-group sums and the micro-gradient count in one small
allreduce beside the gradients', ``p.grad`` made the mean of the step's micro-gradients and
|g_bar|^2 taken from it; the one host transfer of the step brings these numbers back
([s..., c, w, q...]: ``hvd_scale.reduce``).
The plan's lr (and Adam's settings) are set on each group for the inner step, then the user's
values are restored, so torch lr schedulers keep working on the baseline lr (``apply_step``).
Checkpoints and the run's record: ``checkpoint.py``.

What an engine provides (methods of its subclass): ``_gather()`` (wait for this step's
gradients and statistics), ``_allreduce_async(tensor, name)`` and ``_wait_sum(handle)`` (the
statistics' allreduce, summed over workers), ``_average(tensor)``, ``_inner_step(closure)``,
``_in_step()`` and ``_follow_passes()``.

One gain for the whole model (the paper's choice): the engine sums sigma2 and mu2 over groups.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from hvd_scale.adapters import environment
from hvd_scale.adapters.adapt import Adaptation, check_passes
from hvd_scale.adapters.core import USER_SETTINGS, Framework, Readout, Request, Scaling, run_step
from hvd_scale.guard import ADAM_OPTIMIZERS
from hvd_scale.moments import EPS_CORRECTED

from .checkpoint import Checkpoints
from .hessian import hessian_top_eigenvalue
from .statistics import Statistics, _StepState


# Where the norms are read once per step (samples="workers") and the engine does not count the
# passes itself (DDP), a count hook on this many parameters spread over the model counts them: a
# pass reaches at least one of them unless it leaves all of them without a gradient.
COUNTED_PARAMETERS = 4


def _number(value) -> float:
    """A group's setting as a float for the host (nan where it is none: ``check_lrs`` names it)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


@dataclasses.dataclass(frozen=True)
class _Step:
    """One ``step()``'s own inputs, handed from hook to hook (``core.run_step``)."""

    closure: Any = None
    guard_loss: Any = None  # the lr guard's loss function (``step(guard_loss=...)``)


def scaling_for(binding, optimizer: torch.optim.Optimizer, *, name: str, policy, passes: int,
                scale, budget, measure, log_dir, nonfinite, guard, adapt, max_passes,
                adapt_every, samples: str = "auto", elastic: bool = False,
                check=None) -> Scaling:
    """The shared half (``core.Scaling``) for a torch optimizer, whichever engine: the user's
    arguments as given, what torch's optimizer tells of its groups, the engine's collectives
    (``binding``), ``name`` for run.json, Horovod elastic, the engine's own ``check``."""
    groups = len(optimizer.param_groups)
    return Scaling(
        binding,
        Request(policy=policy, passes=passes, scale=scale, budget=budget, measure=measure,
                nonfinite=nonfinite, log_dir=environment.log_dir(log_dir),
                log_every=environment.log_every(), samples=samples,
                samples_environment=environment.samples()),
        Framework(optimizer_name=type(optimizer).__name__, name=name, groups=groups,
                  base_lrs=[g.get("lr") for g in optimizer.param_groups],
                  lr_names=[f"param_groups[{i}]['lr']" for i in range(groups)],
                  eps_placement=EPS_CORRECTED, short_steps=True, elastic=elastic, check=check),
        adaptation=Adaptation(adapt, max_passes, adapt_every, check_passes(passes), measure),
        guard=guard)


class TorchOptimizer(Readout, Statistics, Checkpoints, torch.optim.Optimizer):
    """What every engine's torch optimizer shares: the protocol's hooks, the step, a change of
    k, the guard's sharpness. A subclass builds ``self.scaling`` and the inner optimizer
    (``self._inner``, whose ``state_dict`` is saved), then calls ``_share_groups`` and
    ``_hook_parameters``."""

    # -- set-up (called by the engine's constructor) ----------------------------------------------
    def _share_groups(self, inner: torch.optim.Optimizer) -> None:
        """Become a real torch Optimizer over ``inner``'s groups (lr schedulers check isinstance
        and read/write group["lr"]), sharing its groups and state outright."""
        self._inner = inner
        torch.optim.Optimizer.__init__(self, inner.param_groups, inner.defaults)
        self.param_groups = inner.param_groups
        self.state = inner.state
        self._measure = self.scaling.measure  # fixed for the optimizer's life (its hooks)
        self._count_scaler_skips(self._grad_scaler)  # a step the scaler skips: counted there
        float64 = any(p.dtype == torch.float64 for p in self._params())
        self._stats_dtype = torch.float64 if float64 else torch.float32  # on the wire
        # Parameters the engine and the hooks know: a later unfreezing is refused at the next step.
        self._frozen = [p for p in self._params() if not p.requires_grad]
        self._hooks = []
        # (group, parameter) of every trained parameter, in the groups' order: the hooks' order
        self._trained_params = trained = [(gi, p) for gi, group in enumerate(self.param_groups)
                                          for p in group["params"] if p.requires_grad]
        self._trained = len(trained)
        self._all_gradients = len(trained) * self.backward_passes_per_step  # a full step's
        self._hooks_paused = False  # the guard's Hessian-vector products are not passes
        self._group_of = {p: gi for gi, p in trained}

    def _hook_parameters(self, kind: str | None, few: bool = False) -> None:
        """A tensor hook on every trained parameter: "norms" (each pass's gradient measured
        before it is added into p.grad), "count" (the passes counted), or None. ``few``: the
        count on a handful of parameters spread over the model (``COUNTED_PARAMETERS``), where
        the norms are read once per step and only the passes are wanted."""
        trained = self._trained_params
        if few:
            trained = trained[::max(1, len(trained) // COUNTED_PARAMETERS)]
        if kind == "norms":
            self._hooks = [p.register_hook(self._make_norm_hook(gi, p, index))
                           for index, (gi, p) in enumerate(trained)]
        elif kind == "count":
            self._hooks = [p.register_hook(self._make_count_hook(index))
                           for index, (_, p) in enumerate(trained)]
        self._hooked = len(self._hooks)
        self._step = self._new_step()

    def _new_step(self) -> _StepState:
        return _StepState(norms=[[] for _ in self.param_groups], fired=[0] * self._hooked)

    def _params(self):
        return (p for group in self.param_groups for p in group["params"])

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params() if p.grad is not None]

    @property
    def _device(self) -> torch.device:
        """Where the statistics are made: the gradients' device."""
        return next(self._params()).device

    def _check_no_parameter_unfrozen(self) -> None:
        """A parameter made trainable after the optimizer was built has neither the engine's
        allreduce nor a norm hook: its workers would drift apart and the statistics miss it."""
        unfrozen = [p for p in self._frozen if p.requires_grad]
        if unfrozen:
            shapes = [tuple(p.shape) for p in unfrozen]
            raise ValueError(f"hvd_scale: {len(unfrozen)} parameter(s) of shape(s) {shapes} were "
                             "made trainable after DistributedOptimizer was built; the engine "
                             "would not average their gradients and the statistics would miss "
                             "them. Build the optimizer again (DistributedOptimizer(...)) after "
                             "changing requires_grad, then load its state_dict")

    # -- torch.optim.Optimizer ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, guard_loss=None):
        """Let the policy plan the step from its statistics, and apply it (``core.run_step``).

        A step whose gradients are not finite is skipped on every rank: weights, optimizer state,
        statistics and progress stay as they were (``opt.skipped`` counts it). A group's lr
        that has become negative or not finite raises ValueError naming the group, with nothing
        applied or counted (``Scaling.check_lrs``).
        ``guard_loss``: with a ``guard``, a function returning this worker's loss on its current
        batch (a fresh forward pass; no backward), called on the guard's steps only.
        """
        result = run_step(self, _Step(closure, guard_loss))
        self.scaling.clock.ended()
        self.set_passes(self.scaling.adapted_passes())
        return result

    def set_passes(self, passes: int) -> None:
        """Take k backward passes per step from the next step on; call it on every rank at the
        same step, between steps (adapt="goodput" does). S follows in proportion (the policy's
        factor and tau's advance are the new S's), and so do the engine's accumulation counts."""
        k = check_passes(passes)
        if k == self.backward_passes_per_step:
            return
        if self._step.fired_total or any(self._step.fired) or self._in_step():
            raise RuntimeError("set_passes() between backward passes of a step: call it after "
                               "step() and before the next step's first backward pass")
        if k > 1 and self._bucketed and not self._switching and self.scaling.reads() == "passes":
            raise ValueError(f"set_passes({k}): this optimizer was built for one pass per step "
                             "with its norms taken in the engine's buckets; build it with "
                             "backward_passes_per_step > 1 or adapt='goodput' to change k")
        self.scaling.set_passes(k)  # the run's record at the new k: refused there, if it cannot
        if self._switching and not self._hooked:
            self._hook_parameters("norms")  # per pass where one worker is left (``_per_pass``)
        if not (self._hooked or self._counted_by_engine()) and (self._bucketed or not self._measure):
            # Built at k = 1 with nothing counting (unmeasured, or norms read once per worker in
            # the buckets): from now on a pass is not a step, and the passes are counted.
            self._hook_parameters("count", few=self._bucketed)
        self._follow_passes()

    # -- the hooks of adapters/protocol.py ---------------------------------------------------------
    def reduced_statistics(self, step: _Step):
        """(step, statistics, finite, count): this step's [s..., c, q...] (a device tensor)
        after the gradients' allreduce, or None unmeasured, with the averaged gradient's
        finiteness then (True under a GradScaler, which checks it itself) and the
        micro-gradients counted. The guard's sharpness is measured here when due."""
        gathered = self._gather()
        # Taken: a step that raises drops them.
        statistics, gathered.pending = gathered.pending, None
        count, gathered.count = gathered.count, None
        self.scaling.agree_on_state()  # once: a checkpoint loaded on some ranks only
        if self.scaling.guard_due():
            self._measure_sharpness(step.guard_loss)
        if statistics is not None:
            return step, statistics, True, None
        return step, None, self._grad_scaler is not None or self._grads_finite(), count

    def user_settings(self) -> list[list[float]]:
        """Each group's ``core.USER_SETTINGS``: torch corrects Adam's bias with each parameter's
        own step count, the group's first here; the decay is AdamW's decoupled one only."""
        rows = []
        for group in self.param_groups:
            # Only Adam's kind has betas and a step to correct by (no scan of SGD's parameters).
            state = next((self.state[p] for p in group["params"] if "step" in self.state.get(p, ())),
                         None) if "betas" in group else None
            betas = group.get("betas", (math.nan, math.nan))
            decoupled = group.get("decoupled_weight_decay", False) and "weight_decay" in group
            rows.append([_number(group["lr"]), _number(betas[0]), _number(betas[1]),
                         _number(group.get("eps", math.nan)),
                         _number(group["weight_decay"]) if decoupled else math.nan,
                         1.0 if state is None else float(state["step"]) + 1.0])
        assert len(rows[0]) == len(USER_SETTINGS)
        return rows

    def loss_scale(self) -> float | None:
        scaler = self._grad_scaler
        return scaler.get_scale() if scaler is not None and scaler.is_enabled() else None

    def on_host(self, fn, *args):
        """Eager: the statistics come to the host here, the step's one transfer."""
        return fn(*(a.tolist() if torch.is_tensor(a) else a for a in args))

    def apply_step(self, plan, step: _Step):
        """The inner step with each group's lr (and, for adascale_adam, betas, eps and decoupled
        decay: ``hvd_scale.moments``) from ``plan``; the user's values are put back after, so
        torch lr schedulers keep working on the baseline lr. A factor of 0: nothing applied."""
        plan = [[float(v) for v in row] for row in plan]
        if plan[0][0] == 0.0:
            return None
        keys = ("lr", "betas", "eps", "weight_decay")
        saved = [{k: group[k] for k in keys if k in group} for group in self.param_groups]
        try:
            for group, (_, lr, beta1, beta2, eps, decay) in zip(self.param_groups, plan):
                group["lr"] = lr
                if not math.isnan(beta1):
                    group.update(betas=(beta1, beta2), eps=eps)
                if not math.isnan(decay):
                    group["weight_decay"] = decay
            return self._inner_step(step.closure)
        finally:
            for group, user in zip(self.param_groups, saved):
                group.update(user)

    def _measure_sharpness(self, guard_loss) -> None:
        """The guard's estimate: this worker's top Hessian eigenvalue, averaged over workers."""
        guard, step = self.scaling.guard, self.scaling.run.policy.steps
        if not callable(guard_loss):
            raise ValueError(f"hvd_scale: the lr guard measures the sharpness before step "
                             f"{step + 1}: call opt.step(guard_loss=fn) with fn() returning this "
                             f"worker's loss on its current batch, got guard_loss={guard_loss!r}")
        group = self.param_groups[0]
        params = [p for p in self._params() if p.requires_grad]
        if self.optimizer_name in ADAM_OPTIMIZERS:
            # Adam's stability is about P^-1 H, P = diag(sqrt(v_hat) + eps): before its first
            # step there is no v_hat, and the next step measures instead (alike on every rank).
            if not all("exp_avg_sq" in self.state.get(p, {}) for p in params):
                return
            scaling = [self._precondition(p, torch.ones_like(p), group, floored=False).sqrt_()
                       for p in params]
            limits = {"beta1": group["betas"][0]}
        else:
            scaling = None
            limits = {"momentum": group.get("momentum", 0.0), "dampening": group.get("dampening", 0.0),
                      "nesterov": bool(group.get("nesterov", False))}
        self._hooks_paused = True
        try:
            with torch.enable_grad():
                local = hessian_top_eigenvalue(guard_loss, params, iterations=guard.iterations,
                                               tol=guard.tol, scaling=scaling, seed=step)
        finally:
            self._hooks_paused = False
        mean = self._average(torch.tensor(local, dtype=torch.float64, device=self._device)).item()
        if math.isfinite(mean):  # else this step's gradients overflow too: it will be skipped,
            guard.update(mean, step, optimizer=self.optimizer_name, **limits)  # and measured again

    def __repr__(self) -> str:
        return f"hvd_scale.DistributedOptimizer({self.optimizer_name}, {self.engine}, " \
               f"policy={self.policy.spec!r})"
