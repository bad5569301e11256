"""The lr guard's measurement in torch: the top eigenvalue of the Hessian by power iteration."""

from __future__ import annotations

import math

import torch


def hessian_top_eigenvalue(loss_fn, params: list[torch.Tensor], *, iterations: int = 20,
                           tol: float = 1e-3, scaling: list[torch.Tensor] | None = None,
                           seed: int = 0) -> float:
    """The largest eigenvalue of the Hessian of ``loss_fn()`` in ``params``, by power iteration.

    Each iteration is one Hessian-vector product, Hv = d(g . v)/dw, a second backward pass
    through the graph of one forward pass (kept between iterations). ``scaling``: per-parameter
    s, giving the eigenvalue of diag(s) H diag(s) instead (s = P^-1/2 for Adam's P^-1 H, same
    eigenvalues, symmetric). Power iteration finds the eigenvalue largest in magnitude: when
    that is negative, a second run on H - lambda_neg I finds the top one. Neither ``p.grad``
    nor Horovod's hooks see these passes (autograd.grad returns the products).
    """
    params = [p for p in params if p.requires_grad]
    loss = loss_fn()
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    used = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
    if not used:
        return 0.0  # the loss is linear (or constant) in the parameters: no curvature
    ps, gs = [params[i] for i in used], [grads[i] for i in used]
    ss = None if scaling is None else [scaling[i] for i in used]
    generator = torch.Generator().manual_seed(seed)

    def product(v: list[torch.Tensor]) -> list[torch.Tensor]:
        if ss is not None:
            v = torch._foreach_mul(v, ss)
        hv = torch.autograd.grad(gs, ps, grad_outputs=v, retain_graph=True)
        return list(hv) if ss is None else torch._foreach_mul(hv, ss)

    def dominant(shift: float) -> float:
        v = [torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p) for p in ps]
        torch._foreach_div_(v, torch.stack(torch._foreach_norm(v)).norm())
        estimate = math.nan
        for _ in range(iterations):
            hv = product(v)
            if shift:
                torch._foreach_add_(hv, v, alpha=-shift)
            new = float(sum((a * b).sum() for a, b in zip(v, hv)))  # Rayleigh quotient, |v| = 1
            norm = float(torch.stack(torch._foreach_norm(hv)).norm())
            if not math.isfinite(norm) or norm == 0.0:
                return new
            v = torch._foreach_div(hv, norm)
            converged = abs(new - estimate) <= tol * abs(new)
            estimate = new
            if converged:
                break
        return estimate

    top = dominant(0.0)
    if top < 0:  # the dominant eigenvalue is negative: the top one is lambda_neg + max(H - lambda_neg)
        top = top + dominant(top)
    return top
