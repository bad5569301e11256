"""The torch optimizer: the hooks of ``adapters/protocol.py`` in torch, and nothing more (the
math is in the engine, the sequence of a step and everything that is not a tensor operation in
``adapters/core.py``):

* local statistics: the norm of each backward pass's own gradient (no ``.item()`` per parameter,
  no gradient-sized copy), taken before Horovod's in-place allreduce. With one pass per step,
  Horovod's own hook hands each gradient over and it is sent with its bucket right after one
  fused norm kernel over the bucket; with accumulation, a tensor hook on every parameter sees
  each pass's gradient before it is added into p.grad;
* the per-group sums of squared norms and the micro-batch count (the engine's layout) go out in
  one small asynchronous allreduce started just before Horovod waits on the gradients, so it is
  fused with the gradient traffic instead of adding a blocking collective;
* ``p.grad`` becomes the mean of the step's micro-gradients (in place, on the device), and
  |g_bar|^2 per group is taken from it; the only host transfer of the step brings these 2G + 1
  numbers back (``reduced_statistics``);
* the plan's lr (and Adam's settings) are set on each group for the inner step, then the user's
  values are restored, so torch lr schedulers keep working on the baseline lr (``apply_step``).

One gain for the whole model (the paper's choice): the engine sums sigma2 and mu2 over groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch

from hvd_scale.adapters import environment
from hvd_scale.adapters.adapt import ADAPT_EVERY, check_passes
from hvd_scale.adapters.core import USER_SETTINGS, Readout, Scaling, precondition, run_step
from hvd_scale.run import RunState
from hvd_scale.guard import ADAM_OPTIMIZERS, SharpnessGuard
from hvd_scale.moments import EPS_CORRECTED
from hvd_scale.policies import Policy
from hvd_scale.reduce import SMALLEST_MEAN_SQUARE, wire_copies, wire_sums

from .hessian import hessian_top_eigenvalue
from .process_set import ProcessSetBinding

STATS_NAME = "hvd_scale.stats"
SHARPNESS_NAME = "hvd_scale.sharpness"
# Without accumulation the norms are taken in buckets of gradients as Horovod sends them: a
# bucket goes out at this many tensors or elements (a bounded delay of the first allreduces).
# Each bucket costs a dozen torch ops whatever its size, so the tensor bound is loose (it was 16:
# many small tensors paid for it, benchmarks/README B2) and the elements bound splits large models.
BUCKET_TENSORS = 128
BUCKET_ELEMENTS = 1 << 18
_HALF = (torch.float16, torch.bfloat16)
_IS_SPARSE, _DTYPE = operator.attrgetter("is_sparse"), operator.attrgetter("dtype")


def norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """|t| of each tensor, as one float64 vector, which no finite tensor overflows (a float32
    sum of squares does from |t| ~ 1.8e19 on, and would call a finite step non-finite).

    A sparse tensor's norm is that of its coalesced values: its entries may repeat an index
    (an embedding's gradient lists each token once per occurrence, and Horovod's sparse
    allreduce concatenates the workers' entries), and the duplicates add up before squaring.
    On a GPU one fused kernel reads the tensors as they are and accumulates in float64 (no
    copy). On the CPU torch's float64 norm copies each tensor to float64 first (about 4x the
    time), so there the norms are taken in the tensors' own precision (half in float32),
    checked on the host in numpy (a torch op on a 120-vector costs as much as a small tensor's
    norm), and taken again in float64 only where one came out non-finite or so small that its
    squares underflowed in float32 (against the largest tensor: a conservative bound).
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    if len(tensors) == 1 and tensors[0].device.type == "cpu" and not tensors[0].is_sparse:
        return torch.tensor([cpu_norm(tensors[0])], dtype=torch.float64)
    # (map over C attribute getters: a bucket's per-tensor Python work is most of its cost)
    if any(map(_IS_SPARSE, tensors)):
        tensors = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    fused = len(set(map(_DTYPE, tensors))) == 1
    if tensors[0].device.type != "cpu":
        if fused:
            return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64))
        return torch.cat([torch._foreach_norm([t], 2, dtype=torch.float64)[0].view(1) for t in tensors])
    if tensors[0].dtype == torch.float64 and fused:
        return torch.stack(torch._foreach_norm(tensors, 2))

    def own(ts):  # half widened inside the kernel
        return torch._foreach_norm(ts, 2, dtype=torch.float32 if ts[0].dtype in _HALF else None)

    out = (torch.stack(own(tensors)) if fused
           else torch.cat([own([t])[0].double().view(1) for t in tensors])).detach().double()
    values = out.numpy()
    floor = _floor(max(map(torch.Tensor.numel, tensors)))
    redo = np.flatnonzero(~np.isfinite(values) | (values < floor))
    if redo.size:
        exact = [tensors[i] for i in redo.tolist()]
        out[torch.from_numpy(redo)] = (
            torch.stack(torch._foreach_norm(exact, 2, dtype=torch.float64)) if fused
            else torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in exact]))
    return out


def _floor(numel: int) -> float:
    """A float32 norm of ``numel`` elements below this may have lost digits to underflow: its
    mean square is below ``SMALLEST_MEAN_SQUARE`` (for a list, the largest tensor's: a bound)."""
    return math.sqrt(numel * SMALLEST_MEAN_SQUARE)


def cpu_norm(t: torch.Tensor) -> float:
    """``norms([t])`` of one dense CPU tensor as a Python float, the same value: the check is a
    float comparison instead of torch ops (a per-pass hook's norm: k x tensors a step)."""
    value = torch.linalg.vector_norm(t, dtype=torch.float32 if t.dtype in _HALF else None).item()
    if t.dtype == torch.float64 or (math.isfinite(value) and value >= _floor(t.numel())):
        return value
    return torch.linalg.vector_norm(t, dtype=torch.float64).item()


def _vector(items: list) -> torch.Tensor:
    """Norms kept as float64 vectors and Python floats (``cpu_norm``), in order, as one vector."""
    if all(isinstance(n, float) for n in items):
        return torch.tensor(items, dtype=torch.float64)
    return torch.cat([torch.tensor([n], dtype=torch.float64) if isinstance(n, float) else n
                      for n in items])


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is finite: an unmeasured step's only read of the gradients. Dense
    tensors of one dtype go through torch's fused check (the one GradScaler uses, here scaling
    by 1: no value changes), about 3x faster than their norms on 120 small tensors; others are
    checked by their float64 norms (``norms``: a large finite tensor is not called non-finite)."""
    if not tensors:
        return True
    if len({(t.dtype, t.device) for t in tensors}) > 1 or any(t.is_sparse for t in tensors):
        return bool(norms(tensors).isfinite().all())
    device = tensors[0].device
    found = torch.zeros(1, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, torch.ones(1, device=device))
    return found.item() == 0.0


def _check_op(op) -> None:
    """Only ops that combine the workers' gradients. Horovod's Adasum optimizer runs the inner
    optimizer's step inside each parameter's gradient hook, during backward, with the lr set
    at that moment, and combines the workers' updates instead of their gradients: no step is
    left for the policy's lr factor, a non-finite step cannot be skipped, and there is no
    averaged gradient to measure (its ``skip_synchronize()`` raises AssertionError)."""
    if op not in (hvd.Average, hvd.Sum):
        why = ("Horovod's Adasum optimizer applies the inner step inside backward and combines "
               "the workers' updates, leaving no step for the policy to scale and no averaged "
               "gradient to measure") if op == hvd.Adasum else "it does not average gradients"
        raise ValueError(f"op={'hvd.Adasum' if op == hvd.Adasum else repr(op)} is not supported: "
                         f"{why}; use op=hvd.Average (or hvd.Sum)")


def _number(value) -> float:
    """A group's setting as a float for the host (nan where it is none: ``check_lrs`` names it)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


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
    pending: torch.Tensor | None = None  # [s..., c, q...] after synchronize, until step()
    count: int | None = None  # unmeasured: the step's micro-gradients, after synchronize
    synchronized: bool = False  # synchronize() ran for this step
    sent: int = 0  # unmeasured, with Horovod's hooks: gradients handed to Horovod this step

    def counted(self) -> None:
        """The norms and counts went into the statistics: the next pass starts from zero."""
        for group_norms in self.norms:
            group_norms.clear()
        self.fired = [0] * len(self.fired)
        self.fired_total = self.passes_started = self.sent = 0


@dataclasses.dataclass(frozen=True)
class _Step:
    """One ``step()``'s own inputs, handed from hook to hook (``core.run_step``)."""

    closure: Any = None
    guard_loss: Any = None  # the lr guard's loss function (``step(guard_loss=...)``)


class DistributedOptimizer(Readout, torch.optim.Optimizer):
    """Wrap any torch optimizer: Horovod gradient averaging plus an lr scaling policy.

    Args:
        optimizer: the torch optimizer to wrap (its ``param_groups`` are shared, as in Horovod).
        named_parameters: as for ``hvd.DistributedOptimizer``.
        policy: a spec string (``"adascale"``, ``"warmup:fraction=0.055"``, ...), a ``Policy``, or
            None for ``$HVD_SCALE_POLICY``, else ``"adascale"``.
        backward_passes_per_step: k local backward passes per step. The step applies the *mean*
            of the micro-gradients over passes and workers (as Keras does): compute each
            micro-batch's mean loss and do not divide it by k. A short step (fewer passes on some
            or all workers: a leftover batch) counts the passes actually taken.
        scale: S; default workers x k (micro-batch = baseline batch). Give it when the baseline
            batch differs from a micro-batch: S = workers x k x micro_batch / baseline_batch.
        budget: T in baseline steps, for ``done()`` and ``warmup:fraction=``.
        grad_scaler: a ``torch.amp.GradScaler`` in use, so statistics are taken unscaled.
        measure: compute gradient statistics even when the policy does not need them (to log
            sigma2, mu2, gain for fixed rules). Default: when the policy needs them or metrics
            are logged.
        log_dir: write per-step metrics there on rank 0 (CSV, TensorBoard, a progress bar);
            default ``$HVD_SCALE_LOG_DIR`` (set by ``hvd-scale run --log-dir``), else none.
        nonfinite: a step whose gradients are not finite is skipped on every rank ("skip",
            counted in ``policy.skipped``) or raises FloatingPointError on every rank ("raise").
        guard: a ``hvd_scale.guard.SharpnessGuard``: every N steps the top Hessian eigenvalue is
            measured on each worker's batch and averaged, and lr x factor is capped at the
            optimizer's stability limit (SGD, Adam, AdamW). Its steps need
            ``step(guard_loss=fn)``: ``fn()`` returns this worker's loss on its current batch.
        adapt: "goodput" to adapt k while training: every ``adapt_every`` steps the ranks agree
            on the k in [1, max_passes] of largest predicted goodput (``hvd_scale.goodput``: the
            gain at the new S over the step time at that k, from this job's timings), with
            hysteresis. S follows k (the policy's factor and tau are the new S's); the training
            loop takes ``opt.backward_passes_per_step`` passes before each step (read it every
            step). The k in use is saved in ``state_dict()`` and restored on load.
        max_passes: the largest k adapt may choose (>= backward_passes_per_step).
        **horovod_options: compression, op, gradient_predivide_factor, groups, sparse_as_dense,
            process_set: passed to ``hvd.DistributedOptimizer``. With a ``process_set``, S, n, the
            policy agreement and the statistics are the set's, as the averaged gradients are.
            op=hvd.Sum is normalized like Average (the mean micro-gradient is applied);
            op=hvd.Adasum is refused (``_check_op``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 policy: str | Policy | None = None, backward_passes_per_step: int = 1, *,
                 scale: float | None = None, budget: float | None = None,
                 grad_scaler: Any = None, measure: bool | None = None, log_dir: str | None = None,
                 nonfinite: str = "skip", guard: SharpnessGuard | None = None,
                 adapt: str | None = None, max_passes: int | None = None,
                 adapt_every: int = ADAPT_EVERY, **horovod_options: Any):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer) or hasattr(optimizer, "_allreduce_delay"):
            raise TypeError("optimizer is already distributed: wrap the plain torch optimizer once")
        op = horovod_options.get("op", hvd.Average)
        process_set = horovod_options.get("process_set", hvd.global_process_set)
        # S, n, the agreement and the statistics live within the process set, as the gradients do.
        self._process_set = process_set
        self.scaling = Scaling(ProcessSetBinding(process_set), policy=policy,
                               passes=backward_passes_per_step, scale=scale, budget=budget, optimizer_name=type(optimizer).__name__,
                               framework="torch", groups=len(optimizer.param_groups),
                               base_lrs=[g.get("lr") for g in optimizer.param_groups],
                               measure=measure, log_dir=environment.log_dir(log_dir),
                               log_every=environment.log_every(),
                               nonfinite=nonfinite, short_steps=True, guard=guard,
                               check=lambda _: _check_op(op), elastic=environment.elastic(),
                               lr_names=[f"param_groups[{i}]['lr']"
                                         for i in range(len(optimizer.param_groups))],
                               eps_placement=EPS_CORRECTED, adapt=adapt,
                               max_passes=max_passes, adapt_every=adapt_every)
        self.backward_passes_per_step = backward_passes_per_step
        self.optimizer_name = type(optimizer).__name__
        self._measure = self.scaling.measure  # fixed for the optimizer's life (its hooks)
        self._op = op
        # Horovod's factors for the gradients (hvd.DistributedOptimizer's): the statistics match.
        predivide = horovod_options.get("gradient_predivide_factor", 1.0)
        self._factors = (1.0 / predivide, predivide) if op == hvd.Average else (1.0, 1.0)
        self._grad_scaler = grad_scaler

        self._hvd_opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters,
            backward_passes_per_step=backward_passes_per_step, **horovod_options)
        # Become a real torch Optimizer over the same groups (lr schedulers check isinstance and
        # read/write group["lr"]), then share the Horovod optimizer's groups and state outright.
        super().__init__(self._hvd_opt.param_groups, self._hvd_opt.defaults)
        self.param_groups = self._hvd_opt.param_groups
        self.state = self._hvd_opt.state

        float64 = any(p.dtype == torch.float64 for p in self._params())
        self._stats_dtype = torch.float64 if float64 else torch.float32  # on the wire
        self._skip_sync = False
        # Parameters Horovod and the hooks know: a later unfreezing is refused at the next step.
        self._frozen = [p for p in self._params() if not p.requires_grad]
        self._hooks = []
        trained = [(gi, p) for gi, group in enumerate(self.param_groups)
                   for p in group["params"] if p.requires_grad]
        self._trained = len(trained)
        self._all_gradients = len(trained) * backward_passes_per_step  # a full step's
        self._hooks_paused = False  # the guard's Hessian-vector products are not passes
        # One pass per step: p.grad is that pass's gradient when Horovod's own hook sends it, so
        # the norms are taken right there, a bucket at a time (one fused kernel per bucket, and
        # no hook of ours per tensor). With accumulation (or Horovod's groups=) each pass's
        # gradient is seen only by a tensor hook, before it is added into p.grad.
        # Horovod hooks the parameters only where it allreduces (not in a one-process job that
        # is not elastic): there the tensor hooks count the pass.
        # (adapt: k may change, so the tensor hooks serve every k.)
        self._bucketed = (self._measure and backward_passes_per_step == 1 and adapt is None
                          and horovod_options.get("groups") is None
                          and bool(self._hvd_opt._requires_update))
        self._sending_rest = False  # Horovod's synchronize() sends what backward did not produce
        # One process that is not elastic: Horovod allreduces no gradient, and the statistics
        # are their own sum (through Horovod they would wait a cycle of its thread every step).
        self._alone = hvd.size() == 1 and not self._hvd_opt._requires_update
        self._group_of = {p: gi for gi, p in trained}
        self._send = self._hvd_opt._allreduce_grad_async
        if self._bucketed:
            self._hvd_opt._allreduce_grad_async = self._send_in_buckets  # Horovod's hook calls it
        elif self._measure:
            for index, (gi, p) in enumerate(trained):
                self._hooks.append(p.register_hook(self._make_norm_hook(gi, p, index)))
        elif self._hvd_opt._requires_update:
            # Unmeasured, the micro-gradients are still counted (a short step's S and mean): from
            # Horovod's own counters, the count sent with the step's last gradient.
            self._hvd_opt._allreduce_grad_async = self._send_counting
        elif not self._alone or adapt is not None or backward_passes_per_step > 1:
            # One process, no Horovod hooks: a hook per parameter counts the passes.
            for index, (gi, p) in enumerate(trained):
                self._hooks.append(p.register_hook(self._make_count_hook(index)))
        self._hooked = len(self._hooks)
        self._step = self._new_step()

    def _new_step(self) -> _StepState:
        return _StepState(norms=[[] for _ in self.param_groups], fired=[0] * self._hooked)

    def _params(self):
        return (p for group in self.param_groups for p in group["params"])

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params() if p.grad is not None]

    @property
    def _device(self) -> torch.device:
        """Where the statistics are made: the gradients' device."""
        return next(self._params()).device

    @property
    def policy(self) -> Policy:
        """The engine's policy at the run's record (steps, tau, estimates): a view for reading."""
        return self.scaling.policy

    # -- statistics -----------------------------------------------------------------------------
    # A backward pass is counted by the parameters' own gradients, not by autograd's end-of-
    # backward callback: under reentrant activation checkpointing that callback belongs to the
    # nested backward of the first segment, and would end the pass too early. Each hooked
    # parameter gets one gradient per pass that reaches it, so this worker's passes are the
    # largest count (parameters without a gradient in some pass count less).
    def _make_count_hook(self, index: int):
        """Unmeasured, one process: count this parameter's gradients (the passes of a step)."""
        def hook(grad: torch.Tensor) -> None:
            if not self._hooks_paused:
                self._step.fired[index] += 1
        return hook

    def _send_counting(self, p: torch.Tensor):
        """Unmeasured, with Horovod's hooks: hand p's gradient to Horovod; before the step's
        last one, the micro-gradient count goes out (so it joins their allreduce)."""
        step = self._step
        if not self._sending_rest:
            step.sent += 1
            if step.sent == self._trained and step.stats_handle is None:
                step.stats_handle = self._start_count(self.backward_passes_per_step)
        return self._send(p)

    def _local_passes(self) -> int:
        """Unmeasured: the passes this worker took this step (Horovod's counters or the count
        hooks: the largest count over parameters; a short step takes fewer than k)."""
        if self._hooked:
            return max(self._step.fired, default=0)
        k, delay = self.backward_passes_per_step, self._hvd_opt._allreduce_delay
        if k == 1:
            return 1 if self._step.sent or any(p.grad is not None for p in self._params()) else 0
        return max((k - delay[p] for p in self._hvd_opt._requires_update), default=0)

    def _start_count(self, passes: int):
        """[c] over workers, reduced as the gradients are (``start_statistics``'s wire)."""
        count = torch.tensor([float(passes)], dtype=self._stats_dtype, device=self._device)
        if self._alone:
            return count
        return hvd.allreduce_async_(count, op=self._op, name=STATS_NAME + ".count",
                                    prescale_factor=self._factors[0],
                                    postscale_factor=self._factors[1],
                                    process_set=self._process_set)

    def _make_norm_hook(self, group_index: int, p: torch.Tensor, index: int):
        precondition = self.scaling.rule.statistics == "preconditioned"

        def hook(grad: torch.Tensor) -> None:
            if self._hooks_paused:
                return
            # The gradient of this backward pass alone (hooks run before accumulation into p.grad).
            g = self._precondition(p, grad, self.param_groups[group_index]) if precondition else grad
            step = self._step
            # On the CPU a float: no tensor op per pass and parameter beyond the norm itself.
            step.norms[group_index].append(cpu_norm(g) if g.device.type == "cpu" and not g.is_sparse
                                           else self._norm(g))
            step.fired[index] += 1
            step.fired_total += 1
            if step.fired[index] > step.passes_started:  # the first gradient of a new pass
                step.passes_started += 1
                self.scaling.clock.pass_started()
            if step.fired_total == self._all_gradients and step.stats_handle is None:
                # The step's last gradient: this hook runs before Horovod's hook enqueues its
                # allreduce, so the statistics are in Horovod's queue no later than the last
                # gradient and never wait a cycle for themselves. (Otherwise, with parameters
                # that got no gradient or a short step, synchronize() sends them.)
                step.stats_handle = self.start_statistics()
        return hook

    def _send_in_buckets(self, p: torch.Tensor):
        """Horovod's hook hands over each gradient of the step (k = 1) to be sent; it goes out
        with its bucket, after the bucket's norms. Returns what Horovod's hook records for p."""
        if self._sending_rest:
            return self._send(p)  # no gradient this step: Horovod sends zeros, nothing to measure
        step = self._step
        step.bucket.append(p)
        step.bucket_elements += p.grad.numel()
        step.fired_total += 1
        if (step.fired_total == self._all_gradients or len(step.bucket) >= BUCKET_TENSORS
                or step.bucket_elements >= BUCKET_ELEMENTS):
            return self._flush_bucket(current=p)
        return None, None  # a placeholder until its bucket is sent (below)

    def _flush_bucket(self, current: torch.Tensor | None = None):
        """Take the bucket's norms, then send its gradients (the statistics first when this is
        the step's last gradient). Returns ``current``'s (handle, ctx) for Horovod's hook."""
        step = self._step
        bucket, step.bucket, step.bucket_elements = step.bucket, [], 0
        if not bucket:
            return None, None
        self._take_norms(bucket)
        if step.fired_total == self._all_gradients and step.stats_handle is None:
            step.stats_handle = self.start_statistics()
        handles, result = self._hvd_opt._handles, (None, None)
        for p in bucket:
            sent = self._send(p)
            if p is current:
                result = sent
            else:
                handles[p] = sent
        return result

    def _grad_norms(self, params: list[torch.Tensor]) -> torch.Tensor:
        """|p.grad| of each parameter, a float64 vector (``norms``): one fused kernel when the
        gradients allow it (dense, one dtype); adascale_adam's preconditioned gradients one at a
        time (one alive at a time, not the whole model's)."""
        grads = [p.grad for p in params]
        if self.scaling.rule.statistics == "preconditioned":
            return torch.cat([self._norm(self._precondition(p, g, self.param_groups[self._group_of[p]]))
                              for p, g in zip(params, grads)])
        return norms(grads)

    def _take_norms(self, params: list[torch.Tensor]) -> None:
        """Keep the bucket's norms for this step's sums: as one vector when there is one group."""
        vector = self._grad_norms(params)
        norms = self._step.norms
        if len(norms) == 1:
            norms[0].append(vector)
        else:
            for i, p in enumerate(params):
                norms[self._group_of[p]].append(vector[i:i + 1])

    def start_statistics(self):
        """[s..., c] over workers, asynchronously, reduced exactly as the gradients are (their op,
        pre/postscale factors and dtype): Horovod fuses only tensors that agree on these, so the
        statistics join the gradients' allreduce instead of being a collective of their own.
        In the gradients' dtype the sums travel three times (``hvd_scale.reduce``: the wire);
        ``_summed`` turns the result into the float64 sum."""
        s = self.local_statistics()
        groups = len(self.param_groups)
        wire = torch.cat([*wire_copies(s[:groups]), s[groups:]]).to(self._stats_dtype)
        if self._alone:
            return wire  # the sum over one worker (Horovod's factors multiply to 1)
        return hvd.allreduce_async_(wire, op=self._op, name=STATS_NAME,
                                    prescale_factor=self._factors[0], postscale_factor=self._factors[1],
                                    process_set=self._process_set)

    def _summed(self, reduced: torch.Tensor) -> torch.Tensor:
        """[s..., c] summed over workers, float64, from what ``start_statistics`` reduced."""
        groups = len(self.param_groups)
        reduced = reduced.double()
        if self._op == hvd.Average:
            reduced.mul_(self.scaling.hvd.size())
        plain, wide, narrow, count = (reduced[:groups], reduced[groups:2 * groups],
                                      reduced[2 * groups:3 * groups], reduced[3 * groups:])
        # A count of micro-batches, exact again after the average's rounding.
        return torch.cat([wire_sums(plain, wide, narrow, torch), count.round()])

    def _norm(self, g: torch.Tensor) -> torch.Tensor:
        """[|g|] as a float64 vector of one (``norms``)."""
        return norms([g])

    def _precondition(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """g / (sqrt(v_hat) + eps) for adascale_adam (Adam's second moment before this step)."""
        state = self.state.get(p)
        if not state or "exp_avg_sq" not in state:
            return grad  # first step: no second moment yet, the plain gradient
        bias_correction2 = self.policy.second_moment_correction(group["betas"][1], float(state["step"]))
        if bias_correction2 == 0.0:
            return grad  # v holds no gradient yet
        return precondition(grad, state["exp_avg_sq"], bias_correction2, group["eps"], torch.Tensor.sqrt_)

    def local_statistics(self) -> torch.Tensor:
        """[s_0, ..., s_{G-1}, c] for this worker (the engine's layout), float64: squares of the
        float64 norms, which no finite gradient overflows. c is the passes this worker actually
        took (a short step takes fewer than k)."""
        device, step = self._device, self._step
        sums = [_vector(group_norms).square().sum() if group_norms
                else torch.zeros((), dtype=torch.float64, device=device)
                for group_norms in step.norms]
        passes = min(1, step.fired_total) if self._bucketed else max(step.fired, default=0)
        count = torch.tensor(float(passes), dtype=torch.float64, device=device)
        step.counted()
        return torch.stack(sums + [count])

    def mean_sqnorms(self) -> torch.Tensor:
        """|g_bar|^2 per group (float64) from the mean micro-gradient that p.grad holds after
        synchronize."""
        out = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            out.append(self._grad_norms(params).square().sum() if params
                       else torch.zeros((), dtype=torch.float64, device=self._device))
        return torch.stack(out)

    def _to_mean_gradient(self, count: torch.Tensor | None) -> None:
        """Make p.grad the mean of the step's micro-gradients, in place (no copy).

        Horovod leaves there, over workers, the mean (op=Average) or the sum (op=Sum) of each
        worker's *sum* of its passes. The mean over all n micro-gradients is what Keras applies
        too, so one loss convention (each micro-batch's mean loss, not divided by k) gives the
        same update in both frameworks. ``count``: n, from the statistics (a device tensor); None
        without measurement, when every worker is taken to have made k passes.
        """
        k, workers = self.backward_passes_per_step, self.scaling.hvd.size()
        per_worker_mean = self._op == hvd.Average
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

    # -- the Horovod protocol -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the gradient allreduce (and the statistics'); as ``hvd.DistributedOptimizer``.
        Afterwards p.grad holds the mean micro-gradient (see ``_to_mean_gradient``)."""
        self._check_no_parameter_unfrozen()
        self.scaling.clock.waiting()
        step = self._step
        if step.pending is not None or step.count is not None:
            # The previous step's statistics were never used: its step was skipped (AMP overflow).
            self.scaling.skip()
            step.pending = step.count = None
        self._flush_bucket()  # gradients still waiting in a bucket (some got none this step)
        handle, step.stats_handle = step.stats_handle, None
        if self._measure and handle is None:
            # Fewer gradients than every parameter x k passes: send the statistics now.
            handle = self.start_statistics()
        counting = not self._measure and (self._hooked or self._hvd_opt._requires_update)
        if counting and handle is None:  # a short step, or one process: the count now
            handle = self._start_count(self._local_passes())
        self._sending_rest = True
        try:
            self._hvd_opt.synchronize()
        finally:
            self._sending_rest = False
        if handle is None:
            self._to_mean_gradient(None)
        elif counting:
            reduced = (handle if torch.is_tensor(handle) else hvd.synchronize(handle)).double()
            if self._op == hvd.Average:
                reduced.mul_(self.scaling.hvd.size())
            count = reduced.round()
            step.counted()
            self._to_mean_gradient(count[0])
            step.count = int(count.item())
        else:
            summed = self._summed(handle if torch.is_tensor(handle) else hvd.synchronize(handle))
            self._to_mean_gradient(summed[len(self.param_groups)])
            # [s..., c, q...] (hvd_scale.reduce's step layout), still on the gradients' device.
            step.pending = torch.cat([summed, self.mean_sqnorms()])
        step.synchronized = True
        self.scaling.clock.waited()

    def _check_no_parameter_unfrozen(self) -> None:
        """A parameter made trainable after the optimizer was built has neither Horovod's
        allreduce nor a norm hook: its workers would drift apart and the statistics miss it."""
        unfrozen = [p for p in self._frozen if p.requires_grad]
        if unfrozen:
            shapes = [tuple(p.shape) for p in unfrozen]
            raise ValueError(f"hvd_scale: {len(unfrozen)} parameter(s) of shape(s) {shapes} were "
                             "made trainable after DistributedOptimizer was built; Horovod would "
                             "not average their gradients and the statistics would miss them. "
                             "Build the optimizer again (DistributedOptimizer(...)) after changing "
                             "requires_grad, then load its state_dict")

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``opt.synchronize(); ...; with opt.skip_synchronize(): opt.step()`` (AMP, clipping)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    # -- torch.optim.Optimizer ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, guard_loss=None):
        """Synchronize, let the policy plan the step, and apply it (``core.run_step``).

        A step whose gradients are not finite is skipped on every rank: weights, optimizer state,
        statistics and progress stay as they were (``policy.skipped`` counts it). A group's lr
        that has become negative or not finite raises ValueError naming the group, with nothing
        applied or counted (``Scaling.check_lrs``).
        ``guard_loss``: with a ``guard``, a function returning this worker's loss on its current
        batch (a fresh forward pass; no backward), called on the guard's steps only.
        """
        result = run_step(self, _Step(closure, guard_loss))
        self.scaling.clock.ended()
        self.set_passes(self.scaling.adapted_passes())
        return result

    def set_passes(self, passes: int) -> None:
        """Take k backward passes per step from the next step on; call it on every rank at the
        same step, between steps (adapt="goodput" does). S follows in proportion (the policy's
        factor and tau's advance are the new S's), and so do Horovod's accumulation counters."""
        k = check_passes(passes)
        if k == self.backward_passes_per_step:
            return
        if self._step.fired_total or any(self._step.fired) or self._hvd_opt._handles:
            raise RuntimeError("set_passes() between backward passes of a step: call it after "
                               "step() and before the next step's first backward pass")
        if k > 1 and self._bucketed:
            raise ValueError(f"set_passes({k}): this optimizer was built for one pass per step "
                             "with its norms taken in Horovod's buckets; build it with "
                             "backward_passes_per_step > 1 or adapt='goodput' to change k")
        self.scaling.set_passes(k)  # the run's record at the new k: refused there, if it cannot
        if not (self._measure or self._hooked or self._hvd_opt._requires_update):
            # One process, unmeasured, built at k = 1: from now on a short step can happen, and
            # its passes are counted.
            trained = [p for p in self._params() if p.requires_grad]
            self._hooks = [p.register_hook(self._make_count_hook(i)) for i, p in enumerate(trained)]
            self._hooked = len(self._hooks)
            self._step = self._new_step()
        self._follow_passes()

    def _follow_passes(self) -> None:
        """Horovod's accumulation and this optimizer's counts follow the record's k."""
        k = self.scaling.passes
        self._hvd_opt.set_backward_passes_per_step(k)
        self.backward_passes_per_step = k
        self._all_gradients = self._trained * k

    # -- the hooks of adapters/protocol.py ---------------------------------------------------------
    def reduced_statistics(self, step: _Step):
        """(step, statistics, finite, count): this step's [s..., c, q...] (a device tensor)
        after the gradients' allreduce, or None unmeasured, with the averaged gradient's
        finiteness then (True under a GradScaler, which checks it itself) and the
        micro-gradients counted. The guard's sharpness is measured here when due."""
        gathered = self._step
        if not (gathered.synchronized or self._skip_sync):
            self.synchronize()
        gathered.synchronized = False
        # Taken: a step that raises drops them.
        statistics, gathered.pending = gathered.pending, None
        count, gathered.count = gathered.count, None
        self.scaling.agree_on_state()  # once: a checkpoint loaded on some ranks only
        if self.scaling.guard_due():
            self._measure_sharpness(step.guard_loss)
        if statistics is not None:
            return step, statistics, True, None
        return step, None, self._grad_scaler is not None or self._grads_finite(), count

    def user_settings(self) -> list[list[float]]:
        """Each group's ``core.USER_SETTINGS``: torch corrects Adam's bias with each parameter's
        own step count, the group's first here; the decay is AdamW's decoupled one only."""
        rows = []
        for group in self.param_groups:
            # Only Adam's kind has betas and a step to correct by (no scan of SGD's parameters).
            state = next((self.state[p] for p in group["params"] if "step" in self.state.get(p, ())),
                         None) if "betas" in group else None
            betas = group.get("betas", (math.nan, math.nan))
            decoupled = group.get("decoupled_weight_decay", False) and "weight_decay" in group
            rows.append([_number(group["lr"]), _number(betas[0]), _number(betas[1]),
                         _number(group.get("eps", math.nan)),
                         _number(group["weight_decay"]) if decoupled else math.nan,
                         1.0 if state is None else float(state["step"]) + 1.0])
        assert len(rows[0]) == len(USER_SETTINGS)
        return rows

    def loss_scale(self) -> float | None:
        scaler = self._grad_scaler
        return scaler.get_scale() if scaler is not None and scaler.is_enabled() else None

    def on_host(self, fn, *args):
        """Eager: the statistics come to the host here, the step's one transfer."""
        return fn(*(a.tolist() if torch.is_tensor(a) else a for a in args))

    def apply_step(self, plan, step: _Step):
        """The inner step with each group's lr (and, for adascale_adam, betas, eps and decoupled
        decay: ``hvd_scale.moments``) from ``plan``; the user's values are put back after, so
        torch lr schedulers keep working on the baseline lr. A factor of 0: nothing applied."""
        plan = [[float(v) for v in row] for row in plan]
        if plan[0][0] == 0.0:
            return None
        keys = ("lr", "betas", "eps", "weight_decay")
        saved = [{k: group[k] for k in keys if k in group} for group in self.param_groups]
        try:
            for group, (_, lr, beta1, beta2, eps, decay) in zip(self.param_groups, plan):
                group["lr"] = lr
                if not math.isnan(beta1):
                    group.update(betas=(beta1, beta2), eps=eps)
                if not math.isnan(decay):
                    group["weight_decay"] = decay
            with self._hvd_opt.skip_synchronize():
                return self._hvd_opt.step(step.closure)
        finally:
            for group, user in zip(self.param_groups, saved):
                group.update(user)

    def _measure_sharpness(self, guard_loss) -> None:
        """The guard's estimate: this worker's top Hessian eigenvalue, averaged over workers."""
        guard, step = self.scaling.guard, self.scaling.run.policy.steps
        if not callable(guard_loss):
            raise ValueError(f"hvd_scale: the lr guard measures the sharpness before step "
                             f"{step + 1}: call opt.step(guard_loss=fn) with fn() returning this "
                             f"worker's loss on its current batch, got guard_loss={guard_loss!r}")
        group = self.param_groups[0]
        params = [p for p in self._params() if p.requires_grad]
        if self.optimizer_name in ADAM_OPTIMIZERS:
            # Adam's stability is about P^-1 H, P = diag(sqrt(v_hat) + eps): before its first
            # step there is no v_hat, and the next step measures instead (alike on every rank).
            if not all("exp_avg_sq" in self.state.get(p, {}) for p in params):
                return
            scaling = [self._precondition(p, torch.ones_like(p), group).sqrt_() for p in params]
            limits = {"beta1": group["betas"][0]}
        else:
            scaling = None
            limits = {"momentum": group.get("momentum", 0.0), "dampening": group.get("dampening", 0.0),
                      "nesterov": bool(group.get("nesterov", False))}
        self._hooks_paused = True
        try:
            with torch.enable_grad():
                local = hessian_top_eigenvalue(guard_loss, params, iterations=guard.iterations,
                                               tol=guard.tol, scaling=scaling, seed=step)
        finally:
            self._hooks_paused = False
        mean = hvd.allreduce(torch.tensor(local, dtype=torch.float64), op=hvd.Average,
                             name=SHARPNESS_NAME, process_set=self._process_set).item()
        if math.isfinite(mean):  # else this step's gradients overflow too: it will be skipped,
            guard.update(mean, step, optimizer=self.optimizer_name, **limits)  # and measured again

    def _grads_finite(self) -> bool:
        return all_finite(self._grads())

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Horovod's zero_grad() takes no argument; its check (no allreduce in flight) comes first.
        if self._hvd_opt._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        torch.optim.Optimizer.zero_grad(self._hvd_opt, set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """``{"inner": the wrapped optimizer's state_dict, "hvd_scale": the run's record}``
        (``hvd_scale.run``: the policy's state, S, k, the workers, ...), and ``"guard"``: the
        guard's latest estimate, with a guard."""
        state = {"inner": self._hvd_opt.state_dict(), "hvd_scale": self.scaling.state_dict()}
        if self.scaling.guard is not None:
            state["guard"] = self.scaling.guard.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore both parts; everything is validated before anything changes (here and in
        ``state_dict``): the groups and their parameters' count, each parameter's state tensors
        against its shape (``_check_inner_state``), the run's record (spec, version, groups; the
        saved k under adapt="goodput", within max_passes; ``hvd_scale.run.restored``).

        Load on every rank, or on rank 0 followed by ``broadcast_state`` on every rank: a rank
        that did not load keeps its own record (detected at the first step:
        ``Scaling.agree_on_state``; a later load on some ranks only is not)."""
        if not isinstance(state_dict, dict) or not {"inner", "hvd_scale"} <= set(state_dict) \
                or not set(state_dict) <= {"inner", "hvd_scale", "guard", "passes"}:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"expected a state_dict with keys ['hvd_scale', 'inner'] and "
                             f"optionally 'guard' (from DistributedOptimizer.state_dict()), "
                             f"got {got}")
        inner_groups = state_dict["inner"]["param_groups"]
        if len(inner_groups) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(inner_groups)} parameter group(s), this "
                             f"optimizer has {len(self.param_groups)}")
        self._check_inner_state(state_dict["inner"])
        saved = RunState.from_dict(state_dict["hvd_scale"], self.scaling.setup)
        if "passes" in state_dict:  # a version-5 checkpoint saved k beside the policy's state
            saved = dataclasses.replace(saved, passes=check_passes(state_dict["passes"]))
        run = self.scaling.restored(saved)
        guard = self.scaling.guard
        if guard is not None and state_dict.get("guard") is not None:
            restored = SharpnessGuard()
            restored.load_state_dict(state_dict["guard"])  # validated before anything changes
        self._hvd_opt.load_state_dict(state_dict["inner"])
        # torch's load_state_dict builds new group dicts and a new state: share them again.
        self.param_groups, self.state = self._hvd_opt.param_groups, self._hvd_opt.state
        if guard is not None and state_dict.get("guard") is not None:
            guard.load_state_dict(state_dict["guard"])
        handle = self._step.stats_handle
        if handle is not None and not torch.is_tensor(handle):  # in flight: finish, then drop
            hvd.synchronize(handle)
        self._step = self._new_step()
        self.scaling.run = run
        self._follow_passes()  # the saved k, where k adapts

    def _check_inner_state(self, inner: dict) -> None:
        """The inner optimizer's checkpoint must be of this model: torch loads state tensors of
        any shape and fails inside the first step (on the ranks that loaded it). Every group
        holds as many parameters, and every non-scalar state tensor has its parameter's shape,
        or one that broadcasts to it (factored states: Adafactor's row and column variances), or
        is one flat vector over all parameters (LBFGS's)."""
        params = list(self._params())
        total = sum(p.numel() for p in params)
        state = inner.get("state", {})
        for i, (saved, group) in enumerate(zip(inner["param_groups"], self.param_groups)):
            ids = saved.get("params", ())
            if len(ids) != len(group["params"]):
                raise ValueError(f"checkpoint's param_groups[{i}] has {len(ids)} parameter(s), "
                                 f"this optimizer's has {len(group['params'])}: the checkpoint "
                                 "is of another model")
            for j, (key, p) in enumerate(zip(ids, group["params"])):
                for name, value in state.get(key, {}).items():
                    if not torch.is_tensor(value) or value.dim() == 0:
                        continue  # step counts and other scalars
                    fits = value.dim() == p.dim() and all(
                        a in (1, b) for a, b in zip(value.shape, p.shape))
                    if not (fits or (value.dim() == 1 and value.numel() == total)):
                        raise ValueError(
                            f"checkpoint's state of param_groups[{i}] parameter {j} has "
                            f"{name!r} of shape {tuple(value.shape)}, this optimizer's parameter "
                            f"has shape {tuple(p.shape)}: the checkpoint is of another model")

    def sync_run(self, root_rank: int = 0) -> None:
        """Take ``root_rank``'s run record (``broadcast_state``, an elastic sync), k included."""
        if self._step.fired_total or any(self._step.fired) or self._hvd_opt._handles:
            raise RuntimeError("broadcast_state() between backward passes of a step: call it "
                               "before the first backward pass or after step()")
        self.scaling.broadcast(root_rank)
        self._follow_passes()

    def __repr__(self) -> str:
        return f"hvd_scale.DistributedOptimizer({self.optimizer_name}, policy={self.policy!r})"


def broadcast_state(model: torch.nn.Module, optimizer: DistributedOptimizer, root_rank: int = 0) -> None:
    """Broadcast the model, the optimizer state and the run's record (the policy's state and
    k under adapt="goodput") from root_rank."""
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    hvd.broadcast_optimizer_state(optimizer._hvd_opt, root_rank=root_rank)
    optimizer.sync_run(root_rank)
