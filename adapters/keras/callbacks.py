"""Keras callbacks for ``model.fit`` with hvd_scale's optimizer: broadcast the initial state, put
the policy's metrics into ``logs``, stop at the budget and show the progress toward it."""

from __future__ import annotations

import math
import sys
import warnings

import keras

from hvd_scale.adapters.environment import elastic
from hvd_scale.metrics import LOGS_METRICS

from . import backends
from .optimizer import (WRAPPED_IN_LOSS_SCALE, DistributedOptimizer, broadcast_state,
                        wrapped_in_loss_scale)


def prepare_model(model) -> None:
    """Refuse the wrapping that deadlocks; switch XLA off before fit builds its train function."""
    opt = getattr(model, "optimizer", None)
    if wrapped_in_loss_scale(opt):
        raise ValueError(WRAPPED_IN_LOSS_SCALE)
    if isinstance(opt, DistributedOptimizer) and getattr(model, "compiled", False) \
            and model.jit_compile:
        warnings.warn("hvd_scale: Horovod collectives cannot be compiled (XLA, torch.compile); "
                      "setting model.jit_compile = False (compile with jit_compile=False to "
                      "silence this)", stacklevel=3)
        model.jit_compile = False
        model.train_function = None


def check_equal_steps(params: dict) -> None:
    """Every rank's ``fit`` must run as many steps: each step's allreduce needs every rank, and
    a rank with fewer batches ends its ``fit`` (and, exiting, Horovod) while the others still
    step ('Horovod has been shut down', or a hang at the next collective). One allgather of
    (epochs, steps per epoch) at the start of each ``fit``, so every rank raises alike; data of
    unknown length (a ``tf.data`` pipeline after ``filter``: steps None) cannot be checked and
    is refused. Not under elastic, where a joining worker starts its ``fit`` while the others
    train."""
    hvd = backends.current().hvd
    if hvd.size() == 1 or elastic():
        return
    seen = hvd.allgather_object((params.get("epochs"), params.get("steps")),
                                name="hvd_scale.fit_steps")
    if len(set(seen)) > 1:
        by_rank = ", ".join(f"rank {r}: {e} epoch(s) x {s} step(s)" for r, (e, s) in enumerate(seen))
        raise ValueError(f"hvd_scale: model.fit runs unequal numbers of steps on the ranks "
                         f"({by_rank}): every rank must run the same number of batches (equal "
                         "shards: each rank n // workers samples, the remainder dropped; or the "
                         "same steps_per_epoch and epochs on every rank over repeated data)")
    if any(steps is None for _, steps in seen):
        raise ValueError("hvd_scale: model.fit over data of unknown length (steps per epoch "
                         "None: a tf.data pipeline whose cardinality Keras cannot tell, e.g. after "
                         "filter): the ranks cannot be checked to run as many batches, and a rank "
                         "that runs out first ends its fit while the others wait in the "
                         "allreduce. Pass steps_per_epoch (the same on every rank) over data that "
                         "repeats (dataset.repeat())")


class _PreparesModel(keras.callbacks.Callback):
    """Checks the model's wrapping (and switches XLA off) as soon as fit hands it over, and
    that every rank's fit runs as many steps (``check_equal_steps``); with adapt="goodput", lets
    the optimizer choose k after each batch (``adapt_passes``: once per step, whichever of these
    callbacks calls first)."""

    def set_model(self, model):
        super().set_model(model)
        prepare_model(model)

    def on_train_begin(self, logs=None):
        check_equal_steps(self.params)
        opt = getattr(self.model, "optimizer", None)
        spe = getattr(self.model, "steps_per_execution", 1)
        if isinstance(opt, DistributedOptimizer) and opt.scaling.adapt is not None and spe != 1:
            raise ValueError(f"hvd_scale: adapt={opt.scaling.adapt!r} chooses k between steps, and "
                             f"Keras calls back once per execution (steps_per_execution={spe}): "
                             "compile with steps_per_execution=1")

    def on_train_batch_end(self, batch, logs=None):
        opt = getattr(self.model, "optimizer", None)
        if isinstance(opt, DistributedOptimizer) and opt.scaling.adapt is not None:
            opt.adapt_passes()


class BroadcastInitialState(_PreparesModel):
    """Start every rank from root_rank's weights, optimizer variables and policy state.

    Runs once, at the start of the first ``fit``; a model that ``fit`` itself builds (a
    ``Sequential`` without ``keras.Input``: no variables before its first batch) is broadcast
    after its first batch instead, as Horovod's ``BroadcastGlobalVariablesCallback`` does: that
    step's gradients came from each rank's own initial weights (a warning says so on rank 0).
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        # Built only in part (some layers without variables yet), building the optimizer here
        # would bind it to the wrong variables: wait for fit's first step.
        if not self.broadcast_done and getattr(self.model, "built", False) and self.model.variables:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if not self.broadcast_done:
            if backends.current().hvd.rank() == self.root_rank:
                warnings.warn("hvd_scale: the model had no variables before fit (no keras.Input): "
                              "BroadcastInitialState broadcast rank "
                              f"{self.root_rank}'s state after the first batch, whose gradients "
                              "came from each rank's own initial weights (as with Horovod's "
                              "callback); build the model first (keras.Input) to start equal",
                              stacklevel=2)
            self._broadcast()

    def _broadcast(self):
        broadcast_state(self.model, root_rank=self.root_rank)
        self.broadcast_done = True


class ScalingMetrics(_PreparesModel):
    """Put the policy's metrics into ``logs``; stop training once tau reaches a budget.

    Also hands each batch's loss (from Keras's running mean) to the metrics log's ``loss`` column.

    Keys added to the batch and epoch logs (so History, CSVLogger and the progress bar show
    them; list this callback before CSVLogger): ``hvd_scale.metrics.LOGS_METRICS`` (gain, lr,
    lr_factor, progress, scale, sigma2, mu2, noise_scale, efficiency; ``lr`` and ``lr_factor``
    are what the latest step applied). With ``budget`` (baseline steps; default the
    optimizer's), sets ``model.stop_training`` after the batch whose step takes tau to the
    budget: tau is the same on every rank, so every rank stops at the same batch (with
    ``steps_per_execution > 1``, Keras calls back once per execution: at its end).

    ``average_metrics`` (default True): Keras's own epoch metrics (loss, accuracy, val_*: each
    rank's over its shard) become their mean over the ranks at each epoch's end, as Horovod's
    ``MetricAverageCallback`` does, so rank 0's bar and History speak for the job.
    """

    KEYS = LOGS_METRICS

    def __init__(self, budget: float | None = None, batch_logs: bool = True,
                 average_metrics: bool = True):
        super().__init__()
        self.budget = budget
        self.batch_logs = batch_logs
        self.average_metrics = average_metrics

    def _optimizer(self) -> DistributedOptimizer:
        opt = self.model.optimizer
        if not isinstance(opt, DistributedOptimizer):
            raise TypeError(f"ScalingMetrics needs a model compiled with hvd_scale's "
                            f"DistributedOptimizer, got {type(opt).__name__}")
        return opt

    def _values(self) -> dict[str, float]:
        metrics = self._optimizer().metrics()
        return {key: metrics[key] for key in self.KEYS}

    def on_epoch_begin(self, epoch, logs=None):
        self._seen = (0, 0.0)  # (batches, Keras's running mean loss) in this epoch

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        opt = self._optimizer()
        if logs is not None and _number(logs.get("loss")):
            # Keras's batch logs hold the epoch's running mean: the batches since the last call
            # (one, without steps_per_execution) had this mean loss; it goes to the step's row.
            seen, mean = getattr(self, "_seen", (0, 0.0))
            now, running = batch + 1, float(logs["loss"])
            if now > seen:
                opt.log_loss((now * running - seen * mean) / (now - seen))
            self._seen = (now, running)
        if self.batch_logs and logs is not None:
            logs.update(self._values())
        budget = self.budget if self.budget is not None else opt.policy.budget
        if budget is not None and opt.done(budget):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        hvd = backends.current().hvd
        if self.average_metrics and hvd.size() > 1 and not elastic():
            own = {k: float(v) for k, v in logs.items() if k not in self.KEYS and _number(v)}
            seen = hvd.allgather_object(own, name="hvd_scale.epoch_metrics")
            logs.update({k: sum(rank[k] for rank in seen) / len(seen) for k in own
                         if all(k in rank for rank in seen)})
        logs.update(self._values())


def _number(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


class BudgetProgbar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar for a ``fit`` that ``ScalingMetrics`` stops at a budget
    (``epochs=10**6``): pass it among the callbacks and it replaces Keras's own.

    * Each epoch's header reads ``Epoch 5/~12 (tau 1234/3000)``, not ``Epoch 5/1000000``: tau
      and the budget (``budget``, default the optimizer's), and the epochs the budget takes at
      the rate tau grew over the last epoch (an estimate: AdaScale's gain moves the rate). With
      no budget it is Keras's header.
    * It shows the loss, Keras's own metrics and ``keys`` of the policy's (``ScalingMetrics``
      puts them all into the logs; History and CSVLogger keep them all).
    * When stdout is not a terminal (horovodrun's pipes, a log file) it prints one line per
      epoch (Keras's ``verbose=2``): a bar redrawn with carriage returns reaches a pipe as one
      line holding every redraw of the epoch. ``fit(verbose=0)`` silences it.
    """

    def __init__(self, budget: float | None = None, keys=("progress", "gain", "lr")):
        super().__init__()
        self.budget = budget
        self.hidden = set(LOGS_METRICS) - set(keys)
        self._tau = []  # tau at the start of each epoch of this fit

    def set_params(self, params):
        super().set_params(params)
        if self.verbose == 1 and not (hasattr(sys.stdout, "isatty") and sys.stdout.isatty()):
            self.verbose = 2

    def _progress(self) -> tuple[float | None, float | None]:
        """(tau, budget) from the model's optimizer; None where it has none."""
        opt = getattr(self.model, "optimizer", None)
        budget = self.budget if self.budget is not None else \
            getattr(getattr(opt, "policy", None), "budget", None)
        tau = getattr(opt, "progress", None)
        return (None if tau is None else float(tau)), budget

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._tau = []

    def on_epoch_begin(self, epoch, logs=None):
        epochs, self.epochs = self.epochs, 1  # Keras's "Epoch N/epochs" line: ours instead
        try:
            super().on_epoch_begin(epoch, logs)
        finally:
            self.epochs = epochs
        tau, budget = self._progress()
        if not self.verbose or epochs <= 1:
            return
        if tau is None or not budget:
            print(f"Epoch {epoch + 1}/{epochs}", flush=True)
            return
        self._tau.append(tau)
        total = ""
        if len(self._tau) > 1 and self._tau[-1] > self._tau[-2]:
            left = math.ceil(max(budget - tau, 0.0) / (self._tau[-1] - self._tau[-2]))
            total = f"/~{min(max(epoch + left, epoch + 1), epochs)}"
        print(f"Epoch {epoch + 1}{total} (tau {tau:.0f}/{budget:g})", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, self._shown(logs))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, self._shown(logs))

    def _shown(self, logs):
        return None if logs is None else {k: v for k, v in logs.items() if k not in self.hidden}
