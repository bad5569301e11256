"""Per-step metrics survive restarts, with real Horovod jobs: a run killed and resumed from its
checkpoint into the same log directory, and an elastic job whose rank 0 crashes.

At 0757b73 the resumed run truncated metrics.csv (mode "w": steps 1-6 of the first run lost) and,
under elastic, the logger belonged to the first rank 0, so nobody logged after it died.
"""

import csv
import json
import sys

import pytest

from hvdrun import WORKERS_DIR, requires_horovod, run_horovod, worker_results
from test_elastic import BUDGET, TORCH, run_elastic

pytestmark = [requires_horovod]


def read_steps(path):
    with open(path, newline="") as f:
        return [(int(float(r["step"])), float(r["progress"])) for r in csv.DictReader(f)]


@pytest.mark.timeout(300)
def test_a_killed_run_resumed_from_its_checkpoint_continues_its_log(tmp_path):
    log_dir, ckpt = tmp_path / "log", tmp_path / "ckpt.pt"
    cmd = [sys.executable, str(WORKERS_DIR / "resume_log_worker.py"), str(ckpt), "--steps", "10"]
    env = {"HVD_SCALE_LOG_DIR": str(log_dir)}
    crashed = run_horovod(cmd + ["--crash-at", "7"], np=2, timeout=120, env=env, check=False)
    assert crashed.returncode != 0
    assert [s for s, _ in read_steps(log_dir / "metrics.csv")] == list(range(1, 8))
    resumed = worker_results(run_horovod(cmd, np=2, timeout=120, env=env), np=2)
    assert resumed[0]["resumed_from"] == 6 and resumed[0]["steps"] == 10
    rows = read_steps(log_dir / "metrics.csv")
    assert [s for s, _ in rows] == list(range(1, 11)), rows  # each step once
    assert all(b > a for (_, a), (_, b) in zip(rows, rows[1:])), "tau goes up along the log"
    assert rows[-1][1] == pytest.approx(resumed[0]["progress"])
    # Step 7 ran twice (after the checkpoint at 6): the first one is kept aside, not dropped.
    assert [s for s, _ in read_steps(log_dir / "metrics.replayed.csv")] == [7]
    assert json.loads((log_dir / "run.json").read_text())["resumed_at_step"] == 7


@pytest.mark.timeout(300)
def test_under_elastic_the_new_rank_0_writes_after_rank_0_dies(tmp_path):
    # Two hosts of one slot each (Horovod drops the host of a failed worker): the worker that
    # starts as rank 0 crashes at step 6, whichever host it is on; the other goes on alone.
    log_dir = tmp_path / "log"
    steps, finals = run_elastic(tmp_path / "job", 2, hosts_text="localhost:1\n127.0.0.1:1\n",
                                worker=TORCH, env={"HVD_SCALE_LOG_DIR": str(log_dir)}, min_np=1,
                                worker_args=["--die-first-rank", "0", "--die-at", "6",
                                             "--step-sleep", "0.1"])
    # The process that ends as rank 0 started as rank 1.
    assert len(finals) == 1
    assert steps[0]["rank"] == 1 and steps[-1]["rank"] == 0, "rank 0 should have died"
    rows = read_steps(log_dir / "metrics.csv")
    assert [s for s, _ in rows] == list(range(1, len(rows) + 1)), rows
    assert rows[-1][0] == finals[0]["steps"] and rows[-1][1] >= BUDGET
