"""examples/fsdp_tutorial_before.py (the shape of PyTorch's FSDP2 example) with hvd_scale's FSDP2
optimizer: the wrapped Adam, k micro-batches a step (the first k - 1 without gradient sync), the
policy's numbers printed, and the checkpoint's optimizer state through hvd_scale's DCP functions
(the same calls as torch's, with the run's record: tau and the estimates resume with the model).
The policy comes from the launcher (HVD_SCALE_POLICY, `hvd-scale run --policy`).

    HVD_SCALE_POLICY=adascale_adam torchrun --nproc-per-node 2 examples/fsdp_tutorial_after.py \
        --steps 10 --passes 2

The FSDP2 guide (docs/fsdp.md) shows the diff against the "before".
"""

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed.nn  # noqa: F401  (before init: see docs/troubleshooting.md, Gloo's exit)
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, set_model_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hvd_scale.adapters.torch.dcp import get_optimizer_state_dict, set_optimizer_state_dict
from hvd_scale.adapters.torch.fsdp import DistributedOptimizer


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 32
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False)
                                              for _ in range(4))

    def forward(self, x):
        bsz, seq_len, dim = x.size()
        q, k, v = (w(x).view(bsz, seq_len, self.n_heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, dim))

    def reset_parameters(self):
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                                          nn.Linear(4 * args.dim, args.dim))

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self):
        for m in (self.attention_norm, self.attention, self.ffn_norm,
                  self.feed_forward[0], self.feed_forward[2]):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self):
        for m in (self.tok_embeddings, self.pos_embeddings, self.norm, self.output):
            m.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()


class Checkpointer:
    """checkpoint.py's DCP-API path: full state dicts, written by rank 0 into a new folder."""

    def __init__(self, folder):
        self.folder = folder
        runs = [int(n) for n in os.listdir(folder) if n.isdigit()] if os.path.isdir(folder) else []
        self.last_training_time = max(runs, default=None)

    def _path(self, what):
        return os.path.join(self.folder, str(self.last_training_time), what)

    def load_model(self, model):
        full_sd = torch.load(self._path("model_state_dict.pt"), mmap=True, weights_only=True)
        set_model_state_dict(model, full_sd, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    def load_optim(self, model, opt):
        full_sd = torch.load(self._path("optim_state_dict.pt"), mmap=True, weights_only=True)
        set_optimizer_state_dict(model, opt, full_sd, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    def save(self, model, opt, training_time):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = get_optimizer_state_dict(model, opt, options=options)
        if torch.distributed.get_rank() == 0:
            folder = os.path.join(self.folder, str(training_time))
            os.makedirs(folder, exist_ok=True)
            torch.save(model_sd, os.path.join(folder, "model_state_dict.pt"))
            torch.save(optim_sd, os.path.join(folder, "optim_state_dict.pt"))


def set_modules_to_forward_prefetch(model, num_to_forward_prefetch):
    for i, layer in enumerate(model.layers[:-num_to_forward_prefetch]):
        layer.set_modules_to_forward_prefetch(
            [model.layers[i + j] for j in range(1, num_to_forward_prefetch + 1)])


def batch(generator, args, batch_size):
    """Random tokens; each position's target is a fixed function of its token (learnable)."""
    x = torch.randint(0, args.vocab_size, (batch_size, args.max_seq_len), generator=generator)
    return x, (3 * x + 1) % args.vocab_size


def main(args):
    torch.distributed.init_process_group(backend="gloo")  # torchrun's environment
    rank = torch.distributed.get_rank()
    device = torch.device("cpu")

    torch.manual_seed(0)  # the same initial model on every rank
    model_args = ModelArgs()
    with torch.device("meta"):
        model = Transformer(model_args)
    fsdp_kwargs = {}
    if args.mixed_precision:
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    if args.explicit_prefetching:
        set_modules_to_forward_prefetch(model, num_to_forward_prefetch=1)

    checkpointer = Checkpointer(args.checkpoint_dir)
    if checkpointer.last_training_time is None:
        model.to_empty(device=device)
        model.reset_parameters()
    else:
        model.to_empty(device=device)
        checkpointer.load_model(model)

    optim = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr), model,
                                 backward_passes_per_step=args.passes)
    start = 0
    if checkpointer.last_training_time is not None:
        checkpointer.load_optim(model, optim)
        start = checkpointer.last_training_time
        print(f"[RANK{rank}] resumed at step {start}, tau {optim.progress:g}")

    data = torch.Generator().manual_seed(1000 * start + rank)  # each rank its own samples
    for step in range(start, start + args.steps):
        for i in range(args.passes):
            model.set_requires_gradient_sync(i == args.passes - 1)
            x, y = batch(data, model_args, args.batch_size)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    if rank == 0:
        print(f"{optim.policy.spec} at S = {optim.scale:g}: {optim.steps} steps, "
              f"tau {optim.progress:.2f}, gain {optim.gain:.3f}", flush=True)
    checkpointer.save(model, optim, start + args.steps)
    del model, optim  # FSDP's hooks and the group go before the group is destroyed
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example, on the CPU")
    parser.add_argument("--explicit-prefetching", action="store_true", default=False)
    parser.add_argument("--mixed-precision", action="store_true", default=False)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--passes", type=int, default=1, help="micro-batches a step (k)")
    main(parser.parse_args())
