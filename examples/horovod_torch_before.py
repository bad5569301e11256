"""A Horovod PyTorch script as Horovod's own example (pytorch_mnist.py) writes it, on MNIST-1D.

    horovodrun --gloo -np 2 -H localhost:2 python examples/horovod_torch_before.py

The "before" of the conversion guide (docs/converting.md); its converted twin is
examples/horovod_torch_after.py, and the guide shows their diff. Run under `hvd-scale run
--policy linear`, the twin trains the same steps with the same lr (tested: the same test loss).
"""

import argparse
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist1d_data  # noqa: E402
from torch_mnist1d import make_model  # noqa: E402


def epoch_batches(x, y, batch_size, epoch, seed=0):
    """This rank's shard of the training set, shuffled per epoch (a DistributedSampler's job)."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
    shard = order[hvd.rank()::hvd.size()]
    for i in range(0, len(shard) - batch_size + 1, batch_size):
        idx = shard[i:i + batch_size]
        yield torch.from_numpy(x[idx]), torch.from_numpy(y[idx])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=4000)
    args = p.parse_args()
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = mnist1d_data.load(args.samples)
    model = make_model()
    # Horovod: scale the learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for epoch in range(args.epochs):
        for x, y in epoch_batches(data["x"], data["y"], args.batch_size, epoch):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        out = model(torch.from_numpy(data["x_test"]))
        test_loss = F.cross_entropy(out, torch.from_numpy(data["y_test"])).item()
    if hvd.rank() == 0:
        print(f"test loss {test_loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
