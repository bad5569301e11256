"""Checkpoints through torch.distributed.checkpoint (hvd_scale.adapters.torch.dcp): the run's
record saved with the model's and the optimizer's sharded state in one dcp.save, loaded at the
same layout (the resumed run is the uninterrupted one, step for step), at another world size
(2 -> 1 processes, FSDP2 on a mesh of one included: tau, the estimates and k continue, S
follows the workers), across engines (a
DDP checkpoint resumed under FSDP2 and an FSDP2 one under DDP), and a checkpoint without the
record refused on every rank with nothing changed.

Every job is a torchrun of tests/workers/fsdp_dcp_worker.py (float64, adascale, k = 2); the jobs
of one stage run at once."""

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from hvdrun import WORKERS_DIR, run_torchrun, worker_results

HAS_FSDP = importlib.util.find_spec("hvd_scale.adapters.torch.fsdp") is not None
WORKER = str(WORKERS_DIR / "fsdp_dcp_worker.py")
ENGINES = ("ddp", "fsdp") if HAS_FSDP else ("ddp",)
RTOL = 1e-9  # float64 through the same sums: the engines agree to ~1e-15


def job(args, nproc=2):
    proc = run_torchrun([WORKER, *args], nproc=nproc, timeout=150, check=False)
    if proc.returncode != 0:  # a failed load fails its own test, not the others
        return f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return worker_results(proc, np=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dcp")
    saves = {e: str(base / f"saved_{e}") for e in ENGINES}
    with ThreadPoolExecutor(2) as pool:
        saved = dict(zip(ENGINES, pool.map(
            lambda e: job(["--engine", e, "--save", saves[e], "--steps", "3", "--more", "2"]),
            ENGINES)))
    loads = [(e, f, n) for e in ENGINES for f in ENGINES for n in (2, 1)]
    with ThreadPoolExecutor(3) as pool:
        loaded = dict(zip(loads, pool.map(
            lambda c: job(["--engine", c[1], "--load", saves[c[0]], "--more", "2"], nproc=c[2]),
            loads)))
        bad = pool.submit(job, ["--engine", ENGINES[-1], "--bad-load", str(base / "plain")])
        return saved, loaded, bad.result()


def values(row):
    return [row[key] for key in ("tau", "gain", "lr_factor", "sigma2", "mu2", "weights")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saved_by", ENGINES)
@pytest.mark.parametrize("loaded_by", ENGINES)
def test_resumed_at_the_same_layout_is_the_uninterrupted_run(runs, saved_by, loaded_by):
    saved, loaded, _ = runs
    assert not isinstance(saved[saved_by], str), saved[saved_by]
    assert not isinstance(loaded[(saved_by, loaded_by, 2)], str), loaded[(saved_by, loaded_by, 2)]
    for before, after in zip(saved[saved_by], loaded[(saved_by, loaded_by, 2)]):
        assert after["loaded"] == before["saved"]  # the record, tau, the estimates, S, k
        assert len(after["after"]) == len(before["after"]) == 2
        for a, b in zip(after["after"], before["after"]):
            assert a["step"] == b["step"] and a["scale"] == b["scale"] == 4.0
            assert values(a) == pytest.approx(values(b), rel=RTOL, abs=1e-15)
        assert before["after"][-1]["gain"] > 1.0  # measured, not the fixed 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saved_by", ENGINES)
@pytest.mark.parametrize("loaded_by", ENGINES)
def test_resumed_at_another_world_size_continues_tau_the_estimates_and_k(runs, saved_by,
                                                                         loaded_by):
    saved, loaded, _ = runs
    before = saved[saved_by][0]["saved"]
    assert not isinstance(loaded[(saved_by, loaded_by, 1)], str), loaded[(saved_by, loaded_by, 1)]
    (after,) = loaded[(saved_by, loaded_by, 1)]
    got = after["loaded"]
    assert (got["steps"], got["tau"], got["passes"]) == (3, before["tau"], 2)
    assert (before["scale"], got["scale"]) == (4.0, 2.0)  # S = W k: one worker now
    assert (before["run"]["workers"], got["run"]["workers"]) == (2, 1)
    assert got["run"]["policy"] == {**before["run"]["policy"], "estimator": {
        **before["run"]["policy"]["estimator"], "scale": 2.0}}  # the estimates, at this S
    assert got["sigma2"] == pytest.approx(before["sigma2"], rel=RTOL)
    assert 1.0 <= got["gain"] <= 2.0
    taus = [got["tau"]] + [row["tau"] for row in after["after"]]
    gains = [row["gain"] for row in after["after"]]
    assert [b - a for a, b in zip(taus, taus[1:])] == pytest.approx(gains, rel=1e-12)
    assert [row["step"] for row in after["after"]] == [4, 5]


@pytest.mark.timeout(600)
def test_a_checkpoint_without_the_record_is_refused_on_every_rank(runs):
    *_, bad = runs
    assert not isinstance(bad, str), bad
    for r in bad:
        assert "Missing key in checkpoint state_dict: optim.hvd_scale" in r["dcp_load_error"]
        assert "has no 'hvd_scale' record" in r["set_error"] and "Nothing was loaded" \
            in r["set_error"]
        assert r["unchanged"]
