"""Block-scaled 8- and 4-bit codes for the deltas sent across nodes (``compress="int8"|"int4"``).

A vector is cut into blocks of :data:`QUANT_BLOCK` values; each block is sent as one fp32
scale (its largest magnitude over ``qmax``) and one signed code per value, rounded to the
nearest level: ``q = round(x / scale)`` in ``[-qmax, qmax]`` (127 for 8 bits, 7 for 4; two
4-bit codes share a byte). Quantized values cannot be summed inside an all-reduce, so the
rail average is the way every system that ships them does it (torchft's quantized
collectives, DeepSpeed ZeRO++'s qgZ): an all-to-all of quantized pieces, a sum in fp32,
a requantization, an all-gather (:meth:`hiersync.collectives.HierComm.average_quantized`).

Error feedback: what the codes of a delta leave out is kept (:class:`ErrorFeedback`) and
added to the next delta of the same shard, so over the windows nothing is lost, only late
(to the bf16 rounding it is kept in).
Each rank keeps it for what it sends (its own shard) and for the piece it reduces.

Pure torch (no process group): the reference quantizer of the tests is written apart, in
plain torch, and must match this one to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .vocab import QUANT_BLOCK, RESIDUAL_BYTES

__all__ = ["BlockCodec", "NoFeedback", "codec_for", "ErrorFeedback", "RESIDUAL_DTYPE"]

_QMAX = {8: 127, 4: 7}


@dataclass(frozen=True)
class BlockCodec:
    """Signed ``bits``-bit codes with one fp32 scale per ``block`` values, round to nearest."""

    bits: int
    block: int = QUANT_BLOCK

    def __post_init__(self) -> None:
        if self.bits not in _QMAX:
            raise ValueError(f"bits={self.bits} is not supported; use 8 or 4")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"block={self.block} must be an even number of values >= 2")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def qmax(self) -> int:
        return _QMAX[self.bits]

    def packed_bytes(self, n: int) -> int:
        """Bytes of ``n`` values (a multiple of ``block``): the codes, then the scales."""
        return n * self.bits // 8 + (n // self.block) * 4

    def padded(self, n: int, pieces: int = 1) -> int:
        """``n`` rounded up so that it splits into ``pieces`` pieces of whole blocks."""
        unit = self.block * pieces
        return -(-n // unit) * unit

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Codes and scales of ``x`` (fp32, length a multiple of ``block``) as one uint8 vector."""
        n = x.numel()
        if n % self.block:
            raise ValueError(f"encode needs a multiple of {self.block} values, got {n}")
        blocks = x.reshape(-1, self.block)
        scale = blocks.abs().amax(dim=1) / self.qmax
        # Divided, not multiplied by 1 / scale: a block of values near the smallest normal
        # float has a subnormal scale whose reciprocal overflows (and 0 * inf is NaN).
        s = scale.unsqueeze(1)
        q = torch.where(s > 0, blocks / s, 0.0).round_().clamp_(-self.qmax, self.qmax)
        if self.bits == 8:
            codes = q.to(torch.int8).view(torch.uint8).reshape(-1)
        else:
            u = (q + 8).to(torch.uint8).reshape(-1, 2)  # 1..15 in a nibble
            codes = u[:, 0] | (u[:, 1] << 4)
        return torch.cat([codes, scale.to(torch.float32).view(torch.uint8)])

    def decode(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """The fp32 values of :meth:`encode`'s output for ``n`` values."""
        ncodes = n * self.bits // 8
        codes, scale = packed[:ncodes], packed[ncodes:].view(torch.float32)
        if self.bits == 8:
            q = codes.view(torch.int8).to(torch.float32)
        else:
            q = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1).to(torch.float32) - 8
        return (q.reshape(-1, self.block) * scale.unsqueeze(1)).reshape(-1)

    def encode_pieces(self, x: torch.Tensor, pieces: int) -> torch.Tensor:
        """``x`` cut into ``pieces`` equal pieces, each encoded on its own (codes, then scales),
        end to end: piece ``j`` is bytes ``[j * b, (j + 1) * b)`` with ``b = packed_bytes(n / pieces)``."""
        return torch.cat([self.encode(p) for p in x.reshape(pieces, -1)])

    def decode_pieces(self, packed: torch.Tensor, n: int, pieces: int) -> torch.Tensor:
        """The ``n`` fp32 values of :meth:`encode_pieces`'s output."""
        m = n // pieces
        b = self.packed_bytes(m)
        return torch.cat([self.decode(packed[j * b : (j + 1) * b], m) for j in range(pieces)])


@dataclass(frozen=True)
class NoFeedback(BlockCodec):
    """The same codes, sent without error feedback (``error_feedback=False``): what they
    leave out is lost. Only to measure what the feedback buys."""

    def __init__(self, codec: BlockCodec) -> None:
        object.__setattr__(self, "bits", codec.bits)
        object.__setattr__(self, "block", codec.block)


def codec_for(compress: str) -> BlockCodec:
    """The codec of ``compress="int8"`` or ``"int4"``."""
    if compress not in ("int8", "int4"):
        raise ValueError(f"compress={compress!r} is not a block-quantized payload; use 'int8' or 'int4'")
    return BlockCodec(bits=int(compress[3:]))


RESIDUAL_DTYPE = torch.bfloat16
"""What error feedback keeps between windows is stored in bf16. A residual is at most half a
code's step and bf16 holds it to 2^-9 of itself, so a window loses ~1/500 of what its codes
alone would (``benchmarks/quant_error.py`` measures it); fp32 residuals would cost 3/4 of
the parameters' fp32 bytes per rank at 2 ranks per node, the whole of streaming's budget."""
assert torch.finfo(RESIDUAL_DTYPE).bits == 8 * RESIDUAL_BYTES  # what the cost model prices


class ErrorFeedback:
    """Encode with error feedback: ``x + residual`` is sent, what its codes miss is kept.

    ``pieces``: the vector is cut into that many pieces, each encoded on its own
    (:meth:`BlockCodec.encode_pieces`). After any number of windows
    ``sum(sent) + residual == sum(x)`` up to the bf16 rounding of each window's residual
    (:data:`RESIDUAL_DTYPE`).
    """

    def __init__(self, codec: BlockCodec, pieces: int = 1) -> None:
        self.codec, self.pieces = codec, pieces

    def encode(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, left)``: the codes of ``x + residual`` and what they leave out (fp32).

        ``x`` is fp32 of a padded length and is overwritten (``left`` is a view of it); a
        ``residual`` shorter than ``x`` covers its start (the shard before padding).
        """
        if residual is not None:
            x[: residual.numel()].add_(residual)
        packed = self.codec.encode_pieces(x, self.pieces)
        return packed, x.sub_(self.codec.decode_pieces(packed, x.numel(), self.pieces))

    @staticmethod
    def keep(left: torch.Tensor, residual: torch.Tensor | None, store=lambda t: t) -> torch.Tensor:
        """``left`` as the next residual: copied into ``residual`` (rounded to its dtype) where
        there is one of its length, else ``store(left in RESIDUAL_DTYPE)``."""
        if residual is not None and residual.numel() == left.numel():
            return residual.copy_(left, non_blocking=True)
        return store(left.to(RESIDUAL_DTYPE))
