"""A policy's state: one frozen record, its dict and vector forms, and its versions.

A policy (``policies.py``) is a rule over this record: ``transition(state, statistics, scale) ->
(state, StepInfo)``. Every position in it is in units that do not depend on S (progress tau in
baseline steps, the estimator's sigma2 and mu2 per baseline batch), so a change of S (a worker
joining or leaving, k adapting, a resume at another layout, a short step) moves nothing by itself:
S is an argument of each step, never part of the state.

    steps      optimizer steps applied
    progress   tau, baseline steps of progress after the latest step
    skipped    steps measured but not applied (non-finite gradients)
    lr_factor  the factor the latest step applied to the baseline lr (None before any step)
    estimator  the EMAs of sigma2_hat and mu2_hat per parameter group, and their bias weight

Two forms travel: the dict (``to_dict``; torch's ``state_dict``, a broadcast object) holds the
policy's spec and the scale it was saved at beside the record; the vector (``to_vector``; Keras's
optimizer variable) holds the record alone, as floats:

    [steps, progress, skipped, lr_factor, updates, bias_weight, sigma2_biased[G], mu2_biased[G]]

(lr_factor nan: no step applied yet; counts are exact in float64 up to 2**53.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from .estimate import STATE_VERSION as ESTIMATOR_VERSION
from .estimate import EstimatorState, check_keys, check_scale

# 2: the factor the latest step applied (``lr_factor``) is part of the state.
# 3: adascale_adam's default became moments=progress; a version <= 2 adascale_adam checkpoint was
#    saved by the behaviour now spelled 'adascale_adam:moments=steps'.
# 4: adascale_adam's gain is capped at 8 by default (max_gain); a version <= 3 adascale_adam
#    checkpoint was saved by the behaviour now spelled 'adascale_adam:max_gain=inf'.
# 5: the EMAs hold the unclipped mu2_hat (a version 4 EMA of clipped values loads as it is: a
#    slightly high start that the EMA forgets over its horizon); warm-up's ramp is in progress
#    (warmup:steps=N, optimizer steps, became baseline_steps=N x S) and adascale_adam's
#    horizon=previous is gone: a checkpoint of either is refused, naming what to run instead.
VERSION = 5
KEYS = {"version", "policy", "steps", "progress", "skipped", "lr_factor", "estimator"}
HEAD = 6  # the vector's fields before the per-group estimates
STEPS_INDEX = 0     # steps applied, which a framework may read inside its graph
PROGRESS_INDEX = 1  # tau, which a framework may read inside its graph (a schedule's step)


@dataclasses.dataclass(frozen=True)
class PolicyState:
    """Everything a run's steps have changed (see the module's docstring)."""

    steps: int = 0
    progress: float = 0.0
    skipped: int = 0
    lr_factor: float | None = None
    estimator: EstimatorState = dataclasses.field(default_factory=EstimatorState)

    @property
    def groups(self) -> int | None:
        """Parameter groups the estimates are for (None before the first measured step)."""
        return None if self.estimator.sigma2_biased is None else self.estimator.sigma2_biased.size

    # -- the dict ------------------------------------------------------------------------------
    def to_dict(self, *, spec: str, scale: float, smoothing: float | None) -> dict:
        """The checkpoint form: the record, the spec that made it and the S it was saved at."""
        return {"version": VERSION, "policy": spec, "steps": self.steps, "progress": self.progress,
                "skipped": self.skipped, "lr_factor": self.lr_factor,
                "estimator": {"version": ESTIMATOR_VERSION, "scale": scale, "smoothing": smoothing,
                              **self.estimator.to_dict()}}

    @classmethod
    def from_dict(cls, d: Mapping, *, spec: str, accepts: Callable[[str], bool]) -> "PolicyState":
        """The record of a checkpoint saved by the policy ``spec`` (any version, migrated);
        ValueError naming the difference when ``accepts`` (``Policy.same_spec``) refuses the
        spec that saved it, or it is malformed."""
        d = migrate(d)
        if not accepts(d["policy"]):
            raise ValueError(f"checkpoint was saved by policy {d['policy']!r}, this job runs "
                             f"{spec!r}; build the policy from the same spec to resume")
        est = d["estimator"]
        check_keys("GainEstimator state", est, {"version", "scale", "smoothing", "sigma2_biased",
                                                 "mu2_biased", "bias_weight", "updates"})
        if est["version"] != ESTIMATOR_VERSION:
            raise ValueError(f"GainEstimator state version {est['version']!r} is not supported "
                             f"(expected {ESTIMATOR_VERSION})")
        check_scale(est["scale"])
        estimator = EstimatorState.from_dict({k: est[k] for k in ("sigma2_biased", "mu2_biased",
                                                                  "bias_weight", "updates")})
        return cls(int(d["steps"]), float(d["progress"]), int(d["skipped"]),
                   None if d["lr_factor"] is None else float(d["lr_factor"]), estimator)

    # -- the vector ----------------------------------------------------------------------------
    @staticmethod
    def vector_size(groups: int) -> int:
        return HEAD + 2 * groups

    def to_vector(self, groups: int) -> np.ndarray:
        """The record as ``vector_size(groups)`` floats (zeros for estimates not yet made)."""
        est = self.estimator
        if self.groups not in (None, groups):
            raise ValueError(f"the state vector holds {groups} parameter group(s), the policy has "
                             f"statistics for {self.groups}")
        zeros = np.zeros(groups)
        return np.concatenate([
            [self.steps, self.progress, self.skipped,
             math.nan if self.lr_factor is None else self.lr_factor, est.updates, est.bias_weight],
            zeros if est.sigma2_biased is None else est.sigma2_biased,
            zeros if est.mu2_biased is None else est.mu2_biased]).astype(np.float64)

    @classmethod
    def from_vector(cls, vector, groups: int) -> "PolicyState":
        v = np.asarray(vector, dtype=np.float64)
        if v.shape != (cls.vector_size(groups),):
            raise ValueError(f"a policy state vector for {groups} parameter group(s) holds "
                             f"{cls.vector_size(groups)} values, got shape {v.shape}")
        steps, progress, skipped, lr_factor, updates, bias_weight = v[:HEAD].tolist()
        measured = updates > 0
        estimator = EstimatorState(v[HEAD:HEAD + groups].copy() if measured else None,
                                   v[HEAD + groups:].copy() if measured else None,
                                   bias_weight, int(updates))
        return cls(int(steps), progress, int(skipped),
                   None if math.isnan(lr_factor) else lr_factor, estimator)


def migrate(d: Any) -> dict:
    """A checkpoint's dict of any version as version ``VERSION``'s, or ValueError saying why not.
    Old defaults are spelled out in the spec, so the saved behaviour is the one compared."""
    if isinstance(d, Mapping) and d.get("version") == 1 and "lr_factor" not in d:
        d = {**d, "version": 2, "lr_factor": None}
    check_keys("policy state", d, KEYS)
    version = d["version"]
    if version not in (2, 3, 4, VERSION):
        raise ValueError(f"policy state version {version!r} is not supported "
                         f"(expected {VERSION}, 4, 3, 2 or 1)")
    spec = d["policy"]
    if not isinstance(spec, str):
        raise ValueError(f"policy state: 'policy' must be a spec string, got {spec!r}")
    # The options as written (parse_spec would refuse an option that no longer exists).
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower().replace("-", "_")
    options = dict((k.strip(), v.strip()) for k, _, v in
                   (item.partition("=") for item in rest.split(",") if item.strip()))

    def spelled(**extra) -> str:
        items = [f"{k}={v}" for k, v in {**options, **extra}.items()]
        return name + (":" + ",".join(items) if items else "")

    if name == "adascale_adam" and version <= 3:
        if version == 2 and "moments" not in options:
            spec = spelled(moments="steps")
        elif options.get("moments", "progress") == "progress" and "max_gain" not in options:
            spec = spelled(max_gain="inf")
    if version <= 4 and name == "warmup" and "steps" in options:
        scale = d["estimator"].get("scale") if isinstance(d["estimator"], Mapping) else None
        steps = options.pop("steps")
        raise ValueError(
            f"checkpoint of {d['policy']!r}: warm-up's steps= counted optimizer steps, so the "
            f"ramp's length moved whenever S changed; it is now given in baseline steps. This "
            f"run's ramp was {steps} optimizer steps at S = {scale}: build the policy as "
            f"{spelled(baseline_steps='<' + steps + ' x S>')!r} and set the checkpoint's "
            "'policy' entry to the same spec to resume")
    if version <= 4 and name == "adascale_adam" and options.get("horizon") == "previous":
        raise ValueError(
            f"checkpoint of {d['policy']!r}: adascale_adam's horizon=previous was removed (B4 "
            "measured it equal to the default, and it re-derived the previous gain at the "
            "current S). To go on with the default horizon, set the checkpoint's 'policy' entry "
            "to the spec without it; tau and the estimates carry over")
    return {**d, "version": VERSION, "policy": spec}
