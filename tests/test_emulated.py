"""The emulated accelerator cluster (benchmarks/emulated.py): its modelled waits are accounted as
the profile says, evaluation is not emulated, and under torchrun the gradients' collectives are the
real ones (the ranks end with the same weights) with the link's hook on them. No timing is asserted:
what is checked is what the device records, not how long the machine took."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import emulated  # noqa: E402

PROFILE = emulated.Profile("test", t0=2e-3, t_sample=1e-4, grad_bytes=1e6, bandwidth=1e9, latency=1e-4)


def test_profile_formulas():
    assert PROFILE.pass_time(32) == pytest.approx(2e-3 + 32e-4)
    assert PROFILE.allreduce_time(1) == 0.0  # one worker: no collective
    # ring all-reduce: latency + 2 (W - 1) / W x bytes / bandwidth
    assert PROFILE.allreduce_time(4) == pytest.approx(1e-4 + 2 * 3 / 4 * 1e6 / 1e9)
    assert PROFILE.allreduce_time(4, fraction=0.5) == pytest.approx(1e-4 + 0.75 * 1e6 / 1e9)
    assert PROFILE.step_time(32, 3, 4) == pytest.approx(3 * PROFILE.pass_time(32) + PROFILE.allreduce_time(4))
    assert PROFILE.without_link().allreduce_time(8) == 0.0
    assert set(emulated.PROFILES) >= {"a100-resnet50"}


def test_device_pads_training_passes_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    device = emulated.Device(PROFILE).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for passes, batch in ((1, 5), (3, 7)):
        for _ in range(passes):
            model(torch.randn(batch, 4)).pow(2).mean().backward()
        opt.step()
        device.step_done()
        opt.zero_grad()
    model.eval()  # evaluation: real CPU only, no pass counted
    with torch.no_grad():
        model(torch.randn(100, 4))
    model.train()
    device.step_done()  # no training pass since the last step: nothing recorded
    assert [s[3] for s in device.steps] == [1, 3]
    assert [s[1] for s in device.steps] == pytest.approx([PROFILE.pass_time(5), 3 * PROFILE.pass_time(7)])
    # The waits were taken (the model's real passes are far shorter than t(b)) and are no more
    # than the modelled time.
    modelled = sum(s[1] for s in device.steps)
    assert 0 < device.slept <= modelled + 1e-9
    summary = device.summary(rank=0)
    assert summary["passes"] == 4 and summary["steps"] == 2


WORKER = textwrap.dedent("""
    import contextlib, json, sys
    sys.path.insert(0, {benchmarks!r})
    import emulated
    emulated.install(emulated.Profile("test", t0=2e-3, t_sample=1e-4, grad_bytes=1e6,
                                      bandwidth=1e9, latency=1e-4))
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from hvd_scale.adapters.torch import ddp
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    net = DistributedDataParallel(model)
    opt = ddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), net,
                                   policy="adascale", backward_passes_per_step=2, scale=4)
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(3):
        opt.zero_grad()
        for i in range(2):
            with net.no_sync() if i == 0 else contextlib.nullcontext():
                net(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
        opt.step()
    sys.stdout.write("WEIGHTS " + json.dumps([p.detach().flatten().tolist()
                                             for p in model.parameters()]) + "\\n")
    sys.stdout.flush()
    del net, opt
    dist.destroy_process_group()
""")


def test_emulated_workers_use_the_real_collectives(tmp_path):
    from hvd_scale.launch.jobs import torchrun_command

    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(benchmarks=str(ROOT / "benchmarks")))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(torchrun_command([sys.executable, str(script)], 2), capture_output=True,
                          text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = emulated.read_emulated(proc.stdout)
    weights = [json.loads(line.split("WEIGHTS ", 1)[1]) for line in proc.stdout.splitlines()
               if "WEIGHTS " in line]
    assert [r["rank"] for r in ranks] == [0, 1] and len(weights) == 2
    # Different data on each rank, the same weights after: the gradients were averaged by the
    # real allreduce (through the link's hook).
    assert weights[0] == weights[1]
    for r in ranks:
        assert r["world"] == 2 and r["steps"] == 3 and r["passes"] == 6
        per_step = 2 * PROFILE.pass_time(6) + PROFILE.allreduce_time(2)
        assert r["modelled"] == pytest.approx(3 * per_step)  # the link's wait was taken per step
