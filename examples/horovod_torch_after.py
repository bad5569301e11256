"""examples/horovod_torch_before.py converted to hvd_scale: the policy comes from the launcher.

    hvd-scale run -np 2 --policy adascale -- python examples/horovod_torch_after.py

The conversion guide (docs/converting.md) shows the diff against the "before". The budget is
the same training counted in baseline steps (batches of --batch-size at S = 1): the epochs loop
becomes a loop that runs until tau reaches it, so every policy gets the same progress.
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

from hvd_scale.adapters.torch import DistributedOptimizer, broadcast_state  # noqa: E402


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
    # The baseline (S = 1) lr: the policy scales it. The budget: the epochs at S = 1.
    budget = args.epochs * (len(data["x"]) // args.batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     budget=budget)
    broadcast_state(model, optimizer)
    epoch = 0
    while not optimizer.done():
        for x, y in epoch_batches(data["x"], data["y"], args.batch_size, epoch):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if optimizer.done():
                break
        epoch += 1
    model.eval()
    with torch.no_grad():
        out = model(torch.from_numpy(data["x_test"]))
        test_loss = F.cross_entropy(out, torch.from_numpy(data["y_test"])).item()
    if hvd.rank() == 0:
        print(f"test loss {test_loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
