"""FSDP2's engine for the torch optimizer (``engine.Engine``): a model sharded with
``torch.distributed.fsdp.fully_shard`` (1-D mesh, or HSDP's 2-D replicate x shard mesh). No
Horovod is imported.

    mesh = init_device_mesh("cpu", (W,))                 # or ("cuda", (R, W // R)): HSDP
    for block in model.blocks: fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()), model)   # --policy
    for step ...:
        for i, batch in enumerate(micro_batches):        # k = backward_passes_per_step
            model.set_requires_gradient_sync(i == k - 1)  # samples="workers" (the default)
            loss_fn(model(x), y).backward()              # each micro-batch's mean loss
        opt.step(); opt.zero_grad()

How the statistics ride FSDP2's own communication:

* every FSDP unit's reduce-scatter goes through ``_MeasuringReduceScatter`` (``FSDPModule.
  set_custom_reduce_scatter``, wrapping the unit's own comm, a user's included): its input is
  this rank's local, unreduced gradient of the unit laid out rank by rank (row r: every
  parameter's dim-0 chunk for rank r, padded: ``_Layout``), so its squared norm per parameter
  group is this worker's statistic, FSDP's pre-divide undone (``_predivide``: fp16 and float64
  reductions divide by about sqrt(W) before the collective). With the first k - 1 passes under
  ``set_requires_gradient_sync(False)`` that input is the sum G of the worker's passes
  (samples="workers": |G|^2 / c, one sample a worker); with a reduce-scatter every pass
  (torchtitan's default; samples="passes") each pass's own gradient, read for free (n = W k
  samples), with no tensor hook;
* after the reduction each rank's p.grad holds its shard of the mean over workers of each
  worker's sum: the shards' squared norms, summed over ranks, are |g_bar|^2 times (n / W)^2
  (with HSDP the replicas hold the same shard: divided by the replicate degree);
* [s..., c, w, q...] go out in one small float64 allreduce over the mesh's ranks (the only
  collective hvd_scale adds), at the end of the step's synchronizing backward pass, where p.grad
  is also made the mean of the step's micro-gradients (so clipping between backward and
  ``step()`` sees the mean, as under DDP); ``opt.synchronize()`` exists and finds nothing left.

The passes are counted by one hook on the model's outputs (a hook on the gradient of the root
module's forward outputs: one call per backward pass through the model). Every rank must take
the same passes in a step (FSDP2's all-gathers in each forward require it anyway); a short step
(fewer than k everywhere) is counted as such. A reduce-scatter the user set on a unit before
(``set_custom_reduce_scatter``) runs inside hvd_scale's; one set after is refused at the step.
On a mesh of one process FSDP2 runs no reduce-scatter: there the unit's all-reduce hook, which
sees the local gradient, is read instead.

What cannot be measured is refused on every rank before anything is applied (``*_REFUSED``).
The one private import, ``ReduceScatter`` and ``_get_gradient_divide_factors`` from
``torch.distributed.fsdp._fully_shard``, is pinned by tests/test_fsdp.py.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import CPUOffloadPolicy, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
from torch.utils._pytree import tree_flatten

from hvd_scale.adapters.adapt import ADAPT_EVERY
from hvd_scale.guard import SharpnessGuard
from hvd_scale.policies import Policy

from .ddp import TorchDistributedBinding
from .norms import norms
from .optimizer import TorchOptimizer, scaling_for

FSDP1_REFUSED = (
    "hvd_scale: FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) is not supported: its "
    "gradients are reduced inside flat parameters hvd_scale cannot read before the reduction. "
    "Shard the model with FSDP2 instead (torch.distributed.fsdp.fully_shard), whose engine is "
    "hvd_scale.adapters.torch.fsdp.DistributedOptimizer")

UNMEASURED_REFUSED = (
    "hvd_scale: measure=False under FSDP2: each rank holds only its shard of the gradient, so the "
    "ranks agree on a finite step and on the micro-batches counted only through the statistics' "
    "one allreduce. Leave measure unset (or True)")

# The next three: not refused for good, refused because this engine does not measure them yet.
PRECONDITIONED_REFUSED = (
    "hvd_scale: policy {policy!r} measures Adam-preconditioned gradients (g / (sqrt(v_hat) + eps)) "
    "and under FSDP2 each rank holds Adam's second moment for its shard only, while the "
    "statistic is read from the whole local gradient before the reduce-scatter: not measured by "
    "this engine yet. Use a policy over plain gradients (adascale, linear, sqrt, ...) or DDP")

GRAD_SCALER_REFUSED = (
    "hvd_scale: grad_scaler under FSDP2: a GradScaler checks for inf/nan on each rank's shard "
    "alone, so the ranks could disagree on skipping a step. Use bf16 (MixedPrecisionPolicy("
    "param_dtype=torch.bfloat16)) without a scaler; a non-finite step is skipped on every rank by "
    "the statistics")

GUARD_REFUSED = (
    "hvd_scale: the lr guard measures the Hessian's top eigenvalue over whole parameters, and "
    "under FSDP2 each rank holds shards: not supported by this engine. Build it without guard=")

CPU_OFFLOAD_REFUSED = (
    "hvd_scale: FSDP2 with CPUOffloadPolicy: the sharded gradients are copied to the host after "
    "the reduction (asynchronously with pinned memory), which this engine is not tested on. "
    "Shard without offload_policy")

SHARDED_PARAMS_REFUSED = (
    "hvd_scale: unit {unit!r} has {count} FSDP parameter groups (parameters on different meshes, "
    "shard_placement_fn): FSDP2 takes a custom reduce-scatter only for one group per unit, so "
    "its gradients cannot be measured. Shard each unit on one mesh")

MESH_REFUSED = (
    "hvd_scale: {what}. The statistics are summed over the FSDP2 mesh's ranks, which must be every "
    "rank of the job, each holding its own whole local gradient (a 1-D mesh, or HSDP's 2-D "
    "(replicate, shard) mesh; no tensor or expert parallelism inside the parameters)")

DIVIDE_REFUSED = (
    "hvd_scale: unit {unit!r} has a gradient divide factor of {factor} "
    "(set_gradient_divide_factor): p.grad would not hold the mean over workers, and the lr would "
    "be scaled for a gradient of another size. Leave FSDP2's default (the mean)")

READ_REFUSED = (
    "hvd_scale: FSDP2 statistics with samples={mode!r}: {what} (unit {unit!r}, {passes} "
    "backward pass(es) this step). With samples='workers' (the default from two workers on) run "
    "the first k - 1 passes under model.set_requires_gradient_sync(False) and the last with "
    "True; with samples='passes' reduce-scatter every pass (leave gradient sync on)")

UNLAID_REFUSED = (
    "hvd_scale: unit {unit!r}'s reduce-scatter holds {got} elements, not the {want} of its trained "
    "parameters: some got no gradient this pass, and with several optimizer parameter groups in "
    "the unit the statistic cannot tell which. Call model.set_reduce_scatter_unused_params(True)")

ALONE_HOOK_REFUSED = (
    "hvd_scale: unit {unit!r} has an all-reduce hook (set_all_reduce_hook) on a mesh of one "
    "process, where FSDP2 runs no reduce-scatter and hvd_scale reads the gradients in that hook. "
    "Leave it unset at one process")

REPLACED_REFUSED = (
    "hvd_scale: unit {unit!r}'s reduce-scatter is no longer hvd_scale's (set_custom_reduce_scatter, "
    "set_allocate_memory_from_process_group or set_symm_mem after DistributedOptimizer was built): "
    "its gradients would not be measured. Set your comm first; hvd_scale wraps it")


def _fsdp_units(model) -> list[tuple[str, Any]]:
    """(name, FSDPModule) of every module ``fully_shard`` was applied to, in module order."""
    return [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _state_groups(unit) -> list:
    return unit._get_fsdp_state()._fsdp_param_groups


class _Layout:
    """Where each trained parameter of an FSDP unit sits in a row of its reduce-scatter input:
    ``foreach_reduce`` copies every parameter's dim-0 chunk for rank r into row r (padded to W
    chunks: ``padded_sharded_param_size``), in the unit's parameter order, for the parameters
    that have a gradient."""

    def __init__(self, param_group, group_of: dict):
        trained = [fp for fp in param_group.fsdp_params if fp.sharded_param.requires_grad]
        self.params = [fp.sharded_param for fp in trained]
        self.lengths = [fp.padded_sharded_param_size.numel() for fp in trained]
        self.row = sum(self.lengths)
        self.groups = [group_of.get(p) for p in self.params]
        self.one_group = len(set(self.groups)) <= 1

    def norms(self, flat: torch.Tensor, world: int) -> tuple[list, torch.Tensor] | None:
        """(params, their norms) over the rows of ``flat`` (one norm for the whole unit when its
        parameters are in one optimizer group: padding is zeros); None where the input does not
        hold every trained parameter and several groups share the unit."""
        if self.one_group:
            return self.params[:1], norms([flat])
        if flat.numel() != self.row * world:
            return None
        rows, at, parts = flat.view(world, -1), 0, []
        for length in self.lengths:
            parts.append(rows[:, at:at + length])
            at += length
        return self.params, norms(parts)


class _MeasuringReduceScatter(ReduceScatter):
    """A unit's reduce-scatter, measured: the local gradient's norms per optimizer group taken
    from the input (FSDP's pre-divide undone) before ``inner`` (the unit's own comm) reduces it."""

    def __init__(self, engine, unit_name: str, param_group, inner: ReduceScatter):
        self._engine = weakref.ref(engine)  # the unit holds us; we must not hold the optimizer
        self.unit, self.param_group, self.inner = unit_name, param_group, inner
        self.calls = 0  # this step's reduce-scatters of the unit

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        engine = self._engine()
        if engine is not None:
            engine.measure(self, input_tensor, group.size())
        return self.inner(output_tensor, input_tensor, group, op, async_op=async_op)

    def alone(self, reduce_output: torch.Tensor) -> None:
        """A mesh of one: FSDP2 runs no reduce-scatter (the input is copied to the output,
        divided by nothing), and its all-reduce hook sees that output, the local gradient."""
        engine = self._engine()
        if engine is not None:
            engine.measure(self, reduce_output, 1)


class FSDPEngine:
    """``engine.Engine`` for an FSDP2 model: the reduce-scatters measured
    (``_MeasuringReduceScatter``), the passes counted at the model's outputs, the statistics'
    one allreduce over the mesh's ranks."""

    name = "fsdp"
    sharded = True
    averaged = True  # FSDP2's default reduction: the mean over the data-parallel ranks
    stats_dtype = torch.float64  # an allreduce of its own: exact counts, no overflow

    def __init__(self, model, inner: torch.optim.Optimizer):
        self.model, self.inner = model, inner
        self.units = _fsdp_units(model)
        meshes = {}
        for name, unit in self.units:
            groups = _state_groups(unit)
            if len(groups) > 1:
                raise ValueError(SHARDED_PARAMS_REFUSED.format(unit=name, count=len(groups)))
            for pg in groups:
                if isinstance(pg.offload_policy, CPUOffloadPolicy):
                    raise ValueError(CPU_OFFLOAD_REFUSED)
                if pg.gradient_divide_factor is not None:
                    raise ValueError(DIVIDE_REFUSED.format(unit=name, factor=pg.gradient_divide_factor))
                info = pg.mesh_info
                if not hasattr(info, "shard_process_group"):
                    raise ValueError(MESH_REFUSED.format(what=f"unit {name!r} replicates without "
                                                              "sharding (no reduce-scatter)"))
                meshes[id(info.mesh)] = info
                for fp in pg.fsdp_params:
                    spmd = getattr(fp, "_spmd_mesh", info.mesh)
                    if spmd.ndim != info.mesh.ndim:
                        raise ValueError(MESH_REFUSED.format(
                            what=f"unit {name!r}'s parameters are DTensors on a {spmd.ndim}-D mesh "
                                 f"beside FSDP's {info.mesh.ndim}-D one"))
        if not meshes:
            raise ValueError("hvd_scale: no FSDP2 unit holds a parameter in this model")
        infos = list(meshes.values())
        sizes = {(i.mesh.size(), getattr(i, "replicate_mesh_size", 1)) for i in infos}
        if len(sizes) != 1:
            raise ValueError(MESH_REFUSED.format(what=f"the units are on meshes of sizes {sorted(sizes)}"))
        (size, self.replicas), = sizes
        if size != dist.get_world_size():
            raise ValueError(MESH_REFUSED.format(what=f"the mesh has {size} of the job's "
                                                      f"{dist.get_world_size()} ranks"))
        self._group = None  # the default group: every rank of the mesh
        self.alone = size == 1  # FSDP2 reduce-scatters nothing: its all-reduce hook measures
        self._wrappers: list[_MeasuringReduceScatter] = []
        self._units: dict[int, Any] = {}
        self._handles: list = []
        self.statistics = None
        self._passes_k = 1
        self._reduced_in_pass = False
        self._queued = False

    # -- set-up --------------------------------------------------------------------------------
    def binding(self) -> TorchDistributedBinding:
        return TorchDistributedBinding(self._group)

    def attach(self, statistics) -> None:
        """Wrap every unit's reduce-scatter and count the passes at the model's outputs."""
        self.statistics = statistics
        self._passes_k = statistics.passes
        # samples="workers": the norms are read once per worker (the engine's one read, like
        # DDP's buckets); "passes": every pass's reduce-scatter is read.
        statistics.configure(bucketed=self.scaling.reads() == "workers")
        statistics.hook_parameters(None)
        try:
            for name, unit in self.units:
                for pg in _state_groups(unit):
                    wrapper = _MeasuringReduceScatter(self, name, pg, pg._reduce_scatter_comm)
                    unit.set_custom_reduce_scatter(wrapper)  # one FSDP group per unit (checked)
                    if self.alone:
                        if pg._all_reduce_hook is not None:
                            raise ValueError(ALONE_HOOK_REFUSED.format(unit=name))
                        unit.set_all_reduce_hook(wrapper.alone)
                    self._wrappers.append(wrapper)
                    self._units[id(wrapper)] = unit
            layouts = {}
            for wrapper in self._wrappers:
                layouts[id(wrapper)] = _Layout(wrapper.param_group, statistics.group_of)
            self._layouts = layouts
            self._handles.append(self.model.register_forward_hook(self._forward_hook))
        except BaseException:
            self.close()
            raise

    @property
    def scaling(self):
        return self.statistics.scaling

    def close(self) -> None:
        for wrapper in self._wrappers:
            if wrapper.param_group._reduce_scatter_comm is wrapper:
                self._units[id(wrapper)].set_custom_reduce_scatter(wrapper.inner)
            if wrapper.param_group._all_reduce_hook == wrapper.alone:
                wrapper.param_group._all_reduce_hook = None
        self._wrappers = []
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the hooks -------------------------------------------------------------------------------
    def _forward_hook(self, module, inputs, output) -> None:
        """A hook on the gradient of the root's outputs: one call per backward pass."""
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pass_started, mode="any")

    def _pass_started(self, _grad) -> None:
        statistics = self.statistics
        if statistics is None or statistics.paused:
            return
        step = statistics.step
        if not step.fired:
            step.fired.append(0)  # one counter: this hook's (no tensor hook on the parameters)
        statistics._count_gradient(0)
        self._reduced_in_pass = False
        if not self._queued:
            # After FSDP's own end-of-backward callback (queued at the root's pre-backward):
            # autograd runs callbacks queued while running them after those queued before.
            self._queued = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._end_of_pass))

    def _end_of_pass(self) -> None:
        """The end of a backward pass: where it completed the step's reduction (samples=
        "workers": its reduce-scatters ran; "passes": the k-th pass), the statistics go out and
        p.grad becomes the mean micro-gradient. A short step synchronizes at ``step()``."""
        self._queued = False
        statistics = self.statistics
        if statistics.step.synchronized:
            return
        if statistics.bucketed:
            due = self._reduced_in_pass
        else:
            due = max(statistics.step.fired, default=0) >= self._passes_k
        if due:
            self.synchronize()

    def measure(self, wrapper: _MeasuringReduceScatter, flat: torch.Tensor, world: int) -> None:
        """A unit's reduce-scatter input: this worker's gradient of the unit (this pass's, or
        the sum of its passes), its norms per group kept for the step's statistics."""
        statistics = self.statistics
        if statistics.paused:
            return
        pg = wrapper.param_group
        if pg.gradient_divide_factor is not None:
            raise ValueError(DIVIDE_REFUSED.format(unit=wrapper.unit, factor=pg.gradient_divide_factor))
        if statistics.step.synchronized:
            raise RuntimeError(
                f"hvd_scale: unit {wrapper.unit!r} reduce-scattered again after this step's "
                "statistics went out (a second synchronizing backward pass before opt.step()): "
                "with samples='workers' run the first k - 1 passes of a step under "
                "model.set_requires_gradient_sync(False), or build the optimizer with "
                "samples='passes' to reduce every pass")
        wrapper.calls += 1
        self._reduced_in_pass = True
        statistics.step.fired_total += 1
        found = self._layouts[id(wrapper)].norms(flat, world)
        if found is None:
            layout = self._layouts[id(wrapper)]
            raise ValueError(UNLAID_REFUSED.format(unit=wrapper.unit, got=flat.numel(),
                                                   want=layout.row * world))
        params, found = found
        pre = 1.0 if world == 1 else _predivide(pg, flat.dtype, flat.device)
        statistics.keep_norms(params, found * pre if pre != 1.0 else found)

    def _check_reads(self, passes: int) -> None:
        """Refused on every rank (the same loop on each) before the statistics go out: a step
        whose reduce-scatters do not match what its samples read."""
        mode = "workers" if self.statistics.bucketed else "passes"
        for wrapper in self._wrappers:
            if wrapper.param_group._reduce_scatter_comm is not wrapper:
                raise ValueError(REPLACED_REFUSED.format(unit=wrapper.unit))
        calls = {w.unit: w.calls for w in self._wrappers}
        if passes and not any(calls.values()):
            unit = next(iter(calls))
            raise ValueError(READ_REFUSED.format(
                mode=mode, unit=unit, passes=passes, what="no reduce-scatter ran: the step's "
                "gradients were never reduced (the last pass ran without gradient sync)"))
        for unit, count in calls.items():
            if mode == "workers" and count > 1:
                raise ValueError(READ_REFUSED.format(
                    mode=mode, unit=unit, passes=passes, what=f"{count} reduce-scatters, one a "
                    "pass: each worker's sum of its passes was never formed"))
            if mode == "passes" and 0 < count < passes:
                raise ValueError(READ_REFUSED.format(
                    mode=mode, unit=unit, passes=passes, what=f"{count} reduce-scatter(s): passes "
                    "accumulated without reduction cannot be read one by one"))

    # -- the contract ------------------------------------------------------------------------------
    def allreduce_async(self, tensor: torch.Tensor, name: str):
        return dist.all_reduce(tensor, group=self._group, async_op=True), tensor

    def wait_sum(self, handle) -> torch.Tensor:
        work, tensor = handle
        work.wait()
        return tensor.double()

    def drop(self, handle) -> None:
        if handle is not None:
            handle[0].wait()

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self._group)
        return tensor / dist.get_world_size(self._group)

    def gather(self) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        """The step's statistics out and back (one allreduce), p.grad the mean micro-gradient.
        Runs by itself at the end of the step's synchronizing backward pass; later calls (the
        user's ``opt.synchronize()``, ``step()``) find it done."""
        statistics = self.statistics
        step = statistics.step
        if step.synchronized:
            return
        self._queued = False
        statistics.check_no_parameter_unfrozen()
        passes = max(step.fired, default=0)
        self._check_reads(passes)
        self.scaling.clock.waiting()
        statistics.finish(statistics.start(), counting=False)
        for wrapper in self._wrappers:
            wrapper.calls = 0
        step.synchronized = True
        self.scaling.clock.waited()

    def skip_synchronize(self):
        return contextlib.nullcontext()

    def inner_step(self, closure):
        return self.inner.step(closure)

    def in_step(self) -> bool:
        return self.statistics.step.synchronized or any(w.calls for w in self._wrappers)

    def passes(self) -> int | None:
        return max(self.statistics.step.fired, default=0)

    def follow_passes(self, passes: int) -> None:
        self._passes_k = passes
        self.statistics.follow_passes(passes)

    def mean_sqnorms(self, count: torch.Tensor | None) -> torch.Tensor:
        """This rank's shards' squared norms per group (float64), of the reduced gradient as
        p.grad holds it (before the mean is made); HSDP's replicas hold the same shards, so each
        rank's share is divided by the replicate degree (the allreduce sums all ranks)."""
        statistics = self.statistics
        out = []
        for group in statistics.groups:
            shards = [_local(p.grad) for p in group["params"] if p.grad is not None]
            out.append(norms(shards).square().sum().to(statistics.device) if shards
                       else torch.zeros((), dtype=torch.float64, device=statistics.device))
        q = torch.stack(out)
        return q / self.replicas if self.replicas > 1 else q


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _predivide(pg, dtype: torch.dtype, device: torch.device) -> float:
    """What FSDP2 divided the reduce-scatter input by before the collective (torch's own rule,
    ``_get_gradient_divide_factors``: fp16 and float64 reductions by about sqrt(W), a power of
    two; fp32 and bf16 none)."""
    info = pg.mesh_info
    replicate = getattr(info, "replicate_process_group", None)
    pre, _, _, _ = _get_gradient_divide_factors(
        info.shard_process_group, replicate, dtype, device.type, pg.gradient_divide_factor,
        pg.force_sum_reduction_for_comms)
    return 1.0 if pre is None else float(pre)


def _check_parameters(optimizer, model) -> None:
    """The optimizer trains exactly the model's trained parameters (FSDP2's sharded ones)."""
    trained = {id(p): p for p in model.parameters() if p.requires_grad}
    held = {id(p): p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    stray = [tuple(p.shape) for key, p in held.items() if key not in trained]
    unheld = [tuple(p.shape) for key, p in trained.items() if key not in held]
    if stray or unheld:
        raise ValueError(
            "hvd_scale: the optimizer must train exactly the FSDP2 model's trained parameters "
            "(build it after fully_shard, over model.parameters()); "
            + (f"{len(stray)} of the optimizer's are not the model's (shapes {stray})" if stray
               else f"{len(unheld)} of the model's are not in the optimizer (shapes {unheld})"))


def check_model(model):
    """The FSDP2 module behind ``model`` (a ``torch.compile``d one too); FSDP1 refused."""
    if "FullyShardedDataParallel" in {cls.__name__ for cls in type(model).__mro__}:
        raise ValueError(FSDP1_REFUSED)
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if "FullyShardedDataParallel" in {cls.__name__ for cls in type(model).__mro__}:
        raise ValueError(FSDP1_REFUSED)
    if not isinstance(model, FSDPModule):
        raise TypeError(f"model must be sharded with torch.distributed.fsdp.fully_shard (an "
                        f"FSDPModule at its root), got {type(model).__name__}")
    return model


class DistributedOptimizer(TorchOptimizer):
    """Wrap any torch optimizer of a model sharded with FSDP2 (``fully_shard``): an lr scaling
    policy whose statistics ride FSDP2's reduce-scatters, plus one small allreduce a step.

    ``policy``, ``backward_passes_per_step``, ``scale``, ``budget``, ``measure``, ``log_dir``,
    ``nonfinite``, ``adapt``, ``max_passes``, ``adapt_every`` and ``samples`` are those of DDP's
    (``hvd_scale.adapters.torch.ddp.DistributedOptimizer``). With k > 1: samples="workers" (the
    default from two workers on) wants the first k - 1 passes under
    ``model.set_requires_gradient_sync(False)``; samples="passes" a reduce-scatter every pass
    (each pass's norm is read for free). A mismatch is refused at the step, on every rank.
    Refused here: FSDP1, ``measure=False``, a ``grad_scaler``, a ``guard``, adascale_adam's
    preconditioned statistics, CPU offload, per-parameter meshes, a custom divide factor, and
    meshes that are not the whole job (``*_REFUSED``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model, policy: str | Policy | None = None,
                 backward_passes_per_step: int = 1, *, scale: float | None = None,
                 budget: float | None = None, grad_scaler: Any = None,
                 measure: bool | None = None, log_dir: str | None = None, nonfinite: str = "skip",
                 guard: SharpnessGuard | None = None, adapt: str | None = None,
                 max_passes: int | None = None, adapt_every: int = ADAPT_EVERY,
                 samples: str = "auto"):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, TorchOptimizer):
            raise TypeError(f"optimizer must be a plain torch.optim.Optimizer (wrapped once), got "
                            f"{type(optimizer).__name__}")
        fsdp = check_model(model)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "dist.init_process_group(...) before building the optimizer")
        if measure is False:
            raise ValueError(UNMEASURED_REFUSED)
        if grad_scaler is not None:
            raise ValueError(GRAD_SCALER_REFUSED)
        if guard is not None:
            raise ValueError(GUARD_REFUSED)
        _check_parameters(optimizer, fsdp)
        engine = FSDPEngine(fsdp, optimizer)
        scaling = scaling_for(
            engine.binding(), optimizer, name="torch/fsdp", policy=policy,
            passes=backward_passes_per_step, scale=scale, budget=budget, measure=True,
            log_dir=log_dir, nonfinite=nonfinite, guard=None, adapt=adapt,
            max_passes=max_passes, adapt_every=adapt_every, samples=samples)
        if scaling.policy.statistics == "preconditioned":
            raise ValueError(PRECONDITIONED_REFUSED.format(policy=scaling.policy.spec))
        super().__init__(optimizer, engine, scaling, passes=backward_passes_per_step)
