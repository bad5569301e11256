"""What a torch engine provides: the contract between the torch optimizer (``optimizer.py``) and
whatever averages the gradients (``horovod.py``: Horovod; ``ddp.py``: DistributedDataParallel;
``fsdp.py``: FSDP2). The optimizer is built from parts, none of which inherits another:

    DistributedOptimizer = the inner torch optimizer   (its param_groups and state, shared)
                         + an Engine                    (this Protocol: the collectives, the hooks)
                         + a StepStatistics             (``statistics.py``: the step's norms and
                                                         counts, explicit state, a StepRecord out)
                         + a core.Scaling               (the policy, the run's record, the log)

A step, whatever the engine (``core.run_step`` drives it through the optimizer):

    backward passes   the engine's hooks (its buckets, its comm hook, its reduce-scatter) hand each
                      worker's local gradients to ``statistics.keep_norms(params, norms)`` before
                      they are reduced; or the statistics' own tensor hooks take each pass's
                      (``statistics.hook_parameters("norms" | "count" | None, few)``, the engine's
                      choice, made in ``attach``)
    the last one      ``handle = statistics.start()``: [s..., c, w] (``hvd_scale.reduce``'s
                      StepRecord on the wire) go out through ``allreduce_async``, beside the
                      gradients' own traffic; a sharded engine starts it only once its gradients
                      are reduced, and the vector then carries this rank's q too
    gather()          this step's gradients and statistics are in: the engine finishes its
                      reduction and calls ``statistics.finish(handle, counting)``, which waits
                      (``wait_sum``), makes p.grad the mean micro-gradient (by ``averaged`` and
                      the count) and keeps the step's record, with |g_bar|^2 per group from
                      ``mean_sqnorms``
    inner_step()      the inner optimizer's update, with the plan's lr set on the groups

An engine is constructed by its own public ``DistributedOptimizer`` class (a thin constructor:
the engine's arguments are its own), which hands it to ``optimizer.TorchOptimizer`` with the inner
optimizer and the ``core.Scaling`` (whose collectives, ``protocol.HorovodBinding``, are also the
engine's: its process group or set). Adding an engine: a module with a class meeting ``Engine``,
a thin ``DistributedOptimizer(TorchOptimizer)`` whose ``__init__`` builds it, and one line in
``ENGINES`` of ``tests/test_engine_contract.py`` (the names and signatures checked, the
collectives run in a 2-process job).

Sharded gradients (FSDP2): each rank's p.grad holds its shard of the reduced gradient, so no rank
can read |g_bar|^2 alone. ``sharded = True`` says so: ``mean_sqnorms`` then returns this rank's
shards' squared norms, which the statistics' one allreduce sums over ranks (with HSDP, where
replicas hold the same shard, the engine divides by the replicate degree so that the sum over
the whole group is |g_bar|^2 once). A replicated engine (Horovod, DDP) returns the whole
|g_bar|^2 on every rank, and it never crosses the wire.
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol, runtime_checkable

import torch

# The contract's names, in the order of a step: what tests/test_engine_contract.py checks.
ATTRIBUTES = ("name", "sharded", "averaged", "stats_dtype")
METHODS = ("attach", "allreduce_async", "wait_sum", "drop", "average", "gather", "synchronize",
           "skip_synchronize", "inner_step", "in_step", "passes", "follow_passes", "mean_sqnorms",
           "close")


@runtime_checkable
class Engine(Protocol):
    """What a torch engine provides to the optimizer and its statistics. One instance per
    ``DistributedOptimizer``, for its life; every method is called on every rank in the same
    order (collectives inside them must be too).

    Attributes (fixed when the engine is built):
        name: the engine's name in run.json, the metrics log and ``repr`` ("horovod", "ddp",
            "fsdp").
        sharded: True where each rank's p.grad holds only its shard of the reduced gradient
            (FSDP2): |g_bar|^2 is then summed over ranks in the statistics' allreduce (above).
        averaged: True where the reduced gradient left in p.grad is the mean over workers of
            each worker's sum of its passes (Horovod's op=Average, DDP, FSDP2's default); False
            where it is their sum (Horovod's op=Sum). The statistics make p.grad the mean
            micro-gradient from it: times W / n (averaged) or 1 / n (summed).
        stats_dtype: the dtype the statistics travel in: the gradients' where the engine fuses
            the statistics with them (Horovod fuses one dtype), float64 where their allreduce is
            its own (DDP, FSDP2). In float32 each sum travels three times
            (``hvd_scale.reduce``'s wire: no overflow, no lost digits).
    """

    name: str
    sharded: bool
    averaged: bool
    stats_dtype: torch.dtype

    def attach(self, statistics: Any) -> None:
        """Called once by the optimizer, after building the ``statistics.StepStatistics`` (which
        holds this engine): install the engine's hooks (its buckets' sends, its comm hook, its
        reduce-scatter) feeding ``statistics``; say how the norms are read
        (``statistics.configure(bucketed=..., switching=..., send_at_last_gradient=...)``: in
        the engine's own hooks, each worker's sum once, or by the statistics' tensor hooks per
        pass) and choose those tensor hooks (``statistics.hook_parameters(kind, few)``). A
        refusal here removes what it installed."""

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Any:
        """Start the statistics' allreduce of ``tensor`` (1-D, ``stats_dtype``) over the
        engine's workers, summed (or averaged: ``wait_sum`` undoes it), asynchronously where
        the engine can, so that it overlaps the gradients' traffic. Returns a handle for
        ``wait_sum`` or ``drop``. ``name``: Horovod's tensor name (others may ignore it)."""

    def wait_sum(self, handle: Any) -> torch.Tensor:
        """The sum over workers of ``allreduce_async``'s tensor, as float64 (an average is
        multiplied back by the world size)."""

    def drop(self, handle: Any) -> None:
        """Finish a statistics allreduce in flight and discard it (a skipped step, a load): the
        collective still completes on every rank. ``None``: nothing."""

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean over workers of ``tensor``, blocking (the lr guard's sharpness, once in many
        steps)."""

    def gather(self) -> None:
        """Called by ``step()``: this step's gradients and statistics are in (the engine's
        ``synchronize`` unless the user called it this step, or skips it)."""

    def synchronize(self) -> None:
        """The user's ``opt.synchronize()`` (Horovod's loops call it before clipping or
        ``scaler.unscale_``): finish the gradients' reduction and ``statistics.finish``; after
        it p.grad holds the mean micro-gradient (the whole, or this rank's shard). Where the
        engine has done this already in backward (DDP), it has nothing left to do."""

    def skip_synchronize(self) -> ContextManager:
        """``with opt.skip_synchronize(): opt.step()`` after ``opt.synchronize()``: ``step()``
        does not synchronize again (a context manager; one that does nothing where the engine
        never synchronizes twice)."""

    def inner_step(self, closure: Any) -> Any:
        """The inner optimizer's step (the plan's lr already on the groups), returning its
        result: through the engine where it wraps the step (Horovod), else ``inner.step``."""

    def in_step(self) -> bool:
        """Whether a step is under way in the engine (gradients sent, not yet stepped): k, the
        run's record and the weights must not change then (``set_passes``, loads, broadcasts
        raise RuntimeError)."""

    def passes(self) -> int | None:
        """The backward passes this worker took this step, where the engine counts them itself
        (Horovod's accumulation counters); None where it does not, and the statistics' tensor
        hooks count them."""

    def follow_passes(self, passes: int) -> None:
        """Take k = ``passes`` per step from the next step on (``set_passes``, a load, a
        broadcast, adapt="goodput"): the engine's accumulation and the statistics' hooks follow.
        Where the engine cannot take k, raise ValueError before anything changes; the run's
        record is the optimizer's (``Scaling.set_passes``), changed only after this accepted."""

    def mean_sqnorms(self, count: torch.Tensor | None) -> torch.Tensor:
        """|g_bar|^2 per parameter group, float64, on the statistics' device.

        Replicated (``sharded`` False): called by ``statistics.finish`` after the statistics'
        allreduce, once p.grad holds the mean micro-gradient; ``count`` is n over workers (a
        device tensor) for an engine that measured the reduced gradient before it became that
        mean (DDP's buckets, in the allreduce's callbacks: scaled by (W / n)^2); an engine that
        reads p.grad now returns ``statistics.mean_sqnorms()`` (Horovod). The whole |g_bar|^2,
        on every rank; it never crosses the wire.

        Sharded: called by ``statistics.start()`` with ``count=None``, before n is known: this
        rank's share of the squared norms of the reduced gradient as p.grad holds it then (the
        mean over workers of each worker's sum, or their sum), which the statistics' allreduce
        sums over ranks and the statistics scale to the mean micro-gradient's by (W / n)^2 (or
        1 / n^2 where not ``averaged``)."""

    def close(self) -> None:
        """Remove what the engine hooked (Horovod's gradient hooks put back as Horovod's own,
        tensor hooks removed); the optimizer is not used afterwards. Idempotent."""
