"""Counters a HierState keeps: steps by kind, collectives and bytes per level.

Bytes are what *this rank sends* under a bandwidth-optimal algorithm (the same accounting
as the cost model and nccl-tests' busbw), not what a particular backend happens to send:

=================  =======================
collective         bytes sent per rank
=================  =======================
all-reduce         2 (p - 1) / p * n
reduce-scatter     (p - 1) / p * n          (n = full input size)
all-gather         (p - 1) / p * n          (n = full output size)
all-to-all         (p - 1) / p * n          (n = full input size)
reduce, broadcast  (p - 1) / p * n
=================  =======================

with p the group size and n the bytes of the (padded) tensor. Groups of one rank
issue no collective and count nothing.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field, fields

from .vocab import Level, StepKind

__all__ = ["Stats", "INTRA", "INTER", "collective_bytes"]

INTRA: str = Level.INTRA.value
INTER: str = Level.INTER.value

_FACTORS = {
    "all_reduce": 2.0,
    "reduce_scatter": 1.0,
    "all_gather": 1.0,
    "all_to_all": 1.0,
    "reduce": 1.0,
    "broadcast": 1.0,
}


def collective_bytes(kind: str, group_size: int, nbytes: int) -> int:
    """Bytes one rank sends for collective ``kind`` over ``group_size`` ranks on ``nbytes``."""
    if group_size <= 1:
        return 0
    return int(round(_FACTORS[kind] * (group_size - 1) / group_size * nbytes))


@dataclass
class Stats:
    """Counters since construction (or the last :meth:`reset`). Read them as attributes."""

    steps: int = 0
    """Synchronized backward passes seen (``no_sync()`` micro-steps excluded)."""
    exact_steps: int = 0
    local_steps: int = 0
    sync_steps: int = 0
    collectives: dict = field(default_factory=lambda: {INTRA: 0, INTER: 0})
    """Collectives issued by this rank per level."""
    bytes_sent: dict = field(default_factory=lambda: {INTRA: 0, INTER: 0})
    """Bytes this rank sent per level (bandwidth-optimal accounting, see module doc); a rack level
    adds ``"rack"``."""
    nonfinite_skips: int = 0
    """Steps whose update this rank skipped because a gradient was NaN/Inf."""
    nonfinite_sync_skips: int = 0
    """Sync steps where this rank's node contributed nothing to the cross-node average."""
    recent_sync_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1024))
    """Indices of the most recent inter-node sync steps (bounded)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, level: str, kind: str, group_size: int, nbytes: int) -> None:
        if group_size <= 1:
            return
        with self._lock:
            self.collectives[level] = self.collectives.get(level, 0) + 1
            self.bytes_sent[level] = self.bytes_sent.get(level, 0) + collective_bytes(kind, group_size, nbytes)

    def count_step(self, kind: str, step: int) -> None:
        """One synchronized backward of ``kind`` (a :class:`~hiersync.vocab.StepKind`) at ``step``."""
        with self._lock:
            self.steps += 1
            if kind == StepKind.EXACT:
                self.exact_steps += 1
            elif kind == StepKind.LOCAL:
                self.local_steps += 1
            else:
                self.sync_steps += 1
                self.recent_sync_steps.append(step)

    def count_skip(self, kind: str) -> None:
        """This rank skipped the update of a step of ``kind`` (non-finite gradient)."""
        with self._lock:
            self.nonfinite_skips += 1
            if kind == StepKind.SYNC:
                self.nonfinite_sync_skips += 1

    def as_dict(self) -> dict:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict:
        """Every public counter (a subclass's too), dicts and deques copied."""
        out = {}
        for f in fields(self):
            if not f.name.startswith("_"):
                value = getattr(self, f.name)
                if isinstance(value, dict):
                    value = dict(value)
                elif isinstance(value, collections.deque):
                    value = list(value)
                out[f.name] = value
        return out

    def reset(self) -> None:
        fresh = type(self)()
        with self._lock:
            for name in self._snapshot():
                setattr(self, name, getattr(fresh, name))
