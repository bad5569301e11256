"""Run under horovodrun: checks of the Keras adapter, each printing RESULT lines for the parent.

Every rank draws its own micro-batches from a seed that depends on (rank, step, pass), and can
therefore also rebuild *all* ranks' micro-batches to compute a single-process reference. Models
are float64 (keras floatx), so references agree to rounding.

The model.fit cases (fit, fit_accumulate, checkpoint) run on either Keras backend
(``KERAS_BACKEND=torch`` for torch); the others use TensorFlow directly (tapes, tf.function).
"""

import argparse
import atexit
import csv
import dataclasses
import hashlib
import os
import shutil
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

from _reference import read_sums
from _report import emit_result, error_of
from hvd_scale import GainEstimator
from hvd_scale.metrics import TIMING_METRICS
from hvd_scale.noise import NoiseState
from hvd_scale.adapters.keras import (BroadcastInitialState, CommitState, DistributedOptimizer,
                                      ElasticState, ScalingMetrics, broadcast_state, hvd)


def temp_dir() -> str:
    """A metrics directory of this process, removed when it exits (every rank makes one)."""
    path = tempfile.mkdtemp(prefix="hvd_scale_keras_worker_")
    atexit.register(shutil.rmtree, path, True)
    return path


TF = keras.backend.backend() == "tensorflow"
if TF:
    import tensorflow as tf

keras.config.set_floatx("float64")  # before any Keras object (the loss below) is made
LR = 0.05


def emit(case, **values):
    emit_result({"case": case, "rank": hvd.rank(), "backend": keras.backend.backend(), **values})


def make_model(seed=0, dtypes=(None, None)):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,), dtype=dtypes[0]),
                             keras.layers.Dense(16, activation="tanh", dtype=dtypes[0]),
                             keras.layers.Dense(3, dtype=dtypes[1])])


def micro_batch(rank, step, k_pass, size=16):
    rng = np.random.default_rng(1000 * step + 10 * rank + k_pass)
    x = rng.normal(size=(size, 8))
    y = rng.integers(0, 3, size)
    return x, y


def dataset(rank, samples):
    """A rank's shard for fit: labels depend on x, so the loss can go down."""
    rng = np.random.default_rng(7 + rank)
    x = rng.normal(size=(samples, 8))
    y = (np.argmax(x[:, :3] + 0.3 * rng.normal(size=(samples, 3)), axis=1)).astype("int64")
    return x, y


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def grads_of(model, x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def flat(tensors):
    return np.concatenate([np.asarray(t).reshape(-1) for t in tensors])


def weights_vector(model):
    return flat(model.get_weights())


def weights_hash(model):
    return hashlib.sha256(weights_vector(model).astype(np.float64).tobytes()).hexdigest()


def averaged(grads, name):
    """The mean over workers of each rank's gradient (what the adapter should apply)."""
    out = hvd.grouped_allreduce([tf.convert_to_tensor(g) for g in grads], op=hvd.Average, name=name)
    return flat(out)


def timings(metrics):
    """A metrics row's step timings (``hvd_scale.metrics.TIMING_METRICS``)."""
    return {key: metrics[key] for key in TIMING_METRICS}


def logged_rows(log_dir, keys):
    """The metrics log's rows, ``keys`` as floats; None where no log was written (ranks but 0)."""
    path = os.path.join(log_dir, "metrics.csv")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [{key: float(row[key]) for key in keys} for row in csv.DictReader(f)]


def reference_step(ref, estimator, step, size, k):
    """One step of the one-process AdaScale reference (plain SGD at LR) over every rank's k
    micro-batches of ``step``: its gain."""
    per_micro = [flat(grads_of(ref, *micro_batch(r, step, j))) for r in range(size) for j in range(k)]
    mean = np.mean(per_micro, axis=0)
    sqnorm_sum, samples = read_sums(per_micro, size)  # as the adapter reads them
    gain = estimator.update(sqnorm_sum, float(mean @ mean), len(per_micro), samples=samples)
    offset = 0
    for v in ref.trainable_variables:
        n = int(np.prod(v.shape))
        v.assign(v.numpy() - LR * gain * mean[offset:offset + n].reshape(v.shape))
        offset += n
    return gain


# -- cases --------------------------------------------------------------------------------------

def case_reference(k, use_function):
    """Custom loop vs a one-process AdaScale reference from all ranks' micro-batches (plain SGD)."""
    size = hvd.size()
    model, ref = make_model(), make_model()
    opt = DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale",
                               backward_passes_per_step=k)

    def train_step(x, y):
        opt.apply(grads_of(model, x, y), model.trainable_variables)

    if use_function:
        train_step = tf.function(train_step)
    ref_est = GainEstimator(scale=size * k)
    rows = []
    for step in range(4):
        for j in range(k):
            train_step(*micro_batch(hvd.rank(), step, j))
        gain = reference_step(ref, ref_est, step, size, k)
        rows.append({"gain": opt.gain, "ref_gain": gain, "sigma2": opt.sigma2,
                     "ref_sigma2": ref_est.sigma2, "mu2": opt.mu2, "ref_mu2": ref_est.mu2,
                     "progress": opt.progress, "iterations": int(opt.iterations.numpy()),
                     "max_param_diff": float(np.max(np.abs(weights_vector(model) - weights_vector(ref)))),
                     "lr_after": float(opt.learning_rate.numpy())})
    emit(f"reference_k{k}", scale=opt.scale, rows=rows, function=use_function)


def case_passes_change():
    """set_passes between steps (what adapt='goodput' does): k = 1, 1, 3, 3, 2, 2 on both ranks
    in one traced train step (k is a variable: no retrace); gain, tau and weights equal the
    one-process reference replaying the same micro-batches at S = 2k; the optimizer's variables
    saved at k = 3 resume at k = 3 (S = 6) in an optimizer built at k = 1."""
    size = hvd.size()

    def build():
        return DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale", adapt="goodput",
                                    max_passes=4, adapt_every=10_000)

    model, ref = make_model(), make_model()
    opt = build()
    train_step = tf.function(lambda x, y: opt.apply(grads_of(model, x, y), model.trainable_variables))
    ref_est = GainEstimator(scale=size)
    rows, saved = [], None
    for step, k in enumerate([1, 1, 3, 3, 2, 2]):
        if step == 4:  # before the change to k = 2: the state at k = 3
            saved = ([keras.ops.convert_to_numpy(v.value) for v in opt.variables], model.get_weights())
        if k != opt.backward_passes_per_step:
            opt.set_passes(k)
            ref_est.rescale(size * k)
        for j in range(opt.backward_passes_per_step):
            train_step(*micro_batch(hvd.rank(), step, j))
        opt.adapt_passes()
        gain = reference_step(ref, ref_est, step, size, k)
        rows.append({"k": k, "scale": opt.scale, "gain": opt.gain, "ref_gain": gain,
                     "progress": opt.progress, "timing": timings(opt.metrics()),
                     "diff": float(np.max(np.abs(weights_vector(model) - weights_vector(ref))))})
    traces = train_step.experimental_get_tracing_count()
    resumed_model = make_model()
    resumed_model.set_weights(saved[1])
    resumed = build()
    resumed.build(resumed_model.trainable_variables)
    for v, value in zip(resumed.variables, saved[0]):
        v.assign(value)
    emit("passes_change", rows=rows, traces=traces,
         resumed={"k": resumed.backward_passes_per_step, "scale": resumed.scale,
                  "progress": resumed.progress})


def case_adapt_goodput():
    """adapt='goodput' under model.fit on a model whose allreduce dwarfs its passes (a 1M-parameter
    layer, 4 samples a pass, random labels: the gain is ~S): the ranks agree on k every 5 steps
    (the callbacks call adapt_passes) and the job ends with k > 1."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(4096), keras.layers.Dense(2)])
    opt = DistributedOptimizer(keras.optimizers.SGD(1e-3), policy="adascale", adapt="goodput",
                               max_passes=8, adapt_every=5)
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.normal(size=(4 * 160, 256)), rng.integers(0, 2, 4 * 160)

    class Ks(keras.callbacks.Callback):
        """The k each step runs at (read as its first batch begins)."""

        def __init__(self):
            super().__init__()
            self.ks, self.steps = [], None

        def on_train_batch_begin(self, batch, logs=None):
            if opt.steps != self.steps:
                self.steps = opt.steps
                self.ks.append(opt.backward_passes_per_step)

    ks = Ks()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[BroadcastInitialState(), ScalingMetrics(), ks])
    emit("adapt_goodput", ks=ks.ks, scale=opt.scale, final_k=opt.backward_passes_per_step,
         checksum=float(sum(np.sum(w) for w in model.get_weights())),
         model=dataclasses.asdict(opt.scaling.clock.model(hvd.size())))


def case_dtypes():
    """A float32 model (its statistics travel in the float32 group) and a float32/float64 one
    (one allreduce group per dtype) against the one-process reference in float64."""
    size = hvd.size()
    out = {}
    for name, dtypes in {"float32": ("float32", "float32"), "mixed": ("float32", "float64")}.items():
        model, ref = make_model(dtypes=dtypes), make_model(dtypes=dtypes)
        opt = DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale")
        step_fn = tf.function(lambda x, y: opt.apply(grads_of(model, x, y), model.trainable_variables))
        ref_est = GainEstimator(scale=size)
        rows = []
        for step in range(3):
            x, y = micro_batch(hvd.rank(), step, 0)
            step_fn(x.astype("float32"), y)
            per_micro = [flat(grads_of(ref, x_.astype("float32"), y_)).astype(np.float64)
                         for x_, y_ in (micro_batch(r, step, 0) for r in range(size))]
            mean = np.mean(per_micro, axis=0)
            gain = ref_est.update(sum(float(g @ g) for g in per_micro), float(mean @ mean), size)
            offset = 0
            for v in ref.trainable_variables:
                n = int(np.prod(v.shape))
                v.assign((v.numpy() - LR * gain * mean[offset:offset + n].reshape(v.shape)).astype(v.dtype))
                offset += n
            rows.append({"gain": opt.gain, "ref_gain": gain, "progress": opt.progress})
        out[name] = {"rows": rows, "hash": weights_hash(model),
                     "dtypes": sorted({v.dtype for v in model.trainable_variables}),
                     "max_param_diff": float(np.max(np.abs(weights_vector(model) - weights_vector(ref))))}
    emit("dtypes", runs=out)


def case_policies():
    """Each policy's factor is what the weights moved by; the user's lr comes back."""
    out = {}
    for spec in ["none", "linear", "sqrt", "warmup:baseline_steps=4", "adascale"]:
        model = make_model()
        opt = DistributedOptimizer(keras.optimizers.SGD(LR), policy=spec)
        factors, lrs = [], []
        for step in range(3):
            grads = grads_of(model, *micro_batch(hvd.rank(), step, 0))
            gbar = averaged(grads, f"check.{spec}.{step}")
            before = weights_vector(model)
            opt.apply(grads, model.trainable_variables)
            moved = before - weights_vector(model)
            factors.append(float(moved @ gbar / (gbar @ gbar)) / LR)
            lrs.append(float(opt.learning_rate.numpy()))
        out[spec] = {"factors": factors, "lrs": lrs, "gain": opt.gain, "progress": opt.progress}
    # AdaScale for Adam: preconditioned statistics, lr x sqrt(gain).
    model = make_model()
    opt = DistributedOptimizer(keras.optimizers.Adam(1e-3), policy="adascale_adam")
    gains = []
    for step in range(4):
        opt.apply(grads_of(model, *micro_batch(hvd.rank(), step, 0)), model.trainable_variables)
        gains.append(opt.gain)
    out["adascale_adam"] = {"gains": gains, "progress": opt.progress,
                            "lr_factor": opt.lr_factor}
    emit("policies", scale=hvd.size(), policies=out)


def case_schedule():
    """A LearningRateSchedule runs in tau: the step at progress tau uses lr(floor(tau)) x factor."""
    model = make_model()
    schedule = keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=1, decay_rate=0.5)
    opt = DistributedOptimizer(keras.optimizers.SGD(schedule), policy="linear")
    rows = []
    for step in range(3):
        grads = grads_of(model, *micro_batch(hvd.rank(), step, 0))
        gbar = averaged(grads, f"check.schedule.{step}")
        before, tau = weights_vector(model), opt.progress
        opt.apply(grads, model.trainable_variables)
        moved = before - weights_vector(model)
        rows.append({"tau_before": tau, "lr": float(moved @ gbar / (gbar @ gbar)),
                     "last_lr": opt.last_learning_rate})
    emit("schedule", rows=rows, iterations=int(opt.iterations.numpy()), progress=opt.progress,
         lr_now=float(opt.learning_rate.numpy()))


class Recorder(keras.callbacks.Callback):
    """Per optimizer step: (gain, progress); and the weights' hash when training starts."""

    def __init__(self):
        super().__init__()
        self.rows, self.start_hash, self._steps = [], None, 0

    def on_train_begin(self, logs=None):
        self.start_hash = weights_hash(self.model)

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer
        if opt.steps != self._steps:
            self._steps = opt.steps
            self.rows.append({"gain": opt.gain, "progress": opt.progress})


def case_fit():
    """model.fit: replicas start apart, get broadcast, train in sync, stop at the budget."""
    x, y = dataset(hvd.rank(), 160)  # 10 batches of 16 per epoch
    model = make_model(seed=100 + hvd.rank())  # different on purpose: the broadcast must fix it
    log_dir = temp_dir()
    opt = DistributedOptimizer(keras.optimizers.SGD(0.2, momentum=0.9), policy="adascale",
                               log_dir=log_dir)
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    recorder = Recorder()
    budget = 45.0
    history = model.fit(x, y, batch_size=16, epochs=50, shuffle=False, verbose=0,
                        callbacks=[BroadcastInitialState(), recorder, ScalingMetrics(budget=budget)])
    opt.close()
    rows = logged_rows(log_dir, ("loss",))  # rank 0's
    csv_loss = None if rows is None else [r["loss"] for r in rows]
    emit("fit", losses=history.history["loss"], keys=sorted(history.history), csv_loss=csv_loss,
         epoch_gain=history.history["gain"], epoch_progress=history.history["progress"],
         epoch_lr=history.history["lr"], rows=recorder.rows, start_hash=recorder.start_hash,
         hash=weights_hash(model), scale=opt.scale, budget=budget, progress=opt.progress,
         iterations=int(opt.iterations.numpy()), epochs=len(history.history["loss"]))


def case_tiny():
    """#30 item 5 in Keras: a float32 model whose loss is scaled far down (1e-22, 1e-30) measures
    the unscaled run's gain (its squares underflowed float32, on the wire and in the norms)."""
    gains = {}
    for factor in (1.0, 1e-22, 1e-30):
        model = make_model(seed=5, dtypes=("float32", "float32"))
        opt = DistributedOptimizer(keras.optimizers.SGD(1e-12), policy="adascale")
        opt.build(model.trainable_variables)
        for step in range(6):
            x, y = micro_batch(hvd.rank(), step, 0)
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x.astype("float32"))) * factor
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        metrics = opt.metrics()
        gains[str(factor)] = (metrics["gain"], metrics["sigma2"] / factor ** 2,
                              metrics["mu2"] / factor ** 2)
    emit("tiny", gains=gains)


def case_fit_unbuilt():
    """BroadcastInitialState on a model fit builds (no keras.Input), as Horovod's example has:
    equal weights on every rank after the first batch (#32 item 1: Keras's 'Unknown variable')."""
    keras.utils.set_random_seed(200 + hvd.rank())
    model = keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    opt = DistributedOptimizer(keras.optimizers.Adam(0.01), policy="adascale_adam")
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    x, y = dataset(hvd.rank(), 64)
    built_before = bool(model.variables)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[BroadcastInitialState()])
    emit("fit_unbuilt", built_before=built_before, hash=weights_hash(model),
         losses=history.history["loss"], iterations=int(opt.iterations.numpy()),
         warnings=[str(w.message) for w in caught if "hvd_scale" in str(w.message)])


def case_fit_accumulate():
    """model.fit with backward_passes_per_step=2: S = workers x 2."""
    x, y = dataset(hvd.rank(), 160)
    model = make_model()
    log_dir = temp_dir()
    opt = DistributedOptimizer(keras.optimizers.SGD(0.2), policy="adascale", backward_passes_per_step=2,
                               log_dir=log_dir)
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    recorder = Recorder()
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[recorder])
    opt.close()
    csv_rows = logged_rows(log_dir, ("progress",))  # rank 0's
    emit("fit_accumulate", losses=history.history["loss"], rows=recorder.rows,
         hash=weights_hash(model), scale=opt.scale, iterations=int(opt.iterations.numpy()),
         progress=opt.progress,
         csv_progress=None if csv_rows is None else [r["progress"] for r in csv_rows])


PASS_SLEEP, UPDATE_SLEEP = 0.02, 0.03  # seconds a pass's forward and an update take at least


def slow(x, seconds):
    """x, after sleeping ``seconds`` on the host when the step computes it."""
    if not TF:
        time.sleep(seconds)
        return x
    out = tf.numpy_function(lambda a: (time.sleep(seconds), a)[1], [x], x.dtype, stateful=True)
    return tf.ensure_shape(out, x.shape)


class SlowPass(keras.layers.Layer):
    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return slow(x, PASS_SLEEP)


def slow_sgd(lr):
    """An SGD whose update takes UPDATE_SLEEP more (the policies know SGD by its class name, so
    the instance is patched, not subclassed). TensorFlow's updates one variable at a time
    (update_step), Keras's torch backend all at once (_backend_update_step)."""
    sgd = keras.optimizers.SGD(lr)
    name = "update_step" if TF else "_backend_update_step"
    update = getattr(sgd, name)

    def slow_update(grads, variables, learning_rate):
        if TF and sgd._get_variable_index(variables) == 0:
            grads = slow(grads, UPDATE_SLEEP)
        elif not TF:
            time.sleep(UPDATE_SLEEP)
        update(grads, variables, learning_rate)

    object.__setattr__(sgd, name, slow_update)
    return sgd


def case_timings():
    """#31 item 2: Keras's metrics log has the step clock's timings (a slow pass and a slow
    update show where they belong), at k = 1 and k = 2, and advise reads the log."""
    from hvd_scale.launch.advise import advise

    out = {}
    for k in (1, 2):
        x, y = dataset(hvd.rank(), 16 * 24)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), SlowPass(), keras.layers.Dense(3)])
        log_dir = temp_dir()
        opt = DistributedOptimizer(slow_sgd(0.05), policy="adascale", backward_passes_per_step=k,
                                   log_dir=log_dir)
        model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[ScalingMetrics()])
        opt.close()
        rows = logged_rows(log_dir, TIMING_METRICS + ("time",))  # rank 0's
        report = None if rows is None else advise(log_dir, workers=(1, 2, 4), passes=(1, 2, 4))
        out[str(k)] = {"rows": rows, "advise": report}
    emit("timings", runs=out)


def features_fit(*, spe=1, policy_name=None, wrap_loss_scale=False, callbacks=True, data=None,
                 fit_kwargs=None):
    """One fit of 12 steps (rank's 192 samples, batches of 16) from seed 3's weights: what it
    ended with, or the error each rank saw."""
    keras.config.set_dtype_policy(policy_name or "float64")
    try:
        x, y = dataset(hvd.rank(), 16 * 12)
        model = make_model(seed=3)
        inner = keras.optimizers.SGD(0.1, momentum=0.9)
        if wrap_loss_scale:
            inner = keras.optimizers.LossScaleOptimizer(inner)
        log_dir = temp_dir()
        opt = DistributedOptimizer(inner, policy="adascale", log_dir=log_dir)
        model.compile(optimizer=opt, loss=LOSS, jit_compile=False, steps_per_execution=spe,
                      **({"auto_scale_loss": False} if wrap_loss_scale else {}))
        if data is not None:
            x, y = data(x, y), None
        error = error_of(lambda: model.fit(
            x, y, batch_size=None if y is None else 16, epochs=1, shuffle=False, verbose=0,
            callbacks=[BroadcastInitialState(), ScalingMetrics()] if callbacks else None,
            **(fit_kwargs or {})))
        opt.close()
        rows = logged_rows(log_dir, ("step", "gain", "loss", "step_time"))  # rank 0's
        if error is not None:
            return {"error": error}
        return {"error": error, "weights": weights_vector(model).tolist(), "rows": rows,
                "steps": int(keras.ops.convert_to_numpy(opt.iterations)), "gain": opt.gain,
                "hash": weights_hash(model)}
    finally:
        keras.config.set_dtype_policy("float64")


def case_features():
    """#31 item 4: what Keras users switch on: steps_per_execution, the mixed dtype policies,
    a tf.data pipeline of unknown length."""
    import tensorflow as tf  # tf.data feeds either backend

    def unknown_length(x, y):  # filter: cardinality unknown
        return tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(16)

    out = {
        "reference": features_fit(),
        "spe3": features_fit(spe=3),
        "float32": features_fit(policy_name="float32"),  # the mixed policies' variables' dtype
        "bfloat16": features_fit(policy_name="mixed_bfloat16"),
        "float16_wrapped_by_keras": features_fit(policy_name="mixed_float16"),
        "float16_wrapped_by_keras_no_callbacks": features_fit(policy_name="mixed_float16",
                                                              callbacks=False),
        "float16": features_fit(policy_name="mixed_float16", wrap_loss_scale=True),
        "unknown_length": features_fit(data=unknown_length),
        "unknown_length_repeated": features_fit(
            data=lambda x, y: unknown_length(x, y).repeat(), fit_kwargs={"steps_per_epoch": 12}),
    }
    emit("features", **out)


def new_checkpoint_model(policy="adascale"):
    model = make_model()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    opt = DistributedOptimizer(keras.optimizers.SGD(schedule, momentum=0.9), policy=policy,
                               backward_passes_per_step=2)
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    return model


def as_version_6(path, vector):
    """The saved file (.keras or .weights.h5) as the previous record version wrote it: the
    hvd_scale_state entry equal to ``vector`` without the policy's code nor the noise record,
    [6, S, k, W, measure, skips, last lr, the policy's record]."""
    import h5py
    import zipfile

    def rewrite(h5):
        with h5py.File(h5, "r+") as f:
            found = []
            f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset)
                         and np.array_equal(obj[()], vector) else None)
            assert len(found) == 1, found
            noise = NoiseState.vector_size(1)  # version 8's noise record, after the policy's
            old = np.concatenate([[6.0], f[found[0]][()][2:-noise]])
            del f[found[0]]
            f.create_dataset(found[0], data=old)

    if not path.endswith(".keras"):
        return rewrite(path)
    with zipfile.ZipFile(path) as z:
        members = {name: z.read(name) for name in z.namelist()}
    h5 = path + ".h5"
    with open(h5, "wb") as f:
        f.write(members["model.weights.h5"])
    rewrite(h5)
    with open(h5, "rb") as f:
        members["model.weights.h5"] = f.read()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def load_error(load):
    """The error ``load()`` raised (its type and message), or None."""
    try:
        load()
    except Exception as e:  # noqa: BLE001 (Keras's loader wraps the error in a ValueError)
        return f"{type(e).__name__}: {e}"
    return None


def case_checkpoint():
    """model.save / load_model in the middle of a run (and of an accumulation) continues it;
    a record of another policy is refused (load_weights, tf.train.Checkpoint); one of the
    previous record version (no policy in it) is migrated by load_model (the file's config
    names the policy) and refused by load_weights into an optimizer built here."""
    x, y = dataset(hvd.rank(), 80)  # 5 micro-batches per epoch: epoch 1 ends mid-accumulation
    fit = dict(batch_size=16, shuffle=False, verbose=0)
    full = new_checkpoint_model()
    full.fit(x, y, epochs=3, **fit)

    part = new_checkpoint_model()
    part.fit(x, y, epochs=1, **fit)
    saved_progress = part.optimizer.progress
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"rank{hvd.rank()}.keras")
        part.save(path)
        resumed = keras.models.load_model(path)
        # Another policy's record (the same variables: SGD with momentum under 'linear').
        weights = os.path.join(d, "part.weights.h5")
        part.save_weights(weights)
        other = new_checkpoint_model("linear")
        other.optimizer.build(other.trainable_variables)
        other_before = other.optimizer._state.numpy().copy()
        other_policy = {"load_weights": load_error(lambda: other.load_weights(weights))}
        other_policy["unchanged"] = bool(np.array_equal(other_before, other.optimizer._state.numpy(),
                                                        equal_nan=True))  # last lr: nan
        # The previous version's record: migrated by load_model, refused by load_weights.
        vector = part.optimizer._state.numpy().copy()
        old_path, old_weights = os.path.join(d, "v6.keras"), os.path.join(d, "v6.weights.h5")
        shutil.copy(path, old_path)
        shutil.copy(weights, old_weights)
        as_version_6(old_path, vector)
        as_version_6(old_weights, vector)
        migrated = keras.models.load_model(old_path)
        # The record as saved, with a fresh noise record (version 6 had none).
        noise = NoiseState.vector_size(1)
        taken = migrated.optimizer._state.numpy()
        migrated_record = bool(np.array_equal(taken[:-noise], vector[:-noise]) and np.array_equal(
            taken[-noise:], NoiseState().to_vector(1), equal_nan=True))
        fresh = new_checkpoint_model()
        fresh.optimizer.build(fresh.trainable_variables)
        old_refused = load_error(lambda: fresh.load_weights(old_weights))
        if TF:  # a TensorFlow checkpoint is read into the variable as it is: refused at use
            prefix = tf.train.Checkpoint(model=part, optimizer=part.optimizer).save(
                os.path.join(d, "policy"))
            linear = new_checkpoint_model("linear")
            linear.optimizer.build(linear.trainable_variables)
            tf.train.Checkpoint(model=linear, optimizer=linear.optimizer).restore(prefix)
            linear_before = linear.get_weights()
            other_policy["tf_read"] = load_error(lambda: linear.optimizer.run_state)
            other_policy["tf_fit"] = load_error(lambda: linear.fit(x[:32], y[:32], **fit))
            other_policy["tf_fit_unchanged"] = all(
                np.array_equal(a, b) for a, b in zip(linear_before, linear.get_weights()))
        if TF:  # the same through a TensorFlow checkpoint into a freshly built model
            prefix = tf.train.Checkpoint(model=part, optimizer=part.optimizer).save(os.path.join(d, "tf"))
            restored = new_checkpoint_model()
            restored.optimizer.build(restored.trainable_variables)
            tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
                prefix).assert_existing_objects_matched()
            restored.fit(x, y, epochs=2, **fit)
    opt = resumed.optimizer
    loaded = {"type": type(opt).__name__, "policy": opt.policy.spec, "progress": opt.progress,
              "pending": int(opt._micro_steps.numpy()), "inner": type(opt.inner_optimizer).__name__}
    resumed.fit(x, y, epochs=2, **fit)
    migrated.fit(x, y, epochs=2, **fit)
    emit("checkpoint", saved_progress=saved_progress, loaded=loaded,
         other_policy=other_policy, migrated_record=migrated_record,
         migrated_hash=weights_hash(migrated), old_refused=old_refused,
         full_progress=full.optimizer.progress, resumed_progress=opt.progress,
         full_iterations=int(full.optimizer.iterations.numpy()),
         resumed_iterations=int(opt.iterations.numpy()),
         max_weight_diff=float(np.max(np.abs(weights_vector(full) - weights_vector(resumed)))),
         full_hash=weights_hash(full), resumed_hash=weights_hash(resumed),
         **({"tf_checkpoint_progress": restored.optimizer.progress,
             "tf_checkpoint_hash": weights_hash(restored)} if TF else {}))


def case_nonfinite():
    """A NaN gradient on one rank skips the step on every rank, weights and tau untouched: with
    statistics (adascale) and without (none: the averaged gradient's squared norm decides)."""
    out = {}
    for policy in ("adascale", "none"):
        model = make_model(seed=hvd.rank())
        opt = DistributedOptimizer(keras.optimizers.SGD(LR), policy=policy)
        broadcast_state(model, opt)  # custom loop: the helper builds the optimizer and broadcasts
        start_hash = weights_hash(model)
        rows = []
        for step in range(3):
            x, y = micro_batch(hvd.rank(), step, 0)
            if step == 1 and hvd.rank() == 0:
                x = x * np.nan
            before = weights_vector(model)
            opt.apply(grads_of(model, x, y), model.trainable_variables)
            after = weights_vector(model)
            rows.append({"moved": float(np.max(np.abs(after - before))), "progress": opt.progress,
                         "iterations": int(opt.iterations.numpy()), "sigma2": opt.sigma2})
        out[policy] = {"rows": rows, "skipped": opt.skipped, "start_hash": start_hash,
                       "hash": weights_hash(model), "measured": opt.scaling.measure}
    emit("nonfinite", **out)


def case_loss_scale():
    """DistributedOptimizer(LossScaleOptimizer): statistics unscaled; an overflow skips everywhere."""
    model = make_model()
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=2.0 ** 10)
    opt = DistributedOptimizer(inner, policy="adascale")
    plain = make_model()
    plain_opt = DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale")
    rows = []
    for step in range(4):
        x, y = micro_batch(hvd.rank(), step, 0)
        if step == 2 and hvd.rank() == 1:
            x = x * np.inf
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(LOSS(y, model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        before = weights_vector(model)
        opt.apply(grads, model.trainable_variables)
        moved = float(np.max(np.abs(weights_vector(model) - before)))
        if step != 2:
            plain_opt.apply(grads_of(plain, x, y), plain.trainable_variables)
        rows.append({"moved": moved, "progress": opt.progress, "sigma2": opt.sigma2,
                     "plain_sigma2": plain_opt.sigma2, "loss_scale": float(inner.dynamic_scale.numpy())})
    emit("loss_scale", rows=rows, skipped=opt.skipped,
         max_weight_diff=float(np.max(np.abs(weights_vector(model) - weights_vector(plain)))))


def case_jit():
    """jit_compile=True: a clear error without the callbacks; the callbacks switch XLA off."""
    x, y = dataset(hvd.rank(), 32)
    model = make_model()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR)), loss=LOSS, jit_compile=True)
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        error = None
    except ValueError as e:
        error = str(e)
    model = make_model()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR)), loss=LOSS, jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ScalingMetrics()])
    emit("jit", error=error, jit_after=bool(model.jit_compile), trained=len(history.history["loss"]),
         warned=any("jit_compile" in str(w.message) for w in caught),
         progress=model.optimizer.progress)


def case_hardening():
    """Issue #22, items 1, 4, 5: what the ranks must agree on, bounds on budget and lr, large
    finite gradients (a float32 model: its statistics travel in float32)."""
    rank = hvd.rank()
    out = {"differ_scale": error_of(lambda: DistributedOptimizer(
               keras.optimizers.SGD(LR), policy="linear", scale=[2, 4][rank])),
           "differ_lr": error_of(lambda: DistributedOptimizer(
               keras.optimizers.SGD([LR, 2 * LR][rank]), policy="linear")),
           "budget_zero": error_of(lambda: DistributedOptimizer(
               keras.optimizers.SGD(LR), policy="linear", budget=0))}

    # An lr made negative or nan after construction, eagerly and in a traced step: refused on
    # every rank, nothing applied or counted; the next step runs in step on every rank.
    for mode in ("eager", "function"):
        model = make_model()
        opt = DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale")
        broadcast_state(model, opt)

        def apply(x, y):
            opt.apply(grads_of(model, x, y), model.trainable_variables)

        step_fn = tf.function(apply) if mode == "function" else apply
        rows = []
        for step, lr in enumerate([None, -LR, float("nan"), None]):
            if lr is not None:
                opt.learning_rate = lr
            before = weights_vector(model)
            error = error_of(lambda: step_fn(*micro_batch(rank, step, 0)))
            opt.learning_rate = LR
            rows.append({"error": error, "moved": float(np.max(np.abs(weights_vector(model) - before))),
                         "progress": opt.progress, "steps": opt.steps,
                         "skipped": opt.skipped, "iterations": int(opt.iterations.numpy())})
        out[f"bad_lr_{mode}"] = {"rows": rows, "hash": weights_hash(model)}

    # Finite float32 gradients with |g| ~ 1e21: float32 squares overflow above ~1.8e19.
    large = {}
    for policy in ("adascale", "none"):
        model = make_model(dtypes=("float32", "float32"))
        opt = DistributedOptimizer(keras.optimizers.SGD(1e-23), policy=policy)
        broadcast_state(model, opt)
        x, y = micro_batch(rank, 0, 0)
        grads = [g * 1e21 for g in grads_of(model, x.astype("float32"), y)]
        norm = float(np.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in grads)))
        before = weights_vector(model)
        error = error_of(lambda: opt.apply(grads, model.trainable_variables))
        after = weights_vector(model)
        large[policy] = {"error": error, "grad_norm": norm, "skipped": opt.skipped,
                         "steps": opt.steps, "progress": opt.progress,
                         "moved": float(np.max(np.abs(after - before))),
                         "finite": bool(np.all(np.isfinite(after))), "sigma2": opt.sigma2}
    out["large_gradients"] = large
    out["alive"] = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="hardening.alive"))
    emit("hardening", **out)


def horovod_lr_callback():
    """A converted Horovod script keeping hvd.callbacks.LearningRateWarmupCallback (#32 item 3)."""
    from horovod.tensorflow.keras.callbacks import LearningRateWarmupCallback

    model = make_model()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR), policy="linear"),
                  loss=LOSS, jit_compile=False)
    x, y = dataset(hvd.rank(), 32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[BroadcastInitialState(),
                         LearningRateWarmupCallback(initial_lr=LR * hvd.size(), warmup_epochs=1)])


def adapt_forgotten():
    """A custom loop with adapt='goodput' that never calls adapt_passes(): refused at the step
    after the first decision due."""
    model = make_model()
    opt = DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale", adapt="goodput",
                               max_passes=4, adapt_every=2)
    for step in range(4):
        opt.apply(grads_of(model, *micro_batch(hvd.rank(), step, 0)), model.trainable_variables)


def case_bad_policy():
    errors = {}
    attempts = {
        "bad_option": lambda: DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale:smooth=1"),
        "unknown": lambda: DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascalle"),
        "bad_optimizer": lambda: DistributedOptimizer(keras.optimizers.Adam(), policy="adascale"),
        "keras_accumulation": lambda: DistributedOptimizer(
            keras.optimizers.SGD(LR, gradient_accumulation_steps=2), policy="linear"),
        "adapt": lambda: DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale",
                                              adapt="goodput"),
        "adapt_forgotten": adapt_forgotten,
        "adapt_none": lambda: DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale",
                                                   adapt=None),
        "horizon_previous": lambda: DistributedOptimizer(keras.optimizers.Adam(),
                                                         policy="adascale_adam:horizon=previous"),
        # Ranks that disagree, or one rank with a bad spec: the same error on every rank, no hang.
        "differ": lambda: DistributedOptimizer(keras.optimizers.SGD(LR),
                                               policy=["adascale", "sqrt"][hvd.rank()]),
        "one_bad": lambda: DistributedOptimizer(keras.optimizers.SGD(LR),
                                                policy=["adascale", "sqrt:x=1"][hvd.rank()]),
        "elastic_plain_optimizer": lambda: ElasticState(make_model(), keras.optimizers.SGD(LR)),
        "commit_every_0": lambda: CommitState(None, batches_per_commit=0),
        "horovod_args": lambda: DistributedOptimizer(keras.optimizers.SGD(LR), policy="linear",
                                                     average_aggregated_gradients=True),
        "read_lr": lambda: DistributedOptimizer(keras.optimizers.SGD(LR), policy="linear").lr,
        "horovod_warmup": horovod_lr_callback,
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = None
        except (ValueError, TypeError, AttributeError, RuntimeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    # Every rank is still in step: a collective completes.
    alive = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="check.alive"))
    emit("bad_policy", errors=errors, alive=alive)


def case_uneven():
    """Issue #22, item 7: model.fit on unequal shards (10 batches on rank 0, 7 on rank 1). At
    2be4252 the longer rank failed with 'Horovod has been shut down', or, with a collective
    after fit, the job hung. Now every rank raises one ValueError naming each rank's steps,
    before any step, and the job goes on (a collective after fit completes)."""
    x, y = dataset(hvd.rank(), [160, 112][hvd.rank()])
    model = make_model()
    opt = DistributedOptimizer(keras.optimizers.SGD(LR), policy="adascale")
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    error = error_of(lambda: model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                                     callbacks=[BroadcastInitialState()]))
    alive = float(np.asarray(hvd.allreduce(np.ones(1), op=hvd.Sum, name="uneven.alive"))[0]) \
        if TF else float(hvd.allreduce(__import__("torch").ones(1), op=hvd.Sum, name="uneven.alive"))
    emit("uneven", error=error, steps=opt.steps, alive=alive)


def steps_for_resize(model, opt, start, stop, passes):
    """Steps whose micro-batches are (rank r, step) for r in 0..1, whatever the layout: 2 workers
    x 1 pass, or 1 worker x 2 passes. Returns [gain, sum of the weights] per step."""
    rows = []
    for step in range(start, stop):
        for j in range(passes):
            x, y = micro_batch(hvd.rank() if passes == 1 else j, step, 0)
            opt.apply(grads_of(model, x, y), model.trainable_variables)
        rows.append([opt.gain, float(np.sum(weights_vector(model)))])
    return rows


def resize_optimizer(passes):
    return DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9), policy="adascale",
                                backward_passes_per_step=passes)


def case_save_for_resize():
    """np 2: 8 steps, a tf.train.Checkpoint after 4 (for the np 1 x 2 passes resume)."""
    model, opt = make_model(), resize_optimizer(1)
    steps_for_resize(model, opt, 0, 4, 1)
    saved_progress = opt.progress
    if hvd.rank() == 0:
        tf.train.Checkpoint(model=model, optimizer=opt).write(
            os.path.join(os.environ["HVD_SCALE_TEST_DIR"], "keras_resize"))
    rest = steps_for_resize(model, opt, 4, 8, 1)
    emit("save_for_resize", rest=rest, progress=opt.progress, gain=opt.gain, scale=opt.scale,
         saved_progress=saved_progress)


def case_resume_np1():
    """np 1 x 2 passes (same S = 2) resumes the np 2 checkpoint and continues identically."""
    model, opt = make_model(), resize_optimizer(2)
    opt.build(model.trainable_variables)
    # Partial: the accumulation variables are this job's own, not in a 1-pass checkpoint (the
    # identical continuation below shows that weights, momentum and policy state came back).
    tf.train.Checkpoint(model=model, optimizer=opt).read(
        os.path.join(os.environ["HVD_SCALE_TEST_DIR"], "keras_resize")).expect_partial()
    resumed_progress = opt.progress
    rest = steps_for_resize(model, opt, 4, 8, 2)
    emit("resume_np1", rest=rest, progress=opt.progress, gain=opt.gain, scale=opt.scale,
         resumed_progress=resumed_progress)


CASES = {
    "reference": lambda: (case_reference(1, True), case_reference(2, False)),
    "dtypes": case_dtypes,
    "tiny": case_tiny,
    "policies": case_policies,
    "schedule": case_schedule,
    "fit": case_fit,
    "fit_unbuilt": case_fit_unbuilt,
    "fit_accumulate": case_fit_accumulate,
    "checkpoint": case_checkpoint,
    "timings": case_timings,
    "features": case_features,
    "passes_change": case_passes_change,
    "adapt_goodput": case_adapt_goodput,
    "nonfinite": case_nonfinite,
    "loss_scale": case_loss_scale,
    "jit": case_jit,
    "bad_policy": case_bad_policy,
    "hardening": case_hardening,
    "save_for_resize": case_save_for_resize,
    "resume_np1": case_resume_np1,  # single process, after save_for_resize
    "uneven": case_uneven,  # a job of its own: before the fix it ended the job
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=[c for c in CASES if c not in ("resume_np1", "uneven")])
    args = parser.parse_args()
    hvd.init()
    if TF:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    else:
        import torch
        torch.set_num_threads(1)
    for name in args.cases:
        CASES[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
