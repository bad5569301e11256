"""An adapter's policy state in checkpoints and broadcasts (the forms and versions themselves:
``hvd_scale.state``). Everything is validated before anything changes."""

from __future__ import annotations

from hvd_scale.guard import SharpnessGuard
from hvd_scale.policies import Policy, make_policy


def loaded_policy(policy: Policy, state: dict, groups: int) -> Policy:
    """A policy of ``policy``'s spec, scale and budget holding ``state`` (validated; ``policy``
    is not touched, so a bad checkpoint changes nothing)."""
    loaded = make_policy(policy.spec, scale=policy.scale, budget=policy.budget)
    loaded.load_state_dict(state)
    # The policy only compares with estimates it already has (none before the first step).
    if loaded.state.groups not in (None, groups):
        raise ValueError(f"checkpoint has statistics for {loaded.state.groups} parameter "
                         f"group(s), this optimizer has {groups}")
    return loaded


def broadcast(hvd, policy: Policy, guard: SharpnessGuard | None, groups: int,
              root_rank: int = 0) -> Policy:
    """``root_rank``'s policy state (and guard estimate) on every rank: the policy to hold."""
    state = hvd.broadcast_object(
        {"policy": policy.state_dict(), "guard": None if guard is None else guard.state_dict()},
        root_rank=root_rank, name="hvd_scale.policy_state")
    loaded = loaded_policy(policy, state["policy"], groups)
    if guard is not None and state["guard"] is not None:
        guard.load_state_dict(state["guard"])
    return loaded
