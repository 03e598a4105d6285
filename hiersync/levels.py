"""The hierarchy as data: the levels a rank's parameters are averaged over, each with its schedule.

Pure (no torch import). Level 0 is the node: its ranks average every step's gradients.
Every level above it averages *parameters* across the groups below it, on its own
schedule: the default hierarchy is ``node -> world`` (``period=`` is the world's); a third
level, the rack, groups nodes as nodes group ranks::

    node  (every step: gradients, inside the node)
    rack  (every rack_period steps: parameters, across the rack's nodes, fp32, blocking)
    world (every period steps: parameters, across all nodes; streaming, compression and
           the outer step live on this top level only)

At a step where several levels are due, a level whose sync covers the whole model also
covers every level below it: the world's plain sync makes the rack's pointless (the world
mean is also each rack's mean), so only the highest such level runs. A streaming top level
syncs one fragment at a time, so the rack's whole-model average still runs on its steps,
before the world's fragment is launched (nodes of a rack then send the same snapshot).

Example::

    >>> levels = hierarchy(period=16, rack_period=4)
    >>> [lv.name for lv in levels], [lv.schedule.period for lv in levels]
    (['node', 'rack', 'world'], [1, 4, 16])
    >>> due(levels, 3), due(levels, 15)
    (('rack',), ('world',))
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedule import Schedule

__all__ = ["HierLevel", "hierarchy", "due", "NODE", "RACK", "WORLD"]

NODE, RACK, WORLD = "node", "rack", "world"


@dataclass(frozen=True)
class HierLevel:
    """One level of the hierarchy: its name and when its parameter average runs."""

    name: str
    schedule: Schedule

    @property
    def whole_model(self) -> bool:
        """Whether each of its syncs averages every parameter (not one fragment of them)."""
        return self.schedule.fragments == 1


def hierarchy(
    period: int, warmup_steps: int = 0, fragments: int = 1, rack_period: int | None = None
) -> tuple[HierLevel, ...]:
    """The levels, bottom to top: ``node``, ``rack`` (when ``rack_period`` is set), ``world``."""
    out = [HierLevel(NODE, Schedule(period=1))]
    if rack_period is not None:
        if isinstance(rack_period, bool) or not isinstance(rack_period, int):
            raise TypeError(f"rack_period must be an int >= 2 or None, got {rack_period!r}")
        if not 2 <= rack_period < period:
            raise ValueError(
                f"rack_period={rack_period} must be >= 2 and below period={period} (the world's): the rack "
                "averages parameters more often than the world does, e.g. rack_period=4, period=16"
            )
        out.append(HierLevel(RACK, Schedule(period=rack_period, warmup_steps=warmup_steps)))
    out.append(HierLevel(WORLD, Schedule(period=period, warmup_steps=warmup_steps, fragments=fragments)))
    return tuple(out)


def due(levels: tuple[HierLevel, ...], step: int) -> tuple[str, ...]:
    """The cross-node levels whose parameter average runs after ``step``, bottom to top.

    A level is dropped where a higher level due at the same step syncs the whole model.
    """
    names = [lv for lv in levels[1:] if lv.schedule.is_sync(step)]
    out = []
    for i, lv in enumerate(names):
        if not any(h.whole_model for h in names[i + 1 :]):
            out.append(lv.name)
    return tuple(out)
