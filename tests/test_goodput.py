"""hvd_scale.goodput: the step-time model and the goodput argmax, on synthetic inputs with known
answers (issue #24)."""

import itertools
import math

import numpy as np
import pytest

from hvd_scale import goodput
from hvd_scale.estimate import gain_ratio


def test_fit_recovers_known_parameters():
    rng = np.random.default_rng(0)
    c0, c1, a, u = 0.004, 0.0005, 0.03, 0.002
    k = rng.integers(1, 9, 200)
    m = rng.choice([16, 32, 64], 200)
    compute = k * (c0 + c1 * m) * rng.normal(1, 0.01, 200)
    allreduce = a * rng.normal(1, 0.01, 200)
    update = np.full(200, u)
    model = goodput.fit_step_time(k, m, compute, allreduce, update, workers=2)
    assert model.per_sample == pytest.approx(c1, rel=0.05)
    assert model.pass_time(40) == pytest.approx(c0 + c1 * 40, rel=0.02)
    assert (model.allreduce, model.update) == (pytest.approx(a, rel=0.01), pytest.approx(u))
    assert model.step_time(8, 64) == pytest.approx(8 * (c0 + c1 * 64) + a + u, rel=0.02)
    assert model.error < 0.02  # the mean step time of every (k, m) seen


def test_one_micro_batch_size_costs_in_proportion_and_the_ring_extrapolates():
    model = goodput.fit_step_time([2, 4], [32, 32], [0.02, 0.04], [0.01, 0.01], [0.001, 0.001],
                                  workers=2)
    assert model.per_sample is None and model.pass_time() == pytest.approx(0.01)
    assert model.pass_time(64) == pytest.approx(0.02)
    assert model.error == pytest.approx(0.0, abs=1e-12)
    assert model.allreduce_time(1) == 0.0
    # 2 (W - 1) / W: 1 at W = 2, 1.5 at W = 4, 1.75 at W = 8.
    assert model.allreduce_time(4) == pytest.approx(0.015)
    assert model.allreduce_time(8) == pytest.approx(0.0175)
    with pytest.raises(ValueError, match="one-worker job"):
        goodput.fit_step_time([1], [32], [0.01], [0.0], [0.0], workers=1).allreduce_time(4)


@pytest.mark.parametrize("bad", [
    dict(passes=[]), dict(passes=[0]), dict(compute=[math.nan]), dict(update=[-1.0]),
    dict(micro_batch=[0.0]), dict(allreduce=[0.1, 0.2])])
def test_fit_refuses_bad_timings(bad):
    args = {"passes": [1], "micro_batch": [32.0], "compute": [0.01], "allreduce": [0.0],
            "update": [0.0], **bad}
    with pytest.raises(ValueError):
        goodput.fit_step_time(**args, workers=2)


def test_gain_at_is_the_estimators_and_caps():
    assert goodput.gain_at(3.0, 1.0, 8) == gain_ratio(3.0, 1.0, 8)
    assert goodput.gain_at(3.0, 1.0, 8, max_gain=2.0) == 2.0
    assert goodput.gain_at(math.nan, math.nan, 8) == 1.0
    assert goodput.gain_at(3.0, 1.0, 1) == 1.0
    with pytest.raises(ValueError, match=r"S >= 1.*S = 0.25"):  # #30 item 1: advise ranked it 3.1x
        goodput.gain_at(3.0, 1.0, 0.25)


@pytest.mark.parametrize("sigma2, mu2, allreduce, max_gain", [
    (100.0, 1.0, 0.05, math.inf),   # noisy gradients, slow network: a large batch pays
    (1.0, 10.0, 0.05, math.inf),    # little noise: little gain, small batches
    (10.0, 1.0, 0.001, math.inf),   # fast network
    (1000.0, 1.0, 0.05, 8.0),       # the gain cap stops the growth
    (5.0, 2.0, 0.0, math.inf),
])
def test_argmax_equals_brute_force(sigma2, mu2, allreduce, max_gain):
    model = goodput.StepTimeModel(compute=0.01, per_sample=None, micro_batch=32, allreduce=allreduce,
                                  update=0.002, workers=2)
    grid = goodput.candidates(model, sigma2, mu2, workers=[1, 2, 4, 8], passes=range(1, 17),
                              micro_batches=[16, 32, 64], base_batch=32, max_gain=max_gain)
    chosen = goodput.best(grid)
    brute = {}
    for w, k, m in itertools.product([1, 2, 4, 8], range(1, 17), [16, 32, 64]):
        s = w * k * m / 32
        if s < 1 or (s > 1 and w * k < 2):  # below the baseline batch, or no variance measurable
            assert not goodput.runnable(w, k, m, 32)
            continue
        r = 1.0 if s <= 1 else min((sigma2 + mu2) / (sigma2 / s + mu2), s, max_gain)
        a = 0.0 if w == 1 else allreduce * ((w - 1) / w) / 0.5
        brute[(w, k, m)] = r / (k * 0.01 * m / 32 + a + 0.002)
    top = max(brute.values())
    assert chosen.goodput == pytest.approx(top, rel=1e-12)
    assert brute[(chosen.workers, chosen.passes, chosen.micro_batch)] == pytest.approx(top, rel=1e-12)
    assert chosen.efficiency == pytest.approx(chosen.gain / chosen.scale)


def test_choose_passes_with_hysteresis():
    model = goodput.StepTimeModel(compute=0.01, per_sample=None, micro_batch=32, allreduce=0.05,
                                  update=0.0, workers=2)
    args = dict(max_passes=16, micro_batch=32, base_batch=32)
    # Noise dominates and the allreduce is 5 passes long: many passes per step pay.
    k = goodput.choose_passes(model, 1000.0, 1.0, current=1, **args)
    assert k > 4
    # Already near the best: stays (the best is within the hysteresis).
    grid = goodput.candidates(model, 1000.0, 1.0, workers=[2], passes=range(1, 17),
                              micro_batches=[32], base_batch=32)
    near = max((c for c in grid if c.passes != k and c.goodput > grid[k - 1].goodput / 1.05),
               key=lambda c: c.goodput, default=None)
    if near is not None:
        assert goodput.choose_passes(model, 1000.0, 1.0, current=near.passes, **args) == near.passes
    # No noise: one pass.
    assert goodput.choose_passes(model, 1e-9, 1.0, current=8, **args) == 1
    with pytest.raises(ValueError, match="current passes 0"):
        goodput.choose_passes(model, 1.0, 1.0, current=0, **args)


def test_choose_passes_never_below_min_passes_nor_unrunnable():
    """#30 item 1: with no noise one pass predicts the most goodput, but a job whose baseline
    batch is two micro-batches (one worker, k = 2, scale = 1) cannot take k = 1 (S = 0.5), nor a
    one-worker job k = 1 at S > 1 (one micro-gradient, no variance)."""
    model = goodput.StepTimeModel(compute=0.01, per_sample=None, micro_batch=1, allreduce=0.0,
                                  update=0.002, workers=1)
    free = dict(current=2, max_passes=4, micro_batch=1, base_batch=2)
    assert goodput.choose_passes(model, 1e-9, 1.0, min_passes=2, **free) == 2
    # Without the floor, k = 1 would be S = 0.5: not a candidate either way.
    assert goodput.choose_passes(model, 1e-9, 1.0, **free) == 2
    grid = goodput.candidates(model, 1e-9, 1.0, workers=[1], passes=range(1, 5), micro_batches=[1],
                              base_batch=0.5)  # S = 2k
    assert [c.passes for c in grid] == [2, 3, 4]  # k = 1: S = 2 from one micro-gradient


def test_a_once_a_step_statistics_read_is_not_charged_to_the_passes():
    """Issue 61: from two workers on the statistics read each worker's accumulated gradient once a
    step, inside the last pass. Fitted to k = 1 alone (o unidentified), that read was charged to
    every pass and k = 8 predicted (k - 1) s too slow; timed apart, it stays a step's cost."""
    c, s, a, u = 0.020, 0.004, 0.009, 0.003
    k1 = goodput.fit_step_time([1] * 50, [1.0] * 50, [c + s] * 50, [a] * 50, [u] * 50, workers=2,
                               statistics=[s] * 50)
    assert k1.statistics == pytest.approx(s) and k1.pass_time() == pytest.approx(c)
    assert k1.step_time(8) == pytest.approx(8 * c + s + a + u)
    # Untimed (nan), the read stays in the pass as before: k = 8 over-predicted by 7 s.
    blind = goodput.fit_step_time([1] * 50, [1.0] * 50, [c + s] * 50, [a] * 50, [u] * 50,
                                  workers=2, statistics=[math.nan] * 50)
    assert blind.step_time(8) == pytest.approx(8 * (c + s) + a + u)
    # With a pass timed alone (k = 8), o is the rest of the step beside the read.
    o = 0.002
    k8 = goodput.fit_step_time([8] * 20, [1.0] * 20, [o + 8 * c + s] * 20, [a] * 20, [u] * 20,
                               workers=2, per_pass=[c] * 20, statistics=[s] * 20)
    assert (k8.per_step, k8.statistics) == (pytest.approx(o), pytest.approx(s))
    assert k8.step_time(1) == pytest.approx(o + c + s + a + u)
    with pytest.raises(ValueError, match="statistics time per step"):
        goodput.fit_step_time([1, 1], [1.0, 1.0], [c, c], [a, a], [u, u], workers=2,
                              statistics=[s])


def test_step_clock_keeps_the_statistics_read_apart():
    """adapt="goodput"'s clock: the read stamped between reading() and read() before the wait
    is the model's s; one taken after the wait (a short step's, in synchronize) is not."""
    import time

    from hvd_scale.adapters.adapt import StepClock

    clock = StepClock()
    clock.ended()
    for _ in range(12):
        clock.reading()
        time.sleep(0.004)
        clock.read()
        time.sleep(0.002)
        clock.waiting()
        clock.reading()  # after the wait: the wait's, not the passes'
        clock.read()
        clock.waited()
        clock.lap(1, 2)
        clock.ended()
    model = clock.model(2)
    assert 0.004 <= model.statistics < 0.004 + 0.05
    assert model.step_time(8) - model.step_time(1) == pytest.approx(7 * model.pass_time())
    assert 0.002 <= model.pass_time() < 0.002 + 0.05  # the sleep after the read: the pass
