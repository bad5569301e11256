"""What the two elastic workers (torch, Keras) share: options, reports, the resize and the crash.

Imports nothing heavy: each worker passes its framework's ``hvd`` module.
"""

import argparse
import itertools
import os
import time

from _report import emit_result

_SEQUENCE = itertools.count()
_FIRST_RANK = []  # this process's rank at its first step (ranks change on a resize)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--hosts-file", required=True)
    p.add_argument("--resize-at", type=int, default=None, help="optimizer step at which to resize")
    p.add_argument("--resize-to", type=int, default=None)
    p.add_argument("--die-on-host", default=None,
                   help="the worker on this host name crashes (os._exit(1)) at --die-at")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--die-first-rank", type=int, default=None,
                   help="the worker whose first rank was this one crashes at --die-at")
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--step-sleep", type=float, default=0.3,
                   help="seconds per step, so the driver (polling hosts every second) sees the resize mid-run")
    return p


def emit(hvd, **values) -> None:
    # pid and seq: a worker's rank changes on a resize, its process and its own order do not.
    emit_result(rank=hvd.rank(), pid=os.getpid(), seq=next(_SEQUENCE), **values)


def after_step(hvd, args, state, opt) -> None:
    """Report the step; crash or resize once when asked; slow down. Between step and commit."""
    emit(hvd, kind="step", step=opt.steps, size=hvd.size(), scale=opt.scale,
         progress=opt.progress, gain=opt.gain, passes=opt.backward_passes_per_step)
    if not _FIRST_RANK:
        _FIRST_RANK.append(hvd.rank())
    if (args.die_on_host and os.environ.get("HOROVOD_HOSTNAME") == args.die_on_host
            and opt.steps >= args.die_at):
        os._exit(1)  # a crash: no goodbye to the others
    if args.die_first_rank == _FIRST_RANK[0] and opt.steps >= args.die_at:
        os._exit(1)
    if args.resize_at is not None and not state.resized and opt.steps >= args.resize_at:
        state.resized = True  # on every rank, so the flag is committed alike
        if hvd.rank() == 0:
            with open(args.hosts_file + ".tmp", "w") as f:
                f.write(f"localhost:{args.resize_to}\n")
            os.replace(args.hosts_file + ".tmp", args.hosts_file)
    time.sleep(args.step_sleep)


def emit_final(hvd, opt, eval_loss: float, checksum: float, **extra) -> None:
    emit(hvd, kind="final", size=hvd.size(), scale=opt.scale, progress=opt.progress,
         eval_loss=eval_loss, steps=opt.steps, sigma2=opt.sigma2, checksum=checksum,
         **extra)
