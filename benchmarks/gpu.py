"""B2 on GPUs: the torch adapter's step time and host synchronizations on CUDA, under Horovod (NCCL) or DDP (NCCL).

    horovodrun -np <GPUs> -H localhost:<GPUs> python benchmarks/gpu.py            # Horovod, ~2 min
    horovodrun -np 1 -H localhost:1 python benchmarks/gpu.py --models cnn --steps 20
    torchrun --nproc-per-node <GPUs> benchmarks/gpu.py --engine ddp               # DDP, ~3 min
    torchrun --nproc-per-node 2 benchmarks/gpu.py --engine ddp --device cpu --models mlp \\
        --steps 4 --rounds 2 --warmup 1                                           # CPU self-check

**Not run on a GPU yet** (no machine with one so far): both engines have been run only with
``--device cpu`` (Gloo, the CPU self-check above, under torchrun and ``horovodrun --gloo -np 2``:
the timing loop, the CPU recomputation of the gain -- device float32 against float64, gain within
3e-6 at k = 4 on the MLP -- and the result lines); the host-synchronization count, NCCL and TF32
are CUDA's and untested.

``--engine horovod`` (the default) needs a CUDA build of torch and Horovod built with NCCL
(``HOROVOD_GPU_OPERATIONS=NCCL``; see README "GPUs"). ``--engine ddp`` needs a CUDA build of
torch (NCCL comes with it) and ``torchrun``; Horovod only importable, a CPU build is enough
(benchmarks/torch_overhead.py, which holds the models, imports it). One process per GPU (the
local rank's). Measures, per model of benchmarks/torch_overhead.py (the 1-D CNN, the 120-tensor
MLP, the 2-D CNN with many parameters per FLOP, B4's Transformer) and per k of ``--passes``:

* median step time (zero_grad, k x (forward, backward), step) of the baseline -- plain
  ``hvd.DistributedOptimizer`` (horovod), plain DDP + SGD (ddp: the first k - 1 passes under
  ``no_sync()``, each pass's loss / k) -- and of hvd_scale ``none`` and ``adascale`` (the
  engine's ``DistributedOptimizer``: ``hvd_scale.adapters.torch`` or
  ``hvd_scale.adapters.torch.ddp``), interleaved round by round, each step ending in
  ``torch.cuda.synchronize()`` so that the asynchronous GPU work is inside the time (ratios to
  the baseline, paired round by round: benchmarks/timing.py);
* host synchronizations per step, counted by torch's CUDA sync debug mode: plain Horovod and
  plain DDP have none of their own; hvd_scale's design has one (the statistics' ``tolist()``),
  or one bool for ``none`` (the finiteness check) -- any more is a regression;
* the statistics on the device agree with a CPU recomputation: for the first ``--check-steps``
  steps of a fresh adascale run, every rank's k micro-gradients are recomputed on the CPU in
  float64 from the device model's weights before the step, gathered, and handed to the policy
  (``Policy.transition``, as tests/workers/engines_worker.py's one-process reference does); its
  gain, sigma2 and mu2 are compared with the optimizer's after the device step (TF32 off during
  the check; ``agrees``: the gain within ``--rtol``).

Prints one ``RESULT {json}`` line per (model, k) on rank 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import timing  # noqa: E402
from hvd_scale.launch.jobs import print_result  # noqa: E402

MODEL_NAMES = ["cnn", "mlp", "cnn2d", "transformer"]


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


class HorovodEngine:
    """horovodrun, Horovod's ``DistributedOptimizer``s (plain and hvd_scale's)."""

    kinds = ("plain", "none", "adascale")

    def __init__(self, device_kind: str):
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        if device_kind == "cuda" and not hvd.nccl_built():
            raise SystemExit("benchmarks/gpu.py needs Horovod built with NCCL "
                             "(HOROVOD_GPU_OPERATIONS=NCCL): hvd.nccl_built() is False")
        self.rank, self.world, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()

    def build(self, kind, model, k):
        from torch_overhead import make_variant

        return model, make_variant(kind, model, k)

    def step(self, kind, model, opt, xs, ys, k, loss_fn):
        opt.zero_grad()
        for j in range(k):
            loss_fn(model(xs[j]), ys[j]).backward()
        opt.step()

    def gather(self, obj) -> list:
        return self.hvd.allgather_object(obj)


class DDPEngine:
    """torchrun, a DistributedDataParallel model: plain (torch's SGD) and hvd_scale's
    ``hvd_scale.adapters.torch.ddp.DistributedOptimizer``."""

    kinds = ("ddp", "none", "adascale")

    def __init__(self, device_kind: str):
        import torch.distributed as dist

        self.dist = dist
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_kind == "cuda":
            torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device_kind = device_kind

    def build(self, kind, model, k):
        from torch.nn.parallel import DistributedDataParallel

        from hvd_scale.adapters.torch.ddp import DistributedOptimizer

        ddp = DistributedDataParallel(
            model, device_ids=[self.local_rank] if self.device_kind == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        if kind != "ddp":
            opt = DistributedOptimizer(opt, ddp, policy=kind, backward_passes_per_step=k)
        return ddp, opt

    def step(self, kind, model, opt, xs, ys, k, loss_fn):
        from ddp_overhead import ddp_step

        ddp_step(kind, model, opt, xs, ys, k, loss_fn)

    def gather(self, obj) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out


def _models():
    """benchmarks/torch_overhead.py's models (it imports horovod.torch at its top)."""
    try:
        from torch_overhead import MODELS
    except ImportError as e:
        raise SystemExit(f"benchmarks/gpu.py takes its models from benchmarks/torch_overhead.py, "
                         f"which imports Horovod (a CPU build is enough for --engine ddp): {e}")
    return MODELS


def _data(shape, batch, k, rank, device):
    g = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(batch, *shape, generator=g) for _ in range(k)]
    ys = [torch.randint(0, 10, (batch,), generator=g) for _ in range(k)]
    return [x.to(device) for x in xs], [y.to(device) for y in ys]


def check_gain(engine, build, shape, batch, k, device, steps: int) -> dict:
    """The first ``steps`` adascale steps on the device against the policy fed the statistics
    of every rank's micro-gradients recomputed on the CPU in float64 (relative differences)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        module = build().to(device)
        model, opt = engine.build("adascale", module, k)
        policy = opt.policy
        state, scale = policy.init(), float(opt.scale)
        xs, ys = _data(shape, batch, k, engine.rank, device)
        cpu_xs = [x.cpu().double() for x in xs]
        cpu_ys = [y.cpu() for y in ys]
        loss_fn = torch.nn.CrossEntropyLoss()
        rows = []
        for _ in range(steps):
            copy = build().double()
            copy.load_state_dict({n: t.detach().cpu().double() for n, t in module.state_dict().items()})
            params = list(copy.parameters())
            mine = []
            for j in range(k):
                grads = torch.autograd.grad(loss_fn(copy(cpu_xs[j]), cpu_ys[j]), params)
                mine.append(torch.cat([g.reshape(-1) for g in grads]).numpy())
            micro = torch.stack([torch.from_numpy(v) for each in engine.gather(mine) for v in each])
            mean = micro.mean(0)
            state, _ = policy.transition(state, float(micro.square().sum()),
                                         float(mean.square().sum()), len(micro), scale=scale)
            engine.step("adascale", model, opt, xs, ys, k, loss_fn)
            cpu = policy.estimator(state, scale)
            row = {"gain_device": opt.gain, "gain_cpu": policy.gain(state, scale),
                   "sigma2_device": opt.sigma2, "sigma2_cpu": cpu.sigma2,
                   "mu2_device": opt.mu2, "mu2_cpu": cpu.mu2}
            for key in ("gain", "sigma2", "mu2"):
                a, b = row[f"{key}_device"], row[f"{key}_cpu"]
                row[f"{key}_rel"] = abs(a - b) / max(abs(b), 1e-300)
            rows.append(row)
        return {"steps": rows, "scale": scale,
                **{f"max_{key}_rel": max(r[f"{key}_rel"] for r in rows)
                   for key in ("gain", "sigma2", "mu2")}}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def run(engine, name: str, k: int, args, device) -> dict:
    build, shape = _models()[name]
    baseline = engine.kinds[0]
    variants = {}
    for kind in engine.kinds:
        torch.manual_seed(0)
        variants[kind] = engine.build(kind, build().to(device), k)
    xs, ys = _data(shape, args.batch, k, engine.rank, device)
    loss_fn = torch.nn.CrossEntropyLoss()
    cuda = device.type == "cuda"

    def step_of(kind):
        model, opt = variants[kind]
        return lambda: engine.step(kind, model, opt, xs, ys, k, loss_fn)

    def timed(kind):
        step = step_of(kind)

        def fn():  # the GPU's work inside the time
            if cuda:
                torch.cuda.synchronize()
            step()
            if cuda:
                torch.cuda.synchronize()
        return fn

    summary = timing.summarize(timing.interleave({kind: timed(kind) for kind in variants},
                                                 args.rounds, max(1, args.steps // args.rounds),
                                                 args.warmup), baseline)
    first = variants[baseline][0]
    first = getattr(first, "module", first)
    out = {"model": name, "engine": args.engine, "k": k,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "workers": engine.world, "params": sum(p.numel() for p in first.parameters()),
           "tensors": sum(1 for _ in first.parameters()), "batch": args.batch}
    for kind in variants:
        syncs = count_syncs(step_of(kind)) if cuda else None  # CUDA's sync debug mode only
        out[kind] = {**summary[kind], "host_syncs_per_step": syncs}
    out["adascale"]["gain"] = variants["adascale"][1].gain
    del variants
    if args.check_steps:
        check = check_gain(engine, build, shape, args.batch, k, device, args.check_steps)
        check["agrees"] = check["max_gain_rel"] <= args.rtol
        out["gain_check"] = check
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("horovod", "ddp"), default="horovod",
                   help="horovod: start under horovodrun; ddp: under torchrun (NCCL on CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a self-check of the script on CPUs (Gloo), no GPU figures")
    p.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma-separated, of: {', '.join(MODEL_NAMES)}")
    p.add_argument("--passes", default="1,4", help="values of k, comma-separated")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--check-steps", type=int, default=5,
                   help="adascale steps whose gain is recomputed on the CPU (0: none)")
    p.add_argument("--rtol", type=float, default=1e-3, help="the gain check's tolerance")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs CUDA: torch.cuda.is_available() is False "
                         "(--device cpu: the CPU self-check)")
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    engine = (HorovodEngine if args.engine == "horovod" else DDPEngine)(args.device)
    device = torch.device("cuda", engine.local_rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    for name in args.models.split(","):
        for k in (int(v) for v in args.passes.split(",")):
            result = run(engine, name, k, args, device)
            if engine.rank == 0:
                print_result({"rank": 0, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
