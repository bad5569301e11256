"""B3: step time of the Keras adapter against a plain Horovod loop (TensorFlow backend).

    .venv/bin/python benchmarks/keras_overhead.py      # 3 horovodrun -np 2 jobs per setting, ~16 minutes

Each job (Gloo, one thread per process; with Horovod's defaults or with the environment
`hvd-scale run` gives CPU jobs: a 5 ms cycle) times variants, each a compiled (tf.function)
custom training step, taking turns round by round (ratios to plain paired by round:
benchmarks/timing.py); results/keras_overhead.md holds the median over the jobs. Variants:
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
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_scale.adapters.keras import DistributedOptimizer  # noqa: E402
from hvd_scale.launch.jobs import (CPU_ENV_DEFAULTS, horovodrun_command, print_result,  # noqa: E402
                                   read_results)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402


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


def make_step(kind, model, wrap=lambda opt: opt,
              update=lambda opt, grads, variables, loss: opt.apply(grads, variables)):
    """A compiled step of ``kind``; plain's optimizer is ``wrap(SGD)`` and its update ``update``
    (keras_breakdown's peers change both)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "plain":
        opt = wrap(keras.optimizers.SGD(0.01, momentum=0.9))

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
            update(opt, grads, model.trainable_variables, loss)
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
    x = tf.random.stateless_normal((batch, *shape), seed=(hvd.rank(), 0))
    y = tf.random.stateless_uniform((batch,), seed=(hvd.rank(), 1), maxval=10, dtype=tf.int32)
    variants = {}
    for kind in ("plain", "none", "adascale"):
        keras.utils.set_random_seed(0)
        step = make_step(kind, build())
        step(x, y)  # trace outside the timing
        variants[kind] = (lambda step=step: step(x, y).numpy())
    model0 = build()
    out = {"model": name, "params": sum(int(tf.size(v)) for v in model0.trainable_variables),
           "tensors": len(model0.trainable_variables), "batch": batch}
    times = timing.interleave(variants, rounds, max(1, steps // rounds), warmup)
    return {**out, **timing.summarize(times, "plain")}


def job(args) -> int:
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for name in args.models.split(","):
        result = run(name, args.steps, args.warmup, args.rounds, args.batch)
        if hvd.rank() == 0:
            print_result({"rank": 0, **result})
    return 0


# Horovod's own defaults (1 ms cycle) and what `hvd-scale run` sets for CPU jobs (5 ms, one thread).
SETTINGS = {"launcher's (5 ms cycle)": CPU_ENV_DEFAULTS, "Horovod's defaults (1 ms cycle)": {}}


def drive(args, argv) -> int:
    """`--repeats` horovodrun jobs of this script per setting, the settings taking turns; the
    median of their paired ratios, written to results/keras_overhead.md and .json."""
    python = pathlib.Path(sys.executable).parent / "python"
    cmd = horovodrun_command([python, "benchmarks/keras_overhead.py", "--job", "--steps",
                              args.steps, "--rounds", args.rounds, "--models", args.models],
                             2, controller="gloo")
    settings = {name: SETTINGS[name] for name in SETTINGS if name.split(" ")[0] in args.settings.split(",")}
    runs_of: dict = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, env in settings.items():
            runs_of[name].append({r["model"]: r for r in read_results(timing.run_job(cmd, env))})
            print(name, {m: round(r["adascale"]["ratio_to_plain"], 3) for m, r in runs_of[name][-1].items()},
                  flush=True)
    lines = ["# B3: step-time overhead (Keras 3 adapter, TensorFlow backend, np 2, Gloo, one thread "
             "per process)", "",
             f"Compiled (tf.function) custom training steps taking turns in {args.rounds} rounds inside "
             f"each job ({args.steps} measured steps per variant); ratios to plain paired round by round "
             f"(benchmarks/timing.py); median over {args.repeats} jobs, each job's value in brackets.",
             "`plain` is tf.GradientTape + hvd.grouped_allreduce + SGD.apply (what "
             "DistributedGradientTape does; that class fails with Keras 3 variables).", "",
             "| setting | model | parameters (tensors) | plain ms | none / plain | adascale / plain |",
             "|---|---|---|---|---|---|"]
    for name, runs in runs_of.items():
        for m in args.models.split(","):
            rs = [r[m] for r in runs]
            cells = []
            for kind in ("none", "adascale"):
                vals = [r[kind]["ratio_to_plain"] for r in rs]
                cells.append(f"{statistics.median(vals):.3f} [{', '.join(f'{v:.3f}' for v in vals)}]")
            plain = statistics.median(r["plain"]["median_ms"] for r in rs)
            lines.append(f"| {name} | {m} | {rs[0]['params']:,} ({rs[0]['tensors']}) | {plain:.1f} | "
                         f"{cells[0]} | {cells[1]} |")
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- machine: {os.cpu_count()} CPUs, {platform.machine()}",
              f"- rerun: `.venv/bin/python benchmarks/keras_overhead.py {shlex.join(argv)}`".rstrip()]
    results = timing.ROOT / "benchmarks" / "results"
    (results / "keras_overhead.md").write_text("\n".join(lines) + "\n")
    (results / "keras_overhead.json").write_text(json.dumps(runs_of, indent=1) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=180, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--models", default="cnn,mlp,cnn2d")
    p.add_argument("--repeats", type=int, default=3, help="jobs per setting (the driver)")
    p.add_argument("--settings", default="launcher's,Horovod's",
                   help="comma-separated, of: launcher's, Horovod's (the driver)")
    p.add_argument("--job", action="store_true", help="one job's worker (under horovodrun)")
    args = p.parse_args(argv)
    return job(args) if args.job else drive(args, argv)


if __name__ == "__main__":
    sys.exit(main())
