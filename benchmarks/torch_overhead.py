"""B2: step time of the torch adapter against plain ``hvd.DistributedOptimizer``.

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python benchmarks/torch_overhead.py

#50 (the statistics' cost against k; 3 horovodrun jobs per command, both written beside each other
into results/samples_cost.md/.json; ~8 and ~12 minutes on a quiet 2-core machine):

    .venv/bin/python benchmarks/torch_overhead.py --repeats 3 --out samples_cost \
        --models mlp,transformer_adam --passes 1,4,16,64 --steps 60,24,6,3 --rounds 10,6,6,3 \
        --warmup 2,1,1,1 \
        --variants plain,none,adascale,adascale/passes,adascale_adam,adascale_adam/passes
    .venv/bin/python benchmarks/torch_overhead.py --repeats 3 --out samples_cost \
        --models cnn,cnn2d --passes 1,4,16,64 --steps 20,8,4,2 --rounds 10,4,4,2 \
        --warmup 2,1,1,1 --variants plain,none,adascale,adascale/passes

With --repeats the script is the driver: it starts that many jobs of itself under
``horovodrun -np 2 -H localhost:2 --gloo`` (one thread per process, Horovod's default cycle).

Variants, interleaved round by round in one job so that machine noise hits all of them alike:
    plain     hvd.DistributedOptimizer(SGD)
    none      hvd_scale DistributedOptimizer, policy none (no statistics)
    adascale  hvd_scale DistributedOptimizer, policy adascale (samples "auto": per-worker
              statistics from two workers on)
    adascale/passes          the same with samples="passes" (the per-pass estimator)
    adascale_adam[/passes]   policy adascale_adam: on Adam's models (transformer_adam) in place
              of adascale, which refuses Adam; each is skipped where it does not apply
Models: a 1-D CNN with > 1M parameters, an MLP with > 100 small parameter tensors, a 2-D CNN
with many parameters per FLOP, B4's Transformer (69 tensors), and transformer_adam: the same
Transformer with Adam (lr 1e-3) as every variant's inner optimizer (SGD, momentum 0.9, elsewhere).
Reported: median step time (zero_grad, k x (forward + backward), step), and each variant's ratio to
plain (and to none) paired round by round (benchmarks/timing.py). --passes, --steps, --rounds and
--warmup take one value or one per k.
"""

from __future__ import annotations

import argparse
import os
import pathlib
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
# Models trained with Adam (every variant's inner optimizer): name -> the MODELS entry.
ADAM_MODELS = {"transformer_adam": "transformer"}


def model_spec(name: str):
    """(build, input shape, inner optimizer "sgd" | "adam") of a model name."""
    build, shape = MODELS[ADAM_MODELS.get(name, name)]
    return build, shape, "adam" if name in ADAM_MODELS else "sgd"


def variant_kind(kind: str) -> tuple[str, str]:
    """(policy, samples) of a variant name: "adascale/passes" is policy adascale, samples="passes"."""
    policy, _, samples = kind.partition("/")
    return policy, samples or "auto"


def inner_optimizer(model: torch.nn.Module, inner: str = "sgd") -> torch.optim.Optimizer:
    if inner == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def make_variant(kind: str, model: torch.nn.Module, passes: int = 1, inner: str = "sgd"):
    base = inner_optimizer(model, inner)
    if kind == "plain":
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        backward_passes_per_step=passes)
    policy, samples = variant_kind(kind)
    return DistributedOptimizer(base, named_parameters=model.named_parameters(), policy=policy,
                                backward_passes_per_step=passes, samples=samples)


def kinds_for(model_name: str, kinds) -> tuple:
    """The variants that apply to a model: adascale_adam where the inner optimizer is Adam,
    adascale (whose theory is SGD's; it refuses Adam) where it is SGD."""
    adam = model_spec(model_name)[2] == "adam"
    return tuple(k for k in kinds if variant_kind(k)[0] != ("adascale" if adam else "adascale_adam"))


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
    return timing.summarize(times, baseline, also=("none",))


def run(model_name: str, steps: int, warmup: int, batch: int, rounds: int,
        kinds=("plain", "none", "adascale"), passes: int = 1) -> dict:
    build, shape, inner = model_spec(model_name)
    kinds = kinds_for(model_name, kinds)
    variants = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = build()
        variants[kind] = (model, make_variant(kind, model, passes, inner))
    first = next(iter(variants.values()))[0]
    params = sum(p.numel() for p in first.parameters())
    tensors = sum(1 for _ in first.parameters())
    out = {"model": model_name, "params": params, "tensors": tensors, "batch": batch,
           "passes": passes, "k": passes, "inner": inner, "workers": hvd.size(),
           **time_interleaved(variants, shape, batch, hvd.rank(), steps, warmup, rounds,
                              baseline=kinds[0], passes=passes)}
    return out


def drive(args, argv) -> int:
    """--repeats horovodrun jobs of this script; their rows into results/<out>.md/.json
    (timing.record_samples_cost: #50's table, one engine of several)."""
    import shlex

    from hvd_scale.launch.jobs import horovodrun_command

    job_args = [a for i, a in enumerate(argv) if a not in ("--repeats", "--out")
                and (i == 0 or argv[i - 1] not in ("--repeats", "--out"))]
    job_args = [a for a in job_args if not a.startswith(("--repeats=", "--out="))]
    python = pathlib.Path(sys.executable).parent / "python"
    cmd = horovodrun_command([python, "benchmarks/torch_overhead.py", *job_args], 2,
                             controller="gloo")
    return timing.drive_samples_cost(
        cmd, {}, args.repeats, args.out, "horovod",
        f".venv/bin/python benchmarks/torch_overhead.py {shlex.join(argv)}", "plain")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--steps", default="180", help="measured steps per variant (one, or one per k)")
    p.add_argument("--warmup", default="10", help="untimed steps (one, or one per k)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", default="30", help="interleaving rounds (one, or one per k)")
    p.add_argument("--variants", default="plain,none,adascale")
    p.add_argument("--passes", default="1", help="k backward passes per step (every variant); "
                   "comma-separated: each k in turn")
    p.add_argument("--repeats", type=int, default=None,
                   help="the driver: this many horovodrun -np 2 jobs, into results/<out>")
    p.add_argument("--out", default="samples_cost", help="the driver: results/<out>.md and .json")
    args = p.parse_args(argv)
    if args.repeats:
        return drive(args, argv)
    passes = [int(v) for v in args.passes.split(",")]
    steps, warmup, rounds = (timing.per_k(getattr(args, w), passes, w)
                             for w in ("steps", "warmup", "rounds"))
    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for name in args.models.split(","):
        for i, k in enumerate(passes):
            result = run(name, steps[i], warmup[i], args.batch, min(rounds[i], steps[i]),
                         tuple(args.variants.split(",")), k)
            if hvd.rank() == 0:
                print_result({"rank": 0, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
