"""A torch job that logs metrics (HVD_SCALE_LOG_DIR), checkpoints every 3 steps and can crash:
run it, kill it, run it again and it resumes from its checkpoint into the same log directory.

    horovodrun -np 2 ... python resume_log_worker.py CKPT --steps 10 [--crash-at 7]
"""

import argparse
import os

import horovod.torch as hvd
import torch

from _report import emit_result
from hvd_scale.adapters.torch import DistributedOptimizer, broadcast_state


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--crash-at", type=int, default=None, help="rank 0 dies after this step")
    args = p.parse_args()
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), policy="adascale",
                               backward_passes_per_step=2)
    if os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    broadcast_state(model, opt)
    resumed_from = opt.steps
    while opt.steps < args.steps:
        opt.zero_grad()
        for j in range(2):
            g = torch.Generator().manual_seed(100 * opt.steps + 10 * hvd.rank() + j)
            x = torch.randn(8, 6, generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), (x[:, :3]).argmax(1))
            loss.backward()
        opt.step()
        opt.log_loss(loss.detach())  # the step just taken's row
        if opt.steps % 3 == 0 and hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.checkpoint)
        if args.crash_at == opt.steps and hvd.rank() == 0:
            os._exit(1)
    opt.close()
    emit_result(rank=hvd.rank(), resumed_from=resumed_from, steps=opt.steps,
                progress=opt.progress)


if __name__ == "__main__":
    main()
