"""B3: step time of the Keras adapter against a plain Horovod loop (TensorFlow backend).

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python benchmarks/keras_overhead.py

Variants, each a compiled (tf.function) custom training step, interleaved round by round:
    plain     tf.GradientTape, hvd.grouped_allreduce of the gradients, SGD.apply
              (what horovod.tensorflow's DistributedGradientTape does; that class itself fails
              with Keras 3 variables)
    none      hvd_scale DistributedOptimizer(SGD), policy none
    adascale  hvd_scale DistributedOptimizer(SGD), policy adascale
Models (as in benchmarks/torch_overhead.py): a 1-D CNN with ~1M parameters, an MLP with 120
small variables, a 2-D CNN with 1.42M parameters in 10 variables (most in one Dense).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_scale.adapters.keras import DistributedOptimizer  # noqa: E402


def cnn():
    return keras.Sequential([
        keras.Input((40, 1)),
        keras.layers.Conv1D(64, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(128, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(256, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(256, 5, padding="same", activation="relu"),
        keras.layers.MaxPooling1D(5), keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


def mlp():
    layers = [keras.Input((40, 1)), keras.layers.Flatten(), keras.layers.Dense(32, activation="tanh")]
    layers += [keras.layers.Dense(32, activation="tanh") for _ in range(58)]
    layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def cnn2d():
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(128, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(256, 3, padding="same", activation="relu"), keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


MODELS = {"cnn": (cnn, (40, 1)), "mlp": (mlp, (40, 1)), "cnn2d": (cnn2d, (16, 16, 3))}


def make_step(kind, model):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "plain":
        opt = keras.optimizers.SGD(0.01, momentum=0.9)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
            opt.apply(grads, model.trainable_variables)
            return loss
        return step
    opt = DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), policy=kind)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss
    return step


def run(name, steps, warmup, rounds, batch):
    build, shape = MODELS[name]
    variants = {}
    for kind in ("plain", "none", "adascale"):
        keras.utils.set_random_seed(0)
        model = build()
        variants[kind] = (make_step(kind, model), [])
    model0 = build()
    params = sum(int(tf.size(v)) for v in model0.trainable_variables)
    tensors = len(model0.trainable_variables)
    x = tf.random.stateless_normal((batch, *shape), seed=(hvd.rank(), 0))
    y = tf.random.stateless_uniform((batch,), seed=(hvd.rank(), 1), maxval=10, dtype=tf.int32)
    per_round = max(1, (steps + warmup) // rounds)
    for kind, (step, _) in variants.items():
        step(x, y)  # trace outside the timing
    for _ in range(rounds):
        for kind, (step, times) in variants.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                step(x, y).numpy()
                times.append(time.perf_counter() - t0)
    out = {"model": name, "params": params, "tensors": tensors, "batch": batch}
    for kind, (_, times) in variants.items():
        out[kind] = {"median_ms": 1000 * statistics.median(times[warmup:]), "steps": len(times) - warmup}
    for kind in ("none", "adascale"):
        out[kind]["ratio_to_plain"] = out[kind]["median_ms"] / out["plain"]["median_ms"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--models", default="cnn,mlp,cnn2d")
    args = p.parse_args(argv)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for name in args.models.split(","):
        result = run(name, args.steps, args.warmup, args.rounds, args.batch)
        if hvd.rank() == 0:
            print("RESULT " + json.dumps({"rank": 0, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
