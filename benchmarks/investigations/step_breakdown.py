"""Where the adascale step's extra time goes (torch adapter against plain Horovod, one job).

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python benchmarks/investigations/step_breakdown.py
    (options: --models cnn,mlp --rounds 12 --per-round 6; set HOROVOD_CYCLE_TIME as the launcher does)

Plain ``hvd.DistributedOptimizer`` and hvd_scale ``adascale`` train the same model in interleaved
rounds; rank 0 prints median milliseconds per step of: forward + backward (where the buckets' norms
and sends and the statistics' enqueue run, each also timed), ``step()``, and inside hvd_scale's
step the parts it adds: waiting for the gradients (Horovod's synchronize), waiting for and
decoding the statistics (the engine's ``wait_sum``), |g_bar|^2 (``mean_sqnorms``), the host side (``on_host``) and in it the engine
(``Policy.step``), and the wrapped optimizer's update. A part called several times a step (a
bucket) is summed per step. Timing wrappers add ~1 us per call.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from torch_overhead import MODELS  # noqa: E402

from hvd_scale.adapters.torch import DistributedOptimizer  # noqa: E402
from hvd_scale.launch.jobs import print_result  # noqa: E402


def timed(obj, name: str, times: list) -> None:
    """Replace obj.name with a wrapper that appends each call's duration to times."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)
    setattr(obj, name, wrapper)


def run(model_name: str, rounds: int, per_round: int, warmup: int) -> dict:
    build, shape = MODELS[model_name]
    times = collections.defaultdict(list)
    torch.manual_seed(0)
    plain_model, ada_model = build(), build()
    plain = hvd.DistributedOptimizer(torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=plain_model.named_parameters())
    ada = DistributedOptimizer(torch.optim.SGD(ada_model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=ada_model.named_parameters(), policy="adascale")
    timed(ada._horovod, "_flush_bucket", times["adascale: a bucket's norms and sends (in backward)"])
    timed(ada._statistics, "start", times["adascale: statistics enqueued (in backward)"])
    timed(ada._hvd_opt, "synchronize", times["adascale: wait for gradients"])
    timed(ada._horovod, "wait_sum", times["adascale: statistics waited for and decoded"])
    timed(ada._horovod, "mean_sqnorms", times["adascale: |g_bar|^2"])
    timed(ada, "on_host", times["adascale: host side (engine, checks, log)"])
    timed(ada.policy, "step", times["adascale: engine"])
    timed(ada._hvd_opt, "step", times["adascale: SGD update"])
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(32, *shape, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    for _ in range(rounds):
        for kind, model, opt in (("plain", plain_model, plain), ("adascale", ada_model, ada)):
            for _ in range(per_round):
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                times[f"{kind}: forward + backward"].append(t1 - t0)
                times[f"{kind}: step()"].append(t2 - t1)
                times[f"{kind}: total"].append(t2 - t0)
    # Per step: a bucket's figure is the sum over the step's buckets (steps x buckets calls).
    steps = rounds * per_round
    per_step = {k: ([sum(v[j * len(v) // steps:(j + 1) * len(v) // steps]) for j in range(steps)]
                    if len(v) > steps else v) for k, v in times.items()}
    return {"model": model_name, "tensors": sum(1 for _ in plain_model.parameters()),
            "median_ms": {k: 1000 * statistics.median(v[warmup:]) for k, v in per_step.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--per-round", type=int, default=6)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args(argv)
    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for name in args.models.split(","):
        result = run(name, args.rounds, args.per_round, args.warmup)
        if hvd.rank() == 0:
            print(f"\n{name} ({result['tensors']} tensors), HOROVOD_CYCLE_TIME="
                  f"{os.environ.get('HOROVOD_CYCLE_TIME', 'default')}: median ms per step")
            for key, ms in result["median_ms"].items():
                print(f"  {key:34s} {ms:8.3f}")
            print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
