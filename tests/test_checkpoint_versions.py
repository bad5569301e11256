"""A checkpoint saved before the run record (version 5: ``{"inner", "hvd_scale": the policy's
dict, "passes"}``) loads through the torch adapter's public ``load_state_dict`` and the run goes
on as if it had never stopped (issue #47: checkpoints carry the whole record; the engine's
migration alone is tests/test_run.py's); so does a version-6 record (the dict of today's); and
``broadcast_state`` given the optimizer before the wrap says so. One process, the optimizer in
this one. Version 7's vector (Keras's variable) names its policy: the engine's forms here, Keras's
save and load in tests/test_keras_adapter.py (the checkpoint case)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from hvdrun import requires_horovod

pytestmark = [requires_horovod]

LR = 0.1
XS = [[0.3, -1.2, 0.5], [1.1, 0.4, -0.7], [-0.2, 0.9, 1.3], [0.8, -0.5, 0.1], [0.6, 0.2, -1.0],
      [-1.4, 0.3, 0.7], [0.5, 1.5, -0.3], [0.9, -0.8, 0.4], [-0.6, 0.1, 1.2], [1.0, 1.0, -1.1]]


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1, bias=False).double()


def _opt(model, spec, k, **kw):
    import horovod.torch as hvd
    import torch

    from hvd_scale.adapters.torch import DistributedOptimizer
    hvd.init()
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                named_parameters=model.named_parameters(), policy=spec,
                                backward_passes_per_step=k, measure=True, **kw)


def _step(model, opt, xs):
    import torch
    opt.zero_grad()
    for x in xs:
        # A loss whose gradient differs between micro-batches: the variance is measurable.
        (model(torch.tensor([x], dtype=torch.float64)) - 1.0).pow(2).sum().backward()
    opt.step()


def _as_version_5(state_dict: dict) -> dict:
    """What a version-5 DistributedOptimizer.state_dict() held: the policy's own dict (its
    version 5, unchanged since) and k beside it; no skips in a row, no last lr, no layout."""
    state_dict = copy.deepcopy(state_dict)  # as from a file: no tensor shared with the optimizer
    record = state_dict["hvd_scale"]
    assert record["policy"]["version"] == 5
    return {"inner": state_dict["inner"], "hvd_scale": record["policy"],
            "passes": record["passes"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ["adascale", "warmup:baseline_steps=6", "linear"])
def test_a_version_5_torch_checkpoint_resumes_as_if_never_stopped(spec):
    import torch
    k = 2
    model = _model()
    opt = _opt(model, spec, k)
    for i in range(3):
        _step(model, opt, XS[2 * i:2 * i + 2])
    saved_model = copy.deepcopy(model.state_dict())
    saved = _as_version_5(opt.state_dict())

    resumed_model = _model()
    resumed_model.load_state_dict(saved_model)
    resumed = _opt(resumed_model, spec, k)
    resumed.load_state_dict(saved)
    assert (resumed.steps, resumed.progress, resumed.scale) == (opt.steps, opt.progress, opt.scale)
    assert resumed.run_state.policy == opt.run_state.policy  # tau, the estimates, the counts
    assert resumed.gain == opt.gain
    for i in range(3, 5):
        xs = XS[2 * i:2 * i + 2]
        _step(model, opt, xs)
        _step(resumed_model, resumed, xs)
        assert resumed.lr_factor == opt.lr_factor and resumed.progress == opt.progress
        assert torch.equal(resumed_model.weight, model.weight)
    assert resumed.steps == 5


@pytest.mark.timeout(120)
def test_a_version_5_checkpoint_takes_its_adapted_k_and_refuses_another_policy():
    model = _model()
    opt = _opt(model, "adascale", 2, adapt="goodput", max_passes=4)
    _step(model, opt, XS[:2])
    saved = _as_version_5(opt.state_dict())
    saved["passes"] = 4  # k had adapted to 4 before the save

    resumed = _opt(_model(), "adascale", 2, adapt="goodput", max_passes=4)
    resumed.load_state_dict(saved)
    assert (resumed.run_state.passes, resumed.scale) == (4, 4.0)
    assert resumed.progress == opt.progress

    other = _opt(_model(), "linear", 2)
    before = other.run_state
    with pytest.raises(ValueError, match=r"'adascale'.*'linear'|'linear'.*'adascale'"):
        other.load_state_dict(saved)
    assert other.run_state == before  # nothing changed


@pytest.mark.timeout(60)
def test_broadcast_state_before_the_wrap_names_the_fix():
    """Horovod's scripts broadcast before wrapping the optimizer; moved as is, the call got the
    plain torch optimizer and failed with "'SGD' object has no attribute '_hvd_opt'"."""
    import horovod.torch as hvd
    import torch

    from hvd_scale.adapters.torch import broadcast_state
    hvd.init()
    model = _model()
    with pytest.raises(TypeError, match=r"takes the hvd_scale DistributedOptimizer, got SGD: "
                                        r"call it after wrapping"):
        broadcast_state(model, torch.optim.SGD(model.parameters(), lr=LR))


@pytest.mark.timeout(120)
def test_a_version_6_torch_checkpoint_resumes_as_it_is():
    """Version 7 changed the vector only, version 8 added the noise record: a version-6 dict
    (with or without it) is today's."""
    model = _model()
    opt = _opt(model, "adascale", 2)
    _step(model, opt, XS[:2])
    saved = copy.deepcopy(opt.state_dict())
    assert saved["hvd_scale"]["version"] == 8
    saved["hvd_scale"]["version"] = 6
    resumed = _opt(_model(), "adascale", 2)
    resumed.load_state_dict(saved)
    assert resumed.run_state == opt.run_state


def _run_of(spec):
    from hvd_scale import run as runs
    from hvd_scale.estimate import EstimatorState
    from hvd_scale.spec import make_policy
    from hvd_scale.state import PolicyState
    setup = runs.Setup(policy=make_policy(spec))
    run = runs.start(setup, scale=4, passes=2, workers=2, measure=True)
    # A record with estimates (what the wrong policy would read): sigma2 11.34 as in the issue.
    estimates = EstimatorState(np.array([11.34]), np.array([0.8]), 0.9, 3)
    return setup, dataclasses.replace(run, policy=PolicyState(3, 7.5, 0, 1.6, estimates),
                                      last_lr=0.16)


def test_a_keras_vector_names_its_policy_and_another_policy_is_refused():
    """Issue 58 item 2: the vector had a version and no policy; adascale's record read by
    adascale_adam fed its plain sigma2 into the preconditioned estimates. torch's dict was
    refused ("checkpoint was saved by policy ..."); the vector now is, alike."""
    from hvd_scale import run as runs
    from hvd_scale.run import RunState
    from hvd_scale.spec import make_policy
    setup, run = _run_of("adascale")
    vector = run.to_vector(setup)
    assert vector[runs.VERSION_INDEX] == runs.VERSION == 8
    assert RunState.from_vector(vector, setup) == run
    adam = runs.Setup(policy=make_policy("adascale_adam"))
    with pytest.raises(ValueError, match=r"checkpoint was saved by policy 'adascale', this job "
                                         r"runs 'adascale_adam'; build the policy from the same"):
        RunState.from_vector(vector, adam)
    smoother = runs.Setup(policy=make_policy("adascale:smoothing=0.9"))
    with pytest.raises(ValueError, match=r"saved by policy 'adascale', this job runs "
                                         r"'adascale:smoothing=0.9'"):
        RunState.from_vector(vector, smoother)
    with pytest.raises(ValueError, match=r"saved by another policy, or one with other options "
                                         r"\(code \d+\), this job runs 'adascale'"):
        RunState.from_vector(run.to_vector(smoother), setup)
    # One code for the specs that same_spec takes for one policy (a default spelled out, the
    # options in another order, a number written otherwise): such a record resumes.
    for a, b in (("adascale_adam", "adascale_adam:moments=progress"),
                 ("adascale_adam:lr_power=0.75,max_gain=4", "adascale_adam:max_gain=4.0,lr_power=0.75"),
                 ("adascale:smoothing=0.9", "adascale:smoothing=9e-1")):
        pa, pb = make_policy(a), make_policy(b)
        assert pa.same_spec(pb.spec) and runs.policy_code(pa) == runs.policy_code(pb), (a, b)
    codes = {runs.policy_code(make_policy(spec)) for spec in
             ("adascale", "adascale_adam", "adascale_adam:moments=steps", "linear", "sqrt",
              "adascale:smoothing=0.9", "adascale:smoothing=0.99")}
    assert len(codes) == 7 and all(c == int(c) < 2 ** 53 for c in codes)


def test_a_version_6_vector_is_taken_only_where_its_policy_is_known():
    """Version 6's vector (no policy in it, one value shorter): Keras's load_model rebuilds the
    optimizer from the config saved with it, so the policy is known and the record migrates;
    elsewhere it is refused, naming what to do."""
    from hvd_scale import run as runs
    from hvd_scale.noise import NoiseState
    from hvd_scale.run import RunState
    setup, run = _run_of("adascale")
    vector = run.to_vector(setup)
    noise = NoiseState.vector_size(setup.groups)  # version 8's noise record, after the policy's
    old = np.concatenate([[6.0], vector[2:-noise]])  # [6, S, k, W, measure, skips, last lr, policy]
    with pytest.raises(ValueError, match=r"a version 6 record, which does not name the policy "
                                         r"that saved it, and this optimizer runs 'adascale'.*"
                                         r"keras.models.load_model"):
        runs.migrate_vector(old, setup, saved_by_this_policy=False)
    migrated = runs.migrate_vector(old, setup, saved_by_this_policy=True)
    assert migrated.tolist() == vector.tolist()
    assert RunState.from_vector(migrated, setup) == run
    # Anything else goes through as it is, for from_vector to check.
    np.testing.assert_array_equal(runs.migrate_vector(vector, setup, saved_by_this_policy=False),
                                  vector)
