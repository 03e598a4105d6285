"""One name, one definition per concept (the vocabulary of docs/design.md). Pure: no torch import.

Every module that needs a step kind, a level, a placement, an intra-node algorithm or a
byte unit takes it from here, so the hook, the cost model and the tools cannot drift apart.
The enums are ``str`` subclasses: ``StepKind.SYNC == "sync"``, they format as their value,
and they round-trip through JSON and argparse unchanged.

The words for the cross-node sync, used the same way in code, docs and tests:

* *node*, *local rank*, *L*, *N*, *intra group*, *rail*: :mod:`hiersync.topology`.
* *fragment*: a set of whole parameters that sync together (streaming splits the model into
  F fragments on staggered steps; F = 1 is the whole model). The same model has the same
  fragments on the DDP and FSDP2 front-ends (packed in ``model.parameters()`` order).
* *chunk*: one transfer, at most ``chunk_mb`` of a fragment's parameters (fp32), in the same
  order on every rank.
* *shard*: the part of a chunk one rank averages on its rail and keeps the state of (anchor,
  outer momentum): 1/L of the chunk on a node that holds replicas (DDP), the rank's own
  parameter shards on a node that shards the model (FSDP2).
* *piece*: the slice of a shard a node gathers at once when it writes a blocking average.
* *due*: a sync whose step's backward has ended and that is not launched yet (it launches
  after ``optimizer.step()``, or before the next forward if that step was skipped).
* *in flight*: a sync that was launched and whose correction is not applied yet.
* *correction*: what an overlapped sync adds to a shard, ``target - snapshot``.
"""

from __future__ import annotations

import enum
import re
import sys
from dataclasses import dataclass

__all__ = [
    "StrEnum",
    "StepKind",
    "Level",
    "Placement",
    "IntraAlgorithm",
    "INTRA_ALGORITHMS",
    "default_intra_algorithm",
    "GATHER_PIECE_BYTES",
    "QUANT_BLOCK",
    "RESIDUAL_BYTES",
    "SCALE_BITS",
    "COMPRESS_DTYPES",
    "COMPRESS_CODES",
    "WireFormat",
    "WIRE_FORMATS",
    "wire_format",
    "NONFINITE_MODES",
    "KiB",
    "MiB",
    "GiB",
    "parse_size",
    "format_size",
]

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """``enum.StrEnum`` for Python 3.10: members are strings that print as their value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


class StepKind(StrEnum):
    """What a step does (the schedule decides; see :mod:`hiersync.schedule`)."""

    EXACT = "exact"
    """Every bucket averaged over the world (period 1, or a warmup step)."""
    LOCAL = "local"
    """Buckets averaged inside the node only."""
    SYNC = "sync"
    """A local step after which parameters are also averaged across nodes."""


class Level(StrEnum):
    """Which links a collective crosses."""

    INTRA = "intra"
    """Inside a node (NVLink, loopback)."""
    INTER = "inter"
    """Between nodes (the NICs, one rail per local rank)."""


class Placement(StrEnum):
    """Where the period-k parameter average runs: the *mode*, named in prose as "in the hook",
    "blocking" and "overlapped" (*streaming*: fragments > 1, blocking or overlapped)."""

    HOOK = "hook"
    """Inside the hook, during the sync step's backward (no optimizer attached)."""
    OPTIMIZER = "optimizer"
    """Right after ``optimizer.step()`` on sync steps (attached optimizer)."""
    OVERLAP = "overlap"
    """Launched after ``optimizer.step()``, applied later as a delta correction."""


class IntraAlgorithm(StrEnum):
    """How a node reduces and gathers around the rail leg of the two-level all-reduce."""

    RS_AG = "rs_ag"
    """Reduce-scatter + all-gather: bandwidth-optimal (NCCL's default)."""
    ALLREDUCE_BCAST = "allreduce_bcast"
    """All-reduce + one broadcast per shard (gloo's default: its RS/AG are slow on CPU)."""


INTRA_ALGORITHMS: tuple[str, ...] = tuple(a.value for a in IntraAlgorithm)
"""The intra algorithms by name, for validation and ``choices=`` in the CLI."""


def default_intra_algorithm(backend: str) -> IntraAlgorithm:
    """The intra algorithm hiersync runs on ``backend`` when none is given.

    gloo's reduce-scatter and all-gather are slow on CPU: measured for 64 MB inside a
    node, all-reduce 81-85 ms, reduce-scatter 145-192 ms, all-gather 122-137 ms, one
    broadcast of a 1/2 shard 17-19 ms (docs/benchmarks.md).
    """
    return IntraAlgorithm.ALLREDUCE_BCAST if str(backend).lower() == "gloo" else IntraAlgorithm.RS_AG


# Byte units: binary everywhere in hiersync (a "MB" in a flag or a table is a MiB), as
# DDP's own ``bucket_cap_mb`` is (it multiplies by 1024 * 1024).
KiB = 1024
MiB = 1024**2
GiB = 1024**3

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int | float) -> int:
    """``"64K"``, ``"1.5MiB"``, ``"2G"``, ``"4096"`` -> bytes (binary units: K = 1024).

    Raises ``ValueError`` naming the text when it is not a size.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r}; use e.g. 4096, 64K, 1.5M or 2GiB (binary units)")
    scale = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}[m.group(2).lower()]
    return int(round(float(m.group(1)) * scale))


def format_size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``"64 KiB"``)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


# Counts (parameters, elements) are decimal, unlike byte sizes: "25M" parameters is 25e6.
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)\s*$", re.IGNORECASE)


def parse_count(text: str | int | float) -> int:
    """``"25M"`` -> 25_000_000, ``"1.5k"`` -> 1500, ``"300000"`` -> 300000 (decimal units: k = 1000).

    For counts such as a number of parameters; byte sizes use :func:`parse_size` (binary).
    Raises ``ValueError`` naming the text when it is not a count.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = _COUNT.match(str(text))
    if not m:
        raise ValueError(f"not a count: {text!r}; use e.g. 300000, 500k, 25M or 1.5G (decimal units)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[m.group(2).lower()]
    return int(round(float(m.group(1)) * scale))


__all__ += ["parse_count"]


GATHER_PIECE_BYTES = MiB
"""A node gathers a finished shard in pieces of at least this many bytes per rank, and at
most 4 pieces per chunk: the reused gather buffer holds at most 1/4 of a chunk, and a big
fragment costs 4 collectives per rank instead of one per MiB."""

QUANT_BLOCK = 128
"""Values per fp32 scale of an int8/int4 payload (:mod:`hiersync.quant`; docs/local-sgd.md)."""

RESIDUAL_BYTES = 2
"""Bytes per value of an error-feedback residual: bf16 (``hiersync.quant.RESIDUAL_DTYPE``)."""


SCALE_BITS = 32
"""Bits of one block's scale (fp32) on the wire."""


@dataclass(frozen=True)
class WireFormat:
    """What ``compress=<name>`` sends on the inter-node leg: the one table of payloads.

    The options (:class:`hiersync.config.HierConfig`), the codecs (:func:`hiersync.quant.codec_for`
    builds the class its ``codec`` names) and the cost model (:mod:`hiersync.costmodel.compression`)
    all read :data:`WIRE_FORMATS`; a new payload is a row here, a new kind of payload a row and
    a codec class.
    """

    name: str
    bits: int | None
    """Bits per value sent, scales and positions aside; ``None``: the parameters' own (fp32)."""
    dtype: str | None = None
    """A float payload's ``torch`` dtype, by name (``"bfloat16"``)."""
    codec: str | None = None
    """The codec class that sends it (:data:`hiersync.quant.CODECS`); ``None``: the values themselves."""
    average: str = "all_reduce"
    """How the rail averages the payloads: ``"all_reduce"`` (summed by the collective),
    ``"all_to_all"`` (an all-to-all of pieces, an fp32 sum, a requantize and an all-gather) or
    ``"all_gather"`` (every node's payload gathered, decoded and summed densely on every rank)."""
    block: int | None = None
    """Values per fp32 scale (``None``: no scales)."""
    keep: int | None = None
    """Values sent per block, each with its position in the block (``None``: every value)."""
    index_bits: int = 0
    """Bits of a sent value's position in its block (a sparse payload's)."""
    residual_bytes: int = RESIDUAL_BYTES
    """Bytes per value of its error-feedback residual (a coded payload's)."""

    @property
    def delta(self) -> bool:
        """Sent as the delta against the fp32 anchor (every payload narrower than the parameters)."""
        return self.bits is not None

    @property
    def feedback(self) -> bool:
        """Error feedback applies: what a payload leaves out is kept and sent with the next one."""
        return self.average != "all_reduce"

    def bits_per_value(self, own: int = 32, keep: int | None = None) -> float:
        """Bits sent per parameter, scales and positions included (``own``: the parameters'
        bits; ``keep``: a sparse payload's values per block, if not the row's)."""
        if self.bits is None:
            return own
        if self.block is None:
            return min(self.bits, own)
        sent = keep if keep is not None and self.keep is not None else self.keep or self.block
        return (sent * (self.bits + self.index_bits) + SCALE_BITS) / self.block


WIRE_FORMATS: dict[str, WireFormat] = {
    f.name: f
    for f in (
        WireFormat("none", None),
        WireFormat("bf16", 16, dtype="bfloat16", codec="cast"),
        WireFormat("fp16", 16, dtype="float16", codec="cast"),
        WireFormat("int8", 8, codec="block", average="all_to_all", block=QUANT_BLOCK),
        WireFormat("int4", 4, codec="block", average="all_to_all", block=QUANT_BLOCK),
        WireFormat(
            "topk2", 2, codec="sparse", average="all_gather", block=4096, keep=64, index_bits=12, residual_bytes=4
        ),
    )
}
"""``compress=`` name -> what it sends (``"none"`` is ``compress=None``: fp32 parameters)."""


def wire_format(compress: str | None) -> WireFormat:
    """The :class:`WireFormat` of ``compress`` (``None`` means ``"none"``); ``ValueError`` naming the valid ones."""
    name = "none" if compress is None else compress
    if name not in WIRE_FORMATS:
        raise ValueError(f"unknown compress={compress!r}; valid: {', '.join(WIRE_FORMATS)} (none = None)")
    return WIRE_FORMATS[name]


COMPRESS_DTYPES = tuple(n for n, f in WIRE_FORMATS.items() if f.delta and not f.feedback)
"""16-bit payloads of the inter-node parameter average (deltas against the fp32 anchor)."""
COMPRESS_CODES = tuple(n for n, f in WIRE_FORMATS.items() if f.feedback)
"""Coded payloads (block-quantized, sparse): deltas against the fp32 anchor with error feedback
(:mod:`hiersync.quant`), averaged by something other than an all-reduce."""
NONFINITE_MODES = ("skip", "raise", "ignore")
"""What a NaN/Inf gradient does: skip the update, raise, or no check at all."""
