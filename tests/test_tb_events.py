"""The metrics log's TensorBoard files (``hvd_scale.adapters.log``, written by tensorboardX): what
TensorBoard's own reader gets from them, and no TensorFlow import on the way.

TensorBoard is imported here only, as the reference reader.
"""

from __future__ import annotations

import math
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from hvd_scale.adapters.log import MetricsLogger

REPO = pathlib.Path(__file__).resolve().parents[1]


def _float32(value: float) -> float:
    """simple_value is a float32: the rounding TensorBoard gives back."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def test_tensorboard_reads_the_logs_scalars(tmp_path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    steps = {
        1: {"gain": math.nan, "lr": 0.1, "loss": 2.5, "lr_cap": math.inf},  # NaN, inf: left out
        2: {"gain": 1.5, "lr": 0.1 / 3, "loss": 1.25, "lr_cap": 0.4},
        5: {"gain": 3.75, "lr": 1e-4, "loss": 0.7, "lr_cap": 0.2},
    }
    logger = MetricsLogger(tmp_path, progress_bar=False)  # tmp_path/tb is not there yet
    for step, values in steps.items():
        logger.log({"step": float(step), **values})
    logger.close()
    logger.close()  # idempotent

    (path,) = (tmp_path / "tb").iterdir()
    name = path.name.split(".")
    assert name[:3] == ["events", "out", "tfevents"] and name[-2] == str(os.getpid())
    events = list(LegacyEventFileLoader(str(path)).Load())
    assert events[0].file_version == "brain.Event:2" and events[0].wall_time > 0

    acc = ea_mod.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea_mod.SCALARS: 0})
    acc.Reload()
    # The columns given, and those the logger fills itself (NaN when not given: left out, as
    # "step" and "time" are).
    assert sorted(acc.Tags()["scalars"]) == ["hvd_scale/gain", "hvd_scale/loss", "hvd_scale/lr",
                                             "hvd_scale/lr_cap"]
    for tag in ("gain", "lr", "loss", "lr_cap"):
        expected = [(s, v[tag]) for s, v in steps.items() if math.isfinite(v[tag])]
        got = acc.Scalars(f"hvd_scale/{tag}")
        assert [e.step for e in got] == [s for s, _ in expected]
        assert [e.value for e in got] == [_float32(v) for _, v in expected]
        assert all(e.wall_time > 0 for e in got)


def test_a_reopened_log_starts_a_new_file_and_keeps_the_earlier_one(tmp_path):
    logger = MetricsLogger(tmp_path, progress_bar=False)
    for step in (1, 2, 3, 2):  # step 2 again: a restored elastic job replays, the files reopen
        logger.log({"step": float(step), "gain": 1.0 + step})
    logger.close()
    files = sorted((tmp_path / "tb").iterdir())
    assert len(files) == 2 and all(f.stat().st_size > 0 for f in files)


def test_no_tensorflow_import(tmp_path):
    """Neither TensorFlow nor the tensorboard package, in a torch job or any other; and torch
    itself only where it was loaded already (tensorboardX would import it)."""
    code = (
        "import sys\n"
        "from hvd_scale.adapters.log import MetricsLogger\n"
        f"logger = MetricsLogger({str(tmp_path)!r}, progress_bar=False)\n"
        "logger.log({'step': 3.0, 'loss': 0.5, 'lr_cap': float('inf')})\n"
        "logger.close()\n"
        "assert 'tensorboardX' in sys.modules\n"
        "loaded = sorted(m for m in sys.modules\n"
        "                if m.split('.')[0] in ('tensorflow', 'tensorboard', 'keras', 'torch'))\n"
        "print('loaded:', loaded)\n"
        "assert not loaded, loaded\n"
        "import torch\n"  # importable as ever once the log is open
    )
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded: []" in proc.stdout
    assert "NaN or Inf" not in proc.stderr  # tensorboardX's warning: non-finite values are left out
    assert len(list((tmp_path / "tb").iterdir())) == 1
