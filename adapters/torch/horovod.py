"""Horovod's engine for the torch optimizer (``engine.Engine``; the optimizer, built from it, in
``optimizer.py``): ``hvd.DistributedOptimizer`` wrapped, its hooks and buckets.

* Horovod's own hook hands each gradient over after the step's last pass and it is sent with
  its bucket right after one fused norm kernel over the bucket (no hook of ours per tensor): at
  one pass per step that pass's gradient, with accumulation (samples="workers", the default
  from two workers on) the worker's sum of its passes; per-pass statistics with accumulation
  (samples="passes") take a tensor hook on every parameter, which sees each pass's gradient
  before it is added into p.grad (``statistics.py``);
* the statistics go out in one small asynchronous allreduce started just before Horovod waits
  on the gradients, reduced exactly as they are (op, factors, dtype), so Horovod fuses it with
  the gradient traffic instead of adding a blocking collective.
"""

from __future__ import annotations

import contextlib
from typing import Any

import horovod.torch as hvd
import torch

from hvd_scale.adapters import environment
from hvd_scale.adapters.adapt import ADAPT_EVERY
from hvd_scale.guard import SharpnessGuard
from hvd_scale.policies import Policy

from .optimizer import TorchOptimizer, scaling_for
from .statistics import StepStatistics
from .process_set import ProcessSetBinding

SHARPNESS_NAME = "hvd_scale.sharpness"
# Without accumulation the norms are taken in buckets of gradients as Horovod sends them: a
# bucket goes out at this many tensors or elements (a bounded delay of the first allreduces).
# Each bucket costs a dozen torch ops whatever its size, so the tensor bound is loose (it was 16:
# many small tensors paid for it, benchmarks/README B2) and the elements bound splits large models.
BUCKET_TENSORS = 128
BUCKET_ELEMENTS = 1 << 18


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


class HorovodEngine:
    """``engine.Engine`` over ``hvd.DistributedOptimizer``: its gradient hooks send each gradient
    (in buckets after their norms, where the norms are read there), the statistics join its
    allreduce (same op, factors and dtype: Horovod fuses them), its accumulation counters count
    the passes."""

    name = "horovod"
    sharded = False

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters, scaling, passes: int,
                 adapt: str | None, horovod_options: dict):
        self.scaling = scaling
        op = horovod_options.get("op", hvd.Average)
        # S, n, the agreement and the statistics live within the process set, as the gradients do.
        self.process_set = horovod_options.get("process_set", hvd.global_process_set)
        self.op = op
        self.averaged = op == hvd.Average  # else op=hvd.Sum: the sum over workers
        # Horovod's factors for the gradients (hvd.DistributedOptimizer's): the statistics match.
        predivide = horovod_options.get("gradient_predivide_factor", 1.0)
        self.factors = (1.0 / predivide, predivide) if op == hvd.Average else (1.0, 1.0)
        self.hvd_opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters, backward_passes_per_step=passes,
            **horovod_options)
        float64 = any(p.dtype == torch.float64 for g in optimizer.param_groups for p in g["params"])
        self.stats_dtype = torch.float64 if float64 else torch.float32  # fused with the gradients
        self.passes_now = passes
        measure = scaling.measure
        # When Horovod's own hook sends p.grad (after the step's last pass) the norms are taken
        # right there, a bucket at a time (one fused kernel per bucket, and no hook of ours per
        # tensor): each pass's gradient at k = 1; each worker's sum of its k passes with
        # samples="workers" (Horovod's counters count the passes). Per-pass statistics with
        # accumulation (or Horovod's groups=) see each pass's gradient only in a tensor hook,
        # before it is added into p.grad. Horovod hooks the parameters only where it allreduces
        # (not in a one-process job that is not elastic): there the tensor hooks count the pass.
        # (adapt: k may change, so per-pass statistics take the tensor hooks for every k.)
        # (Under elastic per worker wherever it was not refused: the world size may grow.)
        per_worker = scaling.setup.samples != "passes" if environment.elastic() else \
            scaling.reads() == "workers"
        self.bucketed = (measure and (passes == 1 and adapt is None or per_worker)
                         and horovod_options.get("groups") is None
                         and bool(self.hvd_opt._requires_update))
        # Horovod elastic: W changes in the process; a step at one worker with k >= 2 reads
        # every pass (``StepStatistics.per_pass``), by a norm hook on every parameter.
        self.switching = self.bucketed and environment.elastic()
        self.adapts = adapt is not None
        self.sending_rest = False  # Horovod's synchronize() sends what backward did not produce
        # One process that is not elastic: Horovod allreduces no gradient, and the statistics
        # are their own sum (through Horovod they would wait a cycle of its thread every step).
        self.alone = hvd.size() == 1 and not self.hvd_opt._requires_update
        self.send = self.hvd_opt._allreduce_grad_async  # Horovod's own, put back by close()
        self.skip_sync = False
        self.statistics: StepStatistics | None = None

    def attach(self, statistics: StepStatistics) -> None:
        """Horovod's hook made to send in buckets after their norms (or to count, unmeasured),
        and the statistics' tensor hooks where the passes are read there."""
        self.statistics = statistics
        statistics.configure(bucketed=self.bucketed, switching=self.switching,
                             # the statistics go out from the tensor hook of the step's last
                             # gradient, before Horovod's hook enqueues that gradient
                             send_at_last_gradient=True)
        kind = None
        if self.bucketed:
            self.hvd_opt._allreduce_grad_async = self._send_in_buckets  # Horovod's hook calls it
            if statistics.passes > 1 or self.adapts:
                # a count on a few parameters (each pass's start, for the step clock); under
                # elastic a norm hook on every one, which also counts
                kind = "norms" if self.switching else "count"
        elif statistics.measure:
            kind = "norms"
        elif self.hvd_opt._requires_update:
            # Unmeasured, the micro-gradients are still counted (a short step's S and mean): from
            # Horovod's own counters, the count sent with the step's last gradient.
            self.hvd_opt._allreduce_grad_async = self._send_counting
        elif not self.alone or self.adapts or statistics.passes > 1:
            kind = "count"  # one process, no Horovod hooks: a hook per parameter counts the passes
        statistics.hook_parameters(kind, few=self.bucketed and not self.switching)

    def close(self) -> None:
        """Horovod's hook sends its gradients itself again: its own method, no longer shadowed
        on the instance (the tensor hooks: ``StepStatistics.close``)."""
        vars(self.hvd_opt).pop("_allreduce_grad_async", None)

    # -- the Horovod protocol -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the gradient allreduce (and the statistics'); as ``hvd.DistributedOptimizer``.
        Afterwards p.grad holds the mean micro-gradient (``StepStatistics.to_mean_gradient``)."""
        statistics = self.statistics
        statistics.check_no_parameter_unfrozen()
        self.scaling.clock.waiting()
        step = statistics.step
        if step.pending is not None or step.count is not None:
            # The previous step's statistics were never used: its step was skipped (AMP overflow).
            self.scaling.skip()
            step.pending = step.count = None
        self._flush_bucket()  # gradients still waiting in a bucket (some got none this step)
        handle, step.stats_handle = step.stats_handle, None
        if statistics.measure and handle is None:
            # Fewer gradients than every parameter x k passes: send the statistics now.
            if self.bucketed and statistics.passes > 1 and not statistics.per_pass():
                statistics.take_norms(self._unsent())  # a short step's sums: read once, as here
            handle = statistics.start()
        counting = not statistics.measure and bool(statistics.hooked or self.hvd_opt._requires_update)
        if counting and handle is None:  # a short step, or one process: the count now
            handle = statistics.start_count(max(step.fired, default=0) if statistics.hooked
                                            else self.passes())
        self.sending_rest = True
        try:
            self.hvd_opt.synchronize()
        finally:
            self.sending_rest = False
        statistics.finish(handle, counting)
        step.synchronized = True
        self.scaling.clock.waited()

    @contextlib.contextmanager
    def skip_synchronize(self):
        self.skip_sync = True
        try:
            yield
        finally:
            self.skip_sync = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Horovod's zero_grad() takes no argument; its check (no allreduce in flight) comes first.
        if self.hvd_opt._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        torch.optim.Optimizer.zero_grad(self.hvd_opt, set_to_none=set_to_none)

    # -- the rest of engine.Engine ----------------------------------------------------------------
    def gather(self) -> None:
        if not (self.statistics.step.synchronized or self.skip_sync):
            self.synchronize()

    def inner_step(self, closure):
        with self.hvd_opt.skip_synchronize():
            return self.hvd_opt.step(closure)

    def in_step(self) -> bool:
        return bool(self.hvd_opt._handles)

    def passes(self) -> int | None:
        """The passes this worker took this step, by Horovod's counters (a short step takes
        fewer than k); None where Horovod hooks no parameter (one process)."""
        if not self.hvd_opt._requires_update:
            return None
        k, delay = self.passes_now, self.hvd_opt._allreduce_delay
        if k == 1:
            return 1 if self.statistics.step.sent or self.statistics.grads() else 0
        return max((k - delay[p] for p in self.hvd_opt._requires_update), default=0)

    def follow_passes(self, passes: int) -> None:
        """Horovod's accumulation and the statistics' counts follow k."""
        self.hvd_opt.set_backward_passes_per_step(passes)
        self.passes_now = passes
        self.statistics.follow_passes(passes)

    def mean_sqnorms(self, count: torch.Tensor | None) -> torch.Tensor:
        return self.statistics.mean_sqnorms()  # p.grad holds the mean micro-gradient

    def allreduce_async(self, tensor: torch.Tensor, name: str):
        """Reduced exactly as the gradients are (their op, pre/postscale factors and dtype):
        Horovod fuses only tensors that agree on these, so the statistics join the gradients'
        allreduce instead of being a collective of their own. One process: the tensor is its
        own sum (Horovod's factors multiply to 1)."""
        if self.alone:
            return tensor
        return hvd.allreduce_async_(tensor, op=self.op, name=name,
                                    prescale_factor=self.factors[0],
                                    postscale_factor=self.factors[1],
                                    process_set=self.process_set)

    def wait_sum(self, handle) -> torch.Tensor:
        """The sum over workers, float64 (op=Average: the result times the world size)."""
        reduced = (handle if torch.is_tensor(handle) else hvd.synchronize(handle)).double()
        if self.averaged:
            reduced.mul_(self.scaling.hvd.size())
        return reduced

    def drop(self, handle) -> None:
        if handle is not None and not torch.is_tensor(handle):  # in flight: finish, then drop
            hvd.synchronize(handle)

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(tensor, op=hvd.Average, name=SHARPNESS_NAME,
                             process_set=self.process_set)

    # -- Horovod's hook: counting, and the norms in its buckets ----------------------------------
    def _unsent(self) -> list[torch.Tensor]:
        """Gradients Horovod has not sent yet (a short step: fewer than k passes reached them);
        synchronize() sends them."""
        handles = self.hvd_opt._handles
        return [p for _, p in self.statistics.trained_params
                if p.grad is not None and handles.get(p, (None,))[0] is None]

    def _send_counting(self, p: torch.Tensor):
        """Unmeasured, with Horovod's hooks: hand p's gradient to Horovod; before the step's
        last one, the micro-gradient count goes out (so it joins their allreduce)."""
        statistics = self.statistics
        step = statistics.step
        if not self.sending_rest:
            step.sent += 1
            if step.sent == statistics.trained and step.stats_handle is None:
                step.stats_handle = statistics.start_count(self.passes_now)
        return self.send(p)

    def _send_in_buckets(self, p: torch.Tensor):
        """Horovod's hook hands over each gradient of the step (k = 1) to be sent; it goes out
        with its bucket, after the bucket's norms. Returns what Horovod's hook records for p."""
        statistics = self.statistics
        if self.sending_rest or statistics.per_pass():
            # No gradient this step (Horovod sends zeros, nothing to measure), or the norm
            # hooks read every pass of this step.
            return self.send(p)
        step = statistics.step
        step.bucket.append(p)
        step.bucket_elements += p.grad.numel()
        step.fired_total += 1
        if (step.fired_total == statistics.all_gradients or len(step.bucket) >= BUCKET_TENSORS
                or step.bucket_elements >= BUCKET_ELEMENTS):
            return self._flush_bucket(current=p)
        return None, None  # a placeholder until its bucket is sent (below)

    def _flush_bucket(self, current: torch.Tensor | None = None):
        """Take the bucket's norms, then send its gradients (the statistics first when this is
        the step's last gradient). Returns ``current``'s (handle, ctx) for Horovod's hook."""
        statistics = self.statistics
        step = statistics.step
        bucket, step.bucket, step.bucket_elements = step.bucket, [], 0
        if not bucket:
            return None, None
        statistics.take_norms(bucket)
        if step.fired_total == statistics.all_gradients and step.stats_handle is None:
            step.stats_handle = statistics.start()
        handles, result = self.hvd_opt._handles, (None, None)
        for p in bucket:
            sent = self.send(p)
            if p is current:
                result = sent
            else:
                handles[p] = sent
        return result


class DistributedOptimizer(TorchOptimizer):
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
            counted in ``opt.skipped``) or raises FloatingPointError on every rank ("raise").
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
        samples: what the statistics read (``hvd_scale.estimate.SAMPLES``): "workers" each
            worker's accumulated gradient once, in Horovod's buckets as it is sent (cost flat in
            k; W samples a step); "passes" every pass's gradient, by a tensor hook per parameter
            (n = W k samples, cost growing with k); "auto" (default) workers from two workers
            on. Both are unbiased; fewer samples make a noisier step estimate, which the EMA
            over ~1000 baseline batches averages (benchmarks/results/estimator_variance.md).
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
                 adapt_every: int = ADAPT_EVERY, samples: str = "auto", **horovod_options: Any):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer) or hasattr(optimizer, "_allreduce_delay"):
            raise TypeError("optimizer is already distributed: wrap the plain torch optimizer once")
        op = horovod_options.get("op", hvd.Average)
        scaling = scaling_for(
            ProcessSetBinding(horovod_options.get("process_set", hvd.global_process_set)),
            optimizer, name="torch", policy=policy, passes=backward_passes_per_step, scale=scale,
            budget=budget, measure=measure, log_dir=log_dir, nonfinite=nonfinite, guard=guard,
            adapt=adapt, max_passes=max_passes, adapt_every=adapt_every, samples=samples,
            elastic=environment.elastic(), check=lambda _: _check_op(op))
        self._horovod = HorovodEngine(optimizer, named_parameters, scaling,
                                      backward_passes_per_step, adapt, horovod_options)
        self._hvd_opt = self._horovod.hvd_opt  # Horovod's optimizer (its state_dict is saved)
        super().__init__(self._hvd_opt, self._horovod, scaling, passes=backward_passes_per_step,
                         grad_scaler=grad_scaler, optimizer_name=type(optimizer).__name__)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._horovod.zero_grad(set_to_none)


def broadcast_state(model: torch.nn.Module, optimizer, root_rank: int = 0) -> None:
    """Broadcast the model, the optimizer state and the run's record (the policy's state and
    k under adapt="goodput") from root_rank."""
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"broadcast_state(model, optimizer) takes the hvd_scale "
                        f"DistributedOptimizer, got {type(optimizer).__name__}: call it after "
                        "wrapping the optimizer (Horovod's scripts broadcast before wrapping; "
                        "with hvd_scale the optimizer's run record is broadcast too)")
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    broadcast_optimizer_state(optimizer, root_rank)
    optimizer.sync_run(root_rank)


def broadcast_optimizer_state(optimizer: DistributedOptimizer, root_rank: int = 0) -> None:
    """The torch optimizer's state and options from root_rank, as a single worker's would be.

    Horovod's ``broadcast_optimizer_state`` creates a missing state by a step on zero gradients:
    on a fresh optimizer every rank took it, and Adam counted it (t = 1 before its first update,
    AdamW decayed the weights once), one step ahead of the same script in one process or under
    torchrun. Where root_rank has no state every rank now takes that (none, and the root's
    options), and no step is taken; where it has one, Horovod's broadcast overwrites the state a
    fresh rank's zero step created, and that rank's weights (which AdamW's decay or SGD's
    weight_decay moved) and gradients (zeros) are put back as they were."""
    inner = optimizer._hvd_opt
    root = hvd.broadcast_object(
        {"state": any(inner.state.values()),
         "options": [{k: v for k, v in group.items() if k != "params"}
                     for group in inner.param_groups]},
        root_rank=root_rank, name="hvd_scale.optimizer_state")
    if not root["state"]:
        inner.state.clear()
        for group, options in zip(inner.param_groups, root["options"]):
            group.update(options)
        return
    params = [p for group in inner.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    weights = None if any(inner.state.values()) else [p.detach().clone() for p in params]
    hvd.broadcast_optimizer_state(inner, root_rank=root_rank)
    with torch.no_grad():
        for i, p in enumerate(params):
            p.grad = grads[i]
            if weights is not None:
                p.copy_(weights[i])
