"""Keras 3 adapter (TensorFlow or torch backend): Horovod gradient averaging plus a learning-rate
policy. With ``KERAS_BACKEND=tensorflow`` it runs on ``horovod.tensorflow``, with
``KERAS_BACKEND=torch`` on ``horovod.torch``; JAX is refused (Horovod has no JAX binding).

    import keras
    from hvd_scale.adapters.keras import BroadcastInitialState, DistributedOptimizer, ScalingMetrics, hvd

    hvd.init()                                        # the backend's Horovod module
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), policy="adascale")
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x_shard, y_shard, epochs=1000,
              callbacks=[BroadcastInitialState(), ScalingMetrics(budget=5000), keras.callbacks.CSVLogger(f),
                         BudgetProgbar()])       # 'Epoch 5/~12 (tau 1234/5000)'

Custom training loops work the same way (under TensorFlow eagerly or inside ``tf.function``):

    broadcast_state(model, opt)                       # after the model is built
    while not opt.done(budget):                       # budget in baseline (S = 1) steps
        grads = ...                                   # the backend's own gradient of the loss
        opt.apply(grads, model.trainable_variables)   # or opt.apply_gradients(zip(grads, vars))

Horovod elastic (``horovodrun --min-np ... --host-discovery-script ...``):

    state = ElasticState(model, opt)                  # commits weights, optimizer and policy state
    @elastic_run                                      # hvd.elastic.run, minus a silent failure
    def train(state):
        while not opt.done():
            model.fit(x, y, epochs=1, callbacks=[ScalingMetrics(), CommitState(state)])
    train(state)

Modules: ``optimizer.py`` (the optimizer, in keras.ops), ``backends.py`` (what differs between
TensorFlow and torch), ``callbacks.py`` (fit callbacks), ``elastic.py`` (Horovod elastic).

Conventions and limits:

* One parameter group: all trainable variables share one lr in Keras, so the engine sees one
  group (its statistics are sums over every variable).
* ``backward_passes_per_step=k``: k calls to ``apply`` (k batches of ``fit``) make one optimizer
  step; the inner optimizer receives the *mean* of the k micro-gradients (Keras's own
  ``gradient_accumulation_steps`` convention) averaged over workers. n = workers x k, S = n by
  default. Every worker must make the same number of ``apply`` calls (equal shard sizes; the
  callbacks check that every rank's ``fit`` runs as many steps: ``check_equal_steps``).
  ``adapt="goodput"`` makes k a variable the traced step reads, chosen between steps
  (``adapt_passes``: the callbacks call it under ``fit``).
* A step whose averaged gradient or statistics are not finite is skipped on every rank: weights,
  inner optimizer state, statistics and tau stay (``opt.skipped`` counts it);
  ``nonfinite="raise"`` raises instead. With a ``LossScaleOptimizer`` inside, that optimizer
  still sees the step so it can lower its scale.
* Mixed precision: ``mixed_bfloat16`` as it is; ``mixed_float16``: wrap as
  ``DistributedOptimizer(LossScaleOptimizer(inner))`` and compile with ``auto_scale_loss=False``
  (Keras would otherwise wrap *this* optimizer in a LossScaleOptimizer, which decides to skip per
  rank, before the allreduce, and deadlocks the job: refused). Statistics are unscaled (squared
  norms by the loss scale squared).
* ``steps_per_execution > 1`` (TensorFlow backend) takes the same steps; data of unknown length
  (``tf.data`` after ``filter``) is refused by the callbacks: repeat it, give ``steps_per_epoch``.
* XLA: Horovod's TensorFlow ops have no XLA kernels in this build, so ``jit_compile=True`` cannot
  work. ``apply`` raises a ValueError when traced under XLA; the callbacks switch
  ``model.jit_compile`` off (with a warning) before ``fit`` builds its train function.
* No ``tf.distribute`` strategy (Horovod is the distribution).
* Policy properties (``gain``, ``progress``, ...) are host values: read them eagerly, not inside
  a ``tf.function``.
"""

from . import backends
from .callbacks import BroadcastInitialState, BudgetProgbar, ScalingMetrics
from .elastic import CommitState, ElasticState, elastic_run
from .optimizer import DistributedOptimizer, broadcast_state

hvd = backends.current().hvd  # horovod.tensorflow or horovod.torch, as the Keras backend needs

__all__ = ["BroadcastInitialState", "BudgetProgbar", "CommitState", "DistributedOptimizer", "ElasticState",
           "ScalingMetrics", "broadcast_state", "elastic_run", "hvd"]
