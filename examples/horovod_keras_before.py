"""A Horovod Keras script as Horovod's own example (tensorflow2_keras_mnist.py) writes it, on
MNIST-1D.

    horovodrun --gloo -np 2 -H localhost:2 python examples/horovod_keras_before.py

The "before" of the conversion guide (docs/converting.md); its converted twin is
examples/horovod_keras_after.py, and the guide shows their diff. Horovod 0.28.1's Keras layer
predates Keras 3: this script fails at fit's first batch there (BroadcastGlobalVariablesCallback
calls ``Variable.ref()``, which Keras 3's variables lack; tested), as its LearningRateWarmupCallback
(left out here) would at the first epoch. It is the script a Horovod user has, not one that runs.
"""

import argparse
import os
import sys

import horovod.tensorflow.keras as hvd
import keras
import numpy as np

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
    # Horovod: scale the learning rate by the number of workers.
    opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              shuffle=False, verbose=0)
    test_loss = model.evaluate(x_test, y_test, verbose=0)[0]
    checksum = float(sum(np.sum(w, dtype=np.float64) for w in model.get_weights()))
    print(f"rank {hvd.rank()} test loss {test_loss:.6f} weights {checksum:.10f}", flush=True)


if __name__ == "__main__":
    main()
