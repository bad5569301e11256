"""The torch optimizer's checkpoints and broadcasts: ``state_dict`` (the inner optimizer's and
the run's one record, ``hvd_scale.run``), ``load_state_dict`` (everything validated before
anything changes), ``broadcast_state``. A mixin of ``DistributedOptimizer`` (``optimizer.py``)."""

from __future__ import annotations

import dataclasses

import torch

from hvd_scale.adapters.adapt import check_passes
from hvd_scale.guard import SharpnessGuard
from hvd_scale.run import RunState


class Checkpoints:
    """The checkpoints' half of ``DistributedOptimizer``."""

    def state_dict(self) -> dict:
        """``{"inner": the wrapped optimizer's state_dict, "hvd_scale": the run's record}``
        (``hvd_scale.run``: the policy's state, S, k, the workers, ...), and ``"guard"``: the
        guard's latest estimate, with a guard."""
        state = {"inner": self._inner.state_dict(), "hvd_scale": self.scaling.state_dict()}
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
        self._inner.load_state_dict(state_dict["inner"])
        # torch's load_state_dict builds new group dicts and a new state: share them again.
        self.param_groups, self.state = self._inner.param_groups, self._inner.state
        if guard is not None and state_dict.get("guard") is not None:
            guard.load_state_dict(state_dict["guard"])
        self._drop(self._step.stats_handle)  # a statistics allreduce in flight: finish, then drop
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
        if self._step.fired_total or any(self._step.fired) or self._in_step():
            raise RuntimeError("broadcast_state() between backward passes of a step: call it "
                               "before the first backward pass or after step()")
        self.scaling.broadcast(root_rank)
        self._follow_passes()

