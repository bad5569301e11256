"""Elastic Horovod job (torch adapter): rank 0 rewrites the host file mid-training to resize the job.

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script discover.sh --network-interfaces lo \\
        python elastic_worker.py --hosts-file hosts --resize-at 6 --resize-to 2 --budget 40

Each rank reports every step it takes (RESULT lines tagged "step") and a final summary.
"""

import argparse
import itertools
import json
import os
import sys
import time

import horovod.torch as hvd
import torch

from hvd_scale.adapters.torch import DistributedOptimizer


TEACHER = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))

SEQUENCE = itertools.count()


def emit(**values):
    # pid and seq: a worker's rank changes on a resize, its process and its own order do not.
    record = {"rank": hvd.rank(), "pid": os.getpid(), "seq": next(SEQUENCE), **values}
    sys.stdout.write("RESULT " + json.dumps(record) + "\n")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hosts-file", required=True)
    p.add_argument("--resize-at", type=int, default=None, help="optimizer step at which to resize")
    p.add_argument("--resize-to", type=int, default=None)
    p.add_argument("--die-on-host", default=None,
                   help="the worker on this host name crashes (os._exit(1)) at --die-at")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--policy", default="adascale")
    p.add_argument("--step-sleep", type=float, default=0.3,
                   help="seconds per step, so the driver (polling hosts every second) sees the resize mid-run")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                               named_parameters=model.named_parameters(), policy=args.policy,
                               budget=args.budget)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, resized=False)

    @hvd.elastic.run
    def train(state):
        while not opt.done():
            step = opt.policy.steps
            g = torch.Generator().manual_seed(1000 * step + hvd.rank())
            x = torch.randn(16, 8, generator=g)
            y = (x @ TEACHER).argmax(1)  # a learnable task, so runs can be compared on quality
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            emit(kind="step", step=opt.policy.steps, size=hvd.size(), scale=opt.scale,
                 progress=opt.progress, gain=opt.gain)
            if (args.die_on_host and os.environ.get("HOROVOD_HOSTNAME") == args.die_on_host
                    and opt.policy.steps >= args.die_at):
                sys.stdout.flush()
                os._exit(1)  # a crash: no goodbye to the others
            if args.resize_at is not None and not state.resized and opt.policy.steps >= args.resize_at:
                state.resized = True  # on every rank, so the flag is committed alike
                if hvd.rank() == 0:
                    with open(args.hosts_file + ".tmp", "w") as f:
                        f.write(f"localhost:{args.resize_to}\n")
                    os.replace(args.hosts_file + ".tmp", args.hosts_file)
            time.sleep(args.step_sleep)
            state.commit()  # commits the policy with the optimizer, and checks for host changes

    train(state)
    g = torch.Generator().manual_seed(999)  # a fixed held-out batch, the same for every run
    x = torch.randn(512, 8, generator=g)
    y = (x @ TEACHER).argmax(1)
    with torch.no_grad():
        eval_loss = float(torch.nn.functional.cross_entropy(model(x), y))
    emit(kind="final", size=hvd.size(), scale=opt.scale, progress=opt.progress, eval_loss=eval_loss,
         steps=opt.policy.steps, sigma2=opt.sigma2,
         checksum=float(sum(p.detach().double().sum() for p in model.parameters())))


if __name__ == "__main__":
    main()
