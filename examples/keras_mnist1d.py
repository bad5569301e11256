"""MNIST-1D with a small 1-D CNN in Keras 3 on Horovod, under an lr scaling policy.

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python examples/keras_mnist1d.py \\
        --policy adascale --batch-size 32 --budget 1500 --lr 0.05

The run lasts ``--budget`` baseline steps (steps of one worker at ``--batch-size``): training
stops once progress tau reaches it, so every policy and every scale gets the same budget in
samples. S = workers x ``--accumulate``. The data is MNIST-1D generated locally (the ``mnist1d``
package; nothing is downloaded); each worker trains on its own shard and tests on the whole test
set. Rank 0 prints one line per epoch; every rank ends with ``RESULT {json}`` (rank, policy,
scale, steps, progress, test_accuracy, mean_gain).
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist1d_data  # noqa: E402

from hvd_scale.adapters.keras import BroadcastInitialState, DistributedOptimizer, ScalingMetrics
from hvd_scale.launch.jobs import print_result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=None,
                   help="policy spec (none, linear, sqrt, warmup, adascale, ...); default "
                        "$HVD_SCALE_POLICY, else adascale")
    p.add_argument("--batch-size", type=int, default=32, help="micro-batch per worker (= baseline batch)")
    p.add_argument("--accumulate", type=int, default=1, help="backward passes per optimizer step")
    p.add_argument("--budget", type=float, default=3000, help="training length in baseline steps")
    p.add_argument("--lr", type=float, default=0.05, help="baseline (S = 1) learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--samples", type=int, default=10_000, help="MNIST-1D samples (80%% train)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("batch_size", "accumulate", "samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.budget > 0 or not args.lr > 0:
        p.error("--budget and --lr must be > 0")
    return args


def load_data(samples, rank, size, batch, accumulate):
    """This worker's training shard (equal length on every worker) and the whole test set."""
    data = mnist1d_data.load(samples)
    x, y = data["x"], data["y"]
    per_worker = len(x) // size // (batch * accumulate) * (batch * accumulate)
    if per_worker == 0:
        raise SystemExit(f"{samples} samples leave no full step of {batch} x {accumulate} per worker")
    shard = slice(rank * per_worker, (rank + 1) * per_worker)
    return (x[shard, :, None], y[shard]), (data["x_test"][:, :, None], data["y_test"])


def make_model(length):
    return keras.Sequential([
        keras.Input((length, 1)),
        keras.layers.Conv1D(32, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv1D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


class Report(keras.callbacks.Callback):
    """The gain of every optimizer step; one line per epoch on rank 0. Stops a diverged run:
    non-finite steps are skipped (tau stands still), so the budget alone would never end it."""

    MAX_SKIPPED = 50

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer, self.gains = optimizer, []

    def on_train_batch_end(self, batch, logs=None):
        opt = self.optimizer
        if opt.steps > len(self.gains):
            self.gains.append(opt.gain)
        if opt.skipped >= self.MAX_SKIPPED:  # the same count on every rank
            if hvd.rank() == 0:
                print(f"stopping: {opt.skipped} steps had non-finite gradients", flush=True)
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:3d}  loss {logs['loss']:.4f}  tau {logs['progress']:8.1f}  "
                  f"gain {logs['gain']:.3f}  lr {logs['lr']:.4f}  noise scale "
                  f"{logs['noise_scale']:.2f}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    hvd.init()
    keras.utils.set_random_seed(args.seed)
    (x, y), (x_test, y_test) = load_data(args.samples, hvd.rank(), hvd.size(), args.batch_size,
                                         args.accumulate)
    model = make_model(x.shape[1])
    # measure=True: the fixed rules log the gain they leave on the table as well.
    # The baseline schedule of the torch example, in baseline steps: x0.1 at 50% and 75%.
    # The adapter evaluates it at floor(tau), so it runs unchanged at every scale.
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(
        [int(0.5 * args.budget), int(0.75 * args.budget)], [args.lr, args.lr / 10, args.lr / 100])
    opt = DistributedOptimizer(keras.optimizers.SGD(schedule, momentum=args.momentum),
                               policy=args.policy, backward_passes_per_step=args.accumulate,
                               budget=args.budget, measure=hvd.size() * args.accumulate > 1)
    model.compile(optimizer=opt, jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if hvd.rank() == 0:
        print(f"{hvd.size()} workers x {args.accumulate} passes x {args.batch_size} samples: "
              f"S = {opt.scale:g}, policy {opt.policy.spec}, budget {args.budget:g} baseline steps, "
              f"{len(x)} training samples per worker", flush=True)
    report = Report(opt)
    model.fit(x, y, batch_size=args.batch_size, epochs=10**6, shuffle=True, verbose=0,
              callbacks=[BroadcastInitialState(), ScalingMetrics(budget=args.budget), report])
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    result = {"rank": hvd.rank(), "policy": opt.policy.spec, "scale": opt.scale,
              "steps": int(opt.iterations.numpy()), "progress": opt.progress,
              "skipped": opt.skipped,
              "test_accuracy": float(accuracy),
              "mean_gain": float(np.mean(report.gains)) if report.gains else 1.0}
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f} after {result['steps']} steps (tau {opt.progress:.1f})",
              flush=True)
    print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
