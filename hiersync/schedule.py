"""Which step does what: the pure schedule of hierarchical local SGD.

No torch import: the schedule is unit-tested in microseconds and shared by the hook,
the cost model and the benchmarks.

Steps count from 0. A *step* is one synchronized backward (DDP calls the hook);
micro-steps under ``no_sync()`` do not count. Steps ``s < warmup_steps`` are *exact*
(every bucket averaged over the world). After warmup, every step averages buckets inside
the node, and the *sync steps* are those with ``(s - warmup_steps + 1) % period == 0``:
the k-th, 2k-th, ... step after warmup. With ``period == 1`` every step is exact.

Example::

    >>> s = Schedule(period=4, warmup_steps=2)
    >>> [s.kind(i) for i in range(7)]
    ['exact', 'exact', 'local', 'local', 'local', 'sync', 'local']
"""

from __future__ import annotations

from dataclasses import dataclass

from .vocab import StepKind

__all__ = ["Schedule", "EXACT", "LOCAL", "SYNC"]

EXACT, LOCAL, SYNC = StepKind.EXACT, StepKind.LOCAL, StepKind.SYNC


@dataclass(frozen=True)
class Schedule:
    period: int = 1
    """Steps between inter-node syncs (k). 1 means exact sync every step."""
    warmup_steps: int = 0
    """Steps at the start that use exact sync regardless of ``period``."""

    def __post_init__(self) -> None:
        if isinstance(self.period, bool) or not isinstance(self.period, int):
            raise TypeError(f"period must be an int >= 1, got {self.period!r} ({type(self.period).__name__})")
        if self.period < 1:
            raise ValueError(f"period must be >= 1 (1 = exact sync every step), got {self.period}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise TypeError(
                f"warmup_steps must be an int >= 0, got {self.warmup_steps!r} ({type(self.warmup_steps).__name__})"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    def is_exact(self, step: int) -> bool:
        """Whether ``step`` averages every bucket over the whole world."""
        return self.period == 1 or step < self.warmup_steps

    def is_sync(self, step: int) -> bool:
        """Whether ``step`` is a (post-warmup, period > 1) inter-node parameter sync step."""
        return not self.is_exact(step) and (step - self.warmup_steps + 1) % self.period == 0

    def kind(self, step: int) -> StepKind:
        """``"exact"``, ``"sync"`` or ``"local"``."""
        if self.is_exact(step):
            return EXACT
        return SYNC if self.is_sync(step) else LOCAL

    def inter_syncs(self, num_steps: int) -> int:
        """Number of steps among the first ``num_steps`` that cross nodes (exact or sync)."""
        if num_steps <= 0:
            return 0
        exact = min(num_steps, self.warmup_steps) if self.period > 1 else num_steps
        rest = num_steps - exact
        return exact + (rest // self.period if self.period > 1 else 0)
