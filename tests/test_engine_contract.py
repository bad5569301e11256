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


# ----------------------------------------------------------------------------------------------
# Every engine against the Protocol. Adding an engine: one line here.

import dataclasses  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402

from hvdrun import WORKERS_DIR, run_horovod, run_torchrun, worker_results  # noqa: E402


@dataclasses.dataclass(frozen=True)
class EngineCase:
    module: str  # where its public DistributedOptimizer is
    engine: str  # the class meeting engine.Engine, in that module
    launcher: str  # "horovodrun" or "torchrun"
    wrap: str  # how the worker wraps the model: "none", "ddp", "fully_shard"
    sharded: bool = False
    tensor_hooks: bool = True  # per-pass norms by a tensor hook per parameter (samples="passes")


ENGINES = [
    EngineCase("hvd_scale.adapters.torch.horovod", "HorovodEngine", "horovodrun", "none"),
    EngineCase("hvd_scale.adapters.torch.ddp", "DDPEngine", "torchrun", "ddp"),
    EngineCase("hvd_scale.adapters.torch.fsdp", "FSDPEngine", "torchrun", "fully_shard",
               sharded=True, tensor_hooks=False),
]
NP = 2


def _engine_class(case: EngineCase):
    return getattr(importlib.import_module(case.module), case.engine)


@pytest.mark.parametrize("case", ENGINES, ids=lambda c: c.engine)
def test_engine_meets_the_contract_by_name_and_signature(case):
    from hvd_scale.adapters.torch import engine as contract

    cls = _engine_class(case)
    assert set(contract.ATTRIBUTES) | set(contract.METHODS) == \
        {name for name in vars(contract.Engine) if not name.startswith("_")} | \
        set(contract.Engine.__annotations__), "engine.py's lists and the Protocol differ"
    for name in contract.METHODS:
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} has no method {name}"
        want = inspect.signature(getattr(contract.Engine, name))
        got = inspect.signature(method)
        assert [(p.name, p.kind) for p in got.parameters.values()] == \
            [(p.name, p.kind) for p in want.parameters.values()], \
            f"{cls.__name__}.{name}{got} differs from the contract's {name}{want}"
    # The public optimizer is a TorchOptimizer built from it, not a subclass of the engine.
    from hvd_scale.adapters.torch.optimizer import TorchOptimizer
    public = importlib.import_module(case.module).DistributedOptimizer
    assert issubclass(public, TorchOptimizer) and not issubclass(public, cls)
    assert not issubclass(cls, TorchOptimizer)


@pytest.fixture(scope="module")
def jobs():
    """Each engine's 2-process job, once for the module; its ranks' reports."""
    out = {}
    for case in ENGINES:
        args = [str(WORKERS_DIR / "engine_contract_worker.py"), case.module, case.wrap]
        if case.launcher == "horovodrun":
            proc = run_horovod(["python", *args], np=NP, timeout=240)
        else:
            proc = run_torchrun(args, nproc=NP, timeout=240)
        out[case.engine] = worker_results(proc, np=NP)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ENGINES, ids=lambda c: c.engine)
def test_engine_collectives_steps_and_close_in_a_two_process_job(jobs, case):
    ranks = jobs[case.engine]
    for r in ranks:
        assert r["class"] == case.engine and r["protocol"], r
        assert r["types"] == ["str", "bool", "bool", True] and r["size"] == NP
        # sum of [r + 1, 10 (r + 1), -r] over ranks 0, 1, as float64
        assert r["wait_sum"] == [3.0, 30.0, -1.0] and r["wait_sum_dtype"] == "torch.float64"
        assert r["average"] == [1.5] and r["in_step_between_steps"] is False
        # two steps of k = 2 and one of k = 1 (set_passes -> follow_passes): S = W k each time
        assert r["steps"] == 3 and r["passes"] == 1 and r["scale"] == NP * 1
        assert np.isfinite(r["sigma2"]) and r["gain"] >= 1.0
        # per-pass norms took a tensor hook per parameter; close() removed them, and the
        # engine's own reduction still averages the gradients after it
        assert (r["hooks_before_close"] > 0) == case.tensor_hooks and r["hooks_after_close"] == 0
        assert "step() after opt.close()" in r["step_after_close"]
        if not case.sharded:
            assert r["after_close_spread"] == pytest.approx(0.0, abs=1e-7)
    # the ranks applied the same steps
    assert len({(r["gain"], r["sigma2"], r["weights"]) for r in ranks}) == 1, ranks
