"""A step's statistics in torch, whichever engine reduces the gradients (``engine.Engine``):
the norm of each backward pass's own gradient (in the engine's buckets at k = 1, by a tensor
hook per parameter with accumulation), the micro-gradient count (also unmeasured: a short
step's S and mean), their one allreduce beside the gradients' (the engine's
``allreduce_async``), and the mean micro-gradient in p.grad. ``StepStatistics`` is a part of the
optimizer (``optimizer.py``), not a parent: its state is the step in progress (``StepState``),
what it returns the step's ``hvd_scale.reduce.StepRecord``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import threading
import weakref
from typing import Any

import numpy as np
import torch

from hvd_scale.adapters.core import precondition
from hvd_scale.reduce import StepRecord

from .norms import _IS_SPARSE, _vector, all_finite, cpu_norm, norms

_KIND = operator.attrgetter("dtype", "device")

STATS_NAME = "hvd_scale.stats"
# adascale_adam's preconditioned gradients are made this many elements at a time (a bucket's
# small tensors together, a large one alone): two temporaries of this size, not of the model.
PRECONDITION_CHUNK = 1 << 22


_SCRATCH = threading.local()  # per thread: DDP reads the averaged buckets in Gloo's thread


def _scratch(elements: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two buffers of ``elements`` for ``_preconditioned_norms``, kept per thread, dtype and
    device and grown as needed: fresh large CPU tensors each step cost page faults (a chunk's
    temporaries took longer than the arithmetic)."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    have = buffers.get((dtype, device))
    if have is None or have.shape[1] < elements:
        have = buffers[(dtype, device)] = torch.empty((2, elements), dtype=dtype, device=device)
    return have[0, :elements], have[1, :elements]


@functools.lru_cache(maxsize=256)
def _offsets(sizes: tuple[int, ...]) -> np.ndarray:
    """Where each of tensors of these sizes starts when laid end to end."""
    return np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]).astype(np.int64)


@functools.lru_cache(maxsize=256)
def _lengths(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The segment lengths of tensors of these sizes laid end to end (buckets recur each step)."""
    return torch.tensor(sizes, dtype=torch.int64, device=device)


def _chunks(tensors: list[torch.Tensor], elements: int) -> list[tuple[int, int]]:
    """[i, j) ranges of consecutive tensors of at most ``elements`` elements together (a
    larger tensor alone)."""
    out, start, size = [], 0, 0
    for i, t in enumerate(tensors):
        if i > start and size + t.numel() > elements:
            out.append((start, i))
            start, size = i, 0
        size += t.numel()
    if tensors:
        out.append((start, len(tensors)))
    return out


@dataclasses.dataclass
class StepState:
    """What one optimizer step gathers between its first backward pass and ``step()``, in one
    record: made in one place (``StepStatistics.new_step``), at construction, a change of hooks
    and a load."""

    norms: list[list]  # per group: this step's gradients' norms so far (vectors, or CPU floats)
    fired: list[int]  # per hooked parameter: its gradients this step
    fired_total: int = 0  # gradients seen this step, all parameters
    passes_started: int = 0  # passes whose first gradient has been seen (the step clock's stamps)
    bucket: list = dataclasses.field(default_factory=list)  # parameters waiting to be sent
    bucket_elements: int = 0
    stats_handle: Any = None  # the statistics allreduce in flight (one process: the sums)
    mean_norms: list = dataclasses.field(default_factory=list)  # DDP: |bucket|^2 after allreduce
    pending: torch.Tensor | None = None  # [s..., c, w, q...] after synchronize, until step()
    count: int | None = None  # unmeasured: the step's micro-gradients, after synchronize
    synchronized: bool = False  # synchronize() ran for this step
    sent: int = 0  # unmeasured, with Horovod's hooks: gradients handed to Horovod this step
    # this step reads every pass (``StepStatistics.per_pass``); None: undecided (until the step's
    # first gradient; its gradients may still be sent after the statistics went out)
    per_pass: bool | None = None

    def counted(self) -> None:
        """The norms and counts went into the statistics: the next pass starts from zero."""
        for group_norms in self.norms:
            group_norms.clear()
        self.fired = [0] * len(self.fired)
        self.fired_total = self.passes_started = self.sent = 0



# (group, parameter) hooks: where the statistics' norms are read once per step (samples="workers")
# and the engine does not count the passes itself (DDP), a count hook on this many parameters
# spread over the model counts them: a pass reaches at least one of them unless it leaves all of
# them without a gradient.
COUNTED_PARAMETERS = 4


class StepStatistics:
    """A step's statistics, whichever engine reduces the gradients: explicit state (``step``,
    a ``StepState``), the tensor hooks it installs, and the step's ``StepRecord`` out.

    Parts it is given (none inherited): ``optimizer``, the inner torch optimizer (its groups and
    state, read live: a load replaces them); ``scaling``, the shared ``core.Scaling`` (policy,
    clock, world size); ``engine``, the ``engine.Engine`` whose collectives carry the vector.
    The engine calls, from its hooks: ``keep_norms``/``take_norms`` (a bucket's norms), ``start``
    (the statistics' allreduce), ``start_count`` (unmeasured: the count), ``finish`` (after the
    gradients' reduction), ``per_pass``; it configures the reads in ``attach`` (``configure``,
    ``hook_parameters``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaling, engine, passes: int):
        self.optimizer, self.scaling = optimizer, scaling
        # The engine holds this object (its hooks feed it): a weak reference back, so that no
        # cycle keeps the engine (and a DDP model with its process group) alive after the script
        # drops the optimizer, to be freed during the interpreter's exit.
        self.engine = weakref.proxy(engine)
        self.measure = scaling.measure  # fixed for the optimizer's life (its hooks)
        self.passes = passes  # k, as the engine and the hooks follow it
        # How the engine reads the norms (``configure``): in its buckets, each worker's sum once
        # (``bucketed``); W may change in the process (``switching``, Horovod elastic: a step at
        # one worker with k >= 2 reads every pass instead, by the norm hooks); the statistics go
        # out from the tensor hook of the step's last gradient (``send_at_last_gradient``).
        self.bucketed = self.switching = self.send_at_last_gradient = False
        # Parameters the engine and the hooks know: a later unfreezing is refused at the next step.
        self.frozen = [p for p in self.params() if not p.requires_grad]
        # (group, parameter) of every trained parameter, in the groups' order: the hooks' order
        self.trained_params = [(gi, p) for gi, group in enumerate(self.groups)
                               for p in group["params"] if p.requires_grad]
        self.trained = len(self.trained_params)
        self.group_of = {p: gi for gi, p in self.trained_params}
        self.all_gradients = self.trained * passes  # a full step's
        self.paused = False  # the guard's Hessian-vector products are not passes
        self.hooks: list = []
        self.step = self.new_step()

    groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)

    def params(self):
        return (p for group in self.groups for p in group["params"])

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params() if p.grad is not None]

    @property
    def device(self) -> torch.device:
        """Where the statistics are made: the gradients' device."""
        return next(self.params()).device

    # -- set-up (the engine's ``attach``) ---------------------------------------------------------
    def configure(self, *, bucketed: bool, switching: bool = False,
                  send_at_last_gradient: bool = False) -> None:
        self.bucketed, self.switching = bucketed, switching
        self.send_at_last_gradient = send_at_last_gradient
        self.follow_passes(self.passes)

    def hook_parameters(self, kind: str | None, few: bool = False) -> None:
        """A tensor hook on every trained parameter: "norms" (each pass's gradient measured
        before it is added into p.grad), "count" (the passes counted), or None. ``few``: the
        count on a handful of parameters spread over the model (``COUNTED_PARAMETERS``), where
        the norms are read once per step and only the passes are wanted."""
        trained = self.trained_params
        if few:
            trained = trained[::max(1, len(trained) // COUNTED_PARAMETERS)]
        self.close()
        if kind == "norms":
            self.hooks = [p.register_hook(self._norm_hook(gi, p, index))
                          for index, (gi, p) in enumerate(trained)]
        elif kind == "count":
            self.hooks = [p.register_hook(self._count_hook(index))
                          for index, (_, p) in enumerate(trained)]
        self.step = self.new_step()

    @property
    def hooked(self) -> int:
        return len(self.hooks)

    def close(self) -> None:
        """Remove the tensor hooks (``opt.close()``)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def new_step(self) -> StepState:
        return StepState(norms=[[] for _ in self.groups], fired=[0] * self.hooked)

    def follow_passes(self, passes: int) -> None:
        """k from the next step on: a full step's gradients (each sent once where the engine
        reads its buckets)."""
        self.passes = passes
        self.all_gradients = self.trained * (1 if self.bucketed else passes)

    def follow_new_k(self, engine_counts: bool) -> None:
        """After ``set_passes`` changed k: hooks where none were built. Under elastic, per pass
        where one worker is left (``per_pass``); built at k = 1 with nothing counting
        (unmeasured, or norms read once per worker in the buckets): from now on a pass is not a
        step, and the passes are counted."""
        if self.switching and not self.hooked:
            self.hook_parameters("norms")
        if not (self.hooked or engine_counts) and (self.bucketed or not self.measure):
            self.hook_parameters("count", few=self.bucketed)

    def started(self) -> bool:
        """Whether this step has begun (a gradient seen): k and the record must not change."""
        return bool(self.step.fired_total or any(self.step.fired))

    def reset(self) -> None:
        """A load: a statistics allreduce in flight finished and dropped, a fresh step."""
        self.engine.drop(self.step.stats_handle)
        self.step = self.new_step()

    def skipped(self) -> None:
        """A step never applied (a GradScaler skipped it): its statistics, finished or still in
        flight, dropped; the step counted skipped."""
        step = self.step
        handle, step.stats_handle = step.stats_handle, None
        self.engine.drop(handle)
        step.synchronized, step.pending, step.count = False, None, None
        self.scaling.skip()

    def check_no_parameter_unfrozen(self) -> None:
        """A parameter made trainable after the optimizer was built has neither the engine's
        allreduce nor a norm hook: its workers would drift apart and the statistics miss it."""
        unfrozen = [p for p in self.frozen if p.requires_grad]
        if unfrozen:
            shapes = [tuple(p.shape) for p in unfrozen]
            raise ValueError(f"hvd_scale: {len(unfrozen)} parameter(s) of shape(s) {shapes} were "
                             "made trainable after DistributedOptimizer was built; the engine "
                             "would not average their gradients and the statistics would miss "
                             "them. Build the optimizer again (DistributedOptimizer(...)) after "
                             "changing requires_grad, then load its state_dict")

    @contextlib.contextmanager
    def hooks_paused(self):
        """The guard's Hessian-vector products: backward passes that are not the step's."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    # -- what a step reads ------------------------------------------------------------------------
    def per_pass(self) -> bool:
        """Whether this step reads every pass's gradient (the norm hooks) rather than each
        worker's sum once (the engine's buckets): decided at the step's first gradient from the
        world size and k then (``Scaling.reads``), and kept for the step. Without norm hooks
        that can switch, what the hooks were built for (per pass unless bucketed)."""
        step = self.step
        if step.per_pass is None:
            if self.switching:
                k = self.passes
                step.per_pass = k > 1 and self.scaling.reads() == "passes"
                self.all_gradients = self.trained * (k if step.per_pass else 1)
            else:
                step.per_pass = not self.bucketed
        return step.per_pass

    # A backward pass is counted by the parameters' own gradients, not by autograd's end-of-
    # backward callback: under reentrant activation checkpointing that callback belongs to the
    # nested backward of the first segment, and would end the pass too early. Each hooked
    # parameter gets one gradient per pass that reaches it, so this worker's passes are the
    # largest count (parameters without a gradient in some pass count less).
    def _count_hook(self, index: int):
        """Count this parameter's gradients (the passes of a step, each one's start stamped on
        the step clock): unmeasured, or with the norms read once per worker."""
        def hook(grad: torch.Tensor) -> None:
            if not self.paused:
                self._count_gradient(index)
        return hook

    def _count_gradient(self, index: int) -> None:
        """One more gradient of hooked parameter ``index`` this step; the first of a new pass
        is stamped on the step clock."""
        step = self.step
        step.fired[index] += 1
        if step.fired[index] > step.passes_started:
            step.passes_started += 1
            self.scaling.clock.pass_started()

    def _norm_hook(self, group_index: int, p: torch.Tensor, index: int):
        precondition = self.scaling.policy.statistics == "preconditioned"

        def hook(grad: torch.Tensor) -> None:
            if self.paused:
                return
            if self.switching and not self.per_pass():  # read once per worker, in the buckets
                self._count_gradient(index)
                return
            # The gradient of this backward pass alone (hooks run before accumulation into p.grad).
            g = self.preconditioned(p, grad, self.groups[group_index]) if precondition else grad
            step = self.step
            # On the CPU a float: no tensor op per pass and parameter beyond the norm itself.
            step.norms[group_index].append(cpu_norm(g) if g.device.type == "cpu" and not g.is_sparse
                                           else norms([g]))
            self._count_gradient(index)
            step.fired_total += 1
            if step.fired_total == self.all_gradients and step.stats_handle is None \
                    and self.send_at_last_gradient:
                # The step's last gradient: this hook runs before Horovod's hook enqueues its
                # allreduce, so the statistics are in Horovod's queue no later than the last
                # gradient and never wait a cycle for themselves. (Otherwise, with parameters
                # that got no gradient or a short step, synchronize() sends them.)
                step.stats_handle = self.start()
        return hook

    def grad_norms(self, params: list[torch.Tensor], grads: list | None = None) -> torch.Tensor:
        """|p.grad| (or |grads[i]|) of each parameter, a float64 vector (``norms``): one fused
        kernel when the gradients allow it (dense, one dtype); adascale_adam's preconditioned
        gradients a chunk at a time (``_preconditioned_norms``)."""
        grads = [p.grad for p in params] if grads is None else grads
        if self.scaling.policy.statistics == "preconditioned":
            return torch.cat([self._preconditioned_norms(params[i:j], grads[i:j])
                              for i, j in _chunks(grads, PRECONDITION_CHUNK)])
        return norms(grads)

    def _preconditioned_norms(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
        """|P g| of each gradient (``preconditioned``), a float64 vector. Dense gradients and
        second moments of one dtype and device (the usual case) are laid end to end in two
        scratch buffers and preconditioned there (``denominator``), about ten tensor ops for
        the chunk and no large temporary (six ops per tensor, one tensor at a time, cost
        adascale_adam 1.24-1.36x the Transformer's k = 1 step); others one tensor at a time."""
        denominator = self.denominator(params, grads, lambda *kind: _scratch(*kind)[0])
        if denominator is None:
            return torch.cat([norms([self.preconditioned(p, g, self.groups[self.group_of[p]])])
                              for p, g in zip(params, grads)])
        scratch = _scratch(denominator.numel(), denominator.dtype, denominator.device)[1]
        torch.cat([g.reshape(-1) for g in grads], out=scratch).div_(denominator)
        return norms(list(scratch.split(tuple(g.numel() for g in grads))))

    def denominator(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                     buffer) -> torch.Tensor | None:
        """sqrt(max(v_hat, floor)) + eps of ``params`` laid end to end, written into
        ``buffer(elements, dtype, device)``: ``core.precondition``'s denominator, its per-tensor
        floor (1 - beta2) / c2 x mean(v_hat) a segment sum. None where the flat path does not
        apply: no second moment yet (the first step), one holding no gradient, sparse or mixed
        dtypes and devices (``preconditioned``, a tensor at a time, serves those)."""
        groups = [self.groups[self.group_of[p]] for p in params]
        states = [self.state.get(p) for p in params]
        if not all(st and "exp_avg_sq" in st for st in states):
            return None
        moments = [st["exp_avg_sq"] for st in states]
        tensors = [*moments, *grads]
        if len(set(map(_KIND, tensors))) != 1 or any(map(_IS_SPARSE, tensors)):
            return None
        keys = [(g["betas"][1], float(st["step"])) for g, st in zip(groups, states)]
        # (beta2, Adam's step) -> c2: one per group, as a rule
        corrections = {key: self.scaling.policy.second_moment_correction(self.scaling.run.policy, *key)
                       for key in set(keys)}
        c2 = [corrections[key] for key in keys]
        if 0.0 in c2:  # v holds no gradient yet
            return None
        device, dtype = moments[0].device, moments[0].dtype
        sizes = tuple(map(torch.Tensor.numel, moments))
        v_hat = buffer(sum(sizes), dtype, device)
        torch.cat([v.view(-1) for v in moments], out=v_hat)
        views = list(v_hat.split(sizes))
        if len(corrections) == 1:
            v_hat.div_(c2[0])
        else:
            torch._foreach_div_(views, c2)
        factors = [(1.0 - g["betas"][1]) / c / max(1, n) for g, c, n in zip(groups, c2, sizes)]
        if device.type == "cpu" and dtype in (torch.float32, torch.float64):
            # numpy's segment sum is ~2x torch's here, and the floors become host floats
            sums = np.add.reduceat(v_hat.numpy(), _offsets(sizes), dtype=np.float64)
            torch._foreach_maximum_(views, (sums * factors).tolist())
        else:
            floor = torch.segment_reduce(v_hat, "sum", lengths=_lengths(sizes, device)).mul_(
                torch.tensor(factors, dtype=dtype, device=device))
            torch._foreach_maximum_(views, list(floor.unbind()))
        eps = [g["eps"] for g in groups]
        v_hat.sqrt_()
        if len(set(eps)) == 1:
            v_hat.add_(eps[0])
        else:
            torch._foreach_add_(views, eps)
        return v_hat

    def quotient(self, flat: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        """P g of the gradients laid end to end in ``flat`` (a DDP bucket), P = 1 /
        ``denominator`` (``denominator``'s, the same for the worker's gradient and the mean's),
        in this thread's scratch: one division."""
        _, scratch = _scratch(flat.numel(), flat.dtype, flat.device)
        return torch.div(flat, denominator, out=scratch)

    def keep_norms(self, params: list[torch.Tensor], vector: torch.Tensor) -> None:
        """Keep a bucket's norms (``vector``, one per parameter) for this step's sums: as one
        vector when there is one group."""
        norms = self.step.norms
        if len(norms) == 1:
            norms[0].append(vector)
        else:
            for i, p in enumerate(params):
                norms[self.group_of[p]].append(vector[i:i + 1])

    def take_norms(self, params: list[torch.Tensor], grads: list | None = None) -> None:
        """Keep the bucket's norms for this step's sums (``keep_norms``). Read per worker, this
        is once a step at any k: timed on the step clock, the step-time model keeps it out of
        the passes (read per pass, a k = 1 step's bucket read stands for a pass's)."""
        clock = self.scaling.clock if self.scaling.reads() == "workers" else None
        if clock is not None:
            clock.reading()
        self.keep_norms(params, self.grad_norms(params, grads))
        if clock is not None:
            clock.read()

    def preconditioned(self, p: torch.Tensor, grad: torch.Tensor, group: dict,
                      floored: bool = True) -> torch.Tensor:
        """g / (sqrt(v_hat) + eps) for adascale_adam (Adam's second moment before this step),
        v_hat floored for the statistics (``core.precondition``); ``floored=False``: Adam's own
        preconditioner (the guard's)."""
        state = self.state.get(p)
        if not state or "exp_avg_sq" not in state:
            return grad  # first step: no second moment yet, the plain gradient
        bias_correction2 = self.scaling.policy.second_moment_correction(
            self.scaling.run.policy, group["betas"][1], float(state["step"]))
        if bias_correction2 == 0.0:
            return grad  # v holds no gradient yet
        floor = {"beta2": group["betas"][1], "mean": torch.mean, "maximum": torch.maximum} \
            if floored else {}
        return precondition(grad, state["exp_avg_sq"], bias_correction2, group["eps"],
                            torch.Tensor.sqrt_, **floor)


    # -- the statistics' allreduce ----------------------------------------------------------------
    def local(self) -> StepRecord:
        """This worker's record (``hvd_scale.reduce``), float64: s_j the squares of the float64
        norms, which no finite gradient overflows; c the passes this worker actually took (a
        short step takes fewer than k). Read per pass (``per_pass``): each pass's |g|^2, w = c;
        per worker: the one read of the sum G of its c passes, |G|^2 / c, w = 1."""
        device, step = self.device, self.step
        sums = [_vector(group_norms).square().sum() if group_norms
                else torch.zeros((), dtype=torch.float64, device=device)
                for group_norms in step.norms]
        passes = self._passes_taken()
        samples = passes
        if passes and not self.per_pass():
            sums, samples = [s / passes for s in sums], 1
        step.counted()
        return StepRecord(torch.stack(sums), torch.tensor(float(passes), dtype=torch.float64,
                                                          device=device),
                          torch.tensor(float(samples), dtype=torch.float64, device=device))

    def _passes_taken(self) -> int:
        """This worker's passes this step: with the norms taken in the engine's buckets, one
        if a gradient was sent (k = 1) or the engine's own count (Horovod's accumulation
        counters); else the tensor hooks' (the largest count over the hooked parameters, every
        one where this step reads per pass)."""
        step = self.step
        if self.bucketed and not self.per_pass():
            if self.passes == 1:
                return min(1, step.fired_total)
            counted = self.engine.passes()
            if counted is not None:
                return counted
        return max(step.fired, default=0)

    def start(self):
        """This worker's record over workers, asynchronously (the engine's ``allreduce_async``),
        on the wire (``StepRecord.to_wire``: in float32 the sums travel three times). A sharded
        engine's |g_bar|^2 shares ride with it (``Engine.mean_sqnorms``)."""
        record = self.local()
        if self.engine.sharded:
            record = record._replace(mean_sqnorms=self.engine.mean_sqnorms(None))
        wire = record.to_wire(torch).to(self.engine.stats_dtype)
        return self.engine.allreduce_async(wire, STATS_NAME)

    def start_count(self, passes: int):
        """[c] over workers, reduced as the gradients are (``start``'s wire)."""
        count = torch.tensor([float(passes)], dtype=self.engine.stats_dtype, device=self.device)
        return self.engine.allreduce_async(count, STATS_NAME + ".count")

    def finish(self, handle, counting: bool) -> None:
        """After the gradients' reduction: p.grad made the mean micro-gradient, and the step's
        statistics (``pending``: [s..., c, w, q...], ``StepRecord.pack``) or count kept for
        ``reduced_statistics``."""
        step = self.step
        if handle is None:
            self.to_mean_gradient(None)
        elif counting:
            count = self.engine.wait_sum(handle).round()  # exact again after the average's rounding
            step.counted()
            self.to_mean_gradient(count[0])
            step.count = int(count.item())
        else:
            record = StepRecord.from_wire(self.engine.wait_sum(handle), len(self.groups), torch)
            self.to_mean_gradient(record.count)
            if self.engine.sharded:  # the shards' sum, of the reduced gradient before the mean
                factor = self._mean_factor(record.count)
                q = record.mean_sqnorms * (factor * factor)
            else:
                q = self.engine.mean_sqnorms(record.count)
            # [s..., c, w, q...] (hvd_scale.reduce's step layout), on the gradients' device.
            step.pending = record._replace(mean_sqnorms=q).pack(torch)
        step.per_pass = None  # the next step decides at its first gradient (W may change)

    def mean_sqnorms(self) -> torch.Tensor:
        """|g_bar|^2 per group (float64) from the mean micro-gradient that p.grad holds after
        the engine's reduction (a replicated engine's ``mean_sqnorms``)."""
        out = []
        for group in self.groups:
            params = [p for p in group["params"] if p.grad is not None]
            out.append(self.grad_norms(params).square().sum() if params
                       else torch.zeros((), dtype=torch.float64, device=self.device))
        return torch.stack(out)

    def _mean_factor(self, count: torch.Tensor) -> torch.Tensor:
        """What turns the engine's reduced gradient into the mean micro-gradient: W / n where
        it averaged the workers' sums, 1 / n where it summed them."""
        workers = self.scaling.hvd.size() if self.engine.averaged else 1.0
        return workers / count.clamp(min=1)

    def to_mean_gradient(self, count: torch.Tensor | None) -> None:
        """Make p.grad the mean of the step's micro-gradients, in place (no copy).

        The engine leaves there, over workers, the mean (``averaged``) or the sum of each
        worker's *sum* of its passes. The mean over all n micro-gradients is what Keras applies
        too, so one loss convention (each micro-batch's mean loss, not divided by k) gives the
        same update in both frameworks. ``count``: n, from the statistics (a device tensor);
        None without measurement, when every worker is taken to have made k passes.
        """
        k, workers = self.passes, self.scaling.hvd.size()
        per_worker_mean = self.engine.averaged
        # At k = 1 the average is already the mean unless some worker sent no pass: a rank
        # that called hvd.join() contributes zeros, and Horovod still divides by all workers.
        # On the CPU n is read for free and the multiply skipped when it changes nothing; on
        # a device the multiply is cheaper than the host transfer that would decide it.
        if per_worker_mean and k == 1 and (count is None or (
                count.device.type == "cpu" and count.item() == workers)):
            return
        grads = self.grads()
        if not grads:
            return
        if count is None:
            factor = 1.0 / (k if per_worker_mean else k * workers)
        else:  # on the device: no host transfer before the step's one
            factor = self._mean_factor(count)
        torch._foreach_mul_(grads, factor)

    def grads_finite(self) -> bool:
        return all_finite(self.grads())
