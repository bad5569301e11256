"""Adam's moment horizons in progress (hvd_scale/moments.py): the settings handed to torch's and
Keras's own Adam formulas produce the update of the rule written out by hand."""

import dataclasses
import math

import numpy as np
import pytest

from hvd_scale.moments import EPS_CORRECTED, EPS_RAW, adam_step, bias_correction, moment_progress
from hvd_scale.policies import AdaScaleAdam
from hvd_scale.spec import make_policy

B1, B2, EPS, LR = 0.9, 0.98, 1e-6, 0.01


def reference(grads, gains, eps_placement, *, lr=LR, wd=0.0, w0=1.0):
    """The rule by hand: betas^r, eps / sqrt(r), bias correction 1 - beta^tau, lr x sqrt(r),
    decoupled decay (1 - lr wd)^r per step."""
    m = v = 0.0
    w, tau = np.full_like(grads[0], w0), 0.0
    for g, r in zip(grads, gains):
        tau += r
        b1, b2 = B1 ** r, B2 ** r
        w = w * (1 - lr * wd) ** r
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        c1, c2 = 1 - B1 ** tau, 1 - B2 ** tau
        step_lr, eps = lr * math.sqrt(r), EPS / math.sqrt(r)
        if eps_placement == EPS_CORRECTED:  # torch: eps beside sqrt(v_hat)
            w = w - step_lr / c1 * m / (np.sqrt(v / c2) + eps)
        else:  # Keras: eps beside sqrt(v), the correction folded into the lr
            w = w - step_lr * math.sqrt(c2) / c1 * m / (np.sqrt(v) + eps)
    return w


def framework(grads, gains, eps_placement, *, lr=LR, wd=0.0, w0=1.0):
    """torch's or Keras's own Adam(W) step (its step count t in the bias correction), driven by
    the settings adam_step returns."""
    m = v = 0.0
    w, tau = np.full_like(grads[0], w0), 0.0
    for t, (g, r) in enumerate(zip(grads, gains), start=1):
        tau += r
        s = adam_step(lr=lr * math.sqrt(r), base_lr=lr, beta1=B1, beta2=B2, eps=EPS, gain=r,
                      progress=tau, framework_step=t, eps_placement=eps_placement,
                      weight_decay=wd)
        w = w * (1 - s.lr * s.weight_decay)
        m = s.beta1 * m + (1 - s.beta1) * g
        v = s.beta2 * v + (1 - s.beta2) * g * g
        f1, f2 = 1 - s.beta1 ** t, 1 - s.beta2 ** t
        if eps_placement == EPS_CORRECTED:
            w = w - s.lr / f1 * m / (np.sqrt(v) / math.sqrt(f2) + s.eps)
        else:
            w = w - s.lr * math.sqrt(f2) / f1 * m / (np.sqrt(v) + s.eps)
    return w


@pytest.mark.parametrize("placement", [EPS_CORRECTED, EPS_RAW])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_framework_formula_with_the_settings_equals_the_rule(placement, wd):
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=5) * 1e-3 for _ in range(30)]
    # Gain 1 first (adascale_adam's warm-in), then measured gains, then 1 again.
    gains = [1.0] * 5 + list(rng.uniform(1, 40, 20)) + [1.0] * 5
    ref = reference(grads, gains, placement, wd=wd)
    got = framework(grads, gains, placement, wd=wd)
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    # And it is not plain Adam with a larger lr (the test can fail).
    plain = framework(grads, [1.0] * 30, placement, wd=wd)
    assert not np.allclose(got, plain, rtol=1e-3)


def test_gain_one_returns_the_users_values_untouched():
    for t in (1, 2, 37):
        s = adam_step(lr=0.1 * 1.0, base_lr=0.1, beta1=B1, beta2=B2, eps=EPS, gain=1.0,
                      progress=float(t), framework_step=t, eps_placement=EPS_CORRECTED,
                      weight_decay=0.3)
        assert (s.lr, s.beta1, s.beta2, s.eps, s.weight_decay) == (0.1, B1, B2, EPS, 0.3)


def test_gain_one_after_larger_gains_still_corrects_the_bias():
    # tau = 12 after 4 steps: torch corrects with 1 - beta^5, the rule with 1 - beta^13.
    s = adam_step(lr=LR, base_lr=LR, beta1=B1, beta2=B2, eps=EPS, gain=1.0, progress=13.0,
                  framework_step=5, eps_placement=EPS_CORRECTED)
    assert (s.beta1, s.beta2) == (B1, B2)
    ratio = (math.sqrt(1 - B2 ** 13) / (1 - B1 ** 13)) / (math.sqrt(1 - B2 ** 5) / (1 - B1 ** 5))
    assert s.lr == pytest.approx(LR * ratio, rel=1e-15)
    assert s.eps == pytest.approx(EPS * math.sqrt((1 - B2 ** 13) / (1 - B2 ** 5)), rel=1e-15)


def test_decoupled_decay_per_unit_of_progress():
    s = adam_step(lr=LR * 3, base_lr=LR, beta1=B1, beta2=B2, eps=EPS, gain=9.0, progress=100.0,
                  framework_step=60, eps_placement=EPS_RAW, weight_decay=0.1)
    assert 1 - s.lr * s.weight_decay == pytest.approx((1 - LR * 0.1) ** 9, rel=1e-14)
    assert s.beta1 == B1 ** 9 and s.beta2 == B2 ** 9 and s.eps == EPS / 3


@pytest.mark.parametrize("kwargs, message", [
    ({"gain": 0.5}, "gain must be a finite number >= 1, got 0.5"),
    ({"gain": math.nan}, "gain must be a finite number >= 1, got nan"),
    ({"eps_placement": "inside"}, "eps_placement must be"),
    ({"weight_decay": 200.0}, "lr x weight_decay must be in [0, 1)"),
])
def test_bad_inputs_are_refused(kwargs, message):
    args = dict(lr=LR, base_lr=LR, beta1=B1, beta2=B2, eps=EPS, gain=2.0, progress=10.0,
                framework_step=5, eps_placement=EPS_CORRECTED)
    with pytest.raises(ValueError) as e:
        adam_step(**{**args, **kwargs})
    assert message in str(e.value)


def test_bias_correction_is_the_baselines_after_tau_steps():
    assert bias_correction(0.9, 3.0) == 1 - 0.9 ** 3


def test_updates_the_policy_did_not_account_count_as_baseline_steps():
    # Horovod's broadcast_optimizer_state: one zero-gradient step before the first real one.
    assert moment_progress(0.0, 0, 1) == 1.0
    assert moment_progress(37.5, 10, 11) == 38.5
    assert moment_progress(37.5, 10, 10) == 37.5
    assert moment_progress(37.5, 10, 4) == 37.5  # fewer: tau alone (never below it)


# -- the policy ------------------------------------------------------------------------------------

def test_policy_default_is_horizons_in_progress_and_steps_is_the_adaptdl_variant():
    default = make_policy("adascale_adam")
    assert default.moments_in_progress and default.spec == "adascale_adam"
    assert make_policy("adascale_adam:moments=progress").spec == "adascale_adam"
    adaptdl = make_policy("adascale_adam:moments=steps")
    assert not adaptdl.moments_in_progress and adaptdl.spec == "adascale_adam:moments=steps"
    assert not make_policy("adascale").moments_in_progress
    with pytest.raises(ValueError, match=r"option moments='epochs': expected one of \['progress', 'steps'\]"):
        make_policy("adascale_adam:moments=epochs")


def test_policy_refuses_optimizers_whose_horizons_it_cannot_set():
    with pytest.raises(ValueError, match="'NAdam'.*adascale_adam:moments=steps"):
        make_policy("adascale_adam", optimizer="NAdam")
    make_policy("adascale_adam:moments=steps", optimizer="NAdam")
    for name in ("Adam", "AdamW"):
        make_policy("adascale_adam", optimizer=name)


def test_second_moment_correction_counts_progress():
    p = make_policy("adascale_adam")
    state = p.init()
    assert p.second_moment_correction(state, 0.98, 0) == 0.0  # nothing in v yet
    assert p.second_moment_correction(state, 0.98, 1) == 1 - 0.98  # broadcast_state's zero step
    state = dataclasses.replace(state, progress=40.0, steps=10)
    assert p.second_moment_correction(state, 0.98, 10) == 1 - 0.98 ** 40.0
    assert p.second_moment_correction(state, 0.98, 11) == 1 - 0.98 ** 41.0
    q = make_policy("adascale_adam:moments=steps")
    state = dataclasses.replace(q.init(), progress=40.0)
    assert q.second_moment_correction(state, 0.98, 10) == 1 - 0.98 ** 10


def test_checkpoint_of_the_older_default_resumes_only_as_moments_steps():
    """A version-2 adascale_adam checkpoint was saved by today's moments=steps behaviour: it
    resumes there, and the new default refuses it instead of changing the run silently."""
    old = make_policy("adascale_adam:moments=steps")
    state = {**old.state_dict(old.init(), 4), "version": 2, "policy": "adascale_adam"}
    make_policy("adascale_adam:moments=steps").load_state(state)
    with pytest.raises(ValueError, match="adascale_adam:moments=steps"):
        make_policy("adascale_adam").load_state(state)
    state = {**state, "policy": "adascale_adam:smoothing=0.9"}
    make_policy("adascale_adam:smoothing=0.9,moments=steps").load_state(state)
    # Today's checkpoints round-trip.
    new = make_policy("adascale_adam")
    make_policy("adascale_adam").load_state(new.state_dict(new.init(), 4))
    assert AdaScaleAdam.MIN_ADAM_HISTORY == 20


def _noisy_steps(policy, scale, steps=60):
    """Statistics of pure noise (mu2 ~ 0): the measured gain goes to S. The record after them."""
    state = policy.init()
    for _ in range(steps):
        n = int(scale)
        state, _ = policy.transition(state, [float(n)], [1e-12], n, scale=scale)
    return state


def test_the_gain_a_step_applies_is_capped_at_8_with_horizons_in_progress():
    """Issue #21: at S = 128 B4's gain reached the 50s, where beta^r leaves Adam no averaging
    (BLEU 94.1 against 99.4); capped at 8 it held (99.9, seed 0). The cap is adascale_adam's
    default with the horizons in progress; moments=steps (AdaptDL's) and max_gain=inf have none."""
    capped = make_policy("adascale_adam")
    state = _noisy_steps(capped, 128)
    assert capped.estimator(state, 128).gain > 100 and capped.gain(state, 128) == 8.0
    state, info = capped.transition(state, [128.0], [1e-12], 128, scale=128)
    assert (info.gain, info.lr_factor, info.progress - info.progress_before) == (8.0, math.sqrt(8.0), 8.0)
    assert capped.metrics(state, 128)["gain"] == 8.0  # the log shows the r applied
    for spec in ("adascale_adam:max_gain=inf", "adascale_adam:moments=steps"):
        policy = make_policy(spec)
        assert policy.gain(_noisy_steps(policy, 128), 128) > 100
    twenty = make_policy("adascale_adam:max_gain=20")
    assert twenty.gain(_noisy_steps(twenty, 128), 128) == 20.0
    assert make_policy("adascale_adam:max_gain=8").spec == "adascale_adam"
    with pytest.raises(ValueError, match=r"max_gain='0.5': expected a number >= 1"):
        make_policy("adascale_adam:max_gain=0.5")


def test_checkpoint_saved_before_the_cap_resumes_only_uncapped():
    """A version-3 adascale_adam checkpoint was saved without the cap: it resumes as
    max_gain=inf, and the capped default refuses it instead of changing the run silently."""
    default = make_policy("adascale_adam")
    state = {**default.state_dict(default.init(), 4), "version": 3}
    make_policy("adascale_adam:max_gain=inf").load_state(state)
    with pytest.raises(ValueError, match="adascale_adam:max_gain=inf"):
        make_policy("adascale_adam").load_state(state)
    adaptdl = make_policy("adascale_adam:moments=steps")
    steps = {**adaptdl.state_dict(adaptdl.init(), 4), "version": 3}
    make_policy("adascale_adam:moments=steps").load_state(steps)


def test_adapter_settings_give_the_rule_by_hand_and_the_correction_between_steps():
    """The framework formula with the settings the adapters compute (``Scaling.adam_step``)
    equals the rule by hand over a run whose gain varies, and the second moment's correction
    between steps uses the same exponents (tau)."""
    from test_protocol import scaling_of

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    rng = np.random.default_rng(1)
    grads = [rng.normal(size=5) * 1e-3 for _ in range(40)]
    results = {}
    for spec in ("adascale_adam",):
        scaling = scaling_of(OneRank(), policy=spec, passes=8, scale=8, budget=None,
                             optimizer_name="Adam", framework="numpy", groups=1, measure=True)
        gains = []
        m = v = 0.0
        w = np.ones(5)
        for t, g in enumerate(grads, start=1):
            # Noise-only statistics: the gain climbs from 1 towards S once measured (step 21 on).
            before = scaling.run.policy.progress
            (_, lr, beta1, beta2, eps, _), = scaling.plan(
                [8.0 * (1 + 0.1 * t), 8.0, 8.0, 1.0], True, [[LR, B1, B2, EPS, math.nan, float(t)]])
            record = scaling.run.policy
            gains.append(record.progress - before)  # tau advances by the step's gain
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            f1, f2 = 1 - beta1 ** t, 1 - beta2 ** t
            w = w - lr / f1 * m / (np.sqrt(v) / math.sqrt(f2) + eps)
            assert scaling.policy.second_moment_correction(record, B2, t) == \
                pytest.approx(1 - B2 ** record.progress)
        results[spec] = w
        assert len(set(gains[21:])) > 5 and max(gains) > 2  # the gains vary: the test can fail
    np.testing.assert_allclose(results["adascale_adam"], reference(grads, gains, EPS_CORRECTED),
                               rtol=1e-12)


def test_lr_power_sets_the_lr_factor_and_defaults_to_sqrt():
    policy = make_policy("adascale_adam:lr_power=0.75,max_gain=inf")
    _, info = policy.transition(_noisy_steps(policy, 16), [16.0], [1e-12], 16, scale=16)
    assert info.gain > 4 and info.lr_factor == pytest.approx(info.gain ** 0.75)
    assert info.progress - info.progress_before == pytest.approx(info.gain, rel=1e-12)  # tau += r
    default = make_policy("adascale_adam:lr_power=0.5")
    assert default.spec == "adascale_adam"  # the defaults spell one behaviour
    _, info = default.transition(_noisy_steps(default, 16), [16.0], [1e-12], 16, scale=16)
    assert info.lr_factor == math.sqrt(8.0)
    with pytest.raises(ValueError, match=r"lr_power='2': expected a number in \[0, 1\]"):
        make_policy("adascale_adam:lr_power=2")
    # #30 item 6: horizon=previous re-derived the previous gain at the current S; removed.
    with pytest.raises(ValueError, match=r"horizon= was removed.*equal to the default"):
        make_policy("adascale_adam:horizon=previous")


def test_capped_drift_keeps_the_drift_per_unit_of_tau():
    """#30 item 8: a capped step credits tau += R while v has shrunk by the measured r, so with
    lr x sqrt(R) Adam drifts sqrt(r / R) times the baseline's per unit of tau; capped=drift
    applies lr x R / sqrt(r) instead. Below the cap both are sqrt(r)."""
    drift, plain = make_policy("adascale_adam:capped=drift"), make_policy("adascale_adam")
    drifted, kept = _noisy_steps(drift, 64), _noisy_steps(plain, 64)
    assert drift.spec == "adascale_adam:capped=drift" and plain.spec == "adascale_adam"
    measured = drift.estimator(drifted, 64).gain
    assert measured > 8 and drift.gain(drifted, 64) == plain.gain(kept, 64) == 8.0
    assert kept.lr_factor == pytest.approx(math.sqrt(8.0))
    assert drifted.lr_factor == pytest.approx(8.0 / math.sqrt(measured), rel=1e-12)
    assert drifted.progress == kept.progress  # tau is credited the same R
    # Below the cap: the same sqrt(r).
    low = make_policy("adascale_adam:capped=drift,max_gain=inf")
    ref = make_policy("adascale_adam:max_gain=inf")
    assert _noisy_steps(low, 4).lr_factor == _noisy_steps(ref, 4).lr_factor
    with pytest.raises(ValueError, match=r"capped='x': expected one of \['sqrt', 'drift'\]"):
        make_policy("adascale_adam:capped=x")
