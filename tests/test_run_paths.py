"""Issue #47's items 3-6, each through the public API as a user met it (one process; the same
paths under ``horovodrun -np 2`` are cells of tests/test_transitions.py). Item 1 (Keras's
adapt under fit starting at k = 2) and item 2 (a k adapted before a checkpoint, resumed through
broadcast_state) are the matrix's ``adapt`` and ``adapt_checkpoint`` cells, on both Keras
backends, in one process and under horovodrun -np 2. Each test failed at the commit before the
run record (2c99408) and passes after."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hvdrun import requires_horovod

pytestmark = [requires_horovod]

LR = 0.1


def _torch_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1, bias=False).double()


def _torch_opt(model, spec, k, **kw):
    import horovod.torch as hvd
    import torch

    from hvd_scale.adapters.torch import DistributedOptimizer
    hvd.init()
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                named_parameters=model.named_parameters(), policy=spec,
                                backward_passes_per_step=k, **kw)


def _passes(model, opt, xs):
    import torch
    opt.zero_grad()
    for x in xs:
        model(torch.tensor([x], dtype=torch.float64)).sum().backward()
    opt.step()


def test_item_3_a_change_of_k_that_would_need_statistics_never_taken_is_refused():
    """One process at S = 1 takes no statistics; set_passes(2) was accepted and the next step
    raised 'needs gradient statistics every step'. Now refused at set_passes, naming the cause
    and the fix, with nothing changed; measure=True makes it possible."""
    model = _torch_model()
    opt = _torch_opt(model, "adascale", 1)
    _passes(model, opt, [[1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"k went from 1 to 2 passes per step.*policy 'adascale' "
                                         r"at S = 2 needs the gradient statistics.*measure=True"):
        opt.set_passes(2)
    assert (opt.backward_passes_per_step, opt.scale, opt.steps) == (1, 1.0, 1)
    _passes(model, opt, [[1.0, 0.0, 0.0]])  # the run goes on at k = 1
    measured = _torch_opt(_torch_model(), "adascale", 1, measure=True)
    measured.set_passes(2)
    assert measured.scale == 2.0


def test_item_3_a_k_that_leaves_one_micro_gradient_at_s_above_1_is_refused():
    """k = 2 with scale=4: set_passes(1) was accepted, and the next step raised 'n = 1'."""
    model = _torch_model()
    opt = _torch_opt(model, "adascale", 2, scale=4)
    with pytest.raises(ValueError, match=r"from 2 to 1 passes per step, which would take S from 4 "
                                         r"to 2: policy 'adascale' at S = 2 needs at least 2 "
                                         r"micro-gradients"):
        opt.set_passes(1)
    assert (opt.backward_passes_per_step, opt.scale) == (2, 4.0)


@pytest.mark.parametrize("spec", ["none", "linear", "sqrt", "warmup:baseline_steps=10"])
def test_item_4_an_unmeasured_short_step_applies_its_passes_mean_at_its_own_s(spec):
    """One process, k = 2, a step of one pass, a fixed rule without a log directory: the update
    was 0.50x the pass's gradient x the factor and tau advanced by 2."""
    import torch

    from hvd_scale.spec import make_policy
    model = _torch_model()
    opt = _torch_opt(model, spec, 2)
    assert not opt.scaling.measure
    before = model.weight.detach().clone()
    _passes(model, opt, [[1.0, 2.0, 3.0]])  # one pass of k = 2
    policy = make_policy(spec)
    factor = policy.factor(policy.init(), 1)
    expected = before - LR * factor * torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    assert torch.allclose(model.weight.detach(), expected, rtol=1e-12)
    assert (opt.progress, opt.lr_factor) == (1.0, factor)
    _passes(model, opt, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # a full step: S = 2
    assert opt.progress == 3.0


def test_item_5_a_short_step_of_one_pass_at_s_above_1_takes_its_gain_from_the_estimates():
    """k = 2, scale=4, a leftover batch of one pass raised 'n = 1 micro-gradients give no
    variance estimate'; its S is 2 and its gain comes from the estimates so far."""
    model = _torch_model()
    opt = _torch_opt(model, "adascale", 2, scale=4)
    for i in range(5):
        _passes(model, opt, [[1.0, 0.1 * i, 0.0], [0.5, 0.0, 1.0]])
    estimates = (opt.sigma2, opt.mu2)
    expected = opt.policy.gain(opt.run_state.policy, 2.0)
    tau = opt.progress
    _passes(model, opt, [[1.0, 0.0, 0.0]])
    assert (opt.sigma2, opt.mu2) == estimates
    assert opt.progress == pytest.approx(tau + expected) and 1.0 < expected <= 2.0
    assert opt.lr_factor == pytest.approx(expected)


def _keras(code: str, backend: str = "tensorflow") -> subprocess.CompletedProcess:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240, env=env)


@pytest.mark.timeout(300)
def test_item_6_a_keras_state_of_another_version_is_refused_naming_it():
    """Keras's state vector carried no version: an adascale_adam state saved before the cap
    loaded silently under today's cap. The record's vector has its version: a vector of another
    version is refused at the next step, naming both, before anything is applied; one of the
    older layout (no version) does not fit the variable."""
    out = _keras("""
        import numpy as np, keras
        from hvd_scale.adapters.keras import DistributedOptimizer, hvd
        from hvd_scale import run
        hvd.init()
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        opt = DistributedOptimizer(keras.optimizers.Adam(0.01), policy="adascale_adam",
                                   backward_passes_per_step=2)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        opt.build(model.trainable_variables)
        state = opt._state
        vector = np.array(state.numpy())
        old = vector.copy(); old[run.VERSION_INDEX] = 5
        state.assign(old)
        before = [w.copy() for w in model.get_weights()]
        x = np.ones((16, 4)); y = np.ones((16, 1))
        try:
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            print("LOADED")
        except Exception as e:
            print("REFUSED", f"holds a version 5 record, this hvd_scale reads version {run.VERSION}"
                  in str(e),
                  all(np.array_equal(a, b) for a, b in zip(before, model.get_weights())))
        try:
            state.assign(np.zeros(vector.size - run.HEAD))  # a vector of before the record
            print("ASSIGNED")
        except Exception as e:
            print("SHAPE", type(e).__name__)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED True True" in out.stdout and "SHAPE" in out.stdout, out.stdout


@pytest.mark.parametrize("spec", ["linear", "adascale"])
def test_a_short_steps_metrics_row_holds_its_own_s_and_passes(spec, tmp_path):
    """Issue #48 item 10: the row of a short step (an epoch's leftover batch) showed the announced
    S and k, not the step's own. One process, k = 4 (S = 4): full, short (1 pass), short (3
    passes), full; each row's S, passes, gain and lr factor are the step's."""
    import csv

    model = _torch_model()
    opt = _torch_opt(model, spec, 4, log_dir=str(tmp_path), measure=True)
    xs = [[1.0, 2.0, 3.0], [0.5, -1.0, 2.0], [-1.0, 0.3, 0.2], [2.0, 1.0, -0.5]]
    factors = []
    for passes in (4, 1, 3, 4):
        _passes(model, opt, xs[:passes])
        factors.append(opt.lr_factor)
    opt.close()
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["scale"]) for r in rows] == [4.0, 1.0, 3.0, 4.0]
    assert [float(r["passes"]) for r in rows] == [4.0, 1.0, 3.0, 4.0]
    assert [float(r["lr_factor"]) for r in rows] == factors
    for row in rows:
        assert 1.0 <= float(row["gain"]) <= float(row["scale"])
        assert float(row["efficiency"]) == pytest.approx(float(row["gain"]) / float(row["scale"]))
    if spec == "linear":
        assert factors == [4.0, 1.0, 3.0, 4.0]
