"""Extra GPU memory per rank of a hiersync mode: the local-SGD state the sync keeps.

The model of docs/local-sgd.md ("Memory"), which ``benchmarks/memory.py`` measured on the
testbed. With an attached optimizer (blocking, overlap or streaming) the state is sharded
1/L across the node's ranks: the fp32 anchor shard (with ``compress`` or an outer optimizer),
the outer momentum shard (outer optimizer), and per fragment in flight (tau of them) the
node's fp32 buffer of the whole fragment (P/F, whatever L: the snapshot, the payload made in
place, then the gathered correction) and, with ``compress``, the payload of the rank's 1/L
shard made beside it (16-bit with bf16; int8/int4 make their codes from an fp32 delta: 4 bytes
plus the codes' per element); a blocking sync holds one shard, 1/L, while it runs; plus the
node gather's buffer of 1 MiB per rank. A sync in the hook keeps the anchor and momentum whole
(DDP's buckets are not stable chunks). Period 1 (exact) keeps nothing. tests/test_planner.py
checks the model against the measurements in docs/local-sgd.md's table. Pure: no torch.

Example::

    >>> m = sync_memory(params=8.4e6, ranks_per_node=2, period=4, fragments=4, overlap=1, compress=True, outer=True)
    >>> round(m.total / (8.4e6 * 4), 2)  # measured 1.34 P (docs/local-sgd.md)
    1.37
"""

from __future__ import annotations

from dataclasses import dataclass

from hiersync.vocab import GATHER_PIECE_BYTES, wire_format

from .links import check_count, check_number

__all__ = ["FP32_BYTES", "GATHER_PIECE_BYTES", "SyncMemory", "sync_memory", "residual_bytes"]

FP32_BYTES = 4
"""The anchor and the outer momentum are fp32 whatever the parameters' dtype."""


@dataclass(frozen=True, kw_only=True)
class SyncMemory:
    """Bytes per rank a mode keeps beyond plain DDP, by what holds them."""

    anchor: float
    """fp32 anchor (shard), kept with ``compress`` or an outer optimizer."""
    momentum: float
    """fp32 outer momentum (shard), kept with an outer optimizer."""
    in_flight: float
    """The node buffers and payload shards of the fragments in flight (or the shard being synced)."""
    gather: float
    """The node gather's reused buffer."""
    residual: float = 0.0
    """bf16 error-feedback residuals of ``compress="int8"``/``"int4"``, what was not sent: the rank's
    shard and the 1/N of it that the rank re-encodes after the rail's sum."""
    sharded: bool
    """Whether the state is sharded 1/L (attached optimizer) or whole (in the hook)."""

    @property
    def total(self) -> float:
        return self.anchor + self.momentum + self.in_flight + self.gather + self.residual


def sync_memory(
    *,
    params: float,
    ranks_per_node: int,
    period: int,
    fragments: int = 1,
    overlap: int = 0,
    compress: bool = False,
    outer: bool = False,
    attached: bool = True,
    param_bytes: int = FP32_BYTES,
    error_feedback: bool | str = False,
    nodes: int = 2,
    payload_bytes: float | None = None,
) -> SyncMemory:
    """Extra memory per rank of ``HierState(period, fragments, overlap, compress, outer_lr)``.

    ``params``: parameter count; ``param_bytes``: bytes per parameter of the model (a blocking
    sync's shard follows it); ``attached``: an optimizer is attached (the state is
    sharded 1/L); ``outer``: an outer optimizer (``outer_lr``) is on; ``error_feedback``: the
    coded payload's residuals (True: int8/int4's; or the ``compress=`` name, whose row says:
    :func:`residual_bytes`) (the default ``nodes=2`` is the largest a re-encoded piece gets);
    ``payload_bytes``: with ``compress``, bytes per element of the payload an overlapped sync makes
    beside its buffer (default 2, bf16's; int8 and int4: 4 + 1 and 4 + 0.5, their fp32 delta and
    its codes).
    """
    p = check_number("params", params, strict=True)
    lpn = check_count("ranks_per_node", ranks_per_node)
    k, f = check_count("period", period), check_count("fragments", fragments)
    tau = int(overlap)
    if k == 1:
        return SyncMemory(anchor=0.0, momentum=0.0, in_flight=0.0, gather=0.0, sharded=attached)
    share = 1 / lpn if attached else 1.0
    state = p * FP32_BYTES * share
    anchor = state if (compress or outer) else 0.0
    momentum = state if outer else 0.0
    wire = "int8" if error_feedback is True else error_feedback or None
    residual = residual_bytes(state, nodes, wire) if wire else 0.0
    if not attached:  # the hook averages DDP's buckets in place
        return SyncMemory(anchor=anchor, momentum=momentum, in_flight=0.0, gather=0.0, residual=residual, sharded=False)
    if tau:  # the node's fp32 buffer of each fragment in flight, and a compressed payload of the rank's shard
        extra = check_number("payload_bytes", 2.0 if payload_bytes is None else payload_bytes) if compress else 0.0
        in_flight = tau * p / f * (FP32_BYTES + share * extra)
    else:  # a blocking sync: the shard being synced
        in_flight = p * param_bytes / f * share
    return SyncMemory(
        anchor=anchor,
        momentum=momentum,
        in_flight=in_flight,
        gather=GATHER_PIECE_BYTES * lpn,
        residual=residual,
        sharded=True,
    )


def residual_bytes(state: float, nodes: int, compress: str = "int8") -> float:
    """A coded payload's error-feedback residuals beside ``state`` bytes of fp32 state shard, in
    the dtype its row keeps them in: one for the shard the rank sends, and for a quantized rail
    average (int8/int4) one for the 1/``nodes`` of it the rank re-encodes after the rail's sum."""
    f = wire_format(compress)
    again = 1 / check_count("nodes", nodes) if f.average == "all_to_all" else 0.0
    return state * f.residual_bytes / FP32_BYTES * (1 + again)
