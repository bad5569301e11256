"""DDP scripts under torchrun end with exit 0 on a loaded machine: their Gloo process group is
freed before the interpreter's exit, not during it.

torch 2.13 (CPython 3.11): DDP's reference cycles keep the process group alive after
``dist.destroy_process_group()``, so the collector frees it during the interpreter's exit; its
destructor joins the Gloo threads, and one that still has Python to run then (descheduled on a
loaded machine right after the last collective) is ended with pthread_exit: ``terminate called
without an active exception``, SIGABRT, torchrun exit 1 after training finished.
tests/workers/teardown_probe.py makes that certain instead of occasional (a callback still in
Python at the script's ``destroy_process_group()``) and counts the Gloo threads left at exit.
docs/troubleshooting.md says what a user's script can do.
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hvdrun import WORKERS_DIR, run_torchrun  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"
PROBE = WORKERS_DIR / "teardown_probe.py"


def _probe(script: Path, *args: str, policy: str | None = None):
    env = {"TEARDOWN_PENDING": "1", **({"HVD_SCALE_POLICY": policy} if policy else {})}
    return run_torchrun([str(PROBE), str(script), *args], env=env, timeout=150, check=False)


KNOWN_HELD: dict[str, str] = {}  # a script whose group is known to live to the exit: why


@pytest.mark.timeout(240)
def test_ddp_examples_free_their_process_group_before_the_exit():
    runs = [("ddp_before", EXAMPLES / "ddp_before.py", None),
            ("ddp_after", EXAMPLES / "ddp_after.py", "adascale")]
    with ThreadPoolExecutor(len(runs)) as pool:  # start-up dominates: both jobs at once
        done = list(pool.map(lambda run: _probe(run[1], "--steps", "3", policy=run[2]), runs))
    failed, known = [], []
    for (name, _, _), proc in zip(runs, done):
        out = proc.stdout + proc.stderr
        left = re.findall(r"GLOO_THREADS_AT_EXIT (\d+)", out)
        ok = proc.returncode == 0 and len(left) == 2 and set(left) == {"0"}
        if ok and name in KNOWN_HELD:
            failed.append(f"{name} now frees its process group: drop it from KNOWN_HELD")
        elif not ok:
            (known if name in KNOWN_HELD else failed).append(
                f"{name}: exit {proc.returncode}, Gloo threads at exit {left}, aborted: "
                f"{'terminate called' in out}\n{out[-1500:]}")
    assert not failed, "\n".join(failed)
    if known:
        pytest.xfail("; ".join(KNOWN_HELD.values()))
