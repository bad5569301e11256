"""A Lightning Trainer with hvd_scale: its DDPStrategy wraps the LightningModule's optimizer in
hvd_scale's DDP DistributedOptimizer (hvd_scale.adapters.torch.lightning).

    torchrun --nproc-per-node 2 examples/ddp_lightning.py --policy adascale --accumulate 4
    python examples/ddp_lightning.py --policy adascale     # Lightning starts the 2 processes

Automatic optimization: configure_optimizers returns a plain SGD, Lightning steps it; the
policy's lr factor is applied at each step (the lr the SGD sees is printed, from a step pre-hook
on it); ``--clip C`` clips the gradients' norm at C (Lightning's gradient_clip_val, applied to
the mean of the step's passes). ``--compare`` then trains the same model on the same
micro-batches in a plain DDP loop with hvd_scale's DDP optimizer (the loop of docs/ddp.md,
clipping there too), and each rank prints one ``RESULT {json}`` line per run, with per-step
gain, lr factor, lr seen, tau, sigma2, mu2 and the weights after
(tests/test_ddp_integrations.py compares them).

``--budget T`` trains to a budget in tau instead (the strategy stops the Trainer there, long
before ``max_epochs``), the baseline lr from a schedule at tau (``ScalingCallback``, which also
logs gain, tau, S and the noise scale to a CSVLogger under ``--log-dir``); then again in two
fits, the first to T / 2 and saved with ``trainer.save_checkpoint``, the second resumed from it
(``fit(ckpt_path=...)``) to T. Each fit prints a ``RESULT`` line per rank.
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_reference import BATCH, LR, dataset, network, plain_run, record, weights
from torch.utils.data import DataLoader, DistributedSampler

from hvd_scale.adapters.torch.lightning import DDPStrategy, ScalingCallback
from hvd_scale.schedules import StepDecay

class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = network()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)  # the micro-batch's mean loss

    def configure_optimizers(self):
        self.sgd = torch.optim.SGD(self.parameters(), lr=LR)  # kept: Rows watches its lr
        return self.sgd


class Rows(pl.Callback):
    """After each optimizer step: what the policy did, the lr the SGD saw and the norm of the
    gradient it applied (the update over that lr: a plain SGD's)."""

    def __init__(self):
        self.rows, self.seen, self.steps, self.applied = [], [], 0, []

    def on_fit_start(self, trainer, module):
        # trainer.optimizers[0] is hvd_scale's, over the SGD of configure_optimizers
        before = []

        def pre(o, a, kw):
            self.seen.append(o.param_groups[0]["lr"])
            before[:] = [weights(module.net)]

        def post(o, a, kw):
            update = torch.tensor(weights(module.net)) - torch.tensor(before[0])
            self.applied.append(float(update.norm()) / self.seen[-1])
        module.sgd.register_step_pre_hook(pre)
        module.sgd.register_step_post_hook(post)

    def on_train_start(self, trainer, module):
        self.steps = trainer.global_step  # a resumed fit's steps so far

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step > self.steps:  # an optimizer step was taken
            self.steps = trainer.global_step
            record(trainer.optimizers[0], self.seen, self.rows)
            self.rows[-1]["applied"] = self.applied[-1]


def lightning_run(args, loader):
    rows = Rows()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(policy=args.policy),
                         accumulate_grad_batches=args.accumulate, max_epochs=1,
                         gradient_clip_val=args.clip,
                         callbacks=[rows], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = Classifier()
    trainer.fit(module, loader)
    opt = trainer.optimizers[0]
    if trainer.global_rank == 0:
        print(f"lightning: {opt.policy.spec} at S = {opt.scale:g}: {opt.steps} steps, tau "
              f"{opt.progress:.2f}, gain {opt.gain:.3f}, lr {rows.seen[-1]:.4f}", flush=True)
    return module.net, rows.rows, opt.scale


def budget_fit(args, budget, name, ckpt=None):
    """One fit to ``budget`` (tau) with the lr from a schedule at tau, resumed from ``ckpt``."""
    from lightning.pytorch.loggers import CSVLogger

    rows = Rows()
    schedule = StepDecay(LR, [int(0.75 * args.budget)], gamma=0.5)  # crossed after a resume
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=args.max_epochs,
                         strategy=DDPStrategy(policy=args.policy,
                                              optimizer_kwargs={"budget": budget}),
                         accumulate_grad_batches=args.accumulate,
                         callbacks=[ScalingCallback(schedule=schedule), rows],
                         logger=CSVLogger(args.log_dir, name=name, version=0), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = Classifier()
    loader = DataLoader(dataset(2 * BATCH * args.accumulate * args.steps), batch_size=BATCH)
    trainer.fit(module, loader, ckpt_path=ckpt)
    saved = f"{args.log_dir}/{name}.ckpt"
    trainer.save_checkpoint(saved)  # on every rank; rank 0 writes
    opt = trainer.optimizers[0]
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "run": name, "rows": rows.rows,
                                  "epochs": trainer.current_epoch, "steps": opt.steps,
                                  "progress": opt.progress, "checkpoint": saved,
                                  "logged": trainer.logger.log_dir}), flush=True)
    return saved


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", default="adascale")
    p.add_argument("--accumulate", default="1", help="accumulate_grad_batches (k); a list "
                   "(1,2): one fit after the other")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compare", action="store_true", help="also the plain DDP loop; RESULT lines")
    p.add_argument("--clip", type=float, help="gradient_clip_val (the plain loop clips there)")
    p.add_argument("--budget", type=float, help="train to this tau (and again, resumed halfway)")
    p.add_argument("--max-epochs", type=int, default=100)
    p.add_argument("--log-dir", default="lightning_logs")
    args = p.parse_args()
    if args.budget:
        args.accumulate = int(args.accumulate)
        budget_fit(args, args.budget, "straight")
        half = budget_fit(args, args.budget / 2, "first")
        budget_fit(args, args.budget, "resumed", ckpt=half)
        return
    for k in map(int, args.accumulate.split(",")):
        args.accumulate = k
        samples = 2 * BATCH * k * args.steps
        loader = DataLoader(dataset(samples), batch_size=BATCH)  # Lightning adds the sampler
        net, rows, scale = lightning_run(args, loader)
        if not args.compare:
            continue
        data = dataset(samples)  # the sampler Lightning puts in a training loader (epoch 0)
        shards = list(DataLoader(data, batch_size=BATCH,
                                 sampler=DistributedSampler(data, shuffle=True, seed=0)))
        plain_net, plain_rows = plain_run(args.policy, k, shards, clip=args.clip)
        for run, n, r in (("lightning", net, rows), ("plain", plain_net, plain_rows)):
            print("RESULT " + json.dumps({"rank": dist.get_rank(), "run": run, "k": k,
                                          "scale": scale, "rows": r, "weights": weights(n)}),
                  flush=True)


if __name__ == "__main__":
    main()
