"""Train a small encoder-decoder Transformer with Adam on a generated translation task; BLEU at the end.

    horovodrun --gloo -np 2 -H localhost:2 python examples/torch_translate.py --policy adascale_adam
    torchrun --nproc-per-node 2 examples/torch_translate.py --policy adascale_adam --engine ddp

With --engine ddp the model is a DistributedDataParallel on torch.distributed (Gloo, from
torchrun's environment) and the optimizer hvd_scale's DDP one (hvd_scale.adapters.torch.ddp): the
first k - 1 passes of a step under no_sync(), the data dealt by rank and world size as Horovod's.

The task is examples/translation_data.py (vocabulary mapping, SVO -> SOV reordering, agreement).
The baseline (S = 1) schedule is written once, in baseline steps: a linear warm-up over the first
`--warmup` fraction of the budget to the peak lr, then a cosine decay to 0 at the budget. Every
policy runs it in scale-invariant iterations, lr(floor(tau)) x factor, and stops when tau reaches
the budget, so runs at different scales and with different policies compare.

At the end rank 0 decodes the held-out sentences greedily and scores them with sacrebleu's
`corpus_bleu(..., tokenize="none")`: the target language is already whitespace-tokenized words, so
BLEU is word-level 4-gram BLEU on exactly those words. Every rank prints a `RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import translation_data as td  # noqa: E402

from hvd_scale import lr_at  # noqa: E402
from hvd_scale.adapters.torch import DistributedOptimizer, broadcast_state  # noqa: E402
from hvd_scale.launch.jobs import print_result  # noqa: E402


@dataclasses.dataclass(frozen=True)
class WarmupCosine:
    """lr(t) = lr * min(1, (t + 1) / warmup) * (1 + cos(pi * min(t, T) / T)) / 2, t in baseline steps."""

    lr: float
    warmup: int
    total: int

    def __call__(self, t: int) -> float:
        ramp = min(1.0, (t + 1) / max(1, self.warmup))
        return self.lr * ramp * 0.5 * (1.0 + math.cos(math.pi * min(t, self.total) / self.total))


class Translator(torch.nn.Module):
    """Pre-norm encoder-decoder Transformer, learned positions, untied embeddings."""

    def __init__(self, src_vocab: int, tgt_vocab: int, d_model: int = 64, heads: int = 4,
                 layers: int = 2, ff: int = 128, max_len: int = 32, checkpointing: bool = False):
        super().__init__()
        self.d_model, self.checkpointing = d_model, checkpointing
        self.src_emb = torch.nn.Embedding(src_vocab, d_model, padding_idx=td.PAD)
        self.tgt_emb = torch.nn.Embedding(tgt_vocab, d_model, padding_idx=td.PAD)
        self.pos = torch.nn.Embedding(max_len, d_model)
        kw = dict(d_model=d_model, nhead=heads, dim_feedforward=ff, dropout=0.0, batch_first=True,
                  norm_first=True)
        self.encoder = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(**kw) for _ in range(layers))
        self.decoder = torch.nn.ModuleList(torch.nn.TransformerDecoderLayer(**kw) for _ in range(layers))
        self.enc_norm = torch.nn.LayerNorm(d_model)
        self.dec_norm = torch.nn.LayerNorm(d_model)
        self.out = torch.nn.Linear(d_model, tgt_vocab)

    def _run(self, layer, *args, **kwargs):
        if self.checkpointing and self.training:
            return checkpoint(layer, *args, use_reentrant=False, **kwargs)
        return layer(*args, **kwargs)

    def _embed(self, emb, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return emb(ids) * math.sqrt(self.d_model) + self.pos(positions)

    def encode(self, src):
        pad = src == td.PAD
        x = self._embed(self.src_emb, src)
        for layer in self.encoder:
            x = self._run(layer, x, src_key_padding_mask=pad)
        return self.enc_norm(x), pad

    def decode(self, tgt_in, memory, src_pad):
        n = tgt_in.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        y = self._embed(self.tgt_emb, tgt_in)
        for layer in self.decoder:
            y = self._run(layer, y, memory, tgt_mask=causal, tgt_is_causal=True,
                          memory_key_padding_mask=src_pad)
        return self.out(self.dec_norm(y))

    def forward(self, src, tgt_in):
        memory, pad = self.encode(src)
        return self.decode(tgt_in, memory, pad)


@torch.no_grad()
def translate(model: Translator, src: np.ndarray, max_len: int = td.TGT_LEN, batch: int = 250) -> list:
    """Greedy decoding, batched; a list of id lists (without BOS)."""
    model.eval()
    out = []
    for i in range(0, len(src), batch):
        s = torch.from_numpy(src[i:i + batch])
        s = s[:, :int((s != td.PAD).sum(1).max())]
        memory, pad = model.encode(s)
        ys = torch.full((len(s), 1), td.BOS, dtype=torch.long)
        finished = torch.zeros(len(s), dtype=torch.bool)
        for _ in range(max_len - 1):
            nxt = model.decode(ys, memory, pad)[:, -1].argmax(-1)
            nxt = torch.where(finished, torch.full_like(nxt, td.PAD), nxt)
            ys = torch.cat([ys, nxt[:, None]], 1)
            finished |= nxt == td.EOS
            if finished.all():
                break
        out += [row[1:].tolist() for row in ys]
    model.train()
    return out


def held_out_bleu(model: Translator, data: dict) -> tuple[float, dict]:
    """BLEU of greedy translations of the held-out sentences, and the first one as a sample."""
    hyps = [td.decode(ids, data["grammar"].tgt_vocab) for ids in translate(model, data["src_test"])]
    return bleu(hyps, data["refs"]), {"hyp": hyps[0], "ref": data["refs"][0]}


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (sacrebleu, word-level: tokenize='none', the words are already split)."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none").score)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["horovod", "ddp"], default="horovod",
                   help="horovod (horovodrun) or ddp (torchrun: torch.distributed, Gloo)")
    p.add_argument("--policy", default=None, help="policy spec (default: $HVD_SCALE_POLICY or adascale)")
    p.add_argument("--batch-size", type=int, default=32, help="micro-batch (sentences) per worker and pass")
    p.add_argument("--baseline-batch", type=int, default=None, help="B0 (default: --batch-size)")
    p.add_argument("--accumulate", type=int, default=1, help="backward passes per step")
    p.add_argument("--adapt", choices=["goodput"], default=None,
                   help="adapt the passes per step while training (from --accumulate up to --max-passes)")
    p.add_argument("--max-passes", type=int, default=None, help="the largest k --adapt may choose")
    p.add_argument("--budget", type=float, default=1500, help="baseline (S = 1) steps to train for")
    p.add_argument("--lr", type=float, default=2e-3, help="baseline peak learning rate (Adam)")
    p.add_argument("--optimizer", choices=["adam", "adamw"], default="adam",
                   help="Adam, or AdamW with decoupled --weight-decay")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's decoupled decay")
    p.add_argument("--warmup", type=float, default=0.1, help="baseline warm-up, fraction of the budget")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers (each)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ff", type=int, default=128)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing: every encoder/decoder layer recomputed in backward")
    p.add_argument("--train-size", type=int, default=40_000)
    p.add_argument("--test-size", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps even if tau < budget (0: 4 x budget)")
    p.add_argument("--log-every", type=int, default=50, help="print every N optimizer steps (0: never)")
    p.add_argument("--eval-every", type=float, default=0,
                   help="held-out BLEU every N baseline steps of progress, timed apart (0: at the end)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.engine == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from hvd_scale.adapters.torch import ddp

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)
    data = td.load(args.train_size, args.test_size)
    grammar = data["grammar"]

    model = Translator(len(grammar.src_vocab), len(grammar.tgt_vocab), d_model=args.d_model,
                       heads=args.heads, layers=args.layers, ff=args.ff,
                       checkpointing=args.checkpointing)
    baseline = args.baseline_batch or args.batch_size
    scale = size * args.accumulate * args.batch_size / baseline
    inner = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9) \
        if args.optimizer == "adam" else \
        torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9,
                          weight_decay=args.weight_decay)
    kw = dict(policy=args.policy, backward_passes_per_step=args.accumulate, scale=scale,
              budget=args.budget, adapt=args.adapt, max_passes=args.max_passes)
    if args.engine == "ddp":  # DDP broadcasts the weights when it wraps the model
        # (Both engines start from a fresh Adam: Horovod's broadcast_state takes no step.)
        net = DistributedDataParallel(model)  # trains; model (its module) decodes
        opt = ddp.DistributedOptimizer(inner, net, **kw)
    else:
        net = model
        opt = DistributedOptimizer(inner, named_parameters=model.named_parameters(), **kw)
        broadcast_state(model, opt)
    schedule = WarmupCosine(args.lr, warmup=max(1, int(args.warmup * args.budget)), total=int(args.budget))
    batches = td.shard_batches(data["src"], data["tgt"], args.batch_size, rank, size,
                               seed=args.seed)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=td.PAD, label_smoothing=args.label_smoothing)
    max_steps = args.max_steps or int(4 * args.budget)
    gains, losses = [], []
    # (training seconds without the evaluations, tau, steps, held-out BLEU): quality against
    # steps and time (benchmarks/fair_fight.py). Rank 0 decodes; greedy decoding draws no random
    # numbers, so the training is the same with or without it.
    curve, eval_seconds, next_eval = [], 0.0, args.eval_every
    start = time.perf_counter()
    while not opt.done() and opt.steps < max_steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(schedule, opt.progress)  # the baseline lr at floor(tau)
        opt.zero_grad()
        k = opt.backward_passes_per_step  # adapt='goodput' may change it
        for i in range(k):
            src, tgt = (torch.from_numpy(a) for a in next(batches))
            # Each micro-batch's mean loss, not divided by k: hvd_scale applies the mean of the
            # k micro-gradients. DDP: the first k - 1 passes unsynchronized.
            with net.no_sync() if args.engine == "ddp" and i < k - 1 else contextlib.nullcontext():
                logits = net(src, tgt[:, :-1])
                loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1))
                loss.backward()
        opt.step()
        opt.log_loss(loss.detach())  # the step just taken's row
        gains.append(opt.gain)
        losses.append(loss.item())
        if args.eval_every and opt.progress >= next_eval:
            t0 = time.perf_counter()
            if rank == 0:
                curve.append((t0 - start - eval_seconds, opt.progress, opt.steps,
                              held_out_bleu(model, data)[0]))
            eval_seconds += time.perf_counter() - t0
            next_eval = (math.floor(opt.progress / args.eval_every) + 1) * args.eval_every
        if rank == 0 and args.log_every and opt.steps % args.log_every == 0:
            print(f"step {opt.steps:5d}  tau {opt.progress:8.1f}/{args.budget:g}  "
                  f"gain {opt.gain:5.2f}  lr {group['lr'] * opt.lr_factor:.5f}  loss {loss.item():.3f}",
                  flush=True)
    elapsed = time.perf_counter() - start - eval_seconds

    score, sample = held_out_bleu(model, data) if rank == 0 else (None, None)
    summary = {
        "rank": rank, "policy": opt.policy.spec, "scale": opt.scale, "workers": size,
        "accumulate": args.accumulate, "final_passes": opt.backward_passes_per_step,
        "optimizer": args.optimizer, "steps": opt.steps, "progress": opt.progress,
        "skipped": opt.skipped, "bleu": score,
        "final_loss": float(np.mean(losses[-20:])) if losses else None,
        "mean_gain": float(np.mean(gains)) if gains else 1.0, "seconds": elapsed,
        "eval_seconds": time.perf_counter() - start - elapsed, "seed": args.seed, "curve": curve,
        "checkpointing": args.checkpointing, "sample": sample,
        "params_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    if rank == 0:
        print(f"done: policy {summary['policy']}, S = {summary['scale']:g}, {summary['steps']} steps "
              f"(tau {summary['progress']:.0f}), BLEU {score:.2f}, mean gain {summary['mean_gain']:.2f}, "
              f"{elapsed:.1f} s", flush=True)
    print_result(summary)
    if args.engine == "ddp":
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
