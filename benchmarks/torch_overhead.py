"""B2: step time of the torch adapter against plain ``hvd.DistributedOptimizer``.

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python benchmarks/torch_overhead.py

Variants, interleaved round by round in one job so that machine noise hits all of them alike:
    plain     hvd.DistributedOptimizer(SGD)
    none      hvd_scale DistributedOptimizer, policy none (no statistics)
    adascale  hvd_scale DistributedOptimizer, policy adascale
Models: a 1-D CNN with > 1M parameters, an MLP with > 100 small parameter tensors, a 2-D CNN
with many parameters per FLOP, and B4's Transformer (69 tensors).
Reported: median step time (forward + backward + step), and each variant's ratio to plain paired
round by round (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import horovod.torch as hvd
import torch

from hvd_scale.adapters.torch import DistributedOptimizer
from hvd_scale.launch.jobs import print_result

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402


def cnn() -> torch.nn.Module:
    # ~1.06M parameters, most in the convolutions: compute-bound per step.
    return torch.nn.Sequential(
        torch.nn.Conv1d(1, 64, 5, padding=2), torch.nn.ReLU(),
        torch.nn.Conv1d(64, 128, 5, padding=2), torch.nn.ReLU(),
        torch.nn.Conv1d(128, 256, 5, padding=2), torch.nn.ReLU(),
        torch.nn.Conv1d(256, 256, 5, padding=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool1d(8), torch.nn.Flatten(), torch.nn.Linear(256 * 8, 256),
        torch.nn.ReLU(), torch.nn.Linear(256, 10))


def mlp() -> torch.nn.Module:
    # 60 linear layers of 32 units: 120 small parameter tensors, so per-tensor costs show.
    layers = [torch.nn.Flatten(), torch.nn.Linear(40, 32)]
    for _ in range(59):
        layers += [torch.nn.Tanh(), torch.nn.Linear(32, 32)]
    layers[-1] = torch.nn.Linear(32, 10)
    return torch.nn.Sequential(*layers)


def cnn2d() -> torch.nn.Module:
    # 2-D convolutions, 1.42M parameters in 10 tensors, most in one Linear: many parameters per
    # FLOP, so the statistics' reads weigh more than in the 1-D CNN (a model a new user tries).
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(128, 256, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(256 * 4 * 4, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10))


class _TransformerBench(torch.nn.Module):
    """B4's Transformer (examples/torch_translate.py: 2 + 2 layers, d_model 64) on token ids made
    from the benchmark's float input; the logits of the first 10 target words, averaged over
    positions, are the 10 classes the benchmark's loss expects."""

    SRC, TGT, VOCAB = 20, 24, 64

    def __init__(self):
        super().__init__()
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
        from torch_translate import Translator

        self.model = Translator(self.VOCAB, self.VOCAB)

    def forward(self, x):
        ids = (x.abs() * 16).long().clamp(max=self.VOCAB - 1)
        return self.model(ids[:, :self.SRC], ids[:, self.SRC:])[:, :, :10].mean(1)


def transformer() -> torch.nn.Module:
    return _TransformerBench()


MODELS = {"cnn": (cnn, (1, 40)), "mlp": (mlp, (40,)), "cnn2d": (cnn2d, (3, 16, 16)),
          "transformer": (transformer, (_TransformerBench.SRC + _TransformerBench.TGT,))}


def make_variant(kind: str, model: torch.nn.Module, passes: int = 1):
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if kind == "plain":
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        backward_passes_per_step=passes)
    return DistributedOptimizer(base, named_parameters=model.named_parameters(), policy=kind,
                                backward_passes_per_step=passes)


def time_interleaved(variants: dict, shape, batch: int, rank: int, steps: int, warmup: int,
                     rounds: int, baseline: str = "plain", passes: int = 1) -> dict:
    """Step times (zero_grad, k x (forward, backward), step) of each variant {kind: (model, opt)},
    taking turns in `rounds` rounds (benchmarks/timing.py: ratios paired round by round).
    Every rank's step ends in the same collectives, so one rank's times speak for the job."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step_of(model, opt):
        def step():
            opt.zero_grad()
            for _ in range(passes):
                loss_fn(model(x), y).backward()
            opt.step()
        return step

    times = timing.interleave({kind: step_of(*v) for kind, v in variants.items()}, rounds,
                              max(1, steps // rounds), warmup)
    return timing.summarize(times, baseline)


def run(model_name: str, steps: int, warmup: int, batch: int, rounds: int,
        kinds=("plain", "none", "adascale"), passes: int = 1) -> dict:
    build, shape = MODELS[model_name]
    variants = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = build()
        variants[kind] = (model, make_variant(kind, model, passes))
    first = next(iter(variants.values()))[0]
    params = sum(p.numel() for p in first.parameters())
    tensors = sum(1 for _ in first.parameters())
    out = {"model": model_name, "params": params, "tensors": tensors, "batch": batch,
           "passes": passes, "workers": hvd.size(),
           **time_interleaved(variants, shape, batch, hvd.rank(), steps, warmup, rounds,
                              baseline=kinds[0], passes=passes)}
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--steps", type=int, default=180, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=30, help="interleaving rounds")
    p.add_argument("--variants", default="plain,none,adascale")
    p.add_argument("--passes", type=int, default=1, help="k backward passes per step (every variant)")
    args = p.parse_args(argv)
    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for name in args.models.split(","):
        result = run(name, args.steps, args.warmup, args.batch, args.rounds,
                     tuple(args.variants.split(",")), args.passes)
        if hvd.rank() == 0:
            print_result({"rank": 0, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
