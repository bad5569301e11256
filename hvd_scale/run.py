"""A run as one value: the record of everything a step changes, and the pure functions over it.

    RunState     the policy's record (``hvd_scale.state.PolicyState``: steps, tau, skipped, the
                 latest lr factor, the estimates) and the run's layout and step-to-step values:
                 S, k, the workers, whether statistics are taken, the skips in a row, the lr the
                 latest step applied, the noise scale's record (``hvd_scale.noise.NoiseState``);
                 one dict form and one vector form, each with its version
    Setup        what no step changes: the policy (a rule and its options), the parameter groups,
                 what a non-finite step does, whether short steps can happen, adapt's largest k,
                 what the statistics were asked to read (``samples=``)
    reads        (setup, run) -> "workers" | "passes": what a step's statistics read at the
                 record's layout (derived, never held: it follows W at every change)
    host_step    (setup, run, StepInputs) -> (run, plan, info): one optimizer step on the host
    relayout     (setup, run, passes=, workers=, scale=) -> run: a change of k or S
    restored     (setup, run, saved) -> run: a saved or broadcast record taken into this job

Every adapter holds one ``RunState`` (torch in Python, ``adapters.core.HeldRecord``; Keras in
one optimizer variable only, its vector, every Python view read from it when asked) and replaces
it with what these functions return, so a checkpoint, a broadcast or an elastic sync cannot
restore half of it. Three other things hold values a run produces, none of which is the record's
to carry:

    the lr guard's estimate   ``hvd_scale.guard.SharpnessGuard`` (torch, optional): saved and
                              broadcast beside the record (the optimizer's state_dict "guard",
                              ``Scaling.broadcast``), so the record's forms stay the same with
                              or without a guard
    the step clock's timings  ``adapters.adapt.StepClock``: this process's step times, for the
                              log and adapt="goodput"; never saved: a resumed or resized job
                              times its own machines before adapt chooses
    the engines' copies of k  the torch engines' hooks count passes against k without reading
                              the record; the optimizer sets them from the record at every
                              change of k (``set_passes``, a restore)

S is the step's batch over the baseline batch: S = u W k for W workers of k micro-batches, with u
= S / (W k) the baseline batches per micro-batch, fixed by the set-up (``scale=``). A change of W
or k keeps u; no change of layout moves tau, the estimates or the lr by itself (they are in
baseline units). A layout that cannot run is refused before anything is applied:

    S < 1                                     no policy is defined below the baseline batch
    the policy needs the variance, S > 1 and  statistics not taken, or n = W k = 1 micro-gradient
                                              a step (one micro-gradient has no variance)

What the statistics read follows the layout (``reads``, ``hvd_scale.estimate.samples_read``):
each worker's accumulated gradient once from two workers on (unless samples="passes" was asked),
every pass with one worker, so a job that shrinks to one worker with k >= 2 passes keeps
measuring (explicit samples="workers" included: with one worker its passes are the samples). A
full step whose statistics hold one sample where the policy measures (an adapter reading per
worker with one worker left) is refused: it would leave the gain at its last value silently.

A short step (a leftover batch: n < W k micro-gradients counted) is accounted at its own S = u n
(the lr factor and tau's advance of that S; with n = 1 the estimates so far give its gain). When
u n < 1 (micro-batches smaller than the baseline, ``scale=`` below W k) that S is below the
baseline batch, where no policy is defined: such a step is refused (ValueError, alike on every
rank, nothing applied nor counted); drop the leftover batch or take at least 1 / u passes.

The dict form (torch's ``state_dict``, broadcasts):

    {"version", "policy": PolicyState's dict, "scale", "passes", "workers", "measure",
     "skips_in_a_row", "last_lr", "noise": NoiseState's dict}

The vector form (Keras's ``hvd_scale_state``), float64:

    [version, policy, scale, passes, workers, measure, skips_in_a_row, last_lr,
     PolicyState's vector, NoiseState's vector]

where ``policy`` is the spec's code (``policy_code``): a variable holds numbers only, and a
record of one policy read by another would feed its estimates into the wrong rule (adascale's
plain sigma2 into adascale_adam's preconditioned ones), so the vector names its policy as the
dict does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Mapping, Sequence

import numpy as np

from .moments import EPS_CORRECTED, AdamStep, adam_step, moment_progress
from .noise import NoiseState, advance as advance_noise
from .policies import Policy, StepInfo
from .estimate import check_samples, samples_read
from .reduce import unpack_step
from .state import PROGRESS_INDEX as POLICY_PROGRESS_INDEX
from .state import STEPS_INDEX as POLICY_STEPS_INDEX
from .state import PolicyState

# 6: the run record (this module) holds the policy's record (version 5) and the layout; a
#    version-5 torch checkpoint ({"hvd_scale": the policy's dict, "passes"}) is migrated
#    (``from_dict``); a Keras vector of before (no version, 6 + 2G values) does not fit the
#    variable and is refused by Keras's loader.
# 7: the vector names the policy that saved it (``policy_code``). The dict is version 6's (it
#    always held the spec) and a version-6 dict loads as it is; a version-6 vector (one value
#    shorter) is migrated only by a caller that knows which policy saved it (``migrate_vector``).
# 8: the noise scale's record (``hvd_scale.noise``) after the policy's, in both forms; a record
#    of version 6 or 7 takes a fresh one (no interval until its window is full).
VERSION = 8
KEYS = {"version", "policy", "scale", "passes", "workers", "measure", "skips_in_a_row", "last_lr",
        "noise"}
HEAD = 8  # the vector's fields before the policy's record
VERSION_INDEX, POLICY_INDEX, SCALE_INDEX, PASSES_INDEX = 0, 1, 2, 3  # a graph may read these
STEPS_INDEX = HEAD + POLICY_STEPS_INDEX
PROGRESS_INDEX = HEAD + POLICY_PROGRESS_INDEX

NONFINITE = ("skip", "raise")
# Skipped steps in a row after which a run has diverged (the weights themselves overflow the
# forward pass; skipping would go on forever without advancing tau). AMP's scaler needs a few
# dozen skips at most to find its scale.
DIVERGED_AFTER = 100

# What the framework's optimizer holds for each parameter group before a step: the step's
# baseline lr (a schedule's value), Adam's betas and eps, the decoupled (AdamW) decay and the step
# count t its bias correction will use after this step; nan where it has no such value.
USER_SETTINGS = ("lr", "beta1", "beta2", "eps", "weight_decay", "framework_step")
# The host's answer, a row per group: the policy's lr factor (0: the step is skipped) and what
# the inner update uses for this step only; nan: the user's value stays.
PLAN = ("lr_factor", "lr", "beta1", "beta2", "eps", "weight_decay")


@dataclasses.dataclass(frozen=True)
class RunState:
    """Everything a run's steps change (see the module's docstring)."""

    policy: PolicyState
    scale: float          # S of a full step at this layout
    passes: int           # k, backward passes (micro-batches) per step and worker
    workers: int          # W
    measure: bool         # statistics are taken (fixed by the adapter's set-up)
    skips_in_a_row: int = 0
    last_lr: float = math.nan  # the lr the latest applied step used (nan: none yet)
    noise: NoiseState = dataclasses.field(default_factory=NoiseState)  # noise scale's interval
    # The latest step's own S where it was short (u n < S; None: a full step's, S), for that
    # step's readouts: the next step, a skip, a change of layout and a restore clear it, and no
    # saved form holds it (a restored run's latest step is unknown).
    short_scale: float | None = None

    @property
    def micro_gradients(self) -> int:
        """n of a full step: W x k."""
        return self.workers * self.passes

    @property
    def unit(self) -> float:
        """u = S / (W k): baseline batches per micro-batch (``scale=`` sets it)."""
        return self.scale / self.micro_gradients

    # -- the dict ------------------------------------------------------------------------------
    def to_dict(self, setup: "Setup") -> dict:
        policy = setup.policy
        return {"version": VERSION,
                "policy": self.policy.to_dict(spec=policy.spec, scale=self.scale,
                                              smoothing=policy.smoothing),
                "scale": self.scale, "passes": self.passes, "workers": self.workers,
                "measure": self.measure, "skips_in_a_row": self.skips_in_a_row,
                "last_lr": self.last_lr, "noise": self.noise.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, setup: "Setup") -> "RunState":
        """The record of a checkpoint of ``setup``'s policy; a version-5 torch checkpoint's
        policy part (``{"version": <=5, "policy": spec, ...}``) is taken as a record at its own
        S with this job's layout unknown (``restored`` puts it right). ValueError naming what
        does not fit."""
        if isinstance(d, Mapping) and "steps" in d:  # the policy's own dict: version <= 5
            state = setup.policy.load_state(d)
            scale = float(d.get("estimator", {}).get("scale", 1.0))
            return cls(state, scale, 0, 0, False)
        if not isinstance(d, Mapping) or set(d) not in (KEYS, KEYS - {"noise"}):
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"hvd_scale run state: expected keys {sorted(KEYS)}, got {got}")
        if d["version"] not in (6, 7, VERSION):  # 6, 7: the same dict without the noise record
            raise ValueError(f"hvd_scale run state version {d['version']!r} is not supported "
                             f"(expected {VERSION}, 7 or 6, or a policy state of version <= 5)")
        noise = NoiseState() if d.get("noise") is None else NoiseState.from_dict(d["noise"])
        return cls(setup.policy.load_state(d["policy"]), float(d["scale"]), int(d["passes"]),
                   int(d["workers"]), bool(d["measure"]), int(d["skips_in_a_row"]),
                   float(d["last_lr"]), noise)

    # -- the vector ----------------------------------------------------------------------------
    @staticmethod
    def vector_size(groups: int) -> int:
        return HEAD + PolicyState.vector_size(groups) + NoiseState.vector_size(groups)

    def to_vector(self, setup: "Setup") -> np.ndarray:
        head = [VERSION, policy_code(setup.policy), self.scale, self.passes, self.workers,
                float(self.measure), self.skips_in_a_row, self.last_lr]
        return np.concatenate([np.asarray(head, dtype=np.float64),
                               self.policy.to_vector(setup.groups),
                               self.noise.to_vector(setup.groups)])

    @classmethod
    def from_vector(cls, vector, setup: "Setup") -> "RunState":
        """The record of a vector saved by ``setup``'s policy; ValueError naming what does not
        fit (its size, its version, the policy that saved it)."""
        groups = setup.groups
        v = np.asarray(vector, dtype=np.float64)
        if v.shape != (cls.vector_size(groups),):
            raise ValueError(f"an hvd_scale run state vector for {groups} parameter group(s) "
                             f"holds {cls.vector_size(groups)} values, got shape {v.shape}")
        version, code, scale, passes, workers, measure, skips, last_lr = v[:HEAD].tolist()
        if version != VERSION:
            raise ValueError(f"the hvd_scale state vector (Keras's hvd_scale_state) holds a "
                             f"version {version:g} record, this hvd_scale reads version "
                             f"{VERSION}: it was saved by another hvd_scale (or overwritten); "
                             "resume with the version that saved it")
        if code != policy_code(setup.policy):
            raise ValueError(f"checkpoint was saved by {_named(code)}, this job runs "
                             f"{setup.policy.spec!r}; build the policy from the same spec to "
                             "resume (Keras's hvd_scale_state holds another policy's record: "
                             "its estimates would give this policy a wrong lr)")
        policy_end = HEAD + PolicyState.vector_size(groups)
        return cls(PolicyState.from_vector(v[HEAD:policy_end], groups), scale, int(passes),
                   int(workers), bool(measure), int(skips), last_lr,
                   NoiseState.from_vector(v[policy_end:], groups))


def policy_code(policy: Policy) -> float:
    """The policy's identity as one float64, for the vector: the first 48 bits (exact in float64)
    of SHA-256 over its name and options as ``Policy.same_spec`` compares them (parsed, sorted),
    so two specs get one code exactly when a checkpoint of one resumes under the other."""
    return _code(policy.name, type(policy).parse_options(policy.spec.partition(":")[2]))


def _code(name: str, options: Mapping[str, Any]) -> float:
    canonical = name + ":" + ",".join(f"{k}={options[k]!r}" for k in sorted(options))
    return float(int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:6], "big"))


def _named(code: float) -> str:
    """The policy a code stands for, where it is a registered policy without options."""
    from .spec import POLICIES  # the registry imports the rules, not this module
    names = [name for name in POLICIES if _code(name, {}) == code]
    return f"policy {names[0]!r}" if names else \
        f"another policy, or one with other options (code {code:.0f})"


def migrate_vector(vector, setup: "Setup", *, saved_by_this_policy: bool) -> np.ndarray:
    """A saved vector as this version's: a version-7 vector (no noise record) gets a fresh
    noise record; a version-6 vector (no policy in it either) gets ``setup``'s policy when the
    caller knows it saved the vector (``saved_by_this_policy``: e.g. Keras's optimizer rebuilt
    from the config saved with it), and is refused otherwise, naming what to do; any other
    vector is returned as it is (``from_vector`` checks it)."""
    v = np.asarray(vector, dtype=np.float64)
    fresh = NoiseState().to_vector(setup.groups)
    before_noise = RunState.vector_size(setup.groups) - fresh.size  # a version-7 vector's size
    if v.shape == (before_noise,) and v[VERSION_INDEX] == 7:
        return np.concatenate([[VERSION], v[1:], fresh])
    if v.shape != (before_noise - 1,) or v[VERSION_INDEX] != 6:
        return v
    if not saved_by_this_policy:
        raise ValueError(
            f"hvd_scale: this checkpoint's hvd_scale_state is a version 6 record, which does not "
            f"name the policy that saved it, and this optimizer runs {setup.policy.spec!r}: a "
            "record of another policy would give it a wrong lr, so it is not taken. Load the "
            "whole model with keras.models.load_model (its saved config names the policy, and "
            "the record is then taken as that policy's) and save it again, or resume with the "
            "hvd_scale that saved it (nothing was changed)")
    return np.concatenate([[VERSION, policy_code(setup.policy)], v[1:], fresh])


@dataclasses.dataclass(frozen=True)
class Setup:
    """What no step of a run changes: the configuration the pure functions read."""

    policy: Policy                 # the rule, its options, T and theta (its own record unused)
    groups: int = 1
    nonfinite: str = "skip"
    short_steps: bool = False      # a step may count fewer micro-gradients than W x k
    eps_placement: str = EPS_CORRECTED
    max_passes: int | None = None  # adapt="goodput": the largest k a restored record may hold
    samples: str = "auto"          # what the statistics were asked to read (``SAMPLES``)

    def __post_init__(self):
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {self.nonfinite!r}")
        check_samples(self.samples)


def reads(setup: Setup, run: "RunState | None", workers: int | None = None) -> str:
    """"workers" or "passes": what a step's statistics read at ``run``'s layout (W =
    ``workers`` where given, and then ``run`` may be None: an adapter deciding before the record
    has seen a resize). Derived from the request and W, never held, so every change of layout
    (elastic, a resume, a broadcast) switches it. At k = 1 both read the same."""
    return samples_read(setup.samples, run.workers if workers is None else int(workers))


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's inputs, as the adapter gathered them."""

    statistics: Any = None   # [s..., c, w, q...] summed over workers (``hvd_scale.reduce``); None
    finite: bool = True      # the framework's verdict on the averaged gradient (unmeasured)
    user_settings: Any = None  # a row of USER_SETTINGS per group
    loss_scale: float | None = None  # the gradients were scaled by it (AMP)
    workers: int | None = None  # W now (Horovod elastic); None: unchanged
    count: int | None = None  # micro-gradients of an unmeasured step; None: W x k
    max_lr: float | None = None  # the lr guard's cap on lr x factor (None: no cap)


def start(setup: Setup, *, scale: float, passes: int, workers: int, measure: bool) -> RunState:
    """The record of a run before its first step, its layout checked (``check_layout``)."""
    run = RunState(PolicyState(), float(scale), int(passes), int(workers), bool(measure))
    check_layout(setup, run)
    return run


def check_layout(setup: Setup, run: RunState, why: str = "") -> None:
    """ValueError when the policy cannot run at ``run``'s layout (the module's table)."""
    policy = setup.policy
    if not math.isfinite(run.scale):
        raise ValueError(f"hvd_scale: {why}S = {run.scale!r}: S must be a finite number >= 1 "
                         "(the step's batch over the baseline batch; nothing was changed)")
    if run.scale < 1:
        raise ValueError(f"hvd_scale: {why}S = {run.scale:g} is below the baseline batch "
                         "(S >= 1): no policy is defined there (nothing was changed). Give the "
                         f"job at least {math.ceil(1 / (run.unit * run.passes) - 1e-9)} workers "
                         "(horovodrun --min-np), or more backward passes per step")
    if not policy.uses_statistics or run.scale <= 1:
        return
    if not run.measure:
        raise ValueError(
            f"hvd_scale: {why}policy {policy.name!r} at S = {run.scale:g} needs the gradient "
            "statistics every step, and this optimizer takes none (built with measure=False, "
            "or at S = 1 with one micro-gradient a step, where there is nothing to measure): "
            "build it with measure=True (or adapt='goodput') to run there (nothing was changed)")
    if run.micro_gradients == 1:
        raise ValueError(
            f"hvd_scale: {why}policy {policy.name!r} at S = {run.scale:g} needs at least 2 "
            "micro-gradients per step to measure the variance, got 1 worker x 1 backward pass: "
            "use more passes per step, more workers, or a fixed policy (nothing was changed)")


def relayout(setup: Setup, run: RunState, *, passes: int | None = None,
             workers: int | None = None, scale: float | None = None) -> RunState:
    """A change of k, W or S: S follows k and W in proportion (u stays) unless ``scale`` is
    given. Only the layout changes: tau, the estimates, the skips and the last lr stay.
    ValueError (``check_layout``) for a layout that cannot run, naming the change."""
    k = run.passes if passes is None else int(passes)
    w = run.workers if workers is None else int(workers)
    if (k, w, scale) == (run.passes, run.workers, None):
        return run
    new_scale = run.unit * w * k if scale is None else float(scale)
    changes = [f"{what} went from {a} to {b}{unit}" for what, a, b, unit in
               (("the job", run.workers, w, " worker(s)"), ("k", run.passes, k, " passes per step"))
               if a != b] or [f"S was set to {new_scale:g}"]
    after = dataclasses.replace(run, scale=new_scale, passes=k, workers=w, short_scale=None)
    check_layout(setup, after, why=" and ".join(changes) +
                 f", which would take S from {run.scale:g} to {new_scale:g}: ")
    return after


def restored(setup: Setup, run: RunState, saved: RunState, *, take_passes: bool) -> RunState:
    """``saved`` (a checkpoint's or root's record) taken into this job: its policy record,
    skips and last lr, at this job's W and u, with the saved k when ``take_passes`` (adapt)
    and it is within [1, max_passes]; the layout checked. ValueError before anything changes."""
    k = run.passes
    if take_passes and saved.passes and saved.passes != run.passes:
        if setup.max_passes is None or not 1 <= saved.passes <= setup.max_passes:
            raise ValueError(f"checkpoint was saved at {saved.passes} passes per step "
                             f"(adapt='goodput'); this optimizer takes at most max_passes="
                             f"{setup.max_passes}: build it with a max_passes that allows it")
        k = saved.passes
    groups = saved.policy.groups
    if groups not in (None, setup.groups):
        raise ValueError(f"checkpoint has statistics for {groups} parameter group(s), this "
                         f"optimizer has {setup.groups}")
    taken = dataclasses.replace(run, policy=saved.policy, skips_in_a_row=saved.skips_in_a_row,
                                last_lr=saved.last_lr, noise=saved.noise, short_scale=None)
    return relayout(setup, taken, passes=k)


# -- one step ------------------------------------------------------------------------------------

def check_lrs(run: RunState, lrs: Mapping[str, Any]) -> None:
    """The lrs of the step about to be taken ({name: lr}) must be finite and >= 0: a negative
    lr would ascend the loss, nan or inf wreck the weights. 0 is allowed (warm-ups start there).
    The same on every rank when every rank runs the same code."""
    for name, lr in lrs.items():
        try:
            value = float(lr)
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"hvd_scale: {name} is {lr!r} at step {run.policy.steps + 1}: "
                             "the learning rate must be a finite number >= 0 (the step was "
                             "not applied nor counted)")


def check_adam_history(run: RunState, framework_steps: Sequence[float]) -> None:
    """Adam's state must have taken at least the steps the policy accounted: with horizons in
    progress its bias correction is 1 - beta^tau, and a fresh Adam state under a restored
    policy would take a first update several times too large."""
    steps = run.policy.steps
    behind = [t for t in framework_steps if math.isfinite(t) and t < steps + 1]
    if behind:
        raise ValueError(
            f"hvd_scale: the optimizer's Adam state has taken {int(min(behind)) - 1} "
            f"update(s), but the policy state has accounted {steps} step(s) (tau "
            f"{run.policy.progress:g}): a policy state restored without the optimizer's own "
            "(a fresh Adam under a loaded policy) would make this update several times too "
            "large, as adascale_adam corrects Adam's bias by tau. Restore both from one "
            "checkpoint (opt.load_state_dict), or start the policy afresh too (the step was "
            "not applied nor counted)")


def skipped(run: RunState) -> RunState:
    """A step measured but never applied (non-finite; AMP's scaler skipped it). FloatingPointError
    after ``DIVERGED_AFTER`` in a row: the run has diverged."""
    after = dataclasses.replace(
        run, policy=dataclasses.replace(run.policy, skipped=run.policy.skipped + 1),
        skips_in_a_row=run.skips_in_a_row + 1, short_scale=None)
    if after.skips_in_a_row >= DIVERGED_AFTER:
        last = "no step has been applied since the optimizer was built" \
            if math.isnan(run.last_lr) else f"the last step applied had lr {run.last_lr:g}"
        raise FloatingPointError(
            f"hvd_scale: {after.skips_in_a_row} steps in a row had non-finite gradients and "
            f"were skipped without applying anything (all at step {run.policy.steps + 1}, "
            f"tau {run.policy.progress:g}; {last}): training has diverged")
    return after


def host_step(setup: Setup, run: RunState, inputs: StepInputs,
              lr_names: Sequence[str] | None = None
              ) -> tuple[RunState, np.ndarray, StepInfo | None]:
    """One optimizer step on the host: (the record after it, the plan, what it applied).

    The plan is a row of ``PLAN`` per group. Checked first, before anything counts, alike on
    every rank: the groups' lrs, Adam's history, a change of workers (elastic). A non-finite
    step (the framework's verdict, or statistics that are not finite) is skipped (factor 0;
    ``skipped``) or raises FloatingPointError. The micro-gradients counted (the statistics', or
    ``count``) give the step's S: a full step S, a short one u n = S x n / (W k) (the lr and
    tau of its own S; with n = 1 the estimates so far give its gain); none or more than W k
    raise, and so does a short step below the baseline batch (u n < 1) and a full step whose
    statistics hold one sample where the policy measures (``reads``: the module's docstring).
    """
    policy = setup.policy
    user = np.asarray(inputs.user_settings, dtype=np.float64).reshape(setup.groups,
                                                                      len(USER_SETTINGS))
    lrs = user[:, 0].tolist()
    names = lr_names or (("lr",) if setup.groups == 1 else
                         tuple(f"param_groups[{i}]['lr']" for i in range(setup.groups)))
    check_lrs(run, dict(zip(names, lrs)))
    if policy.moments_in_progress:
        check_adam_history(run, user[:, -1].tolist())
    if inputs.workers is not None and inputs.workers != run.workers:
        # Horovod elastic: S follows the workers (u stays); S < 1 refused, nothing changed.
        run = relayout(setup, run, workers=inputs.workers)
    plan = np.full((setup.groups, len(PLAN)), np.nan)
    plan[:, 0] = 0.0
    values = None if inputs.statistics is None or not run.measure else \
        np.asarray(inputs.statistics, dtype=np.float64)
    finite = bool(inputs.finite) and (values is None or bool(np.all(np.isfinite(values))))
    if not finite:
        if setup.nonfinite == "raise":
            raise FloatingPointError(f"non-finite gradients at step {run.policy.steps + 1} "
                                     "(pass nonfinite='skip' to skip such steps)")
        return skipped(run), plan, None
    base_lr = lrs[0]
    # lr 0 (a warm-up that starts there) needs no cap, and has none to divide by.
    cap = None if inputs.max_lr is None or base_lr == 0 else inputs.max_lr / base_lr
    expected = run.micro_gradients
    statistics, samples = None, None
    if values is not None:
        sqnorm_sum, n, samples, mean_sqnorm = unpack_step(values, setup.groups, inputs.loss_scale)
        statistics = (sqnorm_sum, mean_sqnorm, n)
    else:
        n = expected if inputs.count is None else int(inputs.count)
    if n == 0:  # no backward pass on any rank since the last step
        raise RuntimeError("hvd_scale: step() found no gradients from any backward pass "
                           f"(0 micro-gradients, expected {run.workers} workers x "
                           f"{run.passes}): call loss.backward() (once per pass, "
                           "backward_passes_per_step times) before step()")
    if n == expected:
        scale, required = run.scale, True
    elif setup.short_steps and 1 <= n < expected:
        # Each micro-batch is worth u baseline batches: so is the step. Below one baseline batch
        # no policy is defined (the lr factor and tau's advance of S < 1): refused, not rounded
        # up to S = 1 (which would count 1 / (u n) times the data the step saw).
        scale, required = run.unit * n, False
        if scale < 1 - 1e-9:
            raise ValueError(
                f"hvd_scale: a short step of {n} backward pass(es) in all ({run.workers} "
                f"workers x {run.passes} announced) at u = {run.unit:g} baseline batches per "
                f"micro-batch (S = {run.scale:g}) is S = u n = {scale:g}, below the baseline "
                "batch (S >= 1): no policy is defined there (the step was not applied nor "
                "counted). Drop the leftover batch (DataLoader(drop_last=True)), or give each "
                f"step at least {math.ceil(1 / run.unit - 1e-9)} backward passes in all")
        scale = max(1.0, scale)  # rounding only
    else:  # e.g. a world size frozen in a traced graph
        raise RuntimeError(f"hvd_scale: the step's statistics count {n} micro-gradients, "
                           f"expected {run.workers} workers x {run.passes}")
    if statistics is not None and n >= 2 and samples == 1 and required \
            and policy.uses_statistics and scale > 1:
        # A full step read once per worker with one worker: its passes were there to measure
        # (``reads``), and dropping them would leave the gain at its last value for the rest of
        # the run. An adapter that did not follow the layout; refused before anything counts.
        raise RuntimeError(
            f"hvd_scale: step {run.policy.steps + 1}'s statistics hold one sample ({n} "
            f"micro-gradients from {run.workers} worker(s) x {run.passes} passes read as one "
            f"sum), but at this layout they are read {reads(setup, run)!r}: policy "
            f"{policy.name!r} at S = {run.scale:g} cannot measure a variance from one sample "
            "(nothing was applied nor counted)")
    if statistics is not None and (n == 1 or samples == 1):
        # One sample has no variance (one micro-gradient; a short step where one worker took
        # all its passes, read once): the estimates so far give the gain at the step's S.
        statistics, required = None, False
    try:
        record, info = policy.transition(run.policy, *(statistics or (None, None, None)),
                                         scale=scale, max_factor=cap,
                                         require_statistics=required,
                                         samples=samples if statistics else None)
    except ValueError as e:
        if required:
            raise
        raise ValueError(f"hvd_scale: a short step of {n} backward pass(es) in all "
                         f"({run.workers} workers x {run.passes} announced) cannot be "
                         f"measured: {e}") from e
    after = dataclasses.replace(run, policy=record, skips_in_a_row=0,
                                last_lr=float(base_lr) * info.lr_factor,
                                noise=advance_noise(run.noise, run.policy.estimator,
                                                    record.estimator, policy.theta(scale)),
                                short_scale=None if scale == run.scale else scale)
    plan[:, 0] = info.lr_factor
    plan[:, 1] = user[:, 0] * info.lr_factor
    if policy.moments_in_progress:
        for row, (lr, beta1, beta2, eps, decay, t) in zip(plan, user.tolist()):
            adam = adam_settings(setup, info, base_lr=lr, lr_factor=info.lr_factor, beta1=beta1,
                                 beta2=beta2, eps=eps, framework_step=int(t),
                                 weight_decay=None if math.isnan(decay) else decay)
            row[1:] = (adam.lr, adam.beta1, adam.beta2, adam.eps,
                       math.nan if adam.weight_decay is None else adam.weight_decay)
    return after, plan, info


def adam_settings(setup: Setup, info: StepInfo, *, base_lr: float, lr_factor: float,
                  beta1: float, beta2: float, eps: float, framework_step: int,
                  weight_decay: float | None = None) -> AdamStep:
    """The framework's Adam settings for the step ``info`` with horizons in progress
    (``hvd_scale.moments``). ``framework_step``: the t the framework's bias correction uses."""
    return adam_step(lr=base_lr * lr_factor, base_lr=base_lr, beta1=beta1, beta2=beta2, eps=eps,
                     gain=info.gain,
                     progress=moment_progress(info.progress, info.step, framework_step),
                     framework_step=framework_step, eps_placement=setup.eps_placement,
                     weight_decay=weight_decay)
