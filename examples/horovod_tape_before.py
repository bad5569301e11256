"""A Horovod TF2 script with a GradientTape loop, as Horovod's own example
(tensorflow2_mnist.py) writes it, on MNIST-1D.

    horovodrun --gloo -np 2 -H localhost:2 python examples/horovod_tape_before.py

The "before" of the conversion guide's tape pair (docs/converting.md); its converted twin is
examples/horovod_tape_after.py. Horovod 0.28.1's DistributedGradientTape predates Keras 3: this
script fails at its first step there (the tape's gradient calls ``Variable.ref()``, which Keras
3's variables lack; tested). It is the script a Horovod user has, not one that runs.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keras_mnist1d import load_data, make_model  # noqa: E402


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
    # Horovod: scale the learning rate by the number of workers.
    opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        # Horovod: the tape averages the gradients over the workers.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Horovod: broadcast the initial variables from rank 0 after the first step.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss_value

    for epoch in range(args.epochs):
        for start in range(0, len(x), args.batch_size):
            batch = slice(start, start + args.batch_size)
            training_step(x[batch], y[batch], epoch == 0 and start == 0)
    test_loss = float(loss(y_test, model(x_test, training=False)))
    checksum = float(sum(np.sum(w, dtype=np.float64) for w in model.get_weights()))
    print(f"rank {hvd.rank()} test loss {test_loss:.6f} weights {checksum:.10f}", flush=True)


if __name__ == "__main__":
    main()
