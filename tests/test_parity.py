"""Three paths agree: the torch adapter, Keras on TensorFlow and Keras on torch (KERAS_BACKEND=torch,
horovod.torch). Same model, weights and micro-batches give the same gains, tau, sigma2, mu2 and
weights.

Three `horovodrun -np 2` jobs (one per path) run tests/workers/parity_worker.py. Tolerance:
float32's, relative 1e-5 for gains, tau, sigma2 and mu2, 1e-6 absolute for the weights. Both
adapters keep float64 statistics for a float64 model, and the runs agree to ~1e-15 today; the
float32 tolerance leaves room for a summation order or a float32 statistics path to change,
while any difference of convention (lr, loss scaling over k, n, S) shows at 1e-3 or more.
"""

import sys

import numpy as np
import pytest

from hvdrun import WORKERS_DIR, requires_horovod, run_horovod, worker_results

pytestmark = [requires_horovod]
NP = 2
PATHS = ("torch", "keras", "keras-torch")
GAIN_RTOL = 1e-5
WEIGHT_ATOL = 1e-6


@pytest.fixture(scope="module")
def runs():
    out = {}
    for framework in PATHS:
        proc = run_horovod([sys.executable, str(WORKERS_DIR / "parity_worker.py"),
                            "--framework", framework], np=NP, timeout=240)
        for r in worker_results(proc):
            out[(framework, r["k"], r["rank"])] = r
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("k", [1, 2, 4, "4/passes"])
@pytest.mark.parametrize("keras_path", ["keras", "keras-torch"])
def test_same_gains_in_torch_and_keras(runs, k, keras_path):
    """At k = 2 and 4 each worker's accumulated gradient is read once (the default at two
    workers); "4/passes": every pass read (samples="passes")."""
    passes = int(str(k)[0])
    for rank in range(NP):
        t, kr = runs[("torch", k, rank)], runs[(keras_path, k, rank)]
        assert t["scale"] == kr["scale"] == NP * passes
        assert len(t["rows"]) == len(kr["rows"]) == 6
        tg = np.array([row["gain"] for row in t["rows"]])
        kg = np.array([row["gain"] for row in kr["rows"]])
        assert np.all((tg >= 1) & (tg <= NP * passes)) and tg.max() > 1.0
        np.testing.assert_allclose(kg, tg, rtol=GAIN_RTOL)
        for key in ("progress", "sigma2", "mu2"):  # mu2 may be clipped to exactly 0: atol
            np.testing.assert_allclose([row[key] for row in kr["rows"]], [row[key] for row in t["rows"]],
                                       rtol=GAIN_RTOL, atol=1e-12, err_msg=key)
        np.testing.assert_allclose(kr["weights"], t["weights"], atol=WEIGHT_ATOL)
    # Each framework's ranks agree exactly among themselves.
    for framework in PATHS:
        assert runs[(framework, k, 0)]["rows"] == runs[(framework, k, 1)]["rows"]
    if k == "4/passes":  # the option reached the framework: another estimate from the same passes
        for framework in PATHS:
            ours, default = runs[(framework, k, 0)]["rows"], runs[(framework, 4, 0)]["rows"]
            assert all(a["sigma2"] != pytest.approx(b["sigma2"], rel=1e-3)
                       for a, b in zip(ours, default)), framework


@pytest.mark.timeout(600)
@pytest.mark.parametrize("keras_path", ["keras", "keras-torch"])
def test_same_weights_with_adam_moment_horizons(runs, keras_path):
    """AdamW under adascale_adam (betas^r, eps / sqrt(r), bias correction 1 - beta^tau, decay per
    unit of tau) in torch and in Keras: the same gains, tau and weights."""
    for rank in range(NP):
        t, kr = runs[("torch", "adam", rank)], runs[(keras_path, "adam", rank)]
        assert len(t["rows"]) == len(kr["rows"]) == 26
        tg = np.array([row["gain"] for row in t["rows"]])
        assert tg[:20].tolist() == [1.0] * 20 and tg.max() > 1.2  # measured gains drive the betas
        np.testing.assert_allclose([row["gain"] for row in kr["rows"]], tg, rtol=GAIN_RTOL)
        np.testing.assert_allclose([row["progress"] for row in kr["rows"]],
                                   [row["progress"] for row in t["rows"]], rtol=GAIN_RTOL)
        np.testing.assert_allclose(kr["weights"], t["weights"], atol=WEIGHT_ATOL)
