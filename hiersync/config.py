"""The options of :class:`hiersync.HierState`, validated once. Pure: no torch import.

A frozen keyword-only dataclass (torchtitan's style): every field has a docstring, every
user mistake raises ``ValueError``/``TypeError`` naming the value and the fix, and a
config can be built, compared and logged without a process group.

Example::

    >>> cfg = HierConfig(period=4, warmup_steps=100, compress="bf16")
    >>> cfg.schedule.kind(103)
    'sync'
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .levels import HierLevel, hierarchy
from .pace import check_pace
from .schedule import Schedule
from .vocab import COMPRESS_CODES, INTRA_ALGORITHMS, NONFINITE_MODES, WIRE_FORMATS, MiB, wire_format

__all__ = ["HierConfig", "ALGORITHMS", "COMPRESS", "NONFINITE"]

ALGORITHMS = ("two_level", "flat", "auto")
"""Exact-step all-reduce: two-level, one world all-reduce, or chosen per bucket size."""
COMPRESS = (None, *WIRE_FORMATS)
"""Inter-node payload of the parameter average (``None``/``"none"``: fp32)."""
NONFINITE = NONFINITE_MODES
"""What a NaN/Inf gradient does."""


def _choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {allowed}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class HierConfig:
    """What :class:`hiersync.HierState` does; see its docstring for the user-facing story."""

    period: int = 1
    """Steps between inter-node syncs (k); 1 = exact every step."""
    warmup_steps: int = 0
    """Steps at the start that use exact sync."""
    overlap: bool | int = False
    """Apply each sync ``tau`` steps after its launch as a delta correction (needs an attached
    optimizer): False/0 = blocking, True = 1, an int in 1..period-1. Stored as the int."""
    fragments: int = 1
    """Streaming: sync the parameters in this many fragments on staggered steps (schedule.py)."""
    compress: str | None = None
    """``"bf16"``/``"fp16"``: send parameter deltas against the fp32 anchor in 16 bits;
    ``"int8"``/``"int4"``: block-quantized, with error feedback (needs an attached optimizer
    and nodes of equal size); ``"topk2"``: the ``topk`` largest of each block of 4,096 values,
    2-bit, with error feedback (the same needs)."""
    error_feedback: bool = True
    """int8/int4/topk2: keep what the codes of each delta leave out and send it with the next one
    (False only to measure what it buys: the rounding errors are then lost)."""
    topk: int | None = None
    """``compress="topk2"``: values sent of each block of 4,096 (default 64; a multiple of 4)."""
    outer_lr: float | None = None
    """DiLoCo outer Nesterov learning rate on the averaged pseudo-gradient; None = plain average."""
    outer_momentum: float = 0.0
    """Outer Nesterov momentum (needs ``outer_lr``)."""
    outer_optimizer: Any = field(default=None, compare=False)
    """The outer step by any ``torch.optim`` optimizer: a factory ``params -> Optimizer`` (e.g.
    ``lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)``), given this rank's fp32
    shard of each chunk's anchor, whose gradient is the pseudo-gradient ``anchor - average``; its
    state is kept and checkpointed with the anchor. None: ``outer_lr``'s Nesterov (or no outer step)."""
    algorithm: str = "two_level"
    """Exact-step all-reduce: ``"two_level"``, ``"flat"`` or ``"auto"`` (cost model per bucket size)."""
    nonfinite: str = "skip"
    """NaN/Inf gradient: ``"skip"`` the update, ``"raise"``, or ``"ignore"`` (no check, no cost)."""
    timeout: datetime.timedelta | float | None = None
    """Timeout of hiersync's groups; None = the world process group's own timeout."""
    chunk_mb: float = 25.0
    """The parameter average after ``optimizer.step()`` runs in chunks of this many MiB."""
    intra_algorithm: str | None = None
    """``"rs_ag"`` or ``"allreduce_bcast"``; None = by backend (vocab.default_intra_algorithm)."""
    state_device: str | None = None
    """``"cpu"``: keep the local-SGD state (anchor, momentum shards) in host memory, pinned where
    CUDA is available (applies to the sharded state of an attached optimizer); None: on the
    parameters' device."""
    average_optimizer_state: tuple[str, ...] = ()
    """Names of optimizer-state tensors (AdamW's ``"exp_avg"``, ...) averaged across nodes at each
    sync with their parameters (needs an attached optimizer); ``()``: the optimizer state stays local."""
    profile: Any = None
    """Calibration profile (path or ``costmodel.Profile``) for ``algorithm="auto"``."""
    pace: str = "fixed"
    """``"fixed"``: every node takes ``period`` steps a window (and waits for the slowest at its
    sync); ``"adaptive"``: the fastest node takes ``period``, every other node the whole steps that
    fit in the same time (:mod:`hiersync.pace`), each node's average weighted by its samples."""
    rack_period: int | None = None
    """A third level between node and world (:mod:`hiersync.levels`): average parameters across
    the nodes of each rack every ``rack_period`` steps (2..period-1; racks from
    ``HIERSYNC_RACK_IDS`` or ``HIERSYNC_RACK_KEY``; needs an attached optimizer). None: two levels."""
    schedule: Schedule = field(init=False, repr=False, compare=False)
    levels: tuple[HierLevel, ...] = field(init=False, repr=False, compare=False)
    """The hierarchy, bottom to top: node, (rack,) world; ``schedule`` is the world's."""

    def __post_init__(self) -> None:
        schedule = Schedule(period=self.period, warmup_steps=self.warmup_steps, fragments=self.fragments)
        object.__setattr__(self, "schedule", schedule)
        levels = hierarchy(self.period, self.warmup_steps, self.fragments, self.rack_period)
        object.__setattr__(self, "levels", levels)
        check_pace(self.pace)
        if self.pace == "adaptive" and self.period < 2:
            raise ValueError(
                f"pace='adaptive' needs period >= 2 (at period={self.period} every step is exact: every node takes "
                "every step together)"
            )
        if self.pace == "adaptive" and self.rack_period is not None:
            raise ValueError(
                f"pace='adaptive' with rack_period={self.rack_period}: the rack level counts steps, and under "
                "adaptive pace a rack's nodes take different numbers of them; drop rack_period (or use pace='fixed')"
            )
        if not isinstance(self.overlap, (bool, int)):
            raise TypeError(f"overlap must be a bool or an int number of steps, got {self.overlap!r}")
        if self.overlap and self.period < 2:
            raise ValueError(
                f"overlap={self.overlap} needs period >= 2 (there is nothing to overlap at period={self.period})"
            )
        tau = int(self.overlap)
        if not 0 <= tau <= max(self.period - 1, 0):
            raise ValueError(
                f"overlap={self.overlap} must be between 1 and period - 1 = {self.period - 1} steps (a sync must "
                "land before the same fragment syncs again), or False for blocking syncs"
            )
        object.__setattr__(self, "overlap", tau)
        _choice("compress", self.compress, COMPRESS)
        if self.compress == "none":
            object.__setattr__(self, "compress", None)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        if not self.error_feedback and self.compress not in COMPRESS_CODES:
            raise ValueError(
                f"error_feedback=False applies to compress={' or '.join(map(repr, COMPRESS_CODES))} "
                f"(compress={self.compress!r} sends 16-bit or fp32 values, with nothing to feed back)"
            )
        if self.topk is not None:
            row = wire_format(self.compress)
            if row.keep is None or row.block is None:
                raise ValueError(
                    f"topk={self.topk!r} applies to compress='topk2' (compress={self.compress!r} is dense)"
                )
            if isinstance(self.topk, bool) or not isinstance(self.topk, int):
                raise TypeError(f"topk must be an int, got {self.topk!r}")
            if not (4 <= self.topk <= row.block and self.topk % 4 == 0):
                raise ValueError(
                    f"topk={self.topk} must be a multiple of 4 between 4 and {row.block} (the values of a block)"
                )
        _choice("algorithm", self.algorithm, ALGORITHMS)
        _choice("nonfinite", self.nonfinite, NONFINITE)
        _choice("intra_algorithm", self.intra_algorithm, (None, *INTRA_ALGORITHMS))
        _choice("state_device", self.state_device, (None, "cpu"))
        if self.outer_lr is not None and not (_number(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"outer_lr must be a positive number or None, got {self.outer_lr!r}")
        if not (_number(self.outer_momentum) and 0.0 <= self.outer_momentum < 1.0):
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if self.outer_momentum and self.outer_lr is None:
            raise ValueError(f"outer_momentum={self.outer_momentum} needs outer_lr (e.g. outer_lr=0.7)")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise TypeError(
                f"outer_optimizer must be a factory params -> torch.optim.Optimizer, got {self.outer_optimizer!r}: "
                "e.g. outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"
            )
        if self.outer_optimizer is not None and self.outer_lr is not None:
            raise ValueError(
                f"outer_optimizer and outer_lr={self.outer_lr} are two outer steps: give one (outer_lr=0.7, "
                "outer_momentum=0.9 is torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))"
            )
        names = self.average_optimizer_state
        if isinstance(names, str) or not isinstance(names, (tuple, list)):
            raise TypeError(
                f"average_optimizer_state must be a tuple of names, got {names!r}: "
                "e.g. average_optimizer_state=('exp_avg',)"
            )
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"average_optimizer_state={names!r}: give distinct state names, e.g. ('exp_avg',)")
        if names and self.period < 2:
            raise ValueError(
                f"average_optimizer_state={names!r} needs period >= 2 (at period=1 no optimizer state drifts apart)"
            )
        object.__setattr__(self, "average_optimizer_state", tuple(names))
        if not (_number(self.chunk_mb) and self.chunk_mb > 0):
            raise ValueError(f"chunk_mb must be > 0, got {self.chunk_mb!r}")
        timeout = self.timeout
        if _number(timeout):
            assert isinstance(timeout, (int, float))
            if timeout <= 0:
                raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
            object.__setattr__(self, "timeout", datetime.timedelta(seconds=timeout))
        elif timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a timedelta or seconds, got {timeout!r}")

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * MiB)
