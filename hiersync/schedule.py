"""Which step does what: the pure schedule of hierarchical local SGD.

No torch import: the schedule is unit-tested in microseconds and shared by the hook,
the cost model and the benchmarks.

Steps count from 0. A *step* is one synchronized backward (DDP calls the hook);
micro-steps under ``no_sync()`` do not count. Steps ``s < warmup_steps`` are *exact*
(every bucket averaged over the world). After warmup, every step averages buckets inside
the node, and the *sync steps* are those with ``(s - warmup_steps + 1) % period == 0``:
the k-th, 2k-th, ... step after warmup. With ``period == 1`` every step is exact.

*Streaming* (``fragments=F > 1``): the parameters are split into F fragments
(:func:`fragment_layout`); fragment ``f`` syncs once in every window of k post-warmup
steps, at offset ``ceil((f + 1) * k / F) - 1`` in the window, so the fragments' syncs are
staggered and each step carries about 1/F of a whole-model sync (``F = 1``: offset
``k - 1``, the plain schedule). A step is a sync step when some fragment syncs on it.

Example::

    >>> s = Schedule(period=4, warmup_steps=2)
    >>> [s.kind(i) for i in range(7)]
    ['exact', 'exact', 'local', 'local', 'local', 'sync', 'local']
    >>> [Schedule(period=4, fragments=2).fragments_due(i) for i in range(4)]
    [(), (0,), (), (1,)]
"""

from __future__ import annotations

from dataclasses import dataclass

from .vocab import StepKind

__all__ = ["Schedule", "fragment_layout", "EXACT", "LOCAL", "SYNC"]

EXACT, LOCAL, SYNC = StepKind.EXACT, StepKind.LOCAL, StepKind.SYNC


@dataclass(frozen=True)
class Schedule:
    period: int = 1
    """Steps between inter-node syncs (k). 1 means exact sync every step."""
    warmup_steps: int = 0
    """Steps at the start that use exact sync regardless of ``period``."""
    fragments: int = 1
    """Fragments that sync on staggered steps (streaming); 1 = the whole model at once."""

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
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"fragments must be an int >= 1 (1 = no streaming), got {self.fragments!r}")
        if self.fragments > 1 and self.period < 2:
            raise ValueError(f"fragments={self.fragments} needs period >= 2 (streaming spreads the period-k sync)")

    def offset(self, fragment: int) -> int:
        """Where in each window of ``period`` post-warmup steps ``fragment`` syncs (0-based)."""
        return -(-(fragment + 1) * self.period // self.fragments) - 1

    def fragments_due(self, step: int) -> tuple[int, ...]:
        """The fragments whose cross-node average runs after ``step`` (ascending)."""
        if self.is_exact(step):
            return ()
        r = (step - self.warmup_steps) % self.period
        return tuple(f for f in range(self.fragments) if self.offset(f) == r)

    def is_exact(self, step: int) -> bool:
        """Whether ``step`` averages every bucket over the whole world."""
        return self.period == 1 or step < self.warmup_steps

    def is_sync(self, step: int) -> bool:
        """Whether ``step`` is a (post-warmup, period > 1) inter-node parameter sync step."""
        if self.fragments > 1:
            return bool(self.fragments_due(step))
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
        if self.period == 1:
            return exact
        offsets = {self.offset(f) for f in range(self.fragments)}
        return exact + rest // self.period * len(offsets) + sum(o < rest % self.period for o in offsets)


def fragment_layout(sizes: list[int], fragments: int, what: str = "parameter tensors") -> list[list[int]]:
    """Split tensors of ``sizes`` (bytes, in registry order) into ``fragments`` lists of indices.

    Items (parameter tensors) are never cut: per-tensor state stays simple. Each tensor
    goes, in order, to the fragment holding the fewest bytes so far
    (ties: the lowest index): consecutive layers land in different fragments, the strided
    pattern Streaming DiLoCo found better than contiguous blocks, and the fragments hold
    about equal bytes. Deterministic, so identical on every rank.
    """
    if fragments > len(sizes):
        raise ValueError(
            f"fragments={fragments} but the model has only {len(sizes)} {what} (a fragment holds "
            f"whole {what}): use fragments <= {len(sizes)}"
        )
    load = [0] * fragments
    out: list[list[int]] = [[] for _ in range(fragments)]
    for i, size in enumerate(sizes):
        f = min(range(fragments), key=lambda j: (load[j], j))
        out[f].append(i)
        load[f] += size
    return out
