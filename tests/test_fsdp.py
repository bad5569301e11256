"""FSDP2's engine (``hvd_scale.adapters.torch.fsdp``) under real torchrun jobs: a float64 MLP
sharded with ``fully_shard`` on a CPU mesh with Gloo (2 processes; HSDP: 4, 2 replicas x 2
shards), against the one-process reference replayed in each rank (tests/workers/fsdp_worker.py).

Per step: the gain, lr factor and tau, the statistics vector the policy got ([s..., c, w, q...]:
each worker's local norms read from the reduce-scatter input, |g_bar|^2 summed from the shards)
and the weights after, relative 1e-9 (float64; a wrong n, S, pre-divide or layout shows at 1e-3
or more), at k = 1 and 4 in both accumulation modes, adascale and linear, one and two optimizer
groups. Mixed precision (float32 model, fp16 and bf16 reduce) within the reduce dtype's rounding.
The statistics cost one all_reduce a step. Refusals say why, on every rank.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from hvdrun import WORKERS_DIR, run_torchrun, worker_results

WORKER = WORKERS_DIR / "fsdp_worker.py"
RTOL = 1e-9
KEYS = ("gain", "lr_factor", "progress", "steps")


def _by_run(results):
    out = {}
    for r in results:
        out.setdefault(r["run"], {})[r["rank"]] = r
    return out


@pytest.fixture(scope="module")
def fsdp():
    return _by_run(worker_results(run_torchrun([str(WORKER)], nproc=2, timeout=600)))


@pytest.fixture(scope="module")
def hsdp():
    return _by_run(worker_results(run_torchrun([str(WORKER), "--layout", "hsdp"], nproc=4,
                                                 timeout=600)))


@pytest.fixture(scope="module")
def alone():
    return _by_run(worker_results(run_torchrun([str(WORKER), "--layout", "alone"], nproc=1,
                                               timeout=300)))


def _same_as_reference(got, what):
    ref = got["reference"]
    for key in KEYS:
        np.testing.assert_allclose([r[key] for r in got["rows"]], [r[key] for r in ref["rows"]],
                                   rtol=RTOL, atol=1e-15, err_msg=f"{what}: {key}")
    np.testing.assert_allclose(got["vectors"], ref["vectors"], rtol=RTOL, atol=1e-15,
                               err_msg=f"{what}: the step vectors [s..., c, w, q...]")
    np.testing.assert_allclose(got["weights"], ref["weights"], rtol=RTOL, atol=1e-12,
                               err_msg=f"{what}: weights")


def test_the_private_import_is_pinned():
    """The engine leans on torch's private FSDP2 modules: a torch that moves them fails here."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    import torch
    from hvd_scale.adapters.torch import fsdp
    assert fsdp.ReduceScatter is ReduceScatter
    assert fsdp._get_gradient_divide_factors is _get_gradient_divide_factors
    # FSDP2's rule the statistics undo: float64 and fp16 pre-divide by ~sqrt(W), fp32/bf16 not.
    assert _get_gradient_divide_factors(None, None, torch.float32)[0] is None
    assert torch.__version__.startswith("2.13"), "check fsdp.py's private imports on a new torch"


def test_fsdp1_is_refused_for_fsdp2():
    """FSDP1 needs an accelerator to be built (none here): its class is enough to be refused,
    with the way to FSDP2's engine."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from hvd_scale.adapters.torch import fsdp
    with pytest.raises(ValueError, match="FSDP1.*fully_shard.*fsdp.DistributedOptimizer"):
        fsdp.check_model(FullyShardedDataParallel.__new__(FullyShardedDataParallel))


@pytest.mark.timeout(900)
def test_every_run_matches_the_one_process_reference(fsdp):
    runs = sorted(r for r in fsdp if "/k=" in r)
    assert len(runs) == 13, runs
    for run in runs:
        for rank in (0, 1):
            _same_as_reference(fsdp[run][rank], f"{run} rank {rank}")
        assert fsdp[run][0]["rows"] == fsdp[run][1]["rows"], run  # the ranks agree exactly
        assert fsdp[run][0]["scale"] == 2 * int(run.split("/")[1].partition("=")[2])
    gains = [row["gain"] for row in fsdp["adascale/k=4/workers"][0]["rows"]]
    assert 1 < min(gains[1:]) and max(gains) <= 8, gains  # measured, not the bounds
    # The two accumulation modes read other samples from the same gradients: 2 a step
    # (each worker's sum) against 8 (every pass).
    workers = fsdp["adascale/k=4/workers"][0]["vectors"]
    passes = fsdp["adascale/k=4/passes"][0]["vectors"]
    assert {v[1:3] == [8.0, 2.0] for v in workers} == {True}
    assert {v[1:3] == [8.0, 8.0] for v in passes} == {True}
    assert all(a[0] != pytest.approx(b[0], rel=1e-3) for a, b in zip(workers, passes))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["checkpointed", "compiled"])
def test_activation_checkpointing_and_compiled_blocks(fsdp, variant):
    """A block under non-reentrant activation checkpointing, or each block compiled
    (``module.compile``, aot_eager: no C compiler needed) before sharding, at k = 2: the same
    steps as the reference (checked with every run above), and as the plain model's."""
    got = fsdp[f"adascale/k=2/workers/{variant}"][0]
    plain = fsdp["adascale/k=2/workers/clipped"][0]
    np.testing.assert_allclose(got["vectors"], plain["vectors"], rtol=RTOL)
    assert len(got["rows"]) == 6 and got["rows"][-1]["gain"] > 1


@pytest.mark.timeout(900)
def test_p_grad_is_the_mean_micro_gradient_after_backward(fsdp):
    """Between the last backward pass and ``step()`` (where clipping runs), p.grad's squared norm
    over all shards is |g_bar|^2 of the mean micro-gradient (k = 2), not k^2 times it."""
    got = fsdp["adascale/k=2/workers/clipped"][0]
    q = [v[3] for v in got["reference"]["vectors"]]
    np.testing.assert_allclose(got["seen"], q, rtol=RTOL)


@pytest.mark.timeout(900)
def test_a_short_step_counts_the_passes_taken(fsdp):
    """k = 3, every rank takes two passes (samples="workers"): n = 4, the step at S = 4 (the
    readout's S stays W k), each rank's sum read once, p.grad the mean of the 4
    micro-gradients; the same by hand. (Ranks cannot take different passes under FSDP2: each
    forward all-gathers.)"""
    for rank in (0, 1):
        got = fsdp["short"][rank]
        ref = got["reference"]
        np.testing.assert_allclose(got["vectors"], ref["vectors"], rtol=RTOL)
        assert got["vectors"][0][1:3] == [4.0, 2.0] and got["scale"] == 6.0  # S stays W k
        assert got["gain"] == pytest.approx(ref["gain"], rel=RTOL)
        np.testing.assert_allclose(got["weights"], ref["weights"], rtol=RTOL, atol=1e-12)


@pytest.mark.timeout(900)
def test_a_users_own_reduce_scatter_is_wrapped(fsdp):
    """A comm set with set_custom_reduce_scatter before the optimizer still reduces (3 steps x 1
    reduce-scatter a unit) under hvd_scale's measuring one; one set after is refused at the
    step on every rank."""
    for rank in (0, 1):
        got = fsdp["user comm"][rank]
        # unit 0 also reduced in the refused 4th step (refused at that pass's end, unapplied)
        assert got["calls"] == [4, 3]
        np.testing.assert_allclose(got["vectors"], got["reference"]["vectors"], rtol=RTOL)
        assert "is no longer hvd_scale's" in got["replaced"], got["replaced"]


@pytest.mark.timeout(600)
def test_one_process_mesh(alone):
    """A mesh of one (resuming a job at W = 1): FSDP2 runs no reduce-scatter there, and its
    all-reduce hook is read instead; every pass read (k = 4), as the reference."""
    for run in ("adascale/k=1/passes", "adascale/k=4/passes"):
        _same_as_reference(alone[run][0], f"one process {run}")
    assert alone["adascale/k=4/passes"][0]["scale"] == 4.0


@pytest.mark.timeout(900)
def test_two_parameter_groups_map_the_flat_buffer(fsdp):
    """Weights and biases in two optimizer groups: each group's s and q from its own regions of
    the units' reduce-scatter inputs and shards (padded: a 3-row weight over 2 ranks)."""
    for mode in ("workers", "passes"):
        got = fsdp[f"adascale/k=4/{mode}/groups"][0]
        assert len(got["vectors"][0]) == 6
        assert min(v[1] for v in got["vectors"]) > 0 and min(v[5] for v in got["vectors"]) > 0
        one = fsdp[f"adascale/k=4/{mode}"][0]
        # The same gradients as one group: the totals agree.
        np.testing.assert_allclose([v[0] + v[1] for v in got["vectors"]],
                                   [v[0] for v in one["vectors"]], rtol=RTOL)


@pytest.mark.timeout(900)
def test_one_allreduce_a_step_beside_fsdp2s_collectives(fsdp):
    """6 steps at k = 4: 6 all_reduce calls (the statistics), whatever FSDP2 does; its
    reduce-scatters go through the wrapped comm (counted: 2 units x 1 or x 4 passes)."""
    for mode in ("workers", "passes"):
        calls = fsdp[f"adascale/k=4/{mode}"][0]["collectives"]
        assert calls["all_reduce"] == 6, (mode, calls)
        assert calls["broadcast"] == 0 and calls["all_gather"] == 0, (mode, calls)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype, rtol", [("float16", 5e-3), ("bfloat16", 3e-2)])
def test_mixed_precision_undoes_fsdp2s_divides(fsdp, dtype, rtol):
    """A float32 model reduced in fp16 (FSDP2 pre-divides by 2 at W = 2: the squares 4x off if
    not undone) or bf16 (no divide): s and q as the float64 reference's, to the reduce dtype's
    rounding."""
    got = fsdp[f"mixed/{dtype}"][0]
    ref = got["reference"]["vectors"]
    np.testing.assert_allclose(got["vectors"], ref, rtol=rtol)


@pytest.mark.timeout(900)
def test_hsdp_two_replicas_by_two_shards(hsdp):
    runs = sorted(r for r in hsdp if "/k=" in r)
    assert len(runs) == 4, runs
    for run in runs:
        for rank in range(4):
            _same_as_reference(hsdp[run][rank], f"HSDP {run} rank {rank}")
        assert hsdp[run][0]["scale"] == 4 * int(run.split("/")[1].partition("=")[2])
    calls = hsdp["adascale/k=4/workers"][0]["collectives"]
    # FSDP2's replica all-reduce per unit (2) and the statistics' one, a step.
    assert calls["all_reduce"] == 6 * (2 + 1), calls


REFUSED = {
    "divide factor": "gradient divide factor of 4.0",
    "adascale_adam": "Adam-preconditioned",
    "grad_scaler": "GradScaler",
    "measure=False": "measure=False under FSDP2",
    "not sharded": "fully_shard",
    "workers, reduced every pass": "reduce-scattered again",
    "passes, accumulated": "accumulated without reduction",
}


@pytest.mark.timeout(900)
def test_refusals_say_why_on_every_rank(fsdp):
    for rank in (0, 1):
        refused = fsdp["refusals"][rank]["refused"]
        for case, words in REFUSED.items():
            assert words in refused[case], (rank, case, refused[case])
