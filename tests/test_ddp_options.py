"""Issue #49: the DDP engine (``hvd_scale.adapters.torch.ddp``) under DDP's own options, AMP,
communication hooks and torch.compile, and its refusals: one torchrun job of 2 ranks
(tests/workers/ddp_options_worker.py) runs every variant of a small adascale run in sequence.

Tolerances. The float64 runs sum the same numbers in another order (buckets, groups, graphs), so
the same statistics means relative 1e-12 (measured: <= 3e-15; a wrong n, S, scale or a bucket
counted twice or missed shows at 1e-3 or more). The float32 runs take their norms on the CPU in
float32 (``norms.py``'s fast path), whose rounding depends on the buffer (measured 2e-7 relative
on one bucket's norm between two runs of the same numbers): relative 1e-5 there. Lossy paths
(fp16/bf16 compression of the mean, autocast) have tolerances derived below from their rounding.

The ranks must agree exactly (rows and weights, ==): each takes |g_bar|^2 itself, and before this
issue's fix in ddp.py the buckets' squares were summed in the order the allreduces completed,
which differed between ranks (mu2 in the last bit, then the lr factors and the weights).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hvdrun import WORKERS_DIR, run_torchrun, worker_results

WORKER = WORKERS_DIR / "ddp_options_worker.py"
STATS = ("gain", "lr_factor", "progress", "sigma2", "mu2", "steps")
RTOL64 = 1e-12
RTOL32 = 1e-5
FP16_EPS, BF16_EPS = 2.0 ** -11, 2.0 ** -8  # unit roundoff (half an ulp at 1)


@pytest.fixture(scope="module")
def results():
    """{case: {rank: result}} of the one job (about 10 s of CPU per rank, most of it imports and
    torch.compile)."""
    out = {}
    for r in worker_results(run_torchrun([str(WORKER)], nproc=2, timeout=240)):
        out.setdefault(r["case"], {})[r["rank"]] = r
    return out


def both(results, case):
    got = results[case]
    assert sorted(got) == [0, 1], f"{case}: ranks {sorted(got)}"
    return got[0], got[1]


def ranks_agree(results, case):
    r0, r1 = both(results, case)
    assert "error" not in r0, r0.get("error")
    assert r0["rows"] == r1["rows"], f"{case}: the ranks' statistics differ"
    assert r0["weights"] == r1["weights"], f"{case}: the ranks' weights differ"
    return r0


def same(got, want, what, rtol, keys=STATS, weights_atol=1e-12, gbar2_factor=1.0):
    assert len(got["rows"]) == len(want["rows"]), what
    for key in keys:
        np.testing.assert_allclose([row[key] for row in got["rows"]],
                                   [row[key] for row in want["rows"]], rtol=rtol, atol=0,
                                   err_msg=f"{what}: {key}")
    if gbar2_factor is not None:  # |p.grad|^2 after the last backward pass: the mean's
        np.testing.assert_allclose([row["gbar2"] for row in got["rows"]],
                                   [gbar2_factor * row["gbar2"] for row in want["rows"]],
                                   rtol=rtol, atol=0, err_msg=f"{what}: |g_bar|^2")
    np.testing.assert_allclose(got["weights"], want["weights"], rtol=0, atol=weights_atol,
                               err_msg=f"{what}: weights")


# -- the same statistics as the default run ------------------------------------------------------
@pytest.mark.timeout(300)
def test_the_default_run_is_the_one_process_truth(results):
    default = ranks_agree(results, "default")
    same(default, results["reference"][0], "default DDP vs one process", RTOL64)
    gains = [row["gain"] for row in default["rows"]]
    # measured, not a bound (S = 2; adascale's warm-in holds the first steps' toward 1)
    assert 1.01 < min(gains) and max(gains) < 1.9, gains
    assert default["scale"] == 2.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["gradient_as_bucket_view", "static_graph", "find_unused_all_used",
                                  "tiny_buckets", "tiny_buckets_view_static", "groups_same_lr",
                                  "groups_same_lr_tiny", "compiled"])
def test_an_option_gives_the_default_runs_statistics(results, case):
    """DDP's options change where and when the gradients are averaged, not what: every row and
    the weights as the default run's (float64, 1e-12), every rank the same."""
    r0, _ = both(results, case)
    if case == "compiled" and "error" in r0:
        _skip_if_compiler_unavailable(r0["error"])
    same(ranks_agree(results, case), ranks_agree(results, "default"), f"{case} vs default",
         RTOL64)


def _skip_if_compiler_unavailable(error):
    """torch.compile cannot run here (no compiler toolchain, an unsupported platform): skipped,
    saying so; any other error is a failure."""
    kinds = ("BackendCompilerFailed", "InductorError", "CppCompileError", "InvalidCxxCompiler")
    if error.split(":", 1)[0] in kinds:
        pytest.skip(f"torch.compile cannot run on this machine: {error[:300]}")
    pytest.fail(f"torch.compile(ddp_model): {error}")


@pytest.mark.timeout(300)
def test_tiny_buckets_are_rebuilt_after_the_first_iteration(results):
    """With bucket_cap_mb tiny DDP builds one bucket of 1 MB first (its first-bucket cap) and,
    after the first iteration (static_graph: the second), rebuilds them in gradient order, one
    parameter each: the statistics above were taken over both layouts."""
    one = [[0, 6]]
    six = [[i, 1] for i in range(6)]
    assert both(results, "default")[0]["buckets"] == [one] * 6
    for case, first in (("tiny_buckets", 1), ("tiny_buckets_view_static", 2)):
        for r in both(results, case):
            assert r["buckets"] == [one] * first + [six] * (6 - first), (case, r["buckets"])


# -- against the one-process truth -----------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,truth,k", [
    ("groups_two_lrs", "reference_two_lrs", 1),
    ("k2", "reference_k2", 2),
    ("k2_tiny_view", "reference_k2", 2),
    ("compiled_k2", "reference_k2", 2),
    ("unused", "reference_unused", 1),
    ("unused_tiny", "reference_unused", 1),
    ("unused_k2", "reference_unused_k2", 2),
])
def test_a_variant_is_the_one_process_truth(results, case, truth, k):
    """Two groups at different lrs (one gain, each group's own lr), k = 2 under no_sync
    (bucketed, view, compiled), and a head some ranks leave unused in some steps
    (find_unused_parameters=True: DDP gives it zeros where unused; globally unused it keeps no
    gradient and SGD leaves it): the statistics and weights of the one-process computation, and
    p.grad the mean micro-gradient as the last backward pass returns (it held k times the mean
    there once, and clipping between it and step() clipped that)."""
    r0, _ = both(results, case)
    if case.startswith("compiled") and "error" in r0:
        _skip_if_compiler_unavailable(r0["error"])
    got = ranks_agree(results, case)
    assert got["scale"] == 2 * k
    same(got, results[truth][0], f"{case} vs {truth}", RTOL64)
    if case == "groups_two_lrs":  # the second lr was applied: not the one-lr run
        assert max(abs(a - b) for a, b in zip(got["weights"],
                                               both(results, "groups_same_lr")[0]["weights"])) > 1e-3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["adam_tiny_view", "adam_groups"])
def test_adascale_adam_preconditioned_statistics_under_ddp_options(results, case):
    """adascale_adam (AdamW): the preconditioned norms taken per parameter in each bucket (tiny
    buckets, bucket views, two groups) give the default run's gains; measured from step 21 on."""
    default = ranks_agree(results, "adam_default")
    gains = [row["gain"] for row in default["rows"]]
    assert gains[:20] == [1.0] * 20 and min(gains[20:]) > 1.01, gains  # (held by the warm-in)
    got = ranks_agree(results, case)
    for key in STATS:
        np.testing.assert_allclose([row[key] for row in got["rows"]],
                                   [row[key] for row in default["rows"]], rtol=RTOL64, atol=0,
                                   equal_nan=True, err_msg=f"{case}: {key}")
    np.testing.assert_allclose(got["weights"], default["weights"], rtol=0, atol=1e-12)


# -- communication hooks ----------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,eps", [("fp16_hook", FP16_EPS), ("bf16_hook", BF16_EPS)])
def test_a_compression_hook_composes(results, case, eps):
    """fp16/bf16_compress_hook: each rank's gradient is rounded to half precision, halved
    (exact) and summed in half precision: two roundings, so each element of the mean is off by
    at most delta = 2 eps relative and |g_bar|^2 by 2 delta. The local norms are exact, so with
    n = 2 sigma2_hat = s - 2q and mu2_hat = 2q - s/2 are off by at most 2 x 2 delta |g_bar|^2
    a step, as are their EMAs (weighted means of those); the gain's relative error is bounded by
    the sum of sigma2's and mu2's. (The weights move apart a little too: the bound's factor 2
    covers it, measured errors are 10-20x below it.)"""
    r0, _ = both(results, case)
    got, default = ranks_agree(results, case), ranks_agree(results, "default")
    delta = 2 * eps
    ref_q = np.array([row["gbar2"] for row in default["rows"]])
    q = np.array([row["gbar2"] for row in got["rows"]])
    np.testing.assert_allclose(q, ref_q, rtol=2 * delta, err_msg=f"{case}: |g_bar|^2")
    bound = 2 * 2 * delta * ref_q.max()
    for key in ("sigma2", "mu2"):
        np.testing.assert_allclose([row[key] for row in got["rows"]],
                                   [row[key] for row in default["rows"]], rtol=0, atol=2 * bound,
                                   err_msg=f"{case}: {key}")
    gain_rtol = 2 * bound * (1 / min(row["sigma2"] for row in default["rows"])
                             + 1 / min(row["mu2"] for row in default["rows"]))
    np.testing.assert_allclose([row["gain"] for row in got["rows"]],
                               [row["gain"] for row in default["rows"]], rtol=gain_rtol)
    # The hook ran, every step: the mean was rounded (not bit-equal), the weights moved apart.
    assert np.any(q != ref_q)
    assert 0 < max(abs(a - b) for a, b in zip(got["weights"], default["weights"])) < 1e-2
    if case == "fp16_hook":
        assert r0["buckets"] == [[[0, 6]]] * 6


@pytest.mark.timeout(300)
def test_powersgd_is_refused_under_a_measuring_policy_with_the_evidence(results):
    """PowerSGD returns a low-rank approximation of the mean (plus the error fed back), not
    g_bar. The evidence (PowerSGD on DDP alone, rank 1, start_powerSGD_iter=2, the exact mean
    from an allreduce of each rank's own gradient at the same weights): the first two steps
    (vanilla allreduce) exact, from the third on the approximation is 30%-100%+ away from g_bar
    and |.|^2 off by up to 2x: sigma2 and mu2 would be of the approximation. So a measuring
    policy refuses it, on every rank, naming why; an unmeasured one composes with it."""
    for r in both(results, "powersgd"):
        for hook in ("powerSGD_hook", "batched_powerSGD_hook"):
            error = r["refused"][hook]
            assert error is not None and error.startswith("ValueError: hvd_scale: PowerSGD"), error
            assert "policy adascale" in error and "low-rank approximation" in error
            assert "policy='linear'" in error and "fp16_compress_hook" in error
        assert r["linear_error"] is None and r["linear_steps"] == [3], r["linear_error"]
        rows = r["rows"]
        assert all(row["rel_error"] < 1e-12 for row in rows[:2]), rows[:2]
        assert all(row["rel_error"] > 0.3 for row in rows[2:]), rows
        ratios = [row["approx_gbar2"] / row["exact_gbar2"] for row in rows[2:]]
        assert max(abs(math.log(x)) for x in ratios) > math.log(1.5), ratios


# -- AMP ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scaled,unscaled", [("f32_fp16_scaled", "f32_fp16"),
                                             ("f32_fp16_scaled_k2", "f32_fp16_k2")])
def test_a_grad_scaler_gives_the_unscaled_statistics(results, scaled, unscaled):
    """torch.amp.GradScaler("cpu") at 2^10 with fp16 autocast, the documented loop (scale,
    backward, scaler.step(opt), update; grad_scaler=scaler): the statistics of the same fp16
    autocast run without a scaler. A power of 2 scales fp16 gradients exactly except those
    subnormal unscaled (< 6e-5): float32's tolerance, 1e-5 (measured <= 1.5e-5 on |g_bar|^2 at
    k = 2, where the unscaled run's fp16 gradients of two passes lose more)."""
    got, want = ranks_agree(results, scaled), ranks_agree(results, unscaled)
    k = 2 if scaled.endswith("k2") else 1
    rtol = RTOL32 if k == 1 else 1e-4
    same(got, want, f"{scaled} vs {unscaled}", rtol, weights_atol=1e-4)
    assert got["scale"] == 2 * k and all(row["skipped"] == 0 for row in got["rows"])


@pytest.mark.timeout(300)
def test_autocast_stays_close_to_float32(results):
    """fp16 (and bf16) autocast against float32: the forward and backward in half precision
    (~eps per element; mu2 is a difference, 4x more sensitive). fp16: 5e-3 (measured <= 1e-3 on
    mu2); bf16 (8x coarser): 4e-2 (measured 1.1e-2 on mu2). Both really autocast: the weights
    differ from float32's."""
    f32 = ranks_agree(results, "f32")
    for case, rtol in (("f32_fp16", 5e-3), ("f32_bf16", 4e-2)):
        got = ranks_agree(results, case)
        same(got, f32, f"{case} vs float32", rtol, keys=("gain", "sigma2", "mu2", "progress"),
             weights_atol=rtol)
        assert max(abs(a - b) for a, b in zip(got["weights"], f32["weights"])) > 1e-6, case


@pytest.mark.timeout(300)
def test_a_grad_scaler_overflow_is_skipped_and_counted(results):
    """GradScaler at 2^40 (fp16 overflows: inf gradients), one backoff to 2^10: scaler.step
    skips opt.step() and counts it there (opt.skipped, #58 item 7: it was counted at the next
    backward's first bucket), nothing was applied, and the run then is the scaled run's (the
    first batch taken again)."""
    got = ranks_agree(results, "f32_fp16_overflow")
    rows = got["rows"]
    assert got["first_moved"] is False  # the weights after the overflow step: untouched
    assert [(row["steps"], row["skipped"]) for row in rows] == [(i, 1) for i in range(7)]
    assert rows[0]["gbar2"] is None  # the overflow's gradients were not finite
    assert all(math.isfinite(row["gain"]) for row in rows)
    scaled = ranks_agree(results, "f32_fp16_scaled")
    same({**got, "rows": rows[1:]}, scaled, "after the overflow vs the scaled run", RTOL32,
         weights_atol=1e-6)


@pytest.mark.timeout(300)
def test_a_grad_scaler_overflow_after_synchronize_is_skipped_and_counted(results):
    """Horovod's AMP idiom under DDP (scale, backward, ``opt.synchronize()``,
    ``scaler.unscale_(opt)``, ``scaler.step(opt)``): the overflow's statistics, finished at its
    backward pass, are dropped and counted skipped at the next; no step is averaged twice (the
    run is the documented loop's, row for row and weight for weight)."""
    got = ranks_agree(results, "f32_fp16_overflow_synchronized")
    assert got["first_moved"] is False
    want = ranks_agree(results, "f32_fp16_overflow")
    assert [(row["steps"], row["skipped"]) for row in got["rows"]] == \
        [(row["steps"], row["skipped"]) for row in want["rows"]]
    same({**got, "rows": got["rows"][1:]}, {**want, "rows": want["rows"][1:]},
         "synchronized vs the documented loop", RTOL32, weights_atol=1e-6)


# -- a short step, the refusals --------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_short_step_counts_its_own_passes(results):
    """k = 2, rank 1 takes 1 pass (its last batch), rank 0 both: n = 3 micro-gradients, a step at
    its own scale 4 x 3 / 4, the update -lr x gain x the mean of the 3 (as Horovod's short step,
    tests/test_training_paths.py)."""
    r0, r1 = both(results, "short")
    assert r0 == {**r1, "rank": 0}
    assert r0["n"] == 3 and r0["scale"] == 4.0  # S stays workers x k
    assert r0["progress"] == pytest.approx(r0["ref_gain"], rel=1e-12) and r0["progress"] <= 3
    assert r0["lr_factor"] == r0["progress"]
    assert r0["sigma2"] == pytest.approx(r0["ref_sigma2"], rel=1e-9)
    assert r0["mu2"] == pytest.approx(r0["ref_mu2"], rel=1e-9)
    assert r0["max_weight_diff"] < 1e-12


REFUSALS = {
    "not_ddp": ("TypeError: model must be a torch.nn.parallel.DistributedDataParallel",
                "got Net"),
    "fsdp2": ("ValueError: hvd_scale's DDP engine takes a DistributedDataParallel model",
              "hvd_scale.adapters.torch.fsdp.DistributedOptimizer(optimizer, model"),
    "fsdp1_by_name": ("ValueError: hvd_scale's DDP engine", "FSDP1", "not supported"),
    "hook_registered": ("ValueError: hvd_scale: this DDP model has a communication hook already",
                        "comm_hook=hook"),
    "stray_parameter": ("ValueError: hvd_scale: the optimizer must train exactly",
                        "1 of the optimizer's are not averaged by it (shapes [(5, 2)])"),
    "unheld_parameter": ("ValueError: hvd_scale: the optimizer must train exactly",
                         "4 it averages are not in the optimizer"),
    "two_synchronizing": ("RuntimeError: hvd_scale: a second synchronizing backward pass",
                          "model.no_sync()", "backward_passes_per_step=2"),
    "no_synchronizing": ("RuntimeError: hvd_scale: opt.step() without a synchronizing backward",
                         "outside model.no_sync()"),
    "join": ("RuntimeError: hvd_scale: DDP's Join context", "drop_last=True"),
    "static_graph_no_sync": ("ValueError: hvd_scale: DDP's static_graph=True",
                             "backward_passes_per_step=2", "expect_autograd_hooks_",
                             "with or without hvd_scale"),
    "static_graph_adapt": ("ValueError: hvd_scale: DDP's static_graph=True", "adapt='goodput'"),
    "static_graph_set_passes": ("ValueError: hvd_scale: DDP's static_graph=True",
                                "set_passes(2)"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("what", sorted(REFUSALS))
def test_refused_on_every_rank_with_its_message(results, what):
    """A model that is not DDP, FSDP2 (fully_shard, built on Gloo here) and a class named as
    FSDP1 (FSDP1 needs an accelerator), a hook registered before wrapping, an optimizer over
    parameters DDP does not average (or missing some), two synchronizing passes at k = 2, a step
    with none, DDP's Join context, DDP's static_graph=True with accumulation under no_sync()
    (k > 1 from the start, by adapt='goodput' or set_passes(); PyTorch's reducer fails an
    internal assertion there, hvd_scale or not): the same error on both ranks, and both go on to
    the next collective (no hang)."""
    r0, r1 = both(results, "refusals")
    assert r0[what] == r1[what]
    if what == "static_graph_set_passes":  # refused before anything was applied
        assert r0["static_graph_left"] == [1, 2.0], r0["static_graph_left"]
    if what == "fsdp2" and r0[what].startswith("could not build FSDP2"):
        pytest.skip(r0[what])
    for part in REFUSALS[what]:
        assert part in r0[what], (what, r0[what])
    assert r0["alive"] == r1["alive"] == 2
