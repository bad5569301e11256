"""hvd_scale's DDP optimizer where users meet DDP: Lightning
(``hvd_scale.adapters.torch.lightning.DDPStrategy``, automatic optimization at
``accumulate_grad_batches`` 1 and 2) and Hugging Face Accelerate (examples/ddp_accelerate.py:
``prepare``, then the optimizer over the prepared DDP model, ``accelerator.accumulate``).
Under ``torchrun --nproc-per-node 2`` (Gloo, CPU) each gives, step by step, the gains, lr
factors, tau, sigma2 and mu2 of the plain DDP loop with hvd_scale's DDP optimizer on the same
micro-batches, the lr its SGD saw is the policy's (baseline lr x adascale's gain), and the
weights after are the same (each example's ``--compare`` runs both in one job; Lightning's with
its gradient clipping, the plain loop clipping the mean of the passes). Lightning also trains to
a budget in tau, with an lr schedule in tau, its metrics in the Trainer's logger, and resumes
from its checkpoints.

Skipped only where the package is not installed and HVD_SCALE_REQUIRE_HOROVOD is unset (`make
test` sets it: there a missing package fails; `make setup` installs the extras).
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from hvdrun import REPO_ROOT, _horovod_required, run_process, run_torchrun, worker_results

EXAMPLES = {"lightning": REPO_ROOT / "examples" / "ddp_lightning.py",
            "accelerate": REPO_ROOT / "examples" / "ddp_accelerate.py"}
RTOL = 1e-6
LR = 0.05  # the examples'


def _need(package):
    if importlib.util.find_spec(package) is None:
        if not _horovod_required():
            pytest.skip(f"{package} is not installed (the `{package}` extra; make setup installs it)")
        pytest.fail(f"{package} is not installed, and HVD_SCALE_REQUIRE_HOROVOD requires it "
                    f"(make setup installs the `{package}` extra)")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("package", sorted(EXAMPLES))
def test_steps_like_the_plain_ddp_loop(package):
    _need(package)
    # Lightning clips the gradients' norm (gradient_clip_val; the plain loop clip_grad_norm_ after
    # the passes): at 0.1 every step is clipped (|g_bar| ~ 0.6), so the gradient SGD applied has
    # norm 0.1 at k = 1 and 2 (had it clipped the sum of 2 passes, then averaged: 0.05).
    clip = 0.1 if package == "lightning" else None
    flags = [] if clip is None else ["--clip", str(clip)]
    proc = run_torchrun([str(EXAMPLES[package]), "--policy", "adascale", "--accumulate", "1,2",
                         "--steps", "5", "--compare", *flags], timeout=140)
    runs = {}
    for r in worker_results(proc):
        runs[(r["run"], r["k"], r["rank"])] = r
    assert len(runs) == 8, sorted(runs)
    for k in (1, 2):
        for rank in (0, 1):
            ours, plain = runs[(package, k, rank)], runs[("plain", k, rank)]
            assert ours["scale"] == plain["scale"] == 2 * k
            assert [row["steps"] for row in ours["rows"]] == [1, 2, 3, 4, 5]
            for key in ("gain", "lr_factor", "lr", "progress", "sigma2", "mu2"):
                np.testing.assert_allclose([row[key] for row in ours["rows"]],
                                           [row[key] for row in plain["rows"]], rtol=RTOL,
                                           err_msg=f"k={k} rank {rank}: {key}")
            np.testing.assert_allclose(ours["weights"], plain["weights"], rtol=RTOL, atol=1e-12)
            gains = np.array([row["gain"] for row in ours["rows"]])
            # measured, not the bounds: the lr the SGD saw follows the gain, step by step
            assert 1 < gains.min() and gains.max() < 2 * k and np.ptp(gains) > 1e-3, gains
            np.testing.assert_allclose([row["lr"] for row in ours["rows"]], LR * gains, rtol=1e-12)
            if clip is not None:
                np.testing.assert_allclose([row["applied"] for row in ours["rows"]], clip,
                                           rtol=1e-4, err_msg=f"k={k}: the norm SGD applied")
        assert runs[(package, k, 0)]["rows"] == runs[(package, k, 1)]["rows"]


@pytest.mark.timeout(90)
def test_accelerate_in_one_process_is_refused():
    """Without a torchrun environment Accelerate runs one process and wraps nothing in DDP: no
    DDP hook to carry the statistics, and the DDP optimizer says so."""
    _need("accelerate")
    proc = run_process([sys.executable, str(EXAMPLES["accelerate"]), "--steps", "1"], timeout=80,
                       check=False)
    assert proc.returncode != 0
    assert "TypeError: model must be a torch.nn.parallel.DistributedDataParallel" in proc.stderr


@pytest.mark.timeout(240)
def test_lightning_trains_to_the_budget_in_tau_and_resumes_from_its_checkpoint(tmp_path):
    """DDPStrategy(optimizer_kwargs={"budget": T}) stops the Trainer once tau reaches T (it ran
    to max_epochs, tau far past T); ScalingCallback sets the baseline lr from a schedule at tau
    (StepDecay, halved at tau 12) and logs gain, tau, S and the noise scale to the Trainer's
    logger (a CSVLogger: its values are the optimizer's, step by step). A fit to T / 2 saved
    with trainer.save_checkpoint and resumed with fit(ckpt_path=...) goes on from its step count
    and tau to T, the schedule read at the restored tau."""
    import csv

    from hvd_scale.schedules import StepDecay, lr_at

    _need("lightning")
    budget, max_epochs = 16.0, 100
    proc = run_torchrun([str(EXAMPLES["lightning"]), "--budget", str(budget), "--log-dir",
                         str(tmp_path), "--max-epochs", str(max_epochs)], timeout=220)
    runs = {(r["run"], r["rank"]): r for r in worker_results(proc)}
    assert len(runs) == 6, sorted(runs)
    schedule = StepDecay(LR, [12], gamma=0.5)
    for rank in (0, 1):
        first = runs[("first", rank)]
        for name, target in (("straight", budget), ("first", budget / 2), ("resumed", budget)):
            run = runs[(name, rank)]
            rows = run["rows"]
            start = first["progress"] if name == "resumed" else 0.0
            before = [start] + [row["progress"] for row in rows[:-1]]
            # stopped at the budget: the last step reached it, the one before had not
            assert before[-1] < target <= rows[-1]["progress"], (name, before[-1:], rows[-1])
            assert run["epochs"] < max_epochs - 1 and run["progress"] == rows[-1]["progress"]
            np.testing.assert_allclose([row["lr"] for row in rows],
                                       [lr_at(schedule, t) * row["gain"]
                                        for t, row in zip(before, rows)], rtol=1e-12)
        resumed = runs[("resumed", rank)]["rows"]
        assert resumed[0]["steps"] == first["steps"] + 1  # not 1: the record came back
        assert resumed[0]["progress"] == pytest.approx(first["progress"] + resumed[0]["gain"])
        assert any(t >= 12 for t in [first["progress"]] + [r["progress"] for r in resumed])
    assert runs[("straight", 0)]["rows"] == runs[("straight", 1)]["rows"]
    straight = runs[("straight", 0)]["rows"]
    with open(tmp_path / "straight" / "version_0" / "metrics.csv", newline="") as f:
        logged = [r for r in csv.DictReader(f) if r.get("hvd_scale/gain")]
    assert len(logged) == len(straight)
    for key in ("gain", "progress"):  # Lightning logs float32
        np.testing.assert_allclose([float(r[f"hvd_scale/{key}"]) for r in logged],
                                   [row[key] for row in straight], rtol=1e-6)
    assert {float(r["hvd_scale/scale"]) for r in logged} == {2.0}
    assert all(0 < float(r["hvd_scale/noise_scale"]) < float("inf") for r in logged)
