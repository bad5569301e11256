"""The torch adapter under real `horovodrun -np 2` (Gloo): one job runs every case, tests check it."""

import math
import sys

import pytest

from adapt_checks import check_adapt_goodput, check_passes_change
from hvdrun import (WORKERS_DIR, demux_output, per_rank, requires_horovod, run_cases, run_horovod,
                    worker_results)

pytestmark = [requires_horovod]
NP = 2
LR = 0.05


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # One horovodrun job runs every case; then one process resumes its checkpoint, 2 passes a step.
    return run_cases(WORKERS_DIR / "torch_adapter_worker.py", NP, timeout=240,
                     test_dir=tmp_path_factory.mktemp("torch_adapter"), single=["resume_np1", "one_process"])


def both_ranks(results, case):
    return tuple(per_rank(results, case, NP))


def close(a, b, rel=1e-5, abs_=1e-9):
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,scale", [("reference_k1_sum", 2), ("reference_k2_sum", 4),
                                        ("reference_k2_mean", 4)])
def test_statistics_match_one_process_reference(results, case, scale):
    r0, r1 = both_ranks(results, case)
    assert r0["scale"] == scale
    for row0, row1 in zip(r0["rows"], r1["rows"]):
        # Identical on both ranks (the same numbers reach every rank's engine).
        assert row0["gain"] == row1["gain"] and row0["progress"] == row1["progress"]
        assert 1.0 <= row0["gain"] <= scale
        # The gain equals the single-process reference from the same micro-batches.
        assert close(row0["gain"], row0["ref_gain"]), row0
        # Statistics are in units of the user's micro-gradients, whose mean is applied: with
        # loss / k they are k times smaller, so sigma2 and mu2 are 1/k^2 the reference's.
        k2 = 1 / (scale // NP) ** 2 if case.endswith("_mean") else 1
        assert close(row0["sigma2"], k2 * row0["ref_sigma2"]) and close(row0["mu2"], k2 * row0["ref_mu2"]), row0
        # The update is -lr x gain x mean micro-gradient (plain SGD), per group lr.
        assert row0["max_param_diff"] < 1e-6, row0
        # The user's lr is restored after every step.
        assert row0["lrs_after"] == [LR, LR / 2]
    # progress = sum of gains
    assert close(r0["rows"][-1]["progress"], sum(row["gain"] for row in r0["rows"]))


@pytest.mark.timeout(300)
def test_loss_convention_does_not_change_the_gain(results):
    """hvd_scale applies the mean micro-gradient (as Keras does): with loss / k the micro-gradients
    are k times smaller, and so are the update (checked against the reference in the test above)
    and the statistics (by k^2); the gain, a ratio, is the same."""
    mean, _ = both_ranks(results, "reference_k2_mean")
    informative = [row for row in mean["rows"] if row["ref_mu2"] > 0]
    assert len(informative) >= 2, "need steps where mu2 is not clipped to 0"
    for row in informative:
        assert close(row["gain"], row["ref_gain"], rel=1e-6), row
        assert 1 < row["gain"] < 4
        assert close(row["sigma2"], row["ref_sigma2"] / 4, rel=1e-6), row
        assert close(row["mu2"], row["ref_mu2"] / 4, rel=1e-6), row


@pytest.mark.timeout(300)
def test_each_policy_applies_its_factor(results):
    r0, r1 = both_ranks(results, "policies")
    s = r0["scale"]
    assert s == NP
    pol = r0["policies"]
    expected = {"none": [1, 1, 1], "linear": [s] * 3, "sqrt": [math.sqrt(s)] * 3,
                "warmup:baseline_steps=4": [1, 1 + (s - 1) / 2, s],
                # the practitioners' rules: S^alpha, a hand-tuned factor, sqrt after a ramp,
                # LEGW (sqrt(S) x min(1, tau / (S x 2)), tau counted after the step)
                "power:alpha=0.7": [s ** 0.7] * 3, "fixed:factor=3": [3] * 3,
                "warmup:rule=sqrt,baseline_steps=4": [1, 1 + (math.sqrt(s) - 1) / 2, math.sqrt(s)],
                "legw:steps=2": [math.sqrt(s) * min(1, (t + s) / (2 * s)) for t in (0, s, 2 * s)]}
    for spec, factors in expected.items():
        assert [round(f, 6) for f in pol[spec]["factors"]] == pytest.approx(factors, rel=1e-6), spec
        assert pol[spec]["lrs"] == [LR] * 3, spec
        assert pol[spec]["progress"] == pytest.approx(3 * s), spec
    ada = pol["adascale"]
    assert 1 <= ada["gain"] <= s
    assert ada["factors"][-1] == pytest.approx(ada["gain"], rel=1e-6)
    assert r1["policies"] == pol


@pytest.mark.timeout(300)
def test_checkpoint_resume_reproduces_the_run(results):
    r0, r1 = both_ranks(results, "checkpoint")
    assert r0["resumed"] == pytest.approx(r0["full"], rel=1e-12, abs=1e-12)
    assert r0["resumed_progress"] == pytest.approx(r0["full_progress"], rel=1e-12)
    # StepLR(step_size=3, gamma=0.5) ran in tau: the lr has decayed by 0.5 ** floor(tau / 3).
    tau = r0["full_progress"]
    assert r0["lr"] == pytest.approx(LR * 0.5 ** (math.floor(tau) // 3))
    assert r1["resumed"] == r0["resumed"]


@pytest.mark.timeout(300)
def test_amp_overflow_skips_everything_and_stats_are_unscaled(results):
    for r in both_ranks(results, "amp"):
        rows = r["rows"]
        assert rows[2]["moved"] == 0.0, "the overflowing step must not move the weights"
        assert rows[2]["progress"] == rows[1]["progress"], "nor advance tau"
        assert all(row["moved"] > 0 for i, row in enumerate(rows) if i != 2)
        assert r["skipped"] == 1
        # The skipped step left the statistics alone: the run equals one that never saw it,
        # and the statistics are those of unscaled gradients.
        for row in rows:
            assert close(row["sigma2"], row["plain_sigma2"], rel=1e-4), row


@pytest.mark.timeout(300)
def test_nonfinite_gradient_is_skipped_on_every_rank(results):
    r0, r1 = both_ranks(results, "nonfinite")
    for r in (r0, r1):
        assert r["skipped"] == 1
        assert r["rows"][1]["moved"] == 0.0
        assert r["rows"][1]["progress"] == r["rows"][0]["progress"]
        assert r["rows"][2]["progress"] > r["rows"][1]["progress"]


@pytest.mark.timeout(300)
def test_unused_parameter(results):
    r0, r1 = both_ranks(results, "unused")
    assert r0["extra_unchanged"] and r1["extra_unchanged"]
    assert 1 <= r0["gain"] <= NP and r0["gain"] == r1["gain"]
    assert r0["progress"] == r1["progress"] > 0


@pytest.mark.timeout(300)
def test_statistics_over_many_tensors_sent_in_buckets(results):
    """Without accumulation the norms are taken a bucket at a time as Horovod sends the
    gradients (adapters/torch/horovod.py BUCKET_TENSORS, BUCKET_ELEMENTS): several buckets, one full
    by its size, and an unused layer whose bucket only goes out at synchronize()."""
    r0, r1 = both_ranks(results, "many_tensors")
    assert r0["tensors"] == 50 and r0["rows"] == r1["rows"]  # 48 used, 2 in the unused layer
    for row in r0["rows"]:
        assert close(row["gain"], row["ref_gain"], rel=1e-9), row
        assert close(row["sigma2"], row["ref_sigma2"], rel=1e-9) and close(row["mu2"], row["ref_mu2"], rel=1e-9)
        assert row["max_param_diff"] < 1e-9, row


@pytest.mark.timeout(300)
def test_bad_policy_and_optimizer_error_on_every_rank(results):
    for r in both_ranks(results, "bad_policy"):
        assert r["error"] and "'smooth'" in r["error"] and "smoothing" in r["error"]
    for r in both_ranks(results, "bad_optimizer"):
        assert r["error"] and "'Adam'" in r["error"] and "adascale_adam" in r["error"]


@pytest.mark.timeout(300)
def test_adascale_adam_uses_sqrt_gain(results):
    r0, r1 = both_ranks(results, "adam")
    assert r0["rows"] == r1["rows"]
    rows = r0["rows"]
    for row in rows:
        assert 1 <= row["gain"] <= NP
        assert row["lr_factor"] == pytest.approx(math.sqrt(row["gain"]), rel=1e-12)
    assert rows[-1]["progress"] == pytest.approx(sum(row["gain"] for row in rows))
    # No statistics before Adam's second moment has history: gain 1, one baseline step each.
    warm = r0["history"]
    assert [row["progress"] for row in rows[:warm]] == [float(i + 1) for i in range(warm)]
    assert all(math.isnan(row["sigma2"]) for row in rows[:warm])
    assert max(row["gain"] for row in rows[warm:]) > 1.0
    # Then the statistics are of g / (sqrt(v_hat) + eps): of order 1 per coordinate, far above
    # the raw gradients' (plain adascale on the same model and data).
    assert rows[-1]["sigma2"] > 100 * r0["plain_sigma2"]
    assert r0["lr"] == 1e-3
    assert r0["precondition_exact"] and r0["grad_untouched"]
    assert r0["tensors"] >= 2 and r0["batched_error"] < 1e-5, r0["batched_error"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["Adam", "AdamW", "capped", "power"])
def test_adam_moment_horizons_follow_the_gain(results, kind):
    """adascale_adam's default against a one-process reference applying the rule by hand: betas^r,
    eps / sqrt(r), bias correction 1 - beta^tau, AdamW's decay (1 - lr wd)^r per step, lr x
    sqrt(r). "capped": max_gain=1.5 below the gains measured at S = 4, so the cap binds: the
    capped r is the one applied everywhere (lr, tau, betas). "power" (lr_power=0.75): lr x
    r^0.75."""
    r0, r1 = (r[kind] for r in both_ranks(results, "adam_horizons"))
    assert r0["rows"] == r1["rows"] and r0["scale"] == 4
    rows = r0["rows"]
    power = 0.75 if kind == "power" else 0.5
    for row in rows:
        assert row["lr_factor"] == pytest.approx(row["gain"] ** power, rel=1e-12), row
    if kind == "capped":
        bound = [row for row in rows if row["measured"] > 1.5]
        assert len(bound) >= 3 and all(row["gain"] == 1.5 for row in bound)
        assert all(row["lr_factor"] == math.sqrt(1.5) for row in bound)
    else:
        assert max(row["gain"] for row in rows) > 1.5  # the rule is exercised, not only r = 1
    for row in rows:
        assert row["diff"] < 1e-12, row
    # The user's values, whatever each step set: after the steps, in the checkpoint, resumed.
    user = [[0.9, 0.98], 1e-6, 0.05 if kind == "AdamW" else 0.0, 0.01]
    assert r0["after"] == r0["saved"] == r0["resumed"] == user
    assert r0["resumed_progress"] == rows[-1]["progress"]


@pytest.mark.timeout(300)
def test_passes_changed_mid_run_equal_the_one_process_reference(results):
    """Issue #24: k = 1, 3, 2 (set_passes, as adapt='goodput' does), as every adapter
    (adapt_checks); a checkpoint saved at k = 3 resumes there with Horovod's accumulation
    counters too."""
    r0, r1 = both_ranks(results, "passes_change")
    check_passes_change(r0, r1, NP)
    assert r0["saved_passes"] == 3 and r0["resumed"]["horovod_k"] == 3


@pytest.mark.timeout(300)
def test_adapt_goodput_ranks_agree_and_accumulate_where_the_allreduce_dominates(results):
    r0, r1 = both_ranks(results, "adapt_goodput")
    check_adapt_goodput(r0, r1, NP)
    # Issue 61: each worker's gradient read once a step (samples="workers") is timed apart on
    # the step clock, a step's cost in the model, not a pass's.
    assert r0["model"]["statistics"] > 0, r0["model"]


@pytest.mark.timeout(300)
def test_set_up_values_differing_between_ranks_fail_on_every_rank(results):
    """Issue #22, 1: scale=2 on rank 0 and 4 on rank 1 trained with different lr factors (at
    8d9feec: built without a word); a budget per rank ended in 'Horovod has been shut down'."""
    r0, r1 = both_ranks(results, "hardening")
    for key, named in (("differ_scale", "scale {0: 2.0, 1: 4.0}"),
                       ("differ_budget", "budget {0: 100.0, 1: 200.0}")):
        assert r0[key] == r1[key] and r0[key].startswith("ValueError: "), r0[key]
        assert named in r0[key] and "same values" in r0[key]
    assert r0["alive"] == r1["alive"] == NP  # and the job goes on: a collective completes


@pytest.mark.timeout(300)
def test_budget_and_lr_bounds(results):
    """Issue #22, 4: budget 0 or nan was accepted; an lr set negative or nan after construction
    was applied (the weights went nan). Now: errors naming the value, on every rank; a refused
    step is neither applied nor counted, and the next one runs in step on every rank."""
    r0, r1 = both_ranks(results, "hardening")
    for r in (r0, r1):
        assert "budget must be a finite number > 0" in r["budget_zero"] and "got 0" in r["budget_zero"]
        assert "got nan" in r["budget_nan"]
        rows = r["bad_lr"]
        assert rows["0"]["error"] is None and rows["0"]["moved"] > 0
        for i, shown in (("1", "-0.05"), ("2", "nan")):
            assert f"param_groups[1]['lr'] is {shown} at step 2" in rows[i]["error"], rows[i]
            assert "finite number >= 0" in rows[i]["error"]
            assert rows[i]["moved"] == 0.0
            assert (rows[i]["steps"], rows[i]["skipped"], rows[i]["progress"]) == \
                (rows["0"]["steps"], rows["0"]["skipped"], rows["0"]["progress"])
        assert rows["3"]["error"] is None and rows["3"]["steps"] == 2 and rows["3"]["moved"] > 0
        assert math.isfinite(rows["mine_sum"]) and rows["mine_sum"] == rows["weights_sum"]
    assert r0["bad_lr"] == r1["bad_lr"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["k1", "k2", "unmeasured"])
def test_large_finite_gradients_are_applied(results, mode):
    """Issue #22, 5: float32 gradients with |g| ~ 1e21 (squares overflow float32 above ~1.8e19)
    were skipped as non-finite (at 8d9feec: skipped 1, nothing moved) with one pass, two passes
    and without measurement; now the step is applied with finite statistics."""
    r0, r1 = both_ranks(results, "hardening")
    for r in (r0, r1):
        row = r["large_gradients"][mode]
        assert row["grad_norm"] > 1e20 and row["error"] is None
        assert row["skipped"] == 0 and row["steps"] == 1 and row["progress"] > 0, row
        assert row["moved"] > 0 and row["finite"], row
        if mode != "unmeasured":
            assert math.isfinite(row["sigma2"]) and math.isfinite(row["mu2"]) and row["sigma2"] > 1e38
    assert r0["large_gradients"][mode]["progress"] == r1["large_gradients"][mode]["progress"]


@pytest.mark.timeout(300)
def test_checkpoint_of_another_model_is_refused_at_load(results):
    """Issue #22, 6: a checkpoint of another model with as many groups loaded silently and the
    first step failed inside torch (at 8d9feec: 'The size of tensor a (32) must match the size
    of tensor b (16)', the checkpoint's own tensors changed by it)."""
    for r in both_ranks(results, "hardening"):
        row = r["other_model"]
        assert "'momentum_buffer' of shape (32, 8)" in row["load_error"], row
        assert "parameter has shape (16, 8)" in row["load_error"] and "another model" in row["load_error"]
        assert row["optimizer_unchanged"] and row["checkpoint_unchanged"]


def test_norms_do_not_overflow_for_finite_float32_tensors():
    """The adapter's norms (a float64 vector) of finite float32 tensors are finite, also
    where float32 squares overflow; non-finite tensors stay non-finite."""
    torch = pytest.importorskip("torch")
    from hvd_scale.adapters.torch import norms

    big = torch.full((4, 3), 1e20)
    got = norms([big, torch.tensor([3.0, 4.0]), torch.full((7,), 3e4, dtype=torch.float16)])
    assert all(n.dtype == torch.float64 and n.dim() == 0 for n in got)
    assert got[0].item() == pytest.approx(math.sqrt(12) * 1e20, rel=1e-6)
    assert got[1].item() == pytest.approx(5.0) and got[2].item() == pytest.approx(math.sqrt(7) * 3e4, rel=1e-3)
    mixed = norms([big, torch.ones(2, dtype=torch.float64)])  # one kernel per tensor
    assert mixed[0].item() == pytest.approx(math.sqrt(12) * 1e20, rel=1e-6) and mixed[1].item() == pytest.approx(math.sqrt(2))
    assert not norms([torch.tensor([math.inf, 1.0])])[0].isfinite()
    assert norms([torch.tensor([math.nan])])[0].isnan()
    assert norms([]).numel() == 0
    # Off the CPU (here the meta device, standing in for a GPU) one kernel accumulates in float64.
    off = norms([torch.empty(3, 4, device="meta"), torch.empty(2, device="meta", dtype=torch.half)])
    assert [(n.dtype, n.dim()) for n in off] == [(torch.float64, 0)] * 2


def test_norms_of_one_tensor_and_of_mixed_lists_are_exact():
    """#31: a lone CPU tensor (a per-pass hook's) is normed without a vector's torch ops, to the
    same float64 as through the fused path; lists of mixed dtypes are checked against overflow
    and underflow whatever their first tensor (a float64 first skipped the check: a float32
    tensor of 1e20 after it came out inf, a step of finite gradients called non-finite)."""
    torch = pytest.importorskip("torch")
    from hvd_scale.adapters.torch.norms import cpu_norm, norms

    torch.manual_seed(0)
    for scale in (1.0, 1e-21, 1e-30, 1e20):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            t = (torch.randn(1000) * scale).to(dtype)
            exact = torch.linalg.vector_norm(t, dtype=torch.float64).item()
            one, fused = cpu_norm(t), norms([t, t.clone()])[0].item()
            assert one == fused, (scale, dtype)
            if math.isfinite(exact) and exact > 0 and t.abs().max() > 0:
                assert one == pytest.approx(exact, rel=1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6)
    mixed = norms([torch.ones(2, dtype=torch.float64), torch.full((4, 3), 1e20),
                   torch.full((5,), 1e-30)])
    assert mixed[1].item() == pytest.approx(math.sqrt(12) * 1e20, rel=1e-6)
    assert mixed[2].item() == pytest.approx(math.sqrt(5) * 1e-30, rel=1e-6)


def test_all_finite_reads_without_changing_and_never_calls_finite_non_finite():
    """The unmeasured step's check (torch's fused non-finite check, scaling by 1): every dtype,
    values left bit for bit, one nan or inf anywhere found, large finite values (whose float32
    squares overflow) finite, mixed dtypes and sparse gradients through the norms."""
    torch = pytest.importorskip("torch")
    from hvd_scale.adapters.torch.norms import all_finite

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        big = 6e4 if dtype == torch.float16 else 1e30
        tensors = [torch.randn(7).to(dtype), torch.full((3,), big).to(dtype), torch.tensor([-0.0]).to(dtype)]
        before = [t.clone() for t in tensors]
        assert all_finite(tensors)
        assert all(torch.equal(a, b) and a.signbit().equal(b.signbit()) for a, b in zip(tensors, before))
        for bad in (math.nan, math.inf, -math.inf):
            assert not all_finite(tensors + [torch.tensor([1.0, bad]).to(dtype)])
    assert all_finite([]) and all_finite([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    assert not all_finite([torch.ones(2), torch.tensor([math.inf], dtype=torch.float64)])
    assert not all_finite([torch.sparse_coo_tensor([[0, 0]], [1.0, math.nan], (3,), check_invariants=True)])
    assert all_finite([torch.sparse_coo_tensor([[0, 1]], [1e20, 2.0], (3,), check_invariants=True), torch.ones(2)])


@pytest.mark.timeout(300)
def test_checkpoint_loaded_on_one_rank_only_is_detected_on_every_rank(results):
    for r in both_ranks(results, "one_rank_load"):
        assert r["every_rank"] is None
        assert r["rank0_only"] and "different run states" in r["rank0_only"]
        assert "0: '2 steps" in r["rank0_only"] and "1: '0 steps" in r["rank0_only"]
        assert "broadcast_state" in r["rank0_only"]


@pytest.mark.timeout(300)
def test_misuse_errors_on_every_rank_without_hanging(results):
    for r in both_ranks(results, "misuse"):
        e = r["errors"]
        assert "different policies" in e["differ"] and "'adascale'" in e["differ"] and "'linear'" in e["differ"]
        assert "rank 1" in e["one_bad"] and "'adascal'" in e["one_bad"] and "valid policies" in e["one_bad"]
        assert "lr=0.0" in e["zero_lr"] and "> 0" in e["zero_lr"]
        assert e["raise_nonfinite"] and "non-finite" in e["raise_nonfinite"]
        assert "2 parameter group(s)" in e["wrong_checkpoint"] and "has 1" in e["wrong_checkpoint"]
        assert r["unchanged"]


@pytest.mark.timeout(300)
def test_resume_at_another_world_size_same_scale(results):
    """np 2 x 1 pass -> checkpoint -> np 1 x 2 passes (S = 2 both): the same continuation."""
    full, _ = both_ranks(results, "save_for_resize")
    resumed = results["resume_np1"][0]
    assert resumed["scale"] == 2.0
    # [loss, gain, sum of the weights] at each step after the resume
    assert len(resumed["rest"]) == len(full["rest"]) == 4
    for mine, theirs in zip(resumed["rest"], full["rest"]):
        assert mine == pytest.approx(theirs, rel=1e-9)
    assert resumed["progress"] == pytest.approx(full["progress"], rel=1e-9)
    assert resumed["gain"] == pytest.approx(full["gain"], rel=1e-9)
    # One process, one pass, S = 2: no variance estimate is possible, said up front.
    assert "needs at least 2 micro-gradients" in resumed["n1_error"]


@pytest.mark.timeout(300)
def test_one_process_steps_at_s_1(results):
    """python train.py (no horovodrun): S = 1, one micro-gradient a step: nothing can be measured
    (the gain is 1 by definition), so by default no statistics are taken and no parameter is
    hooked (#31 item 1: those hooks cost 2x a plain step at one process); the steps count.
    An explicit measure=True is honoured (#47 item 3: tests/test_run_paths.py)."""
    r = results["one_process"][0]
    for policy in ("adascale", "none"):
        assert r[policy]["measured"] is False and r[policy]["hooks"] == 0
        assert r[policy]["steps"] == 3 and r[policy]["skipped"] == 0
        assert r[policy]["progress"] == pytest.approx(3.0) and r[policy]["gain"] == 1.0
        assert r[policy]["lr"] == LR
        assert r[policy]["max_diff_to_reference"] < 1e-12  # the same update as plain SGD


@pytest.mark.timeout(180)
def test_a_torch_job_never_imports_tensorflow(tmp_path):
    # TensorBoard event files are still written, by tensorboardX (hvd_scale.adapters.log).
    proc = run_horovod([sys.executable, str(WORKERS_DIR / "torch_no_tf_worker.py"), str(tmp_path)],
                       np=NP, timeout=150, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert [r["loaded"] for r in worker_results(proc, np=NP)] == [[], []]
    # The workers' own lines (horovodrun tags them by rank). horovodrun itself checks its build
    # in a child process that imports horovod.tensorflow first: its untagged notices are not a
    # worker's.
    streams = {**demux_output(proc.stdout), **{(r, "stderr"): text for (r, _), text
                                               in demux_output(proc.stderr).items()}}
    worker_text = "".join(text for (rank, _), text in streams.items() if rank is not None)
    assert "RESULT" in worker_text
    for word in ("tensorflow", "onednn", "cpu_feature_guard"):
        assert word not in worker_text.lower(), worker_text[-3000:]
    assert list((tmp_path / "logs" / "tb").glob("events.out.tfevents.*"))


@pytest.mark.timeout(300)
def test_options_passed_through_to_horovod_train(results):
    """Issue #22, item 3: compression, gradient_predivide_factor and groups (with one pass and
    with accumulation) train: equal weights on every rank, gain in [1, S]."""
    r0, r1 = both_ranks(results, "options")
    for name in ("fp16", "predivide", "groups", "groups_k2"):
        assert r0[name] is None, r0[name]
        run = r0[f"{name}_run"]
        assert run["finite"] and run["spread"] == 0.0 and run["weights"] == r1[f"{name}_run"]["weights"]
        assert all(1.0 <= row["gain"] <= run["scale"] for row in run["rows"]), run["rows"]
        assert run["rows"][-1]["progress"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sparse", "sparse_as_dense"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("policy", ["adascale", "linear"])
def test_sparse_gradients_give_the_dense_statistics(results, kind, k, policy):
    """Issue #22, item 3: nn.Embedding(sparse=True) crashed under every policy (at 2be4252:
    "Could not run 'aten::linalg_vector_norm' with arguments from the 'SparseCPU' backend").
    Now its statistics and weights equal the same model's with a dense embedding on the same
    micro-batches (duplicate tokens within a batch and across passes: coalesced norms)."""
    r0, r1 = both_ranks(results, "options")
    key = f"{kind}_k{k}_{policy}"
    assert r0[key] is None and r1[key] is None, r0[key]
    run, dense = r0[f"{key}_run"], r0[f"{key}_dense"]
    assert run["finite"] and run["spread"] == 0.0 and run["weights"] == r1[f"{key}_run"]["weights"]
    assert run["scale"] == NP * k
    for row, ref in zip(run["rows"], dense["rows"]):
        assert 1.0 <= row["gain"] <= run["scale"]
        for stat in ("gain", "sigma2", "mu2", "progress"):
            assert row[stat] == pytest.approx(ref[stat], rel=1e-5, nan_ok=True), (stat, row, ref)
    assert run["weights"] == pytest.approx(dense["weights"], rel=1e-5, abs=1e-7)


@pytest.mark.timeout(300)
def test_adasum_is_refused_up_front_on_every_rank(results):
    """Issue #22, item 3: op=hvd.Adasum with a fixed policy and measure=False failed at the
    first step (at 2be4252: 'AssertionError: Skipping synchronization is not supported when
    using Adasum optimizer'): Horovod's Adasum optimizer steps inside backward and combines
    updates, so no policy can scale its step. Now a ValueError at construction, every rank."""
    for r in both_ranks(results, "options"):
        for policy in ("adascale", "linear", "none"):
            error = r[f"adasum_{policy}"]
            assert error.startswith("ValueError: ") and "op=hvd.Adasum is not supported" in error, error
            assert "use op=hvd.Average" in error and "rank 0" in error and "rank 1" in error
        assert r["alive"] == NP


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,k", [("adascale_k2", 2), ("linear_k1", 1), ("adascale_k1", 1)])
def test_uneven_data_with_hvd_join(results, name, k):
    """Issue #22, item 7: rank 1 runs out of data after 2 steps and calls hvd.join(); rank 0
    takes 2 more steps alone. Its steps count only its own micro-batches (the joined rank's
    zeros are no micro-batch): short steps at scale S x n / (workers x k), and the update is
    the mean of its own micro-gradients (at 2be4252, at k = 1, half of it: diff 2.5e-3)."""
    r0, r1 = both_ranks(results, "join")
    alone, joined = r0[name], r1[name]
    assert alone["error"] is None and joined["error"] is None
    assert len(alone["rows"]) == 4 and joined["rows"] == alone["rows"][:2]
    assert alone["last_joined"] == joined["last_joined"] == 0
    scale = alone["scale"]
    assert scale == NP * k
    for i, row in enumerate(alone["rows"]):
        assert row["diff"] < 1e-12, row  # the one-process reference over the step's batches
        advance = row["progress"] - (alone["rows"][i - 1]["progress"] if i else 0.0)
        assert advance == pytest.approx(row["lr_factor"] if name != "linear_k1" else
                                        (scale if i < 2 else scale / NP), rel=1e-9)
    # Alone, one worker's k micro-batches: a step of scale k (linear: factor 1 at k = 1).
    if name == "linear_k1":
        assert [row["lr_factor"] for row in alone["rows"]] == [2.0, 2.0, 1.0, 1.0]
    else:
        assert all(1.0 <= row["lr_factor"] <= k for row in alone["rows"][2:])


def test_norm_of_a_sparse_tensor_is_its_dense_norm():
    """Issue #22, item 3: norms() of a sparse tensor raised NotImplementedError (SparseCPU has
    no linalg_vector_norm); with duplicate indices (an embedding's gradient) the entries add up
    before squaring, as in the dense tensor."""
    torch = pytest.importorskip("torch")
    from hvd_scale.adapters.torch import norms

    sparse = torch.sparse_coo_tensor([[0, 2, 0]], torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                                     (4, 2), check_invariants=True)  # row 0 twice: (6, 8) after coalescing
    dense = sparse.to_dense()
    got = norms([sparse, dense])
    assert got[0].item() == pytest.approx(dense.norm().item()) == pytest.approx(math.sqrt(36 + 64 + 9 + 16))
    assert got[1].item() == pytest.approx(got[0].item())


@pytest.mark.timeout(300)
def test_tiny_float32_gradients_give_the_unscaled_gain(results):
    """#30 item 5: the norms were taken in float32 and re-taken in float64 only when
    non-finite, never when they underflow: with the loss x 1e-22 the gain was 4 (= S) against
    3.56 unscaled, and below ~1e-23 it was 1. The statistics are the same in units of the
    gradient's scale, so the gain must be too."""
    r0, r1 = both_ranks(results, "soundness")
    ref = r0["tiny_1"]
    assert max(ref["gains"]) > 1.2 and min(ref["gains"]) < 3.9  # a gain to compare, below S
    for factor in ("tiny_1e-22", "tiny_1e-30"):
        got = r0[factor]
        assert got["gains"] == pytest.approx(ref["gains"], rel=1e-4), factor
        assert got["sigma2"] == pytest.approx(ref["sigma2"], rel=1e-4), factor
        assert got["mu2"] == pytest.approx(ref["mu2"], rel=1e-4), factor
        assert r1[factor]["gains"] == got["gains"]


@pytest.mark.timeout(300)
def test_a_fresh_adam_under_a_restored_policy_is_refused(results):
    """#30 item 10: adascale_adam corrects Adam's bias by tau; a fresh Adam state (one gradient in
    v) under a policy restored at tau ~ 40 took a first update 3-6x too large. Refused alike on
    every rank, before anything is applied or counted."""
    for r in both_ranks(results, "soundness"):
        f = r["fresh_adam"]
        assert f["error"] and "ValueError" in f["error"], f
        assert "Adam state has taken 0 update(s)" in f["error"] and "25 step(s)" in f["error"]
        assert "opt.load_state_dict" in f["error"]
        assert f["unchanged"] and f["steps"] == 25 and f["tau"] == f["saved_tau"]
