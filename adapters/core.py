"""The shared half of every adapter: everything about a step that is not a tensor operation.

An adapter (see ``protocol.py``) produces the step's statistics in its framework and hands them
here as one host vector (``hvd_scale.reduce``'s layout); ``Scaling.plan`` returns the plan (the
factor and the inner step's settings) to apply. No framework is imported here: the Horovod module is passed in (``HorovodBinding``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hvd_scale import run as runs
from hvd_scale.adapters import agreement
from hvd_scale.adapters.adapt import ADAPT_EVERY, Adaptation, StepClock, check_passes
from hvd_scale.adapters.log import MetricsLogger
from hvd_scale.adapters.readout import Readout  # noqa: F401  (the adapters import it from here)
from hvd_scale.estimate import check_samples, resolve_samples
from hvd_scale.guard import UNGUARDED_METRICS, SharpnessGuard, stability_limit
from hvd_scale.moments import EPS_CORRECTED
from hvd_scale.noise import metrics as noise_metrics
from hvd_scale.policies import Policy
from hvd_scale.reduce import unpack_step
from hvd_scale.run import DIVERGED_AFTER, NONFINITE, PLAN, USER_SETTINGS, RunState  # noqa: F401


def run_step(opt, step):
    """One optimizer step, the same sequence for every adapter (``protocol.FrameworkOptimizer``):
    the step's statistics reduced over workers, the policy's plan on the host, the inner update
    with the plan's settings (the user's values put back after). ``step``: the adapter's own
    inputs of this step (Keras: its gradients; torch: the closure and the guard's loss), handed
    from hook to hook as an argument, reduced by the first."""
    step, statistics, finite, count = opt.reduced_statistics(step)
    plan = opt.on_host(opt.scaling.plan, statistics, finite, opt.user_settings(),
                       opt.loss_scale(), count)
    return opt.apply_step(plan, step)


def precondition(grad, second_moment, correction, eps, sqrt, *, beta2=None, mean=None,
                 maximum=None):
    """Adam's preconditioned gradient g / (sqrt(v / c2) + eps), c2 = 1 - beta2^t the bias
    correction of v (``Policy.second_moment_correction``), in any framework's ops (``sqrt``).

    beta2 (with the framework's ``mean`` and ``maximum``): v_hat is floored per tensor at
    (1 - beta2) / c2 x mean(v_hat). v is the one before this step's update, and where it holds
    (nearly) no gradient yet (a ReLU unit dead so far, a rarely used weight) g / (sqrt(v_hat) +
    eps) is ~g / eps: one such coordinate put 4e10 into a step's sigma2 whose bulk is ~2e5
    (benchmarks/results/adam_precondition.md), and the gain sat at S for hundreds of steps. Adam
    itself divides this step by v_t = beta2 v + (1 - beta2) g_bar^2 >= (1 - beta2) g_bar^2; g_bar
    is unknown before the allreduce, so the tensor's typical squared gradient, mean(v_hat),
    stands in for it: the same P for every micro-gradient and the mean (the estimator's m - q
    stays a variance), a bound of ~sqrt(c2 / (1 - beta2)) on what Adam's own step gives such a
    coordinate, and the bulk (v_hat above the floor) untouched."""
    v_hat = second_moment / correction
    if beta2 is not None:
        v_hat = maximum(v_hat, (1.0 - beta2) / correction * mean(v_hat))
    return grad / (sqrt(v_hat) + eps)


@dataclasses.dataclass(frozen=True)
class Request:
    """What the user asked of the run: the ``DistributedOptimizer``'s own arguments, as given
    (checked by ``Scaling``; the policy and S agreed across ranks there).

    policy: a spec string, a ``Policy``, or None (``$HVD_SCALE_POLICY``, else adascale).
    passes: k, backward passes per step; S defaults to workers x k.
    scale: S when the baseline batch is not a micro-batch.
    budget: T in baseline steps.
    measure: take statistics although the policy does not need them; default: when the policy
        needs them or metrics are logged. Not at S = 1 with one micro-gradient a step (one
        process, k = 1, not elastic, k not adapted): there is nothing to measure, and a later
        change of k or S that would need statistics is refused (``hvd_scale.run.check_layout``).
    nonfinite: "skip" a step with non-finite gradients on every rank, or "raise".
    log_dir: per-step metrics on rank 0; None: none (the adapter resolves
        ``$HVD_SCALE_LOG_DIR``: ``environment.log_dir``).
    log_every: steps between rows (``adapters.log.due``; the adapter resolves
        ``$HVD_SCALE_LOG_EVERY``: ``environment.log_every``).
    samples: what a step's statistics read (``hvd_scale.estimate.SAMPLES``): "passes" every
        micro-gradient, "workers" each worker's accumulated gradient once (reads flat in k),
        "auto" workers from two workers on. It follows the layout (``hvd_scale.run.reads``):
        with one worker left (Horovod elastic) every pass, "workers" included; an explicit
        "workers" at a fixed single worker is refused at set-up.
    samples_environment: ``$HVD_SCALE_SAMPLES`` (the adapter resolves it: ``environment.samples``),
        taken where ``samples`` is "auto".
    """

    policy: str | Policy | None = None
    passes: int = 1
    scale: float | None = None
    budget: float | None = None
    measure: bool | None = None
    nonfinite: str = "skip"
    log_dir: str | None = None
    log_every: int | None = None
    samples: str = "auto"
    samples_environment: str | None = None


@dataclasses.dataclass(frozen=True)
class Framework:
    """What an adapter knows of the optimizer it wraps and where it runs.

    optimizer_name: the wrapped optimizer's class name (the policy checks its theory).
    name: recorded in run.json ("torch", "keras/tensorflow", ...).
    groups: parameter groups (one sum and one |g_bar|^2 each).
    base_lrs: the groups' baseline lrs where they are numbers (checked finite and > 0), as a
        sequence (named ``param_groups[i]`` in errors) or a mapping {name: lr}.
    lr_names: how errors name each group's lr at a step; default "lr" for one group, else
        ``param_groups[i]['lr']``.
    eps_placement: where the framework's Adam puts eps (``hvd_scale.moments``).
    short_steps: the framework can take a step with fewer micro-batches than workers x k
        (torch: a leftover batch at an epoch's end; uneven passes across ranks); such a step is
        accounted at its own scale, S x n / (workers x k). Else a count other than workers x k
        is an error.
    elastic: under Horovod elastic (``environment.elastic``): no collective at set-up, where a
        joining worker builds its optimizer while the others train.
    check: the adapter's own check of its set-up, given the built policy: a ValueError it
        raises is reported on every rank in the set-up's one allgather.
    agreed: further values every rank must share (e.g. an lr schedule's config); with the
        policy's spec, S, T, passes, base lrs, measure, nonfinite, groups and the guard's
        settings they are compared across ranks in the one allgather at set-up.
    """

    optimizer_name: str
    name: str
    groups: int = 1
    base_lrs: Sequence[Any] | Mapping[str, Any] = ()
    lr_names: Sequence[str] | None = None
    eps_placement: str = EPS_CORRECTED
    short_steps: bool = False
    elastic: bool = False
    check: Callable[[Policy], None] | None = None
    agreed: Mapping[str, Any] | None = None


class HeldRecord:
    """Where ``Scaling`` keeps the run's one record: here, in Python (the torch adapters). An
    adapter whose framework keeps a run's state in its own variables hands ``Scaling`` another
    holder with these two methods (``Scaling.hold``; Keras: the optimizer variable
    ``hvd_scale_state``, read on demand), so that no second copy exists to disagree with it."""

    def __init__(self, run: RunState):
        self._run = run

    def get(self) -> RunState:
        return self._run

    def set(self, run: RunState) -> None:
        self._run = run


class Scaling:
    """A policy run by an adapter: set-up checks, the host side of each step, logs and the run's
    record (``hvd_scale.run.RunState``: the one value a step changes, replaced each step by the
    engine's pure functions).

    Args:
        hvd: the framework's Horovod module (``HorovodBinding``).
        request: what the user asked (``Request``).
        framework: what the adapter knows of its optimizer (``Framework``).
        adaptation: adapt="goodput"'s settings (``adapt.Adaptation``): the ranks agree on k
            every ``every`` steps (``adapted_passes``); the adapter applies it (``set_passes``).
            None: k stays.
        guard: a ``hvd_scale.guard.SharpnessGuard`` capping lr x factor; the adapter measures
            the sharpness when ``guard_due()`` and hands it to ``guard.update``.
    """

    def __init__(self, hvd, request: Request, framework: Framework, *,
                 adaptation: Adaptation | None = None, guard: SharpnessGuard | None = None):
        self.hvd = hvd
        self.framework = framework
        if guard is not None:
            if not isinstance(guard, SharpnessGuard):
                raise TypeError(f"guard must be a hvd_scale.guard.SharpnessGuard, got {type(guard).__name__}")
            # An optimizer it has no limit for: now.
            stability_limit(1.0, optimizer=framework.optimizer_name)
        self.guard = guard
        passes = check_passes(request.passes)
        measure = request.measure
        self.adaptation = adaptation = adaptation or Adaptation(None, None, ADAPT_EVERY, passes,
                                                                measure)
        if adaptation.adapt is not None:
            measure = True  # the gain at another k needs sigma2 and mu2
        self.clock = StepClock()
        self._timing = self.clock.lap(passes, hvd.size())  # times nan: no step timed yet
        if request.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {request.nonfinite!r}")
        scale = float(hvd.size() * passes) if request.scale is None else request.scale
        log_dir = request.log_dir
        # The request is fixed (the set-up's); what a step reads follows W (``reads``). Where W
        # cannot change, an explicit "workers" with one worker is refused here.
        samples = check_samples(request.samples, request.samples_environment)
        if not framework.elastic:
            resolve_samples(samples, hvd.size())

        def measured(built: Policy) -> bool:
            # One micro-gradient at S = 1 (one process, k = 1, not elastic, k fixed) measures
            # nothing, and the gain is 1 by definition: no statistics, no per-tensor work. A
            # later change of k or S that would need them is refused (run.check_layout).
            if scale == 1 and hvd.size() * passes == 1 and not framework.elastic \
                    and adaptation.adapt is None and measure is None:
                return False
            return bool(built.uses_statistics or log_dir is not None if measure is None else measure)

        base_lrs = framework.base_lrs
        base_lrs = dict(base_lrs) if isinstance(base_lrs, Mapping) else \
            {f"param_groups[{i}]": lr for i, lr in enumerate(base_lrs)}
        guard_settings = None if guard is None else {
            "every": guard.every, "iterations": guard.iterations, "tol": guard.tol,
            "margin": guard.margin}
        built = agreement.agreed_policy(
            hvd, policy=request.policy, scale=scale, budget=request.budget, passes=passes,
            optimizer_name=framework.optimizer_name, base_lrs=base_lrs, check=framework.check,
            elastic=framework.elastic,
            settings=lambda built: {
                "backward_passes_per_step": passes, "lr": base_lrs,
                "parameter groups": framework.groups, "measure": measured(built),
                "nonfinite": request.nonfinite, "guard": guard_settings,
                "samples": samples,
                **adaptation.settings(), **(framework.agreed or {})})
        self.setup = runs.Setup(policy=built, groups=framework.groups, nonfinite=request.nonfinite,
                                short_steps=framework.short_steps,
                                eps_placement=framework.eps_placement,
                                max_passes=adaptation.max_passes, samples=samples)
        # Decided alike on every rank (compared above): the statistics allreduce must run on all
        # of them or none.
        self._record = HeldRecord(runs.start(self.setup, scale=float(scale), passes=passes,
                                             workers=hvd.size(), measure=measured(built)))
        self.logger = None if log_dir is None else MetricsLogger(
            log_dir, rank=hvd.rank, budget=built.budget,  # rank 0 of the moment writes
            run_info={"policy": built.spec, "scale": self.run.scale,
                      "workers": hvd.size(), "backward_passes_per_step": passes,
                      "optimizer": framework.optimizer_name, "framework": framework.name},
            every=request.log_every)
        self._state_agreed = False  # agree_on_state() ran
        # The first step whose gradients were all zero: what the log noted and rank 0 said, once
        # per process (a note, not the run's: a resumed job says it again if it happens again).
        self.zero_gradients_at: int | None = None
        if hvd.rank() == 0:  # what runs, said once: the policy is often chosen by a flag
            print(self.start_line(log_dir), file=sys.stderr, flush=True)

    # -- the run's record --------------------------------------------------------------------------
    run = property(lambda self: self._record.get(),
                   lambda self, run: self._record.set(run),
                   doc="the run's one record (``hvd_scale.run.RunState``), from its holder")

    def hold(self, record) -> None:
        """Keep the run's record in ``record`` from now on (``HeldRecord``'s ``get`` and ``set``;
        Keras: its variable); it is given the record held so far."""
        record.set(self.run)
        self._record = record

    @property
    def policy(self) -> Policy:
        """The policy's configuration (spec, statistics, horizons): fixed for the run."""
        return self.setup.policy

    passes = property(lambda self: self.run.passes, doc="k, backward passes per step")
    measure = property(lambda self: self.run.measure, doc="statistics are taken")
    last_lr = property(lambda self: self.run.last_lr, doc="the lr the latest step applied")

    def reads(self, workers: int | None = None) -> str:
        """"workers" or "passes": what a step's statistics read at W = ``workers`` (default the
        world size now, which a resize may have changed before the record sees it at the next
        step): ``hvd_scale.run.reads``."""
        # W given, no record read: a traced Keras step asks this where its record is a tensor.
        return runs.reads(self.setup, None, self.hvd.size() if workers is None else workers)

    samples = property(reads, doc="what this step's statistics read at the world size now")

    @property
    def step_scale(self) -> float:
        """The latest step's S: the run's, or a short step's own (S x n / (W k), the record's
        ``short_scale``: a later step, relayout or restore clears it)."""
        run = self.run
        return run.scale if run.short_scale is None else run.short_scale

    def start_line(self, log_dir: str | None) -> str:
        policy, run = self.policy, self.run
        how = ("a fixed factor" if not policy.uses_statistics else
               f"the gain measured each step from {run.micro_gradients} micro-gradients"
               + (f" (read once per worker: {run.workers} samples)"
                  if self.samples == "workers" and run.passes > 1 else "")
               if run.measure else
               "gain 1 (one micro-gradient a step at S = 1: nothing to measure)")
        return (f"hvd_scale: policy {policy.spec} at S = {run.scale:g} ({run.workers} "
                f"worker(s) x {run.passes} pass(es)), {how}; "
                + (f"budget T = {policy.budget:g} baseline steps" if policy.budget else
                   "no budget (no progress bar; the loop decides when to stop)")
                + (f"; metrics in {log_dir}" if log_dir else ""))

    # -- the host side of a step -------------------------------------------------------------------
    def plan(self, statistics, finite, user_settings, loss_scale: float | None = None,
             count: int | None = None) -> np.ndarray:
        """The host side of one step, for every adapter (``run_step``): ``hvd_scale.run.host_step``
        on the record, which it replaces; the step's plan, a row of ``PLAN`` per group.

        statistics: the step's vector ``[s..., c, w, q...]`` summed over workers, or None
        (unmeasured: ``finite`` is the framework's verdict, ``count`` the micro-gradients it
        counted, None for workers x k). ``loss_scale``: the gradients were scaled by it."""
        workers = self.hvd.size()
        guard, run = self.guard, self.run
        inputs = runs.StepInputs(
            statistics=statistics if run.measure else None, finite=bool(finite),
            user_settings=user_settings,
            loss_scale=None if loss_scale is None else float(loss_scale), workers=workers,
            count=None if count is None else int(count),
            max_lr=None if guard is None or math.isinf(guard.limit) else guard.limit)
        run, plan, info = runs.host_step(self.setup, run, inputs, self.framework.lr_names)
        self.run = run  # read once and written once a step
        # The row of a short step holds its own S and passes (n / W), not the announced ones, and
        # so do the readouts until the next step (the record's ``short_scale``: ``step_scale``).
        scale = run.scale if info is None else info.scale
        self._timing = self.clock.lap(run.passes * scale / run.scale, workers)
        if info is not None and statistics is not None and run.measure \
                and self.zero_gradients_at is None \
                and not np.any(unpack_step(statistics, self.setup.groups)[0]):
            self._zero_gradients(run)
        if info is not None and self.logger is not None:
            self.logger.step(run.policy.steps, lambda: self.metrics(run, scale))
        return plan

    def _zero_gradients(self, run: RunState) -> None:
        """Said once (rank 0's console, run.json's ``zero_gradients_at_step``): a step whose every
        micro-gradient was zero, where the statistics cannot tell anything and the gain is 1."""
        self.zero_gradients_at = step = run.policy.steps
        if self.logger is not None:
            self.logger.note("zero_gradients_at_step", step)
        if self.hvd.rank() == 0:
            warnings.warn(
                f"hvd_scale: the gradients of step {step} (tau {run.policy.progress:g}) are all "
                "zero, on every micro-batch: the statistics cannot tell anything, the gain is 1 "
                "and tau counts such steps as one baseline step each. Is the loss constant? (a "
                "cross-entropy over a single output, Linear(n, 1), is exactly 0.) Said once",
                stacklevel=2)

    def skip(self) -> None:
        """A step measured but never applied (an AMP overflow skipped it)."""
        self.run = runs.skipped(self.run)

    def agree_on_state(self) -> None:
        """Once, at the first step: every rank must hold the same record (steps, tau, k);
        ``agreement.agree_on_state``. One small allgather per job; none under elastic."""
        if not self._state_agreed:
            self._state_agreed = True
            agreement.agree_on_state(self.hvd, self.run, self.framework.elastic)

    def guard_due(self) -> bool:
        """The next step should measure the sharpness first (alike on every rank)."""
        return self.guard is not None and self.guard.due(self.run.policy.steps)

    # -- a change of k or S (``hvd_scale.run.relayout``: refused before anything changes) -------
    def rescale(self, scale: float | None = None) -> None:
        """New S; None: follow the world size, keeping S / (workers x k) (a ``scale=`` given for
        another baseline batch stays in proportion)."""
        if scale is None:
            self.run = runs.relayout(self.setup, self.run, workers=self.hvd.size())
        else:
            self.run = runs.relayout(self.setup, self.run, scale=scale)

    def set_passes(self, passes: int) -> None:
        """k passes per step from the next step on (alike on every rank): S follows in
        proportion, so the policy's factor and tau's advance are those of the new S."""
        self.run = self.relaid(passes)

    def relaid(self, passes: int) -> RunState:
        """The record at k = ``passes`` (validated; nothing held changes): ValueError for a k
        above adapt's ``max_passes`` or a layout that cannot run."""
        k = check_passes(passes)
        if self.adaptation.max_passes is not None and k > self.adaptation.max_passes:
            raise ValueError(f"set_passes({k}): above max_passes={self.adaptation.max_passes}")
        return runs.relayout(self.setup, self.run, passes=k)

    @property
    def timings_read(self) -> bool:
        """The step clock's timings are read (logged, or adapt="goodput" fits them): an adapter
        for which a stamp costs something (Keras's host calls in a traced step) stamps only then."""
        return self.logger is not None or self.adaptation.adapt is not None

    @property
    def adapt(self) -> str | None:
        """"goodput" when k adapts, else None."""
        return self.adaptation.adapt

    def adapted_passes(self) -> int:
        """adapt="goodput": every ``adapt_every`` steps, the k of largest predicted goodput
        (``adapt.Adaptation.choose``) from rank 0's step times and the estimates, broadcast so
        that every rank takes the same; else the current k. Call after each step, on every rank."""
        run = self.run
        steps = run.policy.steps
        if not self.adaptation.due(steps):
            return run.passes
        choice = run.passes
        if self.hvd.rank() == 0:
            policy = self.policy
            estimator = policy.estimator(run.policy, run.scale)
            choice = self.adaptation.choose(self.clock, sigma2=estimator.sigma2, mu2=estimator.mu2,
                                            scale=run.scale, passes=run.passes,
                                            workers=run.workers,
                                            max_gain=getattr(policy, "max_gain", math.inf))
        if self.hvd.size() > 1:
            choice = self.hvd.broadcast_object(choice, root_rank=0, name="hvd_scale.passes")
        if choice != run.passes and self.hvd.rank() == 0:
            print(f"hvd_scale: step {steps}, tau {run.policy.progress:g}: {run.passes} -> "
                  f"{choice} passes per step (S {run.scale:g} -> "
                  f"{run.unit * run.workers * choice:g}; adapt='goodput')", flush=True)
        return choice

    # -- what is read --------------------------------------------------------------------------------
    def metrics(self, run: RunState | None = None, scale: float | None = None) -> dict[str, float]:
        """``hvd_scale.metrics.STEP_METRICS`` (with two parameter groups or more, each group's
        noise scale too: ``hvd_scale.noise.metrics``): the policy's at the record ``run`` (default
        the one held) and S = ``scale`` (default the latest step's, ``step_scale``, for the record
        held, else the run's; a short step's row: its own, marked ``short_step``), the lr the
        latest step applied, and the guard's (nan and inf without one)."""
        if run is None:
            run, scale = self.run, self.step_scale if scale is None else scale
        scale = run.scale if scale is None else scale
        guard = UNGUARDED_METRICS if self.guard is None else self.guard.metrics()
        return {**self.policy.metrics(run.policy, scale),
                **noise_metrics(run.policy.estimator, run.noise), "lr": run.last_lr,
                "short_step": float(scale != run.scale), **guard, **self._timing}

    # -- checkpoints and broadcasts: the whole record, validated before anything changes --------
    def state_dict(self) -> dict:
        return self.run.to_dict(self.setup)

    def restored(self, saved: Mapping | RunState) -> RunState:
        """A saved record (its dict, or a ``RunState``) as this job would hold it: its policy
        record, skips and last lr, this job's workers and S per micro-batch, the saved k where k
        adapts (``hvd_scale.run.restored``). Validated; nothing held changes."""
        if not isinstance(saved, RunState):
            saved = RunState.from_dict(saved, self.setup)
        return runs.restored(self.setup, self.run, saved, take_passes=self.adapt is not None)

    def broadcast(self, root_rank: int = 0) -> None:
        """Every rank takes ``root_rank``'s record (k included) and guard estimate."""
        guard = self.guard
        state = self.hvd.broadcast_object(
            {"run": self.state_dict(), "guard": None if guard is None else guard.state_dict()},
            root_rank=root_rank, name="hvd_scale.run_state")
        run = self.restored(state["run"])
        if guard is not None and state["guard"] is not None:
            guard.load_state_dict(state["guard"])
        self.run = run
