"""The floor under the statistics' cost: reading each gradient twice, against a training step.

    .venv/bin/python benchmarks/floor.py        # ~1 min, one process, no Horovod

AdaScale needs |g|^2 of every micro-gradient and |g_bar|^2 of the averaged one: at the least,
each gradient is read twice (two fused ``_foreach_norm`` kernels over the model's gradients). For
each model of benchmarks/torch_overhead.py this times, in one process, a plain training step
(zero_grad, forward, backward, SGD momentum) and those two reads, and reports
floor = 1 + (two reads) / (plain step): the adascale / plain ratio no implementation can beat
on this machine. Under Horovod the plain step is longer (the allreduce), so the floor there is
lower still. Also timed: the same reads as one norm kernel per tensor (a hook per parameter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_overhead import MODELS  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[repeats // 5:])


def run(name: str, batch: int, repeats: int) -> dict:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step_ms = median_ms(step, repeats)
    grads = [p.grad for p in model.parameters()]
    fused_ms = median_ms(lambda: torch.stack(torch._foreach_norm(grads)).square().sum().item(), repeats)
    per_tensor_ms = median_ms(
        lambda: torch.stack([torch.linalg.vector_norm(g) for g in grads]).square().sum().item(), repeats)
    return {"model": name, "tensors": len(grads), "params": sum(g.numel() for g in grads),
            "step_ms": step_ms, "read_fused_ms": fused_ms, "read_per_tensor_ms": per_tensor_ms,
            "floor": 1 + 2 * fused_ms / step_ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp,cnn2d,transformer")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        r = run(name, args.batch, args.repeats)
        print(f"{name}: {r['tensors']} tensors, {r['params']:,} parameters; plain step "
              f"{r['step_ms']:.2f} ms; one read of every gradient {r['read_fused_ms']:.3f} ms "
              f"fused ({r['read_per_tensor_ms']:.3f} ms a kernel per tensor); floor {r['floor']:.3f}")
        print("RESULT " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
