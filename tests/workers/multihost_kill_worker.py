"""A worker that is SIGKILLed on one host mid-job while the others wait in an allreduce.

    horovodrun --gloo -np 2 -H hvdtest-a:1,hvdtest-b:1 ... python multihost_kill_worker.py \\
        --kill-host hvdtest-b --kill-at 3 --tag UNIQUE

Every rank reports where it runs (kind "start": gethostname(), HOROVOD_HOSTNAME, size, cross_size,
pid) and each step it finishes (kind "step"); the rank whose gethostname() is --kill-host reports
kind "kill" and SIGKILLs itself before step --kill-at's allreduce, so the others wait in it.
--tag is not used: it marks the command line, so the test can look for leftover processes.
"""

import argparse
import os
import signal
import socket
import time

import horovod.torch as hvd
import torch

from _report import emit_result


def main():
    p = argparse.ArgumentParser(description="multi-host kill worker")
    p.add_argument("--kill-host", required=True)
    p.add_argument("--kill-at", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    host = socket.gethostname()
    emit_result(rank=hvd.rank(), kind="start", host=host, pid=os.getpid(), size=hvd.size(),
                cross_size=hvd.cross_size(), horovod_hostname=os.environ.get("HOROVOD_HOSTNAME"))
    x = torch.ones(1024)
    for step in range(1, args.max_steps + 1):
        if host == args.kill_host and step == args.kill_at:
            emit_result(rank=hvd.rank(), kind="kill", step=step, host=host, pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        total = hvd.allreduce(x, name=f"step{step}", op=hvd.Sum)
        emit_result(rank=hvd.rank(), kind="step", step=step, value=float(total[0]))
        time.sleep(0.05)
    emit_result(rank=hvd.rank(), kind="final", steps=args.max_steps)


if __name__ == "__main__":
    main()
