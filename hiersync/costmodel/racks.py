"""A third level priced: node -> rack -> world, and when a rack level pays. Pure: no torch.

hiersync's world sync is one all-reduce per rail (the ranks with one local rank), each a
ring over the N nodes in rank order, which a job lays out rack by rack. Such a ring
crosses each rack boundary once per direction, so a rack of ``R`` nodes sends ``L`` flows
(one per rail) through its uplinks at once. With an *oversubscription* ``o`` (the rack's
NIC capacity over its uplink capacity: R x L NICs behind R x L / o NICs' worth of uplink),
each flow gets ``min(B, R B / o)`` of the NIC's bandwidth ``B``: the spine limits the ring
only from ``o > R`` on. Below that a rack level saves the latency of the ring's
``2 (N - 1)`` hops (and the spine's extra switch tiers, ``spine_latency_s`` per hop); above
it, or where the cross-rack bandwidth is lower for another reason (a spine shared with
other jobs, racks in other buildings: give it as ``oversubscription``), it saves bandwidth.

The rack level averages parameters across the rack's nodes every ``rack_period`` steps
(fp32, :func:`~hiersync.costmodel.predict_param_sync` over R nodes at the NIC's own link);
the world every ``period`` steps over the cross-rack link. Syncs are priced blocking
(added to the step), and a world step skips the rack's sync (the world's mean is also each
rack's). What the rack level buys in convergence is not modelled: measure steps to a loss
(benchmarks/time_to_loss.py) as for any period.

Example::

    >>> from hiersync.costmodel import get_preset
    >>> rows = price_levels(get_preset("h100-8rail"), params=7e9, nodes=128, nodes_per_rack=16,
    ...                     oversubscription=32.0, compute_s=1.0, rack_period=4, period=16)
    >>> [r.name for r in rows]
    ['two levels, period=4', 'two levels, period=16', 'three levels, 4 / 16']
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hiersync._table import render

from .links import Link, check_count, check_number
from .predict import predict_param_sync
from .profile import Profile

__all__ = ["cross_rack_link", "LevelRow", "price_levels", "rack_verdict"]


def cross_rack_link(inter: Link, nodes_per_rack: int, oversubscription: float, spine_latency_s: float = 0.0) -> Link:
    """The NIC link as a rail ring across racks sees it: per-flow bandwidth ``min(B, R B / o)``,
    latency plus ``spine_latency_s`` per hop."""
    R = check_count("nodes_per_rack", nodes_per_rack)
    o = check_number("oversubscription", oversubscription, strict=True)
    extra = check_number("spine_latency_s", spine_latency_s)
    return Link(inter.alpha + extra, inter.beta * max(1.0, o / R), inter.gamma)


@dataclass(frozen=True)
class LevelRow:
    """One way to run the job: its periods and what a step costs."""

    name: str
    rack_period: int | None
    period: int
    step_s: float
    rack_s: float
    """Seconds of one rack sync (0: no rack level)."""
    world_s: float
    """Seconds of one world sync (of the exact all-reduce, for DDP)."""
    spine_bytes: float
    """Bytes per step each rack sends over its uplinks (amortized over the period)."""


def price_levels(
    profile: Profile,
    *,
    params: float,
    nodes: int,
    nodes_per_rack: int,
    oversubscription: float,
    compute_s: float,
    rack_period: int,
    period: int,
    bytes_per_param: int = 4,
    spine_latency_s: float = 0.0,
) -> list[LevelRow]:
    """Two levels at ``rack_period`` and at ``period``, and three levels (``rack_period`` / ``period``).

    Each leg as :func:`~hiersync.costmodel.predict_param_sync` prices it (NCCL's tuner on an NCCL
    profile): the rack's on ``nodes_per_rack`` nodes at the profile's NIC link, the world's on
    ``nodes`` nodes at :func:`cross_rack_link`. ``step_s``: ``compute_s`` plus the syncs, amortized
    (the every-step gradient average inside the node is the same in every row and hidden in
    backward as the plan assumes).
    """
    N, R = check_count("nodes", nodes), check_count("nodes_per_rack", nodes_per_rack)
    if N % R or R == N:
        raise ValueError(
            f"nodes={N} do not split into several racks of nodes_per_rack={R}: give a divisor of {N} below it"
        )
    if not 2 <= rack_period < period:
        raise ValueError(f"rack_period={rack_period} must be >= 2 and below the world's period={period}")
    n = check_number("params", params, strict=True) * bytes_per_param
    compute = check_number("compute_s", compute_s)
    spine = cross_rack_link(profile.inter, R, oversubscription, spine_latency_s)
    rack_s = predict_param_sync(n, replace(profile, nodes=R), param_bytes=bytes_per_param) if R > 1 else 0.0
    world_s = predict_param_sync(n, replace(profile, nodes=N, inter=spine), param_bytes=bytes_per_param)
    crossing = 2 * (N - 1) / N * n  # out of each rack, per world all-reduce: L rails x 2(N-1)/N x n/L

    def row(name: str, kr: int | None, kw: int) -> LevelRow:
        per_step = world_s / kw + (rack_s * (1 / kr - 1 / kw) if kr else 0.0)
        return LevelRow(name, kr, kw, compute + per_step, rack_s if kr else 0.0, world_s, crossing / kw)

    return [
        row(f"two levels, period={rack_period}", None, rack_period),
        row(f"two levels, period={period}", None, period),
        row(f"three levels, {rack_period} / {period}", rack_period, period),
    ]


def rack_verdict(rows: list[LevelRow], nodes_per_rack: int, oversubscription: float) -> str:
    """Whether the rack level pays: three levels against two levels at the rack's period."""
    two, three = rows[0], rows[2]
    gain = two.step_s / three.step_s
    bound = (
        "the spine limits the world's ring"
        if oversubscription > nodes_per_rack
        else (
            f"the spine does not limit a rack-ordered ring while oversubscription {oversubscription:g} <= "
            f"{nodes_per_rack} nodes per rack, so the rack level saves mostly latency"
        )
    )
    if gain >= 1.1:
        return (
            f"a rack level pays: {gain:.2f}x faster steps than syncing the world every {three.rack_period} steps, with "
            f"every node still averaged with its rack that often ({bound})"
        )
    return (
        f"a rack level buys little here: {gain:.2f}x against syncing the world every {three.rack_period} steps "
        f"({bound}); keep two levels"
    )


def format_levels(rows: list[LevelRow], nodes: int, nodes_per_rack: int, oversubscription: float) -> str:
    """The three-level section of ``python -m hiersync plan --nodes-per-rack R``."""
    compute_ms = (rows[0].step_s - rows[0].world_s / rows[0].period) * 1e3
    out = [
        "",
        f"Three levels: node -> rack ({nodes_per_rack} nodes) -> world ({nodes} nodes), spine oversubscribed "
        f"{oversubscription:g}:1 (syncs priced blocking)",
    ]
    table = [
        [
            r.name,
            f"{r.step_s * 1e3:.1f}",
            f"{r.rack_s * 1e3:.1f}" if r.rack_period else "-",
            f"{r.world_s * 1e3:.1f}",
            f"{r.spine_bytes / 1e9:.2f}",
        ]
        for r in rows
    ]
    head, *body = render(
        ["mode", "step ms", "rack sync ms", "world sync ms", "GB/step out of a rack"], table
    ).splitlines()
    # the compute under the header, before the rows
    out += [f"  {line}" for line in [head, f"(compute {compute_ms:.1f} ms per step plus the syncs, amortized)", *body]]
    three = rows[2]
    out += [
        f"  {rack_verdict(rows, nodes_per_rack, oversubscription)}",
        f"  three levels: hiersync.register(ddp_model, optimizer, period={three.period}, "
        f"rack_period={three.rack_period}) with HIERSYNC_RACK_KEY naming each rank's rack (or HIERSYNC_RACK_IDS)",
    ]
    return "\n".join(out)
