"""The torch optimizer's checkpoints: ``state_dict`` (the inner optimizer's and the run's one
record, ``hvd_scale.run``) and ``validated`` (everything a load needs, checked before anything
changes). Functions of the parts they read (the inner optimizer, ``core.Scaling``); the
optimizer (``optimizer.py``) applies what ``validated`` returns."""

from __future__ import annotations

import dataclasses

import torch

from hvd_scale.adapters.adapt import check_passes
from hvd_scale.guard import SharpnessGuard
from hvd_scale.run import RunState


def state_dict(inner: torch.optim.Optimizer, scaling) -> dict:
    """``{"inner": the wrapped optimizer's state_dict, "hvd_scale": the run's record}``
    (``hvd_scale.run``: the policy's state, S, k, the workers, ...), and ``"guard"``: the guard's
    latest estimate, with a guard."""
    state = {"inner": inner.state_dict(), "hvd_scale": scaling.state_dict()}
    if scaling.guard is not None:
        state["guard"] = scaling.guard.state_dict()
    return state


def validated(state_dict: dict, inner: torch.optim.Optimizer, scaling) -> RunState:
    """The run's record to take from ``state_dict``, after checking all of it against ``inner``
    and ``scaling`` (nothing changes here): the keys, the groups and their parameters' count,
    each parameter's state tensors against its shape (``check_inner_state``), the run's record
    (spec, version, groups; the saved k under adapt="goodput", within max_passes:
    ``hvd_scale.run.restored``) and the guard's state."""
    if not isinstance(state_dict, dict) or not {"inner", "hvd_scale"} <= set(state_dict) \
            or not set(state_dict) <= {"inner", "hvd_scale", "guard", "passes"}:
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"expected a state_dict with keys ['hvd_scale', 'inner'] and "
                         f"optionally 'guard' (from DistributedOptimizer.state_dict()), "
                         f"got {got}")
    inner_groups = state_dict["inner"]["param_groups"]
    if len(inner_groups) != len(inner.param_groups):
        raise ValueError(f"checkpoint has {len(inner_groups)} parameter group(s), this "
                         f"optimizer has {len(inner.param_groups)}")
    check_inner_state(state_dict["inner"], inner.param_groups)
    saved = RunState.from_dict(state_dict["hvd_scale"], scaling.setup)
    if "passes" in state_dict:  # a version-5 checkpoint saved k beside the policy's state
        saved = dataclasses.replace(saved, passes=check_passes(state_dict["passes"]))
    run = scaling.restored(saved)
    if scaling.guard is not None and state_dict.get("guard") is not None:
        SharpnessGuard().load_state_dict(state_dict["guard"])  # validated before anything changes
    return run


def check_inner_state(inner: dict, param_groups: list[dict]) -> None:
    """The inner optimizer's checkpoint must be of this model: torch loads state tensors of
    any shape and fails inside the first step (on the ranks that loaded it). Every group
    holds as many parameters, and every non-scalar state tensor has its parameter's shape,
    or one that broadcasts to it (factored states: Adafactor's row and column variances), or
    is one flat vector over all parameters (LBFGS's)."""
    params = [p for group in param_groups for p in group["params"]]
    total = sum(p.numel() for p in params)
    state = inner.get("state", {})
    for i, (saved, group) in enumerate(zip(inner["param_groups"], param_groups)):
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
