"""Counters a HierState keeps: steps by kind, collectives and bytes per level.

The collectives count themselves (:class:`hiersync.collectives.HierComm`, under :attr:`Stats.lock`):
bytes are what *this rank sends* under a bandwidth-optimal algorithm, the cost model's and
nccl-tests' busbw accounting (:func:`hiersync.collectives.collective_bytes`).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field, fields

from .vocab import Level, StepKind

__all__ = ["Stats", "INTRA", "INTER"]

INTRA: str = Level.INTRA.value
INTER: str = Level.INTER.value


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
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Held while a counter changes (the collectives count from callback threads too)."""

    def count_step(self, kind: str, step: int) -> None:
        """One synchronized backward of ``kind`` (a :class:`~hiersync.vocab.StepKind`) at ``step``."""
        with self.lock:
            self.steps += 1
            if kind == StepKind.EXACT:
                self.exact_steps += 1
            elif kind == StepKind.LOCAL:
                self.local_steps += 1
            else:
                self.sync_steps += 1
                self.recent_sync_steps.append(step)

    def count_collective(self, level: str, nbytes: int) -> None:
        """One collective on ``level`` that sent ``nbytes`` (its busbw bytes:
        :func:`hiersync.collectives.collective_bytes`)."""
        with self.lock:
            self.collectives[level] = self.collectives.get(level, 0) + 1
            self.bytes_sent[level] = self.bytes_sent.get(level, 0) + nbytes

    def count_skip(self, kind: str) -> None:
        """This rank skipped the update of a step of ``kind`` (non-finite gradient)."""
        with self.lock:
            self.nonfinite_skips += 1
            if kind == StepKind.SYNC:
                self.nonfinite_sync_skips += 1

    def as_dict(self) -> dict:
        with self.lock:
            return self._snapshot()

    def _snapshot(self) -> dict:
        """Every public counter (a subclass's too), dicts and deques copied."""
        out = {}
        for f in fields(self):
            if f.compare:  # the counters, not the lock
                value = getattr(self, f.name)
                if isinstance(value, dict):
                    value = dict(value)
                elif isinstance(value, collections.deque):
                    value = list(value)
                out[f.name] = value
        return out

    def reset(self) -> None:
        fresh = type(self)()
        with self.lock:
            for name in self._snapshot():
                setattr(self, name, getattr(fresh, name))
