"""Where the Keras adapter's step time goes, in one process (TensorFlow backend, one thread).

    .venv/bin/python benchmarks/investigations/keras_breakdown.py       # ~1 minute per model

Compiled steps of benchmarks/keras_overhead.py, taking turns (benchmarks/timing.py: ratios to
plain paired round by round), one process (Horovod's allreduce is then a no-op, so what is left
is the adapter's own graph):
    plain            GradientTape, hvd.grouped_allreduce, SGD.apply
    none             hvd_scale, policy none (finiteness from |g_bar|^2, the host call)
    adascale         hvd_scale, policy adascale (two reads of every gradient, the host call)
    ..., <removal>   the same traced without one part (``REMOVALS``: the conditional apply,
                     which a skipped step needs to leave weights and optimizer slots untouched;
                     the engine's host call; the finiteness read): measurements only, never a
                     way to run
    plain, <peer>    plain with Keras's own ways to skip a step (``PEERS``): what a conditional
                     update costs in Keras without hvd_scale
The floor (the two reads and the host call alone) is benchmarks/investigations/floor.py --keras.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import types

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

import hvd_scale.adapters.keras.optimizer as keras_optimizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import timing  # noqa: E402
from keras_overhead import MODELS, make_step  # noqa: E402

VARIANTS = {"none": ("none", ()), "adascale": ("adascale", ()),
            "adascale, apply unconditional": ("adascale", ("apply unconditional",)),
            "none, apply unconditional": ("none", ("apply unconditional",)),
            "none, no host call": ("none", ("no host call",)),
            "none, no finiteness read": ("none", ("no finiteness read",)),
            "none, all three removed": ("none", ("apply unconditional", "no host call", "no finiteness read"))}


# Measurements only, never a way to run: each removes one part of the adapter's traced step.
REMOVALS = {
    "apply unconditional": "the conditional apply traced as a plain apply",
    "no host call": "the engine's host call replaced by a plan made in the graph from the "
                    "finiteness and the lr (no state written)",
    "no finiteness read": "the averaged gradient's squared norm replaced by a constant",
}


# Plain steps that skip a non-finite step as Keras itself can: the cost of a conditional update
# without hvd_scale (its skip is such a cond: ``apply unconditional`` above removes it).
PEERS = {
    "plain, apply in a cond": "plain's apply inside `ops.cond` on the loss's finiteness",
    "plain, LossScaleOptimizer": "plain's SGD wrapped in Keras's `LossScaleOptimizer` (its "
                                 "finiteness check of the gradients and its cond)",
}


def plain_peer(label: str, build, x, y):
    """keras_overhead's plain step, its update skipped as ``PEERS[label]`` says."""
    keras.utils.set_random_seed(0)
    if label == "plain, LossScaleOptimizer":
        step = make_step("plain", build(), wrap=keras.optimizers.LossScaleOptimizer)
    else:  # "plain, apply in a cond"
        step = make_step("plain", build(), update=lambda opt, grads, variables, loss: ops.cond(
            ops.isfinite(loss), lambda: opt.apply(grads, variables), lambda: None))
    step(x, y)  # traced here
    return lambda: step(x, y).numpy()


def traced(kind: str, build, x, y, removed: tuple = ()):
    """A compiled step of ``kind``, traced with the ``REMOVALS`` named in ``removed``."""
    keras.utils.set_random_seed(0)
    step = make_step(kind, build())
    optimizer = keras_optimizer.DistributedOptimizer
    backend = type(keras_optimizer.backends.current())
    saved = {"on_host": optimizer.on_host, "sum_of_squares": backend.sum_of_squares}
    if "apply unconditional" in removed:  # the optimizer module's `ops.cond` runs its true branch
        patched = {name: getattr(ops, name) for name in dir(ops) if not name.startswith("__")}
        patched["cond"] = lambda pred, true_fn, false_fn: true_fn()
        keras_optimizer.ops = types.SimpleNamespace(**patched)
    if "no host call" in removed:  # a plan still made from the step's finiteness and lr
        def on_host(self, fn, statistics, finite, user_settings, loss_scale):
            factor = ops.reshape(ops.cast(finite, "float64"), (1, 1))
            rest = ops.full((1, len(keras_optimizer.PLAN) - 2), np.nan, "float64")
            return ops.concatenate([factor, user_settings[:, :1] * factor, rest], axis=1)
        optimizer.on_host = on_host
    if "no finiteness read" in removed:
        backend.sum_of_squares = lambda self, tensors: tf.constant(1.0, tf.float64)
    try:
        step(x, y)  # traced here, with the removals
    finally:
        keras_optimizer.ops = ops
        optimizer.on_host, backend.sum_of_squares = saved["on_host"], saved["sum_of_squares"]
    return lambda: step(x, y).numpy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,cnn2d")
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args(argv)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    lines = ["# Where the Keras adapter's step time goes (one process, TensorFlow, one thread)", "",
             f"Compiled steps taking turns in {args.rounds} rounds of 6; ratios to plain paired "
             "round by round (benchmarks/timing.py).", "",
             "Measurements only (never a way to run), each traced without one part: "
             + "; ".join(f"*{k}*: {v}" for k, v in REMOVALS.items()) + ".", "",
             "Keras's own skips, without hvd_scale: "
             + "; ".join(f"*{k}*: {v}" for k, v in PEERS.items()) + ".", "",
             "| model | plain ms | " + " | ".join([*VARIANTS, *PEERS]) + " |",
             "|---|---|" + "---|" * (len(VARIANTS) + len(PEERS))]
    for name in args.models.split(","):
        build, shape = MODELS[name]
        x = tf.random.stateless_normal((32, *shape), seed=(0, 0))
        y = tf.random.stateless_uniform((32,), seed=(0, 1), maxval=10, dtype=tf.int32)
        variants = {"plain": traced("plain", build, x, y)}
        for label, (kind, removed) in VARIANTS.items():
            variants[label] = traced(kind, build, x, y, removed)
        for label in PEERS:
            variants[label] = plain_peer(label, build, x, y)
        r = timing.summarize(timing.interleave(variants, args.rounds, 6, warmup=20), "plain")
        cells = [f"{r[k]['ratio_to_plain']:.3f} (+{r['plain']['median_ms'] * (r[k]['ratio_to_plain'] - 1):.2f} ms)"
                 for k in [*VARIANTS, *PEERS]]
        lines.append(f"| {name} | {r['plain']['median_ms']:.2f} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- rerun: `.venv/bin/python benchmarks/investigations/keras_breakdown.py {shlex.join(sys.argv[1:])}`".rstrip()]
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "keras_breakdown.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
