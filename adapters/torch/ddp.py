"""torch.distributed's engine for the torch optimizer (``engine.Engine``; the optimizer, built
from it, in ``optimizer.py``): a ``DistributedDataParallel`` model's own communication carries the
statistics. No Horovod is imported.

    dist.init_process_group("gloo")                      # torchrun sets the rendezvous
    model = DistributedDataParallel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)  # --policy
    for step ...:
        for i, batch in enumerate(micro_batches):        # k = backward_passes_per_step
            with model.no_sync() if i < k - 1 else contextlib.nullcontext():
                loss_fn(model(x), y).backward()          # each micro-batch's mean loss
        opt.step(); opt.zero_grad()

How the statistics ride DDP's communication (one communication hook, ``register_comm_hook``):

* each bucket, before its allreduce: its local gradients' norms (one fused kernel over the
  bucket: DDP's buckets are the Horovod path's buckets), at one pass per step that pass's, with
  accumulation and samples="workers" (the default from two workers on) the sum of the worker's
  passes that DDP allreduces after the passes under ``no_sync()``; per-pass statistics with
  accumulation (samples="passes") are measured by a tensor hook per parameter, as Horovod's
  are (``statistics.py``); with one parameter group, one norm of the bucket's flat buffer;
  adascale_adam's of that buffer divided by Adam's preconditioner (sqrt(v_hat) + eps, made
  once a step per bucket and kept for the mean's norm: a buffer the size of the parameters);
* the bucket's allreduce is DDP's own (or the user's hook: ``comm_hook=``); when it completes,
  |g_bar|^2 of the averaged bucket is taken in its future's callback, before anything (a
  GradScaler's ``unscale_``) touches the gradients;
* at the last bucket, [s..., c, w] go out in one small float64 allreduce on the same process
  group, issued after that bucket's, so it overlaps the gradients' tail; at the end of that
  backward pass, once DDP has written the averaged buckets into p.grad, it is waited for and
  p.grad becomes the mean of the step's micro-gradients (``to_mean_gradient``), so clipping or
  a GradScaler's ``unscale_`` between backward and ``step()`` sees the mean, as under Horovod
  after ``synchronize()`` (which exists here too, and has nothing left to do).

S, n and the agreement are those of the model's process group. Gloo has no ReduceOp.AVG: the
statistics are summed (SUM on every backend), the gradients averaged by DDP's hook (a division
by the group's size before its SUM allreduce, as DDP's default does on NCCL and Gloo alike).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState, batched_powerSGD_hook, powerSGD_hook)
from torch.nn.parallel import DistributedDataParallel

from hvd_scale.adapters.adapt import ADAPT_EVERY, check_passes
from hvd_scale.guard import SharpnessGuard
from hvd_scale.policies import Policy

from .norms import norms
from .optimizer import TorchOptimizer, scaling_for
from .statistics import StepStatistics

FSDP_REFUSED = (
    "hvd_scale's DDP engine takes a DistributedDataParallel model, and this one is sharded with "
    "FSDP. For FSDP2 (fully_shard) use hvd_scale.adapters.torch.fsdp.DistributedOptimizer("
    "optimizer, model, ...), which reads the statistics from FSDP2's reduce-scatters; FSDP1 "
    "(FullyShardedDataParallel) is not supported: shard with fully_shard instead")

# #49, measured in tests/workers/ddp_options_worker.py (rank 1, error feedback, 2 workers): from
# its start_powerSGD_iter on, PowerSGD's "mean" was 68-105% away from g_bar (relative L2) at every
# step and its |.|^2 0.3x to 2x the true |g_bar|^2; an estimator fed it saw the gain at S at once.
POWERSGD_REFUSED = (
    "hvd_scale: PowerSGD's communication hook cannot carry policy {policy}'s statistics: what it "
    "returns is a low-rank approximation of the mean gradient plus the error fed back from earlier "
    "steps, not g_bar, so |g_bar|^2, sigma2, mu2 and the gain would be measured on that "
    "approximation (per step its squared norm was 0.3x to 2x the true one in our tests). Use a "
    "policy that does not measure (e.g. policy='linear', 'sqrt', 'fixed:...'; PowerSGD composes "
    "with those), or a hook that keeps the mean (default_hooks.fp16_compress_hook, "
    "bf16_compress_hook)")

# A rank that has joined runs DDP's hook on zero buckets without a backward pass of its own: it
# would count a micro-batch it never took (or none at all with accumulation) and wait for a step
# that never comes. Raised in the first synchronizing pass inside the context, on every rank,
# before anything is applied.
JOIN_REFUSED = (
    "hvd_scale: DDP's Join context (uneven inputs: `with model.join():` or `Join([model])`) is "
    "not supported: a joined rank's zero gradients would be counted as micro-batches. Give every "
    "rank the same number of steps (drop the last uneven batches: DistributedSampler("
    "drop_last=True)); a leftover batch with fewer passes on some ranks is fine (a short step)")


# PyTorch's reducer fails `expect_autograd_hooks_ INTERNAL ASSERT FAILED` at the first backward
# pass under no_sync() of a static_graph=True model, with or without hvd_scale (torch 2.13).
# Refused when the optimizer is built (or k is raised), on every rank, before any pass.
STATIC_GRAPH_REFUSED = (
    "hvd_scale: DDP's static_graph=True cannot accumulate under model.no_sync() ({why}): "
    "PyTorch's reducer fails an internal assertion (expect_autograd_hooks_) at the first pass "
    "under no_sync(), with or without hvd_scale. Build the DistributedDataParallel without "
    "static_graph=True (the statistics and weights are the same), or take one backward pass "
    "per step")


@dataclasses.dataclass
class StatisticsHookState:
    """The state of hvd_scale's DDP communication hook (``statistics_hook``), as torch's hooks
    keep theirs (``PowerSGDState``; ``fp16_compress_wrapper``'s wrapped hook): the user's hook
    and its state, which it wraps, and the engine that measures.

    ``engine`` is a weak reference: DDP's reducer (C++) holds this state, and a state holding
    the engine, which holds the DDP model, would be a cycle the collector cannot see: the model
    and its process group would outlive the script, to be freed during the interpreter's exit
    (docs/troubleshooting.md). ``closed`` (``opt.close()``): DDP cannot unregister a
    communication hook, so from then on each bucket passes straight to the user's hook."""

    user_hook: Callable
    user_state: Any
    engine: Callable[[], Any]  # weakref.ref to the DDPEngine
    closed: bool = False


def statistics_hook(state: StatisticsHookState, bucket):
    """DDP's communication hook: the bucket's statistics around the user's hook (the engine's
    ``comm_hook``), or the user's hook alone once closed."""
    if state.closed:
        return state.user_hook(state.user_state, bucket)
    engine = state.engine()
    if engine is None:
        raise RuntimeError("hvd_scale: the DistributedOptimizer of this DDP model was deleted "
                           "while the model still trains: keep it as long as the model, or call "
                           "opt.close() first")
    return engine.comm_hook(state, bucket)


class TorchDistributedBinding:
    """``core.Scaling``'s collectives (``protocol.HorovodBinding``) on a torch.distributed
    process group (None: the default group)."""

    def __init__(self, group=None):
        self.group = group
        # Fixed for the process's life (torchrun restarts processes to resize), and read after
        # the script's dist.destroy_process_group() too: the metrics log's flush at exit.
        self._size, self._rank = dist.get_world_size(group), dist.get_rank(group)

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def allgather_object(self, obj, name=None) -> list:
        out = [None] * self.size()
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, root_rank=0, name=None):
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=root_rank)
        return box[0]


def _flat(bucket: torch.Tensor, denominator: torch.Tensor) -> bool:
    """Whether a bucket's flat buffer lines up with its parameters' denominator."""
    return (bucket.dim() == 1 and bucket.numel() == denominator.numel()
            and bucket.dtype == denominator.dtype and bucket.device == denominator.device)


def _ddp_model(model) -> DistributedDataParallel:
    """The DDP module behind ``model`` (a ``torch.compile``d one too); FSDP is refused."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    kinds = {cls.__name__ for cls in type(model).__mro__}
    if kinds & {"FullyShardedDataParallel", "FSDPModule"}:
        raise ValueError(FSDP_REFUSED)
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"model must be a torch.nn.parallel.DistributedDataParallel (the module "
                        f"whose gradients DDP averages), got {type(model).__name__}: wrap it "
                        "first, model = DistributedDataParallel(model)")
    return model


def _check_parameters(optimizer, ddp) -> None:
    """The optimizer trains exactly the parameters DDP averages: another would train apart
    on each worker, and one DDP averages but the optimizer does not hold would be counted
    in the statistics (its bucket's norm) but never applied."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    averaged = {id(p): p for name, p in ddp.module.named_parameters()
                if name not in ignored and p.requires_grad}
    held = {id(p): p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    stray = [tuple(p.shape) for key, p in held.items() if key not in averaged]
    unheld = [tuple(p.shape) for key, p in averaged.items() if key not in held]
    if stray or unheld:
        raise ValueError(
            "hvd_scale: the optimizer must train exactly the parameters the "
            "DistributedDataParallel model averages; "
            + (f"{len(stray)} of the optimizer's are not averaged by it (shapes {stray})"
               if stray else f"{len(unheld)} it averages are not in the optimizer (shapes "
               f"{unheld}): freeze them (requires_grad=False) before wrapping in DDP, or "
               "give them to the optimizer"))


class DDPEngine:
    """``engine.Engine`` over a ``DistributedDataParallel`` model: a communication hook
    (``statistics_hook`` over ``StatisticsHookState``) takes each bucket's norms before the
    user's hook (or DDP's allreduce) and |g_bar|^2 of what it returns; the statistics go out in
    an allreduce of their own on the model's process group after the last bucket's."""

    name = "ddp"
    sharded = False
    averaged = True  # DDP leaves the mean over workers of each worker's sum
    stats_dtype = torch.float64  # an allreduce of its own: exact counts, no overflow

    def __init__(self, ddp: DistributedDataParallel, scaling, passes: int, adapt: str | None,
                 comm_hook: Callable | tuple | None, grad_scaler: Any):
        self.ddp, self.group, self.scaling = ddp, ddp.process_group, scaling
        self.grad_scaler = grad_scaler
        self.measure = scaling.measure
        self.denominators: dict[int, torch.Tensor] = {}  # adascale_adam's, per bucket index
        # The norms are taken in DDP's buckets at the synchronizing pass: each pass's gradient at
        # k = 1, each worker's sum of its passes with samples="workers" (a count hook on a few
        # parameters counts them). Per-pass statistics with accumulation (or adapt: k may
        # change) see each pass's gradient only in a tensor hook, before it is added.
        self.bucketed = self.measure and (passes == 1 and adapt is None
                                          or scaling.samples == "workers")
        self.accumulates = passes > 1 or adapt is not None
        # (At k = 1: every worker took the one pass DDP synchronized, n = workers.)
        state, hook = comm_hook if isinstance(comm_hook, tuple) else (self.group, comm_hook)
        if self.measure and (isinstance(state, PowerSGDState)
                             or hook in (powerSGD_hook, batched_powerSGD_hook)):
            raise ValueError(POWERSGD_REFUSED.format(policy=scaling.policy.spec))
        self.hook_state = StatisticsHookState(hook or allreduce_hook, state, weakref.ref(self))
        self.statistics: StepStatistics | None = None

    def attach(self, statistics: StepStatistics) -> None:
        """The tensor hooks (per-pass norms, or the passes counted), then DDP's communication
        hook: refused (and the tensor hooks removed) where the model has one already."""
        self.statistics = statistics
        # The statistics go out from the last bucket's hook (the same collective order on every
        # rank), never from a tensor hook during backward.
        statistics.configure(bucketed=self.bucketed)
        # One group: a bucket's squared norm is that of its flat buffer (one read), before its
        # allreduce and after it (``_bucket_norms``).
        self.one_group = len(statistics.groups) == 1
        kind = "norms" if self.measure and not self.bucketed else \
            "count" if self.accumulates else None
        statistics.hook_parameters(kind, few=self.bucketed)
        try:
            self.ddp.register_comm_hook(self.hook_state, statistics_hook)
        except RuntimeError as e:
            statistics.close()  # a refused optimizer leaves no tensor hook behind
            raise ValueError("hvd_scale: this DDP model has a communication hook already (DDP "
                             "takes one): pass it to DistributedOptimizer(..., comm_hook=hook) or "
                             "comm_hook=(state, hook) instead of registering it, and the "
                             f"statistics compose with it ({e})") from None

    def close(self) -> None:
        """DDP cannot unregister a communication hook: ours passes through to the user's."""
        self.hook_state.closed = True

    # -- DDP's communication hook ------------------------------------------------------------------
    def comm_hook(self, state: StatisticsHookState, bucket):
        statistics = self.statistics
        step = statistics.step
        if bucket.index() == 0:
            if getattr(self.ddp, "_join_config", None) is not None and self.ddp._join_config.enable:
                raise RuntimeError(JOIN_REFUSED)
            if step.stats_handle is not None or step.synchronized:
                self._unconsumed()
            step.mean_norms = []
        grads, params = bucket.gradients(), bucket.parameters()
        once = self.scaling.reads() == "workers"  # a once-a-step read: the step-time model's s
        if once:
            self.scaling.clock.reading()
        denominator = self._bucket_denominator(bucket.index(), params, grads)
        if self.bucketed:
            step.fired_total += len(grads)
            statistics.keep_norms(params, self._bucket_norms(bucket.buffer(), params,
                                                             lambda: grads, denominator))
        if once:
            self.scaling.clock.read()
        future = state.user_hook(state.user_state, bucket)
        if self.measure:
            future = future.then(self._mean_norms_of(bucket.index(), params, grads, denominator))
        if bucket.is_last():
            if self.measure:
                step.stats_handle = statistics.start()
            elif statistics.hooked:
                step.stats_handle = statistics.start_count(max(step.fired, default=0))
            if step.stats_handle is not None:
                self._synchronize_after_backward()
        return future

    def _synchronize_after_backward(self) -> None:
        """Make p.grad the mean at the end of this backward pass (``synchronize``), after DDP's
        own end-of-backward callback has written the averaged buckets into p.grad. That one is
        queued after this hook ran (the reducer queues it once the last bucket is marked ready),
        so ours is queued from a callback: autograd runs the callbacks queued while running
        them after those queued before, DDP's among them."""
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._synchronize_in_backward))

    def _synchronize_in_backward(self) -> None:
        if self.statistics.step.stats_handle is not None:
            self._synchronize("the backward pass")

    def _bucket_denominator(self, index: int, params, grads) -> torch.Tensor | None:
        """adascale_adam's preconditioner denominator for this bucket's parameters
        (``StepStatistics.denominator``), made once a step for both of the bucket's norms (the
        worker's gradient, then the mean's in the callback), in a buffer kept per bucket: Adam's
        v does not change before ``step()``. None for other policies, or where the one-tensor
        path serves (the first step)."""
        if not self.measure or self.scaling.policy.statistics != "preconditioned":
            return None

        def buffer(elements, dtype, device):
            have = self.denominators.get(index)
            if have is None or (have.numel(), have.dtype, have.device) != (elements, dtype, device):
                have = self.denominators[index] = torch.empty(elements, dtype=dtype, device=device)
            return have
        return self.statistics.denominator(params, grads, buffer)

    def _bucket_norms(self, flat: torch.Tensor, params, grads: Callable, denominator) -> torch.Tensor:
        """The norms a bucket's statistics need, of its flat buffer ``flat`` (the worker's, or
        the averaged one), a float64 vector: with one parameter group the bucket's one norm
        (plain, or adascale_adam's gradient divided by the bucket's ``denominator``: one read
        of the bucket), else one per gradient (``grads()``: ``flat``'s views)."""
        if denominator is not None and _flat(flat, denominator):
            quotient = self.statistics.quotient(flat, denominator)
            return norms([quotient] if self.one_group else
                         list(quotient.split([g.numel() for g in grads()])))
        if self.one_group and self.scaling.policy.statistics == "plain":
            return norms([flat])
        return self.statistics.grad_norms(params, grads())

    def _mean_norms_of(self, index, params, grads, denominator=None):
        """The future's callback: |g_bar|^2 of the bucket's averaged gradients (the result laid
        out as the bucket's gradients) per group (``_bucket_norms``), kept for ``mean_sqnorms``
        with the bucket's ``index``."""
        statistics = self.statistics
        step = statistics.step
        shapes = [(g.numel(), g.shape) for g in grads]
        groups = None if self.one_group else torch.tensor(
            [statistics.group_of.get(p, 0) for p in params], device=statistics.device)

        def reduced(future):
            out = future.value()
            if isinstance(out, (list, tuple)):
                out = out[0]

            def views():
                found, at = [], 0
                for numel, shape in shapes:
                    found.append(out.narrow(0, at, numel).view(shape))
                    at += numel
                return found
            squares = self._bucket_norms(out, params, views, denominator).square()
            if self.one_group:
                step.mean_norms.append((index, squares.sum().view(1)))
            else:
                sums = torch.zeros(len(statistics.groups), dtype=torch.float64,
                                   device=squares.device)
                step.mean_norms.append((index, sums.index_add_(0, groups, squares)))
            return out
        return reduced

    def _unconsumed(self) -> None:
        """A synchronizing pass while the previous one's statistics wait for ``step()``: with a
        GradScaler that skipped the step (an overflow) that step is counted skipped; otherwise
        the loop synchronized twice in one step."""
        if self.grad_scaler is None:
            statistics = self.statistics
            step = statistics.step
            handle, step.stats_handle = step.stats_handle, None
            self.drop(handle)
            step.synchronized, step.pending, step.count = False, None, None
            raise RuntimeError(
                "hvd_scale: a second synchronizing backward pass before opt.step(): with "
                f"backward_passes_per_step={statistics.passes}, run the first k - 1 "
                "passes of a step under model.no_sync(), and call opt.step() after the last "
                "(it skips a non-finite step itself)")
        self.statistics.skipped()

    # -- the Horovod protocol -------------------------------------------------------------------
    def synchronize(self) -> None:
        """As Horovod's: wait for the step's statistics and make p.grad the mean of the step's
        micro-gradients (``StepStatistics.to_mean_gradient``). Under DDP this runs by itself at
        the end of the step's synchronizing backward pass (DDP's allreduce is complete there),
        so calling it finds nothing left to do; kept so that Horovod's loops
        (``opt.synchronize()`` before clipping or ``scaler.unscale_(opt)``) run unchanged.
        p.grad is made the mean once."""
        self._synchronize("opt.synchronize()")

    def _synchronize(self, caller: str) -> None:
        statistics = self.statistics
        step = statistics.step
        if step.synchronized:
            return
        statistics.check_no_parameter_unfrozen()
        self.scaling.clock.waiting()
        handle, step.stats_handle = step.stats_handle, None
        if handle is None and (self.measure or statistics.hooked):
            raise RuntimeError(f"hvd_scale: {caller} without a synchronizing backward pass: "
                               "the step's last backward pass must run outside model.no_sync() "
                               "(DDP averages the gradients there)")
        statistics.finish(handle, counting=not self.measure and handle is not None)
        # (k = 1 unmeasured: nothing was sent, p.grad is the mean already, nothing to keep.)
        step.synchronized = handle is not None
        self.scaling.clock.waited()

    def skip_synchronize(self):
        """``step()`` never makes the mean twice, with or without it."""
        return contextlib.nullcontext()

    # -- the rest of engine.Engine ----------------------------------------------------------------
    def gather(self) -> None:
        self.statistics.check_no_parameter_unfrozen()
        self._synchronize("opt.step()")

    def mean_sqnorms(self, count: torch.Tensor | None) -> torch.Tensor:
        """|g_bar|^2 per group from the buckets' averaged gradients (taken as each allreduce
        completed): DDP's average is of each worker's sum of passes, the mean micro-gradient
        is that times workers / n."""
        statistics = self.statistics
        sums = torch.zeros(len(statistics.groups), dtype=torch.float64, device=statistics.device)
        # In bucket order, not the order the allreduces completed (it differs between ranks: the
        # float sums did, in the last bits, and so did the ranks' lr factors and weights, #49).
        for _, squares in sorted(statistics.step.mean_norms, key=lambda entry: entry[0]):
            sums = sums + squares
        factor = 1.0 if count is None else self.scaling.hvd.size() / count.clamp(min=1)
        return sums * factor ** 2

    def inner_step(self, closure):
        return self.statistics.optimizer.step(closure)

    def in_step(self) -> bool:
        step = self.statistics.step
        return step.stats_handle is not None or step.synchronized

    def passes(self) -> None:
        return None  # DDP does not count the passes: the statistics' hooks do

    def follow_passes(self, passes: int) -> None:
        if getattr(self.ddp, "static_graph", False) and passes > 1:
            raise ValueError(STATIC_GRAPH_REFUSED.format(why=f"set_passes({passes})"))
        self.statistics.follow_passes(passes)

    def allreduce_async(self, tensor: torch.Tensor, name: str):
        return dist.all_reduce(tensor, group=self.group, async_op=True), tensor

    def wait_sum(self, handle) -> torch.Tensor:
        work, tensor = handle
        work.wait()
        return tensor.double()

    def drop(self, handle) -> None:
        if handle is not None:
            handle[0].wait()

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor / dist.get_world_size(self.group)


class DistributedOptimizer(TorchOptimizer):
    """Wrap any torch optimizer of a ``DistributedDataParallel`` model: an lr scaling policy
    whose statistics ride DDP's gradient allreduce.

    ``policy``, ``backward_passes_per_step``, ``scale``, ``budget``, ``grad_scaler``,
    ``measure``, ``log_dir``, ``nonfinite``, ``guard``, ``adapt``, ``max_passes``,
    ``adapt_every`` and ``samples`` are those of Horovod's (``hvd_scale.adapters.torch.DistributedOptimizer``).
    With k > 1, run the first k - 1 backward passes of a step under ``model.no_sync()`` (DDP's
    accumulation); a short step (fewer passes, a leftover batch) counts the passes taken.

    Args:
        optimizer: the plain torch optimizer over the DDP model's parameters.
        model: the ``DistributedDataParallel`` model (or ``torch.compile(ddp_model)``); its
            process group is the job (S, n and the agreement are the group's).
        comm_hook: a DDP communication hook of your own, ``hook`` or ``(state, hook)`` (e.g.
            ``default_hooks.fp16_compress_hook``): the statistics compose with it (norms
            before it, |g_bar|^2 of what it returns), as torch's ``fp16_compress_wrapper``
            composes with another hook. A hook registered on the model before is refused
            (DDP takes one): pass it here. PowerSGD's is refused under a measuring policy
            (``POWERSGD_REFUSED``: it returns no g_bar to measure); unmeasured it composes.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model, policy: str | Policy | None = None,
                 backward_passes_per_step: int = 1, *, scale: float | None = None,
                 budget: float | None = None, grad_scaler: Any = None,
                 measure: bool | None = None, log_dir: str | None = None, nonfinite: str = "skip",
                 guard: SharpnessGuard | None = None, adapt: str | None = None,
                 max_passes: int | None = None, adapt_every: int = ADAPT_EVERY,
                 samples: str = "auto", comm_hook: Callable | tuple | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, TorchOptimizer):
            raise TypeError(f"optimizer must be a plain torch.optim.Optimizer (wrapped once), got "
                            f"{type(optimizer).__name__}")
        ddp = _ddp_model(model)
        if getattr(ddp, "static_graph", False):
            if check_passes(backward_passes_per_step) > 1:
                raise ValueError(STATIC_GRAPH_REFUSED.format(
                    why=f"backward_passes_per_step={backward_passes_per_step}"))
            if adapt is not None:
                raise ValueError(STATIC_GRAPH_REFUSED.format(
                    why=f"adapt={adapt!r} may choose k > 1"))
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "dist.init_process_group(...) before building the optimizer")
        _check_parameters(optimizer, ddp)
        self._group = ddp.process_group  # broadcast_state's
        scaling = scaling_for(
            TorchDistributedBinding(self._group), optimizer, name="torch/ddp", policy=policy,
            passes=backward_passes_per_step, scale=scale, budget=budget, measure=measure,
            log_dir=log_dir, nonfinite=nonfinite, guard=guard, adapt=adapt,
            max_passes=max_passes, adapt_every=adapt_every, samples=samples)
        engine = DDPEngine(ddp, scaling, backward_passes_per_step, adapt, comm_hook, grad_scaler)
        super().__init__(optimizer, engine, scaling, passes=backward_passes_per_step,
                         grad_scaler=grad_scaler)


def broadcast_state(model, optimizer: DistributedOptimizer, root_rank: int = 0) -> None:
    """The model's weights and buffers, the optimizer's state and the run's record from
    ``root_rank`` (a rank of the model's process group) on every rank: after a checkpoint
    loaded on that rank only. (DDP broadcasts the weights once, when it wraps the model.)"""
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"broadcast_state(model, optimizer) takes hvd_scale's DDP "
                        f"DistributedOptimizer, got {type(optimizer).__name__}")
    ddp, group = _ddp_model(model), optimizer._group
    for tensor in ddp.module.state_dict().values():
        dist.broadcast(tensor, group=group, group_src=root_rank)
    box = [optimizer.state_dict()]
    dist.broadcast_object_list(box, group=group, group_src=root_rank)
    if dist.get_rank(group) != root_rank:
        optimizer.load_state_dict(box[0])
