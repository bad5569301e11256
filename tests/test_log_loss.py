"""#48 item 5: ``opt.log_loss(loss)`` after ``step()`` puts the step's own loss in that step's
row of the metrics log, with a real horovodrun -np 2 job, across a resume from a checkpoint into
the same log (the first row after it had nan, and every row the previous step's loss, when a
loss waited for the next row); a second call for one step is warned of, once, and not logged."""

import csv
import sys

import pytest

from hvdrun import WORKERS_DIR, requires_horovod, run_horovod, worker_results

pytestmark = [requires_horovod]


def losses(path):
    with open(path, newline="") as f:
        return {int(float(r["step"])): float(r["loss"]) for r in csv.DictReader(f)}


@pytest.mark.timeout(300)
def test_each_row_holds_its_own_steps_loss_across_a_resume(tmp_path):
    log_dir, ckpt = tmp_path / "log", tmp_path / "ckpt.pt"
    cmd = [sys.executable, str(WORKERS_DIR / "log_loss_worker.py"), str(ckpt)]
    env = {"HVD_SCALE_LOG_DIR": str(log_dir)}
    first = run_horovod(cmd + ["--steps", "5", "--save-at", "3", "--twice-at", "2"], np=2,
                        timeout=120, env=env)
    assert (first.stdout + first.stderr).count("log_loss() was called twice for step 2") == 1
    ran = {int(k): v for k, v in worker_results(first, np=2)[0]["logged"].items()}
    assert losses(log_dir / "metrics.csv") == pytest.approx(ran)  # rank 0's, step by step
    resumed = run_horovod(cmd + ["--steps", "7"], np=2, timeout=120, env=env)
    again = {int(k): v for k, v in worker_results(resumed, np=2)[0]["logged"].items()}
    assert sorted(again) == [4, 5, 6, 7]
    logged = losses(log_dir / "metrics.csv")
    assert sorted(logged) == list(range(1, 8))
    # Steps 1-3 from the first run, 4-7 (the first row after the resume too) from the second.
    assert logged == pytest.approx({**{s: ran[s] for s in (1, 2, 3)}, **again})
    assert "log_loss()" not in resumed.stdout + resumed.stderr
