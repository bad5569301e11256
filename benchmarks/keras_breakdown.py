"""Where the Keras adapter's step time goes, in one process (TensorFlow backend, one thread).

    .venv/bin/python benchmarks/keras_breakdown.py       # ~1 minute per model

Compiled steps of benchmarks/keras_overhead.py, taking turns (benchmarks/timing.py: ratios to
plain paired round by round), one process (Horovod's allreduce is then a no-op, so what is left
is the adapter's own graph):
    plain            GradientTape, hvd.grouped_allreduce, SGD.apply
    none             hvd_scale, policy none (finiteness from |g_bar|^2, the host call)
    adascale         hvd_scale, policy adascale (two reads of every gradient, the host call)
    adascale, apply unconditional
                     the same with the conditional apply (a skipped step must leave weights and
                     optimizer slots untouched) traced as a plain apply: a measurement only,
                     never a way to run
The floor (the two reads and the host call alone) is benchmarks/floor.py --keras.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

import hvd_scale.adapters.keras.optimizer as keras_optimizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402
from keras_overhead import MODELS, make_step  # noqa: E402

UNCONDITIONAL = "adascale, apply unconditional"


def traced(kind: str, build, x, y, unconditional: bool = False):
    keras.utils.set_random_seed(0)
    step = make_step(kind, build())
    if unconditional:  # the optimizer module's `ops.cond` runs its true branch, for this trace
        patched = {name: getattr(ops, name) for name in dir(ops) if not name.startswith("__")}
        patched["cond"] = lambda pred, true_fn, false_fn: true_fn()
        keras_optimizer.ops = types.SimpleNamespace(**patched)
    try:
        step(x, y)
    finally:
        keras_optimizer.ops = ops
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
             "| model | plain ms | none | adascale | adascale, apply unconditional (measurement only) |",
             "|---|---|---|---|---|"]
    for name in args.models.split(","):
        build, shape = MODELS[name]
        x = tf.random.stateless_normal((32, *shape), seed=(0, 0))
        y = tf.random.stateless_uniform((32,), seed=(0, 1), maxval=10, dtype=tf.int32)
        variants = {"plain": traced("plain", build, x, y), "none": traced("none", build, x, y),
                    "adascale": traced("adascale", build, x, y),
                    UNCONDITIONAL: traced("adascale", build, x, y, unconditional=True)}
        r = timing.summarize(timing.interleave(variants, args.rounds, 6, warmup=20), "plain")
        cells = [f"{r[k]['ratio_to_plain']:.3f} (+{r['plain']['median_ms'] * (r[k]['ratio_to_plain'] - 1):.2f} ms)"
                 for k in ("none", "adascale", UNCONDITIONAL)]
        lines.append(f"| {name} | {r['plain']['median_ms']:.2f} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- rerun: `.venv/bin/python benchmarks/keras_breakdown.py {shlex.join(sys.argv[1:])}`".rstrip()]
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "keras_breakdown.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
