"""What a ``python -m hiersync bench`` schedule name means (see :mod:`hiersync.tools.bench`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ScheduleSpec",
    "parse_schedule",
    "default_schedules",
    "full_schedules",
    "timed_steps",
    "NEVER",
    "FULL_PERIODS",
]

FULL_PERIODS = (2, 4, 8)
NEVER = 10**9  # a period no run reaches: intra-node averaging only

_SCHEDULE_RE = re.compile(r"^hiersync_p(\d+)((?:_overlap)?)((?:_bf16)?)$")


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule name means."""

    name: str
    kind: str
    """``ddp``, ``postlocal``, ``bf16_hook``, ``hiersync``, ``intra_only`` or ``compute_only``."""
    period: int = 1
    overlap: bool = False
    compress: str | None = None


def parse_schedule(name: str) -> ScheduleSpec:
    """Parse ``"hiersync_p4_overlap_bf16"``, ``"postlocal_k4"``, ``"ddp"``, ... into a spec."""
    if name in ("ddp", "bf16_hook", "intra_only", "compute_only"):
        return ScheduleSpec(name, name, period=NEVER if name == "intra_only" else 1)
    m = re.match(r"^postlocal_k(\d+)$", name)
    if m and int(m.group(1)) >= 1:
        return ScheduleSpec(name, "postlocal", period=int(m.group(1)))
    m = _SCHEDULE_RE.match(name)
    if m and int(m.group(1)) >= 1:
        period = int(m.group(1))
        overlap = bool(m.group(2))
        if overlap and period < 2:
            raise ValueError(f"schedule {name!r}: overlap needs period >= 2")
        return ScheduleSpec(name, "hiersync", period=period, overlap=overlap, compress="bf16" if m.group(3) else None)
    raise ValueError(
        f"schedule {name!r} is not known; use ddp, bf16_hook, intra_only, compute_only, postlocal_k<k>, "
        "hiersync_p<k>[_overlap][_bf16]"
    )


def default_schedules() -> list[str]:
    """What the targets compare, at k=4, plus the two references."""
    return [
        "ddp",
        "postlocal_k4",
        "bf16_hook",
        "hiersync_p1",
        "hiersync_p4",
        "hiersync_p4_overlap",
        "hiersync_p4_overlap_bf16",
        "intra_only",
        "compute_only",
    ]


def full_schedules(periods: Sequence[int] = FULL_PERIODS) -> list[str]:
    """Every schedule at every period in ``periods``, plus the references."""
    out = ["ddp", "bf16_hook", "hiersync_p1"]
    for k in periods:
        out += [
            f"postlocal_k{k}",
            f"hiersync_p{k}",
            f"hiersync_p{k}_overlap",
            f"hiersync_p{k}_bf16",
            f"hiersync_p{k}_overlap_bf16",
        ]
    return out + ["intra_only", "compute_only"]


def timed_steps(spec: ScheduleSpec, steps: int) -> int:
    """``steps`` rounded up to a multiple of the period, so every window holds the same syncs."""
    k = spec.period if spec.kind in ("hiersync", "postlocal") and spec.period < NEVER else 1
    return max(k, int(math.ceil(steps / k)) * k)
