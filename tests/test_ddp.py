"""The torch adapter under torch.distributed (``hvd_scale.adapters.torch.ddp``): the same script,
seeds and micro-batches under ``horovodrun -np 2``, ``torchrun --nproc-per-node 2`` and in one
process (the engine's own functions over the same micro-gradients) give the same per-step gain,
lr factor, tau, sigma2, mu2 and weights, for every policy at k = 1 and 4 (at k = 4 with the
statistics read once per worker, the default at two workers, and adascale's with every pass
read: ``samples="passes"``); gradient clipping before the step sees the mean micro-gradient
under both; a checkpoint saved under one engine resumes under the other
(tests/workers/engines_worker.py).

Tolerance: the model is float64 and every path sums the same numbers in another order, so
relative 1e-9 (a difference of convention, of n or S or of the loss's scaling over k, shows at
1e-3 or more)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from hvdrun import WORKERS_DIR, requires_horovod, run_horovod, run_process, run_torchrun, worker_results

WORKER = WORKERS_DIR / "engines_worker.py"
RTOL = 1e-9
KEYS = ("gain", "lr_factor", "progress", "sigma2", "mu2", "steps")


def _by_run(results):
    out = {}
    for r in results:
        out.setdefault(r["run"], {})[r["rank"]] = r
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The three runs: Horovod (saving a checkpoint), DDP (resuming Horovod's, saving its own),
    Horovod again (resuming DDP's), and the one-process reference."""
    folder = tmp_path_factory.mktemp("engines")
    runs = {"horovod": _by_run(worker_results(run_horovod(
        [sys.executable, str(WORKER), "--engine", "horovod", "--save", str(folder)], np=2,
        timeout=240)))}
    runs["ddp"] = _by_run(worker_results(run_torchrun(
        [str(WORKER), "--engine", "ddp", "--save", str(folder),
         "--resume", str(folder / "horovod.pt")], timeout=240)))
    resumed = _by_run(worker_results(run_horovod(
        [sys.executable, str(WORKER), "--engine", "horovod", "--resume", str(folder / "ddp.pt")],
        np=2, timeout=240)))
    runs["horovod"]["resumed from ddp"] = resumed["resumed"]
    runs["reference"] = _by_run(worker_results(run_process(
        [sys.executable, str(WORKER), "--engine", "reference"], timeout=240)))
    runs["fsdp"] = _by_run(worker_results(run_torchrun([str(WORKER), "--engine", "fsdp"],
                                                       timeout=240)))
    return runs


def _same(a, b, what, keys=KEYS):
    for key in keys:
        np.testing.assert_allclose([row[key] for row in a["rows"]], [row[key] for row in b["rows"]],
                                   rtol=RTOL, atol=1e-15, err_msg=f"{what}: {key}")
    np.testing.assert_allclose(a["weights"], b["weights"], rtol=RTOL, atol=1e-12,
                               err_msg=f"{what}: weights")


@requires_horovod
@pytest.mark.timeout(900)
def test_every_policy_the_same_under_horovod_ddp_and_one_process(engines):
    horovod, ddp, reference = engines["horovod"], engines["ddp"], engines["reference"]
    runs = sorted(r for r in horovod if "/k=" in r)
    assert len(runs) == 20 and sorted(r for r in ddp if "/k=" in r) == runs
    for run in runs:
        for rank in (0, 1):
            _same(ddp[run][rank], horovod[run][rank], f"{run} rank {rank}: DDP vs Horovod")
        assert ddp[run][0]["rows"] == ddp[run][1]["rows"], run  # the ranks agree exactly
        assert ddp[run][0]["scale"] == 2 * int(run.split("/")[1].partition("=")[2])
        if run in reference:  # every SGD policy (Adam's horizons: the engines against each other)
            _same(ddp[run][0], reference[run][0], f"{run}: DDP vs the one-process reference")
    gains = [row["gain"] for row in ddp["adascale/k=4"][0]["rows"]]
    assert 1 < min(gains[2:]) and max(gains) <= 8  # measured, not the bounds
    adam = [row["gain"] for row in ddp["adascale_adam/k=4"][0]["rows"]]
    assert max(adam) > 1.05, adam  # adascale_adam measured its gain in the runs compared
    assert len(reference) == 18
    # Two workers at k = 4: each worker's sum read once (2 samples) is another estimate than
    # every pass read (8), from the same gradients: the option reached both engines.
    for engine in (horovod, ddp):
        workers, passes = engine["adascale/k=4"][0]["rows"], engine["adascale/k=4/passes"][0]["rows"]
        assert all(a["sigma2"] != pytest.approx(b["sigma2"], rel=1e-3)
                   for a, b in zip(workers, passes)), (workers, passes)


@requires_horovod
@pytest.mark.timeout(900)
def test_every_policy_the_same_under_fsdp2(engines):
    """FSDP2 (``fully_shard``, hvd_scale.adapters.torch.fsdp) as a fourth column: every policy
    but adascale_adam (refused under FSDP2) at k = 1 and 4, with each worker's sum read once
    (the first k - 1 passes under set_requires_gradient_sync(False)) and, for adascale, every
    pass read (a reduce-scatter every pass), and clipping after the last pass: the same lr
    factor, tau, steps and weights as DDP, Horovod and the one-process reference, and for the
    measuring policies the same gain, sigma2 and mu2. FSDP2's engine always measures (a fixed
    policy's gain, sigma2 and mu2 are read-outs there, nan or 1 under DDP): those are checked
    for being measured."""
    fsdp, ddp, horovod, reference = (engines[e] for e in ("fsdp", "ddp", "horovod", "reference"))
    runs = sorted(r for r in fsdp if "/k=" in r)
    assert runs == sorted(r for r in ddp if "/k=" in r and not r.startswith("adascale_adam"))
    assert len(runs) == 17
    for run in [*runs, "clip synchronize", "clip unsynchronized"]:
        measured = run.startswith("adascale") or run.startswith("clip")
        keys = KEYS if measured else ("lr_factor", "progress", "steps")
        for rank in (0, 1):
            for other, what in ((ddp, "DDP"), (horovod, "Horovod")):
                if run in other:
                    _same(fsdp[run][rank], other[run][rank], f"{run} rank {rank}: FSDP2 vs {what}",
                          keys)
        assert fsdp[run][0]["rows"] == fsdp[run][1]["rows"], run  # the ranks agree exactly
        if run in reference:
            _same(fsdp[run][0], reference[run][0], f"{run}: FSDP2 vs the reference", keys)
        if not measured:
            assert all(1 <= row["gain"] <= fsdp[run][0]["scale"] and row["sigma2"] > 0
                       for row in fsdp[run][0]["rows"]), run
    for run in ("clip synchronize", "clip unsynchronized"):
        np.testing.assert_allclose([row["clip_norm"] for row in fsdp[run][0]["rows"]],
                                   [row["clip_norm"] for row in reference["clip"][0]["rows"]],
                                   rtol=RTOL, err_msg=f"{run}: the norm clip_grad_norm_ saw")
    workers, passes = fsdp["adascale/k=4"][0]["rows"], fsdp["adascale/k=4/passes"][0]["rows"]
    assert all(a["sigma2"] != pytest.approx(b["sigma2"], rel=1e-3)
               for a, b in zip(workers, passes))


CLIPPED = ("clip synchronize", "clip scaler")


@requires_horovod
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", [*CLIPPED, "clip unsynchronized", "clip scaler unsynchronized"])
def test_clipping_sees_the_mean_under_both_engines(engines, run):
    """clip_grad_norm_ between the last backward pass and step() at k = 2 (adascale): the
    documented idioms (``opt.synchronize()`` first; with a GradScaler ``synchronize``,
    ``unscale_``, clip, ``scaler.step``), and under DDP PyTorch's own without ``synchronize()``,
    see the mean micro-gradient's norm and give the same weights under DDP and Horovod and the
    one-process reference (the mean clipped). DDP's p.grad held k times the mean there once:
    norms 2x, a clipped step 1/k. The statistics are those of the gradients before clipping."""
    ddp, reference = engines["ddp"], engines["reference"]["clip"][0]
    norms = [row["clip_norm"] for row in reference["rows"]]
    clip = 0.5  # engines_worker.CLIP_NORM: some steps clip, some do not; at 2x every one would
    assert min(norms) < clip < max(norms) and 2 * min(norms) > clip, norms
    for rank in (0, 1):
        got = ddp[run][rank]
        assert got["scale"] == 4
        _same(got, reference, f"{run} rank {rank}: DDP vs the one-process reference")
        np.testing.assert_allclose([row["clip_norm"] for row in got["rows"]], norms, rtol=RTOL,
                                   err_msg=f"{run}: the norm clip_grad_norm_ saw under DDP")
        if run in CLIPPED:
            hvd = engines["horovod"][run][rank]
            _same(got, hvd, f"{run} rank {rank}: DDP vs Horovod")
            np.testing.assert_allclose([row["clip_norm"] for row in hvd["rows"]], norms,
                                       rtol=RTOL, err_msg=f"{run}: the norm under Horovod")
    assert ddp[run][0]["rows"] == ddp[run][1]["rows"]


@requires_horovod
@pytest.mark.timeout(900)
def test_a_checkpoint_resumes_under_the_other_engine(engines):
    """Saved after step 3 under one engine, resumed under the other (on every rank): steps 4..6
    as the run uninterrupted (tau, the estimates, the lr factor, the weights)."""
    for resumed, whole, what in (
            (engines["ddp"]["resumed"], engines["horovod"]["uninterrupted"], "DDP from Horovod's"),
            (engines["horovod"]["resumed from ddp"], engines["ddp"]["uninterrupted"],
             "Horovod from DDP's")):
        for rank in (0, 1):
            assert [row["steps"] for row in resumed[rank]["rows"]] == [4, 5, 6], what
            _same(resumed[rank], whole[rank], what)
    _same(engines["ddp"]["uninterrupted"][0], engines["horovod"]["uninterrupted"][0],
          "uninterrupted: DDP vs Horovod")
