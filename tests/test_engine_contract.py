"""The torch engine contract (``adapters/torch/engine.py``) and the step's record
(``hvd_scale.reduce.StepRecord``): every engine meets the Protocol by name and signature, and its
collectives run in a real 2-process job; the record packs and unpacks the step's vector, on the
wire too, for numpy and torch alike.

Adding an engine: one line in ``ENGINES`` (the module and the class meeting ``Engine``).
"""

from __future__ import annotations

import numpy as np
import pytest

from hvd_scale.reduce import WIRE_NARROW, WIRE_WIDE, StepRecord, pack_local, unpack_step

torch = pytest.importorskip("torch")


# ----------------------------------------------------------------------------------------------
# The step's record: one place packs and slices [s..., c, w, q...].

@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_step_record_round_trips_its_vector(xp):
    lib = np if xp == "numpy" else torch

    def array(values):
        return np.array(values, dtype=np.float64) if xp == "numpy" else \
            torch.tensor(values, dtype=torch.float64)
    record = StepRecord(array([8.0, 4.0]), array(4.0), array(2.0))
    local = record.pack(lib)
    assert [float(v) for v in local] == [8.0, 4.0, 4.0, 2.0]  # s_0, s_1, c, w
    back = StepRecord.unpack(local, 2)
    assert [float(v) for v in back.sums] == [8.0, 4.0] and float(back.count) == 4.0
    assert float(back.samples) == 2.0 and back.mean_sqnorms is None
    step = record._replace(mean_sqnorms=array([1.0, 0.5])).pack(lib)
    assert [float(v) for v in step] == [8.0, 4.0, 4.0, 2.0, 1.0, 0.5]  # ..., q_0, q_1
    assert [float(v) for v in StepRecord.unpack(step, 2).mean_sqnorms] == [1.0, 0.5]
    # The host reads the same vector as a record of Python counts.
    host = unpack_step(np.asarray([float(v) for v in step]), 2)
    assert host.count == 4 and isinstance(host.count, int) and host.samples == 2
    assert host.sums.tolist() == [8.0, 4.0] and host.mean_sqnorms.tolist() == [1.0, 0.5]


def test_step_record_on_the_wire_in_float32():
    # A sum past float32's range comes back from its scaled-down copy, a tiny one from its
    # scaled-up copy, the counts rounded after a float32 reduction; q rides too where it is
    # packed (a sharded engine's shards).
    sums = torch.tensor([1e40, 1e-60, 3.0], dtype=torch.float64)
    record = StepRecord(sums, torch.tensor(3.0, dtype=torch.float64),
                        torch.tensor(1.0, dtype=torch.float64),
                        torch.tensor([2.0, 1e-60, 1e40], dtype=torch.float64))
    wire = record.to_wire(torch)
    assert wire.numel() == 3 * 3 + 2 + 3 * 3
    assert wire[3].item() == pytest.approx(1e40 * WIRE_WIDE) and wire[7].item() == pytest.approx(
        1e-60 * WIRE_NARROW)
    summed = (wire.float() * 2).double()
    summed[9] += 1e-3  # a count a float rounding away
    back = StepRecord.from_wire(summed, 3, torch)
    assert back.sums.tolist() == pytest.approx([2e40, 2e-60, 6.0], rel=1e-6)
    assert back.mean_sqnorms.tolist() == pytest.approx([4.0, 2e-60, 2e40], rel=1e-6)
    assert back.count.item() == 6.0 and back.samples.item() == 2.0
    # Without q the wire is [s x 3, c, w], as pack_local's vector is [s, c, w].
    assert StepRecord.from_wire(record._replace(mean_sqnorms=None).to_wire(torch), 3,
                                torch).mean_sqnorms is None
    assert pack_local([1.0, 2.0], 3, samples=1).tolist() == [1.0, 2.0, 3.0, 1.0]
