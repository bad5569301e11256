"""An emulated accelerator cluster: real training on the CPU, device time modelled by waits.

    torchrun --standalone --nproc-per-node W benchmarks/emulated.py [--profile a100-resnet50] \\
        [--no-link] examples/torch_mnist1d.py --engine ddp --policy adascale ...

Every figure measured on this project's 2 CPU cores says data parallelism does not pay here: two
workers share the cores that one would use. On a cluster each worker has its own device, and
the question that matters (does a job scaled to W workers reach the same quality sooner?) is one
of wall time. This mode keeps everything real except the device:

* **compute**: each worker's forward and backward pass over a micro-batch of b samples costs the
  profile's device time t(b) = t0 + b x t_sample (``Profile.pass_time``), a third in the forward
  and two thirds in the backward (``forward_share``). It is a wait (``time.sleep``: no CPU),
  padded around the real computation, which runs underneath on the CPU: the forward is timed and
  the wait is what is left of its share; the backward's wait is taken when it starts (a hook on
  the model's output), its share less the running mean of the real backward's duration (an
  autograd callback at its end), so a pass lasts max(t(b), the CPU's time) as long as the CPU
  keeps up. The model, data, optimizer, gradients and policy are the real ones: the quality is
  that of real S = W x k training.
* **communication**: the gradients' and the statistics' collectives are the real Gloo ones
  (DDP's, through hvd_scale's DDP engine). The link is emulated on top of them: each bucket's
  allreduce completes a ring all-reduce's modelled time later (``Profile.allreduce_time``:
  latency + 2 (W - 1) / W x bytes / bandwidth, the bytes the modelled model's gradient, shared
  out over the buckets by their real size), a wait in the allreduce's future (a DDP communication
  hook passed as hvd_scale's ``comm_hook``) for what is left of that time once the real
  collective is done (a pad, as for the passes: the real collective's time is part of the link's). ``--no-link``: the real collectives alone. The
  statistics' own small allreduce gets no modelled time (its latency is in the real one).
* **evaluation** (a model in eval mode or under no_grad) is not emulated: it costs real CPU only
  (the example times it apart).

The modelled step time (``Profile.step_time``) is k x t(b) + allreduce_time(W); every process
records, per step, the wall time from its first training forward to the end of ``step()``, the
modelled time of the passes and link waits it took, and its CPU time (``time.process_time``: all
of the process's threads, Gloo's included), and prints one line at exit::

    EMULATED {"rank": 0, "world": 4, "steps": ..., "wall": ..., "modelled": ..., "cpu": ..., ...}

Profiles (``PROFILES``; the numbers are stated, not measured on a device):

* ``a100-resnet50`` (default): a ResNet-50-sized worker on an A100-class device: t0 = 5 ms per
  pass (launches, the framework's fixed cost), t_sample = 1.2 ms (~830 images/s in TF32 at large
  batch), so t(32) = 43.4 ms; its fp32 gradient (25.6 M parameters, 102.2 MB) over a 100 Gb/s
  link (12.5 GB/s), 0.1 ms latency: 8.3 ms per allreduce at W = 2, 12.4 at W = 4, 14.4 at W = 8,
  i.e. 16-25% of a k = 1 step at b = 32, the share data parallelism pays on such a cluster.
* ``fast``: the same shape at half the device time (t0 = 2.5 ms, t_sample = 0.6 ms), for the
  long runs of a time-to-accuracy matrix; the CPU's share is twice as large.

Where the CPU cannot keep up (W processes on 2 cores, other work beside them), the measured step
exceeds the modelled one: every run reports both, so a figure is only read where they agree
(``benchmarks/emulated_fidelity.py``). Only the DDP engine is emulated (``--engine ddp``).

In another benchmark::

    from emulated import PROFILES, emulated_command, read_emulated
    cmd = emulated_command(["examples/torch_mnist1d.py", "--engine", "ddp", ...], workers=4)
    out = subprocess.run(cmd, capture_output=True, text=True, env=emulated_env()).stdout
    read_emulated(out)  # one summary per rank
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import pathlib
import runpy
import statistics
import sys
import threading
import time
from typing import Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARK = "EMULATED "


@dataclasses.dataclass(frozen=True)
class Profile:
    """A worker's device and link: seconds per pass and per allreduce."""
    name: str
    t0: float  # s per forward + backward pass, whatever its batch
    t_sample: float  # s per sample of a pass
    forward_share: float = 1 / 3  # the forward's part of a pass (the backward: the rest)
    grad_bytes: float = 0.0  # the modelled gradient's size, bytes (0: no link emulated)
    bandwidth: float = 12.5e9  # bytes/s
    latency: float = 1e-4  # s per allreduce

    def pass_time(self, batch: int) -> float:
        """t(b) = t0 + b x t_sample: one forward and backward over b samples."""
        return self.t0 + batch * self.t_sample

    def allreduce_time(self, world: int, fraction: float = 1.0) -> float:
        """A ring all-reduce of ``fraction`` of the gradient among ``world`` workers:
        latency + 2 (W - 1) / W x bytes / bandwidth (none for one worker or no link)."""
        if world <= 1 or self.grad_bytes <= 0:
            return 0.0
        return self.latency + 2 * (world - 1) / world * fraction * self.grad_bytes / self.bandwidth

    def step_time(self, batch: int, passes: int, world: int) -> float:
        """The modelled step: k passes, then the gradients' allreduce (one bucket's worth: no
        overlap with the backward, as at this benchmark's model size)."""
        return passes * self.pass_time(batch) + self.allreduce_time(world)

    def without_link(self) -> "Profile":
        return dataclasses.replace(self, grad_bytes=0.0)


PROFILES = {
    "a100-resnet50": Profile("a100-resnet50", t0=5e-3, t_sample=1.2e-3, grad_bytes=102.2e6),
    "fast": Profile("fast", t0=2.5e-3, t_sample=0.6e-3, grad_bytes=51.1e6),
}


def _sleep(seconds: float) -> float:
    if seconds > 0:
        time.sleep(seconds)
        return seconds
    return 0.0


class Device:
    """The modelled device of one worker: hooks on its model pad each training pass to t(b), and
    a step's wall, modelled and CPU seconds are recorded from its first forward to ``step()``'s end."""

    def __init__(self, profile: Profile, world: int = 1):
        self.profile, self.world = profile, world
        self._lock = threading.Lock()
        self._backward_estimate = 0.0  # running mean of the real backward's seconds
        self._backwards = 0
        self._step_start = self._cpu_start = None
        self._modelled = 0.0  # this step's modelled seconds so far (passes and link waits)
        self._passes = 0
        # (wall, modelled, cpu, passes, after: from the last backward's end to step()'s end)
        self.steps: list[tuple[float, float, float, int, float]] = []
        self.slept = 0.0
        self.overrun = 0.0  # seconds the real forward or backward ran past its modelled share
        self.load = [os.getloadavg()[0]]
        self._pending = None
        self._backward_end = None
        self.after = 0.0  # seconds from the step's last backward to the end of step() (timed steps)

    # -- the passes ------------------------------------------------------------------------------
    def attach(self, module) -> "Device":
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)
        return self

    @staticmethod
    def _training(module) -> bool:
        import torch

        return module.training and torch.is_grad_enabled()

    def _before_forward(self, module, args):
        if not self._training(module):
            return
        if self._step_start is None:
            self._step_start, self._cpu_start = time.perf_counter(), time.process_time()
        self._forward_start = time.perf_counter()

    def _after_forward(self, module, args, out):
        if not self._training(module):
            return
        import torch

        batch = int(args[0].shape[0])
        t = self.profile.pass_time(batch)
        with self._lock:
            self._modelled += t
            self._passes += 1
        spent = time.perf_counter() - self._forward_start
        share = self.profile.forward_share * t
        self.overrun += max(0.0, spent - share)
        self.slept += _sleep(share - spent)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            backward = (1 - self.profile.forward_share) * t
            out.register_hook(lambda grad: self._backward_begins(backward))

    def _backward_begins(self, share: float):
        from torch.autograd import Variable

        self.slept += _sleep(share - self._backward_estimate)
        self._pending = (time.perf_counter(), share)
        Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self):
        start, share = self._pending
        spent = time.perf_counter() - start
        self.overrun += max(0.0, spent - min(share, self._backward_estimate))
        self._backwards += 1
        # A mean over the last ~20 passes: the CPU's share moves with the machine's load.
        self._backward_estimate += (spent - self._backward_estimate) / min(self._backwards, 20)
        self._backward_end = time.perf_counter()

    # -- the link --------------------------------------------------------------------------------
    def comm_hook(self, model):
        """A DDP communication hook: DDP's own allreduce of the bucket, completed after the
        link's modelled time for the bucket's share of the gradient."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

        def hook(state, bucket):
            buf = bucket.buffer()
            wait = self.profile.allreduce_time(self.world, buf.numel() * buf.element_size() / total)
            with self._lock:
                self._modelled += wait

            start = time.perf_counter()

            def done(fut):  # the link's time, of which the real collective took its part
                self.slept += _sleep(wait - (time.perf_counter() - start))
                return fut.value()

            return allreduce_hook(state, bucket).then(done)

        return hook

    # -- the steps -------------------------------------------------------------------------------
    def step_done(self):
        if self._step_start is None:  # a step without a pass (nothing to time)
            return
        end = time.perf_counter()
        wall = end - self._step_start
        cpu = time.process_time() - self._cpu_start
        after = end - self._backward_end if self._backward_end else 0.0
        with self._lock:
            self.steps.append((wall, self._modelled, cpu, self._passes, after))
            self._modelled, self._passes = 0.0, 0
        self._step_start = None

    def summary(self, rank: int, skip: int = 5) -> dict:
        rows = self.steps[skip:] if len(self.steps) > 2 * skip else self.steps
        wall = sum(r[0] for r in rows)
        modelled = sum(r[1] for r in rows)
        cpu = sum(r[2] for r in rows)
        ratios = [r[0] / r[1] for r in rows if r[1] > 0]
        self.load.append(os.getloadavg()[0])
        return {"rank": rank, "world": self.world, "profile": dataclasses.asdict(self.profile),
                "steps": len(self.steps), "timed_steps": len(rows),
                "passes": sum(r[3] for r in rows), "after": sum(r[4] for r in rows), "wall": wall, "modelled": modelled, "cpu": cpu,
                "step_wall": wall / max(len(rows), 1), "step_modelled": modelled / max(len(rows), 1),
                "ratio": wall / modelled if modelled else None,
                "ratio_median": statistics.median(ratios) if ratios else None,
                "cpu_share": cpu / wall if wall else None, "slept": self.slept,
                "overrun": self.overrun, "load": self.load}


def install(profile: Profile, link: bool = True) -> Device:
    """Emulate this process's device for the DDP engine: every ``DistributedDataParallel`` built
    from now on has its module's passes padded; every hvd_scale DDP ``DistributedOptimizer`` gets
    the link's communication hook (unless ``link`` is false or the caller passes one) and its
    steps timed. Returns the Device (its summary is printed at exit)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hvd_scale.adapters.torch import ddp

    device = Device(profile if link else profile.without_link())
    ddp_init = DistributedDataParallel.__init__

    def init(self, module, *args, **kwargs):
        ddp_init(self, module, *args, **kwargs)
        device.world = dist.get_world_size(self.process_group)
        device.attach(module)

    DistributedDataParallel.__init__ = init
    optimizer_class = ddp.DistributedOptimizer

    def optimizer(inner, model, *args, **kwargs):
        if link and device.profile.grad_bytes > 0 and kwargs.get("comm_hook") is None:
            kwargs["comm_hook"] = device.comm_hook(model)
        opt = optimizer_class(inner, model, *args, **kwargs)
        step = opt.step

        def timed_step(*a, **kw):
            try:
                return step(*a, **kw)
            finally:
                device.step_done()

        opt.step = timed_step
        return opt

    ddp.DistributedOptimizer = optimizer

    def report():
        rank = int(os.environ.get("RANK", "0"))
        # One write: the ranks share a pipe, and print's separate newline could interleave.
        sys.stdout.write(MARK + json.dumps(device.summary(rank)) + "\n")
        sys.stdout.flush()

    atexit.register(report)
    return device


# -- for other benchmarks ------------------------------------------------------------------------

def emulated_command(script_args: Sequence[str], workers: int, *, profile: str = "a100-resnet50",
                     link: bool = True, python: str | None = None, nice: int = 0) -> list[str]:
    """torchrun's command line running ``script_args`` (a script and its options) on W emulated
    workers; ``nice``: run it at that niceness (negative, as root: the workers wake from their
    waits ahead of the machine's other work, which they barely take CPU from)."""
    from hvd_scale.launch.jobs import torchrun_command

    python = python or sys.executable
    own = [str(pathlib.Path(__file__).resolve()), "--profile", profile] + ([] if link else ["--no-link"])
    cmd = torchrun_command([python] + own + [str(a) for a in script_args], workers)
    return (["nice", "-n", str(nice)] if nice else []) + cmd


def emulated_env(**extra) -> dict:
    """The environment of an emulated job: one torch thread per process (the launcher's CPU
    default), unbuffered output."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def read_emulated(stdout: str) -> list[dict]:
    """The EMULATED summaries in a job's output, by rank."""
    rows = []
    for line in stdout.splitlines():
        at = line.find(MARK)
        if at >= 0:
            try:
                rows.append(json.loads(line[at + len(MARK):]))
            except json.JSONDecodeError:
                continue
    return sorted(rows, key=lambda r: r["rank"])


def machine() -> dict:
    """What a stored run ran on: CPU model and instruction set, cores, torch's threads, the load."""
    import platform

    import torch

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "isa": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
            "load": os.getloadavg()}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="a100-resnet50")
    p.add_argument("--no-link", action="store_true", help="the real collectives alone")
    p.add_argument("script", help="the training script (the DDP engine)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its options")
    args = p.parse_args(argv)
    install(PROFILES[args.profile], link=not args.no_link)
    sys.argv = [args.script] + args.script_args
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
