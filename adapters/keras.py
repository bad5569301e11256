"""Keras 3 adapter (TensorFlow backend): Horovod gradient averaging plus a learning-rate policy.

    import horovod.tensorflow as hvd
    import keras
    from hvd_scale.adapters.keras import BroadcastInitialState, DistributedOptimizer, ScalingMetrics

    hvd.init()
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), policy="adascale")
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x_shard, y_shard, epochs=1000,
              callbacks=[BroadcastInitialState(), ScalingMetrics(budget=5000), keras.callbacks.CSVLogger(f)])

Custom training loops work the same way, eagerly or inside ``tf.function``:

    broadcast_state(model, opt)                       # after the model is built
    while not opt.done(budget):                       # budget in baseline (S = 1) steps
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)   # or opt.apply_gradients(zip(grads, vars))

Horovod elastic (``horovodrun --min-np ... --host-discovery-script ...``):

    state = ElasticState(model, opt)                  # commits weights, optimizer and policy state
    @elastic_run                                      # hvd.elastic.run, minus a silent failure
    def train(state):
        while not opt.done():
            model.fit(x, y, epochs=1, callbacks=[ScalingMetrics(), CommitState(state)])
    train(state)

What this module does, and nothing more (the math is in the engine, ``hvd_scale``):

* statistics: this worker's sum of squared micro-gradient norms and its micro-batch count (the
  engine's layout, ``hvd_scale.reduce``) ride in the *same* ``hvd.grouped_allreduce`` as the
  gradients, in their dtype (float64 for a float64 model, else float32; Horovod's grouped op
  takes one dtype, so gradients of several dtypes make one group each). The group uses
  op=Average, so the two statistics come back as their mean and are multiplied by
  ``hvd.size()`` to give the sums (exact for the count; one rounding for the norms). |g_bar|^2
  is taken from the averaged gradient, so a step costs one collective and one host call;
* the engine's ``Policy.step`` runs on the host through ``tf.numpy_function``; its state is held
  in the optimizer variable ``hvd_scale_state`` (so ``model.save``, ``tf.train.Checkpoint`` and
  ``broadcast_state`` carry it) and the Python policy is a cache reloaded whenever the variable
  was changed behind its back (a restore, a broadcast);
* the step's lr is ``lr(floor(tau)) x factor``: the inner optimizer sees this value for the one
  ``apply`` call and nothing is written to the user's lr variable or ``LearningRateSchedule``.
  A schedule is evaluated at floor(tau) (scale-invariant iterations), not at ``iterations``.

Conventions and limits:

* One parameter group: all trainable variables share one lr in Keras, so the engine sees one
  group (its statistics are sums over every variable).
* ``backward_passes_per_step=k``: k calls to ``apply`` (k batches of ``fit``) make one optimizer
  step; the inner optimizer receives the *mean* of the k micro-gradients (Keras's own
  ``gradient_accumulation_steps`` convention) averaged over workers. n = workers x k, S = n by
  default. Every worker must make the same number of ``apply`` calls (equal shard sizes).
* A step whose averaged gradient or statistics are not finite is skipped on every rank: weights,
  inner optimizer state, statistics and tau stay (``policy.skipped`` counts it). With a
  ``LossScaleOptimizer`` inside, that optimizer still sees the step so it can lower its scale.
* Mixed precision: wrap as ``DistributedOptimizer(LossScaleOptimizer(inner))`` and compile with
  ``auto_scale_loss=False`` (Keras would otherwise wrap *this* optimizer in a LossScaleOptimizer,
  which decides to skip per rank, before the allreduce, and deadlocks the job). Statistics are
  unscaled (squared norms by the loss scale squared).
* XLA: Horovod's TensorFlow ops have no XLA kernels in this build, so ``jit_compile=True`` cannot
  work. ``apply`` raises a ValueError when traced under XLA; the callbacks below switch
  ``model.jit_compile`` off (with a warning) before ``fit`` builds its train function.
* TensorFlow backend only; no ``tf.distribute`` strategy (Horovod is the distribution).
* Policy properties (``gain``, ``progress``, ...) are host values: read them eagerly, not inside
  a ``tf.function``.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import Any, Sequence

import horovod.tensorflow as hvd
from horovod.common.elastic import ObjectState
import keras
import numpy as np
import tensorflow as tf

from hvd_scale.launch import metrics as metrics_log
from hvd_scale.policies import (Policy, PolicyReadout, agree_across_ranks, make_policy,
                                resolve_policy)
from hvd_scale.reduce import unpack_summed

ALLREDUCE_NAME = "hvd_scale.step"

# The engine's state as the float64 vector ``hvd_scale_state`` (one parameter group). Counts are
# exact in float64 up to 2**53. The spec, scale and smoothing are configuration (get_config).
STATE_FIELDS = ("steps", "progress", "skipped", "updates", "bias_weight", "sigma2_biased",
                "mu2_biased")
_PROGRESS = STATE_FIELDS.index("progress")

# Base-optimizer arguments that belong on the inner optimizer (as in LossScaleOptimizer).
_INNER_ONLY = ("learning_rate", "weight_decay", "clipnorm", "global_clipnorm", "clipvalue",
               "use_ema", "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
               "gradient_accumulation_steps")

# For adascale_adam: the Adam family's second-moment hyperparameters (its `_velocities` exist
# once built).
_ADAM_SLOTS = ("beta_2", "epsilon")


def _lr_owner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that holds the lr and the update rule (below any LossScaleOptimizer)."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _elastic() -> bool:
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def _world_size() -> tf.Tensor:
    """hvd.size() as a tensor; under Horovod elastic read when the graph runs, not when it is
    traced (a resize must not leave a train function with the old size, as Horovod does)."""
    return tf.cast(hvd.size_op() if _elastic() else hvd.size(), tf.float64)


def _in_xla_context() -> bool:
    try:  # TensorFlow internals: the XLA context that tf.function(jit_compile=True) enters.
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - moved in a future TF: no check
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()))


def _allreduce_average(tensors: Sequence[tf.Tensor], name: str) -> list[tf.Tensor]:
    """hvd.grouped_allreduce(op=Average), one group per dtype (Horovod's grouped op takes one
    dtype); order kept. Groups in order of first appearance: the same on every rank."""
    groups: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    out: list[tf.Tensor | None] = [None] * len(tensors)
    for dtype, indices in groups.items():
        suffix = "" if len(groups) == 1 else f".{dtype.name}"
        reduced = hvd.grouped_allreduce([tensors[i] for i in indices], op=hvd.Average,
                                        name=name + suffix)
        for i, r in zip(indices, reduced):
            out[i] = r
    return out


def _sqnorm(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """Sum of squares of all entries, float64 (each variable's sum in its own precision, or
    float32 for half types)."""
    total = tf.constant(0.0, tf.float64)
    for t in tensors:
        if t.dtype not in (tf.float64, tf.float32):
            t = tf.cast(t, tf.float32)
        total += tf.cast(tf.reduce_sum(tf.square(t)), tf.float64)
    return total


@keras.saving.register_keras_serializable(package="hvd_scale", name="DistributedOptimizer")
class DistributedOptimizer(PolicyReadout, keras.optimizers.Optimizer):
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
        name: the optimizer's name.

    Base-optimizer arguments (clipnorm, weight_decay, use_ema, ...) are set on the inner
    optimizer, as for ``keras.optimizers.LossScaleOptimizer``.
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, policy: str | Policy | None = None,
                 backward_passes_per_step: int = 1, *, scale: float | None = None,
                 budget: float | None = None, measure: bool | None = None,
                 log_dir: str | None = None, name: str | None = None, **kwargs: Any):
        if keras.backend.backend() != "tensorflow":
            raise ValueError(f"hvd_scale.adapters.keras needs the TensorFlow backend, got "
                             f"KERAS_BACKEND={keras.backend.backend()!r}; with torch use "
                             "hvd_scale.adapters.torch")
        for arg in _INNER_ONLY:
            if arg in kwargs:
                raise ValueError(f"DistributedOptimizer does not support `{arg}`. Instead, set "
                                 f"`{arg}` on the `inner_optimizer`.")
        if kwargs:
            raise ValueError(f"DistributedOptimizer does not support arguments: "
                             f"`{'`, `'.join(kwargs)}`.")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"inner_optimizer must be a keras.optimizers.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        if isinstance(inner_optimizer, DistributedOptimizer):
            raise TypeError("inner_optimizer is already distributed: wrap the plain optimizer once")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                             f"{backward_passes_per_step!r}")
        owner = _lr_owner(inner_optimizer)
        if owner.gradient_accumulation_steps:
            raise ValueError(f"the inner optimizer has gradient_accumulation_steps="
                             f"{owner.gradient_accumulation_steps}, which would accumulate after "
                             "the allreduce; use DistributedOptimizer(..., backward_passes_per_step="
                             f"{owner.gradient_accumulation_steps}) instead")
        optimizer_name = type(owner).__name__
        k = backward_passes_per_step
        micro_gradients = hvd.size() * k
        # Not under Horovod elastic: a joining worker builds its optimizer while the others
        # wait in the state sync, so an allgather here would hang (the sync brings rank 0's state).
        allgather = None if hvd.size() == 1 or _elastic() else \
            (lambda obj: hvd.allgather_object(obj, name="hvd_scale.spec"))
        policy_obj = agree_across_ranks(
            lambda: resolve_policy(policy, scale=float(micro_gradients) if scale is None else scale,
                                   budget=budget, optimizer=optimizer_name,
                                   micro_gradients=micro_gradients), allgather)
        if policy_obj.statistics == "preconditioned" and not all(hasattr(owner, a) for a in _ADAM_SLOTS):
            raise ValueError(f"policy {policy_obj.name!r} measures Adam-preconditioned gradients, "
                             f"but {optimizer_name} has no second moment (beta_2, epsilon)")

        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.backward_passes_per_step = k
        self.optimizer_name = optimizer_name
        self._policy = policy_obj
        self._config = {"scale": scale, "budget": budget, "measure": measure}
        log_dir = log_dir or os.environ.get(metrics_log.LOG_DIR_ENV) or None
        # Decided alike on every rank (the statistics ride in the allreduce of all of them).
        if measure is None:
            measure = policy_obj.uses_statistics or log_dir is not None
        self._measure = bool(measure)
        self._logger = None if log_dir is None else metrics_log.MetricsLogger(
            log_dir, rank=hvd.rank(), budget=policy_obj.budget,
            run_info={"policy": policy_obj.spec, "scale": policy_obj.scale, "workers": hvd.size(),
                      "backward_passes_per_step": k, "optimizer": optimizer_name,
                      "framework": "keras"})
        self._mirror: np.ndarray | None = None  # the state vector the cached policy holds
        self._world_size = hvd.size()  # S follows it under Horovod elastic (see _engine_step)
        self._last_lr = math.nan

    # -- Keras optimizer protocol ----------------------------------------------------------------
    def build(self, var_list):
        self._mirror = self._policy_vector()
        initial = self._mirror.copy()
        self._state = self.add_variable(
            shape=(len(STATE_FIELDS),), dtype="float64", aggregation="none", name="hvd_scale_state",
            initializer=lambda shape, dtype=None: tf.constant(initial, tf.float64))
        self._accumulators = []
        if self.backward_passes_per_step > 1:
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
        if _in_xla_context():
            raise ValueError(
                "hvd_scale's DistributedOptimizer uses Horovod collectives, which XLA cannot compile "
                "(this Horovod build has no XLA ops): compile the model with jit_compile=False "
                "(model.compile(..., jit_compile=False)) or do not use tf.function(jit_compile=True)")
        if tf.distribute.has_strategy():
            raise ValueError("DistributedOptimizer distributes with Horovod; do not use it inside a "
                             "tf.distribute strategy scope")
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
        # Dense gradients: one grouped allreduce (as Horovod's sparse_as_dense=True).
        grads = [tf.convert_to_tensor(g) for g, _ in pairs]
        variables = [v for _, v in pairs]
        with keras.name_scope(self.name, caller=self):
            if self.backward_passes_per_step == 1:
                local = self._local_sqnorm_of(grads, variables) if self._measure else None
                self._step(grads, variables, local, 1.0)
            else:
                self._accumulate(grads, variables)

    def _accumulate(self, grads, variables):
        accumulators = [self._accumulators[self._get_variable_index(v)] for v in variables]
        for acc, g in zip(accumulators, grads):
            acc.assign_add(tf.cast(g, acc.dtype))
        if self._measure:
            self._local_sqnorm.assign_add(self._local_sqnorm_of(grads, variables))
        self._micro_steps.assign_add(1)

        def step():
            local = tf.convert_to_tensor(self._local_sqnorm.value) if self._measure else None
            self._step([tf.convert_to_tensor(acc.value) for acc in accumulators], variables, local,
                       tf.cast(self._micro_steps.value, tf.float64))
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc.value))
            self._local_sqnorm.assign(tf.constant(0.0, tf.float64))
            self._micro_steps.assign(0)

        tf.cond(self._micro_steps.value >= self.backward_passes_per_step, step, lambda: None)

    def _step(self, local_grads, variables, local_sqnorm, local_count):
        """One optimizer step from this worker's summed micro-gradients and statistics."""
        k = self.backward_passes_per_step
        tensors = list(local_grads)
        if self._measure:
            # In the gradients' precision so that they share their group (float64 for a float64
            # model, else float32: the count stays exact, the norms get one float32 rounding).
            stats_dtype = tf.float64 if any(g.dtype == tf.float64 for g in tensors) else tf.float32
            tensors.append(tf.cast(tf.stack([local_sqnorm, tf.cast(local_count, tf.float64)]),
                                   stats_dtype))
        reduced = _allreduce_average(tensors, ALLREDUCE_NAME)
        mean = reduced[:len(local_grads)]
        if k > 1:
            mean = [g / tf.cast(k, g.dtype) for g in mean]  # the mean micro-gradient
        if self._measure:
            stats = tf.cast(reduced[-1], tf.float64) * _world_size()  # the sums over workers
            mean_sqnorm = self._unscale(_sqnorm(self._precondition(mean, variables)))
            finite = tf.logical_and(tf.reduce_all(tf.math.is_finite(stats)),
                                    tf.math.is_finite(mean_sqnorm))
        else:
            stats, mean_sqnorm = tf.zeros([2], tf.float64), tf.constant(0.0, tf.float64)
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in mean])
        base_lr = tf.cast(self._base_learning_rate(self._state.value[_PROGRESS]), tf.float64)
        new_state, factor = tf.numpy_function(
            self._engine_step, [self._state.value, stats, mean_sqnorm, finite, base_lr],
            [tf.float64, tf.float64], stateful=True, name="hvd_scale_policy_step")
        new_state.set_shape([len(STATE_FIELDS)])
        factor.set_shape([])
        self._state.assign(new_state)
        lr = base_lr * factor
        if isinstance(self.inner_optimizer, keras.optimizers.LossScaleOptimizer):
            # It checks finiteness itself (same averaged gradient on every rank) and must see an
            # overflow to lower its scale.
            self._inner_apply(mean, variables, lr)
        else:
            tf.cond(finite, lambda: self._inner_apply(mean, variables, lr), lambda: None)

    def _inner_apply(self, grads, variables, lr):
        """inner.apply with the step's lr; the user's lr attribute is put back untouched."""
        owner = _lr_owner(self.inner_optimizer)
        saved = owner.__dict__["_learning_rate"]
        # Bypass Keras/TF attribute tracking: the swap lasts for this call only.
        object.__setattr__(owner, "_learning_rate", lr)
        try:
            self.inner_optimizer.apply(grads, variables)
        finally:
            object.__setattr__(owner, "_learning_rate", saved)

    def _base_learning_rate(self, progress):
        """The user's lr for the step at progress tau: a schedule runs at floor(tau)."""
        lr = _lr_owner(self.inner_optimizer)._learning_rate
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            return lr(tf.cast(tf.floor(progress), tf.int64))
        if isinstance(lr, keras.Variable):
            return lr.value
        if callable(lr):
            return lr()
        return lr

    # -- statistics ------------------------------------------------------------------------------
    def _loss_scale(self):
        inner = self.inner_optimizer
        if isinstance(inner, keras.optimizers.LossScaleOptimizer):
            return inner.dynamic_scale.value
        return inner.loss_scale_factor

    def _unscale(self, sqnorm):
        scale = self._loss_scale()
        if scale is None:
            return sqnorm
        return sqnorm / tf.square(tf.cast(scale, tf.float64))

    def _local_sqnorm_of(self, grads, variables):
        return self._unscale(_sqnorm(self._precondition(grads, variables)))

    def _precondition(self, grads, variables):
        """g / (sqrt(v_hat) + eps) for adascale_adam (Adam's second moment before this step)."""
        if self._policy.statistics != "preconditioned":
            return grads
        owner = _lr_owner(self.inner_optimizer)
        t = tf.cast(owner.iterations, tf.float32)
        bias_correction2 = 1.0 - tf.pow(tf.cast(owner.beta_2, tf.float32), t)
        out = []
        velocities = getattr(owner, "_velocities", None)
        if velocities is None:
            raise ValueError(f"policy {self._policy.name!r} needs the second moment of "
                             f"{type(owner).__name__}, which keeps no `_velocities`")
        for g, v in zip(grads, variables):
            velocity = velocities[owner._get_variable_index(v)]
            if velocity is None:
                out.append(g)
                continue
            v_hat = velocity.value / tf.cast(tf.maximum(bias_correction2, 1e-30), velocity.dtype)
            denom = tf.cast(tf.sqrt(v_hat) + tf.cast(owner.epsilon, velocity.dtype), g.dtype)
            # First step: no second moment yet, the plain gradient (as the torch adapter).
            out.append(tf.where(t > 0, g / denom, g))
        return out

    # -- the engine, on the host ------------------------------------------------------------------
    def _engine_step(self, state, stats, mean_sqnorm, finite, base_lr):
        """tf.numpy_function body: (new state vector, lr factor; 0 for a skipped step)."""
        self._load_vector(state)
        policy = self._policy
        size = hvd.size()
        policy.follow_workers(self._world_size, size)
        self._world_size = size
        if not finite:
            policy.skip()
            factor = 0.0
        elif self._measure:
            sqnorm_sum, n = unpack_summed(stats, 1)
            if n != size * self.backward_passes_per_step:  # e.g. a world size frozen in a graph
                raise RuntimeError(f"hvd_scale: the step's statistics count {n} micro-gradients, "
                                   f"expected {size} workers x {self.backward_passes_per_step}")
            factor = policy.step(sqnorm_sum, [float(mean_sqnorm)], n).lr_factor
        else:
            factor = policy.step().lr_factor
        if finite:
            self._last_lr = float(base_lr) * factor
            if self._logger is not None:
                self._logger.log({**policy.metrics(), "lr_factor": factor, "lr": self._last_lr})
        self._mirror = self._policy_vector()
        return self._mirror.copy(), np.float64(factor)

    def _policy_vector(self) -> np.ndarray:
        d = self._policy.state_dict()
        est = d["estimator"]
        sigma2, mu2 = est["sigma2_biased"], est["mu2_biased"]
        if sigma2 is not None and len(sigma2) != 1:
            raise ValueError(f"the Keras adapter keeps one parameter group, the policy has "
                             f"statistics for {len(sigma2)}")
        values = {"steps": d["steps"], "progress": d["progress"], "skipped": d["skipped"],
                  "updates": est["updates"], "bias_weight": est["bias_weight"],
                  "sigma2_biased": 0.0 if sigma2 is None else sigma2[0],
                  "mu2_biased": 0.0 if mu2 is None else mu2[0]}
        return np.array([values[f] for f in STATE_FIELDS], dtype=np.float64)

    def _load_vector(self, vector) -> None:
        """Reload the cached policy from the state variable's value when it changed elsewhere."""
        vector = np.asarray(vector, dtype=np.float64)
        if self._mirror is not None and vector.tobytes() == self._mirror.tobytes():
            return
        if vector.shape != (len(STATE_FIELDS),):
            raise ValueError(f"hvd_scale_state must hold {len(STATE_FIELDS)} values "
                             f"{STATE_FIELDS}, got shape {vector.shape}")
        v = dict(zip(STATE_FIELDS, vector.tolist()))
        d = self._policy.state_dict()  # this job's spec, scale and smoothing
        d.update(steps=int(v["steps"]), progress=v["progress"], skipped=int(v["skipped"]))
        measured = int(v["updates"]) > 0
        d["estimator"].update(updates=int(v["updates"]), bias_weight=v["bias_weight"],
                              sigma2_biased=[v["sigma2_biased"]] if measured else None,
                              mu2_biased=[v["mu2_biased"]] if measured else None)
        self._policy.load_state_dict(d)
        self._mirror = vector.copy()

    @property
    def policy(self) -> Policy:
        """The engine's policy, synchronized with ``hvd_scale_state`` (read it eagerly)."""
        if self.built and tf.executing_eagerly():
            self._load_vector(self._state.numpy())
        return self._policy

    # -- forwarded to the inner optimizer ---------------------------------------------------------
    @property
    def learning_rate(self):
        """The user's baseline lr: the variable, or a schedule's value at floor(tau)."""
        lr = _lr_owner(self.inner_optimizer)._learning_rate
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            progress = self._state.value[_PROGRESS] if self.built else tf.constant(0.0, tf.float64)
            return self._base_learning_rate(progress)
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """Optimizer steps applied (skipped steps and accumulation calls excluded)."""
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError("DistributedOptimizer is stateful (TensorFlow backend): use apply()")

    def get_config(self):
        # Constructor arguments only; the policy as its resolved spec (not $HVD_SCALE_POLICY).
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "policy": self._policy.spec,
                "backward_passes_per_step": self.backward_passes_per_step,
                **self._config}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)

    # -- what can be read (host values) ------------------------------------------------------------
    def rescale(self, scale: float | None = None) -> None:
        """New S: default hvd.size() x backward passes."""
        self.policy.rescale(float(hvd.size() * self.backward_passes_per_step) if scale is None else scale)

    def metrics(self) -> dict[str, float]:
        """The policy's metrics plus ``lr``, the learning rate the latest step applied."""
        return {**self.policy.metrics(), "lr": self._last_lr}

    last_learning_rate = property(lambda self: self._last_lr,
                                  doc="lr(floor(tau)) x factor of the latest applied step")

    def __repr__(self) -> str:
        return f"hvd_scale.DistributedOptimizer({self.optimizer_name}, policy={self._policy!r})"


# -- callbacks and helpers -----------------------------------------------------------------------

def _prepare_model(model) -> None:
    """Refuse the wrapping that deadlocks; switch XLA off before fit builds its train function."""
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, keras.optimizers.LossScaleOptimizer) and \
            isinstance(opt.inner_optimizer, DistributedOptimizer):
        raise ValueError("Keras wrapped hvd_scale's DistributedOptimizer in a LossScaleOptimizer "
                         "(mixed_float16), which skips steps per rank before the allreduce: use "
                         "DistributedOptimizer(LossScaleOptimizer(inner)) and compile with "
                         "auto_scale_loss=False")
    if isinstance(opt, DistributedOptimizer) and getattr(model, "compiled", False) \
            and model.jit_compile:
        warnings.warn("hvd_scale: Horovod collectives cannot be XLA-compiled; setting "
                      "model.jit_compile = False (compile with jit_compile=False to silence this)",
                      stacklevel=3)
        model.jit_compile = False
        model.train_function = None


def broadcast_state(model, optimizer=None, root_rank: int = 0) -> None:
    """Broadcast the model's variables, the optimizer's (inner state and the policy's
    ``hvd_scale_state`` included) from root_rank. Builds the optimizer if needed; the model
    must be built."""
    optimizer = getattr(model, "optimizer", None) if optimizer is None else optimizer
    if optimizer is None:
        variables = list(model.variables)
        if not variables:
            raise ValueError("the model has no variables yet: build it (call it on a batch) first")
    else:
        variables = _model_and_optimizer_variables(model, optimizer)
    hvd.broadcast_variables([v.value if isinstance(v, keras.Variable) else v for v in variables],
                            root_rank=root_rank)


def _model_and_optimizer_variables(model, optimizer) -> list:
    if not model.variables:
        raise ValueError("the model has no variables yet: build it (call it on a batch) first")
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return list(model.variables) + list(optimizer.variables)


class ElasticState(ObjectState):
    """Horovod elastic state of a Keras 3 model and this optimizer, for ``hvd.elastic.run``.

        state = ElasticState(model, opt, epoch=0)   # extra keyword values are committed too
        @elastic_run
        def train(state): ...; state.commit()

    ``commit()`` copies every model variable and every optimizer variable (the inner optimizer's
    slots, ``iterations`` and ``hvd_scale_state``: steps, tau and the gain estimates) to host
    memory; after a failure ``restore()`` puts them back, and after a resize ``sync()``
    broadcasts them from rank 0 (how a joining worker gets tau and the weights). S follows the
    new world size at the next step (``follow_workers``). Horovod's own ``TensorFlowKerasState``
    calls Keras 2 APIs and fails with Keras 3.
    """

    def __init__(self, model, optimizer: DistributedOptimizer | None = None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if not isinstance(self.optimizer, DistributedOptimizer):
            raise TypeError(f"ElasticState needs hvd_scale's DistributedOptimizer (given, or "
                            f"compiled into the model), got {type(self.optimizer).__name__}")
        self._variables = _model_and_optimizer_variables(model, self.optimizer)
        self._save_variables()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    def _save_variables(self) -> None:
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self._variables]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        for variable, value in zip(self._variables, self._saved_values):
            variable.assign(value)
        super().restore()

    def sync(self):
        broadcast_state(self.model, self.optimizer)
        self._save_variables()
        super().sync()


def elastic_run(func):
    """``hvd.elastic.run`` for TensorFlow, without its silent failure: Horovod's wrapper turns an
    ``UnknownError`` from a Horovod collective into a restore-and-retry, but *returns None* on any
    other ``UnknownError`` (e.g. a Python error raised inside a ``tf.numpy_function`` or
    ``py_function``), so training stops early as if it had finished. This one re-raises those.

        @elastic_run
        def train(state): ...
    """
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError
    from horovod.tensorflow.elastic import _reset

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as e:
            # Horovod's own test: the op names of its collectives in the message.
            if any(op in e.message for op in ("HorovodAllreduce", "HorovodAllgather",
                                              "HorovodBroadcast")):
                raise HorovodInternalError(e) from e
            raise
    return run_fn(wrapper, _reset)


class CommitState(keras.callbacks.Callback):
    """``model.fit`` under ``hvd.elastic.run``: commit the ElasticState every
    ``batches_per_commit`` batches and at each epoch's end (a commit also checks for added or
    removed hosts). Re-entering ``fit`` after a reset goes on from the committed tau; stop on
    tau with ``ScalingMetrics(budget=...)``."""

    def __init__(self, state: ElasticState, batches_per_commit: int = 1):
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be an integer >= 1, got {batches_per_commit!r}")
        self.state, self.batches_per_commit = state, batches_per_commit
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.batches_per_commit == 0:
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class BroadcastInitialState(keras.callbacks.Callback):
    """Start every rank from root_rank's weights, optimizer variables and policy state.

    Runs once, at the start of the first ``fit``.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def set_model(self, model):
        super().set_model(model)
        _prepare_model(model)

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            broadcast_state(self.model, root_rank=self.root_rank)
            self.broadcast_done = True


class ScalingMetrics(keras.callbacks.Callback):
    """Put the policy's metrics into ``logs``; stop training once tau reaches a budget.

    Keys added to the batch and epoch logs (so History, CSVLogger and the progress bar show
    them; list this callback before CSVLogger): ``gain``, ``lr`` (the latest step's applied lr),
    ``lr_factor``, ``progress`` (tau), ``scale``, ``sigma2``, ``mu2``, ``noise_scale``,
    ``efficiency``. With ``budget`` (baseline steps; default the optimizer's), sets
    ``model.stop_training`` after the batch whose step takes tau to the budget: tau is the same
    on every rank, so every rank stops at the same batch.
    """

    KEYS = ("gain", "lr", "lr_factor", "progress", "scale", "sigma2", "mu2", "noise_scale",
            "efficiency")

    def __init__(self, budget: float | None = None, batch_logs: bool = True):
        super().__init__()
        self.budget = budget
        self.batch_logs = batch_logs

    def set_model(self, model):
        super().set_model(model)
        _prepare_model(model)

    def _optimizer(self) -> DistributedOptimizer:
        opt = self.model.optimizer
        if not isinstance(opt, DistributedOptimizer):
            raise TypeError(f"ScalingMetrics needs a model compiled with hvd_scale's "
                            f"DistributedOptimizer, got {type(opt).__name__}")
        return opt

    def _values(self) -> dict[str, float]:
        metrics = self._optimizer().metrics()
        return {key: metrics[key] for key in self.KEYS}

    def on_train_batch_end(self, batch, logs=None):
        opt = self._optimizer()
        if self.batch_logs and logs is not None:
            logs.update(self._values())
        budget = self.budget if self.budget is not None else opt.policy.budget
        if budget is not None and opt.done(budget):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._values())
