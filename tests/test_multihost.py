"""horovodrun across two hosts, simulated with network namespaces on this machine (multihost.py):
the launcher with Gloo and MPI, the Keras example, a worker killed on one host, and an elastic
job that loses a host and gets it back.

Every job runs "on host a" (its driver there, one rank per host), with the NIC both hosts call
hvd0 and ssh on the fixture's port and key.
"""

import json
import sys
import time
import uuid

import pytest

from hvdrun import BIN_DIR, LAUNCHER, REPO_ROOT, WORKERS_DIR, requires_horovod, worker_results
from hvd_scale.launch.jobs import horovodrun_command, read_results
from multihost import processes_matching, two_hosts  # noqa: F401 - two_hosts is the fixture

pytestmark = [requires_horovod]

HVD_SCALE = BIN_DIR / "hvd-scale"
EXAMPLES = REPO_ROOT / "examples"


def _fail(proc, what):
    out = proc.stdout or ""
    err = getattr(proc, "stderr", "") or ""
    return f"{what}: exit {proc.returncode}\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"


def _accepted_since(h, host, before):
    """Public-key logins on `host`'s sshd since its log had `before` characters."""
    return h.sshd_log(host)[before:].count("Accepted publickey")


def run_launcher(h, controller, script, *script_args, timeout=150):
    """`hvd-scale run -np 2 -H hvdtest-a:1,hvdtest-b:1 --gloo|--mpi ...` on host a; its ranks'
    RESULT lines, after checking that host b's sshd took a login for the job."""
    log_b = len(h.sshd_log("b"))
    cmd = [HVD_SCALE, "run", "-np", "2", "-H", h.hosts(), f"--{controller}", *h.horovodrun_args(),
           "--", sys.executable, EXAMPLES / script, *script_args]
    proc = h.run_on("a", cmd, timeout=timeout)
    assert proc.returncode == 0, _fail(proc, f"{script} across two hosts ({controller})")
    assert _accepted_since(h, "b", log_b) >= 1, "no ssh login on host b: did a rank run there?"
    assert h.wait_clean() == {"a": [], "b": []}
    return worker_results(proc, np=2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_launcher_trains_torch_example_to_equal_weights_on_both_hosts(two_hosts, controller):
    r0, r1 = run_launcher(two_hosts, controller, "torch_mnist1d.py",
                          "--budget", "40", "--samples", "2000", "--log-every", "0")
    for r in (r0, r1):
        assert r["workers"] == 2 and r["scale"] == 2.0 and r["progress"] >= 40, r
    assert r0["params_checksum"] == r1["params_checksum"], (r0, r1)
    assert (r0["steps"], r0["progress"], r0["test_accuracy"]) == \
           (r1["steps"], r1["progress"], r1["test_accuracy"])


@pytest.mark.timeout(240)
def test_launcher_trains_keras_example_on_both_hosts(two_hosts):
    # The Keras example reports no weights; equal steps, tau and test accuracy (each rank tests
    # its own weights on the whole test set) are what it shows.
    r0, r1 = run_launcher(two_hosts, "gloo", "keras_mnist1d.py",
                          "--budget", "40", "--samples", "2000", timeout=210)
    for r in (r0, r1):
        assert r["scale"] == 2.0 and r["progress"] >= 40 and r["skipped"] == 0, r
    assert (r0["steps"], r0["progress"], r0["test_accuracy"], r0["mean_gain"]) == \
           (r1["steps"], r1["progress"], r1["test_accuracy"], r1["mean_gain"])


@pytest.mark.timeout(120)
def test_a_worker_killed_on_host_b_ends_the_job_and_leaves_nothing(two_hosts):
    h = two_hosts
    tag = f"mhkill-{uuid.uuid4().hex[:12]}"
    killed_at = []

    def on_line(line, t):
        if '"kind": "kill"' in line:
            killed_at.append(t)

    cmd = horovodrun_command([sys.executable, WORKERS_DIR / "multihost_kill_worker.py",
                              "--kill-host", h.names["b"], "--kill-at", "3", "--tag", tag], 2,
                             hosts=h.hosts(), controller="gloo", extra_args=h.horovodrun_args(),
                             executable=LAUNCHER)
    proc = h.stream_on("a", cmd, timeout=90, on_line=on_line)
    ended = time.monotonic()  # stream_on returns once the job has exited
    assert proc.returncode != 0, _fail(proc, "the job went on without a rank")
    starts = {r["rank"]: r for r in worker_results(proc.stdout) if r["kind"] == "start"}
    assert {r["host"] for r in starts.values()} == {h.names["a"], h.names["b"]}, starts
    assert all(r["size"] == 2 and r["cross_size"] == 2 for r in starts.values()), starts
    kills = [r for r in worker_results(proc.stdout) if r["kind"] == "kill"]
    assert len(kills) == 1 and kills[0]["host"] == h.names["b"], _fail(proc, "no kill")
    assert not [r for r in worker_results(proc.stdout) if r["kind"] == "final"]
    assert killed_at and ended - killed_at[0] < 30, f"ended {ended - killed_at[0]:.1f} s after the kill"
    # Nothing left: only the sshd listener in each namespace (an ssh session may take a moment
    # to close), and no worker of this job anywhere on the machine.
    assert h.wait_clean() == {"a": [], "b": []}
    assert processes_matching(tag) == []


# -- elastic: host b leaves, then comes back ------------------------------------------------------

BUDGET = 60


@pytest.mark.timeout(240)
def test_elastic_job_loses_host_b_and_gets_it_back(two_hosts, tmp_path):
    h = two_hosts
    a, b = h.names["a"], h.names["b"]
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(f"{a}:1\n{b}:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)

    def set_hosts(*names):
        (tmp_path / "hosts.tmp").write_text("".join(f"{n}:1\n" for n in names))
        (tmp_path / "hosts.tmp").replace(hosts_file)

    # The test drives the resize from the steps it sees: remove b once rank 0 has taken 4 steps
    # at 2 workers, add it back once 3 steps ran at 1 worker.
    phase = {"n": 0, "at_one": 0}
    events = []

    def on_line(line, t):
        rows = read_results(line)  # hvd_scale.launch.jobs: the one RESULT parser
        if not rows:
            return
        r = rows[0]
        if r.get("kind") != "step" or r["rank"] != 0:
            return
        if phase["n"] == 0 and r["size"] == 2 and r["step"] >= 4:
            set_hosts(a)
            phase["n"] = 1
            events.append(("removed b", r["step"], t))
        elif phase["n"] == 1 and r["size"] == 1:
            phase["at_one"] += 1
            if phase["at_one"] >= 3:
                set_hosts(a, b)
                phase["n"] = 2
                events.append(("added b", r["step"], t))

    cmd = horovodrun_command([sys.executable, WORKERS_DIR / "elastic_worker.py", "--hosts-file",
                              hosts_file, "--budget", str(BUDGET), "--step-sleep", "0.2"], 2,
                             min_np=1, max_np=2, controller="gloo",
                             extra_args=["--host-discovery-script", discover, *h.horovodrun_args()],
                             executable=LAUNCHER)
    proc = h.stream_on("a", cmd, timeout=200, on_line=on_line)
    assert proc.returncode == 0, _fail(proc, "elastic job")
    assert phase["n"] == 2, _fail(proc, f"resizes not reached: {events}")

    results = worker_results(proc.stdout)
    finals = [r for r in results if r["kind"] == "final"]
    pid = next(f["pid"] for f in finals if f["rank"] == 0)
    steps = sorted((r for r in results if r["kind"] == "step" and r["pid"] == pid),
                   key=lambda r: r["seq"])
    sizes = [r["size"] for r in steps]
    # 2 workers, then 1 (b removed), then 2 again (b back), in that order.
    runs = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert runs == [2, 1, 2], sizes
    for r in steps:
        assert r["scale"] == r["size"] and 1.0 <= r["gain"] <= r["scale"], r
    # tau never goes back, except that a restored commit may redo one step.
    for before, after in zip(steps, steps[1:]):
        assert after["step"] in (before["step"], before["step"] + 1), (before, after)
        if after["step"] == before["step"]:
            assert after["progress"] >= before["progress"] - before["gain"] - 1e-9, (before, after)
        else:
            assert after["progress"] > before["progress"], (before, after)
    assert steps[-1]["progress"] >= BUDGET
    # The ranks that finish: one per host, at 2 workers, with the same weights and tau.
    done = [f for f in finals if f["size"] == 2]
    assert sorted(f["rank"] for f in done) == [0, 1], finals
    assert len({(f["progress"], f["steps"], f["checksum"]) for f in done}) == 1, done
    # Rank 1 is a new worker started on b after it came back: it took no step before the removal,
    # and got tau and the weights from rank 0.
    rank1 = next(f["pid"] for f in done if f["rank"] == 1)
    first = min((r["step"] for r in results if r["kind"] == "step" and r["pid"] == rank1))
    removed_after = next(step for what, step, _ in events if what == "removed b")
    assert first > removed_after, (first, events)
    assert h.wait_clean() == {"a": [], "b": []}


@pytest.mark.timeout(60)
def test_the_launchers_hostname_check_sees_each_hosts_own_name(two_hosts):
    # hvd-scale run asks every host of -H for its hostname over ssh before launching, and warns
    # when two share one (Horovod 0.28.1's Gloo path then fails on 127.0.0.1).
    h = two_hosts
    code = ("import json, sys; from hvd_scale.launch.engines import remote_hostnames; "
            "print(json.dumps(remote_hostnames(sys.argv[1], sys.argv[2:])))")
    proc = h.run_on("a", [sys.executable, "-c", code, h.hosts(), *h.horovodrun_args()], timeout=40)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {n: n for n in h.names.values()}
