"""The floor under the statistics' cost: reading each gradient twice, against a training step.

    .venv/bin/python benchmarks/investigations/floor.py        # ~1 min, one process, no Horovod

AdaScale needs |g|^2 of every micro-gradient and |g_bar|^2 of the averaged one: at the least,
each gradient is read twice (two fused ``_foreach_norm`` kernels over the model's gradients). For
each model of benchmarks/torch_overhead.py this times, in one process, a plain training step
(zero_grad, forward, backward, SGD momentum) and those two reads, and reports
floor = 1 + (two reads) / (plain step): the adascale / plain ratio no implementation can beat
on this machine. Under Horovod the plain step is longer (the allreduce), so the floor there is
lower still. Also timed: the same reads as one norm kernel per tensor (a hook per parameter).

    .venv/bin/python benchmarks/investigations/floor.py --keras    # the same for Keras on TensorFlow

With --keras, for each model of benchmarks/keras_overhead.py, three compiled steps take turns
(benchmarks/timing.py): the plain step (GradientTape, SGD.apply); the same with the two reads as
the adapter takes them (its backend's ``sum_of_squares``: one fused kernel per tensor, in the
graph); and the same with the engine's host round trip added where the adapter has it, between
the reads and the update (a ``tf.numpy_function`` returning a factor of 1 that the lr is set
from, so the update waits for it). TensorFlow runs each graph op through its executor, so the reads cost per
tensor, not per byte, on many-tensor models.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_overhead import MODELS  # noqa: E402

from hvd_scale.launch.jobs import print_result  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[repeats // 5:])


def run(name: str, batch: int, repeats: int) -> dict:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step_ms = median_ms(step, repeats)
    grads = [p.grad for p in model.parameters()]
    fused_ms = median_ms(lambda: torch.stack(torch._foreach_norm(grads)).square().sum().item(), repeats)
    per_tensor_ms = median_ms(
        lambda: torch.stack([torch.linalg.vector_norm(g) for g in grads]).square().sum().item(), repeats)
    return {"model": name, "tensors": len(grads), "params": sum(g.numel() for g in grads),
            "step_ms": step_ms, "read_fused_ms": fused_ms, "read_per_tensor_ms": per_tensor_ms,
            "floor": 1 + 2 * fused_ms / step_ms}


def run_keras(name: str, batch: int, rounds: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf
    import timing
    from keras_overhead import MODELS as KERAS_MODELS

    from hvd_scale.adapters.keras import backends

    build, shape = KERAS_MODELS[name]
    sum_of_squares = backends.current().sum_of_squares
    x = tf.random.stateless_normal((batch, *shape), seed=(0, 0))
    y = tf.random.stateless_uniform((batch,), seed=(0, 1), maxval=10, dtype=tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make(reads: bool, host: bool):
        keras.utils.set_random_seed(0)
        model, opt = build(), keras.optimizers.SGD(0.01, momentum=0.9)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            out = [loss]
            if reads:  # the micro-gradients' read, and one of as many tensors (the variables,
                # standing for the averaged gradient: a second read of `grads` would be merged)
                out.append(sum_of_squares(grads))
                out.append(sum_of_squares([v.value for v in model.trainable_variables]))
            if host:  # the engine turns them into the step's lr: the update waits for the host
                factor = tf.numpy_function(lambda a: np.float64(1.0), [tf.stack(out[1:])],
                                           tf.float64, stateful=True)
                opt.learning_rate.assign(0.01 * tf.cast(tf.reshape(factor, ()), opt.learning_rate.dtype))
            opt.apply(grads, model.trainable_variables)
            return out
        step()
        return lambda: [t.numpy() for t in step()]

    variants = {"plain": make(False, False), "reads": make(True, False),
                "reads + host call": make(True, True)}
    r = timing.summarize(timing.interleave(variants, rounds, 6, warmup=20), "plain")
    model = build()
    return {"model": name, "tensors": len(model.trainable_variables),
            "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
            "step_ms": r["plain"]["median_ms"], "floor": r["reads"]["ratio_to_plain"],
            "floor_with_host_call": r["reads + host call"]["ratio_to_plain"],
            # what they add, in ms: the same cost against a Horovod step gives that job's floor
            "reads_ms": r["plain"]["median_ms"] * (r["reads"]["ratio_to_plain"] - 1),
            "reads_and_host_call_ms": r["plain"]["median_ms"] * (r["reads + host call"]["ratio_to_plain"] - 1)}


def main_keras(args) -> list[str]:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    lines = ["## Keras 3 on TensorFlow (compiled steps, ratios paired round by round)", "",
             "| model | tensors | parameters | plain step ms | floor (two reads) | + ms | "
             "with the host call | + ms |", "|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        r = run_keras(name, args.batch, args.repeats // 6)
        print_result(r)
        lines.append(f"| {name} | {r['tensors']} | {r['params']:,} | {r['step_ms']:.2f} | "
                     f"{r['floor']:.3f} | {r['reads_ms']:.3f} | {r['floor_with_host_call']:.3f} | "
                     f"{r['reads_and_host_call_ms']:.3f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp,cnn2d,transformer")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--keras", action="store_true", help="Keras 3 on TensorFlow (models cnn,mlp,cnn2d)")
    args = p.parse_args(argv)
    if args.keras:
        if args.models == p.get_default("models"):
            args.models = "cnn,mlp,cnn2d"
        args.repeats = max(args.repeats, 360)
        lines = main_keras(args)
    else:
        torch.set_num_threads(1)
        lines = ["## torch (one process, no Horovod)", "",
                 "| model | tensors | parameters | plain step ms | one fused read of every gradient "
                 "ms | the same, a kernel per tensor ms | floor |", "|---|---|---|---|---|---|---|"]
        for name in args.models.split(","):
            r = run(name, args.batch, args.repeats)
            print_result(r)
            lines.append(f"| {name} | {r['tensors']} | {r['params']:,} | {r['step_ms']:.2f} | "
                         f"{r['read_fused_ms']:.3f} | {r['read_per_tensor_ms']:.3f} | {r['floor']:.3f} |")
    lines = ["# The floor under the statistics' cost (one process, one thread)", "", *lines, "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- rerun: `.venv/bin/python benchmarks/investigations/floor.py {shlex.join(sys.argv[1:])}`".rstrip()]
    out = pathlib.Path(__file__).resolve().parent.parent / "results" / f"floor{'_keras' if args.keras else ''}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
