"""Policies: the factor each rule promises, progress tau, checkpoints, resizes and bad input.

Pure engine tests: numpy and hypothesis only (no torch, TensorFlow or Horovod).
"""

from __future__ import annotations

import copy
import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hvd_scale
from hvd_scale import GainEstimator, available_policies, make_policy, parse_spec
from hvd_scale.spec import resolve_policy
from hvd_scale.estimate import gain_ratio

BUDGET = 1000.0

# Every registered policy, built so that it needs nothing else (warm-up needs a budget or steps).
# The practitioners' rules need their constant.
REQUIRED = {"fixed": "fixed:factor=5", "power": "power:alpha=0.7", "legw": "legw:steps=10"}
SPECS = {name: REQUIRED.get(name, name) for name in available_policies()}
ALL_SPECS = sorted(set(SPECS.values()) | {"warmup:baseline_steps=3", "warmup:fraction=0.2",
                                          "warmup:rule=sqrt,baseline_steps=4",
                                          "warmup:rule=power,alpha=0.5,baseline_steps=4",
                                          "warmup:rule=fixed,factor=5,baseline_steps=4",
                                          "adascale:smoothing=0.5", "adascale_adam:smoothing=0.9"})


@pytest.fixture(autouse=True, scope="module")
def adam_statistics_from_the_first_step():
    """The mechanics tests here measure adascale_adam from step 1; its warm-in (statistics only
    after Adam's second moment has history) is tested on its own below."""
    saved = hvd_scale.policies.AdaScaleAdam.MIN_ADAM_HISTORY
    hvd_scale.policies.AdaScaleAdam.MIN_ADAM_HISTORY = 0
    yield
    hvd_scale.policies.AdaScaleAdam.MIN_ADAM_HISTORY = saved


def test_registry_is_what_the_reference_lists():
    # The reference's rules, and the practitioners' (the seed's experiment).
    assert set(available_policies()) == {"none", "linear", "sqrt", "warmup", "adascale",
                                         "adascale_adam", "power", "fixed", "legw"}


def build(spec: str, scale: float) -> hvd_scale.Policy:
    return make_policy(spec, scale=scale, budget=BUDGET)


# ----------------------------------------------------------------------------------------------
# Hypothesis: statistics for G groups and n micro-gradients with |g_bar|^2 <= mean |g_i|^2.

@st.composite
def stats(draw, groups: int):
    n = draw(st.integers(min_value=2, max_value=64))
    m = np.array([draw(st.floats(min_value=0.0, max_value=1e6)) for _ in range(groups)])
    frac = np.array([draw(st.floats(min_value=0.0, max_value=1.0)) for _ in range(groups)])
    return m * n, np.minimum(frac * m, m), n


scales = st.one_of(st.integers(min_value=1, max_value=512).map(float),
                   st.floats(min_value=1.0, max_value=512.0))
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def policy_state_equal(a: hvd_scale.Policy, b: hvd_scale.Policy) -> None:
    assert a.state_dict() == b.state_dict()
    # lr_factor: what the latest step applied, nan (in both) before any step
    assert a.lr_factor == b.lr_factor or math.isnan(a.lr_factor) and math.isnan(b.lr_factor)
    assert a.gain == b.gain and a.progress == b.progress


# ----------------------------------------------------------------------------------------------
# 1. Checkpoints and resizes, for every policy.

@pytest.mark.parametrize("spec", ALL_SPECS)
@SETTINGS
@given(scale=scales, groups=st.integers(1, 3), data=st.data(),
       past=st.integers(0, 6), through_json=st.booleans())
def test_policy_state_round_trip_gives_identical_future(spec, scale, groups, data, past, through_json):
    policy = build(spec, scale)
    for _ in range(past):
        policy.step(*data.draw(stats(groups)))
    state = policy.state_dict()
    if through_json:
        state = json.loads(json.dumps(state))
    twin = build(spec, scale)
    twin.load_state_dict(state)
    policy_state_equal(twin, policy)
    assert twin.steps == policy.steps == past
    for _ in range(4):
        s, q, n = data.draw(stats(groups))
        assert twin.step(s, q, n) == policy.step(s, q, n)  # StepInfo: factor, progress, gain
        policy_state_equal(twin, policy)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_policy_round_trip_without_statistics_for_fixed_rules_and_scale_one(spec):
    # A fixed rule may run without statistics; AdaScale only at S = 1.
    scale = 1.0 if spec.startswith("adascale") else 6.0
    policy = build(spec, scale)
    for _ in range(5):
        policy.step()
    twin = build(spec, scale)
    twin.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    for _ in range(5):
        assert twin.step() == policy.step()


@pytest.mark.parametrize("spec", ALL_SPECS)
@SETTINGS
@given(scale=scales, new_scale=scales, data=st.data())
def test_rescale_keeps_progress_and_estimates(spec, scale, new_scale, data):
    policy = build(spec, scale)
    for _ in range(3):
        policy.step(*data.draw(stats(2)))
    tau, steps = policy.progress, policy.steps
    sigma2, mu2 = policy.estimator.group_sigma2.copy(), policy.estimator.group_mu2.copy()
    policy.rescale(new_scale)
    assert policy.scale == new_scale
    assert policy.progress == tau and policy.steps == steps
    np.testing.assert_array_equal(policy.estimator.group_sigma2, sigma2)
    np.testing.assert_array_equal(policy.estimator.group_mu2, mu2)
    gain = 1.0 if new_scale == 1 else gain_ratio(sigma2, mu2, new_scale)
    assert policy.gain == min(gain, getattr(policy, "max_gain", math.inf))  # adascale_adam's cap
    name = parse_spec(spec)[0]
    options = parse_spec(spec)[1]
    promised = {
        "none": 1.0,
        "linear": new_scale,
        "sqrt": math.sqrt(new_scale),
        "power": new_scale ** options.get("alpha", 0),
        "fixed": options.get("factor"),
        "legw": math.sqrt(new_scale) * min(1.0, (tau + new_scale) / (new_scale * options.get("steps", 1))),
        "adascale": gain,
        "adascale_adam": math.sqrt(min(gain, getattr(policy, "max_gain", math.inf))),
    }
    if name == "warmup":
        span = policy.span  # in baseline steps: the position on the ramp is tau, kept
        rule = options.get("rule", "linear")
        target = promised["fixed"] if rule == "fixed" else (
            new_scale ** options["alpha"] if rule == "power" else promised[rule])
        want = 1.0 + (target - 1.0) * min(1.0, tau / span)
        assert policy.factor() == pytest.approx(want, rel=1e-15)
    else:
        assert policy.factor() == promised[name]
    # The next step advances tau by the new scale (fixed rules) or the gain at the new scale.
    s, q, n = data.draw(stats(2))
    info = policy.step(s, q, n)
    assert info.progress_before == tau
    if name.startswith("adascale"):
        assert info.progress == tau + info.gain
        assert 1.0 <= info.gain <= new_scale
    else:
        assert info.progress == tau + new_scale


def test_rescale_linear_factor_equals_new_scale():
    policy = make_policy("linear", scale=4)
    policy.step([8.0], [1.25], 4)
    policy.rescale(16)
    assert policy.lr_factor == 4.0  # what the step before the rescale applied
    assert policy.factor() == 16.0
    assert policy.step([8.0], [1.25], 16).lr_factor == 16.0
    assert policy.progress == 4 + 16


def test_follow_workers_scales_s_in_proportion_and_keeps_progress():
    policy = make_policy("adascale", scale=6)  # 3 workers x 2 baseline batches each
    policy.step([12.0], [1.25], 6)
    tau, sigma2 = policy.progress, policy.estimator.sigma2
    policy.follow_workers(3, 3)
    assert policy.scale == 6
    policy.follow_workers(3, 2)
    assert policy.scale == 4 and policy.progress == tau and policy.estimator.sigma2 == sigma2
    policy.follow_workers(2, 4)
    assert policy.scale == 8


def test_warmup_span_is_progress_and_a_rescale_keeps_the_position_on_the_ramp():
    """#30 item 2: the ramp counted optimizer steps while its length followed S, so a rescale
    jumped along it (S 4 -> 8 at tau = 20: factor 2.07 -> 6.00). Now the span is 10% of the
    budget in tau at every S, and a rescale keeps where the run is on the ramp."""
    policy = make_policy("warmup:fraction=0.1", scale=4, budget=1000)
    assert policy.span == 100.0  # 10% of 1000 baseline steps, at any S
    for _ in range(5):
        policy.step()
    assert policy.progress == 20.0
    assert policy.factor() == pytest.approx(1 + 3 * 20 / 100)  # S = 4's rule at 20% of the ramp
    policy.rescale(8)
    assert policy.span == 100.0
    # S = 8's rule at the same position: a run started at S = 8 has this factor at tau = 24 (its
    # step from 16) and 2.12 at tau = 16, so 2.4 at tau = 20 lies on its ramp.
    assert policy.factor() == pytest.approx(1 + 7 * 20 / 100)
    fresh = make_policy("warmup:fraction=0.1", scale=8, budget=1000)
    fresh.step(), fresh.step()
    below, above = fresh.factor(), fresh.step() and fresh.factor()
    assert below < policy.factor() < above
    # And back down: 8 -> 4 at tau = 40 rewinds nothing (old: 5.0 -> 2.07).
    for _ in range(3):
        policy.step()
    assert policy.progress == 44.0
    policy.rescale(4)
    assert policy.factor() == pytest.approx(1 + 3 * 44 / 100)


def test_rescale_to_bad_scale_leaves_policy():
    policy = make_policy("adascale", scale=4)
    policy.step([8.0], [1.25], 4)
    before = copy.deepcopy(policy.state_dict())
    with pytest.raises(ValueError, match=r"0\.5"):
        policy.rescale(0.5)
    assert policy.state_dict() == before and policy.scale == 4


# ----------------------------------------------------------------------------------------------
# 4. What each rule promises.

@pytest.mark.parametrize("name, promised", [
    ("none", lambda s: 1.0), ("linear", lambda s: s), ("sqrt", math.sqrt),
])
@pytest.mark.parametrize("scale", [1.0, 2.0, 3.0, 64.0, 7.5])
@pytest.mark.parametrize("with_stats", [False, True])
def test_fixed_rule_factor_and_progress(name, promised, scale, with_stats):
    policy = make_policy(name, scale=scale)
    for k in range(1, 8):
        info = policy.step([8.0, 2.0], [1.25, 0.5], 4) if with_stats else policy.step()
        assert info.lr_factor == promised(scale)
        assert info.step == k
        assert info.progress_before == (k - 1) * scale
        assert info.progress == k * scale == policy.progress
    # Fixed rules still measure the gain when given statistics (for logging only).
    if with_stats and scale > 1:
        assert info.gain > 1.0
        assert info.gain == policy.estimator.gain


def test_warmup_ramp_by_hand():
    # S = 5 over 20 baseline steps (4 steps): 1, 2, 3, 4, then 5 for ever.
    policy = make_policy("warmup:baseline_steps=20", scale=5)
    factors = [policy.step().lr_factor for _ in range(8)]
    assert factors == [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    assert policy.progress == 8 * 5


def test_warmup_default_fraction_is_lsw():
    # 5.5% of 1000 baseline steps is 55 at every S; at S = 4 the ramp is reached at tau = 56
    # (the 15th step starts there), rising 3 x 4 / 55 a step.
    assert make_policy("warmup", scale=1, budget=1000).span == pytest.approx(55)
    policy = make_policy("warmup", scale=4, budget=1000)
    assert policy.span == pytest.approx(55)
    factors = [policy.step().lr_factor for _ in range(20)]
    assert factors[0] == 1.0
    assert all(b > a for a, b in zip(factors[:14], factors[1:15]))
    np.testing.assert_allclose(np.diff(factors[:14]), 3.0 * 4 / 55, rtol=1e-9)
    assert factors[14:] == [4.0] * 6
    assert policy.progress == 20 * 4


@SETTINGS
@given(scale=scales, span=st.integers(1, 50), steps=st.integers(1, 120))
def test_warmup_ramp_property(scale, span, steps):
    policy = make_policy(f"warmup:baseline_steps={span}", scale=scale)
    for k in range(steps):
        info = policy.step()
        want = 1.0 + (scale - 1.0) * min(1.0, k * scale / span)
        assert info.lr_factor == pytest.approx(want, rel=1e-12)
        assert 1.0 <= info.lr_factor <= scale
        assert info.progress == pytest.approx((k + 1) * scale, rel=1e-12)


STATS_SEQUENCE = [([8.0], [1.25], 4), ([10.0], [1.0], 4), ([6.0], [0.5], 4), ([12.0], [2.9], 4)]


@pytest.mark.parametrize("spec, root", [("adascale", False), ("adascale_adam", True)])
def test_adascale_factor_and_progress_follow_the_gain(spec, root):
    policy = make_policy(spec + ":smoothing=0.5", scale=4)
    reference = GainEstimator(4, smoothing=0.5)
    tau = 0.0
    for s, q, n in STATS_SEQUENCE:
        r = reference.update(s, q, n)
        info = policy.step(s, q, n)
        assert info.gain == r
        assert info.lr_factor == (math.sqrt(r) if root else r)
        assert info.progress_before == tau
        tau += r
        assert info.progress == tau == policy.progress
    assert 1.0 < tau / len(STATS_SEQUENCE) < 4.0  # the gain really was measured, and below S


def test_adascale_adam_takes_no_statistics_before_adams_second_moment_has_history(monkeypatch):
    monkeypatch.setattr(hvd_scale.policies.AdaScaleAdam, "MIN_ADAM_HISTORY", 20)
    policy = make_policy("adascale_adam:smoothing=0.5", scale=4)
    reference = GainEstimator(4, smoothing=0.5)
    for step in range(20):  # gain 1: the baseline lr, one baseline step of progress each
        s, q, n = STATS_SEQUENCE[step % len(STATS_SEQUENCE)]
        info = policy.step(s, q, n)
        assert (info.lr_factor, info.gain, info.progress) == (1.0, 1.0, step + 1.0)
        assert policy.estimator.state.updates == 0
    with pytest.raises(ValueError, match="finite"):  # bad statistics still fail
        policy.step(math.nan, 1.0, 4)
    tau = policy.progress
    for s, q, n in STATS_SEQUENCE:  # then measured, as adascale's gain, lr x sqrt(r)
        r = reference.update(s, q, n)
        info = policy.step(s, q, n)
        assert info.gain == r and info.lr_factor == math.sqrt(r)
        tau += r
        assert info.progress == tau


def test_adascale_first_step_by_hand():
    # m = 2, q = 1.25, n = S = 4 gives sigma2 = mu2 = 1 and r = 1.6 (estimate.py's example).
    info = make_policy("adascale:smoothing=0.0", scale=4).step(8.0, 1.25, 4)
    assert info.gain == pytest.approx(1.6, rel=1e-15)
    assert info.lr_factor == info.gain and info.progress == info.gain


def test_adascale_at_scale_one_is_baseline_sgd():
    policy = make_policy("adascale", scale=1)
    infos = [policy.step(), policy.step([3.0], [1.0], 2), policy.step([2.0], [2.0], 1)]
    assert [i.lr_factor for i in infos] == [1.0, 1.0, 1.0]
    assert policy.progress == 3.0


def test_adascale_needs_statistics_above_scale_one():
    policy = make_policy("adascale", scale=2)
    policy.step([8.0], [1.25], 4)
    before = copy.deepcopy(policy.state_dict())
    with pytest.raises(ValueError, match="adascale.*statistics"):
        policy.step()
    assert policy.state_dict() == before


def test_done_against_budget():
    policy = make_policy("linear", scale=4, budget=10)
    assert not policy.done()
    policy.step(), policy.step()
    assert policy.progress == 8 and not policy.done()
    assert policy.done(budget=8) and not policy.done(budget=8.5)
    policy.step()
    assert policy.done() and policy.progress == 12


def test_done_for_adascale_counts_gains():
    policy = make_policy("adascale:smoothing=0.0", scale=4, budget=3.0)
    policy.step(8.0, 1.25, 4)  # r = 1.6
    assert not policy.done()
    policy.step(8.0, 1.25, 4)  # tau = 3.2
    assert policy.done()


def test_done_without_budget_raises():
    with pytest.raises(ValueError, match="budget"):
        make_policy("linear", scale=4).done()


@pytest.mark.parametrize("budget", [0, -5, math.nan, math.inf, "many", True])
def test_budget_must_be_finite_and_positive(budget):
    """Issue #22, 4: budget 0 or less trained nothing and exited 0; nan never finished."""
    with pytest.raises(ValueError, match=rf"budget must be a finite number > 0 .*got {re.escape(repr(budget))}"):
        make_policy("linear", scale=4, budget=budget)
    with pytest.raises(ValueError, match="budget must be a finite number > 0"):
        make_policy("linear", scale=4).done(budget)
    with pytest.raises(ValueError, match="budget must be a finite number > 0"):
        hvd_scale.spec.resolve_policy(make_policy("linear", scale=4), scale=4, budget=budget)
    assert make_policy("linear", scale=4, budget=2.5).budget == 2.5


def test_adascale_rejects_adam_and_names_the_alternative():
    with pytest.raises(ValueError, match=r"'Adam'.*adascale_adam"):
        make_policy("adascale", scale=4, optimizer="Adam")
    with pytest.raises(ValueError, match=r"'RMSprop'"):
        make_policy("adascale", scale=4, optimizer="RMSprop")
    assert make_policy("adascale", scale=4, optimizer="SGD").name == "adascale"


def test_adascale_adam_accepts_adam_family_only():
    for opt in ("Adam", "AdamW"):
        assert make_policy("adascale_adam", scale=4, optimizer=opt).name == "adascale_adam"
    with pytest.raises(ValueError, match=r"'SGD'.*adascale"):
        make_policy("adascale_adam", scale=4, optimizer="SGD")


@pytest.mark.parametrize("spec", ["none", "linear", "sqrt", "warmup:baseline_steps=5"])
def test_fixed_rules_accept_any_optimizer(spec):
    for opt in ("SGD", "Adam", "RMSprop"):
        assert make_policy(spec, scale=4, optimizer=opt).name == parse_spec(spec)[0]


def test_policy_from_environment(monkeypatch):
    monkeypatch.setenv(hvd_scale.POLICY_ENV, "sqrt")
    assert hvd_scale.POLICY_ENV == "HVD_SCALE_POLICY"
    policy = make_policy(scale=4)
    assert policy.name == "sqrt" and policy.factor() == 2.0
    monkeypatch.setenv("HVD_SCALE_POLICY", "warmup:baseline_steps=7")
    policy = make_policy(None, scale=4)
    assert policy.name == "warmup" and policy.span == 7
    # An explicit spec wins over the environment.
    assert make_policy("linear", scale=4).name == "linear"
    monkeypatch.setenv("HVD_SCALE_POLICY", "adascalee")
    with pytest.raises(ValueError, match="adascalee"):
        make_policy(scale=4)
    monkeypatch.delenv("HVD_SCALE_POLICY")
    assert make_policy(scale=4).name == "adascale"  # the default


def test_code_policy_against_the_flag(monkeypatch):
    """#32 item 2: a policy in the code and another from `hvd-scale run --policy` are refused,
    naming both; the same policy in both (or none in the code) runs."""
    monkeypatch.setenv("HVD_SCALE_POLICY", "linear")
    with pytest.raises(ValueError, match=r"code asks for policy 'adascale'.*HVD_SCALE_POLICY='linear'"
                                         r".*hvd-scale run --policy.*leave the policy to the flag"):
        resolve_policy("adascale", scale=4)
    with pytest.raises(ValueError, match="code asks for policy 'sqrt'"):
        resolve_policy(make_policy("sqrt", scale=4), scale=4)
    assert resolve_policy(None, scale=4).name == "linear"
    assert resolve_policy(" Linear ", scale=4).name == "linear"  # the same policy, spelled apart
    monkeypatch.setenv("HVD_SCALE_POLICY", "warmup:baseline_steps=7")
    with pytest.raises(ValueError, match="baseline_steps=8"):
        resolve_policy("warmup:baseline_steps=8", scale=4)
    monkeypatch.delenv("HVD_SCALE_POLICY")
    assert resolve_policy("sqrt", scale=4).name == "sqrt"


def test_spec_parsing_normalises():
    assert parse_spec(" Warmup : baseline_steps = 10 ") == ("warmup", {"baseline_steps": 10})
    assert parse_spec("adascale-adam:smoothing=0.9") == ("adascale_adam", {"smoothing": 0.9})
    assert make_policy("warmup:baseline_steps=10", scale=2).spec == "warmup:baseline_steps=10"


def test_metrics_are_floats():
    policy = make_policy("adascale", scale=4)
    policy.step([8.0], [1.25], 4)
    metrics = policy.metrics()
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["gain"] == policy.gain and metrics["progress"] == policy.progress
    assert metrics["noise_scale"] == pytest.approx(policy.estimator.sigma2 / policy.estimator.mu2)


# ----------------------------------------------------------------------------------------------
# 3. Bad input: ValueError (or TypeError) naming the bad value; the policy state is unchanged.

@pytest.mark.parametrize("spec, pattern", [
    ("adascal", r"unknown policy 'adascal'"),
    ("", r"''"),
    ("linear:smoothing=0.5", r"unknown option 'smoothing'"),
    ("adascale:foo=1", r"unknown option 'foo'"),
    ("adascale:smoothing", r"'smoothing'.*needs a value"),
    ("adascale:smoothing=1.5", r"smoothing='1\.5'"),
    ("adascale:smoothing=abc", r"smoothing='abc'"),
    ("warmup:baseline_steps=-3", r"steps='-3'"),
    ("warmup:baseline_steps=2.5", r"steps='2\.5'"),
    ("warmup:fraction=0", r"fraction='0'"),
    ("warmup:fraction=1.5", r"fraction='1\.5'"),
    ("warmup:baseline_steps=5,fraction=0.1", r"steps= or fraction="),
    ("warmup", r"fraction=0\.055.*budget"),
    ("warmup:fraction=0.2", r"fraction=0\.2.*budget"),
])
def test_bad_specs(spec, pattern, monkeypatch):
    monkeypatch.delenv("HVD_SCALE_POLICY", raising=False)
    with pytest.raises(ValueError, match=pattern):
        make_policy(spec, scale=4)


def test_bad_spec_type():
    with pytest.raises(ValueError, match="42"):
        make_policy(42, scale=4)


@pytest.mark.parametrize("scale, pattern", [(0.5, r"0\.5"), (float("nan"), "nan"), ("x", "'x'")])
def test_bad_scale_for_policy(scale, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        make_policy("linear", scale=scale)


def trained(spec: str, scale: float = 4.0) -> hvd_scale.Policy:
    policy = build(spec, scale)
    policy.step([8.0], [1.25], 4)
    policy.step([10.0], [1.0], 4)
    return policy


BAD_STEPS = [
    # (sqnorm_sum, mean_sqnorm, n, message pattern)
    ([float("nan")], [1.0], 4, "nan"),
    ([float("inf")], [1.0], 4, "inf"),
    ([8.0], [float("-inf")], 4, "-inf"),
    ([-8.0], [1.0], 4, r"-8\.0"),
    ([8.0], [-1.0], 4, r"-1\.0"),
    ([8.0], [1.25], 0, r"\b0\b"),
    ([8.0], [1.25], -1, r"-1"),
    ([8.0, 1.0], [1.25], 4, r"\(2,\).*\(1,\)"),
    ([8.0, 1.0], [1.25, 0.1], 4, r"1 parameter group.*2"),
]


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("s, q, n, pattern", BAD_STEPS)
def test_bad_statistics_leave_every_policy_unchanged(spec, s, q, n, pattern):
    policy = trained(spec)
    before = copy.deepcopy(policy.state_dict())
    factor, applied = policy.factor(), policy.lr_factor
    with pytest.raises((ValueError, TypeError), match=pattern):
        policy.step(s, q, n)
    assert policy.state_dict() == before
    assert policy.factor() == factor and policy.lr_factor == applied


@pytest.mark.parametrize("spec", ["adascale", "adascale_adam"])
def test_adascale_rejects_single_micro_gradient_above_scale_one(spec):
    policy = trained(spec)
    before = copy.deepcopy(policy.state_dict())
    with pytest.raises(ValueError, match=r"n = 1"):
        policy.step([8.0], [8.0], 1)
    assert policy.state_dict() == before


def test_fixed_rule_with_one_micro_gradient_only_skips_the_estimate():
    # Documented: a fixed rule logs the gain when it can; n = 1 simply gives no estimate.
    policy = trained("linear")
    estimator_before = copy.deepcopy(policy.estimator.state_dict())
    info = policy.step([8.0], [8.0], 1)
    assert info.lr_factor == 4.0 and info.progress == 12.0
    assert policy.estimator.state_dict() == estimator_before


# Loading checkpoints.

@pytest.mark.parametrize("spec, other", [
    ("adascale", "linear"), ("linear", "adascale"), ("adascale", "adascale:smoothing=0.5"),
    ("warmup:baseline_steps=3", "warmup:baseline_steps=4"), ("adascale_adam", "adascale"), ("sqrt", "none"),
])
def test_load_state_from_another_policy_raises(spec, other):
    policy = trained(spec)
    before = copy.deepcopy(policy.state_dict())
    foreign = trained(other, scale=8.0)
    foreign.step([8.0], [1.25], 4)
    with pytest.raises(ValueError, match=f"'{other}'"):
        policy.load_state_dict(foreign.state_dict())
    assert policy.state_dict() == before


def _mutated(d: dict, mutate) -> dict:
    d = copy.deepcopy(d)
    mutate(d)
    return d


STATE_MUTATIONS = [
    (lambda d: d.pop("progress"), r"missing keys \['progress'\]"),
    (lambda d: d.pop("estimator"), r"missing keys \['estimator'\]"),
    (lambda d: d.update(gain=2.0), r"unknown keys \['gain'\]"),
    (lambda d: d["estimator"].pop("mu2_biased"), r"missing keys \['mu2_biased'\]"),
    (lambda d: d["estimator"].update(tau=1.0), r"unknown keys \['tau'\]"),
    (lambda d: d.update(version=99), r"version 99"),
    (lambda d: d.update(policy="nonsense"), r"'nonsense'"),
    (lambda d: d["estimator"].update(sigma2_biased=[1.0, 1.0], mu2_biased=[1.0, 1.0]),
     r"2 parameter group"),
    # Bad values, found only after the estimator part was read: nothing may change either.
    (lambda d: d.update(steps="x"), r"'x'"),
    (lambda d: d.update(progress="far"), r"'far'"),
]


@pytest.mark.parametrize("spec", ["adascale", "linear", "warmup:baseline_steps=3"])
@pytest.mark.parametrize("mutate, pattern", STATE_MUTATIONS)
def test_load_bad_state_raises_and_leaves_policy(spec, mutate, pattern):
    policy = trained(spec)
    before = copy.deepcopy(policy.state_dict())
    # A checkpoint of the same policy, further along, so that a partial load would show.
    donor = trained(spec)
    for _ in range(3):
        donor.step([20.0], [4.0], 4)
    bad = _mutated(donor.state_dict(), mutate)
    with pytest.raises(ValueError, match=pattern):
        policy.load_state_dict(bad)
    assert policy.state_dict() == before
    assert policy.estimator.state_dict() == before["estimator"]


def test_load_keeps_this_jobs_scale():
    saved = trained("adascale", scale=8.0).state_dict()
    policy = make_policy("adascale", scale=2)
    policy.load_state_dict(saved)
    assert policy.scale == 2.0
    assert policy.progress == saved["progress"]
    assert 1.0 <= policy.gain <= 2.0


# -- resolve_policy / agree_across_ranks (what both adapters build their policy with) ------------

def test_resolve_policy_rejects_unmeasurable_adascale():
    with pytest.raises(ValueError, match="needs at least 2 micro-gradients"):
        hvd_scale.spec.resolve_policy("adascale", scale=2, micro_gradients=1)
    # fixed rules need no variance, and S = 1 needs none either
    assert hvd_scale.spec.resolve_policy("linear", scale=2, micro_gradients=1).scale == 2
    assert hvd_scale.spec.resolve_policy("adascale", scale=1, micro_gradients=1).gain == 1.0


def test_resolve_policy_rescales_a_given_policy():
    policy = hvd_scale.make_policy("linear", scale=2)
    assert hvd_scale.spec.resolve_policy(policy, scale=8, optimizer="SGD") is policy
    assert policy.factor() == 8


def _fake_allgather(specs, scales=None, budgets=None):
    """Simulate every rank's build: rank r builds specs[r] (at scales[r], budgets[r]); we play
    rank 0."""
    def builds():
        out = []
        for r, spec in enumerate(specs):
            try:
                p = hvd_scale.make_policy(spec, scale=scales[r] if scales else 2,
                                          budget=budgets[r] if budgets else None)
                out.append(({"policy": p.spec, "scale": p.scale, "budget": p.budget}, None))
            except ValueError as e:
                out.append((None, f"ValueError: {e}"))
        return out
    return lambda mine: builds()


def test_agree_across_ranks_accepts_the_same_spec():
    policy = hvd_scale.spec.agree_across_ranks(
        lambda: hvd_scale.make_policy("sqrt", scale=2), _fake_allgather(["sqrt", "sqrt"]))
    assert policy.name == "sqrt"


def test_agree_across_ranks_reports_differing_specs_on_every_rank():
    with pytest.raises(ValueError, match="different policies") as e:
        hvd_scale.spec.agree_across_ranks(lambda: hvd_scale.make_policy("sqrt", scale=2),
                                              _fake_allgather(["sqrt", "linear"]))
    assert "'sqrt'" in str(e.value) and "'linear'" in str(e.value)


def test_agree_across_ranks_reports_another_ranks_error():
    # rank 0 (us) built fine; rank 1's spec was bad: we raise too, naming rank 1.
    with pytest.raises(ValueError, match="rank 1: ValueError: unknown policy 'sqtr'"):
        hvd_scale.spec.agree_across_ranks(lambda: hvd_scale.make_policy("sqrt", scale=2),
                                              _fake_allgather(["sqrt", "sqtr"]))


@pytest.mark.parametrize("scales, budgets, named", [
    ([2, 4], None, "scale {0: 2.0, 1: 4.0}"),
    ([2, 2], [100, 200], "budget {0: 100.0, 1: 200.0}"),
])
def test_agree_across_ranks_reports_differing_scale_or_budget_per_rank(scales, budgets, named):
    """Issue #22, 1: a scale (or budget) that differs between ranks trained apart silently."""
    with pytest.raises(ValueError, match="different") as e:
        hvd_scale.spec.agree_across_ranks(
            lambda: hvd_scale.make_policy("sqrt", scale=scales[0],
                                          budget=budgets[0] if budgets else None),
            _fake_allgather(["sqrt", "sqrt"], scales, budgets))
    assert named in str(e.value)


def test_agree_across_ranks_compares_the_adapters_settings():
    gathered = [({"policy": "sqrt", "scale": 2.0, "budget": None, "backward_passes_per_step": k,
                  "lr": {"param_groups[0]": lr}}, None) for k, lr in ((1, 0.1), (2, 0.1))]
    with pytest.raises(ValueError, match=r"backward_passes_per_step \{0: 1, 1: 2\}") as e:
        hvd_scale.spec.agree_across_ranks(
            lambda: hvd_scale.make_policy("sqrt", scale=2), lambda mine: gathered,
            lambda built: {"backward_passes_per_step": 1, "lr": {"param_groups[0]": 0.1}})
    assert "lr {" not in str(e.value)  # the lrs agree: only what differs is named


def test_agree_across_ranks_single_process_raises_its_own_error():
    with pytest.raises(ValueError, match="unknown policy"):
        hvd_scale.spec.agree_across_ranks(lambda: hvd_scale.make_policy("sqtr", scale=2), None)


# ----------------------------------------------------------------------------------------------
# The practitioners' rules (the seed's answer): a hand-tuned factor, S^alpha, warm-up to any rule,
# LEGW.

def test_practitioners_rules_by_hand():
    assert [make_policy("fixed:factor=5", scale=8).step().lr_factor for _ in range(2)] == [5, 5]
    assert make_policy("power:alpha=0.5", scale=16).step().lr_factor == 4.0
    assert make_policy("power:alpha=1", scale=16).step().lr_factor == 16.0
    sqrt_warm = make_policy("warmup:rule=sqrt,baseline_steps=64", scale=16)  # 4 steps at S = 16
    assert [sqrt_warm.step().lr_factor for _ in range(6)] == [1.0, 1.75, 2.5, 3.25, 4.0, 4.0]
    fixed_warm = make_policy("warmup:rule=fixed,factor=5,baseline_steps=16", scale=8)
    assert [fixed_warm.step().lr_factor for _ in range(3)] == [1.0, 3.0, 5.0]
    # LEGW at S = 4 with a base warm-up of 2 baseline steps: sqrt(4) after 8 baseline steps.
    legw = make_policy("legw:steps=2", scale=4)
    infos = [legw.step() for _ in range(3)]
    assert [i.lr_factor for i in infos] == [1.0, 2.0, 2.0] and infos[-1].progress == 12.0
    # Every fixed rule's step consumes S baseline batches.
    assert make_policy("fixed:factor=5", scale=8).step().progress == 8.0


@pytest.mark.parametrize("spec, pattern", [
    ("fixed", r"fixed:factor=F"),
    ("fixed:factor=0", r"factor='0'.*> 0"),
    ("power", r"power:alpha=A"),
    ("power:alpha=1.5", r"alpha='1.5'.*\[0, 1\]"),
    ("warmup:rule=cubic,baseline_steps=3", r"rule='cubic'.*\['fixed', 'linear', 'power', 'sqrt'\]"),
    ("warmup:rule=power,baseline_steps=3", r"rule=power needs alpha="),
    ("warmup:alpha=0.5,baseline_steps=3", r"alpha= goes with rule=power"),
    ("warmup:rule=sqrt,factor=2,baseline_steps=3", r"factor= goes with rule=fixed"),
    ("legw", r"legw:steps=N"),
])
def test_practitioners_rules_refuse_bad_specs(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_policy(spec, scale=4, budget=100)


def test_warmup_rule_linear_is_the_plain_warmup():
    assert make_policy("warmup:rule=linear,baseline_steps=3", scale=4).spec == "warmup:baseline_steps=3"


def test_warmup_steps_in_optimizer_steps_is_refused_with_the_new_spelling():
    """#30 item 2: warmup:steps=N counted optimizer steps; read as baseline steps it would
    silently shorten a ramp S-fold, so the old option is refused, naming the conversion."""
    with pytest.raises(ValueError, match=r"'warmup:steps=500'.*baseline_steps=<steps x S>"):
        make_policy("warmup:steps=500", scale=8)


def test_a_bad_spec_from_the_environment_names_the_variable(monkeypatch):
    """#32 item 6: a typo in $HVD_SCALE_POLICY did not name the variable as its source."""
    monkeypatch.setenv(hvd_scale.POLICY_ENV, "adascalle")
    with pytest.raises(ValueError, match=r"\$HVD_SCALE_POLICY='adascalle' .*unknown policy 'adascalle'"):
        make_policy(scale=4)
    monkeypatch.setenv(hvd_scale.POLICY_ENV, "sqrt")
    assert make_policy(scale=4).name == "sqrt"
    assert make_policy("linear", scale=4).name == "linear"  # an explicit spec: the environment unread
