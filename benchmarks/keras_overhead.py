"""B3: step time of the Keras adapter against a plain Horovod loop (TensorFlow backend).

    .venv/bin/python benchmarks/keras_overhead.py      # 3 horovodrun -np 2 jobs per setting, ~16 minutes

#50 (the statistics' cost against k, per-worker and per-pass samples; into results/samples_cost,
the driver recording after each job; ~7 minutes a job on a quiet 2-core machine):

    .venv/bin/python benchmarks/keras_overhead.py --out samples_cost --settings "launcher's" \
        --models mlp,cnn --passes 1,4,16 --steps 20,8,3 --rounds 10,4,3 --warmup 1,0,0 \
        --variants plain,none,adascale,adascale/passes

At k > 1 a step is k calls of the compiled step (one micro-batch each): hvd_scale's optimizer
built with backward_passes_per_step=k accumulates and steps at the k-th; plain's first k - 1
calls add the gradients into variables, the k-th allreduces their mean and applies it. Each
variant's first step runs (and traces) before the warm-up steps and the timing.

Each job (Gloo, one thread per process; with Horovod's defaults or with the environment
`hvd-scale run` gives CPU jobs: a 5 ms cycle) times variants, each a compiled (tf.function)
custom training step, taking turns round by round (ratios to plain paired by round:
benchmarks/timing.py); results/keras_overhead.md holds the median over the jobs. Variants:
    plain     tf.GradientTape, hvd.grouped_allreduce of the gradients, SGD.apply
              (what horovod.tensorflow's DistributedGradientTape does; that class itself fails
              with Keras 3 variables)
    none      hvd_scale DistributedOptimizer(SGD), policy none
    adascale  hvd_scale DistributedOptimizer(SGD), policy adascale (samples "auto": per-worker
              statistics from two workers on)
    adascale/passes  the same with samples="passes" (the per-pass estimator; #50)
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
              update=lambda opt, grads, variables, loss: opt.apply(grads, variables), passes=1):
    """A compiled step of ``kind``; plain's optimizer is ``wrap(SGD)`` and its update ``update``
    (keras_breakdown's peers change both). With passes=k > 1, one call is one pass (micro-batch)
    and the optimizer steps at every k-th; plain then returns ``k_step(x, y)``, a Python function
    of the k calls (the first k - 1 accumulate, the k-th allreduces and applies)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "plain" and passes > 1:
        opt = wrap(keras.optimizers.SGD(0.01, momentum=0.9))
        accs = [tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables]

        @tf.function
        def accumulate(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            for a, g in zip(accs, tape.gradient(loss, model.trainable_variables)):
                a.assign_add(g)
            return loss

        @tf.function
        def last(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = [(a + g) / passes for a, g in zip(accs, tape.gradient(loss, model.trainable_variables))]
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
            update(opt, grads, model.trainable_variables, loss)
            for a in accs:
                a.assign(tf.zeros_like(a))
            return loss

        def k_step(x, y):
            for _ in range(passes - 1):
                accumulate(x, y)
            return last(x, y)
        return k_step
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
    policy, _, samples = kind.partition("/")
    opt = DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), policy=policy,
                               backward_passes_per_step=passes, samples=samples or "auto")

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss
    return step


def run(name, steps, warmup, rounds, batch, kinds=("plain", "none", "adascale"), passes=1):
    build, shape = MODELS[name]
    x = tf.random.stateless_normal((batch, *shape), seed=(hvd.rank(), 0))
    y = tf.random.stateless_uniform((batch,), seed=(hvd.rank(), 1), maxval=10, dtype=tf.int32)
    variants = {}
    for kind in kinds:
        keras.utils.set_random_seed(0)
        step = make_step(kind, build(), passes=passes)
        if kind == "plain" or passes == 1:  # one call: the whole step
            def call(step=step):
                return step(x, y).numpy()
        else:  # k calls, the optimizer steps at the k-th
            def call(step=step):
                for _ in range(passes - 1):
                    step(x, y)
                return step(x, y).numpy()
        call()  # trace outside the timing
        variants[kind] = call
    model0 = build()
    out = {"model": name, "params": sum(int(tf.size(v)) for v in model0.trainable_variables),
           "tensors": len(model0.trainable_variables), "batch": batch, "k": passes}
    times = timing.interleave(variants, rounds, max(1, steps // rounds), warmup)
    return {**out, **timing.summarize(times, kinds[0], also=("none",))}


def job(args) -> int:
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    passes = [int(v) for v in args.passes.split(",")]
    steps, warmup, rounds = (timing.per_k(getattr(args, w), passes, w)
                             for w in ("steps", "warmup", "rounds"))
    for name in args.models.split(","):
        for i, k in enumerate(passes):
            result = run(name, steps[i], warmup[i], min(rounds[i], steps[i]), args.batch,
                         tuple(args.variants.split(",")), k)
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
                              args.steps, "--rounds", args.rounds, "--models", args.models,
                              "--warmup", args.warmup, "--passes", args.passes,
                              "--variants", args.variants], 2, controller="gloo")
    settings = {name: SETTINGS[name] for name in SETTINGS if name.split(" ")[0] in args.settings.split(",")}
    if args.out != "keras_overhead":  # #50's table (timing.record_samples_cost), one setting
        if len(settings) != 1:
            raise SystemExit(f"--out {args.out}: one setting (--settings)")
        (name, env), = settings.items()
        return timing.drive_samples_cost(
            cmd, env, args.repeats, args.out, "keras",
            f".venv/bin/python benchmarks/keras_overhead.py {shlex.join(argv)}  (setting: {name})",
            "plain")
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
    p.add_argument("--steps", default="180", help="measured steps per variant (one, or one per k)")
    p.add_argument("--warmup", default="10", help="untimed steps (one, or one per k)")
    p.add_argument("--rounds", default="30", help="interleaving rounds (one, or one per k)")
    p.add_argument("--passes", default="1", help="k micro-batches per step, comma-separated: each in turn")
    p.add_argument("--variants", default="plain,none,adascale",
                   help="the first the baseline; adascale/passes: samples='passes'")
    p.add_argument("--out", default="keras_overhead",
                   help="the driver: keras_overhead (B3's table) or another name: #50's table "
                        "(timing.record_samples_cost)")
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
