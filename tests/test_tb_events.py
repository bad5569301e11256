"""hvd_scale.tb_events: the CRC, files TensorBoard's own reader accepts, and no TensorFlow import.

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

from hvd_scale.tb_events import FILE_VERSION, EventWriter, crc32c, masked_crc32c

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert crc32c(b"") == 0
    assert 0 <= masked_crc32c(b"123456789") < 2**32


def _records(path: pathlib.Path) -> list[bytes]:
    """Our own TFRecord parse, checking both CRCs of every record."""
    raw, out, pos = path.read_bytes(), [], 0
    while pos < len(raw):
        header = raw[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[pos + 8:pos + 12])[0] == masked_crc32c(header)
        data = raw[pos + 12:pos + 12 + length]
        assert struct.unpack("<I", raw[pos + 12 + length:pos + 16 + length])[0] == masked_crc32c(data)
        out.append(data)
        pos += 16 + length
    return out


def test_tensorboard_reads_scalars(tmp_path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    log_dir = tmp_path / "tb"  # not there yet: the writer creates it
    steps = {
        0: {"loss": 2.5, "lr": 0.1, "gain": 1.0},
        1: {"loss": 1.25, "lr": 0.1 / 3, "gain": math.nan},  # NaN: gain left out at step 1
        5: {"loss": 0.7, "lr": 1e-4, "gain": 3.75},
        7: {"gain": math.nan},  # nothing left: no event at all
    }
    writer = EventWriter(log_dir)
    for step, values in steps.items():
        writer.add_scalars(step, values, wall_time=1000.0 + step)
    writer.flush()
    writer.close()
    writer.close()  # idempotent

    (path,) = log_dir.iterdir()
    name = path.name.split(".")
    assert name[:3] == ["events", "out", "tfevents"] and name[-2:] == [str(os.getpid()), "0"]
    assert len(_records(path)) == 4  # the file_version event and three scalar events

    events = list(LegacyEventFileLoader(str(path)).Load())
    assert events[0].file_version == FILE_VERSION and events[0].wall_time > 0
    assert [e.step for e in events[1:]] == [0, 1, 5]

    acc = ea_mod.EventAccumulator(str(log_dir), size_guidance={ea_mod.SCALARS: 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["gain", "loss", "lr"]
    for tag in ("loss", "lr", "gain"):
        expected = [(s, v[tag]) for s, v in steps.items() if tag in v and not math.isnan(v[tag])]
        got = acc.Scalars(tag)
        assert [e.step for e in got] == [s for s, _ in expected]
        assert [e.wall_time for e in got] == [1000.0 + s for s, _ in expected]
        # simple_value is a float32: compare against the float32 rounding of the input.
        assert [e.value for e in got] == [struct.unpack("<f", struct.pack("<f", v))[0] for _, v in expected]


def test_no_tensorflow_import(tmp_path):
    code = (
        "import sys\n"
        "from hvd_scale.tb_events import EventWriter\n"
        f"w = EventWriter({str(tmp_path / 'tb')!r})\n"
        "w.add_scalars(3, {'loss': 0.5})\n"
        "w.close()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'tensorboard'))\n"
        "print('loaded:', loaded)\n"
        "assert not loaded, loaded\n"
    )
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded: []" in proc.stdout
    assert len(list((tmp_path / "tb").iterdir())) == 1
