"""Elastic Horovod job (Keras adapter): rank 0 rewrites the host file mid-training to resize the job.

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script discover.sh --network-interfaces lo \\
        python elastic_keras_worker.py --hosts-file hosts --resize-at 6 --resize-to 2 --budget 40

Two ways to train, both under ``hvd.elastic.run`` with ``ElasticState``: a custom loop whose step
is one ``tf.function`` traced before the resize (the world size must not stay frozen in it), or
``model.fit`` with the ``CommitState`` and ``ScalingMetrics`` callbacks. Each rank reports every
step it takes (RESULT lines tagged "step") and a final summary, as elastic_worker.py.
"""

import argparse
import itertools
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvd_scale.adapters.keras import (CommitState, DistributedOptimizer, ElasticState, ScalingMetrics,
                                      elastic_run)

TEACHER = np.random.default_rng(7).normal(size=(8, 3))
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

SEQUENCE = itertools.count()


def emit(**values):
    # pid and seq: a worker's rank changes on a resize, its process and its own order do not.
    record = {"rank": hvd.rank(), "pid": os.getpid(), "seq": next(SEQUENCE), **values}
    sys.stdout.write("RESULT " + json.dumps(record) + "\n")
    sys.stdout.flush()


def batch(step, rank, size=16):
    """This rank's batch for an optimizer step: a learnable task, so runs compare on quality."""
    x = np.random.default_rng(1000 * step + rank).normal(size=(size, 8)).astype("float32")
    return x, np.argmax(x @ TEACHER, axis=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hosts-file", required=True)
    p.add_argument("--resize-at", type=int, default=None, help="optimizer step at which to resize")
    p.add_argument("--resize-to", type=int, default=None)
    p.add_argument("--die-on-host", default=None,
                   help="the worker on this host name crashes (os._exit(1)) at --die-at")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--fail-at", type=int, default=None,
                   help="the train step raises a Python error (inside the graph) at this step")
    p.add_argument("--horovod-run", action="store_true",
                   help="use hvd.elastic.run instead of hvd_scale's elastic_run")
    p.add_argument("--fit", action="store_true", help="train with model.fit and callbacks")
    p.add_argument("--step-sleep", type=float, default=0.3,
                   help="seconds per step, so the driver (polling hosts every second) sees the resize mid-run")
    args = p.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    opt = DistributedOptimizer(keras.optimizers.SGD(0.2), policy="adascale", budget=args.budget)
    state = ElasticState(model, opt, resized=False)
    run = hvd.elastic.run if args.horovod_run else elastic_run

    def check_step(step):
        if args.fail_at is not None and step >= args.fail_at:
            raise RuntimeError(f"user error at step {step}")
        return step

    def after_step():
        """Report, resize once (rank 0 rewrites the hosts), slow down: between step and commit."""
        emit(kind="step", step=opt.policy.steps, size=hvd.size(), scale=opt.scale,
             progress=opt.progress, gain=opt.gain)
        if (args.die_on_host and os.environ.get("HOROVOD_HOSTNAME") == args.die_on_host
                and opt.policy.steps >= args.die_at):
            sys.stdout.flush()
            os._exit(1)  # a crash: no goodbye to the others
        if args.resize_at is not None and not state.resized and opt.policy.steps >= args.resize_at:
            state.resized = True  # on every rank, so the flag is committed alike
            if hvd.rank() == 0:
                with open(args.hosts_file + ".tmp", "w") as f:
                    f.write(f"localhost:{args.resize_to}\n")
                os.replace(args.hosts_file + ".tmp", args.hosts_file)
        time.sleep(args.step_sleep)

    if args.fit:
        model.compile(optimizer=opt, loss=LOSS, jit_compile=False)

        class Report(keras.callbacks.Callback):
            def on_train_batch_end(self, batch_index, logs=None):
                after_step()

        # Ranks draw batches by step and rank; a re-entered fit starts its epochs afresh.
        @run
        def train(state):
            while not opt.done():
                x, y = zip(*(batch(opt.policy.steps + i, hvd.rank()) for i in range(50)))
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
                train_step(*batch(opt.policy.steps, hvd.rank()))
                after_step()
                state.commit()  # commits the policy with the weights, and checks for host changes

    train(state)
    x, y = batch(10**6, 0, size=512)  # a fixed held-out batch, the same for every run
    eval_loss = float(LOSS(y, model(x, training=False)))
    emit(kind="final", size=hvd.size(), scale=opt.scale, progress=opt.progress, eval_loss=eval_loss,
         steps=opt.policy.steps, sigma2=opt.sigma2,
         checksum=float(sum(np.sum(v.numpy(), dtype=np.float64) for v in model.variables)))


if __name__ == "__main__":
    main()
