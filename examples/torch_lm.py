"""Train a small GRU language model with Adam on generated sentences; next-word accuracy at the end.

    horovodrun --gloo -np 2 -H localhost:2 python examples/torch_lm.py --policy adascale_adam

B5's task C (issue #24): the sentences of the translation task's SOV language (translation_data.py),
whose words are drawn at random from a grammar, so the next word keeps an irreducible entropy and
the gradient noise stays large against its mean (AdaScale's gain stays near S at small S): the
regime where large batches pay. The GRU's matmuls are small and sequential, so a second thread
speeds one process up less than a Transformer's (x1.2 here against x1.4).

The baseline (S = 1) schedule is written once, in baseline steps: lr, then x0.1 at 50% and 75% of
the budget, run in scale-invariant iterations as in torch_mnist1d.py. With --eval-every, the test
loss and next-word accuracy every N baseline steps, timed apart (time to accuracy).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import translation_data as td  # noqa: E402

from hvd_scale import lr_at, schedules  # noqa: E402
from hvd_scale.adapters.torch import DistributedOptimizer, broadcast_state  # noqa: E402
from hvd_scale.launch.jobs import print_result  # noqa: E402


class GRULanguageModel(torch.nn.Module):
    def __init__(self, vocab: int, embedding: int = 32, hidden: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embedding, padding_idx=td.PAD)
        self.rnn = torch.nn.GRU(embedding, hidden, batch_first=True)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(ids))
        return self.out(h)


def next_word_loss(model, sentences: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy of each next word given the words before it (BOS first, PAD
    ignored), and the number of those predictions that are right."""
    ids = torch.from_numpy(sentences)
    logits = model(ids[:, :-1]).reshape(-1, model.out.out_features)
    target = ids[:, 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=td.PAD)
    right = ((logits.argmax(1) == target) & (target != td.PAD)).sum()
    return loss, right


def evaluate(model, sentences: np.ndarray) -> tuple[float, float]:
    """(test loss in nats per word, next-word accuracy)."""
    model.eval()
    with torch.no_grad():
        loss, right = next_word_loss(model, sentences)
    model.train()
    return loss.item(), right.item() / int((sentences[:, 1:] != td.PAD).sum())


def trimmed(sentences: np.ndarray) -> np.ndarray:
    """The batch cut after its longest sentence."""
    return sentences[:, :int((sentences != td.PAD).sum(1).max())]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default=None, help="policy spec (default: $HVD_SCALE_POLICY or adascale)")
    p.add_argument("--batch-size", type=int, default=64, help="micro-batch (sentences) per worker and pass")
    p.add_argument("--baseline-batch", type=int, default=None, help="B0 (default: --batch-size)")
    p.add_argument("--accumulate", type=int, default=1, help="backward passes per step")
    p.add_argument("--adapt", choices=["goodput"], default=None,
                   help="adapt the passes per step while training (from --accumulate up to --max-passes)")
    p.add_argument("--max-passes", type=int, default=None, help="the largest k --adapt may choose")
    p.add_argument("--budget", type=float, default=3000, help="baseline (S = 1) steps to train for")
    p.add_argument("--lr", type=float, default=0.01, help="baseline learning rate (Adam)")
    p.add_argument("--hidden", type=int, default=128, help="the GRU's width")
    p.add_argument("--train-size", type=int, default=40_000)
    p.add_argument("--test-size", type=int, default=2_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="print every N optimizer steps (0: never)")
    p.add_argument("--eval-every", type=float, default=0,
                   help="test loss and accuracy every N baseline steps of progress, timed apart (0: at the end)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)
    data = td.load(args.train_size, args.test_size)
    sentences, test = data["tgt"], trimmed(data["tgt_test"])

    model = GRULanguageModel(len(data["grammar"].tgt_vocab), hidden=args.hidden)
    baseline = args.baseline_batch or args.batch_size
    scale = hvd.size() * args.accumulate * args.batch_size / baseline
    opt = DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr),
        named_parameters=model.named_parameters(), policy=args.policy,
        backward_passes_per_step=args.accumulate, scale=scale, budget=args.budget,
        adapt=args.adapt, max_passes=args.max_passes)
    broadcast_state(model, opt)
    schedule = schedules.StepDecay(args.lr, milestones=[int(0.5 * args.budget), int(0.75 * args.budget)])
    batches = (trimmed(s) for s, _ in td.shard_batches(sentences, sentences, args.batch_size,
                                                        hvd.rank(), hvd.size(), seed=args.seed))
    gains = []
    # (training seconds without the evaluations, tau, steps, test loss, accuracy): time to accuracy.
    curve, eval_seconds, next_eval = [], 0.0, args.eval_every
    start = time.perf_counter()
    while not opt.done():
        for group in opt.param_groups:
            group["lr"] = lr_at(schedule, opt.progress)  # the baseline lr at floor(tau)
        opt.zero_grad()
        for _ in range(opt.backward_passes_per_step):  # adapt='goodput' may change it
            # Each micro-batch's mean loss, not divided by k: hvd_scale applies the mean of the
            # k micro-gradients.
            loss, _ = next_word_loss(model, next(batches))
            loss.backward()
        opt.step()
        opt.log_loss(loss.detach())  # the step just taken's row
        gains.append(opt.gain)
        if args.eval_every and opt.progress >= next_eval:
            t0 = time.perf_counter()
            curve.append((t0 - start - eval_seconds, opt.progress, opt.steps, *evaluate(model, test)))
            eval_seconds += time.perf_counter() - t0
            next_eval = (math.floor(opt.progress / args.eval_every) + 1) * args.eval_every
        if hvd.rank() == 0 and args.log_every and opt.steps % args.log_every == 0:
            print(f"step {opt.steps:5d}  tau {opt.progress:8.1f}/{args.budget:g}  "
                  f"gain {opt.gain:5.2f}  lr {group['lr'] * opt.lr_factor:.5f}  loss {loss.item():.3f}",
                  flush=True)
    elapsed = time.perf_counter() - start - eval_seconds
    test_loss, accuracy = evaluate(model, test)
    summary = {
        "rank": hvd.rank(), "policy": opt.policy.spec, "scale": opt.scale, "workers": hvd.size(),
        "accumulate": args.accumulate, "final_passes": opt.backward_passes_per_step,
        "steps": opt.steps, "progress": opt.progress, "test_loss": test_loss,
        "test_accuracy": accuracy, "mean_gain": float(np.mean(gains)) if gains else 1.0,
        "seconds": elapsed, "seed": args.seed, "curve": curve,
        "params_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    if hvd.rank() == 0:
        print(f"done: policy {summary['policy']}, S = {summary['scale']:g}, {summary['steps']} steps "
              f"(tau {summary['progress']:.0f}), test loss {test_loss:.4f}, next-word accuracy "
              f"{accuracy:.4f}, mean gain {summary['mean_gain']:.2f}, {elapsed:.1f} s", flush=True)
    print_result(summary)
    return summary


if __name__ == "__main__":
    main()
