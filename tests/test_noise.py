"""The noise scale's confidence interval (hvd_scale.noise) on synthetic gradients of known sigma2
and mu2: nominal 95% intervals cover 92-97% of the time and the point estimate's bias is under
5% once the EMA's window is full, with per-worker samples at W = 2 and with per-pass samples;
per parameter group and for the sum over groups.

The engine's own path is run: each step's statistics (sum of squared norms, |g_bar|^2, n,
samples) go through ``hvd_scale.estimate.fold`` at the default theta = 0.999 ** S, and the noise
record follows with ``hvd_scale.noise.advance``. Replicates run side by side as the estimator's
"groups" (its arithmetic is per group), reshaped to (replicate, group) for the noise record.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hvd_scale import noise
from hvd_scale.estimate import EstimatorState, default_smoothing, fold
from hvd_scale.metrics import METRICS, check_names, group_metric, split_group_metric

REPLICATES = 2000
# Two parameter groups of different size, noise shape and noise scale (B = sigma2 / mu2 in
# baseline batches): group 0 low-rank noise, group 1 near-isotropic.
DIMS = (6, 10)
SIGMA2 = (4.0, 8.0)
MU2 = (1.0, 0.5)


def _group(dim, sigma2, mu2, decay, rng):
    eig = decay ** np.arange(dim)
    eig *= sigma2 / eig.sum()  # tr C = sigma2: one micro-batch is one baseline batch
    mean = rng.standard_normal(dim)
    mean *= math.sqrt(mu2) / np.linalg.norm(mean)
    return np.sqrt(eig), mean


def simulate(workers, passes, samples, steps, seed=0, replicates=REPLICATES):
    """(point, low, high) per replicate, each (replicates, groups + 1), after ``steps`` steps
    at W = workers, k = passes; samples "workers" (each worker's k-pass sum read once) or
    "passes" (every micro-gradient read)."""
    rng = np.random.default_rng(seed)
    shapes = [_group(d, s, m, decay, rng)
              for d, s, m, decay in zip(DIMS, SIGMA2, MU2, (0.5, 0.95))]
    n = workers * passes
    scale = float(n)
    theta = default_smoothing(scale)
    groups = len(DIMS)
    est, rec = EstimatorState(), noise.NoiseState()
    shaped = lambda e: EstimatorState(  # noqa: E731 (the estimator's groups as (replicate, group))
        None if e.sigma2_biased is None else e.sigma2_biased.reshape(replicates, groups),
        None if e.mu2_biased is None else e.mu2_biased.reshape(replicates, groups),
        e.bias_weight, e.updates)
    for _ in range(steps):
        sqsum = np.empty((replicates, groups))
        mean_sq = np.empty((replicates, groups))
        for j, (scales, mean) in enumerate(shapes):
            g = mean + scales * rng.standard_normal((replicates, workers, passes, len(mean)))
            if samples == "passes":
                sqsum[:, j] = (g ** 2).sum(axis=(1, 2, 3))
            else:  # each worker's sum G_w of its k passes, read once: |G_w|^2 / k
                sqsum[:, j] = (g.sum(axis=2) ** 2).sum(axis=(1, 2)) / passes
            mean_sq[:, j] = (g.mean(axis=(1, 2)) ** 2).sum(axis=1)
        before = est
        est = fold(est, sqsum.ravel(), mean_sq.ravel(), n, scale, theta,
                   samples=n if samples == "passes" else workers)
        rec = noise.advance(rec, shaped(before), shaped(est), theta)
    return noise.interval(shaped(est), rec)


def truth():
    return np.array([s / m for s, m in zip(SIGMA2, MU2)] + [sum(SIGMA2) / sum(MU2)])


# S = W k = 8, theta = 0.999^8: the EMA's bias weight is 1 - theta^800 = 0.998 (warmed up) and
# its window n_eff ~ 250 steps.
CASES = {"W=2 per-worker samples": (2, 4, "workers"),
         "per-pass samples": (2, 4, "passes")}


@pytest.fixture(scope="module", params=list(CASES))
def measured(request):
    workers, passes, samples = CASES[request.param]
    return request.param, simulate(workers, passes, samples, steps=800)


def test_coverage_and_bias(measured):
    name, (point, low, high) = measured
    b = truth()
    covered = ((low <= b) & (b <= high)).mean(axis=0)
    bias = point.mean(axis=0) / b - 1
    print(f"{name}: coverage {np.round(100 * covered, 1)} %, bias {np.round(100 * bias, 2)} % "
          "(group 0, group 1, sum)")
    assert np.all((0.92 <= covered) & (covered <= 0.97)), (name, covered)
    assert np.all(np.abs(bias) < 0.05), (name, bias)
    assert np.all(np.isfinite(high)) and np.all(low > 0)  # mu2 well apart from 0 here


def test_a_young_window_still_covers():
    """Ten steps in: V comes from a few steps, and Student's t at n_eff - 1 keeps the intervals
    near their level (the normal quantile covered 91-93% here)."""
    assert noise.t_quantile(10) == pytest.approx(2.228, abs=1e-3)
    assert noise.t_quantile(2) == pytest.approx(4.303, rel=0.01)
    for samples in ("workers", "passes"):
        _, low, high = simulate(2, 4, samples, steps=10, seed=5, replicates=1000)
        covered = ((low <= truth()) & (truth() <= high)).mean(axis=0)
        assert np.all(covered >= 0.925), (samples, covered)


def test_interval_narrows_with_the_window():
    """The interval is the window's: a younger EMA (fewer steps) gives wider intervals."""
    _, low_a, high_a = simulate(2, 4, "workers", steps=100, seed=1, replicates=100)
    _, low_b, high_b = simulate(2, 4, "workers", steps=800, seed=1, replicates=100)
    assert np.median(high_a - low_a, axis=0)[-1] > 1.5 * np.median(high_b - low_b, axis=0)[-1]


def test_fieller_open_above_where_mu2_is_not_apart_from_zero():
    low, high = noise.fieller(s=np.array([1.0, 1.0]), m=np.array([0.01, 1.0]),
                              v_ss=np.array([0.01, 0.01]), v_mm=np.array([0.01, 0.01]),
                              v_sm=np.array([0.0, 0.0]))
    assert math.isinf(high[0]) and low[0] >= 0
    assert 0 < low[1] < 1 < high[1] < math.inf
    # with no spread the interval is the point
    low, high = noise.fieller(np.array(2.0), np.array(1.0), 0.0, 0.0, 0.0)
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)


def test_record_forms_and_a_late_start():
    """Dict and vector forms round-trip; a record started after the estimator (a checkpoint of
    before) gives no interval until its window is full; nothing before two steps."""
    rng = np.random.default_rng(3)
    est, rec, late = EstimatorState(), noise.NoiseState(), noise.NoiseState()
    theta = 0.9
    for t in range(200):
        before = est
        g = 1.0 + rng.standard_normal((4, 3))  # 4 micro-gradients, 3 coordinates, one group
        est = fold(est, [(g ** 2).sum()], [(g.mean(axis=0) ** 2).sum()], 4, 4.0, theta)
        rec = noise.advance(rec, before, est, theta)
        if t >= 150:
            late = noise.advance(late, before, est, theta)
        if t == 0:
            assert noise.interval(est, rec) is None
        if t == 160:
            assert noise.interval(est, late) is None  # 11 steps at theta 0.9: u = 0.69
    assert noise.interval(est, late) is not None  # 50 steps: u = 0.995
    assert noise.NoiseState.from_dict(rec.to_dict()).to_dict() == rec.to_dict()
    back = noise.NoiseState.from_vector(rec.to_vector(1), 1)
    np.testing.assert_array_equal(back.products, rec.products)
    assert (back.bias_weight, back.weight_sq, back.updates) == \
        (rec.bias_weight, rec.weight_sq, rec.updates)
    assert noise.NoiseState.from_vector(noise.NoiseState().to_vector(2), 2).products is None


def test_metric_names_are_the_engines():
    assert {"noise_scale_low", "noise_scale_high"} <= set(METRICS)
    check_names([group_metric("noise_scale", 3), "noise_scale_high"])
    assert split_group_metric("noise_scale_low[12]") == ("noise_scale_low", 12)
    with pytest.raises(ValueError, match="unknown metric"):
        check_names(["sigma2[0]"])
    est = fold(EstimatorState(), [4.0, 2.0], [0.5, 0.3], 4, 4.0, 0.5)
    values = noise.metrics(est, noise.NoiseState())
    assert math.isnan(values["noise_scale_low"])
    assert values[group_metric("noise_scale", 0)] > 0  # the point needs no interval


def test_the_run_record_carries_it_through_steps_checkpoints_and_the_log(tmp_path):
    """host_step advances the noise record beside the estimator; both forms save it; a version
    7 record (before it) loads with a fresh one; the metrics log writes the sum's interval and,
    with two groups, each group's columns."""
    from hvd_scale import run as runs
    from hvd_scale.adapters.log import MetricsLogger, _read_rows
    from hvd_scale.spec import make_policy

    setup = runs.Setup(policy=make_policy("adascale:smoothing=0.9"), groups=2)
    run = runs.start(setup, scale=4, passes=2, workers=2, measure=True)
    rng = np.random.default_rng(0)
    logger = MetricsLogger(tmp_path, progress_bar=False, tensorboard=False)
    for t in range(60):
        gs = [1.0 + rng.standard_normal((4, 3)), 0.3 + rng.standard_normal((4, 5))]
        vector = [*((g ** 2).sum() for g in gs), 4.0, 4.0,
                  *((g.mean(axis=0) ** 2).sum() for g in gs)]
        run, _, _ = runs.host_step(setup, run, runs.StepInputs(
            vector, True, [[0.1, math.nan, math.nan, math.nan, math.nan, t + 1.0]] * 2))
        values = {**setup.policy.metrics(run.policy, run.scale),
                  **noise.metrics(run.policy.estimator, run.noise)}
        logger.log(values)
    logger.close()
    assert run.noise.updates == run.policy.estimator.updates == 60
    point, low, high = noise.interval(run.policy.estimator, run.noise)
    assert point[-1] == pytest.approx(values["noise_scale"])
    assert low[-1] == values["noise_scale_low"] < values["noise_scale"] < values["noise_scale_high"]
    same = lambda a, b: a.to_vector(setup).tolist() == b.to_vector(setup).tolist()  # noqa: E731
    assert same(runs.RunState.from_dict(run.to_dict(setup), setup), run)
    assert same(runs.RunState.from_vector(run.to_vector(setup), setup), run)
    # version 7: the dict without "noise", the vector without its record
    old = {**run.to_dict(setup), "version": 7}
    del old["noise"]
    assert runs.RunState.from_dict(old, setup).noise == noise.NoiseState()
    vector = run.to_vector(setup)[:-noise.NoiseState.vector_size(2)]
    vector[runs.VERSION_INDEX] = 7
    migrated = runs.RunState.from_vector(
        runs.migrate_vector(vector, setup, saved_by_this_policy=False), setup)
    assert migrated.noise == noise.NoiseState() and same(migrated, dataclasses.replace(
        run, noise=noise.NoiseState()))
    header, rows = _read_rows(tmp_path / "metrics.csv")
    assert header[-6:] == [group_metric(name, j) for j in (0, 1)
                           for name in ("noise_scale", "noise_scale_low", "noise_scale_high")]
    assert float(rows[-1]["noise_scale_low[1]"]) == pytest.approx(low[1])
    assert math.isnan(float(rows[0]["noise_scale_low"]))  # one step: no interval yet


def test_a_group_lost_in_its_noise_is_bounded_by_nothing():
    """mu2's estimate below 0 (a group whose gradient is lost in its noise): B = inf, [0, inf)."""
    est, rec = EstimatorState(), noise.NoiseState()
    rng = np.random.default_rng(7)
    for _ in range(50):
        g = np.stack([2.0 + rng.standard_normal((4, 3)), 0.01 + rng.standard_normal((4, 3))])
        before = est
        est = fold(est, (g ** 2).sum(axis=(1, 2)), (g.mean(axis=1) ** 2).sum(axis=1), 4, 4.0,
                   0.9)
        rec = noise.advance(rec, before, est, 0.9)
    est = dataclasses.replace(est, mu2_biased=est.mu2_biased * np.array([1.0, -1.0]))
    point, low, high = noise.interval(est, rec)
    assert math.isinf(point[1]) and low[1] == 0 and math.isinf(high[1])
    assert 0 < low[0] <= point[0] <= high[0] < math.inf
