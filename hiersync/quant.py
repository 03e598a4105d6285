"""The codecs of the deltas sent across nodes: one per row of :data:`hiersync.vocab.WIRE_FORMATS`.

:func:`codec_for` turns a ``compress=`` name into a :class:`Codec`: ``None`` for fp32 (the
parameters themselves are averaged), else the class its row names in :data:`CODECS`: a
:class:`CastCodec` for bf16/fp16 (the delta against the fp32 anchor, cast, summed by the
rail's all-reduce), a :class:`BlockCodec` for int8/int4. A codec owns the whole wire path of
a shard's delta (:meth:`Codec.average`): encode with the residuals it keeps, average through
the comm it is given, decode. A new kind of payload is a class here and a row of
:data:`~hiersync.vocab.WIRE_FORMATS`.

Block-scaled 8- and 4-bit codes (``compress="int8"|"int4"``):

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .futures import completed, then, wait
from .vocab import QUANT_BLOCK, RESIDUAL_BYTES, WIRE_FORMATS, WireFormat, wire_format

__all__ = [
    "Codec",
    "Site",
    "Kept",
    "CastCodec",
    "BlockCodec",
    "SparseCodec",
    "CODECS",
    "codec_for",
    "ErrorFeedback",
    "RESIDUAL_DTYPE",
]


class Site(Protocol):
    """What a codec's average is given by the averager of a shard (:class:`hiersync.averagers.RailAverager`)."""

    comm: Any
    """The shard's :class:`hiersync.sync.AveragerComm`: its rail, its weighting, the rail averages."""
    transfer: Callable[[torch.Tensor], torch.futures.Future]
    """The rail average of a summed payload (an all-reduce, or the leaders' on uneven nodes)."""

    def stored(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as kept between syncs (on the state device)."""
        ...

    def here(self, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """A kept tensor on ``device`` for the maths (a transient copy when offloaded)."""
        ...


class Kept(Protocol):
    """What a codec keeps of a shard between syncs (:class:`hiersync.averagers.ChunkState`)."""

    residual: torch.Tensor | None
    """What this node's payloads of the shard left out (error feedback)."""
    reduced_residual: torch.Tensor | None
    """The same for what this rank re-encodes after an fp32 sum (the quantized rail average)."""


class Codec(Protocol):
    """A kind of payload of the inter-node average: the whole wire path of one shard's delta."""

    @property
    def wire(self) -> WireFormat:
        """Its row of :data:`~hiersync.vocab.WIRE_FORMATS`."""
        ...

    def padded(self, n: int, nodes: int) -> int:
        """The length of the fp32 delta it is given for a shard of ``n`` values (zeros after ``n``)."""
        ...

    def average(self, site: Site, e: torch.Tensor, n: int, kept: Kept) -> torch.futures.Future:
        """Start the rail average of the delta ``e`` (fp32, :meth:`padded` long, its own to
        overwrite) of an ``n``-value shard; the future's value is what :meth:`result` reads."""
        ...

    def result(self, got: torch.Tensor, weighting: Any, out: torch.Tensor | None) -> torch.Tensor:
        """The averaged fp32 delta of :meth:`average`'s value (into ``out`` if given)."""
        ...


def _into(got: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``got`` as an fp32 vector: ``out`` (a copy unless it is ``got``), or ``got`` itself if fp32."""
    if out is None:
        return got.float()
    return out if out.data_ptr() == got.data_ptr() else out.copy_(got)


@dataclass(frozen=True)
class CastCodec:
    """A delta sent as a narrower float (bf16, fp16), summed by the rail's all-reduce."""

    wire: WireFormat

    @classmethod
    def of(cls, wire: WireFormat, feedback: bool = True, options: Any = None) -> CastCodec:
        return cls(wire)

    @property
    def dtype(self) -> torch.dtype:
        assert self.wire.dtype is not None
        return getattr(torch, self.wire.dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def padded(self, n: int, nodes: int) -> int:
        return n

    def average(self, site: Site, e: torch.Tensor, n: int, kept: Kept) -> torch.futures.Future:
        return site.transfer(self.encode(e))  # the comm weighs this node's payload

    def result(self, got: torch.Tensor, weighting: Any, out: torch.Tensor | None) -> torch.Tensor:
        avg = _into(got, out)  # into ``out`` by a copy: an add of 16 bits to fp32 makes an fp32 temporary
        if weighting is not None and (r := weighting.rescale()) != 1.0:  # the sum's weights to the samples' total
            avg.mul_(r)
        return avg


_QMAX = {8: 127, 4: 7}


@dataclass(frozen=True)
class BlockCodec:
    """Signed ``bits``-bit codes with one fp32 scale per ``block`` values, round to nearest.

    ``feedback``: keep what the codes leave out and send it with the next delta
    (:class:`ErrorFeedback`); ``False`` (``error_feedback=False``) loses it, only to measure
    what the feedback buys.
    """

    bits: int
    block: int = QUANT_BLOCK
    feedback: bool = True

    def __post_init__(self) -> None:
        if self.bits not in _QMAX:
            raise ValueError(f"bits={self.bits} is not supported; use 8 or 4")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"block={self.block} must be an even number of values >= 2")

    @classmethod
    def of(cls, wire: WireFormat, feedback: bool = True, options: Any = None) -> BlockCodec:
        assert wire.bits is not None and wire.block is not None
        return cls(bits=wire.bits, block=wire.block, feedback=feedback)

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def wire(self) -> WireFormat:
        return WIRE_FORMATS[self.name]

    @property
    def qmax(self) -> int:
        return _QMAX[self.bits]

    def packed_bytes(self, n: int) -> int:
        """Bytes of ``n`` values (a multiple of ``block``): the codes, then the scales."""
        return n * self.bits // 8 + (n // self.block) * 4

    def padded(self, n: int, nodes: int = 1) -> int:
        """``n`` rounded up so that it splits into ``nodes`` pieces of whole blocks."""
        unit = self.block * nodes
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
        # In place on one fp32 temporary (the where of a division would take two)
        q = torch.div(blocks, s).masked_fill_(~(s > 0), 0.0).round_().clamp_(-self.qmax, self.qmax)
        if self.bits == 8:
            codes = q.to(torch.int8).view(torch.uint8).reshape(-1)
        else:
            u = q.add_(8).to(torch.uint8).reshape(-1, 2)  # 1..15 in a nibble
            codes = u[:, 0] | (u[:, 1] << 4)
        return torch.cat([codes, scale.to(torch.float32).view(torch.uint8)])

    def decode(self, packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 values of :meth:`encode`'s output for ``n`` values (written into ``out`` if given)."""
        ncodes = n * self.bits // 8
        codes, scale = packed[:ncodes], packed[ncodes:].view(torch.float32)
        q = codes.view(torch.int8) if self.bits == 8 else torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)
        out = q.to(torch.float32) if out is None else out.copy_(q)
        if self.bits == 4:
            out.sub_(8)
        out.view(-1, self.block).mul_(scale.unsqueeze(1))
        return out

    def average(self, site: Site, e: torch.Tensor, n: int, kept: Kept) -> torch.futures.Future:
        """Send ``e`` (plus what earlier codes left out) as block codes, one piece per node: the
        quantized rail average (:meth:`hiersync.collectives.HierComm.average_quantized`). The
        future holds the rail's averaged delta, decoded (fp32, ``n`` values, made in ``e``)."""
        comm = site.comm
        N, divisor, w = comm.rail_nodes(), comm.rail_divisor(), comm.weighting
        padded = e.numel()
        # False: healed in this window's quorum, or no samples in it: it sends zeros
        contributes = comm.contributes() and (w is None or w.own > 0)
        # the sum is divided by ``divisor`` below: own * divisor / S makes it the samples' mean
        weight = 1.0 if w is None or w.own * divisor == w.expected else w.own * divisor / w.expected
        if not contributes:
            e.zero_()
        if self.feedback and contributes:  # a node that sends zeros leaves its residual as it is
            residual = site.here(kept.residual, e.device)
            if weight != 1.0:  # weighted: the codes carry weight * (delta + residual), the residual stays unweighted
                e.mul_(weight)
                residual = residual * weight if residual is not None else None
            packed, left = ErrorFeedback(self, N).encode(e, residual)
            if weight != 1.0:
                left.div_(weight)
            kept.residual = ErrorFeedback.keep(left[:n], kept.residual, site.stored)
        else:
            if weight != 1.0 and contributes:
                e.mul_(weight)
            packed = self.encode_pieces(e, N)  # piece j goes to the j-th node of the rail
        m = padded // N  # values per piece
        nbytes = self.packed_bytes(m)

        def reduce(received: torch.Tensor) -> torch.Tensor:
            # This rank's piece from every node: decode, mean in fp32, re-encode with its own feedback.
            mean = self.decode(received[:nbytes], m)  # summed in place: one piece's temporary at a time
            for j in range(1, N):
                mean.add_(self.decode(received[j * nbytes : (j + 1) * nbytes], m))
            mean.div_(divisor)
            if w is not None and (r := w.rescale()) != 1.0:  # weighted: the sum's weights to the samples' total
                mean.mul_(r)
            if not self.feedback:
                return self.encode(mean)
            r = kept.reduced_residual
            if r is not None and r.numel() != m:  # a different number of nodes starts afresh
                r = None
            out, left = ErrorFeedback(self).encode(mean, site.here(r, mean.device))
            kept.reduced_residual = ErrorFeedback.keep(left, r, site.stored)
            return out

        def decoded(f: torch.futures.Future) -> torch.Tensor:  # into ``e``: free again by then
            return self.decode_pieces(wait(f), padded, N, out=e)[:n]

        return then(comm.average_quantized(packed, reduce), decoded, e.device, "the quantized rail average")

    def result(self, got: torch.Tensor, weighting: Any, out: torch.Tensor | None) -> torch.Tensor:
        return _into(got, out)  # the reduce applied the weights

    def encode_pieces(self, x: torch.Tensor, pieces: int) -> torch.Tensor:
        """``x`` cut into ``pieces`` equal pieces, each encoded on its own (codes, then scales),
        end to end: piece ``j`` is bytes ``[j * b, (j + 1) * b)`` with ``b = packed_bytes(n / pieces)``."""
        return torch.cat([self.encode(p) for p in x.reshape(pieces, -1)])

    def decode_pieces(self, packed: torch.Tensor, n: int, pieces: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``n`` fp32 values of :meth:`encode_pieces`'s output, piece by piece into ``out`` (or a new vector)."""
        m = n // pieces
        b = self.packed_bytes(m)
        out = torch.empty(n, dtype=torch.float32, device=packed.device) if out is None else out
        for j in range(pieces):
            self.decode(packed[j * b : (j + 1) * b], m, out=out[j * m : (j + 1) * m])
        return out


_TERNARY = (0.0, 1.0, -1.0, 0.0)  # a 2-bit code's value in units of its block's scale (3: unused)


@dataclass(frozen=True)
class SparseCodec:
    """The ``keep`` largest magnitudes of each block of ``block`` values, as 2-bit codes with one
    fp32 scale per block and a 12-bit position in the block (``compress="topk2"``).

    A code is the sign of a sent value or zero, ``{0: 0, 1: +s, 2: -s}``, ``s`` its block's mean
    magnitude of the nonzero values sent (the ternary level that keeps their L1 mass); a sent
    value under ``s / 2`` goes as 0, so the zeros of a block with fewer than ``keep`` nonzero
    values decode to zeros. One node (a quorum of one) sends nothing: its average is its own
    delta plus its residual, exactly, and the residual is then spent.

    Laid out as every block's codes (4 a byte), then their positions (2 in 3 bytes), then the
    scales. Everything not sent stays in the error-feedback residual, kept in fp32 (nearly
    all of a delta waits there for windows: bf16 would lose 2^-9 of it every window). The rail
    average all-gathers every node's payload and decodes and sums it densely on every rank, in
    rail order, so every node gets the same bits: sparse codes cannot be summed in an
    all-reduce, and a requantized all-to-all would sparsify the sum a second time. A rank sends
    ``(N - 1)`` payloads' bytes where an all-reduce's input would cost ``2 (N - 1) / N``: at the
    defaults, 0.014x of bf16's all-reduce at 2 nodes, 0.057x at 8, 0.45x at 64, and more than
    bf16 past 141 nodes (a rack level keeps N small: docs/local-sgd.md).
    """

    wire: WireFormat
    keep: int = 64
    block: int = 4096
    feedback: bool = True

    def __post_init__(self) -> None:
        if not 4 <= self.block <= 4096:
            raise ValueError(f"block={self.block} must be between 4 and 4096 values (12-bit positions)")
        if not (4 <= self.keep <= self.block and self.keep % 4 == 0):
            raise ValueError(f"topk={self.keep} must be a multiple of 4 between 4 and the block's {self.block} values")

    @classmethod
    def of(cls, wire: WireFormat, feedback: bool = True, options: Any = None) -> SparseCodec:
        assert wire.keep is not None and wire.block is not None
        topk = getattr(options, "topk", None)
        return cls(wire, wire.keep if topk is None else topk, wire.block, feedback)

    def padded(self, n: int, nodes: int = 1) -> int:
        return -(-n // self.block) * self.block

    def packed_bytes(self, n: int) -> int:
        """Bytes of ``n`` values (a multiple of ``block``): codes, positions, scales."""
        return n // self.block * (self.keep // 4 + self.keep * 3 // 2 + 4)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(positions, codes, scales)`` of ``x`` (fp32, a multiple of ``block`` values): each
        block's ``keep`` largest magnitudes, ``(blocks, keep)`` int64 and uint8, and ``(blocks,)`` fp32."""
        blocks = x.view(-1, self.block)
        pos = blocks.abs().topk(self.keep, dim=1, sorted=False).indices
        v = blocks.gather(1, pos)
        a = v.abs()
        scale = a.sum(dim=1) / (a > 0).sum(dim=1).clamp_(min=1)  # the mean of the nonzero ones
        code = (a * 2 > scale.unsqueeze(1)).to(torch.uint8) * (1 + (v < 0).to(torch.uint8))
        return pos, code, scale

    def pack(self, pos: torch.Tensor, code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """:meth:`select`'s output as one uint8 vector."""
        c = code.reshape(-1, 4)
        codes = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
        p = pos.reshape(-1, 2)
        a, b = p[:, 0], p[:, 1]
        where = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).to(torch.uint8).reshape(-1)
        return torch.cat([codes, where, scale.to(torch.float32).view(torch.uint8)])

    def unpack(self, packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, values)`` of a payload of ``n`` values: ``(blocks, keep)`` int64 and fp32."""
        m, k = n // self.block, self.keep
        nc, npos = m * k // 4, m * k * 3 // 2
        codes = packed[:nc]
        c = torch.stack([codes & 3, (codes >> 2) & 3, (codes >> 4) & 3, codes >> 6], dim=1).reshape(m, k)
        w = packed[nc : nc + npos].reshape(-1, 3).to(torch.int64)
        pos = torch.stack([w[:, 0] | ((w[:, 1] & 0xF) << 8), (w[:, 1] >> 4) | (w[:, 2] << 4)], dim=1).reshape(m, k)
        # copied: a payload's start in a gathered buffer need not be aligned for fp32
        scale = packed[nc + npos : nc + npos + 4 * m].clone().view(torch.float32)
        return pos, self.values(c, scale)

    @staticmethod
    def values(code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The fp32 values of ``(blocks, keep)`` codes with their blocks' scales."""
        lut = torch.tensor(_TERNARY, dtype=torch.float32, device=code.device)
        return lut[code.to(torch.int64)].mul_(scale.unsqueeze(1))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.pack(*self.select(x))

    def decode(self, packed: torch.Tensor, n: int, out: torch.Tensor | None = None, add: bool = False) -> torch.Tensor:
        """The ``n`` fp32 values of a payload: zeros but at its positions (written, or added with
        ``add``, into ``out`` if given)."""
        pos, vals = self.unpack(packed, n)
        if out is None:
            out = torch.zeros(n, dtype=torch.float32, device=packed.device)
        elif not add:
            out.zero_()
        out.view(-1, self.block).scatter_add_(1, pos, vals)
        return out

    def average(self, site: Site, e: torch.Tensor, n: int, kept: Kept) -> torch.futures.Future:
        """Send ``e`` (plus the residual) as each block's largest values; what is not sent, or
        sent rounded, is the next residual. The future holds the rail's mean delta (fp32, ``n``
        values, made in ``e``)."""
        comm = site.comm
        N, divisor, w = comm.rail_nodes(), comm.rail_divisor(), comm.weighting
        contributes = comm.contributes() and (w is None or w.own > 0)  # else: zeros, the residual as it is
        if not contributes:
            e.zero_()
        elif self.feedback and (r := site.here(kept.residual, e.device)) is not None:
            e[: r.numel()].add_(r)
        if N == 1:  # the average of one node is its own: nothing is left out
            if contributes and kept.residual is not None:
                kept.residual.zero_()
            return completed(e[:n], e.device)
        pos, code, scale = self.select(e)
        if self.feedback and contributes:  # what the codes miss, in place: e is the next residual
            e.view(-1, self.block).scatter_add_(1, pos, self.values(code, scale).neg_())
            left = e[:n]
            if kept.residual is not None and kept.residual.numel() == n and kept.residual.dtype == torch.float32:
                kept.residual.copy_(left, non_blocking=True)
            else:
                kept.residual = site.stored(left.clone())
        # weighted: the sum's node weights (own * divisor / S, divided below) scale the codes' scales
        if w is not None and contributes and w.own * divisor != w.expected:
            scale = scale * (w.own * divisor / w.expected)
        packed = self.pack(pos, code, scale)
        padded = e.numel()
        nbytes = packed.numel()

        def summed(f: torch.futures.Future) -> torch.Tensor:  # every node's payload, in rail order, into ``e``
            got = wait(f)
            e.zero_()
            for j in range(N):
                self.decode(got[j * nbytes : (j + 1) * nbytes], padded, out=e, add=True)
            e.div_(divisor)
            if w is not None and (r := w.rescale()) != 1.0:  # the sum's weights to the samples' total
                e.mul_(r)
            return e[:n]

        return then(comm.gather_payloads(packed), summed, e.device, "the gathered rail average")

    def result(self, got: torch.Tensor, weighting: Any, out: torch.Tensor | None) -> torch.Tensor:
        return _into(got, out)  # the sum applied the weights


CODECS: dict[str, type[Any]] = {"cast": CastCodec, "block": BlockCodec, "sparse": SparseCodec}
"""A row's ``codec`` name -> its class, built by :func:`codec_for` from the row and the options."""


def codec_for(compress: str | None, error_feedback: bool = True, options: Any = None) -> Codec | None:
    """The codec of a ``compress=`` name (``None``/``"none"``: fp32, no codec), from its row of
    :data:`~hiersync.vocab.WIRE_FORMATS`. ``options``: the :class:`~hiersync.config.HierConfig`
    a codec kind reads its own options from (``None``: its defaults)."""
    f = wire_format(compress)
    if f.codec is None:
        return None
    return CODECS[f.codec].of(f, error_feedback, options)


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
        codec, m = self.codec, x.numel() // self.pieces
        packed = codec.encode_pieces(x, self.pieces)
        b = codec.packed_bytes(m)
        for j, piece in enumerate(x.view(self.pieces, m)):  # what the codes miss, a piece at a time
            piece.sub_(codec.decode(packed[j * b : (j + 1) * b], m))
        return packed, x

    @staticmethod
    def keep(left: torch.Tensor, residual: torch.Tensor | None, store=lambda t: t) -> torch.Tensor:
        """``left`` as the next residual: copied into ``residual`` (rounded to its dtype) where
        there is one of its length, else ``store(left in RESIDUAL_DTYPE)``."""
        if residual is not None and residual.numel() == left.numel():
            return residual.copy_(left, non_blocking=True)
        return store(left.to(RESIDUAL_DTYPE))
