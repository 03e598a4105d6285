"""What ``compress=`` costs on the inter-node leg: bits per element, and the quantized rail average.

``HierState(compress=...)`` sends deltas against an fp32 anchor across nodes:

* ``None``: the parameters' own dtype (32 bits per element for fp32);
* ``"bf16"`` / ``"fp16"``: 16 bits, all-reduced on the rail like full precision;
* ``"int8"`` / ``"int4"``: b bits per element plus one fp32 scale per block of
  :data:`QUANT_BLOCK` elements, sent as a *quantized rail average*: an all-to-all of the
  quantized pieces, an fp32 sum of each rank's piece, requantized, then an all-gather. Each
  rank sends ``2(N-1)/N * n * bits/8`` bytes for its n-element shard, as an all-reduce of
  ``bits``-bit values would, but pays the latency of both phases and the quantize and
  dequantize passes (:func:`quantize_seconds`) at :attr:`Profile.quant_gbps`.

Quantized values cannot be summed inside an all-reduce, hence the two phases (the scheme of
torchft's and DeepSpeed ZeRO++'s quantized collectives). Pure: no torch.

Example::

    >>> bits_per_element("int8", 4), bits_per_element("int4", 4), bits_per_element("bf16", 4)
    (8.25, 4.25, 16)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hiersync.vocab import QUANT_BLOCK, WIRE_FORMATS, wire_format

from .links import check_number

if TYPE_CHECKING:
    from .profile import Profile

__all__ = [
    "QUANT_BLOCK",
    "SCALE_BITS",
    "COMPRESS_OPTIONS",
    "QUANTIZED_BITS",
    "DEFAULT_QUANT_GBPS",
    "check_compress",
    "is_quantized",
    "bits_per_element",
    "compress_ratio",
    "quantize_seconds",
]

SCALE_BITS = 32
COMPRESS_OPTIONS = tuple(WIRE_FORMATS)
"""``"none"`` stands for ``compress=None`` on the command line (:data:`hiersync.vocab.WIRE_FORMATS`)."""
QUANTIZED_BITS = {n: f.bits for n, f in WIRE_FORMATS.items() if f.block_scaled and f.bits is not None}
DEFAULT_QUANT_GBPS = 100.0
"""GB/s of fp32 input one quantize or dequantize pass processes when a profile states none: a
conservative GPU rate (the passes are memory-bound and an H100's HBM moves ~3 TB/s); not
measured on a device yet."""


def check_compress(compress: str | None) -> str:
    """``compress`` as one of :data:`COMPRESS_OPTIONS` (None means ``"none"``); ``ValueError`` otherwise."""
    return wire_format(compress).name


def is_quantized(compress: str | None) -> bool:
    """Whether ``compress`` is sent as a quantized rail average (int8, int4)."""
    return wire_format(compress).block_scaled


def bits_per_element(compress: str | None, param_bytes: int = 4) -> float:
    """Bits sent per parameter on the inter-node leg, block scales included."""
    f, own = wire_format(compress), 8 * param_bytes
    if f.bits is None:
        return own
    if f.block_scaled:
        return f.bits + SCALE_BITS / QUANT_BLOCK
    return min(f.bits, own)


def compress_ratio(compress: str | None, param_bytes: int = 4) -> float:
    """Bytes sent per byte of parameters: :func:`bits_per_element` / (8 x ``param_bytes``)."""
    return bits_per_element(compress, param_bytes) / (8 * param_bytes)


def quantize_seconds(elements: float, nodes: int, profile: Profile) -> float:
    """The quantize/dequantize passes of one quantized rail average of ``elements`` (fp32 maths).

    Quantize the shard, dequantize and sum the N-1 pieces received ((N-1)/N of it), requantize
    the rank's piece (1/N), dequantize the gathered result: 3 passes over the shard's elements,
    4 bytes each, at the profile's ``quant_gbps`` (:data:`DEFAULT_QUANT_GBPS` if unstated).
    """
    n = check_number("elements", elements)
    gbps = profile.quant_gbps or DEFAULT_QUANT_GBPS
    passes = 1 + (nodes - 1) / nodes + 1 / nodes + 1
    return passes * n * 4 / (gbps * 1e9)
