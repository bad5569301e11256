"""The shared half of every adapter: everything about a step that is not a tensor operation.

An adapter (see ``protocol.py``) produces the step's statistics in its framework and hands them
here as one host vector (``hvd_scale.reduce``'s layout); ``Scaling.step`` returns the factor to
apply. No framework is imported here: the Horovod module is passed in (``HorovodBinding``).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hvd_scale.adapters import agreement, checkpoint
from hvd_scale.adapters.adapt import ADAPT_EVERY, Adaptation, StepClock, check_passes
from hvd_scale.adapters.log import MetricsLogger
from hvd_scale.adapters.readout import Readout  # noqa: F401  (the adapters import it from here)
from hvd_scale.guard import UNGUARDED_METRICS, SharpnessGuard, stability_limit
from hvd_scale.moments import EPS_CORRECTED, AdamStep, adam_step, moment_progress
from hvd_scale.policies import Policy, StepInfo
from hvd_scale.reduce import unpack_step

NONFINITE = ("skip", "raise")
# Skipped steps in a row after which a run has diverged (the weights themselves overflow the
# forward pass; skipping would go on forever without advancing tau). AMP's scaler needs a few
# dozen skips at most to find its scale.
DIVERGED_AFTER = 100


# What the framework's optimizer holds for each parameter group before a step (its
# ``user_settings``): the step's baseline lr (a schedule's value), Adam's betas and eps, the
# decoupled (AdamW) decay and the step count t its bias correction will use after this step; nan
# where it has no such value.
USER_SETTINGS = ("lr", "beta1", "beta2", "eps", "weight_decay", "framework_step")
# The host's answer (``Scaling.plan``), a row per group: the policy's lr factor (0: the step is
# skipped) and what the inner update uses for this step only; nan: the user's value stays.
PLAN = ("lr_factor", "lr", "beta1", "beta2", "eps", "weight_decay")


def run_step(opt, closure=None):
    """One optimizer step, the same sequence for every adapter (``protocol.FrameworkOptimizer``):
    the step's statistics reduced over workers, the policy's plan on the host, the inner update
    with the plan's settings (the user's values put back after)."""
    statistics, finite = opt.reduced_statistics()
    plan = opt.on_host(opt.scaling.plan, statistics, finite, opt.user_settings(), opt.loss_scale())
    return opt.apply_step(plan, closure)


def precondition(grad, second_moment, correction, eps, sqrt):
    """Adam's preconditioned gradient g / (sqrt(v / c2) + eps), c2 = 1 - beta2^t the bias
    correction of v (``Policy.second_moment_correction``), in any framework's ops (``sqrt``)."""
    return grad / (sqrt(second_moment / correction) + eps)


class Scaling:
    """A policy run by an adapter: set-up checks, the host side of each step, logs and state.

    Args:
        hvd: the framework's Horovod module (``HorovodBinding``).
        policy: a spec string, a ``Policy``, or None (``$HVD_SCALE_POLICY``, else adascale).
        passes: k, backward passes per step; S defaults to workers x k.
        scale: S when the baseline batch is not a micro-batch.
        budget: T in baseline steps.
        optimizer_name: the wrapped optimizer's class name (the policy checks its theory).
        framework: recorded in run.json ("torch", "keras/tensorflow", ...).
        groups: parameter groups (one sum and one |g_bar|^2 each).
        base_lrs: the groups' baseline lrs where they are numbers (checked finite and > 0), as a
            sequence (named ``param_groups[i]`` in errors) or a mapping {name: lr}.
        agreed: further values every rank must share (e.g. an lr schedule's config); with the
            policy's spec, S, T, passes, base lrs, measure, nonfinite, groups and the guard's
            settings they are compared across ranks in the one allgather at set-up.
        measure: take statistics although the policy does not need them; default: when the
            policy needs them or metrics are logged. Never at S = 1 with one micro-gradient a
            step (one process, k = 1, not elastic): there is nothing to measure.
        log_dir: per-step metrics on rank 0; None: none (the adapter resolves
            ``$HVD_SCALE_LOG_DIR``: ``environment.log_dir``).
        log_every: steps between rows (``adapters.log.due``; the adapter resolves
            ``$HVD_SCALE_LOG_EVERY``: ``environment.log_every``).
        loss_after_step: the framework knows a step's loss only after it (Keras's batch logs):
            a row waits for ``log_loss``.
        elastic: under Horovod elastic (``environment.elastic``): no collective at set-up, where a
            joining worker builds its optimizer while the others train.
        nonfinite: "skip" a step with non-finite gradients on every rank, or "raise".
        short_steps: the framework can take a step with fewer micro-batches than workers x k
            (torch: a leftover batch at an epoch's end; uneven passes across ranks); such a step
            is accounted at its own scale, S x n / (workers x k). Else a count other than
            workers x k is an error.
        guard: a ``hvd_scale.guard.SharpnessGuard`` capping lr x factor; the adapter measures
            the sharpness when ``guard_due()`` and hands it to ``guard.update``.
        check: the adapter's own check of its set-up, given the built policy: a ValueError it
            raises is reported on every rank in the set-up's one allgather.
        lr_names: how errors name each group's lr at a step (``check_lrs``); default "lr" for
            one group, else ``param_groups[i]['lr']``.
        eps_placement: where the framework's Adam puts eps (``hvd_scale.moments``).
        adapt, max_passes, adapt_every: "goodput" to let the ranks agree on k (up to
            ``max_passes``) every ``adapt_every`` steps (``adapted_passes``); the adapter applies
            it (``set_passes``).
    """

    def __init__(self, hvd, *, policy: str | Policy | None, passes: int, scale: float | None,
                 budget: float | None, optimizer_name: str, framework: str, groups: int = 1,
                 base_lrs: Sequence[Any] | Mapping[str, Any] = (),
                 measure: bool | None = None,
                 log_dir: str | None = None, nonfinite: str = "skip", short_steps: bool = False,
                 guard: SharpnessGuard | None = None, agreed: Mapping[str, Any] | None = None,
                 check: Callable[[Policy], None] | None = None, elastic: bool = False,
                 lr_names: Sequence[str] | None = None, eps_placement: str = EPS_CORRECTED,
                 adapt: str | None = None, max_passes: int | None = None,
                 adapt_every: int = ADAPT_EVERY, log_every: int | None = None,
                 loss_after_step: bool = False):
        self.hvd = hvd
        self.elastic = elastic
        self.lr_names = tuple(lr_names) if lr_names is not None else \
            ("lr",) if groups == 1 else tuple(f"param_groups[{i}]['lr']" for i in range(groups))
        self.eps_placement = eps_placement
        if guard is not None:
            if not isinstance(guard, SharpnessGuard):
                raise TypeError(f"guard must be a hvd_scale.guard.SharpnessGuard, got {type(guard).__name__}")
            stability_limit(1.0, optimizer=optimizer_name)  # an optimizer it has no limit for: now
        self.guard = guard
        self.passes = check_passes(passes)
        self.adaptation = Adaptation(adapt, max_passes, adapt_every, self.passes, measure)
        if self.adaptation.adapt is not None:
            measure = True  # the gain at another k needs sigma2 and mu2
        self.clock = StepClock()
        self._timing = self.clock.lap(self.passes, hvd.size())  # times nan: no step timed yet
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.groups = groups
        self.short_steps = short_steps
        self.optimizer_name = optimizer_name

        def measured(built: Policy) -> bool:
            # One micro-gradient at S = 1 (one process, k = 1, not elastic: it stays so) measures
            # nothing, and the gain is 1 by definition: no statistics, no per-tensor work.
            if built.scale == 1 and hvd.size() * self.passes == 1 and not elastic \
                    and self.adaptation.adapt is None:
                return False
            return bool(built.uses_statistics or log_dir is not None if measure is None else measure)

        base_lrs = dict(base_lrs) if isinstance(base_lrs, Mapping) else \
            {f"param_groups[{i}]": lr for i, lr in enumerate(base_lrs)}
        guard_settings = None if guard is None else {
            "every": guard.every, "iterations": guard.iterations, "tol": guard.tol,
            "margin": guard.margin}
        self.policy = agreement.agreed_policy(
            hvd, policy=policy, scale=scale, budget=budget, passes=self.passes,
            optimizer_name=optimizer_name, base_lrs=base_lrs, check=check, elastic=elastic,
            settings=lambda built: {
                "backward_passes_per_step": self.passes, "lr": base_lrs,
                "parameter groups": groups, "measure": measured(built), "nonfinite": nonfinite,
                "guard": guard_settings, **self.adaptation.settings(), **(agreed or {})})
        # Decided alike on every rank (compared above): the statistics allreduce must run on all
        # of them or none.
        self.measure = measured(self.policy)
        self.logger = None if log_dir is None else MetricsLogger(
            log_dir, rank=hvd.rank, budget=self.policy.budget,  # rank 0 of the moment writes
            run_info={"policy": self.policy.spec, "scale": self.policy.scale,
                      "workers": hvd.size(), "backward_passes_per_step": self.passes,
                      "optimizer": optimizer_name, "framework": framework}, every=log_every,
            loss_after_step=loss_after_step)
        self._world_size = hvd.size()
        self.last_lr = math.nan
        self.last_step: StepInfo | None = None  # what the latest accounted step applied
        self._state_agreed = False  # agree_on_state() ran
        self._skips_in_a_row = 0
        if hvd.rank() == 0:  # what runs, said once: the policy is often chosen by a flag
            print(self.start_line(log_dir), file=sys.stderr, flush=True)

    def start_line(self, log_dir: str | None) -> str:
        policy = self.policy
        n = self._world_size * self.passes
        how = ("a fixed factor" if not policy.uses_statistics else
               f"the gain measured each step from {n} micro-gradients" if self.measure else
               "gain 1 (one micro-gradient a step at S = 1: nothing to measure)")
        return (f"hvd_scale: policy {policy.spec} at S = {policy.scale:g} ({self._world_size} "
                f"worker(s) x {self.passes} pass(es)), {how}; "
                + (f"budget T = {policy.budget:g} baseline steps" if policy.budget else
                   "no budget (no progress bar; the loop decides when to stop)")
                + (f"; metrics in {log_dir}" if log_dir else ""))

    # -- the host side of a step -------------------------------------------------------------------
    def step(self, statistics: Sequence[float] | np.ndarray | None, *, base_lr: float,
             finite: bool = True, loss_scale: float | None = None) -> float:
        """Account one optimizer step and return its lr factor (0.0: the step is skipped).

        statistics: the step's vector ``[s..., c, q...]`` (``hvd_scale.reduce.unpack_step``),
            or None when nothing was measured. ``loss_scale``: the gradients were scaled by it.
        finite: the framework's own verdict on the averaged gradient (when not measured).
        A non-finite step is skipped (weights, optimizer state, statistics and tau stay; the
        policy counts it) or raises FloatingPointError, alike on every rank: the statistics and
        the averaged gradient are the same everywhere. ``DIVERGED_AFTER`` skips in a row raise
        FloatingPointError too: the run has diverged. A ``base_lr`` that is negative or not
        finite raises ValueError before anything is counted (``check_lrs``).
        """
        self.check_lrs({"lr": base_lr})
        self.follow_world_size()
        self._timing = self.clock.lap(self.passes, self._world_size)
        if statistics is not None:
            values = np.asarray(statistics, dtype=np.float64)
            finite = bool(finite) and bool(np.all(np.isfinite(values)))
        if not finite:
            if self.nonfinite == "raise":
                raise FloatingPointError(f"non-finite gradients at step {self.policy.steps + 1} "
                                         "(pass nonfinite='skip' to skip such steps)")
            self.skip()
            return 0.0
        self._skips_in_a_row = 0
        # lr 0 (a warm-up that starts there) needs no cap, and has none to divide by.
        cap = None if self.guard is None or base_lr == 0 else self.guard.max_factor(base_lr)
        if statistics is None:
            info = self.policy.step(max_factor=cap)
        else:
            sqnorm_sum, n, mean_sqnorm = unpack_step(values, self.groups, loss_scale)
            expected = self._world_size * self.passes
            if n == expected:
                info = self.policy.step(sqnorm_sum, mean_sqnorm, n, max_factor=cap)
            elif self.short_steps and 1 <= n < expected:
                # Each micro-batch is worth S / (workers x k) baseline batches: so is the step.
                try:
                    info = self.policy.step(sqnorm_sum, mean_sqnorm, n,
                                            scale=max(1.0, self.policy.scale * n / expected),
                                            max_factor=cap)
                except ValueError as e:
                    raise ValueError(f"hvd_scale: a short step of {n} backward pass(es) in all "
                                     f"({self._world_size} workers x {self.passes} announced) "
                                     f"cannot be measured: {e}") from e
            elif n == 0:  # no backward pass on any rank since the last step
                raise RuntimeError("hvd_scale: step() found no gradients from any backward pass "
                                   f"(0 micro-gradients, expected {self._world_size} workers x "
                                   f"{self.passes}): call loss.backward() (once per pass, "
                                   "backward_passes_per_step times) before step()")
            else:  # e.g. a world size frozen in a traced graph
                raise RuntimeError(f"hvd_scale: the step's statistics count {n} micro-gradients, "
                                   f"expected {self._world_size} workers x {self.passes}")
        self.last_lr = float(base_lr) * info.lr_factor
        self.last_step = info
        if self.logger is not None:
            self.logger.step(self.policy.steps, self.metrics)
        return info.lr_factor

    def plan(self, statistics, finite, user_settings, loss_scale: float | None = None) -> np.ndarray:
        """The host side of one step, for every adapter (``run_step``): the step's plan, a row of
        ``PLAN`` per group, from its statistics (``step``) and the groups' ``USER_SETTINGS``.

        The groups' lrs are checked before anything counts (``check_lrs``). Unmeasured, the
        statistics are ignored and ``finite`` is the framework's verdict on the gradient.
        """
        user = np.asarray(user_settings, dtype=np.float64).reshape(self.groups, len(USER_SETTINGS))
        lrs = user[:, 0].tolist()
        self.check_lrs(dict(zip(self.lr_names, lrs)))
        if self.policy.moments_in_progress:
            self.check_adam_history(user[:, -1].tolist())
        loss_scale = None if loss_scale is None else float(loss_scale)
        factor = self.step(statistics if self.measure else None, base_lr=lrs[0], finite=bool(finite),
                           loss_scale=loss_scale)
        plan = np.full((self.groups, len(PLAN)), np.nan)
        plan[:, 0] = factor
        plan[:, 1] = user[:, 0] * factor
        if factor == 0.0 or not self.policy.moments_in_progress:
            return plan
        for row, (lr, beta1, beta2, eps, decay, t) in zip(plan, user.tolist()):
            adam = self.adam_step(self.last_step, base_lr=lr, lr_factor=factor, beta1=beta1,
                                  beta2=beta2, eps=eps,
                                  framework_step=int(t), eps_placement=self.eps_placement,
                                  weight_decay=None if math.isnan(decay) else decay)
            row[1:] = (adam.lr, adam.beta1, adam.beta2, adam.eps,
                       math.nan if adam.weight_decay is None else adam.weight_decay)
        return plan

    def adam_step(self, info: StepInfo | None, *, base_lr: float, lr_factor: float,
                  beta1: float, beta2: float, eps: float, framework_step: int, eps_placement: str,
                  weight_decay: float | None = None) -> AdamStep | None:
        """The framework's Adam settings for the step ``info`` (``hvd_scale.moments``): None
        where the policy leaves Adam's moments alone (every policy but adascale_adam's default).
        ``framework_step``: the t the framework's bias correction will use."""
        if info is None or not self.policy.moments_in_progress:
            return None
        return adam_step(lr=base_lr * lr_factor, base_lr=base_lr, beta1=beta1, beta2=beta2,
                         eps=eps, gain=info.gain,
                         progress=moment_progress(info.progress, info.step, framework_step),
                         framework_step=framework_step, eps_placement=eps_placement,
                         weight_decay=weight_decay)

    def check_adam_history(self, framework_steps: Sequence[float]) -> None:
        """Adam's state must have taken at least the steps the policy accounted. With horizons in
        progress its bias correction is 1 - beta^tau: a fresh Adam state (one gradient in v)
        under a restored policy (tau of a long run) would take a first update several times too
        large. Raised alike on every rank, before anything is counted."""
        steps = self.policy.steps
        behind = [t for t in framework_steps if math.isfinite(t) and t < steps + 1]
        if behind:
            raise ValueError(
                f"hvd_scale: the optimizer's Adam state has taken {int(min(behind)) - 1} "
                f"update(s), but the policy state has accounted {steps} step(s) (tau "
                f"{self.policy.progress:g}): a policy state restored without the optimizer's own "
                "(a fresh Adam under a loaded policy) would make this update several times too "
                "large, as adascale_adam corrects Adam's bias by tau. Restore both from one "
                "checkpoint (opt.load_state_dict), or start the policy afresh too (the step was "
                "not applied nor counted)")

    def check_lrs(self, lrs: Mapping[str, Any]) -> None:
        """The lrs of the step about to be taken ({name: lr}) must be finite and >= 0: set after
        construction (by hand or by a scheduler), a negative lr would ascend the loss and nan or
        inf would wreck the weights. The user's lrs are the same on every rank when every rank
        runs the same code, so this raises alike on every rank. 0 is allowed: warm-ups such as
        LambdaLR(lambda s: s / warmup) or Keras's CosineDecay(0.0, warmup_target=...) start there.
        """
        for name, lr in lrs.items():
            try:
                value = float(lr)
            except (TypeError, ValueError):
                value = math.nan
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"hvd_scale: {name} is {lr!r} at step {self.policy.steps + 1}: "
                                 "the learning rate must be a finite number >= 0 (the step was "
                                 "not applied nor counted)")

    def agree_on_state(self) -> None:
        """Once, at the first step: every rank must hold the same policy state (steps, tau);
        ``agreement.agree_on_state``. One small allgather per job; none under elastic."""
        if not self._state_agreed:
            self._state_agreed = True
            agreement.agree_on_state(self.hvd, self.policy, self.elastic)

    def guard_due(self) -> bool:
        """The next step should measure the sharpness first (alike on every rank)."""
        return self.guard is not None and self.guard.due(self.policy.steps)

    def skip(self) -> None:
        """A step measured but never applied (non-finite, or an AMP overflow skipped it)."""
        self.policy.skip()
        self._skips_in_a_row += 1
        if self._skips_in_a_row >= DIVERGED_AFTER:
            # Say what was skipped and what was applied last; no lr when nothing was applied.
            last = "no step has been applied since the optimizer was built" \
                if math.isnan(self.last_lr) else f"the last step applied had lr {self.last_lr:g}"
            raise FloatingPointError(
                f"hvd_scale: {self._skips_in_a_row} steps in a row had non-finite gradients and "
                f"were skipped without applying anything (all at step {self.policy.steps + 1}, "
                f"tau {self.policy.progress:g}; {last}): training has diverged")

    def follow_world_size(self) -> None:
        """Horovod elastic changed the number of workers: S changes in proportion (a scale given
        for another baseline batch stays consistent); AdaScale keeps its estimates and tau."""
        size = self.hvd.size()
        self.policy.follow_workers(self._world_size, size)  # S < 1 is refused, nothing changed
        self._world_size = size

    def rescale(self, scale: float | None = None) -> None:
        """New S; None: follow the world size, keeping S / (workers x k) (a ``scale=`` given for
        another baseline batch stays in proportion)."""
        if scale is None:
            self.follow_world_size()
        else:
            self.policy.rescale(scale)

    @property
    def timings_read(self) -> bool:
        """The step clock's timings are read (logged, or adapt="goodput" fits them): an adapter
        for which a stamp costs something (Keras's host calls in a traced step) stamps only then."""
        return self.logger is not None or self.adaptation.adapt is not None

    @property
    def adapt(self) -> str | None:
        """"goodput" when k adapts, else None."""
        return self.adaptation.adapt

    @property
    def max_passes(self) -> int | None:
        return self.adaptation.max_passes

    def set_passes(self, passes: int) -> None:
        """k passes per step from the next step on (alike on every rank): S follows in
        proportion, so the policy's factor and tau's advance are those of the new S."""
        k = check_passes(passes)
        if k != self.passes:
            self.policy.rescale(self.policy.scale * k / self.passes)
            self.passes = k

    def adapted_passes(self) -> int:
        """adapt="goodput": every ``adapt_every`` steps, the k of largest predicted goodput
        (``adapt.Adaptation.choose``) from rank 0's step times and the estimates, broadcast so
        that every rank takes the same; else the current k. Call after each step, on every rank."""
        steps = self.policy.steps
        if not self.adaptation.due(steps):
            return self.passes
        choice = self.passes
        if self.hvd.rank() == 0:
            estimator = self.policy.estimator
            choice = self.adaptation.choose(self.clock, sigma2=estimator.sigma2, mu2=estimator.mu2,
                                            scale=self.policy.scale, passes=self.passes,
                                            workers=self._world_size,
                                            max_gain=getattr(self.policy, "max_gain", math.inf))
        if self.hvd.size() > 1:
            choice = self.hvd.broadcast_object(choice, root_rank=0, name="hvd_scale.passes")
        if choice != self.passes and self.hvd.rank() == 0:
            print(f"hvd_scale: step {steps}, tau {self.policy.progress:g}: {self.passes} -> "
                  f"{choice} passes per step (S {self.policy.scale:g} -> "
                  f"{self.policy.scale * choice / self.passes:g}; adapt='goodput')", flush=True)
        return choice

    # -- what is read --------------------------------------------------------------------------------
    def metrics(self, policy: Policy | None = None) -> dict[str, float]:
        """``hvd_scale.metrics.STEP_METRICS``: the policy's (``policy``: as the adapter holds it;
        default this one), the lr the latest step applied, and the guard's (nan and inf without
        one)."""
        guard = UNGUARDED_METRICS if self.guard is None else self.guard.metrics()
        return {**(policy or self.policy).metrics(), "lr": self.last_lr, **guard, **self._timing}

    # -- checkpoints (``checkpoint.py``) ----------------------------------------------------------
    def loaded_policy(self, state: dict) -> Policy:
        """A policy of this job's spec, scale and budget holding ``state`` (validated; the current
        policy is not touched, so a bad checkpoint changes nothing)."""
        return checkpoint.loaded_policy(self.policy, state, self.groups)

    def broadcast(self, root_rank: int = 0) -> None:
        """Every rank takes ``root_rank``'s policy state (and guard estimate)."""
        self.policy = checkpoint.broadcast(self.hvd, self.policy, self.guard, self.groups,
                                           root_rank)
