"""Shared pieces of the example LMs: a small GPT, the Python standard library as text, batches.

The model is a GPT-style byte-level transformer (vocabulary: the 256 byte values), a few
hundred thousand parameters by default. The text is the ``.py`` sources of the Python
standard library this interpreter runs on (``sysconfig.get_paths()["stdlib"]``): always
there, nothing to download. Files are read in an order fixed by a hash of their path
(a mix of modules, the same on every machine with this Python version) until ``--text-mb``
MB; the last 5% of those bytes are the validation set: every rank and every run sees the
same split. Batches are
drawn from a generator seeded by (seed, rank, step): a run is reproducible, and every
synchronization schedule trains on exactly the same data.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    a = p.add_argument
    a("--steps", type=int, default=300, help="optimizer steps")
    a("--batch-size", type=int, default=16, help="sequences per rank per step")
    a("--block", type=int, default=64, help="context length in bytes")
    a("--layers", type=int, default=2)
    a("--heads", type=int, default=4)
    a("--dim", type=int, default=128, help="embedding width (2 layers x 128: about 440K parameters)")
    a("--lr", type=float, default=3e-3, help="peak AdamW lr (linear warmup, cosine decay to lr/10)")
    a("--text-mb", type=float, default=4.0, help="MB of stdlib source to read (train + val)")
    a("--eval-batches", type=int, default=16, help="validation batches (split over the ranks)")
    a("--seed", type=int, default=0)
    a("--period", type=int, default=4, help="hiersync: cross-node sync every k steps (1: exact all-reduce)")
    a("--fragments", type=int, default=1, help="hiersync: streaming fragments (1: whole model at once)")
    a("--overlap", type=int, default=0, help="hiersync: apply each sync this many steps late (0: blocking)")
    a("--warmup-steps", type=int, default=0, help="hiersync: exact-sync steps before local SGD starts")
    a("--compress", default=None, choices=["bf16", "fp16", "int8", "int4"], help="hiersync: inter-node deltas")
    return p


def hiersync_options(args: argparse.Namespace) -> dict:
    return dict(
        period=args.period,
        fragments=args.fragments,
        overlap=args.overlap,
        warmup_steps=args.warmup_steps,
        compress=args.compress,
    )


def setup() -> tuple[int, int, torch.device]:
    """Under torchrun: the process group (NCCL on CUDA, else gloo) and this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def load_text(mb: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) byte tensors from the standard library's ``.py`` files, about ``mb`` MB in all."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subdirs, names in os.walk(root):
        # installed packages differ between machines; the stdlib does not
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    parts, size = [], 0
    for path in sorted(files, key=lambda f: zlib.crc32(os.path.relpath(f, root).encode())):
        try:
            parts.append(Path(path).read_bytes())
        except OSError:
            continue
        size += len(parts[-1])
        if size >= mb * 1e6:
            break
    text = torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8).long()
    cut = int(0.95 * len(text))
    return text[:cut], text[cut:]


def get_batch(
    data: torch.Tensor, batch: int, block: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(data) - block - 1, (batch,), generator=g)
    x = torch.stack([data[i : i + block] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + block] for i in ix.tolist()])
    return x.to(device), y.to(device)


def train_batch(data: torch.Tensor, args: argparse.Namespace, rank: int, step: int, device: torch.device):
    return get_batch(data, args.batch_size, args.block, (args.seed * 1_000_003 + step) * 4096 + rank, device)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Multiplier of the peak lr: linear warmup over 5% of the steps, cosine to 0.1 at ``steps``, then 0.1."""
    warm = max(1, args.steps // 20)
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, args.steps - warm))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    """Mean validation loss over ``args.eval_batches`` fixed batches, split over the ranks (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    was_training = model.training
    model.eval()
    total = torch.zeros(2, device=device)
    for i in range(rank, args.eval_batches, world):
        x, y = get_batch(val, args.batch_size, args.block, 10**9 + i, device)
        total += torch.stack([model(x, y)[1].float(), torch.ones((), device=device)])
    dist.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT: token + position embeddings, pre-LN blocks, tied output head."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(args.seed)  # the same initial weights on every rank and in every run
        self.tok = nn.Embedding(256, args.dim)
        self.pos = nn.Parameter(torch.zeros(args.block, args.dim))
        self.blocks = nn.Sequential(*[Block(args.dim, args.heads) for _ in range(args.layers)])
        self.ln = nn.LayerNorm(args.dim)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        h = self.ln(self.blocks(self.tok(x) + self.pos[: x.shape[1]]))
        logits = h @ self.tok.weight.t()
        loss = None if y is None else F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
        return logits, loss
