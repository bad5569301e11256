"""What a framework adapter provides, and what the shared half (``core.Scaling``) owns.

A framework plugs in by implementing ``FrameworkOptimizer`` in one module (``torch.py``;
``keras/optimizer.py``, whose backend-specific collectives are in ``keras/backends.py``).
Everything that is not a tensor operation lives once, in ``core.py``: building the policy and
checking that every rank agrees on it, the measurement default, the statistics layout (with
unscaling), the per-step record and log, following the world size, the read-only values and the
checkpoint state. The math lives in the engine (``hvd_scale``), metric names in
``hvd_scale.metrics``.

One optimizer step, whatever the framework:

    each micro-batch:   its gradients' squared norms added to s_j, c += 1
    once per step:      start_statistics()          local_statistics() = [s..., c], summed over workers
                           mean_sqnorms()             q_j = |g_bar|^2 from the averaged gradient
                           factor = scaling.step([s..., c, q...], base_lr=...)   (host, core.py)
                           apply_step(factor)          inner update with lr x factor, this step only

``tests/test_protocol.py`` runs a toy numpy framework through these hooks and ``core.Scaling``.
"""

from __future__ import annotations

from typing import Any, Protocol


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


class FrameworkOptimizer(Protocol):
    """The four tensor-side hooks of an adapter's optimizer, in the framework's own ops.

    An adapter also wraps the framework's optimizer the way that framework expects (a
    ``torch.optim.Optimizer``, a ``keras.optimizers.Optimizer``) and holds a ``core.Scaling``.
    """

    def local_statistics(self, *framework_args: Any) -> Any:
        """This worker's ``[s_0..s_{G-1}, c]`` for the step: s_j sums the squared norms of each
        micro-batch's own gradient in group j (taken before accumulation and before the
        allreduce), c counts the micro-batches. (torch keeps the sums from its hooks; Keras
        passes them in, as a traced graph's tensors.)"""

    def start_statistics(self) -> Any:
        """Start the reduction of ``[s_0..s_{G-1}, c]`` over workers (``hvd_scale.reduce``'s
        layout), ideally fused with the gradients' allreduce; returns what ``mean_sqnorms``'
        caller waits on."""

    def mean_sqnorms(self) -> Any:
        """q_j = |g_bar|^2 per group, from the averaged gradient the allreduce produced."""

    def apply_step(self, lr_factor: Any) -> Any:
        """Apply the inner optimizer's update with every lr multiplied by ``lr_factor`` for this
        step only; a factor of 0 is a skipped step. The user's lr is left untouched."""
