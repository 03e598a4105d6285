"""Pace: how many inner steps each node takes in a window, from the step times of every node.

Fixed pace (today's runtime) gives every node ``period`` steps a window, so every node waits
at each sync for the slowest. Adaptive pace gives the fastest node
``period`` steps and every other node the whole number of its own steps that fits in the same
time, at least 1, so that the nodes reach the sync together. The decision is this module's
:func:`steps_per_window`, which the runtime runs (``register(..., pace="adaptive")``, through
:class:`Windows`) and the cost model prices (:mod:`hiersync.costmodel.pace`, ``plan --node-speeds``).

A step time is a node's whole step (forward, backward, update), not its wait at a sync. A node
within :data:`TOLERANCE` of the fastest takes ``period``: timer noise never costs it a step.
Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .schedule import Schedule
from .vocab import StepKind

__all__ = ["PACES", "TOLERANCE", "Windows", "check_pace", "check_positive", "steps_per_window"]

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
    steps that fits in the window, widened by ``tolerance``: ``floor(window / t * (1 + tolerance))``,
    at most ``period`` and at least 1. The window is ``period`` of the fastest's steps, or, where
    that trains more samples per second over all nodes (by more than ``tolerance / 5``), stretched
    to the end of a slower node's next whole step: a node that fits 4.7 steps then takes 5 and the
    others wait a little, instead of it leaving 0.7 of a step idle every window (with one slow node
    among many, stretching costs every other node the wait and is not chosen).

    >>> steps_per_window([0.10, 0.20, 0.104, 0.40], period=8)
    [8, 4, 8, 2]
    >>> steps_per_window([0.45, 0.77], period=8)  # 4.7 steps fit: 5, the window 4% longer
    [8, 5]
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be an int >= 1, got {period!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    times = check_positive(step_s, "step times (seconds, one per node)")
    base = period * min(times)

    def fitting(window: float) -> tuple[list[int], float]:
        steps = [min(period, max(1, math.floor(window / t * (1 + tolerance)))) for t in times]
        return steps, sum(steps) / max(n * t for n, t in zip(steps, times))

    best, rate = fitting(base)
    for t in sorted(set(times)):
        stretched = math.ceil(base / t) * t
        if stretched <= base * (1 + tolerance) or stretched / t > period:
            continue
        steps, r = fitting(stretched)
        if r > rate * (1 + tolerance / 5):
            best, rate = steps, r
    lasts = max(n * t for n, t in zip(best, times))  # a node of one long step may stretch it: fill it
    return [max(n, min(period, math.floor(lasts / t * (1 + 1e-12)))) for n, t in zip(best, times)]


class Windows:
    """One node's windows under adaptive pace: a :class:`~hiersync.schedule.Schedule` whose
    windows have the length this node was given, not ``period`` each.

    Window ``w`` starts at this node's step :attr:`start` and holds :attr:`length` steps. Its
    fragments sync on the slowest node's grid (:attr:`grid`, that node's steps in the window):
    fragment ``f`` at the end of the slowest node's step ``ceil((f + 1) * grid / F)``, and on this
    node at the step that ends at the same fraction of the window, offset
    ``ceil(ceil((f + 1) * grid / F) * length / grid) - 1`` (every node at one speed: the schedule's
    ``ceil((f + 1) * period / F) - 1``). So every node reaches a fragment's sync at about the
    same time, and a fast node does not wait for a slow one's step at each fragment; with fewer
    steps than fragments several sync on one step, in fragment order. :meth:`close` ends the
    window whose last fragment synced and starts the next at the length decided for it. Answers
    what a ``Schedule`` answers (``kind``, ``fragments_due``, ``is_sync``, ``is_exact``), so the
    front-end and the engine read it in its place; warmup steps are exact on every node, as there.

    >>> w = Windows(Schedule(period=4, fragments=2))
    >>> [w.fragments_due(i) for i in range(4)]
    [(), (0,), (), (1,)]
    >>> w.close(3, 2); [w.fragments_due(i) for i in range(4, 6)], w.window
    ([(0,), (1,)], 1)
    >>> w = Windows(Schedule(period=8, fragments=4)); w.close(7, 8, grid=2)  # a node at 1/4 speed: 2 steps
    >>> [w.fragments_due(i) for i in range(8, 16)]  # on its grid: two fragments at each of its step ends
    [(), (), (), (0, 1), (), (), (), (2, 3)]
    """

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.period, self.warmup_steps, self.fragments = schedule.period, schedule.warmup_steps, schedule.fragments
        self.start = schedule.warmup_steps
        """This node's first step of the open window."""
        self.length = schedule.period
        """Steps this node takes in the open window (the first window: ``period`` on every node)."""
        self.grid = schedule.period
        """Steps the slowest node takes in the open window: the fragments' syncs sit on its steps."""
        self.window = 0
        """Windows closed so far (equal on every node at the same sync)."""

    def offset(self, fragment: int) -> int:
        """Where in the open window ``fragment`` syncs on this node (0-based)."""
        n, g = self.length, self.grid
        on_grid = -(-(fragment + 1) * g // self.fragments)  # the slowest node's steps before it
        return -(-on_grid * n // g) - 1

    def is_exact(self, step: int) -> bool:
        return self.schedule.is_exact(step)

    def fragments_due(self, step: int) -> tuple[int, ...]:
        if self.is_exact(step):
            return ()
        r = step - self.start
        return tuple(f for f in range(self.fragments) if self.offset(f) == r)

    def is_sync(self, step: int) -> bool:
        return bool(self.fragments_due(step))

    def apply_at(self, step: int, overlap: int) -> int:
        """``overlap`` of the slowest node's steps, counted in this node's: a node that takes 4 steps
        to the slowest's one applies a sync 4 of its steps after the launch, at about the time the
        slowest applies it after its next, so its transfer has that long to end (tau of this node's
        own steps would wait for it). A correction still in flight when its fragment syncs again
        is applied first, as under fixed pace."""
        return step + 1 + max(overlap, -(-overlap * self.length // self.grid))

    def kind(self, step: int) -> StepKind:
        if self.is_exact(step):
            return StepKind.EXACT
        return StepKind.SYNC if self.is_sync(step) else StepKind.LOCAL

    def closes(self, fragments: Sequence[int]) -> bool:
        """Whether a sync of ``fragments`` ends the window (its last fragment is among them)."""
        return self.fragments - 1 in fragments

    def close(self, step: int, length: int, grid: int | None = None) -> None:
        """The window's last fragment synced after ``step``: the next window starts after it, this
        node's ``length`` steps, the slowest node's ``grid`` (default ``length``)."""
        grid = length if grid is None else grid
        for name, n in (("length", length), ("grid", grid)):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.period:
                raise ValueError(f"a window's {name} must be an int in 1..{self.period}, got {n!r}")
        if grid > length:
            raise ValueError(f"a window's grid (the slowest node's steps, {grid}) exceeds this node's {length}")
        self.start, self.length, self.grid, self.window = step + 1, length, grid, self.window + 1

    def state(self) -> dict[str, Any]:
        return {"start": self.start, "length": self.length, "grid": self.grid, "window": self.window}

    def load(self, state: dict[str, Any]) -> None:
        self.start, self.length, self.window = int(state["start"]), int(state["length"]), int(state["window"])
        self.grid = int(state.get("grid", self.length))
