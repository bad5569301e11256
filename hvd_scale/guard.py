"""An lr safety guard: keep lr x factor below the optimizer's stability limit (the seed's lr < 1/L).

Near a minimum the loss is a quadratic with Hessian H; along H's top eigenvector (eigenvalue
lambda, the local smoothness L) an optimizer with lr eta is stable only below a limit:

| optimizer                                | stable iff                                          |
|------------------------------------------|-----------------------------------------------------|
| gradient descent                         | eta < 2 / lambda                                    |
| heavy ball, momentum beta (torch's SGD)  | eta < 2 (1 + beta) / ((1 - dampening) lambda)       |
| Nesterov momentum beta                   | eta < 2 (1 + beta) / ((1 + 2 beta) lambda)          |
| Adam (beta1), lambda of P^-1 H,          | eta < (2 + 2 beta1) / ((1 - beta1) lambda)          |
|   P = diag(sqrt(v_hat) + eps)            |   (Cohen et al. 2022, "adaptive edge of stability") |

No scaling rule knows lambda, and lambda grows during training (progressive sharpening), which
is where linear scaling and warm-up diverge. The guard measures lambda every N steps (power
iteration on Hessian-vector products over each worker's batch, averaged across workers: an
adapter's job) and caps lr x factor at ``margin`` x the limit. The default 0.5 is the seed's
lr < 1/L for gradient descent: at the limit itself (margin 1) the top direction neither grows
nor shrinks, and on B1 (benchmarks/README.md) linear scaling capped there still diverged,
while capped at half of it trained. The cap changes the lr only: tau advances as the policy
says, so a capped step makes less progress than tau counts (the guard trades it for stability).

Everything here is host arithmetic on floats; ``SharpnessGuard`` holds the latest estimate.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

# ``metrics()`` of a job without a guard: no estimate, no cap.
UNGUARDED_METRICS = {"sharpness": math.nan, "lr_cap": math.inf}

# The optimizer families the limits above cover (class names; torch and Keras agree).
SGD_OPTIMIZERS = frozenset({"SGD"})
ADAM_OPTIMIZERS = frozenset({"Adam", "AdamW"})


def stability_limit(sharpness: float, *, optimizer: str = "SGD", momentum: float = 0.0,
                    dampening: float = 0.0, nesterov: bool = False,
                    beta1: float = 0.9) -> float:
    """The largest stable lr for curvature ``sharpness`` (inf when it is <= 0: no direction is
    curved upwards, nothing to cap). For Adam, ``sharpness`` is the preconditioned one."""
    if not math.isfinite(sharpness):
        raise ValueError(f"sharpness must be finite, got {sharpness!r}")
    if sharpness <= 0:
        return math.inf
    if optimizer in SGD_OPTIMIZERS:
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if nesterov:
            return 2 * (1 + momentum) / ((1 + 2 * momentum) * sharpness)
        return 2 * (1 + momentum) / ((1 - dampening) * sharpness)
    if optimizer in ADAM_OPTIMIZERS:
        if not 0 <= beta1 < 1:
            raise ValueError(f"beta1 must be in [0, 1), got {beta1!r}")
        return (2 + 2 * beta1) / ((1 - beta1) * sharpness)
    raise ValueError(f"the lr guard knows the stability limit of {sorted(SGD_OPTIMIZERS | ADAM_OPTIMIZERS)}, "
                     f"got optimizer {optimizer!r}")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class SharpnessGuard:
    """Caps lr x factor at ``margin`` x the stability limit for the latest sharpness estimate.

    Args:
        every: measure at steps 0, N, 2N, ... (0-based: the first step is always measured).
        iterations: power-iteration steps (Hessian-vector products) per measurement, at most.
        tol: stop early once the eigenvalue estimate changes by less than this, relatively.
        margin: fraction of the limit allowed, in (0, 1]; 0.5 (default) is the seed's 1/L for
            plain gradient descent.

    State (``state_dict``): the latest estimate and the step it was taken at; it travels with
    the optimizer's checkpoint (its "guard" entry, beside the run's record: ``hvd_scale.run``
    says why) and with a broadcast, so a resumed job keeps its cap until the next measurement.
    """

    def __init__(self, every: int = 50, *, iterations: int = 20, tol: float = 1e-3,
                 margin: float = 0.5):
        self.every = _positive_int("every", every)
        self.iterations = _positive_int("iterations", iterations)
        if not (isinstance(tol, (int, float)) and 0 < tol < 1):
            raise ValueError(f"tol must be in (0, 1), got {tol!r}")
        if not (isinstance(margin, (int, float)) and 0 < margin <= 1):
            raise ValueError(f"margin must be in (0, 1], got {margin!r}")
        self.tol, self.margin = float(tol), float(margin)
        self.sharpness = math.nan  # averaged over workers; nan until measured
        self.limit = math.inf      # margin x the stability limit (an lr)
        self.measured_at = -1      # the 0-based step of the latest estimate

    def due(self, step: int) -> bool:
        """Measure before the 0-based ``step`` (the same answer on every rank: steps agree)."""
        return step % self.every == 0 or (self.measured_at < 0 and step > 0)

    def update(self, sharpness: float, step: int, **optimizer: Any) -> None:
        """Take a new estimate (averaged over workers) for the optimizer described by
        ``stability_limit``'s keywords."""
        self.limit = self.margin * stability_limit(float(sharpness), **optimizer)
        self.sharpness, self.measured_at = float(sharpness), int(step)

    def max_factor(self, base_lr: float) -> float | None:
        """The largest lr factor the cap allows for this baseline lr (None: no cap yet)."""
        return None if math.isinf(self.limit) else self.limit / base_lr

    def metrics(self) -> dict[str, float]:
        """``sharpness`` and ``lr_cap`` (``hvd_scale.metrics.GUARD_METRICS``)."""
        return {"sharpness": self.sharpness, "lr_cap": self.limit}

    def state_dict(self) -> dict:
        return {"sharpness": self.sharpness, "limit": self.limit, "measured_at": self.measured_at}

    def load_state_dict(self, d: Mapping) -> None:
        if not isinstance(d, Mapping) or set(d) != {"sharpness", "limit", "measured_at"}:
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"guard state needs keys ['limit', 'measured_at', 'sharpness'], got {got}")
        limit = float(d["limit"])
        if not limit > 0:
            raise ValueError(f"guard state has limit {limit!r}: must be > 0 (inf: no cap)")
        self.sharpness, self.limit, self.measured_at = float(d["sharpness"]), limit, int(d["measured_at"])

    def __repr__(self) -> str:
        return (f"SharpnessGuard(every={self.every}, iterations={self.iterations}, "
                f"margin={self.margin:g}, sharpness={self.sharpness:.4g})")
