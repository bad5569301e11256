"""PyTorch's own DDP example (the DDP tutorial's "Basic Use Case", pytorch/examples
distributed/ddp/main.py), started by torchrun, on the CPU with Gloo, for a few steps.

    torchrun --nproc-per-node 2 examples/ddp_before.py

The "before" of the DDP guide (docs/ddp.md); examples/ddp_after.py is the same script with
hvd_scale's DDP optimizer, and the guide shows their diff. The data are generated: each rank its
own batches of 20 inputs and labels, as the tutorial's torch.randn.
"""

import argparse
import gc

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (imported by DDP: before init_process_group)
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(steps):
    dist.init_process_group("gloo")              # torchrun sets the rendezvous
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    torch.manual_seed(0)                         # DDP broadcasts rank 0's weights anyway
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    data = torch.Generator().manual_seed(1 + rank)   # each rank its own batches
    for step in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=data))
        labels = torch.randn(20, 5, generator=data)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
    if rank == 0:
        print(f"final loss {loss.item():.8f}", flush=True)
    # The process group is freed by destroy_process_group(), not during the interpreter's exit,
    # where a Gloo thread still busy aborts the process (docs/troubleshooting.md): DDP's last
    # references to it go first, and torch.distributed.nn, imported above, holds none.
    del ddp_model, optimizer
    gc.collect()
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    demo_basic(p.parse_args().steps)
