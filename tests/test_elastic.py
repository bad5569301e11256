"""Horovod elastic with the torch adapter: a worker leaves, a worker joins; S follows, tau goes on.

Rank 0 rewrites the host file that the discovery script prints, so the resize happens at a known
step without killing anything by hand; the driver polls it every second.
"""

import sys

import pytest

from hvdrun import WORKERS_DIR, requires_horovod, run_horovod, worker_results

pytestmark = [requires_horovod]
BUDGET = 60


def run_elastic(tmp_path, start: int, end: int):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:{start}\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    proc = run_horovod(
        [sys.executable, str(WORKERS_DIR / "elastic_worker.py"), "--hosts-file", str(hosts),
         "--resize-at", "6", "--resize-to", str(end), "--budget", str(BUDGET)],
        np=start, hosts=False, timeout=150,
        hvd_args=["--min-np", "2", "--max-np", "3", "--host-discovery-script", str(discover),
                  "--network-interfaces", "lo"])
    results = worker_results(proc)
    steps = [r for r in results if r["kind"] == "step" and r["rank"] == 0]
    finals = [r for r in results if r["kind"] == "final"]
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
