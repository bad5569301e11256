"""examples/ddp_tutorial_before.py (the shape of PyTorch's DDP tutorial series) with hvd_scale's
DDP optimizer: a budget in baseline steps instead of a number of epochs, k micro-batches a step
(the first k - 1 under no_sync()), snapshots that hold the optimizer's state (the run's tau and
the estimates with it). The policy comes from the launcher.

    HVD_SCALE_POLICY=adascale torchrun --nproc-per-node 2 examples/ddp_tutorial_after.py 2 1 --passes 3

The budget is the epochs' worth of steps at one worker (total_epochs x ceil(samples / batch)).
The tutorial's loss is a cross-entropy over Linear(20, 1)'s one output, which is exactly 0: its
gradients are zero, nothing trains, and hvd_scale says so (the gain is then 1). The DDP guide
(docs/ddp.md) shows the diff against the "before".
"""

import argparse
import contextlib
import math
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from hvd_scale.adapters.torch.ddp import DistributedOptimizer


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)  # the same samples on every rank
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, budget, passes):
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.model = DDP(self.model)
        self.optimizer = DistributedOptimizer(optimizer, self.model, budget=budget,
                                              backward_passes_per_step=passes)
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.model.module.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}, "
              f"tau {self.optimizer.progress:g}")

    def _run_batch(self, batches):
        self.optimizer.zero_grad()
        for i, (source, targets) in enumerate(batches):
            with self.model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                output = self.model(source)
                loss = F.cross_entropy(output, targets)
                loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        batches = []
        for source, targets in self.train_data:
            batches.append((source, targets))
            if len(batches) == self.optimizer.backward_passes_per_step:
                self._run_batch(batches)
                batches = []
                if self.optimizer.done():
                    return
        if batches:
            self._run_batch(batches)  # the epoch's leftover batches: a short step

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1,
                    "OPTIMIZER_STATE": self.optimizer.state_dict()}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self):
        epoch = self.epochs_run
        while not self.optimizer.done():
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            epoch += 1


def load_train_objs():
    train_set = MyTrainDataset(2048)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path, passes):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    budget = total_epochs * math.ceil(len(dataset) / batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, budget, passes)
    trainer.train()
    opt = trainer.optimizer
    if trainer.global_rank == 0:
        print(f"{opt.policy.spec} at S = {opt.scale:g}: {opt.steps} steps, tau {opt.progress:.2f}, "
              f"gain {opt.gain:.3f}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--passes", default=1, type=int, help="micro-batches a step (k)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.passes)
