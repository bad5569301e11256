"""The Keras 3 optimizer: Horovod gradient averaging plus a learning-rate policy.

Written once in ``keras.ops``; what differs between the TensorFlow and torch backends (Horovod's
module, the allreduce, the host call) is in ``backends.py``, everything that is not a tensor
operation in ``hvd_scale.adapters.core``. What this module does:

* statistics: this worker's sum of squared micro-gradient norms and its micro-batch count
  (``hvd_scale.reduce``'s layout) ride in the *same* grouped allreduce as the gradients, in their
  dtype (float64 for a float64 model, else float32). The group uses op=Average, so the two come
  back as their mean and are multiplied by the world size to give the sums (exact for the count;
  one rounding for the norms). |g_bar|^2 is taken from the averaged gradient, so a step costs one
  collective and one host call;
* the step runs the shared sequence (``core.run_step``), its host part (``core.Scaling.plan``)
  under TensorFlow through ``tf.numpy_function``. The run's record is the optimizer variable
  ``hvd_scale_state`` (``hvd_scale.run.RunState``'s vector, with its version: the policy's
  state, S, k, the skips, the last lr) and nothing else, as Keras's LossScaleOptimizer keeps
  its scale (``VariableRecord``): ``model.save``, ``tf.train.Checkpoint``, ``broadcast_state``
  and elastic syncs carry all of it; each step's host part is handed the variable's value and
  hands the new one back, which the step assigns; every Python view (``run_state``,
  ``metrics()``, ``steps``, ...) is read from the variable when asked;
* the step's lr is ``lr(floor(tau)) x factor``: the inner optimizer sees this value for the one
  ``apply`` call and nothing is written to the user's lr variable or ``LearningRateSchedule``;
* when the metrics are logged or k adapts, the step clock (``adapters.adapt.StepClock``) is
  stamped from the step as it runs: each pass's gradients (k >= 2), the wait for the allreduce,
  its end (the host call) and the update's end, each a small host call ordered by control
  dependencies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
from typing import Any

import keras
import numpy as np
from keras import ops

from hvd_scale.adapters import environment
from hvd_scale.adapters.adapt import ADAPT_EVERY, Adaptation, check_passes
from hvd_scale.adapters.core import (PLAN, USER_SETTINGS, Framework, Readout, Request, Scaling,
                                    precondition, run_step)
from hvd_scale.moments import EPS_RAW, bias_correction, moment_progress
from hvd_scale.policies import Policy
from hvd_scale.reduce import StepRecord, step_vector_size
from hvd_scale import run as runs
from hvd_scale.run import PASSES_INDEX, PROGRESS_INDEX, STEPS_INDEX, RunState, migrate_vector

from . import backends

ALLREDUCE_NAME = "hvd_scale.step"
GROUPS = 1  # all trainable variables share one lr in Keras: one parameter group
_PROGRESS = PROGRESS_INDEX  # the run vector's entries the traced step reads
_STEPS = STEPS_INDEX

# Base-optimizer arguments that belong on the inner optimizer (as in LossScaleOptimizer).
_INNER_ONLY = ("learning_rate", "weight_decay", "clipnorm", "global_clipnorm", "clipvalue",
               "use_ema", "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
               "gradient_accumulation_steps")

# For adascale_adam: the Adam family's second-moment hyperparameters (its `_velocities` exist
# once built).
_ADAM_SLOTS = ("beta_2", "epsilon")


WRAPPED_IN_LOSS_SCALE = (
    "Keras wrapped hvd_scale's DistributedOptimizer in a LossScaleOptimizer (model.compile does "
    "under the mixed_float16 dtype policy), which skips a step on a rank whose own gradients "
    "overflow, before the allreduce: the other ranks would wait for it forever. Wrap the other "
    "way, DistributedOptimizer(LossScaleOptimizer(inner)), and compile with "
    "auto_scale_loss=False")


def wrapped_in_loss_scale(optimizer) -> bool:
    """A LossScaleOptimizer outside hvd_scale's (``WRAPPED_IN_LOSS_SCALE``)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and \
        isinstance(optimizer.inner_optimizer, DistributedOptimizer)


def _lr_owner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that holds the lr and the update rule (below any LossScaleOptimizer)."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _lr_for_agreement(owner: keras.optimizers.Optimizer) -> tuple[dict, dict]:
    """(base lrs checked > 0, further values compared across ranks) for ``core.Scaling``: a
    number lr is both; a schedule is compared by its config; a callable is neither."""
    lr = owner._learning_rate
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        return {}, {"learning_rate schedule": keras.saving.serialize_keras_object(lr)}
    if isinstance(lr, keras.Variable):
        return {"learning_rate": float(ops.convert_to_numpy(lr.value))}, {}
    return {}, {}


# horovod.tensorflow.keras.DistributedOptimizer's arguments that this one does not take, and why.
_HOROVOD_ARGS = {
    "average_aggregated_gradients": "drop it: the mean of the k micro-gradients is always what is "
                                    "applied (its True)",
    **{arg: "not supported in Keras (the torch adapter takes it)"
       for arg in ("compression", "op", "gradient_predivide_factor", "sparse_as_dense", "groups",
                   "process_set")},
    **{arg: "not supported in Keras" for arg in ("device_dense", "device_sparse", "num_groups",
                                                 "scale_local_gradients")},
}


class VariableRecord:
    """``core.Scaling``'s holder of the run's record for Keras (``core.HeldRecord``'s ``get`` and
    ``set``): the optimizer variable ``hvd_scale_state``, read and written eagerly, with no copy
    beside it. Before the variable exists (the optimizer is built at its first ``apply``) the
    record is the one ``Scaling`` started, which ``build`` puts in the variable; inside a step's
    host call (``handed``) it is the variable's value that call was given, and what the call
    hands back, which the step assigns.

    ``asked``: the layout this job asks for (S per micro-batch, k, whether statistics are taken:
    the set-up's, S as ``rescale`` last set it), which no step changes. A record is read from the
    variable as this job would hold it (``view``: ``hvd_scale.run.restored``), since
    ``tf.train.Checkpoint``, a broadcast or an elastic restore may have put there a record
    saved at another layout; and the traced step reads k (where fixed) and ``measure`` here,
    where the variable is a tensor."""

    def __init__(self, optimizer: "DistributedOptimizer", start: RunState):
        self._optimizer = optimizer
        self.asked = start
        self._variable = None  # hvd_scale_state, once built
        self._handed: list | None = None  # [record] inside a host call

    def bind(self, variable) -> None:
        """The variable ``build`` created, with the record held so far as its value."""
        self._variable = variable

    def view(self, vector) -> RunState:
        """The record a vector of ``hvd_scale_state`` holds, as this job holds it: its policy
        record, skips, last lr and (adapt) k, at the asked S per micro-batch and, where that
        layout can run, at the world size now (else the next step refuses the resize, alike on
        every rank). ValueError for a record this optimizer cannot take, naming why."""
        scaling = self._optimizer.scaling
        setup, asked = scaling.setup, self.asked
        saved = RunState.from_vector(vector, setup)
        workers = saved.workers or asked.workers
        base = dataclasses.replace(asked, workers=workers,
                                   scale=asked.unit * workers * asked.passes)
        run = runs.restored(setup, base, saved, take_passes=scaling.adapt is not None)
        size = scaling.hvd.size()
        if run.workers != size:
            try:
                run = runs.relayout(setup, run, workers=size)
            except ValueError:
                pass  # refused by the step (hvd_scale.run.host_step), before anything applies
        return run

    def get(self) -> RunState:
        if self._handed is not None:
            return self._handed[0]
        if self._variable is None:
            return self.asked
        if not self._optimizer._backend.eager():
            raise RuntimeError("hvd_scale: the run's record (hvd_scale_state) is read eagerly, "
                               "not inside a traced function")
        return self.view(ops.convert_to_numpy(self._variable.value))

    def set(self, run: RunState) -> None:
        if self._handed is not None:
            self._handed[0] = run
            return
        if self._variable is None:
            self.asked = run
            return
        # S per micro-batch is what rescale(S) sets; the other writes keep it.
        self.asked = dataclasses.replace(self.asked, scale=run.unit * self.asked.micro_gradients)
        self._variable.assign(ops.convert_to_tensor(run.to_vector(self._optimizer.scaling.setup),
                                                    "float64"))

    @contextlib.contextmanager
    def handed(self, vector):
        """Inside a step's host call: the record is the variable's value the call was given
        (``view``); what the call sets replaces it in the list yielded, for the call to hand
        back. Nothing is held after the call."""
        self._handed = handed = [self.view(vector)]
        try:
            yield handed
        finally:
            self._handed = None


@keras.saving.register_keras_serializable(package="hvd_scale", name="DistributedOptimizer")
class DistributedOptimizer(Readout, keras.optimizers.Optimizer):
    """Wrap any Keras 3 optimizer: Horovod gradient averaging plus an lr scaling policy.

    Args:
        inner_optimizer: the Keras optimizer to wrap (its lr, schedule and update rule are used).
        policy: a spec string (``"adascale"``, ``"warmup:fraction=0.055"``, ...), a ``Policy``, or
            None for ``$HVD_SCALE_POLICY``, else ``"adascale"``.
        backward_passes_per_step: k ``apply`` calls (micro-batches) per optimizer step.
        scale: S; default workers x k (micro-batch = baseline batch). Give it when the baseline
            batch differs from a micro-batch: S = workers x k x micro_batch / baseline_batch.
        budget: T in baseline steps, for ``done()`` and ``warmup:fraction=``.
        measure: compute gradient statistics even when the policy does not need them (to log
            sigma2, mu2, gain for fixed rules). Default: when the policy needs them or metrics
            are logged.
        log_dir: write per-step metrics there on rank 0 (CSV, TensorBoard, a progress bar), as
            the torch adapter; default ``$HVD_SCALE_LOG_DIR`` (set by ``hvd-scale run
            --log-dir``), else none. A run-time setting: not part of ``get_config``.
        nonfinite: a step whose averaged gradient or statistics are not finite is skipped on
            every rank ("skip") or raises FloatingPointError ("raise"), as in the torch adapter.
        samples: what the statistics read (``hvd_scale.estimate.SAMPLES``): "workers" each
            worker's accumulated gradient once, at the step's last apply (cost flat in k);
            "passes" every apply's gradient; "auto" (default) workers from two workers on.
        adapt: "goodput" to let the ranks choose k (up to ``max_passes``) every ``adapt_every``
            steps from rank 0's step timings and the gain at each k, as the torch adapter does.
            k lives in the run's record (the variable ``hvd_scale_state``), which the traced step
            reads (no retrace) and checkpoints keep; the choice is made eagerly between steps:
            the callbacks do it under ``fit``, a custom loop calls ``adapt_passes()`` after each
            step.
        name: the optimizer's name.

    Base-optimizer arguments (clipnorm, weight_decay, use_ema, ...) are set on the inner
    optimizer, as for ``keras.optimizers.LossScaleOptimizer``.
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, policy: str | Policy | None = None,
                 backward_passes_per_step: int = 1, *, scale: float | None = None,
                 budget: float | None = None, measure: bool | None = None,
                 log_dir: str | None = None, nonfinite: str = "skip", adapt: str | None = None,
                 max_passes: int | None = None, adapt_every: int = ADAPT_EVERY,
                 samples: str = "auto", name: str | None = None, **kwargs: Any):
        backend = backends.current()
        for arg in _INNER_ONLY:
            if arg in kwargs:
                raise ValueError(f"DistributedOptimizer does not support `{arg}`. Instead, set "
                                 f"`{arg}` on the `inner_optimizer`.")
        known = [f"`{arg}`: {_HOROVOD_ARGS[arg]}" for arg in kwargs if arg in _HOROVOD_ARGS]
        if known:  # hvd.DistributedOptimizer's arguments, met when a Horovod script is converted
            raise ValueError("DistributedOptimizer does not take Horovod's " + "; ".join(known))
        if kwargs:
            raise ValueError(f"DistributedOptimizer does not support arguments: "
                             f"`{'`, `'.join(kwargs)}`.")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"inner_optimizer must be a keras.optimizers.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        if isinstance(inner_optimizer, DistributedOptimizer):
            raise TypeError("inner_optimizer is already distributed: wrap the plain optimizer once")
        owner = _lr_owner(inner_optimizer)
        if owner.gradient_accumulation_steps:
            raise ValueError(f"the inner optimizer has gradient_accumulation_steps="
                             f"{owner.gradient_accumulation_steps}, which would accumulate after "
                             "the allreduce; use DistributedOptimizer(..., backward_passes_per_step="
                             f"{owner.gradient_accumulation_steps}) instead")
        optimizer_name = type(owner).__name__
        base_lrs, agreed = _lr_for_agreement(owner)
        scaling = Scaling(
            backend.hvd,
            Request(policy=policy, passes=backward_passes_per_step, scale=scale, budget=budget,
                    measure=measure, nonfinite=nonfinite, log_dir=environment.log_dir(log_dir),
                    log_every=environment.log_every(), samples=samples,
                    samples_environment=environment.samples()),
            Framework(optimizer_name=optimizer_name, name=f"keras/{backend.name}",
                      groups=GROUPS, base_lrs=base_lrs, eps_placement=EPS_RAW,
                      elastic=environment.elastic(), agreed=agreed),
            adaptation=Adaptation(adapt, max_passes, adapt_every,
                                  check_passes(backward_passes_per_step), measure))
        if scaling.policy.statistics == "preconditioned" and \
                not all(hasattr(owner, a) for a in _ADAM_SLOTS):
            raise ValueError(f"policy {scaling.policy.name!r} measures Adam-preconditioned "
                             f"gradients, but {optimizer_name} has no second moment (beta_2, epsilon)")

        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.optimizer_name = optimizer_name
        self.scaling = scaling
        self._backend = backend
        self._record = VariableRecord(self, scaling.run)
        scaling.hold(self._record)  # the run's one record: hvd_scale_state once built
        self._config = {"backward_passes_per_step": backward_passes_per_step, "scale": scale,
                        "budget": budget, "measure": measure, "nonfinite": nonfinite,
                        **({"adapt": adapt, "max_passes": max_passes, "adapt_every": adapt_every}
                           if adapt is not None else {}),
                        **({"samples": samples} if samples != "auto" else {})}
        # The graph's shape: k > 1 or a k that may change accumulates (in variables).
        self._accumulating = backward_passes_per_step > 1 or adapt is not None
        self._adapted_at = None  # the steps after which adapt_passes() last ran
        self._from_saved_config = False  # from_config: the policy is the one saved with it

    # -- Keras optimizer protocol ----------------------------------------------------------------
    def build(self, var_list):
        initial = self.scaling.run.to_vector(self.scaling.setup)
        self._state = self.add_variable(
            shape=initial.shape, dtype="float64", aggregation="none", name="hvd_scale_state",
            initializer=lambda shape, dtype=None: ops.convert_to_tensor(initial, "float64"))
        self._record.bind(self._state)
        self._accumulators = []
        if self._accumulating:
            self._micro_steps = self.add_variable(shape=(), dtype="int32", aggregation="none",
                                                  name="hvd_scale_micro_steps")
            self._local_sqnorm = self.add_variable(shape=(), dtype="float64", aggregation="none",
                                                   name="hvd_scale_local_sqnorm")
            self._accumulators = [self.add_variable_from_reference(v, name="hvd_scale_accumulator")
                                  for v in var_list]
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        """Accumulate, allreduce, let the policy account the step, apply it with lr x factor."""
        self._backend.check_context()
        self._check_caller()
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError("When passing `grads` without `variables`, the optimizer must "
                                 "already be built: call `optimizer.build(trainable_variables)`.")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"expected one gradient per variable ({len(trainable_variables)}), "
                             f"got {len(grads)} gradients")
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        # The None pattern is the model's, hence the same on every rank.
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        grads = [ops.convert_to_tensor(g) for g, _ in pairs]
        variables = [v for _, v in pairs]
        with keras.name_scope(self.name, caller=self):
            if not self._accumulating:
                local = self._sqnorm_of(grads, variables) if self._measure else None
                self._step(grads, variables, local, 1.0)
            else:
                self._accumulate(grads, variables)

    def _check_caller(self):
        """Refuse a LossScaleOptimizer that calls this one's apply (``WRAPPED_IN_LOSS_SCALE``):
        a custom loop or a fit without this package's callbacks, which say so at fit's start.
        Its apply is a few frames up (Keras's cond and its finite branch)."""
        frame = sys._getframe(2)
        for _ in range(6):
            if frame is None:
                return
            if wrapped_in_loss_scale(frame.f_locals.get("self")) and \
                    frame.f_locals["self"].inner_optimizer is self:
                raise ValueError(WRAPPED_IN_LOSS_SCALE)
            frame = frame.f_back

    def _accumulate(self, grads, variables):
        if self.scaling.timings_read:  # this pass's gradients exist
            self._backend.stamp(self.scaling.clock.pass_started, grads)
        accumulators = [self._accumulators[self._get_variable_index(v)] for v in variables]
        for acc, g in zip(accumulators, grads):
            acc.assign_add(ops.cast(g, acc.dtype))
        per_pass = self._reads_passes()
        if per_pass is not False or self._reads_follow_world_size():
            # Under elastic every pass's norm whatever W is: a shrink between passes leaves the
            # step all of them to read.
            self._local_sqnorm.assign_add(self._sqnorm_of(grads, variables))
        self._micro_steps.assign_add(1)

        def step():
            summed = [ops.convert_to_tensor(acc.value) for acc in accumulators]
            count = ops.cast(self._micro_steps.value, "float64")
            local = None
            if per_pass is True:
                local = ops.convert_to_tensor(self._local_sqnorm.value)
            elif self._measure:  # the sum G of the passes, read once: |G|^2 / c
                local = ops.cast(self._sqnorm_of(summed, variables), "float64") / count
                if per_pass is not False:  # elastic: one worker left reads its passes
                    local = ops.where(per_pass, ops.convert_to_tensor(self._local_sqnorm.value),
                                      local)
            self._step(summed, variables, local, count)
            for acc in accumulators:
                acc.assign(ops.zeros_like(acc.value))
            self._local_sqnorm.assign(ops.convert_to_tensor(0.0, "float64"))
            self._micro_steps.assign(0)

        ops.cond(self._micro_steps.value >= self._passes_now(), step, lambda: None)

    def _reads_follow_world_size(self) -> bool:
        """What the statistics read is decided when the step runs (Horovod elastic: W changes
        under a traced step), unless every pass is read anyway."""
        return self._measure and self.scaling.framework.elastic \
            and self.scaling.setup.samples != "passes"

    def _reads_passes(self):
        """This step's statistics read every apply's gradient (else each worker's sum once):
        ``hvd_scale.run.reads``, a Python bool where W is fixed, under Horovod elastic the
        world size when the step runs (a boolean tensor in a traced step)."""
        if not self._measure:
            return False
        if self._reads_follow_world_size():
            return self._backend.world_size() < 2
        return self.scaling.reads() == "passes"

    def _passes_now(self):
        """k for the step being traced: the record's with adapt (it changes between steps),
        else the one asked (fixed)."""
        if self.scaling.adapt is None:
            return self._record.asked.passes
        return ops.cast(self._state.value[PASSES_INDEX], "int32")

    @property
    def _measure(self) -> bool:
        """Statistics are taken: fixed by the set-up (read where the step is traced)."""
        return self._record.asked.measure

    # -- adapt="goodput" and k ---------------------------------------------------------------------
    @property
    def backward_passes_per_step(self) -> int:
        """k, the apply calls per optimizer step now (adapt="goodput" and ``set_passes`` change it)."""
        return self.scaling.passes

    def _mid_step(self) -> bool:
        return self._accumulating and self.built and \
            bool(int(ops.convert_to_numpy(self._micro_steps.value)))

    def set_passes(self, passes: int) -> None:
        """Take k apply calls per step from the next step on: eagerly, between steps, on every rank
        at the same step (``adapt_passes`` does). S follows in proportion. Needs adapt="goodput"
        (k is then in the record the traced step reads)."""
        k = check_passes(passes)
        if self.scaling.adapt is None:
            raise ValueError(f"set_passes({k}): k is fixed in the traced step of an optimizer "
                             "built without adapt='goodput' (build it with adapt='goodput', "
                             "max_passes=K to change k while training)")
        if not self._backend.eager():
            raise RuntimeError("set_passes() runs eagerly, between steps, not inside a tf.function")
        if k == self.scaling.passes:
            return
        if self._mid_step():
            raise RuntimeError("set_passes() between apply calls of a step: call it after the "
                               "step's last apply and before the next step's first")
        self.scaling.set_passes(k)  # refused before anything changes if it cannot run

    def adapt_passes(self) -> int:
        """adapt="goodput": call after each optimizer step, eagerly, on every rank (under ``fit``
        the callbacks do, after every batch: mid-step, between the apply calls of k >= 2, it
        does nothing): every ``adapt_every`` steps the ranks take rank 0's choice of k (one
        broadcast). Once per step; returns k."""
        if self.scaling.adapt is None or self._mid_step():
            return self.scaling.passes
        steps = self.scaling.run.policy.steps
        if steps != self._adapted_at:
            self._adapted_at = steps
            self.set_passes(self.scaling.adapted_passes())
        return self.scaling.passes

    def _check_adapted(self, steps: int) -> None:
        """In the host call, before step ``steps + 1``: a decision due after step ``steps`` was
        taken (adapt_passes ran), else k would never adapt: refused alike on every rank."""
        if self._adapted_at is None or steps < self._adapted_at:  # the first step here, or rolled back
            self._adapted_at = steps
        elif self.scaling.adaptation.due(steps) and self._adapted_at != steps:
            raise RuntimeError(
                f"hvd_scale: adapt='goodput' chooses k after step {steps}, but adapt_passes() did "
                "not run after it: under model.fit pass ScalingMetrics or BroadcastInitialState "
                "(with steps_per_execution=1); in a custom loop call optimizer.adapt_passes() "
                "after each step, eagerly")

    # -- the hooks of adapters/protocol.py ------------------------------------------------------
    def _step(self, local_grads, variables, local_sqnorm, count):
        """One optimizer step from this worker's summed micro-gradients and statistics."""
        run_step(self, (local_grads, variables, local_sqnorm, count))

    def reduced_statistics(self, step):
        """One grouped allreduce (op=Average) of the gradients and, when measured, [s, c, w] in
        their dtype (so that it joins their group); then [s, c, w, q], q = |g_bar|^2 of the mean
        micro-gradient, or None with the averaged gradient's finiteness. In float32 s could
        overflow (from 3.4e38 on: |g| ~ 1.8e19, finite gradients) or lose its digits (below
        1.2e-38: a loss scaled far down): it travels three times (``hvd_scale.reduce``: the
        wire), and the copy that fits is taken. ``step``: (local gradients, variables, s, c),
        handed on as (mean gradients, variables)."""
        local_grads, variables, local_sqnorm, count = step
        tensors = list(local_grads)
        measure = self._measure
        if measure:
            float64 = any(keras.backend.standardize_dtype(g.dtype) == "float64" for g in tensors)
            count = ops.cast(count, "float64")
            per_pass = self._reads_passes() if self._accumulating else True  # k = 1: alike
            samples = count if per_pass is True else ops.ones_like(count) if per_pass is False \
                else ops.where(per_pass, count, ops.ones_like(count))
            local = StepRecord(ops.reshape(ops.cast(local_sqnorm, "float64"), (GROUPS,)), count,
                               samples)
            # Three copies of the sum, then [c, w] (hvd_scale.reduce: the wire).
            tensors.append(ops.cast(local.to_wire(ops), "float64" if float64 else "float32"))
        # The passes are over once the local gradients (and statistics) exist: the wait starts.
        waiting = self._backend.stamp(self.scaling.clock.waiting, tensors) \
            if self.scaling.timings_read else None
        reduced = self._backend.allreduce_average(tensors, ALLREDUCE_NAME, after=waiting)
        mean = reduced[:len(local_grads)]
        if self._accumulating:  # the mean micro-gradient
            mean = [g / ops.cast(self._passes_now(), g.dtype) for g in mean]
        step = (mean, variables)
        if not measure:
            # One fused read per tensor, as the statistics' (an isfinite and an all per tensor
            # cost twice the ops): the squared norm is finite when every element is (a square
            # overflowing float32 is skipped too, as a measured step's statistics would be).
            return step, None, ops.isfinite(self._backend.sum_of_squares(mean)), None
        summed = StepRecord.from_wire(ops.cast(reduced[-1], "float64") * self._backend.world_size(),
                                      GROUPS, ops)
        q = ops.reshape(self._sqnorm_of(mean, variables), (GROUPS,))
        return (step, summed._replace(mean_sqnorms=q).pack(ops), ops.convert_to_tensor(True),
                None)

    def user_settings(self):
        """[[lr(floor(tau)), beta_1, beta_2, epsilon, weight decay, t]] (``core.USER_SETTINGS``;
        nan where the optimizer has none), float64."""
        owner = _lr_owner(self.inner_optimizer)
        base_lr = self._base_learning_rate(self._state.value[_PROGRESS])

        def setting(name):
            value = getattr(owner, name, None)
            return math.nan if value is None else value

        row = [base_lr] + [setting(a) for a in ("beta_1", "beta_2", "epsilon", "weight_decay")] + \
            [ops.cast(owner.iterations, "float64") + 1.0]
        assert len(row) == len(USER_SETTINGS)
        return ops.reshape(ops.stack([ops.cast(v, "float64") for v in row]), (1, len(USER_SETTINGS)))

    def loss_scale(self):
        inner = self.inner_optimizer
        scale = inner.dynamic_scale.value if isinstance(inner, keras.optimizers.LossScaleOptimizer) \
            else inner.loss_scale_factor
        return ops.convert_to_tensor(1.0 if scale is None else scale, "float64")

    def on_host(self, fn, *args):
        """``fn(statistics, finite, user_settings, loss_scale, count)`` on the host (a host call
        inside a traced step), over the record variable's value handed to the call, the new
        record handed back and assigned by the step: the host holds no record of its own.
        (Keras takes no short step: count None.)"""
        statistics, finite, user_settings, loss_scale, _ = args
        measured = statistics is not None
        if not measured:
            statistics = ops.zeros((step_vector_size(GROUPS),), "float64")
        # A method, not a function defined here: TensorFlow's autograph rewrites functions defined
        # inside the traced step, and the rewritten one would pass every call it makes, every
        # step, through autograph's call wrapper.
        new_state, plan = self._backend.host_call(
            functools.partial(self._host_step, fn, measured),
            [self._state.value, statistics, finite, user_settings, loss_scale],
            name="hvd_scale_policy_step")
        self._state.assign(ops.reshape(new_state, self._state.shape))
        return ops.reshape(plan, (GROUPS, len(PLAN)))

    def _host_step(self, fn, measured, state, statistics, finite, user_settings, loss_scale):
        """The host side of ``on_host``, in numpy: ``fn`` over the record the variable's value
        ``state`` holds (``VariableRecord.handed``); the new record's vector and the plan."""
        self.scaling.clock.waited()  # the allreduce it depends on is over
        with self._record.handed(state) as record:
            if self.scaling.adapt is not None:
                self._check_adapted(record[0].policy.steps)
            plan = fn(statistics if measured else None, bool(finite), user_settings,
                      float(loss_scale))
        return record[0].to_vector(self.scaling.setup), np.asarray(plan, dtype=np.float64)

    def apply_step(self, plan, step):
        """inner.apply with the plan's lr (and, for adascale_adam, the step's beta_1, beta_2,
        epsilon and weight decay: ``hvd_scale.moments``); the user's attributes are put back. A
        factor of 0 applies nothing (a LossScaleOptimizer still sees the step, with lr 0)."""
        grads, variables = step
        factor, lr, adam = plan[0, 0], plan[0, 1], None
        if self.scaling.policy.moments_in_progress:  # the same on every rank: fixed by the spec
            dtype = keras.backend.standardize_dtype(variables[0].dtype)
            adam = [ops.cast(plan[0, i], dtype) for i in range(2, 6)]
        if isinstance(self.inner_optimizer, keras.optimizers.LossScaleOptimizer):
            # It checks finiteness itself (same averaged gradient on every rank) and must see an
            # overflow to lower its scale; a skipped step reaches it with lr 0.
            self._apply_inner(grads, variables, lr, adam)
        else:
            ops.cond(factor > 0, lambda: self._apply_inner(grads, variables, lr, adam),
                     lambda: self._ended(variables))

    def _ended(self, variables):
        """The clock's stamp at the update's end: once the variables read its result. Taken
        inside the cond's branch: after the cond, TensorFlow does not wait for Keras's update."""
        if self.scaling.timings_read:
            self._backend.stamp(self.scaling.clock.ended, [ops.convert_to_tensor(v) for v in variables])

    def _apply_inner(self, grads, variables, lr, adam):
        owner = _lr_owner(self.inner_optimizer)
        dtypes = {keras.backend.standardize_dtype(v.dtype) for v in variables}
        if len(dtypes) == 1:  # cast once here, not once per variable in Keras's update step
            lr = ops.cast(lr, dtypes.pop())
        swaps = {"_learning_rate": lr}
        if adam is not None:
            beta_1, beta_2, epsilon, weight_decay = adam
            swaps.update(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
            if owner.weight_decay is not None:
                swaps["weight_decay"] = weight_decay
        saved = {key: owner.__dict__[key] for key in swaps}
        # Bypass Keras's attribute tracking: the swap lasts for this call only.
        for key, value in swaps.items():
            object.__setattr__(owner, key, value)
        try:
            self.inner_optimizer.apply(grads, variables)
        finally:
            for key, value in saved.items():
                object.__setattr__(owner, key, value)
        self._ended(variables)

    def _base_learning_rate(self, progress):
        """The user's lr for the step at progress tau: a schedule runs at floor(tau)."""
        lr = _lr_owner(self.inner_optimizer)._learning_rate
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            return lr(ops.cast(ops.floor(progress), "int64"))
        if isinstance(lr, keras.Variable):
            return lr.value
        if callable(lr):
            return lr()
        return lr

    # -- statistics ------------------------------------------------------------------------------
    def _sqnorm_of(self, grads, variables):
        # In the backend's own fused kernels (a few ops per tensor add up over many tensors).
        return self._backend.sum_of_squares(self._precondition(grads, variables))

    def _precondition(self, grads, variables):
        """g / (sqrt(v_hat) + eps) for adascale_adam (Adam's second moment before this step)."""
        if self.scaling.policy.statistics != "preconditioned":
            return grads
        owner = _lr_owner(self.inner_optimizer)
        t = ops.cast(owner.iterations, "float32")
        # 1 - beta_2 ** t; with horizons in progress the exponents applied add up to tau (plus
        # any update the policy did not account: hvd_scale.moments.moment_progress).
        exponent = t
        if self.scaling.policy.moments_in_progress:
            state = ops.cast(self._state.value, "float32")
            exponent = moment_progress(state[_PROGRESS], state[_STEPS], t, maximum=ops.maximum)
        bias_correction2 = bias_correction(ops.cast(owner.beta_2, "float32"), exponent)
        velocities = getattr(owner, "_velocities", None)
        if velocities is None:
            raise ValueError(f"policy {self.scaling.policy.name!r} needs the second moment of "
                             f"{type(owner).__name__}, which keeps no `_velocities`")
        out = []
        for g, v in zip(grads, variables):
            velocity = velocities[owner._get_variable_index(v)]
            if velocity is None:
                out.append(g)
                continue
            correction = ops.cast(ops.maximum(bias_correction2, 1e-30), velocity.dtype)
            # v_hat floored per tensor (``core.precondition``): where v holds no gradient yet
            # (a ReLU unit dead so far) g / eps would swamp sigma2 and pin the gain at S.
            ratio = precondition(ops.cast(g, velocity.dtype), velocity.value, correction,
                                 ops.cast(owner.epsilon, velocity.dtype), ops.sqrt,
                                 beta2=ops.cast(owner.beta_2, velocity.dtype), mean=ops.mean,
                                 maximum=ops.maximum)
            # First step: no second moment yet, the plain gradient (as the torch adapter).
            out.append(ops.where(t > 0, ops.cast(ratio, g.dtype), g))
        return out

    # -- the engine's state in a variable -----------------------------------------------------------
    def load_own_variables(self, store):
        """Keras's loader (``load_model``, ``load_weights``): the saved record is checked before
        any of this optimizer's variables is assigned (another policy's or version's is refused,
        naming it), and a version-6 record, which names no policy, is taken as this policy's
        only when this optimizer was rebuilt from the config saved with it (``load_model``)."""
        variables = self.variables
        if self.built and len(store.keys()) == len(variables):
            index = str(next(i for i, v in enumerate(variables) if v is self._state))
            values = {key: store[key] for key in store.keys()}
            saved = migrate_vector(np.asarray(values[index]), self.scaling.setup,
                                   saved_by_this_policy=self._from_saved_config)
            self._record.view(saved)  # refused here, naming why, before anything is assigned
            values[index], store = saved, values
        super().load_own_variables(store)

    # -- forwarded to the inner optimizer ---------------------------------------------------------
    @property
    def learning_rate(self):
        """The user's baseline lr: the variable, or a schedule's value at floor(tau)."""
        lr = _lr_owner(self.inner_optimizer)._learning_rate
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            progress = self._state.value[_PROGRESS] if self.built else \
                ops.convert_to_tensor(0.0, "float64")
            return self._base_learning_rate(progress)
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def lr(self):
        # Keras 2's name, read by Horovod's LearningRateWarmupCallback and
        # LearningRateScheduleCallback, which scale the lr by hvd.size() themselves: under a
        # policy that is lr x S twice (linear) or a fixed rule fighting AdaScale's gain.
        raise ValueError("hvd_scale's DistributedOptimizer: optimizer.lr was read (Keras 2's "
                         "name), as Horovod's LearningRateWarmupCallback and "
                         "LearningRateScheduleCallback do: they scale the lr by the number of "
                         "workers, which the policy already does. Drop them and give the "
                         "baseline (S = 1) lr, as a number or a keras.optimizers.schedules "
                         "schedule in baseline steps (its warm-up included); read the lr as "
                         "optimizer.learning_rate")

    @property
    def iterations(self):
        """Optimizer steps applied (skipped steps and accumulation calls excluded)."""
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError("DistributedOptimizer is stateful: use apply()")

    def get_config(self):
        # Constructor arguments only; the policy as its resolved spec (not $HVD_SCALE_POLICY).
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "policy": self.scaling.policy.spec, **self._config}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        optimizer = cls(inner, **config)
        optimizer._from_saved_config = True
        return optimizer

    def __repr__(self) -> str:
        return f"hvd_scale.DistributedOptimizer({self.optimizer_name}, policy={self.scaling.policy.spec!r})"


def broadcast_state(model, optimizer=None, root_rank: int = 0) -> None:
    """Broadcast the model's variables and the optimizer's (inner state and the policy's
    ``hvd_scale_state`` included) from root_rank. Builds the optimizer if needed; the model
    must be built."""
    optimizer = getattr(model, "optimizer", None) if optimizer is None else optimizer
    if optimizer is None:
        variables = list(model.variables)
        if not variables:
            raise ValueError("the model has no variables yet: build it (call it on a batch) first")
    else:
        variables = model_and_optimizer_variables(model, optimizer)
    backends.current().broadcast_variables(variables, root_rank)


def model_and_optimizer_variables(model, optimizer) -> list:
    if not model.variables:
        raise ValueError("the model has no variables yet: build it (call it on a batch) first")
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return list(model.variables) + list(optimizer.variables)
