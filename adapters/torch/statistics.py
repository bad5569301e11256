"""Where the torch optimizer gathers a step's statistics, whichever engine averages the
gradients: the norm of each backward pass's own gradient (in the engine's buckets at k = 1, by a
tensor hook per parameter with accumulation), the micro-gradient count (also unmeasured: a
short step's S and mean), their one allreduce beside the gradients' (``_allreduce_async``, the
engine's), and the mean micro-gradient in p.grad. A mixin of ``optimizer.TorchOptimizer``,
whose record of the step in progress is ``_StepState``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from typing import Any

import numpy as np
import torch

from hvd_scale.adapters.core import precondition
from hvd_scale.reduce import wire_copies, wire_sums

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
class _StepState:
    """What one optimizer step gathers between its first backward pass and ``step()``, in one
    record: made in one place (``DistributedOptimizer._new_step``), at construction and on load."""

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
    # this step reads every pass (``Statistics._per_pass``); None: undecided (until the step's
    # first gradient; its gradients may still be sent after the statistics went out)
    per_pass: bool | None = None

    def counted(self) -> None:
        """The norms and counts went into the statistics: the next pass starts from zero."""
        for group_norms in self.norms:
            group_norms.clear()
        self.fired = [0] * len(self.fired)
        self.fired_total = self.passes_started = self.sent = 0


class Statistics:
    """The statistics' half of ``TorchOptimizer`` (its attributes: ``_step``, ``param_groups``,
    ``scaling``, ``_averaged``, ...; the engine's ``_allreduce_async`` and ``_wait_sum``)."""

    # The engine's norms are read in its buckets (each worker's sum once) and, where W changes
    # in the process (Horovod elastic), every parameter carries a norm hook too: a step at one
    # worker with k >= 2 reads every pass there instead (``_per_pass``), as the layout asks.
    _switching = False

    def _per_pass(self) -> bool:
        """Whether this step reads every pass's gradient (the norm hooks) rather than each
        worker's sum once (the engine's buckets): decided at the step's first gradient from the
        world size and k then (``Scaling.reads``), and kept for the step. Without norm hooks
        that can switch, what the hooks were built for (per pass unless bucketed)."""
        step = self._step
        if step.per_pass is None:
            if self._switching:
                k = self.backward_passes_per_step
                step.per_pass = k > 1 and self.scaling.reads() == "passes"
                self._all_gradients = self._trained * (k if step.per_pass else 1)
            else:
                step.per_pass = not self._bucketed
        return step.per_pass

    # A backward pass is counted by the parameters' own gradients, not by autograd's end-of-
    # backward callback: under reentrant activation checkpointing that callback belongs to the
    # nested backward of the first segment, and would end the pass too early. Each hooked
    # parameter gets one gradient per pass that reaches it, so this worker's passes are the
    # largest count (parameters without a gradient in some pass count less).
    def _make_count_hook(self, index: int):
        """Count this parameter's gradients (the passes of a step, each one's start stamped on
        the step clock): unmeasured, or with the norms read once per worker."""
        def hook(grad: torch.Tensor) -> None:
            if not self._hooks_paused:
                self._count_gradient(index)
        return hook

    def _count_gradient(self, index: int) -> None:
        """One more gradient of hooked parameter ``index`` this step; the first of a new pass
        is stamped on the step clock."""
        step = self._step
        step.fired[index] += 1
        if step.fired[index] > step.passes_started:
            step.passes_started += 1
            self.scaling.clock.pass_started()

    def _start_count(self, passes: int):
        """[c] over workers, reduced as the gradients are (``start_statistics``'s wire)."""
        count = torch.tensor([float(passes)], dtype=self._stats_dtype, device=self._device)
        return self._allreduce_async(count, STATS_NAME + ".count")

    def _make_norm_hook(self, group_index: int, p: torch.Tensor, index: int):
        precondition = self.scaling.policy.statistics == "preconditioned"

        def hook(grad: torch.Tensor) -> None:
            if self._hooks_paused:
                return
            if self._switching and not self._per_pass():  # read once per worker, in the buckets
                self._count_gradient(index)
                return
            # The gradient of this backward pass alone (hooks run before accumulation into p.grad).
            g = self._precondition(p, grad, self.param_groups[group_index]) if precondition else grad
            step = self._step
            # On the CPU a float: no tensor op per pass and parameter beyond the norm itself.
            step.norms[group_index].append(cpu_norm(g) if g.device.type == "cpu" and not g.is_sparse
                                           else self._norm(g))
            self._count_gradient(index)
            step.fired_total += 1
            if step.fired_total == self._all_gradients and step.stats_handle is None \
                    and self._sends_at_last_gradient:
                # The step's last gradient: this hook runs before Horovod's hook enqueues its
                # allreduce, so the statistics are in Horovod's queue no later than the last
                # gradient and never wait a cycle for themselves. (Otherwise, with parameters
                # that got no gradient or a short step, synchronize() sends them.)
                step.stats_handle = self.start_statistics()
        return hook

    def _grad_norms(self, params: list[torch.Tensor], grads: list | None = None) -> torch.Tensor:
        """|p.grad| (or |grads[i]|) of each parameter, a float64 vector (``norms``): one fused
        kernel when the gradients allow it (dense, one dtype); adascale_adam's preconditioned
        gradients a chunk at a time (``_preconditioned_norms``)."""
        grads = [p.grad for p in params] if grads is None else grads
        if self.scaling.policy.statistics == "preconditioned":
            return torch.cat([self._preconditioned_norms(params[i:j], grads[i:j])
                              for i, j in _chunks(grads, PRECONDITION_CHUNK)])
        return norms(grads)

    def _preconditioned_norms(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
        """|P g| of each gradient (``_precondition``), a float64 vector. Dense gradients and
        second moments of one dtype and device (the usual case) are laid end to end in two
        scratch buffers and preconditioned there (``_denominator``), about ten tensor ops for
        the chunk and no large temporary (six ops per tensor, one tensor at a time, cost
        adascale_adam 1.24-1.36x the Transformer's k = 1 step); others one tensor at a time."""
        denominator = self._denominator(params, grads, lambda *kind: _scratch(*kind)[0])
        if denominator is None:
            return torch.cat([self._norm(self._precondition(p, g, self.param_groups[self._group_of[p]]))
                              for p, g in zip(params, grads)])
        scratch = _scratch(denominator.numel(), denominator.dtype, denominator.device)[1]
        torch.cat([g.reshape(-1) for g in grads], out=scratch).div_(denominator)
        return norms(list(scratch.split(tuple(g.numel() for g in grads))))

    def _denominator(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                     buffer) -> torch.Tensor | None:
        """sqrt(max(v_hat, floor)) + eps of ``params`` laid end to end, written into
        ``buffer(elements, dtype, device)``: ``core.precondition``'s denominator, its per-tensor
        floor (1 - beta2) / c2 x mean(v_hat) a segment sum. None where the flat path does not
        apply: no second moment yet (the first step), one holding no gradient, sparse or mixed
        dtypes and devices (``_precondition``, a tensor at a time, serves those)."""
        groups = [self.param_groups[self._group_of[p]] for p in params]
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

    def _quotient(self, flat: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        """P g of the gradients laid end to end in ``flat`` (a DDP bucket), P = 1 /
        ``denominator`` (``_denominator``'s, the same for the worker's gradient and the mean's),
        in this thread's scratch: one division."""
        _, scratch = _scratch(flat.numel(), flat.dtype, flat.device)
        return torch.div(flat, denominator, out=scratch)

    def _keep_norms(self, params: list[torch.Tensor], vector: torch.Tensor) -> None:
        """Keep a bucket's norms (``vector``, one per parameter) for this step's sums: as one
        vector when there is one group."""
        norms = self._step.norms
        if len(norms) == 1:
            norms[0].append(vector)
        else:
            for i, p in enumerate(params):
                norms[self._group_of[p]].append(vector[i:i + 1])

    def _take_norms(self, params: list[torch.Tensor], grads: list | None = None) -> None:
        """Keep the bucket's norms for this step's sums (``_keep_norms``)."""
        self._keep_norms(params, self._grad_norms(params, grads))

    def start_statistics(self):
        """[s..., c, w] over workers, asynchronously (the engine's ``_allreduce_async``). In the
        gradients' dtype the sums travel three times (``hvd_scale.reduce``: the wire);
        ``_summed`` turns the result into the float64 sum."""
        s = self.local_statistics()
        groups = len(self.param_groups)
        wire = torch.cat([*wire_copies(s[:groups]), s[groups:]]).to(self._stats_dtype)
        return self._allreduce_async(wire, STATS_NAME)

    def _finish_statistics(self, handle, counting: bool) -> None:
        """After the gradients' allreduce: p.grad made the mean micro-gradient, and the step's
        statistics (``pending``: [s..., c, w, q...]) or count kept for ``reduced_statistics``."""
        step = self._step
        if handle is None:
            self._to_mean_gradient(None)
        elif counting:
            count = self._wait_sum(handle).round()  # exact again after the average's rounding
            step.counted()
            self._to_mean_gradient(count[0])
            step.count = int(count.item())
        else:
            summed = self._summed(handle)
            self._to_mean_gradient(summed[len(self.param_groups)])
            # [s..., c, w, q...] (hvd_scale.reduce's step layout), on the gradients' device.
            step.pending = torch.cat([summed, self.mean_sqnorms(summed[len(self.param_groups)])])
        step.per_pass = None  # the next step decides at its first gradient (W may change)

    def _summed(self, handle) -> torch.Tensor:
        """[s..., c, w] summed over workers, float64, from ``start_statistics``'s handle."""
        groups = len(self.param_groups)
        reduced = self._wait_sum(handle)
        plain, wide, narrow, counts = (reduced[:groups], reduced[groups:2 * groups],
                                       reduced[2 * groups:3 * groups], reduced[3 * groups:])
        # Counts of micro-batches and samples, exact again after the average's rounding.
        return torch.cat([wire_sums(plain, wide, narrow, torch), counts.round()])

    def _norm(self, g: torch.Tensor) -> torch.Tensor:
        """[|g|] as a float64 vector of one (``norms``)."""
        return norms([g])

    def _precondition(self, p: torch.Tensor, grad: torch.Tensor, group: dict,
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

    def local_statistics(self) -> torch.Tensor:
        """[s_0, ..., s_{G-1}, c, w] for this worker (the engine's layout), float64: squares of
        the float64 norms, which no finite gradient overflows. c is the passes this worker
        actually took (a short step takes fewer than k). Read per pass (``_per_pass``): each
        pass's |g|^2, w = c; per worker: the one read of the sum G of its c passes, |G|^2 / c,
        w = 1."""
        device, step = self._device, self._step
        sums = [_vector(group_norms).square().sum() if group_norms
                else torch.zeros((), dtype=torch.float64, device=device)
                for group_norms in step.norms]
        passes = self._passes_taken()
        samples = passes
        if passes and not self._per_pass():
            sums, samples = [s / passes for s in sums], 1
        counts = torch.tensor([float(passes), float(samples)], dtype=torch.float64, device=device)
        step.counted()
        return torch.cat([torch.stack(sums), counts])

    def _passes_taken(self) -> int:
        """This worker's passes this step: with the norms taken in the engine's buckets, one
        if a gradient was sent (k = 1) or the engine's own count (Horovod's accumulation
        counters, ``_engine_passes``); else the tensor hooks' (the largest count over the
        hooked parameters, every one where this step reads per pass)."""
        step = self._step
        if self._bucketed and not self._per_pass():
            if self.backward_passes_per_step == 1:
                return min(1, step.fired_total)
            if self._counted_by_engine():
                return self._engine_passes()
        return max(step.fired, default=0)

    def mean_sqnorms(self, count: torch.Tensor | None = None) -> torch.Tensor:
        """|g_bar|^2 per group (float64) from the mean micro-gradient that p.grad holds after
        synchronize (``count``, n, is for an engine that measured the sum earlier: DDP's)."""
        out = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            out.append(self._grad_norms(params).square().sum() if params
                       else torch.zeros((), dtype=torch.float64, device=self._device))
        return torch.stack(out)

    def _to_mean_gradient(self, count: torch.Tensor | None) -> None:
        """Make p.grad the mean of the step's micro-gradients, in place (no copy).

        The engine leaves there, over workers, the mean (Horovod's op=Average, DDP) or the sum
        (op=Sum) of each worker's *sum* of its passes. The mean over all n micro-gradients is what Keras applies
        too, so one loss convention (each micro-batch's mean loss, not divided by k) gives the
        same update in both frameworks. ``count``: n, from the statistics (a device tensor); None
        without measurement, when every worker is taken to have made k passes.
        """
        k, workers = self.backward_passes_per_step, self.scaling.hvd.size()
        per_worker_mean = self._averaged
        # At k = 1 the average is already the mean unless some worker sent no pass: a rank
        # that called hvd.join() contributes zeros, and Horovod still divides by all workers.
        # On the CPU n is read for free and the multiply skipped when it changes nothing; on
        # a device the multiply is cheaper than the host transfer that would decide it.
        if per_worker_mean and k == 1 and (count is None or (
                count.device.type == "cpu" and count.item() == workers)):
            return
        grads = self._grads()
        if not grads:
            return
        if count is None:
            factor = 1.0 / (k if per_worker_mean else k * workers)
        else:  # on the device: no host transfer before the step's one
            factor = (workers if per_worker_mean else 1.0) / count.clamp(min=1)
        torch._foreach_mul_(grads, factor)

    def _grads_finite(self) -> bool:
        return all_finite(self._grads())

    def _count_scaler_skips(self, scaler) -> None:
        """A GradScaler that skips this optimizer's step (an overflow: its ``step`` never calls
        ours) has that step counted skipped right there, not at the next synchronizing pass (a
        run ending on a skipped step would never count it): this scaler's ``step`` is wrapped
        (on the instance; a scaler shared by several optimizers wraps once for each)."""
        inner = getattr(scaler, "step", None)
        if not callable(inner):
            return

        def step(optimizer, *args, **kwargs):
            record = self.scaling.run.policy
            result = inner(optimizer, *args, **kwargs)
            if optimizer is self and self.scaling.run.policy is record:  # ours never ran
                self._skipped_by_scaler()
            return result
        scaler.step = step

    def _skipped_by_scaler(self) -> None:
        """The step the scaler skipped: its gathered statistics dropped, counted skipped."""
        step = self._step
        if self.engine != "ddp" and not step.synchronized:
            # Horovod without synchronize() first: the scaler read the gradients before they
            # were averaged (its idiom synchronizes first); not ours to count.
            return
        # DDP sent the statistics with the last bucket, in backward; Horovod (and DDP's
        # synchronize()) gathered them: either way the step never consumed them.
        handle, step.stats_handle = step.stats_handle, None
        self._drop(handle)
        step.synchronized, step.pending, step.count = False, None, None
        self.scaling.skip()
