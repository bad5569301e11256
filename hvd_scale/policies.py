"""Learning-rate scaling policies: what a step at scale S does to the lr and to progress.

Every policy turns the step count and (for AdaScale) the step's gradient statistics into

    lr_factor   multiply the baseline lr, evaluated at floor(tau), by this for the step
    tau         progress in scale-invariant (baseline) iterations; training ends at tau >= T

| policy        | lr_factor                              | tau advances by |
|---------------|----------------------------------------|-----------------|
| none          | 1                                      | S               |
| linear        | S                                      | S               |
| sqrt          | sqrt(S)                                | S               |
| power         | S^alpha                                | S               |
| fixed         | a hand-tuned factor F                  | S               |
| warmup        | 1 + (R(S) - 1) min(1, tau / span)      | S               |
|               |   R: linear (default), sqrt, power, fixed                |
| legw          | sqrt(S) min(1, tau / (S W))            | S               |
| adascale      | r = (sigma2 + mu2) / (sigma2/S + mu2)  | r               |
| adascale_adam | sqrt(r), r from preconditioned grads   | r               |
|               |   Adam's betas -> beta^r, eps -> eps / sqrt(r) each step (``moments.py``)  |

A fixed rule's step consumes S baseline batches, so tau advances by S and one baseline schedule
lr(tau) and one budget T (in baseline steps) serve every policy. Policies are built from a spec
string, ``name`` or ``name:key=value,...``, as given to ``--policy`` or ``HVD_SCALE_POLICY``
(``spec.py``: the registry, ``parse_spec``, ``make_policy``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Mapping

from .estimate import (GainEstimator, check_smoothing, check_scale, default_smoothing,
                       estimated_gain, fold)
from .metrics import POLICY_METRICS
from .moments import bias_correction, moment_progress
from .state import PolicyState

# Which optimizers a policy has theory for, by class name (torch.optim and keras.optimizers agree).
SGD_FAMILY = frozenset({"SGD"})
# adascale_adam's moment horizons: in progress (betas follow the gain) or in optimizer steps.
MOMENTS = ("progress", "steps")
# What a capped adascale_adam step's lr is: sqrt(R), or R / sqrt(r measured) (drift kept).
CAPPED = ("sqrt", "drift")
ADAM_FAMILY = frozenset({"Adam", "AdamW", "NAdam", "Nadam", "RAdam"})


def optimizer_family(name: str) -> str:
    """'sgd', 'adam' or 'other' for an optimizer class name."""
    if name in SGD_FAMILY:
        return "sgd"
    if name in ADAM_FAMILY:
        return "adam"
    return "other"


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one optimizer step should do, and where it leaves progress."""

    step: int             # optimizer steps applied, this one included
    lr_factor: float      # multiply the baseline lr by this for this step only
    progress_before: float  # tau at which to evaluate the baseline schedule: lr(floor(tau))
    progress: float       # tau after this step
    gain: float           # the measured gain r (1 where nothing was measured)
    scale: float          # the S this step was taken at (a short step: its own)


def _capped(factor: float, max_factor: float | None) -> float:
    return factor if max_factor is None else min(factor, max_factor)


# -- spec parsing ------------------------------------------------------------------------------

def _number_option(convert: Callable[[str], Any], accept: Callable[[Any], bool], expected: str):
    """An option parser: ``convert`` the text, keep the value when ``accept`` says so."""
    def parse(name: str, raw: str):
        try:
            value = convert(raw)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise ValueError(f"option {name}={raw!r}: expected {expected}")
        return value
    return parse


_positive_int = _number_option(int, lambda v: v > 0, "a whole number > 0")
_fraction = _number_option(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
_theta = _number_option(float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
_positive = _number_option(float, lambda v: math.isfinite(v) and v > 0, "a number > 0")
_at_least_one = _number_option(float, lambda v: v >= 1, "a number >= 1 (inf: no cap)")
_exponent = _number_option(float, lambda v: 0.0 <= v <= 1.0,
                           "a number in [0, 1] (0: none, 0.5: sqrt, 1: linear)")


def _choice(*allowed: str):
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"option {name}={raw!r}: expected one of {list(allowed)}")
        return value
    return parse


def _rule(name: str, raw: str) -> str:
    rule = raw.strip().lower()
    if rule not in FIXED_RULES:
        raise ValueError(f"option {name}={raw!r}: expected one of {sorted(FIXED_RULES)}")
    return rule


def check_budget(budget: Any) -> float | None:
    """T, the baseline steps to train for: None, or a finite number > 0 (0 or less would train
    nothing, nan or inf never end)."""
    if budget is None:
        return None
    try:
        value = None if isinstance(budget, bool) else float(budget)
    except (TypeError, ValueError):
        value = None
    if value is None or not (math.isfinite(value) and value > 0):
        raise ValueError(f"budget must be a finite number > 0 (baseline steps to train for), "
                         f"got {budget!r}")
    return value


# -- the policies ------------------------------------------------------------------------------

class Policy:
    """A rule: its configuration (the class, its options, T, the EMA's theta) and pure functions
    over the state record (``hvd_scale.state.PolicyState``) at a step's S. A policy holds no
    state and no S: the record is the caller's (optax's ``init`` / ``update`` over explicit
    state), and S is an argument of every function that depends on it.

    The math is ``transition(state, statistics, scale=S) -> (state, StepInfo)``: the lr factor,
    tau's advance and the estimates as functions of the record and this step's S, nothing else.
    Every position is in progress (tau), so a change of S moves no position by itself, and a
    fixed rule's factor is its rule's value at the new S. A run's whole record (S, k, the skips,
    ...) and the host step around ``transition`` are ``hvd_scale.run``'s.

        policy = make_policy("adascale", budget=T)
        state = policy.init()
        while not policy.done(state):
            ...
            state, info = policy.transition(state, sqnorm_sum, mean_sqnorm, n, scale=S)
            lr = schedule(info.progress_before) * info.lr_factor

    Every policy measures the gain when it is given statistics (so sigma2, mu2, the noise scale
    and the efficiency can be logged for any policy); only AdaScale's lr depends on it.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    options: ClassVar[dict[str, tuple]] = {}  # option -> (parser, help)
    uses_statistics: ClassVar[bool] = False   # the lr needs per-step gradient statistics
    statistics: ClassVar[str] = "plain"       # 'preconditioned': norms of the Adam-scaled gradient
    required: ClassVar[dict[str, str]] = {}   # option -> usage, for options without a default
    renamed: ClassVar[dict[str, str]] = {}    # a former option -> what to write instead
    moments_in_progress: ClassVar[bool] = False  # adascale_adam's default sets Adam's betas

    @classmethod
    def parse_options(cls, text: str, *, spec: str | None = None) -> dict[str, Any]:
        """'fraction=0.055,rule=sqrt' -> {'fraction': 0.055, 'rule': 'sqrt'}, each option parsed
        and checked by its own parser (``spec``: the whole spec, for errors)."""
        options: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if key in cls.renamed:
                raise ValueError(f"policy spec {spec or cls.name!r}: {cls.renamed[key]}")
            if key not in cls.options:
                valid = ", ".join(cls.options) or "none"
                raise ValueError(f"unknown option {key!r} for policy {cls.name!r}; valid "
                                 f"options: {valid}")
            if not eq:
                raise ValueError(f"option {key!r} of policy {cls.name!r} needs a value: {key}=...")
            options[key] = cls.options[key][0](key, raw.strip())
        return options

    def same_spec(self, spec: str) -> bool:
        """Whether ``spec`` names this policy with these options (a checkpoint's spec)."""
        name, _, rest = spec.strip().partition(":")
        return name.strip().lower().replace("-", "_") == self.name and \
            type(self).parse_options(rest, spec=spec) == \
            type(self).parse_options(self.spec.partition(":")[2])

    def __init__(self, *, budget: float | None = None, smoothing: float | None = None,
                 **options: Any):
        for option, usage in self.required.items():
            if options.get(option) is None:
                raise ValueError(f"policy {self.name!r} needs its {option}: {usage}")
        self._options = options
        self._smoothing = check_smoothing(smoothing)
        self.budget = check_budget(budget)
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"a policy is a frozen configuration: {name!r} cannot be set "
                                 "(build another with make_policy; the run's state is a record "
                                 "of its own, hvd_scale.state.PolicyState)")
        super().__setattr__(name, value)

    def init(self) -> PolicyState:
        """The record before a run's first step."""
        return PolicyState()

    # -- the rule: pure functions of the record and S (what a subclass defines) ----------------
    def rule_factor(self, progress: float, scale: float, gain: float) -> float:
        """The lr factor of a step at scale S taken from progress tau, with gain r."""
        raise NotImplementedError

    def advance(self, scale: float, gain: float) -> float:
        """How far tau moves for a step at scale S with gain r (a fixed rule: S)."""
        return scale

    def gain(self, state: PolicyState, scale: float) -> float:
        """The gain a step at scale S applies, from the estimates in ``state`` (held toward 1
        while they are young: ``estimate.estimated_gain``; adascale_adam: capped)."""
        return estimated_gain(state.estimator, scale, self.theta(scale))

    def theta(self, scale: float) -> float:
        """The EMA's theta for a step at scale S (default 0.999 ** S: ~1000 baseline batches)."""
        return default_smoothing(scale) if self._smoothing is None else self._smoothing

    def check_optimizer(self, optimizer: str) -> None:
        """Raise ValueError when this policy has no theory for the optimizer (fixed rules: any)."""

    def transition(self, state: PolicyState, sqnorm_sum=None, mean_sqnorm=None,
                   n: int | None = None, *, scale: float, max_factor: float | None = None,
                   require_statistics: bool = True, samples: int | None = None
                   ) -> tuple[PolicyState, StepInfo]:
        """One optimizer step at scale S: the record after it and what it applies.

        Statistics as in ``GainEstimator.update`` (None: nothing measured; ``samples``: the
        independent samples among the n, ``estimate_moments``). ``max_factor``: a cap
        on the factor (``hvd_scale.guard``); tau advances as uncapped. Raises ValueError (the
        record is not replaced) on statistics missing where the policy needs them, or bad.
        ``require_statistics=False``: a step that cannot be measured (a short step of one
        micro-gradient) takes the gain at its S from the estimates so far.
        """
        scale = check_scale(scale)
        if max_factor is not None and not max_factor > 0:
            raise ValueError(f"max_factor must be > 0, got {max_factor!r}")
        if n is not None and int(n) < 1:
            raise ValueError(f"n (micro-gradients in the step) must be >= 1, got {n!r}")
        # A fixed rule only logs the estimate, and n = 1 simply gives none.
        measurable = self.uses_statistics or n is None or int(n) >= 2
        estimator = state.estimator
        if sqnorm_sum is not None and measurable:
            estimator = fold(estimator, sqnorm_sum, mean_sqnorm, n, scale, self.theta(scale),
                             samples)
        elif self.uses_statistics and scale > 1 and require_statistics:
            raise ValueError(f"policy {self.name!r} needs gradient statistics every step")
        measured = dataclasses.replace(state, estimator=estimator)
        gain = self.gain(measured, scale)
        factor = _capped(self.rule_factor(state.progress, scale, gain), max_factor)
        progress = state.progress + self.advance(scale, gain)
        after = dataclasses.replace(measured, steps=state.steps + 1, progress=progress,
                                    lr_factor=factor)
        return after, StepInfo(after.steps, factor, state.progress, progress, gain, scale)

    def done(self, state: PolicyState, budget: float | None = None) -> bool:
        """True once tau has reached the budget T (baseline steps; default the policy's)."""
        budget = self.budget if budget is None else check_budget(budget)
        if budget is None:
            raise ValueError("done() needs a budget in baseline steps (none was given to the policy)")
        return state.progress >= budget

    def second_moment_correction(self, state: PolicyState, beta2: float, steps: float) -> float:
        """The bias correction of Adam's v after the framework's ``steps`` updates: 1 - beta2 **
        steps (with adascale_adam's horizons in progress, 1 - beta2 ** tau)."""
        return bias_correction(beta2, steps)

    # -- the configuration ----------------------------------------------------------------------
    @property
    def spec(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.spec_options().items())
        return f"{self.name}:{opts}" if opts else self.name

    @property
    def smoothing(self) -> float | None:
        """The EMA's theta as given (None: the default, 0.999 ** S)."""
        return self._smoothing

    def spec_options(self) -> dict[str, Any]:
        opts = dict(self._options)
        if self._smoothing is not None:
            opts["smoothing"] = self._smoothing
        return opts

    # -- what a record gives at S: read, never changed --------------------------------------------
    def estimator(self, state: PolicyState, scale: float) -> GainEstimator:
        """The estimates at S, as a ``GainEstimator`` (a copy: changing it changes nothing)."""
        view = GainEstimator(scale, smoothing=self._smoothing)
        view.state = state.estimator
        return view

    def efficiency(self, state: PolicyState, scale: float) -> float:
        """The gain a step at S would apply over S: the fraction of linear speed-up."""
        return self.gain(state, scale) / scale

    def factor(self, state: PolicyState, scale: float) -> float:
        """The factor the next step at S would apply (from the estimates so far)."""
        return self.rule_factor(state.progress, scale, self.gain(state, scale))

    def metrics(self, state: PolicyState, scale: float) -> dict[str, float]:
        """``hvd_scale.metrics.POLICY_METRICS`` as floats (Keras logs, CSV, TensorBoard).
        ``lr_factor`` is the factor the latest step applied (nan before any); ``factor()`` gives
        the next one; ``gain`` and ``efficiency`` are the gain a step at S applies
        (adascale_adam's capped)."""
        est = self.estimator(state, scale)
        gain = self.gain(state, scale)
        values = {"step": float(state.steps), "progress": state.progress, "scale": float(scale),
                  "gain": gain,
                  "lr_factor": math.nan if state.lr_factor is None else state.lr_factor,
                  "sigma2": est.sigma2, "mu2": est.mu2, "noise_scale": est.noise_scale,
                  "efficiency": gain / scale, "skipped": float(state.skipped)}
        return {k: values[k] for k in POLICY_METRICS}

    # -- checkpoints (the forms and versions: ``hvd_scale.state``) ------------------------------
    def state_dict(self, state: PolicyState, scale: float) -> dict:
        """``state``'s dict form, saved with this policy's spec and the S it ran at."""
        return state.to_dict(spec=self.spec, scale=scale, smoothing=self._smoothing)

    def load_state(self, d: Mapping) -> PolicyState:
        """The record of a checkpoint's dict saved by this policy's spec (any version, migrated:
        ``hvd_scale.state.migrate``); ValueError naming the difference."""
        return PolicyState.from_dict(d, spec=self.spec, accepts=self.same_spec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r})"


_SMOOTHING = {"smoothing": (_theta, "EMA theta of the gain statistics in [0, 1); "
                                    "default 0.999**S (horizon ~1000 baseline batches)")}


class NoScaling(Policy):
    name = "none"
    description = "lr unchanged at every scale (the baseline the other rules improve on)"

    def rule_factor(self, progress, scale, gain) -> float:
        return 1.0


class LinearScaling(Policy):
    name = "linear"
    description = "lr x S (Goyal et al.): the linear scaling rule"

    def rule_factor(self, progress, scale, gain) -> float:
        return scale


class SqrtScaling(Policy):
    name = "sqrt"
    description = "lr x sqrt(S): keeps the update's variance fixed"

    def rule_factor(self, progress, scale, gain) -> float:
        return math.sqrt(scale)


class FixedFactor(Policy):
    name = "fixed"
    description = ("lr x a hand-tuned factor at every scale (the seed's 'x 5 at 8 workers': "
                   "fixed:factor=5)")
    options = {"factor": (_positive, "the lr factor (required)")}
    required = {"factor": "fixed:factor=F (F > 0)"}

    def rule_factor(self, progress, scale, gain) -> float:
        return self._options["factor"]


class PowerScaling(Policy):
    name = "power"
    description = "lr x S^alpha (alpha 0.5 is sqrt, 1 is linear)"
    options = {"alpha": (_exponent, "the exponent in [0, 1] (required)")}
    required = {"alpha": "power:alpha=A (A in [0, 1])"}

    def rule_factor(self, progress, scale, gain) -> float:
        return scale ** self._options["alpha"]


# The fixed rules a warm-up can ramp to: S -> the factor reached after the ramp.
FIXED_RULES: dict[str, Callable[..., float]] = {
    "linear": lambda S, **_: S,
    "sqrt": lambda S, **_: math.sqrt(S),
    "power": lambda S, alpha, **_: S ** alpha,
    "fixed": lambda S, factor, **_: factor,
}


class WarmupScaling(Policy):
    name = "warmup"
    description = ("a fixed rule (linear by default: the paper's LSW) reached by a linear ramp "
                   "from 1 over a span of progress (default: the first 5.5% of the run's budget)")
    options = {
        "baseline_steps": (_positive_int, "ramp length in baseline steps (progress tau); at a "
                                          "constant S it lasts baseline_steps / S optimizer steps"),
        "fraction": (_fraction, "ramp length as a fraction of the budget (baseline steps); "
                                "default 0.055"),
        "rule": (_rule, "the rule ramped to: linear (default), sqrt, power, fixed"),
        "alpha": (_exponent, "the exponent, with rule=power"),
        "factor": (_positive, "the factor, with rule=fixed"),
    }
    renamed = {"steps": "warm-up's steps= (optimizer steps) became baseline_steps= (the ramp "
                        "in progress, so that a change of S does not move it): write "
                        "baseline_steps=<steps x S>, e.g. steps=500 at S = 8 is "
                        "baseline_steps=4000"}
    DEFAULT_FRACTION = 0.055  # the AdaScale paper's LSW baseline

    def __init__(self, *, budget=None, baseline_steps=None, fraction=None, rule=None,
                 alpha=None, factor=None, **kw):
        if baseline_steps is not None and fraction is not None:
            raise ValueError("policy 'warmup' takes baseline_steps= or fraction=, not both")
        needs = {"power": "alpha", "fixed": "factor"}
        for option, value in (("alpha", alpha), ("factor", factor)):
            if value is not None and needs.get(rule) != option:
                raise ValueError(f"policy 'warmup': {option}= goes with rule="
                                 f"{'power' if option == 'alpha' else 'fixed'}, got rule={rule}")
        if rule in needs and {"alpha": alpha, "factor": factor}[needs[rule]] is None:
            raise ValueError(f"policy 'warmup' with rule={rule} needs {needs[rule]}=")
        if baseline_steps is None and fraction is None:
            fraction = self.DEFAULT_FRACTION
        options = {"baseline_steps": baseline_steps} if baseline_steps is not None \
            else {"fraction": fraction}
        if fraction is not None and budget is None:
            raise ValueError(f"policy 'warmup' with fraction={fraction} needs the run's budget "
                             "(baseline steps): pass budget=, or give warmup:baseline_steps=N")
        extra = {k: v for k, v in (("rule", rule), ("alpha", alpha), ("factor", factor))
                 if v is not None and not (k == "rule" and v == "linear")}
        super().__init__(budget=budget, **options, **extra, **kw)

    @property
    def span(self) -> float:
        """Ramp length in progress (baseline steps): the same at every S, so a change of S moves
        neither the ramp's length nor where a run is on it."""
        if "baseline_steps" in self._options:
            return float(self._options["baseline_steps"])
        return self._options["fraction"] * self.budget

    def target(self, scale: float) -> float:
        """The rule's factor at scale S, reached at the end of the ramp."""
        return FIXED_RULES[self._options.get("rule", "linear")](scale, **self._options)

    def rule_factor(self, progress, scale, gain) -> float:
        # 1 + (R(S) - 1) min(1, tau / span), tau before the step: the first step's factor is 1.
        # At a constant S this is the ramp over span / S optimizer steps; at a change of S the
        # position on the ramp stays, and the factor is the new S's rule at that position.
        return 1.0 + (self.target(scale) - 1.0) * min(1.0, progress / self.span)


class LEGW(Policy):
    name = "legw"
    description = ("Linear-Epoch Gradual Warm-up (You et al.; AdaptDL's LEGWScale): lr x sqrt(S) "
                   "after a linear ramp whose length in baseline steps grows with S")
    options = {"steps": (_positive_int, "warm-up length in baseline steps at S = 1 (required); "
                                        "at scale S it is S x steps")}
    required = {"steps": "legw:steps=N (the base warm-up, baseline steps)"}

    def rule_factor(self, progress, scale, gain) -> float:
        # sqrt(S) x min(1, tau / (S W)) with tau counted after this step, so the first step's lr
        # is not 0 (AdaptDL counts it before). The position is tau, but the ramp's length is
        # S x W by the rule's definition: during the ramp the factor at a given tau is
        # (tau + S) / (sqrt(S) W), so a larger S lowers it there (x 1 / sqrt(2) for S doubled)
        # and a smaller S raises it; after the ramp it is sqrt(S) (tests/test_policies.py).
        ramp = (progress + scale) / (scale * self._options["steps"])
        return math.sqrt(scale) * min(1.0, ramp)


class AdaScale(Policy):
    name = "adascale"
    description = "lr x gain r in [1, S] measured from the gradient variance (Johnson et al. 2020); SGD"
    options = _SMOOTHING
    uses_statistics = True
    def rule_factor(self, progress, scale, gain) -> float:
        return gain

    def advance(self, scale, gain) -> float:
        return gain

    def check_optimizer(self, optimizer: str) -> None:
        family = optimizer_family(optimizer)
        if family == "sgd":
            return
        hint = ("use policy 'adascale_adam' (preconditioned statistics, lr x sqrt(gain))"
                if family == "adam" else "use a fixed rule: none, linear, sqrt or warmup")
        raise ValueError(f"policy 'adascale' has theory for SGD (with momentum) only, got "
                         f"optimizer {optimizer!r}: {hint}")


class AdaScaleAdam(AdaScale):
    name = "adascale_adam"
    description = ("AdaScale for the Adam family: gain from the preconditioned gradient "
                   "g / (sqrt(v_hat) + eps), lr x sqrt(r), tau += r; Adam's moment horizons in "
                   "progress: betas -> beta^r, eps -> eps / sqrt(r), AdamW's decay per unit of tau")
    options = {**_SMOOTHING,
               "moments": (_choice(*MOMENTS), "progress (default): Adam's betas and eps follow "
                           "the gain, horizons fixed in baseline steps; steps: left as the user "
                           "set them (AdaptDL's AdamScale)"),
               "max_gain": (_at_least_one, "a cap on the gain r each step applies (lr x sqrt(r), "
                            "tau += r, betas^r); default 8 (moments=steps: none), inf: none"),
               "lr_power": (_exponent, "the lr factor r^p; default 0.5 (sqrt: Adam's SDE scaling "
                            "rule; other values measured on B4 for comparison)"),
               "capped": (_choice(*CAPPED), "the lr of a step whose measured gain r exceeds "
                          "max_gain R: sqrt (default) lr x sqrt(R); drift: lr x R / sqrt(r), so "
                          "that Adam's drift per unit of tau credited stays the baseline's (v "
                          "shrinks by the measured r; measured on B4 for comparison)")}
    renamed = {"horizon": "adascale_adam's horizon= was removed: B4 measured horizon=previous "
                          "equal to the default, and it re-derived the previous step's gain at the "
                          "current S (wrong after a rescale, a short step or a resume); the betas "
                          "follow the gain each step applies"}
    statistics = "preconditioned"
    # The optimizers whose update hvd_scale.moments knows how to drive (NAdam's momentum decay and
    # RAdam's rectification are counted in steps).
    PROGRESS_OPTIMIZERS = frozenset({"Adam", "AdamW"})

    # Adam's second moment after t steps averages about t squared gradients (t << 1/(1 - beta2)):
    # at t = 1, g / sqrt(v_hat) is sign(g), +-1 in every coordinate, and for small t the ratio's
    # relative spread is about sqrt(2 / t) (Gaussian coordinates). Such heavy-tailed norms would
    # sit in the EMA for ~1000 baseline batches, so statistics count from this many steps on
    # (spread ~0.3); the steps before are taken at gain 1: lr unscaled and tau += 1. Counted in
    # optimizer steps, not progress: what it waits for is the number of squared gradients in v.
    MIN_ADAM_HISTORY = 20

    @property
    def moments_in_progress(self) -> bool:
        """Adam's betas, eps and decoupled decay follow each step's gain (``hvd_scale.moments``)."""
        return self._options.get("moments", "progress") == "progress"

    def spec_options(self) -> dict[str, Any]:
        opts = super().spec_options()
        if opts.get("moments") == "progress":  # the defaults: one spec for one behaviour
            del opts["moments"]
        if opts.get("max_gain") == (self.DEFAULT_MAX_GAIN if self.moments_in_progress else math.inf):
            del opts["max_gain"]
        for option, default in (("lr_power", 0.5), ("capped", "sqrt")):
            if opts.get(option) == default:
                del opts[option]
        return opts

    def second_moment_correction(self, state, beta2: float, steps: float) -> float:
        # With horizons in progress the exponents applied so far (the gain of each step) add up
        # to tau, plus the framework's steps the policy did not account, as gain 1
        # (``moment_progress``).
        if not self.moments_in_progress:
            return bias_correction(beta2, steps)
        return bias_correction(beta2, moment_progress(state.progress, state.steps, int(steps)))

    # The gain a step applies is capped (``max_gain``): measured on B4 (benchmarks/README.md), at
    # S = 128 the gain climbs to the 50s late in the schedule, where beta1^r = 0.9^50 leaves Adam
    # no first-moment averaging and beta2^r a second moment of a few steps, and BLEU fell 5 short
    # of S = 1; capped at 8 (the largest mean gain measured to hold BLEU, S = 32's 8.3) it holds.
    # A capped step applies lr x sqrt(8), tau += 8 and betas^8 where more was measured; Adam's v,
    # though, shrinks by the measured gain, so per unit of tau credited it drifts sqrt(r / 8)
    # times the baseline's (README: what the cap does). With the betas left alone
    # (moments=steps, AdaptDL's) there is no horizon to keep: no cap.
    DEFAULT_MAX_GAIN = 8.0

    @property
    def max_gain(self) -> float:
        default = self.DEFAULT_MAX_GAIN if self.moments_in_progress else math.inf
        return self._options.get("max_gain", default)

    def gain(self, state: PolicyState, scale: float) -> float:
        """The measured gain capped at ``max_gain``, and 1 while Adam's v has too little history
        (``MIN_ADAM_HISTORY``), then held toward 1 while the estimates are young (AdaScale's
        warm-in: they start at that step): the r a step applies."""
        if state.steps < self.MIN_ADAM_HISTORY:
            return 1.0
        return min(estimated_gain(state.estimator, scale, self.theta(scale)), self.max_gain)

    def rule_factor(self, progress, scale, gain) -> float:
        power = self._options.get("lr_power", 0.5)
        return math.sqrt(gain) if power == 0.5 else gain ** power

    def transition(self, state, sqnorm_sum=None, mean_sqnorm=None, n=None, *, scale,
                   max_factor=None, require_statistics=True, samples=None):
        if state.steps >= self.MIN_ADAM_HISTORY:
            after, info = super().transition(state, sqnorm_sum, mean_sqnorm, n, scale=scale,
                                             max_factor=max_factor,
                                             require_statistics=require_statistics,
                                             samples=samples)
            measured = estimated_gain(after.estimator, scale, self.theta(scale)) \
                if self._options.get("capped") == "drift" else info.gain
            if measured > info.gain:
                # v shrank by the measured r while tau is credited R: the baseline's drift per
                # unit of tau needs lr x R / sqrt(r), not sqrt(R) (sqrt(r / R) times less).
                factor = _capped(info.gain / math.sqrt(measured), max_factor)
                after = dataclasses.replace(after, lr_factor=factor)
                info = dataclasses.replace(info, lr_factor=factor)
            return after, info
        # The warm-in: bad statistics fail as in a measured step; the estimates stay untouched.
        after, info = super().transition(state, sqnorm_sum, mean_sqnorm, n, scale=scale,
                                         max_factor=max_factor,
                                         require_statistics=require_statistics, samples=samples)
        return dataclasses.replace(after, estimator=state.estimator), info

    def check_optimizer(self, optimizer: str) -> None:
        if optimizer_family(optimizer) != "adam":
            raise ValueError(f"policy 'adascale_adam' is for {sorted(ADAM_FAMILY)}, got "
                             f"optimizer {optimizer!r}; for SGD use 'adascale'")
        if self.moments_in_progress and optimizer not in self.PROGRESS_OPTIMIZERS:
            raise ValueError(f"policy 'adascale_adam' sets the moment horizons of "
                             f"{sorted(self.PROGRESS_OPTIMIZERS)} only, got optimizer "
                             f"{optimizer!r}: use 'adascale_adam:moments=steps' to leave its "
                             "betas alone")
