"""hvd_scale's DDP optimizer where users meet DDP: Lightning
(``hvd_scale.adapters.torch.lightning.DDPStrategy``, automatic optimization at
``accumulate_grad_batches`` 1 and 2) and Hugging Face Accelerate (examples/ddp_accelerate.py:
``prepare``, then the optimizer over the prepared DDP model, ``accelerator.accumulate``).
Under ``torchrun --nproc-per-node 2`` (Gloo, CPU) each gives, step by step, the gains, lr
factors, tau, sigma2 and mu2 of the plain DDP loop with hvd_scale's DDP optimizer on the same
micro-batches, the lr its SGD saw is the policy's (baseline lr x adascale's gain), and the
weights after are the same (each example's ``--compare`` runs both in one job).

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
    proc = run_torchrun([str(EXAMPLES[package]), "--policy", "adascale", "--accumulate", "1,2",
                         "--steps", "5", "--compare"], timeout=140)
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
            assert 1.05 < gains.min() and gains.max() < 2 * k and np.ptp(gains) > 1e-3, gains
            np.testing.assert_allclose([row["lr"] for row in ours["rows"]], LR * gains, rtol=1e-12)
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
