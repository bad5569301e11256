"""A torch job that logs its loss after each step (``loss.backward(); opt.step();
opt.log_loss(loss)``) into $HVD_SCALE_LOG_DIR, checkpoints at --save-at and resumes from it when
the checkpoint exists: each rank reports the losses it logged, by step (#48 item 5).

    horovodrun -np 2 ... python log_loss_worker.py CKPT --steps 5 --save-at 3 [--twice-at 2]
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
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--twice-at", type=int, default=None, help="log this step's loss twice")
    args = p.parse_args()
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), policy="adascale")
    if os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    broadcast_state(model, opt)
    logged = {}
    while opt.steps < args.steps:
        g = torch.Generator().manual_seed(100 * opt.steps + hvd.rank())
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), x[:, :3].argmax(1))
        loss.backward()
        opt.step()
        opt.log_loss(loss.detach())
        logged[opt.steps] = loss.item()
        if opt.steps == args.twice_at:
            opt.log_loss(loss.detach() + 1.0)  # a mistake: warned of, not logged
        if opt.steps == args.save_at and hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.checkpoint)
    opt.close()
    emit_result(rank=hvd.rank(), logged=logged)


if __name__ == "__main__":
    main()
