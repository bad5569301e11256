"""examples/horovod_tape_before.py converted to hvd_scale: the policy comes from the launcher.

    hvd-scale run -np 2 --policy adascale -- python examples/horovod_tape_after.py

The conversion guide (docs/converting.md) says what changed and why. The tape is a plain
tf.GradientTape: each rank hands its own gradients to hvd_scale's optimizer, which averages them
itself (measuring each rank's first: AdaScale's variance), so Horovod's DistributedGradientTape,
which would average them first, goes. The epochs become a budget in baseline steps (batches of
--batch-size at S = 1), so every policy gets the same progress.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keras_mnist1d import load_data, make_model  # noqa: E402

from hvd_scale.adapters.keras import DistributedOptimizer, broadcast_state, hvd  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=4000)
    args = p.parse_args()
    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # apart on purpose: the broadcast makes them equal
    (x, y), (x_test, y_test) = load_data(args.samples, hvd.rank(), hvd.size(), args.batch_size, 1)
    model = make_model(x.shape[1])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # The baseline (S = 1) lr: the policy scales it. The budget: the epochs at S = 1.
    budget = args.epochs * (len(x) * hvd.size() // args.batch_size)
    opt = DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9), budget=budget)
    broadcast_state(model, opt)  # before the first step: the model, the optimizer, the policy

    @tf.function
    def training_step(images, labels):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        # This rank's own gradients: the optimizer measures them, then averages them.
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss_value

    while not opt.done():  # until tau reaches the budget
        for start in range(0, len(x), args.batch_size):
            batch = slice(start, start + args.batch_size)
            loss_value = training_step(x[batch], y[batch])
            opt.log_loss(loss_value)  # the step's row of the metrics log (with --log-dir)
            if opt.done():
                break
    test_loss = float(loss(y_test, model(x_test, training=False)))
    checksum = float(sum(np.sum(w, dtype=np.float64) for w in model.get_weights()))
    print(f"rank {hvd.rank()} test loss {test_loss:.6f} weights {checksum:.10f}", flush=True)


if __name__ == "__main__":
    main()
