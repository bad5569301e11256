"""The spec language: the registry of policies, ``parse_spec`` and ``make_policy``, and how an
adapter resolves and agrees on its policy.

A policy is built from a spec string, ``name`` or ``name:key=value,...``, as given to ``--policy``
or ``HVD_SCALE_POLICY``; the rules themselves (and each one's options) are in ``policies.py``,
which imports nothing from here, so the state record (``state.py``) needs no policy either.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from .policies import (LEGW, AdaScale, AdaScaleAdam, FixedFactor, LinearScaling, NoScaling,
                       Policy, PowerScaling, SqrtScaling, WarmupScaling, check_budget)

POLICY_ENV = "HVD_SCALE_POLICY"
DEFAULT_POLICY = "adascale"

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (NoScaling, LinearScaling, SqrtScaling, PowerScaling, FixedFactor,
                              WarmupScaling, LEGW, AdaScale, AdaScaleAdam)
}


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """'warmup:fraction=0.055' -> ('warmup', {'fraction': 0.055}), validated against the registry."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"policy spec must be a non-empty string such as 'adascale' or "
                         f"'warmup:steps=500', got {spec!r}; valid policies: {available_policies()}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower().replace("-", "_")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid policies: {available_policies()}")
    return name, POLICIES[name].parse_options(rest, spec=spec.strip())


def available_policies() -> list[str]:
    return list(POLICIES)


def describe_policies() -> list[tuple[str, str, dict[str, str]]]:
    """(name, one-line description, {option: help}) for every policy."""
    return [(name, cls.description, {k: v[1] for k, v in cls.options.items()})
            for name, cls in POLICIES.items()]


def make_policy(spec: str | None = None, *, budget: float | None = None,
                optimizer: str | None = None) -> "Policy":
    """Build a policy from a spec string (None: ``$HVD_SCALE_POLICY``, else 'adascale'): a
    frozen configuration; S is an argument of its functions, the record the caller's.

    budget: T, the baseline steps to train for (needed by ``warmup:fraction=...``).
    optimizer: the optimizer's class name; a policy without theory for it raises ValueError.
    """
    if spec is None and os.environ.get(POLICY_ENV):
        try:
            return make_policy(os.environ[POLICY_ENV], budget=budget, optimizer=optimizer)
        except ValueError as e:  # say where the spec came from: the launcher or the shell
            raise ValueError(f"${POLICY_ENV}={os.environ[POLICY_ENV]!r} (set by hvd-scale run "
                             f"--policy, or in the environment): {e}") from e
    name, options = parse_spec(DEFAULT_POLICY if spec is None else spec)
    policy = POLICIES[name](budget=budget, **options)
    if optimizer is not None:
        policy.check_optimizer(optimizer)
    return policy


def resolve_policy(policy: "str | Policy | None", *, scale: float, budget: float | None = None,
                   optimizer: str | None = None, micro_gradients: int | None = None) -> "Policy":
    """What an adapter builds its policy with: a spec (or None: the environment) or a ``Policy``;
    checks the optimizer, and that the variance is measurable at S = ``scale`` with
    ``micro_gradients`` per step, over all workers."""
    check_budget(budget)  # also where a given Policy keeps its own
    given = policy
    if isinstance(policy, Policy):
        if optimizer is not None:
            policy.check_optimizer(optimizer)
    else:
        policy = make_policy(policy, budget=budget, optimizer=optimizer)
    check_policy_source(given, policy)
    if policy.uses_statistics and micro_gradients == 1 and scale > 1:
        raise ValueError(f"policy {policy.name!r} at scale {scale:g} needs at least 2 "
                         "micro-gradients per step to measure the variance, got 1 worker x 1 "
                         "backward pass: use backward_passes_per_step >= 2, more workers, or a "
                         "fixed policy")
    return policy


def check_policy_source(given: "str | Policy | None", policy: "Policy") -> None:
    """A policy named in the code (``given``) and another in ``$HVD_SCALE_POLICY`` (``hvd-scale run
    --policy``): the flag would lose without a word, so refuse naming both. The same policy in
    both is fine."""
    env = os.environ.get(POLICY_ENV)
    if given is None or not env:
        return
    flag = make_policy(None, budget=policy.budget)  # names $HVD_SCALE_POLICY on error
    if flag.spec != policy.spec:
        raise ValueError(f"the code asks for policy {policy.spec!r} while ${POLICY_ENV}={env!r} (set "
                         f"by hvd-scale run --policy, or in the environment) asks for {flag.spec!r}: "
                         "leave the policy to the flag (do not pass policy=, or pass policy=None) "
                         "or run without --policy")


def agree_across_ranks(build: "Callable[[], Policy]",
                       allgather: "Callable[[Any], list] | None",
                       settings: "Callable[[Policy], Mapping[str, Any]] | None" = None) -> "Policy":
    """Build the policy on every rank and check, with one ``allgather`` of (values, error), that
    all ranks succeeded with the same values: a bad or differing set-up then raises the same
    ValueError on every rank (naming each rank's value) instead of one rank failing while the
    others wait in a collective, or the replicas training apart.

    Compared: the policy's spec (name and options) and budget T, and what ``settings(policy)``
    adds (an adapter's S, passes, base lrs, ...: comparable, picklable values).
    ``allgather=None``: a single process."""
    built, error = None, None
    try:
        built = build()
    except (ValueError, TypeError) as e:
        error = f"{type(e).__name__}: {e}"
    if allgather is None:
        if error:
            raise ValueError(error)
        return built
    values = None if built is None else {"policy": built.spec, "budget": built.budget,
                                         **(settings(built) if settings else {})}
    seen = allgather((values, error))  # the one collective: everything travels in it
    errors = [f"rank {rank}: {err}" for rank, (_, err) in enumerate(seen) if err]
    if errors:
        raise ValueError("hvd_scale: bad policy set-up; " + "; ".join(errors))
    per_rank = [v for v, _ in seen]
    differ = {key: {rank: v.get(key) for rank, v in enumerate(per_rank)}
              for key in per_rank[0] if any(v.get(key) != per_rank[0][key] for v in per_rank)}
    if differ:
        problems = []
        if "policy" in differ:
            problems.append(f"the ranks run different policies {differ.pop('policy')}: give "
                            "every worker the same policy (--policy / HVD_SCALE_POLICY)")
        if differ:
            problems.append("the ranks were given different " + "; ".join(
                f"{key} {by_rank}" for key, by_rank in differ.items()) + ": every worker must "
                "build its optimizer with the same values (they set the lr of every step, and "
                "which collectives it runs)")
        raise ValueError("hvd_scale: " + "; ".join(problems))
    return built
