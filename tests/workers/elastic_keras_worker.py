"""Elastic Horovod job (Keras adapter): rank 0 rewrites the host file mid-training to resize the job.

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script discover.sh --network-interfaces lo \\
        python elastic_keras_worker.py --hosts-file hosts --resize-at 6 --resize-to 2 --budget 40

Two ways to train, both under ``hvd.elastic.run`` with ``ElasticState``: a custom loop whose step
is one ``tf.function`` traced before the resize (the world size must not stay frozen in it), or
``model.fit`` with the ``CommitState`` and ``ScalingMetrics`` callbacks. Each rank reports every
step it takes (RESULT lines tagged "step") and a final summary (see _elastic.py). ``--fit`` runs
on either Keras backend (``KERAS_BACKEND=torch``: horovod.torch); the traced step is TensorFlow's.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

from _elastic import after_step, emit_final, parser
from hvd_scale.adapters.keras import (CommitState, DistributedOptimizer, ElasticState, ScalingMetrics,
                                      elastic_run, hvd)

TF = keras.backend.backend() == "tensorflow"
if TF:
    import tensorflow as tf

TEACHER = np.random.default_rng(7).normal(size=(8, 3))
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batch(step, rank, size=16):
    """This rank's batch for an optimizer step: a learnable task, so runs compare on quality."""
    x = np.random.default_rng(1000 * step + rank).normal(size=(size, 8)).astype("float32")
    return x, np.argmax(x @ TEACHER, axis=1)


def main():
    p = parser("elastic job, Keras adapter")
    p.add_argument("--fail-at", type=int, default=None,
                   help="the train step raises a Python error (inside the graph) at this step")
    p.add_argument("--horovod-run", action="store_true",
                   help="use hvd.elastic.run instead of hvd_scale's elastic_run")
    p.add_argument("--fit", action="store_true", help="train with model.fit and callbacks")
    p.add_argument("--passes-at", type=int, default=None,
                   help="with adapt='goodput': every rank sets 2 passes per step at this step "
                        "(the custom loop)")
    args = p.parse_args()
    hvd.init()
    if TF:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    else:
        import torch
        torch.set_num_threads(1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    adapt = {} if args.passes_at is None else \
        {"adapt": "goodput", "max_passes": 2, "adapt_every": 10_000}  # k changed by hand below
    opt = DistributedOptimizer(keras.optimizers.SGD(0.2), policy="adascale", budget=args.budget,
                               **adapt)
    state = ElasticState(model, opt, resized=False)
    run = hvd.elastic.run if args.horovod_run else elastic_run

    def check_step(step):
        if args.fail_at is not None and step >= args.fail_at:
            raise RuntimeError(f"user error at step {step}")
        return step

    if args.fit:
        model.compile(optimizer=opt, loss=LOSS, jit_compile=False)

        class Report(keras.callbacks.Callback):
            def on_train_batch_end(self, batch_index, logs=None):
                after_step(hvd, args, state, opt)

        # Ranks draw batches by step and rank; a re-entered fit starts its epochs afresh.
        @run
        def train(state):
            while not opt.done():
                x, y = zip(*(batch(opt.steps + i, hvd.rank()) for i in range(50)))
                model.fit(np.concatenate(x), np.concatenate(y), batch_size=16, epochs=1,
                          shuffle=False, verbose=0,
                          callbacks=[ScalingMetrics(), Report(), CommitState(state)])
    else:
        @tf.function(jit_compile=False)
        def train_step(x, y):
            tf.numpy_function(check_step, [opt.iterations], tf.int64)
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        @run
        def train(state):
            while not opt.done():
                x, y = batch(opt.steps, hvd.rank())
                for _ in range(opt.backward_passes_per_step):  # 2 after --passes-at
                    train_step(x, y)
                if args.passes_at is not None:
                    opt.adapt_passes()
                    if opt.steps == args.passes_at:
                        opt.set_passes(2)
                after_step(hvd, args, state, opt)
                state.commit()  # commits the policy with the weights, and checks for host changes

    train(state)
    x, y = batch(10**6, 0, size=512)  # a fixed held-out batch, the same for every run
    eval_loss = float(keras.ops.convert_to_numpy(LOSS(y, model(x, training=False))))
    emit_final(hvd, opt, eval_loss,
               checksum=float(sum(np.sum(keras.ops.convert_to_numpy(v.value), dtype=np.float64)
                                  for v in model.variables)))


if __name__ == "__main__":
    main()
