"""Nodes of different speeds: the throughput of fixed and adaptive pace, and the ideal.

A node at speed ``s`` (1 = the fastest) takes ``compute_s / s`` a step. Per window:

* fixed pace (every node ``k`` steps): the window lasts ``k * compute_s / min(s)`` plus the
  sync's exposed time; every node trains ``k`` steps. The job runs at the slowest node's rate.
* adaptive pace: node ``i`` takes ``n_i`` steps (:func:`hiersync.pace.steps_per_window`, the
  runtime's own decision); the window lasts ``max(n_i * compute_s / s_i)`` plus the sync;
  the nodes train ``sum(n_i)`` steps, and the average weights each by its samples.
* DDP (and period 1): every step waits for the slowest, ``compute_s / min(s)`` plus the step's
  exposed communication.
* the ideal: the sum of each node's own rate, as if it ran alone with the same windows and
  sync, ``sum(k / (k * compute_s / s_i + sync))`` (DDP: ``sum(1 / (compute_s / s_i + exposed))``);
  without communication, ``sum(s) / N`` of the equal-speed job's (one node at 0.5x on 4 nodes:
  3.5/4).

Throughput is in node-steps of samples per second (one unit = one full step's batch of one
node). The steps to a given loss follow the samples, not the windows: a window of adaptive pace
trains ``sum(n_i) / (N k)`` of the equal-speed window's samples (:attr:`Paced.samples_per_window`),
which is what the average's weights make up for; whether a weighted window of fewer samples
converges as far per sample is measured, not modelled. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hiersync.pace import TOLERANCE, check_pace, check_positive, steps_per_window

from .links import check_count, check_number

__all__ = ["Paced", "parse_speeds", "check_speeds", "paced", "ddp_paced", "format_paced"]


@dataclass(frozen=True, kw_only=True)
class Paced:
    """One schedule's throughput on nodes of the given speeds."""

    pace: str
    """``"fixed"``, ``"adaptive"`` or ``"ddp"`` (every step waits for the slowest)."""
    steps: tuple[int, ...]
    """Inner steps each node takes a window (1 a window for DDP)."""
    window_s: float
    """Seconds a window lasts: the slowest node's steps plus the sync's exposed time."""
    samples_per_s: float
    """Node-steps trained per second, all nodes together."""
    ideal_per_s: float
    """The sum of each node's own rate (each as if alone, with the same windows and sync)."""
    samples_per_window: float
    """Node-steps per window as a fraction of the equal-speed window's (``N * k``)."""

    @property
    def of_ideal(self) -> float:
        return self.samples_per_s / self.ideal_per_s


def parse_speeds(text: str) -> list[float]:
    """``"1,1,1,0.5"`` -> ``[1.0, 1.0, 1.0, 0.5]``: one speed per node, relative to the fastest
    (``"2,2,2,1"`` is the same: divided by the largest)."""
    try:
        speeds = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"node speeds must be numbers separated by commas (e.g. 1,1,1,0.5), got {text!r}") from None
    return check_speeds(speeds)


def check_speeds(speeds: Sequence[float]) -> list[float]:
    """``speeds`` divided by the largest (the fastest node is 1); a ``ValueError`` for none or one <= 0."""
    speeds = check_positive(speeds, "node speeds (relative to the fastest, one per node, e.g. 1,1,1,0.5)")
    top = max(speeds)
    return [s / top for s in speeds]


def paced(
    speeds: Sequence[float],
    *,
    compute_s: float,
    period: int,
    sync_s: float = 0.0,
    pace: str = "adaptive",
    tolerance: float = TOLERANCE,
) -> Paced:
    """Throughput of ``period``-step windows under ``pace`` on nodes of relative ``speeds``.

    ``compute_s``: a full-speed node's step (forward, backward, update); ``sync_s``: what a window's
    sync adds to it (exposed, per window: ``period`` x the plan's exposed time per step).
    """
    speeds = check_speeds(speeds)
    c = check_number("compute_s", compute_s, strict=True)
    k = check_count("period", period)
    sync = check_number("sync_s", sync_s)
    check_pace(pace)
    step_s = [c / s for s in speeds]
    steps = steps_per_window(step_s, k, tolerance) if pace == "adaptive" else [k] * len(speeds)
    window = max(n * t for n, t in zip(steps, step_s)) + sync
    ideal = sum(k / (k * t + sync) for t in step_s)
    return Paced(
        pace=pace,
        steps=tuple(steps),
        window_s=window,
        samples_per_s=sum(steps) / window,
        ideal_per_s=ideal,
        samples_per_window=sum(steps) / (k * len(speeds)),
    )


def ddp_paced(speeds: Sequence[float], *, compute_s: float, exposed_s: float = 0.0) -> Paced:
    """DDP on nodes of relative ``speeds``: every step waits for the slowest node."""
    speeds = check_speeds(speeds)
    c = check_number("compute_s", compute_s, strict=True)
    e = check_number("exposed_s", exposed_s)
    step = c / min(speeds) + e
    return Paced(
        pace="ddp",
        steps=(1,) * len(speeds),
        window_s=step,
        samples_per_s=len(speeds) / step,
        ideal_per_s=sum(1 / (c / s + e) for s in speeds),
        samples_per_window=1.0,
    )


def format_paced(rows: Sequence[Paced], speeds: Sequence[float], period: int) -> str:
    """The table ``plan --node-speeds`` prints: each schedule's throughput against the ideal."""
    from hiersync._table import render

    label = {"ddp": "DDP", "fixed": f"k={period}, fixed pace", "adaptive": f"k={period}, adaptive pace"}
    body = [
        [
            label[r.pace],
            " ".join(map(str, r.steps)),
            f"{r.window_s * 1e3:.1f}",
            f"{r.samples_per_s:.3g}",
            f"{r.of_ideal:.3f}",
            f"{r.samples_per_window:.3f}",
        ]
        for r in rows
    ]
    head = (
        f"nodes of different speeds ({','.join(f'{s:g}' for s in speeds)}; the ideal: the sum of each node's "
        "own rate, as if it ran alone)"
    )
    table = render(
        ["schedule", "steps per node", "window ms", "node-steps/s", "x ideal", "samples/window"],
        body,
        align="llr",
        indent="  ",
    )
    lines = [head, table]
    if any(r.pace == "adaptive" for r in rows):
        lines.append(
            "  adaptive pace: hiersync.register(..., pace='adaptive'); its averages weigh each node by the samples "
            "it trained (samples/window: what a window trains against fixed pace's)"
        )
    return "\n".join(lines)
