"""The lr safety guard (hvd_scale.guard): the stability limits, the cap in the policy step, the
power iteration against exact eigenvalues, and the torch adapter under `horovodrun -np 2`."""

import math
import re
import sys

import numpy as np
import pytest

from hvd_scale import make_policy
from hvd_scale.guard import SharpnessGuard, stability_limit
from hvdrun import WORKERS_DIR, requires_horovod, run_horovod, worker_results


# -- the engine: limits, the guard's state, the capped step ---------------------------------------
def test_stability_limits_of_each_optimizer():
    assert stability_limit(4.0) == pytest.approx(0.5)  # gradient descent: 2 / lambda
    assert stability_limit(4.0, momentum=0.9) == pytest.approx(2 * 1.9 / 4)
    assert stability_limit(4.0, momentum=0.9, dampening=0.5) == pytest.approx(2 * 1.9 / 2)
    assert stability_limit(4.0, momentum=0.9, nesterov=True) == pytest.approx(2 * 1.9 / (2.8 * 4))
    assert stability_limit(4.0, optimizer="Adam", beta1=0.9) == pytest.approx(3.8 / 0.4)
    assert stability_limit(0.0) == math.inf and stability_limit(-1.0) == math.inf


@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": "RMSprop"}, "got optimizer 'RMSprop'"),
    ({"momentum": 1.0}, "momentum must be in [0, 1), got 1.0"),
    ({"optimizer": "Adam", "beta1": -0.1}, "beta1 must be in [0, 1), got -0.1"),
])
def test_stability_limit_refuses_what_it_does_not_know(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        stability_limit(1.0, **kwargs)
    with pytest.raises(ValueError, match="sharpness must be finite"):
        stability_limit(math.nan)


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, "every must be an integer >= 1, got 0"),
    ({"every": True}, "every must be an integer >= 1, got True"),
    ({"iterations": 0}, "iterations must be an integer >= 1, got 0"),
    ({"tol": 0.0}, "tol must be in (0, 1), got 0.0"),
    ({"margin": 1.5}, "margin must be in (0, 1], got 1.5"),
])
def test_guard_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SharpnessGuard(**kwargs)


def test_guard_schedule_cap_and_state():
    guard = SharpnessGuard(every=5, margin=0.5)
    assert guard.max_factor(0.1) is None and guard.metrics()["lr_cap"] == math.inf
    assert math.isnan(guard.metrics()["sharpness"])
    assert [s for s in range(12) if guard.due(s)] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # none yet
    guard.update(10.0, 0, momentum=0.9)
    assert [s for s in range(12) if guard.due(s)] == [0, 5, 10]
    assert guard.limit == pytest.approx(0.5 * 2 * 1.9 / 10)  # margin x 2 (1 + beta) / lambda
    assert guard.max_factor(0.019) == pytest.approx(10.0)
    restored = SharpnessGuard()
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    with pytest.raises(ValueError, match="guard state needs keys"):
        restored.load_state_dict({"sharpness": 1.0})
    with pytest.raises(ValueError, match="limit -1.0"):
        restored.load_state_dict({"sharpness": 1.0, "limit": -1.0, "measured_at": 0})
    assert restored.state_dict() == guard.state_dict()  # a bad state changed nothing


@pytest.mark.parametrize("spec", ["linear", "warmup:baseline_steps=32", "adascale", "adascale_adam"])
def test_the_cap_lowers_the_applied_factor_not_progress(spec):
    free, capped = make_policy(spec), make_policy(spec)
    free_state, capped_state = free.init(), capped.init()
    rng = np.random.default_rng(0)
    for _ in range(25):
        stats = (float(rng.uniform(8, 16)), float(rng.uniform(0.5, 1.0)), 8)
        free_state, a = free.transition(free_state, *stats, scale=8)
        capped_state, b = capped.transition(capped_state, *stats, scale=8, max_factor=1.05)
        assert b.lr_factor == min(a.lr_factor, 1.05) and capped_state.lr_factor == b.lr_factor
        assert b.progress == a.progress and b.gain == a.gain
    assert free_state.lr_factor > 1.05  # the cap did bind (adascale_adam: 5 steps past its 20)
    with pytest.raises(ValueError, match="max_factor must be > 0, got 0.0"):
        capped.transition(capped_state, *stats, scale=8, max_factor=0.0)


# -- power iteration against exact eigenvalues ----------------------------------------------------
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("case", ["psd", "negative_dominant", "scaled"])
def test_power_iteration_finds_the_top_eigenvalue(case):
    from hvd_scale.adapters.torch import hessian_top_eigenvalue

    g = torch.Generator().manual_seed(1)
    a = torch.randn(7, 7, generator=g, dtype=torch.float64)
    h = a @ a.T if case != "negative_dominant" else -(a @ a.T) + 3 * torch.eye(7, dtype=torch.float64)
    s = torch.rand(7, generator=g, dtype=torch.float64) + 0.5
    w = torch.nn.Parameter(torch.randn(7, generator=g, dtype=torch.float64))
    got = hessian_top_eigenvalue(lambda: 0.5 * w @ h @ w + w.sum(), [w], iterations=1000, tol=1e-13,
                                 scaling=[s] if case == "scaled" else None)
    m = (torch.diag(s) @ h @ torch.diag(s)) if case == "scaled" else h
    assert got == pytest.approx(float(np.linalg.eigvalsh(m.numpy()).max()), rel=1e-6)
    assert w.grad is None  # nothing accumulated into .grad


# -- the torch adapter, two workers ---------------------------------------------------------------
@pytest.fixture(scope="module")
def results():
    proc = run_horovod([sys.executable, str(WORKERS_DIR / "guard_worker.py")], np=2, timeout=150)
    out: dict = {}
    for r in worker_results(proc):
        out.setdefault(r["case"], []).append(r)
    return out


@requires_horovod
@pytest.mark.timeout(200)
def test_guard_measures_the_workers_mean_sharpness_and_caps_the_lr(results):
    ranks = sorted(results["sgd"], key=lambda r: r["rank"])
    unguarded = sorted(results["sgd_unguarded"], key=lambda r: r["rank"])[0]["rows"]
    rows = ranks[0]["rows"]
    for a, b in zip(ranks[0]["rows"], ranks[1]["rows"]):  # one estimate, one lr on both ranks
        assert (a["sharpness"], a["lr"], a["moved"]) == (b["sharpness"], b["lr"], b["moved"])
    for step in (0, 3, 18):  # measured at steps 0, 3, ..., 18 (every=3) on the batch given to guard_loss
        expected = np.mean([r["rows"][step]["local_sharpness"] for r in ranks])
        assert rows[step]["sharpness"] == pytest.approx(expected, rel=1e-8)
        assert rows[step]["lr_cap"] == pytest.approx(0.5 * 2 * 1.9 / expected, rel=1e-8)  # margin 0.5
    assert rows[1]["sharpness"] == rows[0]["sharpness"]  # kept between measurements
    # linear at S = 4: 0.2 x 4 = 0.8 is past the limit (~0.4): every step applies the cap (~0.2).
    for row in rows:
        assert row["lr"] == pytest.approx(row["lr_cap"], rel=1e-12) and row["lr_factor"] < 4.0
    # The first update is -lr_cap x the mean micro-gradient (momentum buffer = gradient at step 1),
    # and the guard's Hessian-vector products left the statistics alone.
    mean_grad = np.sum([r["rows"][0]["local_grad_sum"] for r in ranks], axis=0) / 4
    np.testing.assert_allclose(rows[0]["moved"], rows[0]["lr_cap"] * mean_grad, rtol=1e-9)
    for key in ("gain", "sigma2", "mu2"):
        assert rows[0][key] == pytest.approx(unguarded[0][key], rel=1e-12)
    # Without the guard the scaled lr diverges on this quadratic; with it the loss falls.
    assert unguarded[-1]["loss"] > 100 * unguarded[0]["loss"]
    assert rows[-1]["loss"] < 0.1 * rows[0]["loss"], [row["loss"] for row in rows]


@requires_horovod
@pytest.mark.timeout(200)
def test_a_due_step_without_guard_loss_fails_on_every_rank(results):
    assert len(results["missing"]) == 2
    for r in results["missing"]:
        assert "opt.step(guard_loss=fn)" in r["error"] and "got guard_loss=None" in r["error"]
        assert r["steps"] == 0  # the step was not taken


@requires_horovod
@pytest.mark.timeout(200)
def test_adam_is_measured_once_it_has_a_second_moment(results):
    for r in results["adam"]:
        assert r["measured_at"] == 1
        first, second = r["rows"][0], r["rows"][1]
        assert math.isnan(first["sharpness"]) and first["lr_cap"] == math.inf
        assert second["sharpness"] > 0
        # margin 0.5 (default) x (2 + 2 beta1) / ((1 - beta1) lambda)
        assert second["lr_cap"] == pytest.approx(0.5 * 3.8 / 0.1 / second["sharpness"], rel=1e-9)


@requires_horovod
@pytest.mark.timeout(200)
def test_the_estimate_travels_with_the_checkpoint(results):
    for r in results["checkpoint"]:
        assert r["loaded"] == r["saved"] and r["saved"]["measured_at"] == 0
        assert r["due"] is False  # steps 2 of every=3: the loaded cap holds until step 3
