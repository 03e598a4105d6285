"""What a ``python -m hiersync bench`` schedule name means (see :mod:`hiersync.tools.bench`).

Grammar of the hiersync schedules::

    hiersync_p<k>[_overlap | _stream[<F>][_tau<t>]][_bf16]

* ``hiersync_p<k>``: period k, the inter-node average runs blocking after ``optimizer.step()``;
* ``_overlap``: the whole model's average is launched there and applied one step later
  (``overlap=True``, needs k >= 2);
* ``_stream``: streaming, ``fragments=F`` (default ``F = k``) staggered over the period, each
  applied ``t`` steps after its launch (``overlap=t``, default 1, ``1 <= t <= k - 1``);
* ``_bf16``: 16-bit deltas on the inter-node leg (``compress="bf16"``).

``hiersync_p4_stream`` is ``HierState(period=4, fragments=4, overlap=1)``,
``hiersync_p8_stream4_tau2_bf16`` is ``HierState(period=8, fragments=4, overlap=2, compress="bf16")``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ScheduleSpec",
    "parse_schedule",
    "default_schedules",
    "full_schedules",
    "timed_steps",
    "run_steps",
    "BURN_STEPS",
    "parse_compute",
    "NEVER",
    "FULL_PERIODS",
    "COMPUTE_MODELS",
    "GRAMMAR",
]

FULL_PERIODS = (2, 4, 8)
NEVER = 10**9  # a period no run reaches: intra-node averaging only
COMPUTE_MODELS = ("cpu", "accel")
"""``cpu``: real CPU compute; ``accel``: layers that sleep a set time with the CPU idle (a device's kernels)."""
GRAMMAR = "hiersync_p<k>[_overlap|_stream[<F>][_tau<t>]][_bf16]"

_SCHEDULE_RE = re.compile(r"^hiersync_p(\d+)(?:(_overlap)|(_stream)(\d*)(?:_tau(\d+))?)?(_bf16)?$")


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule name means."""

    name: str
    kind: str
    """``ddp``, ``postlocal``, ``bf16_hook``, ``hiersync``, ``intra_only`` or ``compute_only``."""
    period: int = 1
    overlap: int = 0
    """Steps after its launch that an inter-node average is applied (0: blocking)."""
    compress: str | None = None
    fragments: int = 1
    """Streaming fragments (1: the whole model at once)."""
    stream: bool = False
    """Built with the streaming API (``fragments=F, overlap=tau``), not the ``overlap=True`` flag."""

    def hiersync_options(self) -> dict[str, Any]:
        """The keyword arguments of ``hiersync.register`` / ``HierState`` this schedule uses."""
        opts: dict[str, Any] = {"period": self.period, "compress": self.compress}
        if self.stream:
            opts.update(fragments=self.fragments, overlap=self.overlap)
        else:
            opts["overlap"] = bool(self.overlap)
        return opts


def parse_schedule(name: str) -> ScheduleSpec:
    """Parse ``"hiersync_p4_stream_bf16"``, ``"postlocal_k4"``, ``"ddp"``, ... into a spec."""
    if name in ("ddp", "bf16_hook", "intra_only", "compute_only"):
        return ScheduleSpec(name, name, period=NEVER if name == "intra_only" else 1)
    m = re.match(r"^postlocal_k(\d+)$", name)
    if m and int(m.group(1)) >= 1:
        return ScheduleSpec(name, "postlocal", period=int(m.group(1)))
    m = _SCHEDULE_RE.match(name)
    if m and int(m.group(1)) >= 1:
        period = int(m.group(1))
        overlap_flag, stream, frag, tau, bf16 = m.group(2, 3, 4, 5, 6)
        compress = "bf16" if bf16 else None
        if overlap_flag:
            if period < 2:
                raise ValueError(f"schedule {name!r}: overlap needs period >= 2")
            return ScheduleSpec(name, "hiersync", period=period, overlap=1, compress=compress)
        if stream:
            fragments = int(frag) if frag else period
            overlap = int(tau) if tau else 1
            if period < 2:
                raise ValueError(f"schedule {name!r}: streaming needs period >= 2")
            if fragments < 1:
                raise ValueError(f"schedule {name!r}: fragments must be >= 1")
            if not 1 <= overlap <= period - 1:
                raise ValueError(f"schedule {name!r}: tau must be in 1..{period - 1} (period {period})")
            return ScheduleSpec(
                name, "hiersync", period=period, overlap=overlap, compress=compress, fragments=fragments, stream=True
            )
        return ScheduleSpec(name, "hiersync", period=period, compress=compress)
    raise ValueError(
        f"schedule {name!r} is not known; use ddp, bf16_hook, intra_only, compute_only, postlocal_k<k>, {GRAMMAR}"
    )


def parse_compute(text: str) -> list[str]:
    """``"cpu,accel"`` -> ``["cpu", "accel"]`` (validated, order kept, duplicates dropped)."""
    out = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
    bad = [c for c in out if c not in COMPUTE_MODELS]
    if bad or not out:
        raise ValueError(f"--compute={text!r}: use one or both of {', '.join(COMPUTE_MODELS)}")
    return out


def default_schedules() -> list[str]:
    """What the targets compare, at k=4, plus the two references (x2 compute models: ~20 runs).

    ``hiersync_p4_overlap_bf16`` (in :func:`full_schedules`) left the default when the
    streaming rows joined it, to keep the default run near its time budget.
    """
    return [
        "ddp",
        "postlocal_k4",
        "bf16_hook",
        "hiersync_p1",
        "hiersync_p4",
        "hiersync_p4_overlap",
        "hiersync_p4_stream",
        "hiersync_p4_stream_bf16",
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
        if k >= 2:
            out += [f"hiersync_p{k}_stream", f"hiersync_p{k}_stream_bf16"]
    return out + ["intra_only", "compute_only"]


def timed_steps(spec: ScheduleSpec, steps: int) -> int:
    """``steps`` rounded up to a multiple of the period, so every window holds the same syncs."""
    k = spec.period if spec.kind in ("hiersync", "postlocal") and spec.period < NEVER else 1
    return max(k, int(math.ceil(steps / k)) * k)


BURN_STEPS = 1
"""Untimed free-running steps between the attributed and the timed ones (bench_worker)."""


def run_steps(spec: ScheduleSpec, warmup: int, steps: int) -> int:
    """Every step one bench run of ``spec`` takes: warmup, attributed, burnt and timed steps."""
    return warmup + 2 * timed_steps(spec, steps) + BURN_STEPS
