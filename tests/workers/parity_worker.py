"""Run under horovodrun, once per path: the same AdaScale run through the torch adapter, the Keras
adapter on TensorFlow, or the Keras adapter on torch (``--framework keras-torch``: Keras's torch
backend on horovod.torch), reported per optimizer step for tests/test_parity.py to compare.

Both runs use one model (8 -> 16 tanh -> 3, float64, SGD without momentum), the same initial
weights (numpy, seed 123) and the same micro-batches per (rank, step, pass) (numpy seeds). Every path
computes each micro-batch's mean loss (one convention, not divided by k) and applies the mean of
the k x workers micro-gradients, so weights, sigma2 and mu2 agree too, for k in (1, 2, 4). The Keras side trains with model.fit, one micro-batch per batch.

    horovodrun --gloo -np 2 -H localhost:2 python tests/workers/parity_worker.py --framework keras
"""

import argparse
import os
import sys

import numpy as np

from _report import emit_result

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

LR = 0.05
STEPS = 6
BATCH = 16
PASSES = (1, 2, 4)
# The Adam run: AdamW with adascale_adam's moment horizons in progress, long enough for measured
# gains (statistics start after AdaScaleAdam.MIN_ADAM_HISTORY = 20 steps). eps tiny: torch adds it
# to sqrt(v_hat) and Keras to sqrt(v), so only a negligible eps makes the two updates the same.
ADAM = {"k": 2, "steps": 26, "lr": 0.01, "betas": (0.9, 0.98), "eps": 1e-12, "weight_decay": 0.05}


def initial_weights():
    """torch layout: W1 (16, 8), b1 (16), W2 (3, 16), b2 (3)."""
    rng = np.random.default_rng(123)
    return [rng.normal(0, 0.5, (16, 8)), rng.normal(0, 0.1, 16), rng.normal(0, 0.5, (3, 16)),
            rng.normal(0, 0.1, 3)]


def micro_batch(rank, step, k_pass):
    rng = np.random.default_rng(1000 * step + 10 * rank + k_pass)
    return rng.normal(size=(BATCH, 8)), rng.integers(0, 3, BATCH)


def emit(rank, **values):
    emit_result({"rank": rank, **values})


def run_torch(k, adam=False, samples="auto"):
    import horovod.torch as hvd
    import torch

    from hvd_scale.adapters.torch import DistributedOptimizer, broadcast_state

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    with torch.no_grad():
        for p, w in zip(model.parameters(), initial_weights()):
            p.copy_(torch.from_numpy(w))
    inner = torch.optim.AdamW(model.parameters(), lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"],
                              weight_decay=ADAM["weight_decay"]) if adam else \
        torch.optim.SGD(model.parameters(), lr=LR)
    opt = DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                               policy="adascale_adam" if adam else "adascale",
                               backward_passes_per_step=k, samples=samples)
    if adam:  # as the docs show; a fresh Adam's state after it is a single worker's (no step)
        broadcast_state(model, opt)
    rows = []
    for step in range(ADAM["steps"] if adam else STEPS):
        opt.zero_grad()
        for j in range(k):
            x, y = micro_batch(hvd.rank(), step, j)
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()  # each micro-batch's mean loss, as Keras's fit computes it
        opt.step()
        rows.append({"gain": opt.gain, "progress": opt.progress,
                     "sigma2": opt.sigma2, "mu2": opt.mu2})
    weights = np.concatenate([p.detach().numpy().reshape(-1) for p in model.parameters()])
    return hvd.rank(), opt.scale, rows, weights


def run_keras(k, adam=False, samples="auto"):
    import keras

    from hvd_scale.adapters.keras import DistributedOptimizer, hvd

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
    else:
        import torch
        torch.set_num_threads(1)
    keras.config.set_floatx("float64")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    w1, b1, w2, b2 = initial_weights()
    model.set_weights([w1.T, b1, w2.T, b2])
    inner = keras.optimizers.AdamW(ADAM["lr"], beta_1=ADAM["betas"][0], beta_2=ADAM["betas"][1],
                                   epsilon=ADAM["eps"], weight_decay=ADAM["weight_decay"]) if adam \
        else keras.optimizers.SGD(LR)
    opt = DistributedOptimizer(inner, policy="adascale_adam" if adam else "adascale",
                               backward_passes_per_step=k, samples=samples)
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = [micro_batch(hvd.rank(), step, j) for step in range(ADAM["steps"] if adam else STEPS)
               for j in range(k)]
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    rows = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if opt.steps > len(rows):
                rows.append({"gain": opt.gain, "progress": opt.progress, "sigma2": opt.sigma2,
                             "mu2": opt.mu2})

    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Record()])
    w1, b1, w2, b2 = model.get_weights()
    weights = np.concatenate([w1.T.reshape(-1), b1, w2.T.reshape(-1), b2])
    return hvd.rank(), opt.scale, rows, weights


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["torch", "keras", "keras-torch"], required=True)
    args = parser.parse_args()
    if args.framework != "keras":
        os.environ["KERAS_BACKEND"] = "torch"  # before Keras is imported
    if args.framework == "torch":
        import horovod.torch as hvd
    else:
        from hvd_scale.adapters.keras import hvd
    hvd.init()
    run = run_torch if args.framework == "torch" else run_keras
    for k in PASSES:
        rank, scale, rows, weights = run(k)
        emit(rank, framework=args.framework, k=k, scale=scale, rows=rows, weights=weights.tolist())
    # Every pass read (the default at two workers reads each worker's sum once).
    rank, scale, rows, weights = run(4, samples="passes")
    emit(rank, framework=args.framework, k="4/passes", scale=scale, rows=rows,
         weights=weights.tolist())
    rank, scale, rows, weights = run(ADAM["k"], adam=True)
    emit(rank, framework=args.framework, k="adam", scale=scale, rows=rows, weights=weights.tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
