"""The torch optimizer: the hooks of ``adapters/protocol.py`` in torch, whichever engine averages
the gradients (the math is in the engine, the sequence of a step and everything that is not a
tensor operation in ``adapters/core.py``). It is built from parts, none of them a parent:

* the inner torch optimizer (its ``param_groups`` and ``state`` shared outright);
* an engine (``engine.Engine``: the contract): ``horovod.py``, Horovod's
  ``hvd.DistributedOptimizer`` (its hooks, its buckets); ``ddp.py``, ``DistributedDataParallel``
  (a communication hook); ``fsdp.py``, FSDP2;
* the step's statistics (``statistics.StepStatistics``, their norms in ``norms.py``): the norm
  of each backward pass's own gradient, the per-group sums and the micro-gradient count in one
  small allreduce beside the gradients', ``p.grad`` made the mean of the step's micro-gradients
  and |g_bar|^2 per group; the step's one host transfer brings back its record
  ([s..., c, w, q...]: ``hvd_scale.reduce.StepRecord``);
* the shared ``core.Scaling`` (the policy, the run's one record, the log).

Each engine's public ``DistributedOptimizer`` is a ``TorchOptimizer`` whose constructor builds
its engine. The plan's lr (and Adam's settings) are set on each group for the inner step, then
the user's values are restored, so torch lr schedulers keep working on the baseline lr
(``apply_step``). Checkpoints: ``checkpoint.py``.

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

from . import checkpoint
from .engine import Engine
from .hessian import hessian_top_eigenvalue
from .statistics import StepStatistics




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


class TorchOptimizer(Readout, torch.optim.Optimizer):
    """What every engine's torch optimizer is: a real torch Optimizer over the inner one's
    groups (lr schedulers check isinstance and read/write group["lr"]), composed of the inner
    optimizer, an ``Engine``, a ``StepStatistics`` and a ``core.Scaling`` (``Readout``: the
    read-only values, over ``scaling`` alone). An engine's ``DistributedOptimizer`` builds the
    engine and the scaling, then calls this constructor."""

    def __init__(self, inner: torch.optim.Optimizer, engine: Engine, scaling: Scaling, *,
                 passes: int, grad_scaler: Any = None, optimizer_name: str | None = None):
        self.scaling = scaling
        self._inner = inner  # whose state_dict is saved (Horovod's: the wrapped optimizer)
        torch.optim.Optimizer.__init__(self, inner.param_groups, inner.defaults)
        self.param_groups, self.state = inner.param_groups, inner.state
        self.optimizer_name = optimizer_name or type(inner).__name__
        self.engine = engine.name
        self._engine = engine
        self._grad_scaler = grad_scaler
        self._closed = False  # close(): the hooks put back, no further step
        self._statistics = StepStatistics(inner, scaling, engine, passes)
        engine.attach(self._statistics)
        self._count_scaler_skips(grad_scaler)  # a step the scaler skips: counted there

    backward_passes_per_step = property(lambda self: self._statistics.passes,
                                        doc="k, the backward passes of the next step")

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
        if self._closed:
            raise RuntimeError("hvd_scale: step() after opt.close(): its hooks are removed and "
                               "nothing would be measured; build a new DistributedOptimizer")
        result = run_step(self, _Step(closure, guard_loss))
        self.scaling.clock.ended()
        self.set_passes(self.scaling.adapted_passes())
        return result

    def set_passes(self, passes: int) -> None:
        """Take k backward passes per step from the next step on; call it on every rank at the
        same step, between steps (adapt="goodput" does). S follows in proportion (the policy's
        factor and tau's advance are the new S's), and so do the engine's accumulation counts."""
        k = check_passes(passes)
        statistics = self._statistics
        if k == statistics.passes:
            return
        if statistics.started() or self._engine.in_step():
            raise RuntimeError("set_passes() between backward passes of a step: call it after "
                               "step() and before the next step's first backward pass")
        if k > 1 and statistics.bucketed and not statistics.switching \
                and self.scaling.reads() == "passes":
            raise ValueError(f"set_passes({k}): this optimizer was built for one pass per step "
                             "with its norms taken in the engine's buckets; build it with "
                             "backward_passes_per_step > 1 or adapt='goodput' to change k")
        self.scaling.relaid(k)  # the run's record at the new k: refused there, if it cannot
        self._engine.follow_passes(k)  # the engine's refusals first, then its counts follow
        self.scaling.set_passes(k)
        statistics.follow_new_k(engine_counts=self._engine.passes() is not None)

    def synchronize(self) -> None:
        """Finish the gradients' reduction (and the statistics'), as Horovod's: afterwards p.grad
        holds the mean micro-gradient (``StepStatistics.to_mean_gradient``)."""
        self._engine.synchronize()

    def skip_synchronize(self):
        """``opt.synchronize(); ...; with opt.skip_synchronize(): opt.step()`` (AMP, clipping)."""
        return self._engine.skip_synchronize()

    def close(self) -> None:
        """Put back what this optimizer hooked (the engine's hooks, the tensor hooks), and flush
        and close the metrics files. Under DDP the communication hook stays registered (DDP
        cannot unregister one) and passes each bucket to the user's hook (or DDP's allreduce).
        A later ``step()`` raises RuntimeError."""
        self._closed = True
        self._engine.close()
        self._statistics.close()
        if self.scaling.logger is not None:
            self.scaling.logger.close()

    # -- checkpoints (``checkpoint.py``) ----------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"inner": the wrapped optimizer's state_dict, "hvd_scale": the run's record}``
        (``hvd_scale.run``: the policy's state, S, k, the workers, ...), and ``"guard"``: the
        guard's latest estimate, with a guard."""
        return checkpoint.state_dict(self._inner, self.scaling)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore both parts; everything is validated before anything changes
        (``checkpoint.validated``): the groups and their parameters' count, each parameter's
        state tensors against its shape, the run's record (spec, version, groups; the saved k
        under adapt="goodput", within max_passes; ``hvd_scale.run.restored``).

        Load on every rank, or on rank 0 followed by ``broadcast_state`` on every rank: a rank
        that did not load keeps its own record (detected at the first step:
        ``Scaling.agree_on_state``; a later load on some ranks only is not)."""
        run = checkpoint.validated(state_dict, self._inner, self.scaling)
        self._inner.load_state_dict(state_dict["inner"])
        # torch's load_state_dict builds new group dicts and a new state: share them again.
        self.param_groups, self.state = self._inner.param_groups, self._inner.state
        guard = self.scaling.guard
        if guard is not None and state_dict.get("guard") is not None:
            guard.load_state_dict(state_dict["guard"])
        self._statistics.reset()  # a statistics allreduce in flight: finish, then drop
        self.scaling.run = run
        self._engine.follow_passes(run.passes)  # the saved k, where k adapts

    def sync_run(self, root_rank: int = 0) -> None:
        """Take ``root_rank``'s run record (``broadcast_state``, an elastic sync), k included."""
        if self._statistics.started() or self._engine.in_step():
            raise RuntimeError("broadcast_state() between backward passes of a step: call it "
                               "before the first backward pass or after step()")
        self.scaling.broadcast(root_rank)
        self._engine.follow_passes(self.scaling.passes)

    # -- the hooks of adapters/protocol.py ---------------------------------------------------------
    def reduced_statistics(self, step: _Step):
        """(step, statistics, finite, count): this step's [s..., c, w, q...] (a device tensor,
        ``StepRecord.pack``) after the gradients' reduction, or None unmeasured, with the
        averaged gradient's finiteness then (True under a GradScaler, which checks it itself)
        and the micro-gradients counted. The guard's sharpness is measured here when due."""
        self._engine.gather()
        gathered = self._statistics.step
        gathered.synchronized = False
        # Taken: a step that raises drops them.
        statistics, gathered.pending = gathered.pending, None
        count, gathered.count = gathered.count, None
        self.scaling.agree_on_state()  # once: a checkpoint loaded on some ranks only
        if self.scaling.guard_due():
            self._measure_sharpness(step.guard_loss)
        if statistics is not None:
            return step, statistics, True, None
        return step, None, self._grad_scaler is not None or self._statistics.grads_finite(), count

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
            return self._engine.inner_step(step.closure)
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
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self.optimizer_name in ADAM_OPTIMIZERS:
            # Adam's stability is about P^-1 H, P = diag(sqrt(v_hat) + eps): before its first
            # step there is no v_hat, and the next step measures instead (alike on every rank).
            if not all("exp_avg_sq" in self.state.get(p, {}) for p in params):
                return
            scaling = [self._statistics.preconditioned(p, torch.ones_like(p), group, floored=False).sqrt_()
                       for p in params]
            limits = {"beta1": group["betas"][0]}
        else:
            scaling = None
            limits = {"momentum": group.get("momentum", 0.0), "dampening": group.get("dampening", 0.0),
                      "nesterov": bool(group.get("nesterov", False))}
        with self._statistics.hooks_paused(), torch.enable_grad():
            local = hessian_top_eigenvalue(guard_loss, params, iterations=guard.iterations,
                                           tol=guard.tol, scaling=scaling, seed=step)
        mean = self._engine.average(torch.tensor(local, dtype=torch.float64,
                                                 device=self._statistics.device)).item()
        if math.isfinite(mean):  # else this step's gradients overflow too: it will be skipped,
            guard.update(mean, step, optimizer=self.optimizer_name, **limits)  # and measured again

    def _count_scaler_skips(self, scaler) -> None:
        """A GradScaler that skips this optimizer's step (an overflow: its ``step`` never calls
        ours) has that step counted skipped right there, not at the next synchronizing pass (a
        run ending on a skipped step would never count it): this scaler's ``step`` is wrapped
        (on the instance; a scaler shared by several optimizers wraps once for each)."""
        inner = getattr(scaler, "step", None)
        if not callable(inner):
            return

        def step(optimizer, *args, **kwargs):
            record = self.scaling.run.policy
            result = inner(optimizer, *args, **kwargs)
            if optimizer is self and self.scaling.run.policy is record:  # ours never ran
                self._skipped_by_scaler()
            return result
        scaler.step = step

    def _skipped_by_scaler(self) -> None:
        """The step the scaler skipped: its gathered statistics dropped, counted skipped."""
        if self.engine == "horovod" and not self._statistics.step.synchronized:
            # Horovod without synchronize() first: the scaler read the gradients before they
            # were averaged (its idiom synchronizes first); not ours to count. (The engines that
            # reduce in backward, DDP and FSDP2, sent the statistics there.)
            return
        self._statistics.skipped()

    def __repr__(self) -> str:
        return f"hvd_scale.DistributedOptimizer({self.optimizer_name}, {self.engine}, " \
               f"policy={self.scaling.policy.spec!r})"
