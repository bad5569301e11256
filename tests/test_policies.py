"""Policies: the factor each rule promises, progress tau, checkpoints, changes of S and bad input.

A policy is a frozen configuration (issue #47): the record is a ``PolicyState`` the test holds,
S an argument of every step and every reading. Pure engine tests: numpy and hypothesis only (no
torch, TensorFlow or Horovod).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hvd_scale
from hvd_scale import GainEstimator, available_policies, make_policy, parse_spec
from hvd_scale import run as runs
from hvd_scale.run import RunState, Setup
from hvd_scale.spec import resolve_policy
from hvd_scale.estimate import gain_ratio
from hvd_scale.state import PolicyState

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


# The warm-in off for the mechanics tests, on where a test asks (``warm_in``).
from warm_in_fixtures import warm_in, without_warm_in  # noqa: F401,E402  (fixtures)


def test_registry_is_what_the_reference_lists():
    # The reference's rules, and the practitioners' (the seed's experiment).
    assert set(available_policies()) == {"none", "linear", "sqrt", "warmup", "adascale",
                                         "adascale_adam", "power", "fixed", "legw"}


def build(spec: str) -> hvd_scale.Policy:
    return make_policy(spec, budget=BUDGET)


def run_steps(policy: hvd_scale.Policy, scale: float, count: int,
              state: PolicyState | None = None) -> tuple[PolicyState, list]:
    """``count`` transitions at S = ``scale`` without statistics, from ``state`` (default: the
    record before a first step): (the record after them, their StepInfos)."""
    state = policy.init() if state is None else state
    infos = []
    for _ in range(count):
        state, info = policy.transition(state, scale=scale)
        infos.append(info)
    return state, infos


def test_a_policy_is_a_frozen_configuration():
    """#47: a policy holds no state and no S; a run's record is the caller's."""
    policy = make_policy("adascale")
    assert policy.init() == PolicyState()
    assert policy.init().lr_factor is None
    state, info = policy.transition(policy.init(), [8.0], [1.25], 4, scale=4)
    assert (state.steps, state.progress, state.lr_factor) == (1, info.progress, info.lr_factor)
    assert policy.init() == PolicyState()  # the step changed the record returned, not the policy
    assert repr(policy) == "AdaScale(spec='adascale')"
    for name, value in (("budget", 10.0), ("state", state), ("_scale", 8.0)):
        with pytest.raises(AttributeError, match="frozen configuration"):
            setattr(policy, name, value)
    assert policy.budget is None and not hasattr(policy, "state")


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


def policy_state_equal(pa: hvd_scale.Policy, a: PolicyState, pb: hvd_scale.Policy,
                       b: PolicyState, scale: float) -> None:
    assert pa.state_dict(a, scale) == pb.state_dict(b, scale)
    # lr_factor: what the latest step applied, None (in both) before any step
    assert a.lr_factor == b.lr_factor
    assert pa.gain(a, scale) == pb.gain(b, scale) and a.progress == b.progress


# ----------------------------------------------------------------------------------------------
# 1. Checkpoints and changes of S, for every policy.

@pytest.mark.parametrize("spec", ALL_SPECS)
@SETTINGS
@given(scale=scales, groups=st.integers(1, 3), data=st.data(),
       past=st.integers(0, 6), through_json=st.booleans())
def test_policy_state_round_trip_gives_identical_future(spec, scale, groups, data, past, through_json):
    policy = build(spec)
    state = policy.init()
    for _ in range(past):
        state, _ = policy.transition(state, *data.draw(stats(groups)), scale=scale)
    saved = policy.state_dict(state, scale)
    if through_json:
        saved = json.loads(json.dumps(saved))
    twin = build(spec)
    twin_state = twin.load_state(saved)
    policy_state_equal(twin, twin_state, policy, state, scale)
    assert twin_state.steps == state.steps == past
    for _ in range(4):
        s, q, n = data.draw(stats(groups))
        twin_state, twin_info = twin.transition(twin_state, s, q, n, scale=scale)
        state, info = policy.transition(state, s, q, n, scale=scale)
        assert twin_info == info  # StepInfo: factor, progress, gain
        policy_state_equal(twin, twin_state, policy, state, scale)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_policy_round_trip_without_statistics_for_fixed_rules_and_scale_one(spec):
    # A fixed rule may run without statistics; AdaScale only at S = 1.
    scale = 1.0 if spec.startswith("adascale") else 6.0
    policy = build(spec)
    state, _ = run_steps(policy, scale, 5)
    twin = build(spec)
    twin_state = twin.load_state(json.loads(json.dumps(policy.state_dict(state, scale))))
    for _ in range(5):
        twin_state, twin_info = twin.transition(twin_state, scale=scale)
        state, info = policy.transition(state, scale=scale)
        assert twin_info == info


@pytest.mark.parametrize("spec", ALL_SPECS)
@SETTINGS
@given(scale=scales, new_scale=scales, data=st.data())
def test_rescale_keeps_progress_and_estimates(spec, scale, new_scale, data):
    # A change of S is no call: the record is read, and the next step taken, at the new S.
    policy = build(spec)
    state = policy.init()
    for _ in range(3):
        state, _ = policy.transition(state, *data.draw(stats(2)), scale=scale)
    tau, steps = state.progress, state.steps
    sigma2 = policy.estimator(state, scale).group_sigma2.copy()
    mu2 = policy.estimator(state, scale).group_mu2.copy()
    assert policy.metrics(state, new_scale)["scale"] == new_scale
    assert policy.estimator(state, new_scale).scale == new_scale
    assert state.progress == tau and state.steps == steps
    np.testing.assert_array_equal(policy.estimator(state, new_scale).group_sigma2, sigma2)
    np.testing.assert_array_equal(policy.estimator(state, new_scale).group_mu2, mu2)
    gain = 1.0 if new_scale == 1 else gain_ratio(sigma2, mu2, new_scale)
    assert policy.gain(state, new_scale) == min(gain, getattr(policy, "max_gain", math.inf))  # adascale_adam's cap
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
        assert policy.factor(state, new_scale) == pytest.approx(want, rel=1e-15)
    else:
        assert policy.factor(state, new_scale) == promised[name]
    # The next step advances tau by the new scale (fixed rules) or the gain at the new scale.
    s, q, n = data.draw(stats(2))
    state, info = policy.transition(state, s, q, n, scale=new_scale)
    assert info.progress_before == tau
    if name.startswith("adascale"):
        assert info.progress == tau + info.gain
        assert 1.0 <= info.gain <= new_scale
    else:
        assert info.progress == tau + new_scale


def test_rescale_linear_factor_equals_new_scale():
    policy = make_policy("linear")
    state, _ = policy.transition(policy.init(), [8.0], [1.25], 4, scale=4)
    # S 4 -> 16: the next step's S.
    assert state.lr_factor == 4.0  # what the step before the change applied
    assert policy.metrics(state, 16)["lr_factor"] == 4.0
    assert policy.factor(state, 16) == 16.0
    state, info = policy.transition(state, [8.0], [1.25], 16, scale=16)
    assert info.lr_factor == 16.0
    assert state.progress == 4 + 16


def test_follow_workers_scales_s_in_proportion_and_keeps_progress():
    # A Horovod elastic resize: hvd_scale.run.relayout (was Policy.follow_workers).
    setup = Setup(policy=make_policy("adascale"))
    run = runs.start(setup, scale=6, passes=2, workers=3, measure=True)  # 3 workers x 2 baseline batches each
    record, _ = setup.policy.transition(run.policy, [12.0], [1.25], 6, scale=6)
    run = dataclasses.replace(run, policy=record)
    tau, sigma2 = run.policy.progress, setup.policy.estimator(run.policy, run.scale).sigma2
    assert runs.relayout(setup, run, workers=3).scale == 6
    run = runs.relayout(setup, run, workers=3)
    run = runs.relayout(setup, run, workers=2)
    assert run.scale == 4 and run.policy.progress == tau and run.policy == record
    assert setup.policy.estimator(run.policy, run.scale).sigma2 == sigma2
    run = runs.relayout(setup, run, workers=4)
    assert run.scale == 8 and run.policy == record


def test_warmup_span_is_progress_and_a_rescale_keeps_the_position_on_the_ramp():
    """#30 item 2: the ramp counted optimizer steps while its length followed S, so a rescale
    jumped along it (S 4 -> 8 at tau = 20: factor 2.07 -> 6.00). Now the span is 10% of the
    budget in tau at every S, and a rescale keeps where the run is on the ramp."""
    policy = make_policy("warmup:fraction=0.1", budget=1000)
    assert policy.span == 100.0  # 10% of 1000 baseline steps, at any S
    state, _ = run_steps(policy, 4, 5)
    assert state.progress == 20.0
    assert policy.factor(state, 4) == pytest.approx(1 + 3 * 20 / 100)  # S = 4's rule at 20% of the ramp
    # S 4 -> 8.
    assert policy.span == 100.0
    # S = 8's rule at the same position: a run started at S = 8 has this factor at tau = 24 (its
    # step from 16) and 2.12 at tau = 16, so 2.4 at tau = 20 lies on its ramp.
    assert policy.factor(state, 8) == pytest.approx(1 + 7 * 20 / 100)
    fresh = make_policy("warmup:fraction=0.1", budget=1000)
    fresh_state, _ = run_steps(fresh, 8, 2)
    below = fresh.factor(fresh_state, 8)
    fresh_state, _ = run_steps(fresh, 8, 1, fresh_state)
    above = fresh.factor(fresh_state, 8)
    assert below < policy.factor(state, 8) < above
    # And back down: 8 -> 4 at tau = 40 rewinds nothing (old: 5.0 -> 2.07).
    state, _ = run_steps(policy, 8, 3, state)
    assert state.progress == 44.0
    assert policy.factor(state, 4) == pytest.approx(1 + 3 * 44 / 100)


def test_rescale_to_bad_scale_leaves_policy():
    # S < 1: refused by the step at that S and by hvd_scale.run.relayout (was Policy.rescale).
    policy = make_policy("adascale")
    state, _ = policy.transition(policy.init(), [8.0], [1.25], 4, scale=4)
    before = copy.deepcopy(policy.state_dict(state, 4))
    with pytest.raises(ValueError, match=r"0\.5"):
        policy.transition(state, [8.0], [1.25], 4, scale=0.5)
    assert policy.state_dict(state, 4) == before
    setup = Setup(policy=policy)
    run = dataclasses.replace(runs.start(setup, scale=4, passes=1, workers=4, measure=True),
                              policy=state)
    saved = copy.deepcopy(run.to_dict(setup))
    with pytest.raises(ValueError, match=r"S was set to 0\.5, which would take S from 4 to 0\.5: "
                                         r"S = 0\.5 is below the baseline batch"):
        runs.relayout(setup, run, scale=0.5)
    assert run.to_dict(setup) == saved and run.scale == 4


# ----------------------------------------------------------------------------------------------
# 4. What each rule promises.

@pytest.mark.parametrize("name, promised", [
    ("none", lambda s: 1.0), ("linear", lambda s: s), ("sqrt", math.sqrt),
])
@pytest.mark.parametrize("scale", [1.0, 2.0, 3.0, 64.0, 7.5])
@pytest.mark.parametrize("with_stats", [False, True])
def test_fixed_rule_factor_and_progress(name, promised, scale, with_stats):
    policy = make_policy(name)
    state = policy.init()
    for k in range(1, 8):
        if with_stats:
            state, info = policy.transition(state, [8.0, 2.0], [1.25, 0.5], 4, scale=scale)
        else:
            state, info = policy.transition(state, scale=scale)
        assert info.lr_factor == promised(scale)
        assert info.step == k
        assert info.progress_before == (k - 1) * scale
        assert info.progress == k * scale == state.progress
    # Fixed rules still measure the gain when given statistics (for logging only).
    if with_stats and scale > 1:
        assert info.gain > 1.0
        assert info.gain == policy.estimator(state, scale).gain


def test_warmup_ramp_by_hand():
    # S = 5 over 20 baseline steps (4 steps): 1, 2, 3, 4, then 5 for ever.
    policy = make_policy("warmup:baseline_steps=20")
    state, infos = run_steps(policy, 5, 8)
    factors = [info.lr_factor for info in infos]
    assert factors == [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    assert state.progress == 8 * 5


def test_warmup_default_fraction_is_lsw():
    # 5.5% of 1000 baseline steps is 55 at every S; at S = 4 the ramp is reached at tau = 56
    # (the 15th step starts there), rising 3 x 4 / 55 a step.
    policy = make_policy("warmup", budget=1000)
    assert policy.span == pytest.approx(55)
    state, infos = run_steps(policy, 4, 20)
    factors = [info.lr_factor for info in infos]
    assert factors[0] == 1.0
    assert all(b > a for a, b in zip(factors[:14], factors[1:15]))
    np.testing.assert_allclose(np.diff(factors[:14]), 3.0 * 4 / 55, rtol=1e-9)
    assert factors[14:] == [4.0] * 6
    assert state.progress == 20 * 4


@SETTINGS
@given(scale=scales, span=st.integers(1, 50), steps=st.integers(1, 120))
def test_warmup_ramp_property(scale, span, steps):
    policy = make_policy(f"warmup:baseline_steps={span}")
    state = policy.init()
    for k in range(steps):
        state, info = policy.transition(state, scale=scale)
        want = 1.0 + (scale - 1.0) * min(1.0, k * scale / span)
        assert info.lr_factor == pytest.approx(want, rel=1e-12)
        assert 1.0 <= info.lr_factor <= scale
        assert info.progress == pytest.approx((k + 1) * scale, rel=1e-12)


STATS_SEQUENCE = [([8.0], [1.25], 4), ([10.0], [1.0], 4), ([6.0], [0.5], 4), ([12.0], [2.9], 4)]


@pytest.mark.parametrize("spec, root", [("adascale", False), ("adascale_adam", True)])
def test_adascale_factor_and_progress_follow_the_gain(spec, root):
    policy = make_policy(spec + ":smoothing=0.5")
    state = policy.init()
    reference = GainEstimator(4, smoothing=0.5)
    tau = 0.0
    for s, q, n in STATS_SEQUENCE:
        r = reference.update(s, q, n)
        state, info = policy.transition(state, s, q, n, scale=4)
        assert info.gain == r
        assert info.lr_factor == (math.sqrt(r) if root else r)
        assert info.progress_before == tau
        tau += r
        assert info.progress == tau == state.progress
    assert 1.0 < tau / len(STATS_SEQUENCE) < 4.0  # the gain really was measured, and below S


def test_adascale_adam_takes_no_statistics_before_adams_second_moment_has_history(monkeypatch):
    monkeypatch.setattr(hvd_scale.policies.AdaScaleAdam, "MIN_ADAM_HISTORY", 20)
    policy = make_policy("adascale_adam:smoothing=0.5")
    state = policy.init()
    reference = GainEstimator(4, smoothing=0.5)
    for step in range(20):  # gain 1: the baseline lr, one baseline step of progress each
        s, q, n = STATS_SEQUENCE[step % len(STATS_SEQUENCE)]
        state, info = policy.transition(state, s, q, n, scale=4)
        assert (info.lr_factor, info.gain, info.progress) == (1.0, 1.0, step + 1.0)
        assert policy.estimator(state, 4).state.updates == 0
    with pytest.raises(ValueError, match="finite"):  # bad statistics still fail
        policy.transition(state, math.nan, 1.0, 4, scale=4)
    tau = state.progress
    for s, q, n in STATS_SEQUENCE:  # then measured, as adascale's gain, lr x sqrt(r)
        r = reference.update(s, q, n)
        state, info = policy.transition(state, s, q, n, scale=4)
        assert info.gain == r and info.lr_factor == math.sqrt(r)
        tau += r
        assert info.progress == tau


def test_adascale_first_step_by_hand():
    # m = 2, q = 1.25, n = S = 4 gives sigma2 = mu2 = 1 and r = 1.6 (estimate.py's example).
    policy = make_policy("adascale:smoothing=0.0")
    _, info = policy.transition(policy.init(), 8.0, 1.25, 4, scale=4)
    assert info.gain == pytest.approx(1.6, rel=1e-15)
    assert info.lr_factor == info.gain and info.progress == info.gain

# -- the warm-in: the first steps' gains from young estimates ---------------------------------------

def _low_rank_steps(rng, steps, workers=2, passes=8):
    """Per-step statistics of W x k Gaussian micro-gradients g = mu + e at S = W k, noise of low
    rank (eigenvalues 0.7, 0.3 of a baseline batch's covariance, sigma2 = 1), mu2 = 0.2 at 45
    degrees to the first: (per-worker sqnorm_sum, per-pass sqnorm_sum, mean_sqnorm) per step, and
    the true gain (benchmarks/warm_in.py's setting)."""
    scale = workers * passes
    lam, mu = np.array([0.7, 0.3, 0.0]), math.sqrt(0.1) * np.array([1.0, 0.0, 1.0])
    g = rng.standard_normal((steps, workers, passes, 3)) * np.sqrt(lam) + mu  # (n / S) C = C
    sums = g.sum(axis=2)
    per_worker = np.sum(sums * sums, axis=(2, 1)) / passes       # sum_w |G_w|^2 / k_w
    per_pass = np.sum(g * g, axis=(3, 2, 1))
    mean = g.mean(axis=(1, 2))
    true_gain = (1.0 + 0.2) / (1.0 / scale + 0.2)
    return per_worker, per_pass, np.sum(mean * mean, axis=1), true_gain


@pytest.mark.parametrize("spec", ["adascale", "adascale_adam"])
@pytest.mark.parametrize("samples", ["workers", "passes"])
def test_adascale_first_steps_never_apply_far_more_than_the_true_gain(spec, samples, warm_in):
    # W 2 x k 8, noise of low rank: the first steps' estimates average one to a few noisy steps.
    # Before the warm-in step 1 applied more than 1.5 x the true gain in ~25% of runs (up to
    # S = 16); it must stay within x 1.5 above in >= 95% of runs at each of the first 50 steps,
    # and be within x 1.5 of the truth both ways by step 50 (the warm-in ends).
    runs_, steps, scale = 200, 50, 16
    applied = np.empty((runs_, steps))
    for run in range(runs_):
        per_worker, per_pass, q, true_gain = _low_rank_steps(np.random.default_rng(run), steps)
        policy, state = make_policy(spec), None
        state = policy.init()
        for t in range(steps):
            s, n_samples = (per_worker[t], 2) if samples == "workers" else (per_pass[t], None)
            state, info = policy.transition(state, s, q[t], 16, scale=scale, samples=n_samples)
            applied[run, t] = info.gain
    above = np.mean(applied > 1.5 * true_gain, axis=0)
    assert above.max() <= 0.05, f"steps whose gain > 1.5 x true in > 5% of runs: {above.round(2)}"
    last = applied[:, -1] / true_gain
    assert np.mean((last >= 1 / 1.5) & (last <= 1.5)) >= 0.95
    assert np.all(applied >= 1.0)


def test_adascale_warm_in_ends_where_the_ema_reaches_its_horizon_and_is_off_without_one(warm_in):
    # The warm-in takes off the young EMA's excess uncertainty only: once the EMA holds about its
    # horizon's samples, and at every step without smoothing (smoothing=0: the user asked for
    # each step's own estimate), the gain applied is the estimator's.
    steady = make_policy("adascale")
    state = steady.init()
    for _ in range(300):
        state, info = steady.transition(state, [24.0], [1.25], 16, scale=16, samples=2)
    est = steady.estimator(state, 16)
    assert info.gain == gain_ratio(est.group_sigma2, est.group_mu2, 16) == pytest.approx(4.0)
    plain = make_policy("adascale:smoothing=0")
    _, info = plain.transition(plain.init(), 8.0, 1.25, 4, scale=4)
    assert info.gain == pytest.approx(1.6, rel=1e-15)


def test_adascale_warm_in_follows_the_estimates_uncertainty_not_a_count(warm_in):
    # After the same number of steps, estimates dominated by the signal (mu2 >> sigma2 / S: q
    # holds little noise) are applied more nearly whole than noise-dominated ones; both grow
    # toward the estimator's gain step by step, never above it.
    def gains(sqnorm_sum, mean_sqnorm, steps):
        policy = make_policy("adascale")
        state, out = policy.init(), []
        for _ in range(steps):
            state, info = policy.transition(state, sqnorm_sum, mean_sqnorm, 16, scale=16)
            est = policy.estimator(state, 16)
            out.append((info.gain, gain_ratio(est.group_sigma2, est.group_mu2, 16)))
        return out
    signal = gains(40.0, 1.0, 5)     # sigma2 = 1.6, mu2 = 0.9: raw gain 2.5
    noise = gains(241.0, 1.0, 5)     # sigma2 = 15, mu2 = 0.06: raw gain 15
    for series in (signal, noise):
        assert all(1.0 <= g <= r for g, r in series)
        assert all(a[0] < b[0] for a, b in zip(series, series[1:]))
    (g_signal, r_signal), (g_noise, r_noise) = signal[-1], noise[-1]
    # step 5: 39% of r - 1 against 26%; the noise-dominated one is also the larger r
    assert (g_signal - 1) / (r_signal - 1) > 1.3 * (g_noise - 1) / (r_noise - 1)


def test_adascale_at_scale_one_is_baseline_sgd():
    policy = make_policy("adascale")
    state, first = policy.transition(policy.init(), scale=1)
    state, second = policy.transition(state, [3.0], [1.0], 2, scale=1)
    state, third = policy.transition(state, [2.0], [2.0], 1, scale=1)
    assert [i.lr_factor for i in (first, second, third)] == [1.0, 1.0, 1.0]
    assert state.progress == 3.0


def test_adascale_needs_statistics_above_scale_one():
    policy = make_policy("adascale")
    state, _ = policy.transition(policy.init(), [8.0], [1.25], 4, scale=2)
    before = copy.deepcopy(policy.state_dict(state, 2))
    with pytest.raises(ValueError, match="adascale.*statistics"):
        policy.transition(state, scale=2)
    assert policy.state_dict(state, 2) == before


def test_done_against_budget():
    policy = make_policy("linear", budget=10)
    state = policy.init()
    assert not policy.done(state)
    state, _ = run_steps(policy, 4, 2, state)
    assert state.progress == 8 and not policy.done(state)
    assert policy.done(state, budget=8) and not policy.done(state, budget=8.5)
    state, _ = run_steps(policy, 4, 1, state)
    assert policy.done(state) and state.progress == 12


def test_done_for_adascale_counts_gains():
    policy = make_policy("adascale:smoothing=0.0", budget=3.0)
    state, _ = policy.transition(policy.init(), 8.0, 1.25, 4, scale=4)  # r = 1.6
    assert not policy.done(state)
    state, _ = policy.transition(state, 8.0, 1.25, 4, scale=4)  # tau = 3.2
    assert policy.done(state)


def test_done_without_budget_raises():
    with pytest.raises(ValueError, match="budget"):
        make_policy("linear").done(PolicyState())


@pytest.mark.parametrize("budget", [0, -5, math.nan, math.inf, "many", True])
def test_budget_must_be_finite_and_positive(budget):
    """Issue #22, 4: budget 0 or less trained nothing and exited 0; nan never finished."""
    with pytest.raises(ValueError, match=rf"budget must be a finite number > 0 .*got {re.escape(repr(budget))}"):
        make_policy("linear", budget=budget)
    with pytest.raises(ValueError, match="budget must be a finite number > 0"):
        make_policy("linear").done(PolicyState(), budget)
    with pytest.raises(ValueError, match="budget must be a finite number > 0"):
        hvd_scale.spec.resolve_policy(make_policy("linear"), scale=4, budget=budget)
    assert make_policy("linear", budget=2.5).budget == 2.5


def test_adascale_rejects_adam_and_names_the_alternative():
    with pytest.raises(ValueError, match=r"'Adam'.*adascale_adam"):
        make_policy("adascale", optimizer="Adam")
    with pytest.raises(ValueError, match=r"'RMSprop'"):
        make_policy("adascale", optimizer="RMSprop")
    assert make_policy("adascale", optimizer="SGD").name == "adascale"


def test_adascale_adam_accepts_adam_family_only():
    for opt in ("Adam", "AdamW"):
        assert make_policy("adascale_adam", optimizer=opt).name == "adascale_adam"
    with pytest.raises(ValueError, match=r"'SGD'.*adascale"):
        make_policy("adascale_adam", optimizer="SGD")


@pytest.mark.parametrize("spec", ["none", "linear", "sqrt", "warmup:baseline_steps=5"])
def test_fixed_rules_accept_any_optimizer(spec):
    for opt in ("SGD", "Adam", "RMSprop"):
        assert make_policy(spec, optimizer=opt).name == parse_spec(spec)[0]


def test_policy_from_environment(monkeypatch):
    monkeypatch.setenv(hvd_scale.POLICY_ENV, "sqrt")
    assert hvd_scale.POLICY_ENV == "HVD_SCALE_POLICY"
    policy = make_policy()
    assert policy.name == "sqrt" and policy.factor(policy.init(), 4) == 2.0
    monkeypatch.setenv("HVD_SCALE_POLICY", "warmup:baseline_steps=7")
    policy = make_policy(None)
    assert policy.name == "warmup" and policy.span == 7
    # An explicit spec wins over the environment.
    assert make_policy("linear").name == "linear"
    monkeypatch.setenv("HVD_SCALE_POLICY", "adascalee")
    with pytest.raises(ValueError, match="adascalee"):
        make_policy()
    monkeypatch.delenv("HVD_SCALE_POLICY")
    assert make_policy().name == "adascale"  # the default


def test_code_policy_against_the_flag(monkeypatch):
    """#32 item 2: a policy in the code and another from `hvd-scale run --policy` are refused,
    naming both; the same policy in both (or none in the code) runs."""
    monkeypatch.setenv("HVD_SCALE_POLICY", "linear")
    with pytest.raises(ValueError, match=r"code asks for policy 'adascale'.*HVD_SCALE_POLICY='linear'"
                                         r".*hvd-scale run --policy.*leave the policy to the flag"):
        resolve_policy("adascale", scale=4)
    with pytest.raises(ValueError, match="code asks for policy 'sqrt'"):
        resolve_policy(make_policy("sqrt"), scale=4)
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
    assert make_policy("warmup:baseline_steps=10").spec == "warmup:baseline_steps=10"


def test_metrics_are_floats():
    policy = make_policy("adascale")
    state, _ = policy.transition(policy.init(), [8.0], [1.25], 4, scale=4)
    metrics = policy.metrics(state, 4)
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["gain"] == policy.gain(state, 4) and metrics["progress"] == state.progress
    estimator = policy.estimator(state, 4)
    assert metrics["noise_scale"] == pytest.approx(estimator.sigma2 / estimator.mu2)


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
        make_policy(spec)


def test_bad_spec_type():
    with pytest.raises(ValueError, match="42"):
        make_policy(42)


@pytest.mark.parametrize("scale, pattern", [(0.5, r"0\.5"), (float("nan"), "nan"), ("x", "'x'")])
def test_bad_scale_for_policy(scale, pattern):
    # S is an argument of each step: a bad one is refused there, naming it.
    policy = make_policy("linear")
    with pytest.raises((ValueError, TypeError), match=pattern):
        policy.transition(policy.init(), scale=scale)


def trained(spec: str, scale: float = 4.0) -> tuple[hvd_scale.Policy, PolicyState]:
    policy = build(spec)
    state, _ = policy.transition(policy.init(), [8.0], [1.25], 4, scale=scale)
    state, _ = policy.transition(state, [10.0], [1.0], 4, scale=scale)
    return policy, state


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
    policy, state = trained(spec)
    before = copy.deepcopy(policy.state_dict(state, 4.0))
    factor, applied = policy.factor(state, 4.0), state.lr_factor
    with pytest.raises((ValueError, TypeError), match=pattern):
        policy.transition(state, s, q, n, scale=4.0)
    assert policy.state_dict(state, 4.0) == before
    assert policy.factor(state, 4.0) == factor and state.lr_factor == applied


@pytest.mark.parametrize("spec", ["adascale", "adascale_adam"])
def test_adascale_rejects_single_micro_gradient_above_scale_one(spec):
    policy, state = trained(spec)
    before = copy.deepcopy(policy.state_dict(state, 4.0))
    with pytest.raises(ValueError, match=r"n = 1"):
        policy.transition(state, [8.0], [8.0], 1, scale=4.0)
    assert policy.state_dict(state, 4.0) == before


def test_fixed_rule_with_one_micro_gradient_only_skips_the_estimate():
    # Documented: a fixed rule logs the gain when it can; n = 1 simply gives no estimate.
    policy, state = trained("linear")
    estimator_before = copy.deepcopy(policy.estimator(state, 4.0).state_dict())
    state, info = policy.transition(state, [8.0], [8.0], 1, scale=4.0)
    assert info.lr_factor == 4.0 and info.progress == 12.0
    assert policy.estimator(state, 4.0).state_dict() == estimator_before


# Loading checkpoints.

@pytest.mark.parametrize("spec, other", [
    ("adascale", "linear"), ("linear", "adascale"), ("adascale", "adascale:smoothing=0.5"),
    ("warmup:baseline_steps=3", "warmup:baseline_steps=4"), ("adascale_adam", "adascale"), ("sqrt", "none"),
])
def test_load_state_from_another_policy_raises(spec, other):
    policy, state = trained(spec)
    before = copy.deepcopy(policy.state_dict(state, 4.0))
    foreign, foreign_state = trained(other, scale=8.0)
    foreign_state, _ = foreign.transition(foreign_state, [8.0], [1.25], 4, scale=8.0)
    with pytest.raises(ValueError, match=f"'{other}'"):
        policy.load_state(foreign.state_dict(foreign_state, 8.0))
    assert policy.state_dict(state, 4.0) == before


def _mutated(d: dict, mutate) -> dict:
    d = copy.deepcopy(d)
    mutate(d)
    return d


# (mutation, message, refused by the policy's load_state: False where the check is the run's,
# hvd_scale.run.restored's, which knows this job's parameter groups)
STATE_MUTATIONS = [
    (lambda d: d.pop("progress"), r"missing keys \['progress'\]", True),
    (lambda d: d.pop("estimator"), r"missing keys \['estimator'\]", True),
    (lambda d: d.update(gain=2.0), r"unknown keys \['gain'\]", True),
    (lambda d: d["estimator"].pop("mu2_biased"), r"missing keys \['mu2_biased'\]", True),
    (lambda d: d["estimator"].update(tau=1.0), r"unknown keys \['tau'\]", True),
    (lambda d: d.update(version=99), r"version 99", True),
    (lambda d: d.update(policy="nonsense"), r"'nonsense'", True),
    (lambda d: d["estimator"].update(sigma2_biased=[1.0, 1.0], mu2_biased=[1.0, 1.0]),
     r"2 parameter group", False),
    # Bad values, found only after the estimator part was read: nothing may change either.
    (lambda d: d.update(steps="x"), r"'x'", True),
    (lambda d: d.update(progress="far"), r"'far'", True),
]


@pytest.mark.parametrize("spec", ["adascale", "linear", "warmup:baseline_steps=3"])
@pytest.mark.parametrize("mutate, pattern, by_policy", STATE_MUTATIONS)
def test_load_bad_state_raises_and_leaves_policy(spec, mutate, pattern, by_policy):
    policy, state = trained(spec)
    before = copy.deepcopy(policy.state_dict(state, 4.0))
    # A checkpoint of the same policy, further along, so that a partial load would show.
    donor, donor_state = trained(spec)
    for _ in range(3):
        donor_state, _ = donor.transition(donor_state, [20.0], [4.0], 4, scale=4.0)
    bad = _mutated(donor.state_dict(donor_state, 4.0), mutate)
    if by_policy:
        with pytest.raises(ValueError, match=pattern):
            policy.load_state(bad)
    # What a job does with a checkpoint (torch's load_state_dict of a version-5 policy dict):
    # read it as a run record, then take it in at this job's layout and groups.
    setup = Setup(policy=policy, groups=1)
    here = dataclasses.replace(runs.start(setup, scale=4, passes=1, workers=4, measure=True),
                               policy=state)
    with pytest.raises(ValueError, match=pattern):
        runs.restored(setup, here, RunState.from_dict(bad, setup), take_passes=False)
    assert policy.state_dict(here.policy, 4.0) == before
    assert policy.estimator(here.policy, 4.0).state_dict() == before["estimator"]


def test_load_keeps_this_jobs_scale():
    trained_policy, trained_state = trained("adascale", scale=8.0)
    saved = trained_policy.state_dict(trained_state, 8.0)
    policy = make_policy("adascale")
    state = policy.load_state(saved)
    # S is this job's (2), whatever S the checkpoint was saved at.
    assert policy.estimator(state, 2).scale == 2.0
    assert state.progress == saved["progress"]
    assert 1.0 <= policy.gain(state, 2) <= 2.0


# -- resolve_policy / agree_across_ranks (what both adapters build their policy with) ------------

def test_resolve_policy_rejects_unmeasurable_adascale():
    with pytest.raises(ValueError, match="needs at least 2 micro-gradients"):
        hvd_scale.spec.resolve_policy("adascale", scale=2, micro_gradients=1)
    # fixed rules need no variance, and S = 1 needs none either
    assert hvd_scale.spec.resolve_policy("linear", scale=2, micro_gradients=1).name == "linear"
    resolved = hvd_scale.spec.resolve_policy("adascale", scale=1, micro_gradients=1)
    assert resolved.gain(resolved.init(), 1) == 1.0


def test_resolve_policy_takes_a_given_policy_as_it_is():
    # A policy holds no S: resolve_policy returns it unchanged (it used to rescale it), and the
    # S the adapter runs at is the argument of each step.
    policy = hvd_scale.make_policy("linear")
    assert hvd_scale.spec.resolve_policy(policy, scale=8, optimizer="SGD") is policy
    assert policy.spec == "linear"
    assert policy.factor(policy.init(), 8) == 8


def _fake_allgather(specs, scales=None, budgets=None):
    """Simulate every rank's build: rank r builds specs[r] (at scales[r], budgets[r]); we play
    rank 0. S travels in the adapter's settings (agree_across_ranks' ``settings``)."""
    def builds():
        out = []
        for r, spec in enumerate(specs):
            try:
                p = hvd_scale.make_policy(spec, budget=budgets[r] if budgets else None)
                values = {"policy": p.spec, "budget": p.budget}
                if scales:
                    values["scale"] = float(scales[r])
                out.append((values, None))
            except ValueError as e:
                out.append((None, f"ValueError: {e}"))
        return out
    return lambda mine: builds()


def test_agree_across_ranks_accepts_the_same_spec():
    policy = hvd_scale.spec.agree_across_ranks(
        lambda: hvd_scale.make_policy("sqrt"), _fake_allgather(["sqrt", "sqrt"]))
    assert policy.name == "sqrt"


def test_agree_across_ranks_reports_differing_specs_on_every_rank():
    with pytest.raises(ValueError, match="different policies") as e:
        hvd_scale.spec.agree_across_ranks(lambda: hvd_scale.make_policy("sqrt"),
                                              _fake_allgather(["sqrt", "linear"]))
    assert "'sqrt'" in str(e.value) and "'linear'" in str(e.value)


def test_agree_across_ranks_reports_another_ranks_error():
    # rank 0 (us) built fine; rank 1's spec was bad: we raise too, naming rank 1.
    with pytest.raises(ValueError, match="rank 1: ValueError: unknown policy 'sqtr'"):
        hvd_scale.spec.agree_across_ranks(lambda: hvd_scale.make_policy("sqrt"),
                                              _fake_allgather(["sqrt", "sqtr"]))


@pytest.mark.parametrize("scales, budgets, named", [
    ([2, 4], None, "scale {0: 2.0, 1: 4.0}"),
    ([2, 2], [100, 200], "budget {0: 100.0, 1: 200.0}"),
])
def test_agree_across_ranks_reports_differing_scale_or_budget_per_rank(scales, budgets, named):
    """Issue #22, 1: a scale (or budget) that differs between ranks trained apart silently."""
    with pytest.raises(ValueError, match="different") as e:
        hvd_scale.spec.agree_across_ranks(
            lambda: hvd_scale.make_policy("sqrt", budget=budgets[0] if budgets else None),
            _fake_allgather(["sqrt", "sqrt"], scales, budgets),
            lambda built: {"scale": float(scales[0])})
    assert named in str(e.value)


def test_agree_across_ranks_compares_the_adapters_settings():
    gathered = [({"policy": "sqrt", "scale": 2.0, "budget": None, "backward_passes_per_step": k,
                  "lr": {"param_groups[0]": lr}}, None) for k, lr in ((1, 0.1), (2, 0.1))]
    with pytest.raises(ValueError, match=r"backward_passes_per_step \{0: 1, 1: 2\}") as e:
        hvd_scale.spec.agree_across_ranks(
            lambda: hvd_scale.make_policy("sqrt"), lambda mine: gathered,
            lambda built: {"scale": 2.0, "backward_passes_per_step": 1,
                           "lr": {"param_groups[0]": 0.1}})
    assert "lr {" not in str(e.value)  # the lrs agree: only what differs is named


def test_agree_across_ranks_single_process_raises_its_own_error():
    with pytest.raises(ValueError, match="unknown policy"):
        hvd_scale.spec.agree_across_ranks(lambda: hvd_scale.make_policy("sqtr"), None)


# ----------------------------------------------------------------------------------------------
# The practitioners' rules (the seed's answer): a hand-tuned factor, S^alpha, warm-up to any rule,
# LEGW.

def first_step(spec: str, scale: float):
    """The StepInfo of a fresh run's first step at S = ``scale`` (no statistics)."""
    return make_policy(spec).transition(PolicyState(), scale=scale)[1]


def test_practitioners_rules_by_hand():
    assert [first_step("fixed:factor=5", 8).lr_factor for _ in range(2)] == [5, 5]
    assert first_step("power:alpha=0.5", 16).lr_factor == 4.0
    assert first_step("power:alpha=1", 16).lr_factor == 16.0
    sqrt_warm = make_policy("warmup:rule=sqrt,baseline_steps=64")  # 4 steps at S = 16
    assert [i.lr_factor for i in run_steps(sqrt_warm, 16, 6)[1]] == [1.0, 1.75, 2.5, 3.25, 4.0, 4.0]
    fixed_warm = make_policy("warmup:rule=fixed,factor=5,baseline_steps=16")
    assert [i.lr_factor for i in run_steps(fixed_warm, 8, 3)[1]] == [1.0, 3.0, 5.0]
    # LEGW at S = 4 with a base warm-up of 2 baseline steps: sqrt(4) after 8 baseline steps.
    legw = make_policy("legw:steps=2")
    infos = run_steps(legw, 4, 3)[1]
    assert [i.lr_factor for i in infos] == [1.0, 2.0, 2.0] and infos[-1].progress == 12.0
    # Every fixed rule's step consumes S baseline batches.
    assert first_step("fixed:factor=5", 8).progress == 8.0


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
        make_policy(spec, budget=100)


def test_warmup_rule_linear_is_the_plain_warmup():
    assert make_policy("warmup:rule=linear,baseline_steps=3").spec == "warmup:baseline_steps=3"


def test_warmup_steps_in_optimizer_steps_is_refused_with_the_new_spelling():
    """#30 item 2: warmup:steps=N counted optimizer steps; read as baseline steps it would
    silently shorten a ramp S-fold, so the old option is refused, naming the conversion."""
    with pytest.raises(ValueError, match=r"'warmup:steps=500'.*baseline_steps=<steps x S>"):
        make_policy("warmup:steps=500")


def test_a_bad_spec_from_the_environment_names_the_variable(monkeypatch):
    """#32 item 6: a typo in $HVD_SCALE_POLICY did not name the variable as its source."""
    monkeypatch.setenv(hvd_scale.POLICY_ENV, "adascalle")
    with pytest.raises(ValueError, match=r"\$HVD_SCALE_POLICY='adascalle' .*unknown policy 'adascalle'"):
        make_policy()
    monkeypatch.setenv(hvd_scale.POLICY_ENV, "sqrt")
    assert make_policy().name == "sqrt"
    assert make_policy("linear").name == "linear"  # an explicit spec: the environment unread
