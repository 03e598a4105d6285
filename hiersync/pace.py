"""Pace: how many inner steps each node takes in a window, from the step times of every node.

Fixed pace (today's runtime) gives every node ``period`` steps a window, so every node waits
at each sync for the slowest. Adaptive pace gives the fastest node
``period`` steps and every other node the whole number of its own steps that fits in the same
time, at least 1, so that the nodes reach the sync together. The decision is this module's
:func:`steps_per_window`, which the cost model prices (:mod:`hiersync.costmodel.pace`, ``plan
--node-speeds``); the runtime does not pace yet.

A step time is a node's whole step (forward, backward, update), not its wait at a sync. A node
within :data:`TOLERANCE` of the fastest takes ``period``: timer noise never costs it a step.
Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["PACES", "TOLERANCE", "check_pace", "check_positive", "steps_per_window"]

PACES = ("fixed", "adaptive")
TOLERANCE = 0.05
"""A node whose step is at most 5% slower than the fastest's takes the fastest's count: the
spread of step times on one host (a few percent) never drops a step, and a node 5% slow waits at
most 5% of a window at the sync."""


def check_pace(pace: object) -> str:
    """``pace`` if it is one of :data:`PACES`; a ``ValueError`` naming them otherwise."""
    if pace not in PACES:
        raise ValueError(f"pace must be one of {', '.join(map(repr, PACES))}, got {pace!r}")
    return str(pace)


def check_positive(values: Sequence[float], what: str) -> list[float]:
    """``values`` as floats, one at least, each finite and > 0; a ``ValueError`` naming ``what`` otherwise."""
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what}: none given")
    bad = [v for v in out if not (v > 0 and math.isfinite(v))]
    if bad:
        raise ValueError(f"{what} must be finite and > 0, got {bad}")
    return out


def steps_per_window(step_s: Sequence[float], period: int, tolerance: float = TOLERANCE) -> list[int]:
    """Inner steps each node takes in the next window, from each node's step time ``step_s``.

    The fastest node takes ``period``; a node whose step takes ``t`` takes the whole number of
    steps that fits in ``period`` of the fastest's, widened by ``tolerance``:
    ``floor(period * fastest / t * (1 + tolerance))``, at most ``period`` and at least 1.

    >>> steps_per_window([0.10, 0.20, 0.104, 0.40], period=8)
    [8, 4, 8, 2]
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be an int >= 1, got {period!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    times = check_positive(step_s, "step times (seconds, one per node)")
    fastest = min(times)
    return [min(period, max(1, math.floor(period * fastest / t * (1 + tolerance)))) for t in times]
