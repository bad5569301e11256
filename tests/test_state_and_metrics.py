"""Engine state as data (a dict and a flat vector), the one list of metric names, and the metrics
log (``hvd_scale.adapters.log``).

No torch, TensorFlow or Horovod: numpy, hypothesis and (for the log's TensorBoard files)
tensorboardX.
"""

from __future__ import annotations

import csv
import json
import math
import os
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hvd_scale import make_policy
from hvd_scale import run as runs
from hvd_scale.adapters.log import MetricsLogger
from hvd_scale.metrics import LOGS_METRICS, METRICS, POLICY_METRICS, STEP_METRICS, check_names
from hvd_scale.reduce import step_vector_size, unpack_step
from hvd_scale.state import PROGRESS_INDEX, PolicyState
from test_policies import ALL_SPECS, SETTINGS, stats

BUDGET = 1000.0


def build(spec: str):
    return make_policy(spec, budget=BUDGET)


def records_equal(policy, a: PolicyState, twin, b: PolicyState, scale: float) -> None:
    """Two records (each read through its own policy, built from one spec) at S: the same dict,
    the same latest factor (None in both before any step), gain and tau."""
    assert policy.state_dict(a, scale) == twin.state_dict(b, scale)
    assert a.lr_factor == b.lr_factor
    assert policy.gain(a, scale) == twin.gain(b, scale) and a.progress == b.progress


@pytest.mark.parametrize("spec", ALL_SPECS)
@SETTINGS
@given(scale=st.sampled_from([1.0, 2.0, 6.0, 64.0]), groups=st.integers(1, 3), data=st.data(),
       past=st.integers(0, 5))
def test_state_vector_round_trip_gives_identical_future(spec, scale, groups, data, past):
    policy = build(spec)
    state = policy.init()
    for _ in range(past):
        state, _ = policy.transition(state, *data.draw(stats(groups)), scale=scale)
    vector = state.to_vector(groups)
    assert vector.dtype == np.float64 and vector.shape == (PolicyState.vector_size(groups),)
    assert vector[PROGRESS_INDEX] == state.progress
    twin = build(spec)
    loaded = PolicyState.from_vector(vector.copy(), groups)
    records_equal(twin, loaded, policy, state, scale)
    for _ in range(3):
        s, q, n = data.draw(stats(groups))
        loaded, a = twin.transition(loaded, s, q, n, scale=scale)
        state, b = policy.transition(state, s, q, n, scale=scale)
        assert a == b
        records_equal(twin, loaded, policy, state, scale)


def test_state_vector_of_the_wrong_size_changes_nothing():
    policy = build("adascale")
    state, _ = policy.transition(policy.init(), [8.0], [1.25], 4, scale=4.0)
    before = policy.state_dict(state, 4.0)
    with pytest.raises(ValueError, match=r"1 parameter group.*got shape \(9,\)"):
        PolicyState.from_vector(np.zeros(9), 1)
    with pytest.raises(ValueError, match="2 parameter group"):
        state.to_vector(2)
    assert policy.state_dict(state, 4.0) == before


def test_version_1_checkpoint_still_loads():
    policy = build("adascale")
    state, _ = policy.transition(policy.init(), [8.0], [1.25], 4, scale=4.0)
    old = policy.state_dict(state, 4.0)
    old.pop("lr_factor")
    old["version"] = 1
    twin = build("adascale")
    loaded = twin.load_state(json.loads(json.dumps(old)))
    assert loaded.progress == state.progress and twin.gain(loaded, 4.0) == policy.gain(state, 4.0)
    # nothing recorded of the latest step's factor
    assert loaded.lr_factor is None and math.isnan(twin.metrics(loaded, 4.0)["lr_factor"])
    assert twin.transition(loaded, [8.0], [1.25], 4, scale=4.0)[1] == \
        policy.transition(state, [8.0], [1.25], 4, scale=4.0)[1]


def test_lr_factor_is_the_applied_one_everywhere():
    # warmup changes its factor every step: the applied one and the next one differ.
    policy, scale = make_policy("warmup:baseline_steps=20"), 5
    state = policy.init()
    assert state.lr_factor is None and math.isnan(policy.metrics(state, scale)["lr_factor"])
    assert policy.factor(state, scale) == 1.0
    state, info = policy.transition(state, scale=scale)
    assert state.lr_factor == info.lr_factor == 1.0 == policy.metrics(state, scale)["lr_factor"]
    assert policy.factor(state, scale) == 2.0  # what the next step will get
    state, info = policy.transition(state, scale=scale)
    assert policy.metrics(state, scale)["lr_factor"] == info.lr_factor == 2.0 == state.lr_factor


def test_every_metric_has_one_name_list():
    policy = make_policy("adascale")
    assert tuple(policy.metrics(policy.init(), 4)) == POLICY_METRICS
    assert set(STEP_METRICS) <= set(METRICS) and set(LOGS_METRICS) <= set(STEP_METRICS)
    check_names(STEP_METRICS)
    with pytest.raises(ValueError, match=r"unknown metric name\(s\) \['gian'\]"):
        check_names(["gain", "gian"])


def test_logger_refuses_an_unknown_key_and_writes_every_column(tmp_path):
    logger = MetricsLogger(tmp_path, rank=0, budget=None, progress_bar=False)
    with pytest.raises(ValueError, match="'typo'"):
        logger.log({"step": 1.0, "typo": 2.0})
    logger.log({"step": 1.0, "gain": 1.5, "lr_factor": 1.5, "lr": 0.15})
    logger.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == list(METRICS) and len(rows) == 1
    assert float(rows[0]["lr"]) == 0.15 and rows[0]["sigma2"] == "nan"
    assert any((tmp_path / "tb").iterdir())


def test_logger_on_other_ranks_checks_names_too(tmp_path):
    logger = MetricsLogger(tmp_path / "r1", rank=1)
    with pytest.raises(ValueError, match="'typo'"):
        logger.log({"typo": 1.0})
    assert not (tmp_path / "r1").exists()


def test_step_vector_layout_and_unscaling():
    groups = 2
    vector = np.array([8.0, 4.0, 4.0, 2.0, 1.0, 0.5])  # s_0, s_1, c, w, q_0, q_1
    assert vector.size == step_vector_size(groups)
    s, n, samples, q = unpack_step(vector, groups)
    assert s.tolist() == [8.0, 4.0] and n == 4 and samples == 2 and q.tolist() == [1.0, 0.5]
    s, n, samples, q = unpack_step(vector * np.array([4, 4, 1, 1, 4, 4]), groups, loss_scale=2.0)
    assert s.tolist() == [8.0, 4.0] and n == 4 and samples == 2 and q.tolist() == [1.0, 0.5]
    with pytest.raises(ValueError, match="6 values"):
        unpack_step(vector[:5], groups)


@pytest.mark.parametrize("spec", ["adascale", "linear", "warmup:baseline_steps=8"])
def test_a_step_at_its_own_scale_leaves_the_runs_scale(spec):
    # A run at S = 8 (one worker x 8 passes) takes a short step of 2 of its 8 micro-batches: the
    # step is the policy's at S = 2, and the run's S stays 8.
    setup = runs.Setup(policy=build(spec), short_steps=True)
    short = runs.start(setup, scale=8.0, passes=8, workers=1, measure=True)
    short, _, info = runs.host_step(setup, short, runs.StepInputs(
        [8.0, 2.0, 2.0, 1.25], True, [[0.1, math.nan, math.nan, math.nan, math.nan, 1.0]]))
    ref = build(spec)
    record, expected = ref.transition(ref.init(), [8.0], [1.25], 2, scale=2.0)
    assert info == expected
    assert short.scale == 8.0 and short.policy.progress == record.progress


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _log_steps(logger, steps):
    for step in steps:
        logger.log({"step": float(step), "progress": 2.0 * step, "gain": 1.5})


def test_a_resumed_run_appends_and_sets_replayed_rows_aside(tmp_path):
    first = MetricsLogger(tmp_path, progress_bar=False)
    _log_steps(first, range(1, 6))  # killed after step 5, its last checkpoint at step 3
    first.close()
    resumed = MetricsLogger(tmp_path, progress_bar=False)
    _log_steps(resumed, range(4, 8))
    resumed.close()
    assert [float(r["step"]) for r in _rows(tmp_path / "metrics.csv")] == [1, 2, 3, 4, 5, 6, 7]
    assert [float(r["step"]) for r in _rows(tmp_path / "metrics.replayed.csv")] == [4, 5]
    assert json.loads((tmp_path / "run.json").read_text())["resumed_at_step"] == 4


def test_a_fresh_run_into_a_used_directory_keeps_the_earlier_one(tmp_path):
    first = MetricsLogger(tmp_path, run_info={"policy": "linear"}, progress_bar=False)
    _log_steps(first, range(1, 4))
    first.close()
    second = MetricsLogger(tmp_path, run_info={"policy": "adascale"}, progress_bar=False)
    with pytest.warns(UserWarning, match=r"kept as metrics\.1\.csv"):
        _log_steps(second, range(1, 3))
    second.close()
    assert len(_rows(tmp_path / "metrics.1.csv")) == 3 and len(_rows(tmp_path / "metrics.csv")) == 2
    assert json.loads((tmp_path / "run.1.json").read_text())["policy"] == "linear"
    assert json.loads((tmp_path / "run.json").read_text())["policy"] == "adascale"


def test_the_rank_0_of_the_moment_writes_and_replays_are_not_duplicated(tmp_path):
    rank = {"a": 0, "b": 1}
    a = MetricsLogger(tmp_path, rank=lambda: rank["a"], progress_bar=False)
    b = MetricsLogger(tmp_path, rank=lambda: rank["b"], progress_bar=False)
    for step in (1, 2, 3):
        a.log({"step": float(step)})
        b.log({"step": float(step)})
    assert a.active and not b.active
    rank.update(a=1, b=0)  # a resize renumbered the workers; the job restored step 2's commit
    for step in (3, 4):
        a.log({"step": float(step)})
        b.log({"step": float(step)})
    assert b.active and not a.active
    b.close()
    assert [float(r["step"]) for r in _rows(tmp_path / "metrics.csv")] == [1, 2, 3, 4]
    assert [float(r["step"]) for r in _rows(tmp_path / "metrics.replayed.csv")] == [3]


# -- #30: the state record and its versions -------------------------------------------------------

# A version-4 checkpoint as daf194d's Policy.state_dict() wrote it (adascale at S = 4, 3 steps).
V4_ADASCALE = {"version": 4, "policy": "adascale", "steps": 3, "progress": 5.25, "skipped": 1,
               "lr_factor": 1.75, "estimator": {"version": 1, "scale": 4.0, "smoothing": None,
                                                "sigma2_biased": [0.9], "mu2_biased": [0.4],
                                                "bias_weight": 0.01, "updates": 3}}


def test_version_4_checkpoint_loads_at_another_scale_and_continues():
    """The layout did not change from version 4 to 5 (only what mu2's EMA holds): a version-4
    checkpoint loads as it is, at this job's S, and its vector form is the same floats."""
    policy, scale = make_policy("adascale"), 8
    state = policy.load_state(V4_ADASCALE)
    assert (state.steps, state.progress, state.skipped, state.lr_factor) == (3, 5.25, 1, 1.75)
    assert policy.estimator(state, scale).sigma2 == pytest.approx(90.0)
    assert policy.estimator(state, scale).mu2 == pytest.approx(40.0)
    np.testing.assert_array_equal(state.to_vector(1), [3, 5.25, 1, 1.75, 3, 0.01, 0.9, 0.4])
    saved = policy.state_dict(state, scale)
    assert saved["version"] == 5 and saved["estimator"]["scale"] == 8  # saved at this job's S
    state, info = policy.transition(state, [8.0], [1.25], 8, scale=scale)
    assert info.progress_before == 5.25 and info.step == 4


@pytest.mark.parametrize("spec, pattern", [
    ("warmup:steps=500", r"steps=.*optimizer steps.*500 optimizer steps at S = 4.*baseline_steps"),
    ("adascale_adam:horizon=previous", r"horizon=previous was removed.*'policy' entry"),
])
def test_version_4_checkpoints_of_removed_options_are_refused_saying_what_to_do(spec, pattern):
    """#30 items 2 and 6: a ramp in optimizer steps and horizon=previous are gone; their
    checkpoints are refused (nothing loaded), each naming what to run instead."""
    saved = {**V4_ADASCALE, "policy": spec}
    policy = make_policy("adascale_adam" if "adam" in spec else "warmup:baseline_steps=2000")
    state = policy.init()
    before = policy.state_dict(state, 4)
    with pytest.raises(ValueError, match=pattern):
        policy.load_state(saved)
    assert policy.state_dict(state, 4) == before


def test_efficiency_is_the_applied_gain_over_s():
    """#30 item 3: adascale_adam's efficiency used the uncapped gain (S = 64, capped gain 8:
    0.150 logged, not 0.125); advise and the plots read it."""
    import hvd_scale.policies as policies
    policy, scale = make_policy("adascale_adam"), 64
    state = policy.init()
    for _ in range(policies.AdaScaleAdam.MIN_ADAM_HISTORY + 5):
        # noise only: the measured gain is near S
        state, _ = policy.transition(state, [64.0], [1e-9], 64, scale=scale)
    assert policy.estimator(state, scale).gain > 9 and policy.gain(state, scale) == 8.0
    assert policy.metrics(state, scale)["gain"] == 8.0
    assert policy.metrics(state, scale)["efficiency"] == 8.0 / 64
    assert policy.efficiency(state, scale) == 8.0 / 64


def test_state_record_is_frozen_and_a_step_replaces_it():
    """The record is never changed in place: a step returns a new one (what a Keras host call or
    a broadcast holds stays what it was)."""
    import dataclasses
    policy = make_policy("adascale")
    before = policy.init()
    state, _ = policy.transition(before, [8.0], [1.25], 4, scale=4)
    assert before.steps == 0 and state.steps == 1 and state is not before
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.progress = 3.0
    # transition is pure: the same record and statistics give the same record, any number of times.
    again, info = policy.transition(before, [8.0], [1.25], 4, scale=4)
    np.testing.assert_array_equal(again.to_vector(1), state.to_vector(1))
    assert info.step == 1 and before.steps == 0
    # ... and the policy is a frozen configuration, holding no record to change.
    with pytest.raises(AttributeError, match="frozen configuration"):
        policy.budget = 10.0


def test_log_interval_keeps_a_long_run_small_and_its_last_step(tmp_path):
    """#32 item 7: every step up to 1,000, every 10th to 10,000, every 100th after (a 20,000-step
    job: 2,000 rows, not 20,000); metrics() is called only for rows written; the last step is
    written at close whatever the interval; --log-every N reaches the workers."""
    from hvd_scale.adapters import environment
    from hvd_scale.adapters.log import due
    from hvd_scale.launch.engines import worker_env

    assert sum(due(s) for s in range(1, 20_001)) == 1_000 + 900 + 100
    logger = MetricsLogger(tmp_path / "default", progress_bar=False, tensorboard=False)
    calls = []

    def metrics_at(step):
        def read():
            calls.append(step)
            return {"step": step, "progress": 2.0 * step}
        return read

    for step in range(1, 1_206):
        logger.step(step, metrics_at(step))
    logger.close()
    with open(tmp_path / "default" / "metrics.csv") as f:
        steps = [int(float(r["step"])) for r in csv.DictReader(f)]
    assert steps == list(range(1, 1_001)) + list(range(1_010, 1_201, 10)) + [1_205]
    assert calls == steps  # rows not written cost no metrics() call
    every = MetricsLogger(tmp_path / "seven", progress_bar=False, tensorboard=False, every=7)
    for step in range(1, 21):
        every.step(step, metrics_at(step))
    every.close()
    with open(tmp_path / "seven" / "metrics.csv") as f:
        assert [int(float(r["step"])) for r in csv.DictReader(f)] == [1, 7, 14, 20]
    with pytest.raises(ValueError, match="log every must be an integer >= 1.*got 0"):
        MetricsLogger(tmp_path / "x", every=0)
    env = worker_env(log_every=50, environ={}, gpu=False)
    assert env["HVD_SCALE_LOG_EVERY"] == "50" and "HVD_SCALE_SAMPLES" not in env
    assert worker_env(samples="passes", environ={}, gpu=False)["HVD_SCALE_SAMPLES"] == "passes"
    with pytest.raises(ValueError, match=r"samples must be one of .*got 'each'"):
        worker_env(samples="each", environ={}, gpu=False)
    with pytest.raises(ValueError, match="log_every must be an integer >= 1"):
        worker_env(log_every=-1, environ={}, gpu=False)
    os.environ["HVD_SCALE_LOG_EVERY"] = "x"
    try:
        with pytest.raises(ValueError, match=r"\$HVD_SCALE_LOG_EVERY='x'.*--log-every"):
            environment.log_every()
        os.environ["HVD_SCALE_LOG_EVERY"] = "25"
        assert environment.log_every() == 25
    finally:
        del os.environ["HVD_SCALE_LOG_EVERY"]


def test_a_row_waits_for_a_loss_known_after_its_step(tmp_path):
    """#48 item 5: log_loss is called after the step (torch's loop, Keras's batch logs): the
    step's row waits for set_loss, or is written without one at the next step or at close."""
    logger = MetricsLogger(tmp_path, progress_bar=False, tensorboard=False)
    logger.step(1, lambda: {"step": 1, "progress": 1.0})
    assert not (tmp_path / "metrics.csv").exists()  # waiting for its loss
    logger.set_loss(0.5)
    logger.step(2, lambda: {"step": 2, "progress": 2.0})
    logger.step(3, lambda: {"step": 3, "progress": 3.0})  # step 2's row goes without a loss
    logger.set_loss(0.25)
    logger.step(4, lambda: {"step": 4, "progress": 4.0})
    logger.close()  # step 4's row, without a loss
    rows = [(float(r["step"]), float(r["loss"])) for r in _rows(tmp_path / "metrics.csv")]
    assert rows[0] == (1, 0.5) and rows[2] == (3, 0.25)
    assert rows[1][0] == 2 and math.isnan(rows[1][1]) and rows[3][0] == 4 and math.isnan(rows[3][1])


def test_log_loss_at_a_wrong_point_is_warned_of_and_a_thinned_row_keeps_its_loss(tmp_path):
    """#48 item 5: before the process's first step, or twice for one step: a warning naming the
    step, and the row keeps the first loss; after a skipped step (no row): dropped, silently;
    a step whose row is not due keeps its loss for close (the run's last row)."""
    logger = MetricsLogger(tmp_path, progress_bar=False, tensorboard=False, every=2)
    with pytest.warns(UserWarning, match=r"before this process's first step\(\).*after step\(\)"):
        logger.set_loss(9.0, step=0, skipped=0)
    logger.step(1, lambda: {"step": 1})
    logger.set_loss(1.0, step=1, skipped=0)
    with pytest.warns(UserWarning, match=r"twice for step 1; the first loss is kept"):
        logger.set_loss(1.5, step=1, skipped=0)
    logger.set_loss(8.0, step=1, skipped=1)  # a skipped attempt after step 1: no row, no warning
    logger.step(2, lambda: {"step": 2})
    logger.set_loss(2.0, step=2, skipped=1)
    logger.step(3, lambda: {"step": 3})  # not due (every 2): its loss waits for close
    logger.set_loss(3.0, step=3, skipped=1)
    logger.close()
    rows = [(float(r["step"]), float(r["loss"])) for r in _rows(tmp_path / "metrics.csv")]
    assert rows == [(1, 1.0), (2, 2.0), (3, 3.0)]
    # AMP's first steps are often skipped: a loss then, before any step, is no mistake.
    quiet = MetricsLogger(tmp_path / "amp", progress_bar=False, tensorboard=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.set_loss(7.0, step=0, skipped=1)
    quiet.close()


# -- a short step and zero gradients, as the readouts, the log and the plot tell them ------------

def _toy(**kw):
    from test_protocol import ToyOptimizer

    return ToyOptimizer(np.zeros(3), **kw)


def _toy_step(opt, passes, seed):
    rng = np.random.default_rng(seed)
    for _ in range(passes):
        x = rng.normal(size=(8, 3))
        opt.backward(x, x @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=8))
    opt.step()


def test_a_short_steps_readouts_row_and_legend_say_one_thing(tmp_path):
    """A run at S = 4 (one worker x 4 passes) whose third step is short (3 passes, an epoch's
    leftover batch): its row holds its own S and gain, marked short_step; the readouts right
    after it say the same (opt.gain was the gain at S = 4 while the row said S = 3's); the run's
    S stays 4, the next full step reads at 4 again, and the plot's legend names S = 4 once and
    counts the short step (it read S=4->3->4 as if the run were elastic)."""
    from hvd_scale.launch.plot import read_run

    opt = _toy(passes=4, short_steps=True, log_dir=str(tmp_path / "run"))
    for seed in (1, 2):
        _toy_step(opt, 4, seed)
    assert not opt.short_step and opt.metrics()["short_step"] == 0.0
    _toy_step(opt, 3, 3)  # the short step
    row = opt.metrics()
    policy, state = opt.policy, opt.run_state.policy
    assert opt.scale == 4.0 and row["scale"] == 3.0 and row["short_step"] == 1.0
    assert opt.short_step
    assert opt.gain == row["gain"] == policy.gain(state, 3.0) != policy.gain(state, 4.0)
    assert opt.efficiency == row["efficiency"] == opt.gain / 3.0
    assert row["lr_factor"] == opt.lr_factor == state.lr_factor  # adascale's: the gain at 3
    assert opt.factor() == policy.factor(state, 4.0)  # the next, full, step's
    _toy_step(opt, 4, 4)
    assert not opt.short_step and opt.gain == policy.gain(opt.run_state.policy, 4.0)
    assert opt.metrics()["scale"] == 4.0
    opt.close()
    rows = _rows(tmp_path / "run" / "metrics.csv")
    assert [float(r["scale"]) for r in rows] == [4.0, 4.0, 3.0, 4.0]
    assert [float(r["short_step"]) for r in rows] == [0.0, 0.0, 1.0, 0.0]
    assert float(rows[2]["gain"]) == row["gain"]
    label, _ = read_run(tmp_path / "run")
    assert label == "run (adascale, S=4, 1 short step)"


def test_zero_gradients_are_said_once_in_the_console_and_run_json(tmp_path):
    """A loss that is exactly zero (PyTorch's DDP tutorial series: cross-entropy over
    Linear(20, 1)'s one output) gives zero gradients: the gain is 1 and tau counts steps. It
    is said once, as a warning on rank 0 and ``zero_gradients_at_step`` in run.json; a run
    with gradients says nothing."""
    x = np.random.default_rng(0).normal(size=(8, 3))
    w = np.array([1.0, -2.0, 0.5])
    opt = _toy(passes=2, log_dir=str(tmp_path / "zero"))
    opt.w = w.copy()
    with pytest.warns(UserWarning, match=r"gradients of step 1 \(tau 1\) are all zero") as said:
        for _ in range(3):
            for _ in range(2):
                opt.backward(x, x @ w)  # fits exactly: every micro-gradient is 0
            opt.step()
    assert len([w for w in said if "all zero" in str(w.message)]) == 1
    assert opt.gain == 1.0 and opt.progress == 3.0
    opt.close()
    info = json.loads((tmp_path / "zero" / "run.json").read_text())
    assert info["zero_gradients_at_step"] == 1
    # measured gradients: nothing said, nothing noted
    opt = _toy(passes=2, log_dir=str(tmp_path / "fine"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in (1, 2):
            _toy_step(opt, 2, seed)
        opt.close()
    assert "zero_gradients_at_step" not in json.loads((tmp_path / "fine" / "run.json").read_text())
