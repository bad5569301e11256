"""examples/horovod_loader_before.py converted to hvd_scale: the policy comes from the launcher.

    hvd-scale run -np 2 --policy adascale -- python examples/horovod_loader_after.py

Converted from the docs site alone (docs/converting.md, docs/torch.md; #48): the lr is the
baseline (S = 1) one, hvd_scale's DistributedOptimizer takes Horovod's compression and
predivide factor, broadcast_state replaces the two broadcasts, and the epochs become a budget in
baseline steps (batches of --batch-size at S = 1): the loop over epochs runs until tau reaches
it, each pass over the DistributedSampler's shard followed by the test, as before. --use-adasum
is gone: Horovod's Adasum combines the workers' updates, not their gradients, so there is no
step for a policy to scale (hvd_scale refuses op=hvd.Adasum).
"""

import argparse
import math
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist1d_data  # noqa: E402

from hvd_scale.adapters.torch import DistributedOptimizer, broadcast_state  # noqa: E402

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--samples", type=int, default=4000, help="MNIST-1D samples (80%% train)")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv1d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout1d()
        self.fc1 = nn.Linear(140, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = x.unsqueeze(1)
        x = F.relu(F.max_pool1d(self.conv1(x), 2))
        x = F.relu(F.max_pool1d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 140)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def main(args):
    def train_epoch(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            optimizer.log_loss(loss)
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                # tau (baseline steps) and the gain: hvd_scale's progress and this step's factor.
                print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}\ttau {:.1f}/{} gain {:.2f}"
                      .format(epoch, batch_idx * len(data), len(train_sampler),
                              100. * batch_idx / len(train_loader), loss.item(),
                              optimizer.progress, budget, optimizer.gain), flush=True)
            if optimizer.done():
                break

    def metric_average(val, name):
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss = 0.
        test_accuracy = 0.
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                # sum up batch loss
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                # get the index of the max log-probability
                pred = output.data.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.data.view_as(pred)).float().sum().item()
        # Horovod: use test_sampler to determine the number of examples in
        # this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        # Horovod: average metric values across workers.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")
        # Horovod: print output only on first rank.
        if hvd.rank() == 0:
            print("Test set: Average loss: {:.6f}, Accuracy: {:.2f}%".format(
                test_loss, 100. * test_accuracy), flush=True)

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)
    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    data = mnist1d_data.load(args.samples)
    train_dataset = torch.utils.data.TensorDataset(torch.from_numpy(data["x"]),
                                                   torch.from_numpy(data["y"]))
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = torch.utils.data.TensorDataset(torch.from_numpy(data["x_test"]),
                                                  torch.from_numpy(data["y_test"]))
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()

    # The baseline (S = 1) lr: the policy scales it. The budget: the epochs at S = 1, each
    # ceil(samples / batch) steps: the loader keeps an epoch's last, smaller batch.
    budget = args.epochs * math.ceil(len(train_dataset) / args.batch_size)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # hvd_scale's DistributedOptimizer takes Horovod's options; the policy comes from
    # hvd-scale run --policy.
    optimizer = DistributedOptimizer(optimizer,
                                     named_parameters=model.named_parameters(),
                                     compression=compression,
                                     gradient_predivide_factor=args.gradient_predivide_factor,
                                     budget=budget)

    # Rank 0's parameters, optimizer state and policy state on every rank.
    broadcast_state(model, optimizer)

    epoch = 0
    while not optimizer.done():
        epoch += 1
        train_epoch(epoch)
        test()


if __name__ == "__main__":
    main(parser.parse_args())
