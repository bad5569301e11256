"""The torch optimizer: the hooks of ``adapters/protocol.py`` in torch, and nothing more (the
math is in the engine, the sequence of a step and everything that is not a tensor operation in
``adapters/core.py``). This file holds the optimizer, its Horovod protocol and the protocol's
hooks; the statistics it gathers are in ``statistics.py`` (their norms in ``norms.py``), its
checkpoints and broadcasts in ``checkpoint.py``:

* local statistics: the norm of each backward pass's own gradient (no ``.item()`` per parameter,
  no gradient-sized copy), taken before Horovod's in-place allreduce. With one pass per step,
  Horovod's own hook hands each gradient over and it is sent with its bucket right after one
  fused norm kernel over the bucket; with accumulation, a tensor hook on every parameter sees
  each pass's gradient before it is added into p.grad;
* the per-group sums of squared norms and the micro-batch count (the engine's layout) go out in
  one small asynchronous allreduce started just before Horovod waits on the gradients, so it is
  fused with the gradient traffic instead of adding a blocking collective;
* ``p.grad`` becomes the mean of the step's micro-gradients (in place, on the device), and
  |g_bar|^2 per group is taken from it; the only host transfer of the step brings these 2G + 1
  numbers back (``reduced_statistics``);
* the plan's lr (and Adam's settings) are set on each group for the inner step, then the user's
  values are restored, so torch lr schedulers keep working on the baseline lr (``apply_step``).

One gain for the whole model (the paper's choice): the engine sums sigma2 and mu2 over groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import horovod.torch as hvd
import torch

from hvd_scale.adapters import environment
from hvd_scale.adapters.adapt import ADAPT_EVERY, Adaptation, check_passes
from hvd_scale.adapters.core import USER_SETTINGS, Framework, Readout, Request, Scaling, run_step
from hvd_scale.guard import ADAM_OPTIMIZERS, SharpnessGuard
from hvd_scale.moments import EPS_CORRECTED
from hvd_scale.policies import Policy

from .checkpoint import Checkpoints
from .hessian import hessian_top_eigenvalue
from .process_set import ProcessSetBinding
from .statistics import Statistics, _StepState

SHARPNESS_NAME = "hvd_scale.sharpness"


def _check_op(op) -> None:
    """Only ops that combine the workers' gradients. Horovod's Adasum optimizer runs the inner
    optimizer's step inside each parameter's gradient hook, during backward, with the lr set
    at that moment, and combines the workers' updates instead of their gradients: no step is
    left for the policy's lr factor, a non-finite step cannot be skipped, and there is no
    averaged gradient to measure (its ``skip_synchronize()`` raises AssertionError)."""
    if op not in (hvd.Average, hvd.Sum):
        why = ("Horovod's Adasum optimizer applies the inner step inside backward and combines "
               "the workers' updates, leaving no step for the policy to scale and no averaged "
               "gradient to measure") if op == hvd.Adasum else "it does not average gradients"
        raise ValueError(f"op={'hvd.Adasum' if op == hvd.Adasum else repr(op)} is not supported: "
                         f"{why}; use op=hvd.Average (or hvd.Sum)")


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


class DistributedOptimizer(Readout, Statistics, Checkpoints, torch.optim.Optimizer):
    """Wrap any torch optimizer: Horovod gradient averaging plus an lr scaling policy.

    Args:
        optimizer: the torch optimizer to wrap (its ``param_groups`` are shared, as in Horovod).
        named_parameters: as for ``hvd.DistributedOptimizer``.
        policy: a spec string (``"adascale"``, ``"warmup:fraction=0.055"``, ...), a ``Policy``, or
            None for ``$HVD_SCALE_POLICY``, else ``"adascale"``.
        backward_passes_per_step: k local backward passes per step. The step applies the *mean*
            of the micro-gradients over passes and workers (as Keras does): compute each
            micro-batch's mean loss and do not divide it by k. A short step (fewer passes on some
            or all workers: a leftover batch) counts the passes actually taken.
        scale: S; default workers x k (micro-batch = baseline batch). Give it when the baseline
            batch differs from a micro-batch: S = workers x k x micro_batch / baseline_batch.
        budget: T in baseline steps, for ``done()`` and ``warmup:fraction=``.
        grad_scaler: a ``torch.amp.GradScaler`` in use, so statistics are taken unscaled.
        measure: compute gradient statistics even when the policy does not need them (to log
            sigma2, mu2, gain for fixed rules). Default: when the policy needs them or metrics
            are logged.
        log_dir: write per-step metrics there on rank 0 (CSV, TensorBoard, a progress bar);
            default ``$HVD_SCALE_LOG_DIR`` (set by ``hvd-scale run --log-dir``), else none.
        nonfinite: a step whose gradients are not finite is skipped on every rank ("skip",
            counted in ``opt.skipped``) or raises FloatingPointError on every rank ("raise").
        guard: a ``hvd_scale.guard.SharpnessGuard``: every N steps the top Hessian eigenvalue is
            measured on each worker's batch and averaged, and lr x factor is capped at the
            optimizer's stability limit (SGD, Adam, AdamW). Its steps need
            ``step(guard_loss=fn)``: ``fn()`` returns this worker's loss on its current batch.
        adapt: "goodput" to adapt k while training: every ``adapt_every`` steps the ranks agree
            on the k in [1, max_passes] of largest predicted goodput (``hvd_scale.goodput``: the
            gain at the new S over the step time at that k, from this job's timings), with
            hysteresis. S follows k (the policy's factor and tau are the new S's); the training
            loop takes ``opt.backward_passes_per_step`` passes before each step (read it every
            step). The k in use is saved in ``state_dict()`` and restored on load.
        max_passes: the largest k adapt may choose (>= backward_passes_per_step).
        **horovod_options: compression, op, gradient_predivide_factor, groups, sparse_as_dense,
            process_set: passed to ``hvd.DistributedOptimizer``. With a ``process_set``, S, n, the
            policy agreement and the statistics are the set's, as the averaged gradients are.
            op=hvd.Sum is normalized like Average (the mean micro-gradient is applied);
            op=hvd.Adasum is refused (``_check_op``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 policy: str | Policy | None = None, backward_passes_per_step: int = 1, *,
                 scale: float | None = None, budget: float | None = None,
                 grad_scaler: Any = None, measure: bool | None = None, log_dir: str | None = None,
                 nonfinite: str = "skip", guard: SharpnessGuard | None = None,
                 adapt: str | None = None, max_passes: int | None = None,
                 adapt_every: int = ADAPT_EVERY, **horovod_options: Any):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer) or hasattr(optimizer, "_allreduce_delay"):
            raise TypeError("optimizer is already distributed: wrap the plain torch optimizer once")
        op = horovod_options.get("op", hvd.Average)
        process_set = horovod_options.get("process_set", hvd.global_process_set)
        # S, n, the agreement and the statistics live within the process set, as the gradients do.
        self._process_set = process_set
        groups = len(optimizer.param_groups)
        self.scaling = Scaling(
            ProcessSetBinding(process_set),
            Request(policy=policy, passes=backward_passes_per_step, scale=scale, budget=budget,
                    measure=measure, nonfinite=nonfinite, log_dir=environment.log_dir(log_dir),
                    log_every=environment.log_every()),
            Framework(optimizer_name=type(optimizer).__name__, name="torch", groups=groups,
                      base_lrs=[g.get("lr") for g in optimizer.param_groups],
                      lr_names=[f"param_groups[{i}]['lr']" for i in range(groups)],
                      eps_placement=EPS_CORRECTED, short_steps=True,
                      elastic=environment.elastic(), check=lambda _: _check_op(op)),
            adaptation=Adaptation(adapt, max_passes, adapt_every,
                                  check_passes(backward_passes_per_step), measure),
            guard=guard)
        self.backward_passes_per_step = backward_passes_per_step
        self.optimizer_name = type(optimizer).__name__
        self._measure = self.scaling.measure  # fixed for the optimizer's life (its hooks)
        self._op = op
        # Horovod's factors for the gradients (hvd.DistributedOptimizer's): the statistics match.
        predivide = horovod_options.get("gradient_predivide_factor", 1.0)
        self._factors = (1.0 / predivide, predivide) if op == hvd.Average else (1.0, 1.0)
        self._grad_scaler = grad_scaler

        self._hvd_opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters,
            backward_passes_per_step=backward_passes_per_step, **horovod_options)
        # Become a real torch Optimizer over the same groups (lr schedulers check isinstance and
        # read/write group["lr"]), then share the Horovod optimizer's groups and state outright.
        super().__init__(self._hvd_opt.param_groups, self._hvd_opt.defaults)
        self.param_groups = self._hvd_opt.param_groups
        self.state = self._hvd_opt.state

        float64 = any(p.dtype == torch.float64 for p in self._params())
        self._stats_dtype = torch.float64 if float64 else torch.float32  # on the wire
        self._skip_sync = False
        # Parameters Horovod and the hooks know: a later unfreezing is refused at the next step.
        self._frozen = [p for p in self._params() if not p.requires_grad]
        self._hooks = []
        trained = [(gi, p) for gi, group in enumerate(self.param_groups)
                   for p in group["params"] if p.requires_grad]
        self._trained = len(trained)
        self._all_gradients = len(trained) * backward_passes_per_step  # a full step's
        self._hooks_paused = False  # the guard's Hessian-vector products are not passes
        # One pass per step: p.grad is that pass's gradient when Horovod's own hook sends it, so
        # the norms are taken right there, a bucket at a time (one fused kernel per bucket, and
        # no hook of ours per tensor). With accumulation (or Horovod's groups=) each pass's
        # gradient is seen only by a tensor hook, before it is added into p.grad.
        # Horovod hooks the parameters only where it allreduces (not in a one-process job that
        # is not elastic): there the tensor hooks count the pass.
        # (adapt: k may change, so the tensor hooks serve every k.)
        self._bucketed = (self._measure and backward_passes_per_step == 1 and adapt is None
                          and horovod_options.get("groups") is None
                          and bool(self._hvd_opt._requires_update))
        self._sending_rest = False  # Horovod's synchronize() sends what backward did not produce
        # One process that is not elastic: Horovod allreduces no gradient, and the statistics
        # are their own sum (through Horovod they would wait a cycle of its thread every step).
        self._alone = hvd.size() == 1 and not self._hvd_opt._requires_update
        self._group_of = {p: gi for gi, p in trained}
        self._send = self._hvd_opt._allreduce_grad_async
        if self._bucketed:
            self._hvd_opt._allreduce_grad_async = self._send_in_buckets  # Horovod's hook calls it
        elif self._measure:
            for index, (gi, p) in enumerate(trained):
                self._hooks.append(p.register_hook(self._make_norm_hook(gi, p, index)))
        elif self._hvd_opt._requires_update:
            # Unmeasured, the micro-gradients are still counted (a short step's S and mean): from
            # Horovod's own counters, the count sent with the step's last gradient.
            self._hvd_opt._allreduce_grad_async = self._send_counting
        elif not self._alone or adapt is not None or backward_passes_per_step > 1:
            # One process, no Horovod hooks: a hook per parameter counts the passes.
            for index, (gi, p) in enumerate(trained):
                self._hooks.append(p.register_hook(self._make_count_hook(index)))
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

    # -- the Horovod protocol -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the gradient allreduce (and the statistics'); as ``hvd.DistributedOptimizer``.
        Afterwards p.grad holds the mean micro-gradient (see ``_to_mean_gradient``)."""
        self._check_no_parameter_unfrozen()
        self.scaling.clock.waiting()
        step = self._step
        if step.pending is not None or step.count is not None:
            # The previous step's statistics were never used: its step was skipped (AMP overflow).
            self.scaling.skip()
            step.pending = step.count = None
        self._flush_bucket()  # gradients still waiting in a bucket (some got none this step)
        handle, step.stats_handle = step.stats_handle, None
        if self._measure and handle is None:
            # Fewer gradients than every parameter x k passes: send the statistics now.
            handle = self.start_statistics()
        counting = not self._measure and (self._hooked or self._hvd_opt._requires_update)
        if counting and handle is None:  # a short step, or one process: the count now
            handle = self._start_count(self._local_passes())
        self._sending_rest = True
        try:
            self._hvd_opt.synchronize()
        finally:
            self._sending_rest = False
        if handle is None:
            self._to_mean_gradient(None)
        elif counting:
            count = self._sum_of(handle).round()  # exact again after the average's rounding
            step.counted()
            self._to_mean_gradient(count[0])
            step.count = int(count.item())
        else:
            summed = self._summed(handle)
            self._to_mean_gradient(summed[len(self.param_groups)])
            # [s..., c, q...] (hvd_scale.reduce's step layout), still on the gradients' device.
            step.pending = torch.cat([summed, self.mean_sqnorms()])
        step.synchronized = True
        self.scaling.clock.waited()

    def _check_no_parameter_unfrozen(self) -> None:
        """A parameter made trainable after the optimizer was built has neither Horovod's
        allreduce nor a norm hook: its workers would drift apart and the statistics miss it."""
        unfrozen = [p for p in self._frozen if p.requires_grad]
        if unfrozen:
            shapes = [tuple(p.shape) for p in unfrozen]
            raise ValueError(f"hvd_scale: {len(unfrozen)} parameter(s) of shape(s) {shapes} were "
                             "made trainable after DistributedOptimizer was built; Horovod would "
                             "not average their gradients and the statistics would miss them. "
                             "Build the optimizer again (DistributedOptimizer(...)) after changing "
                             "requires_grad, then load its state_dict")

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``opt.synchronize(); ...; with opt.skip_synchronize(): opt.step()`` (AMP, clipping)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    # -- torch.optim.Optimizer ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, guard_loss=None):
        """Synchronize, let the policy plan the step, and apply it (``core.run_step``).

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
        factor and tau's advance are the new S's), and so do Horovod's accumulation counters."""
        k = check_passes(passes)
        if k == self.backward_passes_per_step:
            return
        if self._step.fired_total or any(self._step.fired) or self._hvd_opt._handles:
            raise RuntimeError("set_passes() between backward passes of a step: call it after "
                               "step() and before the next step's first backward pass")
        if k > 1 and self._bucketed:
            raise ValueError(f"set_passes({k}): this optimizer was built for one pass per step "
                             "with its norms taken in Horovod's buckets; build it with "
                             "backward_passes_per_step > 1 or adapt='goodput' to change k")
        self.scaling.set_passes(k)  # the run's record at the new k: refused there, if it cannot
        if not (self._measure or self._hooked or self._hvd_opt._requires_update):
            # One process, unmeasured, built at k = 1: from now on a short step can happen, and
            # its passes are counted.
            trained = [p for p in self._params() if p.requires_grad]
            self._hooks = [p.register_hook(self._make_count_hook(i)) for i, p in enumerate(trained)]
            self._hooked = len(self._hooks)
            self._step = self._new_step()
        self._follow_passes()

    def _follow_passes(self) -> None:
        """Horovod's accumulation and this optimizer's counts follow the record's k."""
        k = self.scaling.passes
        self._hvd_opt.set_backward_passes_per_step(k)
        self.backward_passes_per_step = k
        self._all_gradients = self._trained * k

    # -- the hooks of adapters/protocol.py ---------------------------------------------------------
    def reduced_statistics(self, step: _Step):
        """(step, statistics, finite, count): this step's [s..., c, q...] (a device tensor)
        after the gradients' allreduce, or None unmeasured, with the averaged gradient's
        finiteness then (True under a GradScaler, which checks it itself) and the
        micro-gradients counted. The guard's sharpness is measured here when due."""
        gathered = self._step
        if not (gathered.synchronized or self._skip_sync):
            self.synchronize()
        gathered.synchronized = False
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
            with self._hvd_opt.skip_synchronize():
                return self._hvd_opt.step(step.closure)
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
            scaling = [self._precondition(p, torch.ones_like(p), group).sqrt_() for p in params]
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
        mean = hvd.allreduce(torch.tensor(local, dtype=torch.float64), op=hvd.Average,
                             name=SHARPNESS_NAME, process_set=self._process_set).item()
        if math.isfinite(mean):  # else this step's gradients overflow too: it will be skipped,
            guard.update(mean, step, optimizer=self.optimizer_name, **limits)  # and measured again

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Horovod's zero_grad() takes no argument; its check (no allreduce in flight) comes first.
        if self._hvd_opt._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        torch.optim.Optimizer.zero_grad(self._hvd_opt, set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"hvd_scale.DistributedOptimizer({self.optimizer_name}, policy={self.policy.spec!r})"
