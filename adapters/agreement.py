"""What every rank must agree on: the policy at set-up, and its state at the first step.

A bad or differing set-up raises the same ValueError on every rank (naming each rank's value)
instead of one rank failing while the others wait in a collective, or the replicas training
apart. One allgather at set-up (``hvd_scale.spec.agree_across_ranks``), one at the first step;
none under Horovod elastic, where a worker that joins builds its optimizer while the others train
(a collective would wait forever) and the state comes from rank 0 at every sync instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from hvd_scale.estimate import check_scale
from hvd_scale.policies import Policy
from hvd_scale.run import RunState
from hvd_scale.spec import agree_across_ranks, resolve_policy


def check_base_lrs(base_lrs: Mapping[str, Any]) -> None:
    """The groups' baseline lrs, where they are numbers: finite and > 0 (the policy multiplies
    them)."""
    for name, lr in base_lrs.items():
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or \
                not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"{name} has lr={lr!r}: the baseline learning rate must be "
                             "a finite number > 0 (the policy multiplies it)")


def agreed_policy(hvd, *, policy: "str | Policy | None", scale: float,
                  budget: float | None, passes: int, optimizer_name: str,
                  base_lrs: Mapping[str, Any], check: Callable[[Policy], None] | None,
                  settings: Callable[[Policy], Mapping[str, Any]], elastic: bool) -> Policy:
    """The policy built on every rank for a run at S = ``scale``, checked (base lrs, the
    optimizer, ``check``) and compared with S and ``settings`` across ranks in one allgather."""

    def build() -> Policy:
        check_base_lrs(base_lrs)
        check_scale(scale)
        built = resolve_policy(policy, scale=scale, budget=budget, optimizer=optimizer_name,
                               micro_gradients=hvd.size() * passes)
        if check is not None:
            check(built)
        return built

    allgather = None if hvd.size() == 1 or elastic else \
        (lambda obj: hvd.allgather_object(obj, name="hvd_scale.spec"))
    return agree_across_ranks(build, allgather,
                              lambda built: {"scale": float(scale), **settings(built)})


def agree_on_state(hvd, run: RunState, elastic: bool) -> None:
    """Every rank must hold the same record (steps, tau, k, S). A checkpoint loaded on some
    ranks only (without ``broadcast_state`` after it) would train the replicas with different
    lrs and tau, or take different numbers of passes, silently; here it is a ValueError on every
    rank naming each rank's record."""
    if hvd.size() == 1 or elastic:
        return
    mine = (run.policy.steps, run.policy.progress, run.passes, run.scale)
    seen = hvd.allgather_object(mine, name="hvd_scale.state")
    if len(set(seen)) > 1:
        states = {rank: f"{steps} steps, tau {tau:g}, k {k}, S {scale:g}"
                  for rank, (steps, tau, k, scale) in enumerate(seen)}
        raise ValueError(f"hvd_scale: the ranks start with different run states {states}: "
                         "a checkpoint loaded on some ranks only? Load it on every rank, or on "
                         "rank 0 and then call broadcast_state(model, optimizer) on every rank")
