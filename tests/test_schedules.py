"""Baseline lr schedules and lr_at (evaluated at floor(tau)) against hand-computed values.

Pure engine tests: no framework imports.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_scale import lr_at, schedules
from hvd_scale.schedules import Constant, Cosine, Exponential, StepDecay


def test_constant():
    s = Constant(0.1)
    assert [s(t) for t in (0, 1, 10**6)] == [0.1, 0.1, 0.1]
    assert Constant(3)(5) == 3


def test_step_decay_by_hand():
    s = StepDecay(1.0, milestones=[10, 20], gamma=0.1)
    assert s(0) == 1.0 and s(9) == 1.0
    assert s(10) == pytest.approx(0.1, rel=1e-15) and s(19) == pytest.approx(0.1, rel=1e-15)
    assert s(20) == pytest.approx(0.01, rel=1e-15) and s(10**6) == pytest.approx(0.01, rel=1e-15)
    assert s.milestones == (10, 20)  # normalised to a tuple of ints
    # gamma > 1 is allowed (a step up); a milestone at 0 applies from the start.
    assert StepDecay(0.5, milestones=[0, 3], gamma=2.0)(0) == 1.0
    assert StepDecay(0.5, milestones=[0, 3], gamma=2.0)(3) == 2.0
    # Repeated milestones apply twice (torch's MultiStepLR counts them).
    assert StepDecay(1.0, milestones=[5, 5], gamma=0.5)(5) == 0.25


def test_exponential_by_hand():
    s = Exponential(0.5, decay_rate=0.5, decay_steps=10)
    assert s(0) == 0.5
    assert s(10) == pytest.approx(0.25, rel=1e-15)
    assert s(20) == pytest.approx(0.125, rel=1e-15)
    assert s(5) == pytest.approx(0.5 * math.sqrt(0.5), rel=1e-15)
    assert Exponential(2.0, decay_rate=0.9)(3) == pytest.approx(2.0 * 0.729, rel=1e-15)


def test_cosine_by_hand():
    s = Cosine(1.0, total=100)
    assert s(0) == 1.0
    assert s(50) == pytest.approx(0.5, rel=1e-15)
    assert s(25) == pytest.approx(0.5 * (1 + math.sqrt(0.5)), rel=1e-15)
    assert s(100) == pytest.approx(0.0, abs=1e-15)
    assert s(250) == s(100)  # clamped after the total
    f = Cosine(1.0, total=100, final=0.1)
    assert f(0) == 1.0
    assert f(50) == pytest.approx(0.55, rel=1e-15)
    assert f(100) == pytest.approx(0.1, rel=1e-15) and f(1000) == pytest.approx(0.1, rel=1e-15)


def test_lr_at_floors_tau():
    s = StepDecay(1.0, milestones=[10], gamma=0.1)
    assert lr_at(s, 9.999) == 1.0
    assert lr_at(s, 10.0) == pytest.approx(0.1)
    assert lr_at(s, 10.7) == pytest.approx(0.1)
    e = Exponential(1.0, decay_rate=0.5)
    assert lr_at(e, 2.9) == 0.25 == e(2)
    assert lr_at(e, 0.0) == 1.0
    c = Cosine(1.0, total=4)
    assert lr_at(c, 2.5) == pytest.approx(0.5)


def test_lr_at_float_and_callable():
    assert lr_at(0.3, 123.4) == 0.3
    assert lr_at(2, 0.5) == 2.0 and isinstance(lr_at(2, 0.5), float)
    seen = []

    def sched(t):
        seen.append(t)
        return 0.01 * (t + 1)

    assert lr_at(sched, 7.99) == pytest.approx(0.08)
    assert seen == [7] and isinstance(seen[0], int)


@settings(max_examples=200, deadline=None)
@given(tau=st.floats(min_value=0.0, max_value=1e7))
def test_lr_at_equals_schedule_at_floor(tau):
    for s in (StepDecay(1.0, [3, 100, 5000]), Exponential(1.0, 0.99, 7.0), Cosine(1.0, 10**6, 0.01)):
        assert lr_at(s, tau) == s(math.floor(tau))


def test_schedules_are_frozen_and_show_hyperparameters():
    s = StepDecay(0.1, milestones=[30, 60])
    with pytest.raises(Exception):
        s.lr = 1.0
    assert "milestones=(30, 60)" in repr(s)
    assert schedules.Constant is Constant


# ----------------------------------------------------------------------------------------------
# Bad arguments: ValueError naming the value.

@pytest.mark.parametrize("make, pattern", [
    (lambda: Constant(0), r"\b0\b"),
    (lambda: Constant(-0.1), r"-0\.1"),
    (lambda: Constant(float("nan")), r"nan"),
    (lambda: Constant(float("inf")), r"inf"),
    (lambda: Constant("0.1"), r"'0\.1'"),
    (lambda: StepDecay(0, [1]), r"\b0\b"),
    (lambda: StepDecay(1.0, [20, 10]), r"\[20, 10\]"),
    (lambda: StepDecay(1.0, [-1, 10]), r"\[-1, 10\]"),
    (lambda: StepDecay(1.0, [10], gamma=0), r"gamma.*\b0\b"),
    (lambda: StepDecay(1.0, [10], gamma=-0.5), r"-0\.5"),
    (lambda: StepDecay(1.0, [10], gamma=float("nan")), r"nan"),
    (lambda: Exponential(1.0, decay_rate=0), r"\b0\b"),
    (lambda: Exponential(1.0, decay_rate=-2), r"-2"),
    (lambda: Exponential(1.0, decay_rate=0.5, decay_steps=0), r"\b0\b"),
    (lambda: Exponential(-1.0, decay_rate=0.5), r"-1\.0"),
    (lambda: Cosine(1.0, total=0), r"total.*\b0\b"),
    (lambda: Cosine(1.0, total=-5), r"-5"),
    (lambda: Cosine(1.0, total=10, final=2.0), r"2\.0"),
    (lambda: Cosine(1.0, total=10, final=-0.1), r"-0\.1"),
    (lambda: Cosine(1.0, total=10, final=float("nan")), r"nan"),
])
def test_bad_schedule_arguments(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


@pytest.mark.parametrize("bad, exc, pattern", [
    (0.0, ValueError, r"0\.0"), (-1.0, ValueError, r"-1\.0"), (float("nan"), ValueError, "nan"),
    ("fast", TypeError, r"str"), (None, TypeError, r"NoneType"),
])
def test_lr_at_bad_schedule(bad, exc, pattern):
    with pytest.raises(exc, match=pattern):
        lr_at(bad, 3.0)
