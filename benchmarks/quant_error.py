"""Block size and rounding of the int8/int4 codes, chosen by what they do to real deltas.

Trains the example char-LM (examples/_lm.py) in one process with AdamW and records, every
k steps, the delta the sync would send (parameters minus the last anchor). Each delta is
then encoded as hiersync does (one fp32 scale per block, signed codes) with several block
sizes and two roundings, and the table gives, per (bits, block, rounding):

* ``bits/value``: what crosses the link, scales included;
* ``err one window``: mean over windows of |decode(encode(delta)) - delta| / |delta| (L2);
* ``err after W``: |sum(sent) - sum(deltas)| / |sum(deltas)| over all W windows, without and
  with error feedback (what the codes left out is added to the next delta), its residual
  kept in fp32 or in bf16 (what hiersync keeps, ``hiersync.quant.RESIDUAL_DTYPE``).

Round to nearest is what hiersync ships (``hiersync.quant.BlockCodec``); stochastic rounding
(``floor(x / scale + u)``, u uniform in [0, 1)) is measured here only, for the comparison.

    python benchmarks/quant_error.py --steps 120    # ~1 min on 2 CPU cores (30 windows)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import _lm

from hiersync._table import render
from hiersync.quant import RESIDUAL_DTYPE, BlockCodec


def deltas(args: argparse.Namespace) -> list[torch.Tensor]:
    """Every k-step delta of a short char-LM run (one process, AdamW, the example's lr schedule)."""
    torch.manual_seed(args.seed)
    train, _ = _lm.load_text(args.text_mb)
    model = _lm.GPT(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    anchor, out = flat(), []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = _lm.lr_at(step, args)
        x, y = _lm.train_batch(train, args, 0, step, torch.device("cpu"))
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.period == 0:
            now = flat()
            out.append(now - anchor)
            anchor = now
    return out


def stochastic(codec: BlockCodec, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Encode-decode with stochastic rounding (the comparison; hiersync rounds to nearest)."""
    blocks = x.reshape(-1, codec.block)
    scale = blocks.abs().amax(1, keepdim=True) / codec.qmax
    u = torch.rand(blocks.shape, generator=gen)
    q = torch.floor(torch.where(scale > 0, blocks / scale, 0.0) + u).clamp_(-codec.qmax, codec.qmax)
    return (q * scale).reshape(-1)


def measure(ds: list[torch.Tensor], codec: BlockCodec, rounding: str) -> tuple[float, float, float, float]:
    gen = torch.Generator().manual_seed(0)
    n = codec.padded(ds[0].numel())

    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        if rounding == "nearest":
            return codec.decode(codec.encode(x), n)
        return stochastic(codec, x, gen)

    one, total = [], torch.zeros(n)
    sent_plain = torch.zeros(n)
    sent_fed = {torch.float32: torch.zeros(n), RESIDUAL_DTYPE: torch.zeros(n)}  # by the residual's dtype
    residual = {dtype: torch.zeros(n, dtype=dtype) for dtype in sent_fed}
    for d in ds:
        x = torch.zeros(n)
        x[: d.numel()] = d
        total += x
        y = roundtrip(x)
        one.append(float((y - x).norm() / x.norm()))
        sent_plain += y
        for dtype in sent_fed:
            e = x + residual[dtype]
            s = roundtrip(e)
            residual[dtype] = (e - s).to(dtype)
            sent_fed[dtype] += s
    rel = lambda sent: float((sent - total).norm() / total.norm())
    return sum(one) / len(one), rel(sent_plain), rel(sent_fed[torch.float32]), rel(sent_fed[RESIDUAL_DTYPE])


def main(argv: list[str] | None = None) -> int:
    p = _lm.parser(__doc__.splitlines()[0])
    p.add_argument("--blocks", default="32,64,128,256", help="block sizes to compare")
    args = p.parse_args(argv)
    ds = deltas(args)
    W = len(ds)
    print(f"char-LM: {args.layers} layers, dim {args.dim}, AdamW lr {args.lr}, k={args.period}")
    print(f"{W} windows of {args.period} steps, {ds[0].numel()} values each")
    table = []
    for bits in (8, 4):
        for block in (int(b) for b in args.blocks.split(",")):
            codec = BlockCodec(bits, block)
            for rounding in ("nearest", "stochastic"):
                one, plain, fed32, fed16 = measure(ds, codec, rounding)
                bpv = codec.packed_bytes(block * 64) * 8 / (block * 64)
                cells = [str(bits), str(block), rounding, f"{bpv:.3f}", f"{one:.4f}"]
                table.append([*cells, f"{plain:.4f}", f"{fed32:.5f}", f"{fed16:.5f}"])
    head = ["bits", "block", "rounding", "bits/value", "err one window", "err after W, no feedback"]
    print(render([*head, "feedback, fp32 residual", "bf16 residual"], table, align="r"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
