"""A torch job through the adapter, with metrics logged (CSV + TensorBoard): reports whether
TensorFlow (or the tensorboard package) got imported on the way."""

import os
import sys

import horovod.torch as hvd
import torch

from _report import emit_result
from hvd_scale.adapters.torch import DistributedOptimizer


def main():
    hvd.init()
    model = torch.nn.Linear(4, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), policy="adascale",
                               log_dir=os.path.join(sys.argv[1], "logs"))
    for step in range(3):
        opt.zero_grad()
        torch.manual_seed(10 * step + hvd.rank())
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
    opt.close()
    emit_result(rank=hvd.rank(), loaded=sorted(m for m in ("tensorflow", "tensorboard", "keras")
                                               if m in sys.modules))


if __name__ == "__main__":
    main()
