"""Horovod elastic with Keras 3: the state to commit, restore and sync, a fit callback that
commits, and the run wrapper. Horovod's own ``TensorFlowKerasState`` calls Keras 2 APIs and fails
with Keras 3."""

from __future__ import annotations

import keras
import numpy as np
from horovod.common.elastic import ObjectState

from . import backends
from .optimizer import DistributedOptimizer, broadcast_state, model_and_optimizer_variables


class ElasticState(ObjectState):
    """Horovod elastic state of a Keras 3 model and this optimizer, for ``elastic_run``.

        state = ElasticState(model, opt, epoch=0)   # extra keyword values are committed too
        @elastic_run
        def train(state): ...; state.commit()

    ``commit()`` copies every model variable and every optimizer variable (the inner optimizer's
    slots, ``iterations`` and ``hvd_scale_state``: steps, tau and the gain estimates) to host
    memory; after a failure ``restore()`` puts them back, and after a resize ``sync()``
    broadcasts them from rank 0 (how a joining worker gets tau and the weights). S follows the
    new world size (``hvd_scale.run.relayout``: the optimizer's values read the variable at the
    world size now; a layout that cannot run is refused by the next step), and so does what the
    statistics read (each worker's sum from two workers on, every ``apply`` at one:
    the traced step reads the world size when it runs, ``DistributedOptimizer._reads_passes``).
    """

    def __init__(self, model, optimizer: DistributedOptimizer | None = None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if not isinstance(self.optimizer, DistributedOptimizer):
            raise TypeError(f"ElasticState needs hvd_scale's DistributedOptimizer (given, or "
                            f"compiled into the model), got {type(self.optimizer).__name__}")
        self._variables = model_and_optimizer_variables(model, self.optimizer)
        self._save_variables()
        hvd = backends.current().hvd
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    def _save_variables(self) -> None:
        self._saved_values = [np.array(keras.ops.convert_to_numpy(v.value), copy=True)
                              for v in self._variables]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        for variable, value in zip(self._variables, self._saved_values):
            variable.assign(value)
        super().restore()

    def sync(self):
        broadcast_state(self.model, self.optimizer)
        self._save_variables()
        super().sync()


def elastic_run(func):
    """``hvd.elastic.run`` for the Keras backend in use. With TensorFlow, without Horovod's silent
    failure: its wrapper *returns None* on an ``UnknownError`` that names no Horovod collective
    (e.g. a Python error inside a ``tf.numpy_function``), so training would stop early as if it
    had finished; this one re-raises such errors.

        @elastic_run
        def train(state): ...
    """
    return backends.current().elastic_run(func)


class CommitState(keras.callbacks.Callback):
    """``model.fit`` under ``elastic_run``: commit the ElasticState every ``batches_per_commit``
    batches and at each epoch's end (a commit also checks for added or removed hosts).
    Re-entering ``fit`` after a reset goes on from the committed tau; stop on tau with
    ``ScalingMetrics(budget=...)``."""

    def __init__(self, state: ElasticState, batches_per_commit: int = 1):
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be an integer >= 1, got {batches_per_commit!r}")
        self.state, self.batches_per_commit = state, batches_per_commit
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.batches_per_commit == 0:
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()
