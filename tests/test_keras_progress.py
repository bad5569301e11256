"""#48 item 10: Keras's progress bar under the budget-driven fit (``epochs=10**6``, ScalingMetrics
stops at the budget) said "Epoch 4/1000000", and its line, redrawn with carriage returns and
holding every metric ScalingMetrics logs, reached horovodrun's pipe as one line of hundreds of
characters per batch. ``BudgetProgbar`` shows tau against the budget and the epochs the budget
takes, a few of the policy's metrics, and one line per epoch when stdout is not a terminal."""

import os
import sys
import textwrap
from types import SimpleNamespace

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from hvdrun import requires_horovod, run_process  # noqa: E402

ALL_METRICS = {"gain": 1.5, "lr": 0.05, "lr_factor": 1.5, "progress": 0.0, "scale": 2.0,
               "sigma2": 1e-5, "mu2": 2e-3, "noise_scale": 0.005, "efficiency": 0.75}


def _fit(progbar, per_batch, batches=4, epochs=3, fit_epochs=10**6, budget=100.0):
    """Drive the callback as fit does, tau growing per_batch each batch."""
    opt = SimpleNamespace(progress=0.0, policy=SimpleNamespace(budget=budget))
    progbar.set_model(SimpleNamespace(optimizer=opt))
    progbar.set_params({"verbose": 1, "epochs": fit_epochs, "steps": batches})
    progbar.on_train_begin()
    for epoch in range(epochs):
        progbar.on_epoch_begin(epoch)
        for batch in range(batches):
            opt.progress += per_batch
            progbar.on_train_batch_end(batch, {"loss": 0.5, **ALL_METRICS,
                                               "progress": opt.progress})
        progbar.on_epoch_end(epoch, {"loss": 0.4, "accuracy": 0.9, **ALL_METRICS,
                                     "progress": opt.progress})


def test_headers_show_tau_the_budget_and_the_epochs_it_takes(capsys):
    from hvd_scale.adapters.keras.callbacks import BudgetProgbar

    _fit(BudgetProgbar(), per_batch=2.5)  # 10 tau an epoch: the budget of 100 takes 10 epochs
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("Epoch")] == [
        "Epoch 1 (tau 0/100)", "Epoch 2/~10 (tau 10/100)", "Epoch 3/~10 (tau 20/100)"]
    assert "1000000" not in out
    # Not a terminal (pytest's capture, as horovodrun's pipe): one line per epoch (verbose=2),
    # with the loss, Keras's own metrics and progress, gain and lr; not the rest.
    rows = [line for line in lines if not line.startswith("Epoch")]
    assert len(rows) == 3 and "\r" not in out and "\b" not in out
    for row in rows:
        assert all(f"- {k}:" in row for k in ("loss", "accuracy", "progress", "gain", "lr"))
        assert not any(f"- {k}:" in row for k in ("sigma2", "mu2", "noise_scale", "efficiency",
                                                   "scale", "lr_factor"))
        assert len(row) < 120, row


def test_the_estimate_follows_the_latest_epoch_and_caps_at_fit_epochs(capsys):
    from hvd_scale.adapters.keras.callbacks import BudgetProgbar

    _fit(BudgetProgbar(budget=30.0, keys=("progress",)), per_batch=1.0, epochs=3, fit_epochs=5)
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch")]
    # 4 tau an epoch: 30 takes 8 epochs, more than fit's 5.
    assert headers == ["Epoch 1 (tau 0/30)", "Epoch 2/~5 (tau 4/30)", "Epoch 3/~5 (tau 8/30)"]


def test_without_a_budget_it_is_kerass_header_and_verbose_0_is_silent(capsys):
    from hvd_scale.adapters.keras.callbacks import BudgetProgbar

    _fit(BudgetProgbar(), per_batch=1.0, epochs=2, fit_epochs=7, budget=None)
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch")]
    assert headers == ["Epoch 1/7", "Epoch 2/7"]

    progbar = BudgetProgbar()
    progbar.set_model(SimpleNamespace(optimizer=SimpleNamespace(progress=0.0, policy=None)))
    progbar.set_params({"verbose": 0, "epochs": 10**6, "steps": 2})
    progbar.on_epoch_begin(0)
    progbar.on_train_batch_end(0, {"loss": 1.0})
    progbar.on_epoch_end(0, {"loss": 1.0})
    assert capsys.readouterr().out == ""


def test_on_a_terminal_the_bar_stays_and_shows_only_the_chosen_keys(capsys, monkeypatch):
    from hvd_scale.adapters.keras.callbacks import BudgetProgbar

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    progbar = BudgetProgbar()
    _fit(progbar, per_batch=2.5, epochs=1)
    assert progbar.verbose == 1
    out = capsys.readouterr().out
    assert "- gain:" in out and "- progress:" in out and "sigma2" not in out


@requires_horovod
@pytest.mark.timeout(300)
def test_a_real_fit_to_a_budget_prints_short_lines(tmp_path):
    """One process (Horovod size 1), the real optimizer, ScalingMetrics and BudgetProgbar, its
    stdout a pipe as under horovodrun."""
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, keras
        from hvd_scale.adapters.keras import DistributedOptimizer, ScalingMetrics, hvd
        from hvd_scale.adapters.keras.callbacks import BudgetProgbar

        hvd.init()
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 4)).astype("float32")
        y = (x @ np.ones(4, "float32"))[:, None]
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.01), budget=20),
                      loss="mse", jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=10**6, callbacks=[ScalingMetrics(), BudgetProgbar()])
        print("tau", model.optimizer.progress)
    """))
    proc = run_process([sys.executable, str(script)], timeout=240,
                       env={**os.environ, "KERAS_BACKEND": "tensorflow", "OMP_NUM_THREADS": "1",
                            "TF_CPP_MIN_LOG_LEVEL": "2", "HVD_SCALE_POLICY": "linear"},
                       what="a one-process fit with BudgetProgbar")
    lines = proc.stdout.splitlines()
    headers = [line for line in lines if line.startswith("Epoch")]
    # linear at S = 1: 4 tau an epoch of 4 batches, 20 in 5 epochs.
    assert headers == ["Epoch 1 (tau 0/20)", "Epoch 2/~5 (tau 4/20)", "Epoch 3/~5 (tau 8/20)",
                       "Epoch 4/~5 (tau 12/20)", "Epoch 5/~5 (tau 16/20)"], proc.stdout
    assert "tau 20.0" in lines
    assert "1000000" not in proc.stdout and "sigma2" not in proc.stdout
    assert max(len(line) for line in lines) < 160, proc.stdout
