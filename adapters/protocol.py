"""What a framework adapter provides, and what the shared half (``core.py``) owns.

A framework plugs in by implementing ``FrameworkOptimizer`` in its own module (``torch/``;
``keras/optimizer.py``, whose backend-specific collectives are in ``keras/backends.py``).
Everything that is not a tensor operation lives once, beside this file: ``core.py`` (the
sequence of a step, ``run_step``; ``Scaling``: the measurement default, the statistics layout
with unscaling, the step's plan of lr factor and Adam's settings, the per-step record and log,
following the world size), ``agreement.py`` (building the policy and checking that every rank
agrees on it and on its state), ``adapt.py`` (the step clock and adapt="goodput"'s choice of k),
``checkpoint.py`` (the policy state in checkpoints and broadcasts), ``readout.py`` (the read-only
values).
The math lives in the engine (``hvd_scale``), metric names in ``hvd_scale.metrics``, what is read
from the environment in ``environment.py``.

One optimizer step, whatever the framework (``core.run_step``):

    each micro-batch:   its own gradient's squared norm added to s_j, c += 1 (the framework's
                        business: torch's hooks, Keras's apply)
    once per step:      statistics, finite = reduced_statistics()    [s..., c, q...] over workers
                        plan = on_host(scaling.plan, statistics, finite, user_settings(), loss_scale())
                        apply_step(plan)      the inner update with the plan's lr (and Adam's
                                              betas, eps, decay), for this step only

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

    def reduced_statistics(self) -> tuple[Any, Any]:
        """(statistics, finite) for the step, after the gradients' allreduce: statistics is
        ``[s_0..s_{G-1}, c, q_0..q_{G-1}]`` (``hvd_scale.reduce``'s step layout) summed over
        workers, s_j the squared norms of each micro-batch's own gradient in group j, c the
        micro-batches, q_j = |g_bar|^2 of the averaged gradient; None when nothing is measured,
        and then ``finite`` says whether the averaged gradient is finite."""

    def user_settings(self) -> Any:
        """A row of ``core.USER_SETTINGS`` per group: what the user's optimizer holds for this
        step (its lr, Adam's betas and eps, the decoupled decay, the step count t; nan: none)."""

    def loss_scale(self) -> Any:
        """The scale the gradients carry (AMP, LossScaleOptimizer), or None."""

    def on_host(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on the host with host values, its result handed back to the framework
        (torch: a call; Keras: a host call inside the traced step)."""

    def apply_step(self, plan: Any, closure: Any = None) -> Any:
        """The inner optimizer's update with the settings of ``plan`` (a row of ``core.PLAN``
        per group) for this step only, the user's values put back after; a factor of 0 is a
        skipped step (nothing applied). ``closure``: torch's, passed to the inner step."""
