"""Horovod elastic with both adapters: a worker leaves, a worker joins, a worker dies; S follows,
tau goes on.

Rank 0 rewrites the host file that the discovery script prints, so the resize happens at a known
step without killing anything by hand; the driver polls it every second.
"""

import math
import subprocess
import sys

import pytest

from hvdrun import WORKERS_DIR, requires_horovod, run_horovod, worker_env, worker_results

sys.path.insert(0, str(WORKERS_DIR))
import _reference  # noqa: E402  (tests/workers: the independent reference)

pytestmark = [requires_horovod]
BUDGET = 60


TORCH, KERAS = "elastic_worker.py", "elastic_keras_worker.py"


def run_elastic(tmp_path, start: int, end: int | None = None, hosts_text: str | None = None,
                worker_args=(), worker=TORCH, env=None, min_np=2, kind="step", everything=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    hosts = tmp_path / "hosts"
    hosts.write_text(hosts_text or f"localhost:{start}\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    resize = [] if end is None else ["--resize-at", "6", "--resize-to", str(end)]
    proc = run_horovod(
        [sys.executable, str(WORKERS_DIR / worker), "--hosts-file", str(hosts),
         "--budget", str(BUDGET), *resize, *worker_args],
        np=start, hosts=False, timeout=150, env=env,
        hvd_args=["--min-np", str(min_np), "--max-np", "3", "--host-discovery-script", str(discover),
                  "--network-interfaces", "lo"])
    results = worker_results(proc)
    if everything is not None:  # every process's reports, for a replay
        everything.extend(results)
    finals = [r for r in results if r["kind"] == "final"]
    # Every step of the process that ends as rank 0 (it may have had another rank before).
    pid = next(f["pid"] for f in finals if f["rank"] == 0)
    steps = sorted((r for r in results if r["kind"] == kind and r["pid"] == pid),
                   key=lambda r: r["seq"])
    return steps, finals


def check(steps, finals, start, end):
    sizes = [r["size"] for r in steps]
    assert sizes[0] == start and sizes[-1] == end, sizes
    assert sizes == sorted(sizes, reverse=start > end), "one resize only"
    for r in steps:
        assert r["scale"] == r["size"], r      # S = workers x 1 follows the world size
        assert 1.0 <= r["gain"] <= r["scale"]
    progress = [r["progress"] for r in steps]
    assert all(b > a for a, b in zip(progress, progress[1:])), "tau never goes back"
    assert progress[-1] >= BUDGET
    assert len(finals) == end
    assert len({(f["progress"], f["steps"], f["checksum"]) for f in finals}) == 1, finals


@pytest.mark.timeout(200)
def test_a_worker_leaves(tmp_path):
    steps, finals = run_elastic(tmp_path, 3, 2)
    check(steps, finals, 3, 2)


@pytest.mark.timeout(200)
def test_a_worker_joins_with_the_committed_state(tmp_path):
    steps, finals = run_elastic(tmp_path, 2, 3)
    check(steps, finals, 2, 3)
    # The new worker (rank 2) got tau, steps and the weights from rank 0's broadcast.
    assert any(f["rank"] == 2 for f in finals)


@pytest.mark.timeout(200)
def test_adam_moments_are_kept_across_a_resize(tmp_path):
    # Chosen: Adam's moments carry over a resize (committed, broadcast to a joining worker), as
    # its step count does; AdaptDL resets them. See README, "Adam".
    steps, finals = run_elastic(tmp_path, 3, 2, worker_args=["--adam"])
    check(steps, finals, 3, 2)
    # Never reset: Adam's count is the policy's steps (the first sync, of a fresh optimizer,
    # takes no step: Horovod's broadcast_optimizer_state would take one on zero gradients).
    assert {f["adam_step"] for f in finals} == {float(finals[0]["steps"])}
    assert len({f["moments"] for f in finals}) == 1 and finals[0]["moments"] > 0
    assert max(r["gain"] for r in steps) > 1.0  # measured once Adam's moments had history


@pytest.mark.timeout(200)
@pytest.mark.parametrize("worker", [TORCH, KERAS])
def test_a_worker_joins_at_the_passes_adapt_chose(tmp_path, worker):
    """Issue #24 (#31 item 3: Keras too): k went from 1 to 2 at step 3 (set_passes, as
    adapt='goodput' does); the worker that joins at step 6 takes k = 2 at the sync (else its
    passes and S would differ from the others'), and S = workers x k throughout."""
    steps, finals = run_elastic(tmp_path, 2, 3, worker_args=["--passes-at", "3"], worker=worker)
    assert [r["size"] for r in steps][0] == 2 and steps[-1]["size"] == 3
    for r in steps:
        assert r["scale"] == r["size"] * r["passes"], r
    assert {r["passes"] for r in steps if r["step"] > 3} == {2}
    assert len(finals) == 3 and any(f["rank"] == 2 for f in finals)
    assert len({(f["progress"], f["steps"], f["checksum"], f["scale"]) for f in finals}) == 1, finals
    assert finals[0]["scale"] == 6.0


@pytest.mark.timeout(200)
@pytest.mark.parametrize("worker", [TORCH, KERAS])
def test_a_worker_leaves_after_the_passes_changed(tmp_path, worker):
    """Issue #24 (#31 item 3: Keras too): k went from 1 to 2 at step 3; a worker leaves at step
    6: the two that remain keep k = 2 (nothing to agree on: they both had it) and S = workers x k
    follows the world size."""
    steps, finals = run_elastic(tmp_path, 3, 2, worker_args=["--passes-at", "3"], worker=worker)
    assert steps[0]["size"] == 3 and steps[-1]["size"] == 2
    for r in steps:
        assert r["scale"] == r["size"] * r["passes"], r
    assert {r["passes"] for r in steps if r["step"] > 3} == {2}
    assert {r["size"] for r in steps if r["passes"] == 2} == {3, 2}  # the leave came after the change
    assert len(finals) == 2
    assert len({(f["progress"], f["steps"], f["checksum"], f["scale"]) for f in finals}) == 1, finals
    assert finals[0]["scale"] == 4.0 and finals[0]["progress"] >= BUDGET


@pytest.mark.timeout(200)
@pytest.mark.parametrize("start,end", [(2, 1), (1, 2)])
def test_a_job_that_shrinks_to_one_worker_keeps_measuring(tmp_path, start, end):
    """#58 item 1: adascale, k = 2, the default samples: with two workers each reads its sum of
    the passes once; when the job shrank to one, that was one sample a step, no step was measured
    again and the gain stayed at its last value (estimator updates stuck, tau at a stale gain
    for 88% of the budget). At one worker the passes are read: every step updates the estimates,
    at either size, and reading follows the world size when it grows back.

    #58 item 10: the transitions matrix's elastic cell. Every step (lr factor = gain, tau, S, n)
    is the independent reference's (tests/workers/_reference.py ``CellModel``) replaying the
    micro-gradients every rank reported at that step's world size: each worker's sum read once
    at W = 2, every pass at W = 1, S = W k following W."""
    everything = []
    steps, finals = run_elastic(tmp_path, start, end, worker_args=["--passes", "2", "--reference"],
                                min_np=1, kind="estimates", everything=everything)
    sizes = [r["size"] for r in steps]
    assert sizes[0] == start and sizes[-1] == end, sizes
    assert sizes.count(1) >= 3, sizes  # steps taken at one worker
    updates = [r["updates"] for r in steps]
    # Every step measured: one update a step, across the resize.
    assert all(b == a + 1 for a, b in zip(updates, updates[1:])), list(zip(sizes, updates))
    assert len(finals) == end and finals[0]["scale"] == 2.0 * end
    assert len({(f["progress"], f["steps"], f["checksum"]) for f in finals}) == 1, finals
    zero = steps[0]["pid"]
    micro = sorted((r for r in everything if r["kind"] == "micro"),
                   key=lambda r: (r["pid"] != zero, r["seq"]))
    micro = [{**r, "zero": r["pid"] == zero} for r in micro]
    assert [r["step"] for r in micro if r["zero"]] == list(range(1, finals[0]["steps"] + 1))
    pairs = _reference.replay_elastic(micro)
    wrong = [(i + 1, got, expected) for i, (got, expected) in enumerate(pairs)
             if not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
                        for a, b in zip(got, expected))]
    assert not wrong, f"{len(wrong)} step(s) (lr factor, tau, S, n, skipped) against the " \
                      f"reference's: {wrong[:3]}"


@pytest.mark.timeout(200)
def test_keras_a_job_that_shrinks_to_one_worker_keeps_measuring(tmp_path):
    """#58 item 1 in Keras's traced step: k = 2 from step 3 (set_passes), 2 -> 1 workers at step
    6. What the statistics read is decided when the step runs (the world size then): at one
    worker its passes. A step not measured would keep the gain at the estimates' last value;
    measured, every step's gain is its own."""
    steps, finals = run_elastic(tmp_path, 2, 1, worker=KERAS, worker_args=["--passes-at", "3"],
                                min_np=1)
    alone = [r for r in steps if r["size"] == 1]
    assert len(alone) >= 3 and {r["passes"] for r in alone} == {2}, steps
    assert all(r["scale"] == 2.0 for r in alone), alone
    gains = [r["gain"] for r in alone]
    assert len(set(gains)) == len(gains), gains  # each step measured, none at a frozen gain
    assert len(finals) == 1 and finals[0]["progress"] >= BUDGET


# Two host names for one machine: Horovod blacklists the host of a failed worker, so the worker
# that dies must sit on a host of its own ("127.0.0.1" resolves to this machine, runs locally).
TWO_HOSTS = "localhost:2\n127.0.0.1:1\n"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("worker", [TORCH, KERAS])
def test_a_worker_dies_and_the_job_finishes_on_the_rest(tmp_path, worker):
    steps, finals = run_elastic(tmp_path / "killed", 3, hosts_text=TWO_HOSTS, worker=worker,
                                worker_args=["--die-on-host", "127.0.0.1", "--die-at", "6",
                                             "--step-sleep", "0.1"])
    _, uninterrupted = run_elastic(tmp_path / "full", 3, hosts_text=TWO_HOSTS, worker=worker,
                                   worker_args=["--step-sleep", "0.1"])
    sizes = [r["size"] for r in steps]
    assert sizes[0] == 3 and sizes[-1] == 2
    for r in steps:
        assert r["scale"] == r["size"] and 1.0 <= r["gain"] <= r["scale"]
    # The survivors restored the last commit: a step may be redone once, tau never goes back
    # further than that.
    for before, after in zip(steps, steps[1:]):
        assert after["step"] in (before["step"], before["step"] + 1), (before, after)
        if after["step"] == before["step"]:
            assert after["progress"] >= before["progress"] - before["gain"] - 1e-9
        else:
            assert after["progress"] > before["progress"]
    assert len(finals) == 2 and finals[0]["progress"] >= BUDGET
    assert finals[0]["checksum"] == finals[1]["checksum"]
    # Quality close to the uninterrupted 3-worker run (the loss starts near ln 3 = 1.10).
    full = uninterrupted[0]["eval_loss"]
    assert full < 0.5
    assert abs(finals[0]["eval_loss"] - full) < 0.1 * full + 0.02, (finals[0]["eval_loss"], full)


# -- the Keras adapter: ElasticState, CommitState, elastic_run -----------------------------------

@pytest.mark.timeout(200)
def test_keras_a_worker_leaves_from_a_traced_train_step(tmp_path):
    # The step is one tf.function traced at 3 workers: the world size must not stay frozen in it.
    steps, finals = run_elastic(tmp_path, 3, 2, worker=KERAS)
    check(steps, finals, 3, 2)


@pytest.mark.timeout(200)
def test_keras_fit_a_worker_joins_with_the_committed_state(tmp_path):
    steps, finals = run_elastic(tmp_path, 2, 3, worker=KERAS, worker_args=["--fit"])
    check(steps, finals, 2, 3)
    assert any(f["rank"] == 2 for f in finals)


@pytest.mark.timeout(200)
def test_keras_on_torch_fit_a_worker_joins_with_the_committed_state(tmp_path):
    # Keras's torch backend: horovod.torch collectives, horovod.torch.elastic.run.
    steps, finals = run_elastic(tmp_path, 2, 3, worker=KERAS, worker_args=["--fit"],
                                env={"KERAS_BACKEND": "torch"})
    check(steps, finals, 2, 3)
    assert any(f["rank"] == 2 for f in finals)


def run_single(*args):
    """The Keras elastic worker as one plain process (hvd.init() alone: size 1, no driver)."""
    return subprocess.run([sys.executable, str(WORKERS_DIR / KERAS), "--hosts-file", "unused",
                           "--budget", "20", "--step-sleep", "0", *args],
                          capture_output=True, text=True, timeout=120, env=worker_env())


@pytest.mark.timeout(300)
def test_keras_elastic_run_raises_an_error_that_horovods_run_swallows():
    ours = run_single("--fail-at", "3")
    assert ours.returncode != 0 and "RuntimeError: user error at step 3" in ours.stderr, \
        ours.stderr[-3000:]
    assert '"kind": "final"' not in ours.stdout
    # Horovod's hvd.elastic.run returns None on the same error: "finished" at tau 3 of 20.
    horovods = run_single("--fail-at", "3", "--horovod-run")
    assert horovods.returncode == 0, horovods.stderr[-3000:]
    assert '"progress": 3.0' in horovods.stdout and '"kind": "final"' in horovods.stdout
