"""The run as one value (issue #47): ``hvd_scale.run``'s record, its forms, and the pure functions
that every change of k or S goes through. Engine only (numpy): the adapters' paths are in
tests/test_transitions.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hvd_scale import run as runs
from hvd_scale.run import RunState, Setup, StepInputs
from hvd_scale.spec import make_policy

LR = 0.1
NAN = math.nan


def setup_for(spec: str, *, groups: int = 1, **kw) -> Setup:
    return Setup(policy=make_policy(spec), groups=groups, **kw)


def user(lr: float = LR, t: float = 1.0, groups: int = 1):
    return [[lr, NAN, NAN, NAN, NAN, t]] * groups


def stats(n: int, noise: float = 0.5, mean: float = 1.0) -> list[float]:
    """[s, c, w, q]: n micro-gradients, each read, with mean |g_i|^2 = mean + noise and
    |g_bar|^2 = mean."""
    return [n * (mean + noise), float(n), float(n), mean]


def test_the_host_step_is_the_policys_transition_bit_for_bit():
    """What was right stays: a run of host steps gives the records a policy's transitions give."""
    setup = setup_for("adascale")
    run = runs.start(setup, scale=4, passes=2, workers=2, measure=True)
    policy, record = make_policy("adascale"), run.policy
    for i in range(20):
        s = stats(4, noise=0.1 * (i % 5 + 1))
        run, plan, info = runs.host_step(setup, run, StepInputs(s, True, user()))
        record, expected = policy.transition(record, [s[0]], [s[3]], 4, scale=4)
        assert run.policy == record and info == expected
        assert plan[0, 0] == expected.lr_factor and plan[0, 1] == LR * expected.lr_factor
        assert run.last_lr == LR * expected.lr_factor and run.skips_in_a_row == 0


@pytest.mark.parametrize("spec", ["adascale", "adascale_adam", "linear"])
def test_both_forms_round_trip_the_whole_record(spec):
    setup = setup_for(spec)
    run = runs.start(setup, scale=6, passes=3, workers=2, measure=True)
    for _ in range(3):
        run, _, _ = runs.host_step(setup, run, StepInputs(stats(6), True, user(t=run.policy.steps + 1)))
    run = runs.skipped(run)
    assert RunState.from_dict(run.to_dict(setup), setup) == run
    again = RunState.from_vector(run.to_vector(setup), setup)
    assert again.to_vector(setup).tolist() == run.to_vector(setup).tolist()
    assert (again.passes, again.workers, again.scale, again.skips_in_a_row) == (3, 2, 6.0, 1)


def test_a_vector_of_another_version_is_refused_naming_both():
    """#47 item 6: Keras's vector had no version, and an old record loaded silently."""
    setup = setup_for("adascale_adam")
    vector = runs.start(setup, scale=2, passes=1, workers=2, measure=True).to_vector(setup)
    vector[runs.VERSION_INDEX] = 5
    with pytest.raises(ValueError, match=rf"holds a version 5 record, this hvd_scale reads "
                                         rf"version {runs.VERSION}"):
        RunState.from_vector(vector, setup)
    with pytest.raises(ValueError, match=rf"holds {RunState.vector_size(1)} values, got shape "
                                         r"\(13,\)"):
        RunState.from_vector(np.zeros(13), setup)  # before the run record: 6 + 2G, no version


def test_a_version_5_torch_checkpoint_migrates_with_its_policy_state():
    setup = setup_for("linear")
    policy = make_policy("linear")
    state, _ = policy.transition(policy.init(), scale=4)
    saved = RunState.from_dict(policy.state_dict(state, 4), setup)
    assert saved.policy == state and saved.scale == 4.0


def test_relayout_keeps_tau_and_the_estimates_and_refuses_what_cannot_run():
    setup = setup_for("adascale")
    run = runs.start(setup, scale=4, passes=2, workers=2, measure=True)
    run, _, _ = runs.host_step(setup, run, StepInputs(stats(4), True, user()))
    grown = runs.relayout(setup, run, passes=4)
    assert (grown.scale, grown.passes, grown.policy, grown.last_lr) == (8.0, 4, run.policy, run.last_lr)
    # #47 item 3, second half: k = 1 at one worker would leave n = 1 at S > 1.
    one = runs.start(setup_for("adascale"), scale=4, passes=2, workers=1, measure=True)
    with pytest.raises(ValueError, match=r"k went from 2 to 1 passes per step, which would take S "
                                         r"from 4 to 2: policy 'adascale' at S = 2 needs at least 2 "
                                         r"micro-gradients"):
        runs.relayout(setup, one, passes=1)
    # A fixed rule runs anywhere at S >= 1.
    linear = setup_for("linear")
    assert runs.relayout(linear, runs.start(linear, scale=4, passes=2, workers=1, measure=False),
                         passes=1).scale == 2.0


def test_a_change_of_k_that_needs_statistics_never_taken_is_refused():
    """#47 item 3: one process at S = 1 takes no statistics; set_passes(2) was accepted and the
    next step raised 'needs gradient statistics every step'."""
    setup = setup_for("adascale")
    run = runs.start(setup, scale=1, passes=1, workers=1, measure=False)
    with pytest.raises(ValueError, match=r"k went from 1 to 2 passes per step, which would take S "
                                         r"from 1 to 2: policy 'adascale' at S = 2 needs the "
                                         r"gradient statistics.*measure=True"):
        runs.relayout(setup, run, passes=2)


def test_an_unmeasured_short_step_counts_its_own_micro_gradients():
    """#47 item 4: a step of one pass at k = 2 counted S = 2 (the update was half the pass's
    gradient); the count it is given makes it a step at S = 1."""
    setup = setup_for("linear", short_steps=True)
    run = runs.start(setup, scale=2, passes=2, workers=1, measure=False)
    run, plan, info = runs.host_step(setup, run, StepInputs(None, True, user(), count=1))
    assert (info.lr_factor, run.policy.progress, plan[0, 1]) == (1.0, 1.0, LR)
    run, plan, info = runs.host_step(setup, run, StepInputs(None, True, user(t=2)))
    assert (info.lr_factor, run.policy.progress) == (2.0, 3.0)


def test_a_short_steps_own_s_is_in_the_record_until_the_next_step_or_change():
    """A short step's own S (u n) is the record's (``RunState.short_scale``), not a holder beside
    it (``Scaling._short`` was): the next full step, a skip, a relayout and a restore clear it,
    and no saved form carries it."""
    setup = setup_for("linear", short_steps=True)
    run = runs.start(setup, scale=4, passes=2, workers=2, measure=False)
    assert run.short_scale is None
    short, _, info = runs.host_step(setup, run, StepInputs(None, True, user(), count=3))
    assert short.short_scale == info.scale == 3.0 and short.scale == 4.0
    assert "short_scale" not in short.to_dict(setup)
    assert runs.RunState.from_dict(short.to_dict(setup), setup).short_scale is None
    assert runs.RunState.from_vector(short.to_vector(setup), setup).short_scale is None
    full, _, _ = runs.host_step(setup, short, StepInputs(None, True, user(t=2)))
    assert full.short_scale is None
    assert runs.skipped(short).short_scale is None
    assert runs.relayout(setup, short, workers=4).short_scale is None
    assert runs.restored(setup, short, short, take_passes=False).short_scale is None


def test_a_short_step_of_one_micro_gradient_takes_the_gain_from_the_estimates():
    """#47 item 5: a step of one pass at S > 1 raised 'n = 1 micro-gradients give no variance
    estimate'; its gain at its own S comes from the estimates so far."""
    setup = setup_for("adascale", short_steps=True)
    run = runs.start(setup, scale=4, passes=2, workers=1, measure=True)
    for i in range(10):
        run, _, _ = runs.host_step(setup, run, StepInputs(stats(2), True, user()))
    estimates = run.policy.estimator
    before = run.policy.progress
    run, plan, info = runs.host_step(setup, run, StepInputs([1.5, 1.0, 1.0, 1.5], True, user()))
    expected = make_policy("adascale").gain(run.policy, 2)
    assert run.policy.estimator == estimates  # nothing measured
    assert info.gain == pytest.approx(expected) and 1 < info.gain <= 2
    assert run.policy.progress == pytest.approx(before + info.gain)


def test_a_change_of_workers_in_a_step_follows_s_and_refuses_below_the_baseline():
    setup = setup_for("linear")
    run = runs.start(setup, scale=1, passes=1, workers=2, measure=False)
    with pytest.raises(ValueError, match=r"the job went from 2 to 1 worker\(s\), which would take "
                                         r"S from 1 to 0\.5.*at least 2 workers"):
        runs.host_step(setup, run, StepInputs(None, True, user(), workers=1))
    grown, _, info = runs.host_step(setup, run, StepInputs(None, True, user(), workers=4))
    assert (grown.scale, info.lr_factor) == (2.0, 2.0)


def test_restored_takes_the_record_at_this_jobs_layout():
    """A checkpoint or root's broadcast: the policy's record, skips and last lr are the saved
    ones; W and S per micro-batch this job's; k the saved one where k adapts (#47 item 2)."""
    setup = setup_for("adascale", max_passes=4)
    saved = runs.start(setup, scale=6, passes=3, workers=2, measure=True)
    saved, _, _ = runs.host_step(setup, saved, StepInputs(stats(6), True, user()))
    here = runs.start(setup, scale=2, passes=1, workers=2, measure=True)
    taken = runs.restored(setup, here, saved, take_passes=True)
    assert (taken.passes, taken.scale, taken.policy, taken.last_lr) == (3, 6.0, saved.policy,
                                                                      saved.last_lr)
    assert runs.restored(setup, here, saved, take_passes=False).passes == 1
    with pytest.raises(ValueError, match=r"saved at 3 passes per step.*max_passes=2"):
        runs.restored(dataclasses.replace(setup, max_passes=2), here, saved, take_passes=True)


def test_a_scale_that_is_not_a_finite_number_is_refused_before_anything_changes():
    """Policy.rescale refused S = nan at once; with S only in the run record, start and relayout
    must (else a record at S = nan could be saved before the next step failed)."""
    setup = setup_for("linear")
    run = runs.start(setup, scale=2, passes=1, workers=2, measure=False)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match=r"S must be a finite number >= 1"):
            runs.relayout(setup, run, scale=bad)
        with pytest.raises(ValueError, match=r"S must be a finite number >= 1"):
            runs.start(setup, scale=bad, passes=1, workers=1, measure=False)


def test_per_worker_statistics_are_the_estimator_with_w_samples():
    """#50: samples="workers" hands sum_w |G_w|^2 / k_w with n = sum_w k_w and w = W samples: the
    host step is the policy's transition with samples = W (not n - 1 degrees of freedom)."""
    setup = setup_for("adascale")
    run = runs.start(setup, scale=8, passes=4, workers=2, measure=True)
    policy, record = make_policy("adascale"), run.policy
    for i in range(5):
        s = [8 * (1.0 + 0.1 * (i + 1)), 8.0, 2.0, 1.0]
        run, _, info = runs.host_step(setup, run, StepInputs(s, True, user()))
        record, expected = policy.transition(record, [s[0]], [s[3]], 8, scale=8, samples=2)
        assert run.policy == record and info == expected
    # The same sums read as 8 samples would give another sigma2: w is what sets the estimator.
    as_passes, _ = policy.transition(policy.init(), [8 * 1.1], [1.0], 8, scale=8)
    as_workers, _ = policy.transition(policy.init(), [8 * 1.1], [1.0], 8, scale=8, samples=2)
    assert as_workers.estimator.sigma2_biased[0] == pytest.approx(
        as_passes.estimator.sigma2_biased[0] * 7)


def test_what_the_statistics_read_follows_the_layout():
    """#58 item 1: samples="auto" was resolved once, at set-up. What a step reads is derived from
    the request and the record's W (``runs.reads``): per worker from two workers on, per pass
    with one worker, switching at every change of W (elastic, a resume, a broadcast); an explicit
    "workers" reads per pass with one worker left (its passes are the samples), "passes" always."""
    auto = setup_for("adascale")
    run = runs.start(auto, scale=4, passes=2, workers=2, measure=True)
    assert runs.reads(auto, run) == "workers"
    shrunk = runs.relayout(auto, run, workers=1)
    assert runs.reads(auto, shrunk) == "passes"
    assert runs.reads(auto, runs.relayout(auto, shrunk, workers=3)) == "workers"
    assert runs.reads(auto, run, workers=1) == "passes"  # an adapter deciding before the step
    workers = setup_for("adascale", samples="workers")
    assert [runs.reads(workers, run, w) for w in (1, 2, 8)] == ["passes", "workers", "workers"]
    passes = setup_for("adascale", samples="passes")
    assert [runs.reads(passes, run, w) for w in (1, 2, 8)] == ["passes"] * 3
    with pytest.raises(ValueError, match=r"samples='each': must be one of"):
        setup_for("adascale", samples="each")


def test_a_job_that_shrinks_to_one_worker_keeps_measuring_from_its_passes():
    """#58 item 1: Horovod elastic, adascale, k = 2, 2 -> 1 workers: the steps at one worker were
    read once per worker (one sample), dropped as unmeasurable, and the gain stayed at its last
    value for the rest of the run. At one worker the passes are read (w = n = k): the estimates
    go on updating; a full step read as one sample where the policy measures is refused."""
    setup = setup_for("adascale")
    run = runs.start(setup, scale=4, passes=2, workers=2, measure=True)
    for i in range(4):  # two workers, read once each: w = 2
        run, _, _ = runs.host_step(setup, run, StepInputs([4 * (1.2 + 0.1 * i), 4.0, 2.0, 1.0],
                                                          True, user()))
    assert run.policy.estimator.updates == 4
    # The job shrinks: the adapter reads the step's two passes (w = 2 = n), as ``reads`` says.
    before = run
    run, _, info = runs.host_step(setup, run, StepInputs([2 * 1.5, 2.0, 2.0, 1.0], True, user(),
                                                         workers=1))
    assert (run.workers, run.scale, runs.reads(setup, run)) == (1, 2.0, "passes")
    assert run.policy.estimator.updates == 5 and run.policy.estimator != before.policy.estimator
    policy = make_policy("adascale")
    expected, _ = policy.transition(before.policy, [3.0], [1.0], 2, scale=2.0, samples=2)
    assert run.policy == expected
    # One sum read for the one worker left: one sample of two passes has no variance. It was
    # dropped and the gain frozen; now refused before anything counts.
    with pytest.raises(RuntimeError, match=r"statistics hold one sample \(2 micro-gradients from "
                                           r"1 worker\(s\) x 2 passes.*read 'passes'"):
        runs.host_step(setup, run, StepInputs([2 * 1.5, 2.0, 1.0, 1.0], True, user()))
    # A fixed rule that measures only for the metrics is not refused (nothing depends on it).
    linear = setup_for("linear")
    one = runs.start(linear, scale=2, passes=2, workers=1, measure=True)
    one, _, info = runs.host_step(linear, one, StepInputs([3.0, 2.0, 1.0, 1.0], True, user()))
    assert info.lr_factor == 2.0
    # Growing back to two workers: read per worker again (w = W = 2).
    run, _, _ = runs.host_step(setup, run, StepInputs([4 * 1.3, 4.0, 2.0, 1.0], True, user(),
                                                      workers=2))
    assert (run.scale, runs.reads(setup, run), run.policy.estimator.updates) == (4.0, "workers", 6)


@pytest.mark.parametrize("spec", ["linear", "adascale"])
def test_a_short_step_below_the_baseline_batch_is_refused_not_counted_as_one(spec):
    """#58 item 5: k = 4, scale=2 (u = 0.5 baseline batches per micro-batch): a 1-pass step was
    accounted as S = max(1, u n) = 1, tau + 1 for half a baseline batch and linear's factor 1
    where its rule gives 0.5. S = u n < 1 has no policy: refused before anything is applied or
    counted; u n >= 1 is accounted at its own S."""
    setup = setup_for(spec, short_steps=True)
    measure = spec == "adascale"
    run = runs.start(setup, scale=2, passes=4, workers=1, measure=measure)

    def inputs(n, **kw):
        statistics = [n * 1.5, float(n), float(n), 1.0] if measure else None
        return StepInputs(statistics, True, user(), count=None if measure else n, **kw)
    run, _, _ = runs.host_step(setup, run, inputs(4))
    with pytest.raises(ValueError, match=r"a short step of 1 backward pass\(es\) in all \(1 "
                                         r"workers x 4 announced\) at u = 0\.5 baseline batches.*"
                                         r"S = u n = 0\.5, below the baseline batch.*drop_last=True"
                                         r".*at least 2 backward passes"):
        runs.host_step(setup, run, inputs(1))
    tau = run.policy.progress
    two, _, info = runs.host_step(setup, run, inputs(2))  # one baseline batch: S = 1
    assert (info.scale, info.lr_factor, two.policy.progress) == (1.0, 1.0, tau + 1.0)
    three, _, info = runs.host_step(setup, run, inputs(3))  # S = 1.5, its own factor and tau
    assert info.scale == 1.5 and three.policy.progress == pytest.approx(tau + info.lr_factor)
    if spec == "linear":
        assert info.lr_factor == 1.5


# -- a skip that the adapter never sees: AMP's GradScaler ------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["horovod", "ddp"])
def test_a_grad_scaler_skip_is_counted_at_the_step_it_skipped(engine):
    """#58 item 7: a step the GradScaler skips (an overflow) never reaches opt.step(); it was
    counted at the next synchronizing pass, so a run ending on a skipped step never counted it.
    Counted right after scaler.step, once (not again at the next pass), tau untouched."""
    import subprocess
    import sys

    from hvdrun import WORKERS_DIR, free_port, worker_env, worker_results
    if engine == "horovod":
        pytest.importorskip("horovod.torch")
    proc = subprocess.run([sys.executable, str(WORKERS_DIR / "scaler_skip_worker.py"), "--engine",
                           engine, "--port", str(free_port())], capture_output=True, text=True,
                          timeout=150, env=worker_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = worker_results(proc.stdout)[0]["rows"]
    assert [(r["steps"], r["skipped"]) for r in rows] == [(1, 0), (1, 1), (2, 1)], rows
    assert rows[1]["progress"] == rows[0]["progress"] < rows[2]["progress"]
