"""The norms of gradients, in torch: the statistics' one tensor operation (float64 results, no
overflow for finite tensors, sparse tensors coalesced, a float32 fast path on the CPU with an
underflow check), and an unmeasured step's finiteness check."""

from __future__ import annotations

import math
import operator

import numpy as np
import torch

from hvd_scale.reduce import SMALLEST_MEAN_SQUARE

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
