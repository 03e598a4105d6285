"""What ``compress=`` costs on the inter-node leg: bits per element, and the quantized rail average.

``HierState(compress=...)`` sends deltas against an fp32 anchor across nodes:

* ``None``: the parameters' own dtype (32 bits per element for fp32);
* ``"bf16"`` / ``"fp16"``: 16 bits, all-reduced on the rail like full precision;
* ``"int8"`` / ``"int4"``: b bits per element plus one fp32 scale per block of
  :data:`QUANT_BLOCK` elements, sent as a *quantized rail average*: an all-to-all of the
  quantized pieces, an fp32 sum of each rank's piece, requantized, then an all-gather. Each
  rank sends ``2(N-1)/N * n * bits/8`` bytes for its n-element shard, as an all-reduce of
  ``bits``-bit values would, but pays the latency of both phases and the quantize and
  dequantize passes (:func:`quantize_seconds`) at :attr:`Profile.quant_gbps`;
* a sparse row (``keep`` values of each block, with their positions): every node's payload
  is all-gathered and decoded on every rank, so a rank sends ``(N-1) * payload`` bytes: the
  bytes grow with N, where an all-reduce's stay ``2(N-1)/N`` of its input.

Coded values cannot be summed inside an all-reduce, hence the two phases (the scheme of
torchft's and DeepSpeed ZeRO++'s quantized collectives) or the gather. Every figure comes from
the payload's row of :data:`hiersync.vocab.WIRE_FORMATS`. Pure: no torch.

Example::

    >>> bits_per_element("int8", 4), bits_per_element("int4", 4), bits_per_element("bf16", 4)
    (8.25, 4.25, 16)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hiersync.vocab import QUANT_BLOCK, SCALE_BITS, WIRE_FORMATS, wire_format

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

COMPRESS_OPTIONS = tuple(WIRE_FORMATS)
"""``"none"`` stands for ``compress=None`` on the command line (:data:`hiersync.vocab.WIRE_FORMATS`)."""
QUANTIZED_BITS = {n: f.bits for n, f in WIRE_FORMATS.items() if f.feedback and f.bits is not None}
"""The coded payloads (averaged by something other than an all-reduce): bits per value sent."""
SPARSE_PASSES = 3.3
"""A sparse payload's encode with error feedback, in passes over the shard at ``quant_gbps``: the
magnitudes, each block's largest (``torch.topk``, most of it), their codes, the residual's update.
Fitted on a 2-core CPU at 3.25M values (one rank's shard of a 25 MB model at 2 ranks a node),
where int8's quantize pass sets ``quant_gbps``: ``python benchmarks/codec_cost.py`` (each of 15
repeats times that pass and the sparse average back to back) prices a median 0.86x to 1.11x of
what it measures over two runs at 2 and 4 nodes, quartiles 0.60x to 1.75x (the box's noise).
A GPU's ``topk`` costs differently, not measured."""
SPARSE_DECODE_PASSES = 0.05
"""Passes over the shard per node's payload decoded into the dense sum (a scatter of k values a block)."""
DEFAULT_QUANT_GBPS = 100.0
"""GB/s of fp32 input one quantize or dequantize pass processes when a profile states none: a
conservative GPU rate (the passes are memory-bound and an H100's HBM moves ~3 TB/s); not
measured on a device yet."""


def check_compress(compress: str | None) -> str:
    """``compress`` as one of :data:`COMPRESS_OPTIONS` (None means ``"none"``); ``ValueError`` otherwise."""
    return wire_format(compress).name


def is_quantized(compress: str | None) -> bool:
    """Whether ``compress`` is coded (int8, int4, sparse): averaged by its row's collectives, not an all-reduce."""
    return wire_format(compress).feedback


def bits_per_element(compress: str | None, param_bytes: int = 4) -> float:
    """Bits of a payload per parameter, block scales and positions included (what one node
    sends of its shard once; a gathered payload goes to each of the N-1 others)."""
    return wire_format(compress).bits_per_value(8 * param_bytes)


def compress_ratio(compress: str | None, param_bytes: int = 4) -> float:
    """Bytes sent per byte of parameters: :func:`bits_per_element` / (8 x ``param_bytes``)."""
    return bits_per_element(compress, param_bytes) / (8 * param_bytes)


def quantize_seconds(elements: float, nodes: int, profile: Profile, compress: str | None = "int8") -> float:
    """The encode and decode passes of one coded rail average of ``elements`` (fp32 maths).

    Block codes: quantize the shard, dequantize and sum the N-1 pieces received ((N-1)/N of
    it), requantize the rank's piece (1/N), dequantize the gathered result: 3 passes over the
    shard's elements, 4 bytes each, at the profile's ``quant_gbps`` (:data:`DEFAULT_QUANT_GBPS`
    if unstated). A sparse payload: :data:`SPARSE_PASSES` (the selection of each block's
    largest values, the residual's update) plus one pass per node's payload scattered into the
    dense sum.
    """
    n = check_number("elements", elements)
    gbps = profile.quant_gbps or DEFAULT_QUANT_GBPS
    if wire_format(compress).average == "all_gather":
        passes = SPARSE_PASSES + SPARSE_DECODE_PASSES * nodes
    else:
        passes = 1 + (nodes - 1) / nodes + 1 / nodes + 1
    return passes * n * 4 / (gbps * 1e9)
