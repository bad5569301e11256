"""What a framework adapter provides, and what the shared half (``core.py``) owns.

A framework plugs in by implementing ``FrameworkOptimizer`` in its own module (``torch/``;
``keras/optimizer.py``, whose backend-specific collectives are in ``keras/backends.py``).
Everything that is not a tensor operation lives once, beside this file: ``core.py`` (the
sequence of a step, ``run_step``; ``Scaling``: the set-up, the measurement default, the run's one
record and the engine's pure functions over it (``hvd_scale.run``: the step's plan of lr factor
and Adam's settings, a change of k or S, a restore), the log, checkpoints and broadcasts),
``agreement.py`` (building the policy and checking that every rank agrees on it and on its
record), ``adapt.py`` (the step clock and adapt="goodput"'s choice of k), ``readout.py`` (the
read-only values).
The math lives in the engine (``hvd_scale``), metric names in ``hvd_scale.metrics``, what is read
from the environment in ``environment.py``.

One optimizer step, whatever the framework (``core.run_step``):

    each micro-batch:   c += 1, and (samples="passes") its own gradient's squared norm
                        added to s_j (the framework's business: torch's hooks, Keras's apply)
    the last one:       (samples="workers") |G|^2 / c of this worker's summed gradient G
                        added to s_j instead, read once when it is sent
    once per step:      step, statistics, finite, count = reduced_statistics(step)
                                              [s..., c, w, q...] over workers (or None, and n)
                        plan = on_host(scaling.plan, statistics, finite, user_settings(),
                                       loss_scale(), count)
                        apply_step(plan, step)  the inner update with the plan's lr (and Adam's
                                              betas, eps, decay), for this step only

``step`` is the adapter's own inputs of the step (Keras: its gradients and variables; torch: the
closure and the guard's loss), an argument from hook to hook: nothing is handed from one call to
the next through the optimizer. ``scaling.plan`` replaces the run's one record
(``hvd_scale.run``).

``tests/test_protocol.py`` runs every adapter (a toy numpy framework, torch, Keras on TensorFlow
and on torch) through these hooks.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

# The hooks ``core.run_step`` calls, in its order: what ``tests/test_protocol.py`` checks.
HOOKS = ("reduced_statistics", "user_settings", "loss_scale", "on_host", "apply_step")


class HorovodBinding(Protocol):
    """The collectives ``core.Scaling`` needs: a framework's Horovod module (``horovod.torch``
    and ``horovod.tensorflow`` both qualify as they are)."""

    def size(self) -> int:
        """Workers in the job now (it changes under Horovod elastic)."""

    def rank(self) -> int:
        """This worker's rank; rank 0 writes the metrics log."""

    def allgather_object(self, obj: Any, name: str | None = None) -> list:
        """Every rank's ``obj``, in rank order (used once, to agree on the policy)."""

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
        """``obj`` from ``root_rank`` on every rank (the policy state in ``broadcast_state``)."""


@runtime_checkable
class FrameworkOptimizer(Protocol):
    """The hooks of an adapter's optimizer, in the framework's own ops; one signature each, for
    every adapter. Values may be the framework's tensors (Keras traces them into a graph):
    ``on_host`` is where they become host values.

    An adapter also wraps the framework's optimizer the way that framework expects (a
    ``torch.optim.Optimizer``, a ``keras.optimizers.Optimizer``) and holds a ``core.Scaling``.
    """

    scaling: Any  # core.Scaling

    def reduced_statistics(self, step: Any) -> tuple[Any, Any, Any, Any]:
        """(step, statistics, finite, count) after the gradients' allreduce: ``step`` as the
        next hooks need it (Keras: the mean gradients); statistics is
        ``[s_0..s_{G-1}, c, w, q_0..q_{G-1}]`` (``hvd_scale.reduce.StepRecord.pack``: 2 G + 2
        numbers) summed over workers, s_j the squared norms of the samples read in group j
        (each micro-batch's own gradient, or each worker's sum once), c the micro-batches, w
        the samples, q_j = |g_bar|^2 of the mean gradient; None when nothing is measured,
        and then ``finite`` says whether the averaged gradient is finite and ``count`` is the
        micro-batches counted over workers (None: every worker took k)."""

    def user_settings(self) -> Any:
        """A row of ``core.USER_SETTINGS`` per group: what the user's optimizer holds for this
        step (its lr, Adam's betas and eps, the decoupled decay, the step count t; nan: none)."""

    def loss_scale(self) -> Any:
        """The scale the gradients carry (AMP, LossScaleOptimizer), or None."""

    def on_host(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on the host with host values, its result handed back to the framework
        (torch: a call; Keras: a host call inside the traced step)."""

    def apply_step(self, plan: Any, step: Any) -> Any:
        """The inner optimizer's update with the settings of ``plan`` (a row of ``core.PLAN``
        per group) for this step only, the user's values put back after; a factor of 0 is a
        skipped step (nothing applied). ``step``: what ``reduced_statistics`` handed on."""
