"""examples/horovod_keras_before.py converted to hvd_scale: the policy comes from the launcher.

    hvd-scale run -np 2 --policy adascale -- python examples/horovod_keras_after.py

The conversion guide (docs/converting.md) shows the diff against the "before". The budget is
the same training counted in baseline steps (batches of --batch-size at S = 1): fit's epochs
become a budget at which ScalingMetrics stops, so every policy gets the same progress.
"""

import argparse
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keras_mnist1d import load_data, make_model  # noqa: E402

from hvd_scale.adapters.keras import (BroadcastInitialState, DistributedOptimizer,  # noqa: E402
                                      ScalingMetrics, hvd)


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
    # The baseline (S = 1) lr: the policy scales it. The budget: the epochs at S = 1.
    budget = args.epochs * (len(x) * hvd.size() // args.batch_size)
    opt = keras.optimizers.SGD(args.lr, momentum=0.9)
    opt = DistributedOptimizer(opt, budget=budget)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    callbacks = [BroadcastInitialState(), ScalingMetrics()]  # ScalingMetrics: stop at the budget
    model.fit(x, y, batch_size=args.batch_size, epochs=10**6, callbacks=callbacks,
              shuffle=False, verbose=0)
    test_loss = model.evaluate(x_test, y_test, verbose=0)[0]
    checksum = float(sum(np.sum(w, dtype=np.float64) for w in model.get_weights()))
    print(f"rank {hvd.rank()} test loss {test_loss:.6f} weights {checksum:.10f}", flush=True)


if __name__ == "__main__":
    main()
