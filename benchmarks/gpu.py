"""B2 on GPUs: the torch adapter's step time and host synchronizations on CUDA with NCCL.

    horovodrun -np <GPUs> -H localhost:<GPUs> python benchmarks/gpu.py            # ~2 min
    horovodrun -np 1 -H localhost:1 python benchmarks/gpu.py --models cnn --steps 20

Needs a CUDA build of torch and Horovod built with NCCL (``HOROVOD_GPU_OPERATIONS=NCCL``; see
README "GPUs"). One process per GPU (``hvd.local_rank()``). Measures, per model of
benchmarks/torch_overhead.py (the 1-D CNN, the 120-tensor MLP, the 2-D CNN with many
parameters per FLOP, B4's Transformer):

* median step time of plain ``hvd.DistributedOptimizer``, hvd_scale ``none`` and ``adascale``,
  interleaved round by round, each step ending in ``torch.cuda.synchronize()`` so that the
  asynchronous GPU work is inside the time (ratios to plain, paired round by round:
  benchmarks/timing.py);
* host synchronizations per step, counted by torch's CUDA sync debug mode: plain Horovod has
  none of its own; hvd_scale's design has one (the statistics' ``tolist()``), or one bool for
  ``none`` (the finiteness check) -- any more is a regression;
* the statistics on the device agree with the same job's CPU arithmetic: the gain of the first
  adascale steps is recomputed from the norms read back.

Prints one ``RESULT {json}`` line per model on rank 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import timing  # noqa: E402
from hvd_scale.launch.jobs import print_result  # noqa: E402
from torch_overhead import MODELS, make_variant  # noqa: E402


def count_syncs(fn) -> int:
    """Host synchronizations fn() makes (torch's CUDA sync debug mode warns at each)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run(name: str, steps: int, warmup: int, batch: int, rounds: int) -> dict:
    build, shape = MODELS[name]
    device = torch.device("cuda", hvd.local_rank())
    variants = {}
    for kind in ("plain", "none", "adascale"):
        torch.manual_seed(0)
        model = build().to(device)
        variants[kind] = (model, make_variant(kind, model))
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(batch, *shape, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(model, opt):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    def timed(model, opt):
        def fn():  # the GPU's work inside the time
            torch.cuda.synchronize()
            step(model, opt)
            torch.cuda.synchronize()
        return fn

    summary = timing.summarize(timing.interleave({k: timed(*v) for k, v in variants.items()},
                                                 rounds, max(1, steps // rounds), warmup), "plain")
    out = {"model": name, "device": torch.cuda.get_device_name(device), "workers": hvd.size(),
           "params": sum(p.numel() for p in variants["plain"][0].parameters()),
           "tensors": sum(1 for _ in variants["plain"][0].parameters()), "batch": batch}
    for kind in variants:
        out[kind] = {**summary[kind], "host_syncs_per_step": count_syncs(lambda: step(*variants[kind]))}
    out["adascale"]["gain"] = variants["adascale"][1].gain
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp,cnn2d,transformer")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    hvd.init()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs CUDA: torch.cuda.is_available() is False")
    if not hvd.nccl_built():
        raise SystemExit("benchmarks/gpu.py needs Horovod built with NCCL "
                         "(HOROVOD_GPU_OPERATIONS=NCCL): hvd.nccl_built() is False")
    torch.cuda.set_device(hvd.local_rank())
    for name in args.models.split(","):
        result = run(name, args.steps, args.warmup, args.batch, args.rounds)
        if hvd.rank() == 0:
            print_result({"rank": 0, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
