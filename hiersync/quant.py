"""Block-scaled 8- and 4-bit codes for the deltas sent across nodes (``compress="int8"|"int4"``).

A vector is cut into blocks of :data:`QUANT_BLOCK` values; each block is sent as one fp32
scale (its largest magnitude over ``qmax``) and one signed code per value, rounded to the
nearest level: ``q = round(x / scale)`` in ``[-qmax, qmax]`` (127 for 8 bits, 7 for 4; two
4-bit codes share a byte). Quantized values cannot be summed inside an all-reduce, so the
rail average is the way every system that ships them does it (torchft's quantized
collectives, DeepSpeed ZeRO++'s qgZ): an all-to-all of quantized pieces, a sum in fp32,
a requantization, an all-gather (:meth:`hiersync.collectives.HierComm.average_quantized`).

Error feedback: what the codes of a delta leave out is kept (:class:`ErrorFeedback`) and
added to the next delta of the same shard, so over the windows nothing is lost, only late.
Each rank keeps it for what it sends (its own shard) and for the piece it reduces.

Pure torch (no process group): the reference quantizer of the tests is written apart, in
plain torch, and must match this one to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .vocab import QUANT_BLOCK

__all__ = ["BlockCodec", "codec_for", "ErrorFeedback"]

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
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(blocks * inv.unsqueeze(1)).clamp_(-self.qmax, self.qmax)
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


def codec_for(compress: str) -> BlockCodec:
    """The codec of ``compress="int8"`` or ``"int4"``."""
    if compress not in ("int8", "int4"):
        raise ValueError(f"compress={compress!r} is not a block-quantized payload; use 'int8' or 'int4'")
    return BlockCodec(bits=int(compress[3:]))


class ErrorFeedback:
    """Encode with error feedback: ``x + residual`` is sent, what its codes miss is kept.

    ``residual`` is an fp32 vector of the shard's padded length, updated in place, so that
    after any number of windows ``sum(sent) + residual == sum(x)`` (to fp32 rounding).
    """

    def __init__(self, codec: BlockCodec) -> None:
        self.codec = codec

    def encode(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, residual)``: the codes of ``x + residual`` and the new residual."""
        e = x if residual is None else x.add_(residual)
        packed = self.codec.encode(e)
        residual = e.sub_(self.codec.decode(packed, e.numel()))  # in place on ``x``: it is not used again
        return packed, residual
