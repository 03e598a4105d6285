"""Failure-aware planning: interruptions at this size, the checkpoint interval, and goodput.

Nodes fail independently at a constant rate, once per ``node_mtbf_hours`` each (exponential
lifetimes). On N nodes the job is interrupted at N times that rate: the job's MTBF is
``M = node MTBF / N``, and the chance of at least one interruption in a day is
``1 - (1 - p)^N`` with ``p = 1 - exp(-24 h / node MTBF)`` the chance for one node, which is
``1 - exp(-24 N / node MTBF)``.

Two ways to live with it (:func:`failure_plan`):

* **Restart from a checkpoint** (every rank restarts; what torchrun does): checkpoints of
  ``checkpoint_s`` every tau seconds of work, ``restart_s`` to come back. Daly's interval
  (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
  dumps", FGCS 2006; Young's sqrt(2 delta M) to first order) minimises the expected wall
  time, and the goodput (useful work / wall time) at that interval is Daly's exact expression
  for exponential failures: ``tau / (M e^(R/M) (e^((tau + delta)/M) - 1))``.
* **Survive in place** (hiersync on torchft): the survivors go on. A failure costs the whole job
  ``detect_s`` (the survivors' next quorum waits for the dead node's heartbeat to expire, the
  contact bound of ``register(..., heartbeat_timeout=)``: 5 s, torchft's default; a node that
  freezes inside a window's data costs the collective timeout instead), and the dead node's
  share of the job for its lost window (the steps since its last sync, a whole window at most),
  its restart and a joiner's recovery from a live peer:
  ``detect_s + (window_s + restart_s + recovery_s) / N`` seconds of the whole job per failure,
  so goodput ``1 - (N detect_s + window_s + restart_s + recovery_s) / node MTBF``: the cost of
  a failure no longer grows with the job.

Default MTBF: Meta's Llama 3 run had 419 unexpected interruptions in 54 days on 16,384 H100s
(2,048 nodes of 8): one per ~6,300 node-hours (:data:`LLAMA3_NODE_MTBF_HOURS`). Pure: no torch.

Example::

    >>> fp = failure_plan(nodes=1024, checkpoint_s=60, restart_s=600, detect_s=60, window_s=4, recovery_s=10)
    >>> round(fp.interruptions_per_day, 1), round(fp.goodput_restart, 3), round(fp.goodput_in_place, 3)
    (3.9, 0.904, 0.997)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .links import check_count, check_number

__all__ = [
    "LLAMA3_NODE_MTBF_HOURS",
    "FailurePlan",
    "daly_interval",
    "restart_goodput",
    "failure_plan",
    "format_failures",
]

LLAMA3_NODE_MTBF_HOURS = 16384 / 8 * 54 * 24 / 419
"""Node-hours per unexpected interruption in Llama 3's pre-training (Table 5 of the paper:
419 in 54 days on 16,384 H100s = 2,048 nodes): ~6,335."""
DEFAULT_CHECKPOINT_S = 60.0
"""Seconds to write one checkpoint (assumed: a few GB per GPU to a parallel file system)."""
DEFAULT_RESTART_S = 600.0
"""Seconds from a failure to training again after a restart (assumed: rescheduling, process
start, NCCL init and loading the checkpoint)."""
DEFAULT_DETECT_S = 5.0
"""Seconds the survivors wait before the quorum drops a dead node: the Lighthouse's heartbeat timeout,
hiersync's contact bound (``hiersync.transport.HEARTBEAT_TIMEOUT_S``; docs/fault-tolerance.md measured
a survivor's stall per fault at p50 4.8-5.1 s at docs/cluster.md's settings)."""


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's optimum seconds of work between checkpoints for a job MTBF ``mtbf_s``.

    ``sqrt(2 d M) (1 + sqrt(d / 2M) / 3 + d / 18M) - d`` while ``d < 2M``, else ``M``.
    """
    d = check_number("checkpoint_s", checkpoint_s)
    m = check_number("mtbf_s", mtbf_s, strict=True)
    if d >= 2 * m:
        return m
    return math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d


def restart_goodput(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful work / wall time when restarting from checkpoints every ``interval_s`` of work (Daly)."""
    tau = check_number("interval_s", interval_s, strict=True)
    d, r = check_number("checkpoint_s", checkpoint_s), check_number("restart_s", restart_s)
    m = check_number("mtbf_s", mtbf_s, strict=True)
    exponent = (tau + d) / m + r / m
    if exponent > 700:  # the job never finishes a checkpoint interval
        return 0.0
    return tau / (m * math.exp(r / m) * math.expm1((tau + d) / m))


@dataclass(frozen=True, kw_only=True)
class FailurePlan:
    """What failures cost a job of ``nodes`` nodes (see the module docstring)."""

    nodes: int
    node_mtbf_hours: float
    job_mtbf_s: float
    interruptions_per_day: float
    """Expected interruptions per day: 24 N / node MTBF."""
    p_interrupted_day: float
    """Chance of at least one interruption in a day: 1 - (1 - p)^N."""
    checkpoint_s: float
    restart_s: float
    interval_s: float
    """Daly's optimum seconds of work between checkpoints."""
    goodput_restart: float
    """Useful work / wall time, restarting from checkpoints at :attr:`interval_s`."""
    in_place_cost_s: float
    """Seconds of the whole job one failure costs when the survivors go on."""
    goodput_in_place: float
    """Useful work / wall time when the survivors go on (hiersync on torchft)."""
    window_s: float
    recovery_s: float
    detect_s: float


def failure_plan(
    *,
    nodes: int,
    node_mtbf_hours: float = LLAMA3_NODE_MTBF_HOURS,
    checkpoint_s: float = DEFAULT_CHECKPOINT_S,
    restart_s: float = DEFAULT_RESTART_S,
    detect_s: float = DEFAULT_DETECT_S,
    window_s: float = 0.0,
    recovery_s: float = 0.0,
) -> FailurePlan:
    """Interruptions, Daly's checkpoint interval and both goodputs for ``nodes`` nodes.

    ``window_s``: the work a dead node loses (its steps since its last sync: one window of k
    steps at most); ``recovery_s``: a joiner's recovery of its state from a live peer.
    """
    n = check_count("nodes", nodes)
    mtbf_h = check_number("node_mtbf_hours", node_mtbf_hours, strict=True)
    d, r = check_number("checkpoint_s", checkpoint_s), check_number("restart_s", restart_s)
    detect, window = check_number("detect_s", detect_s), check_number("window_s", window_s)
    recovery = check_number("recovery_s", recovery_s)
    job_mtbf = mtbf_h * 3600 / n
    p_node_day = -math.expm1(-24 / mtbf_h)
    interval = daly_interval(d, job_mtbf)
    cost = detect + (window + r + recovery) / n
    return FailurePlan(
        nodes=n,
        node_mtbf_hours=mtbf_h,
        job_mtbf_s=job_mtbf,
        interruptions_per_day=24 * n / mtbf_h,
        p_interrupted_day=1 - (1 - p_node_day) ** n,
        checkpoint_s=d,
        restart_s=r,
        interval_s=interval,
        goodput_restart=restart_goodput(interval, d, r, job_mtbf) if interval > 0 else 0.0,
        in_place_cost_s=cost,
        goodput_in_place=max(0.0, 1 - cost / job_mtbf),
        window_s=window,
        recovery_s=recovery,
        detect_s=detect,
    )


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:,.1f} s"
    if seconds < 120:
        return f"{seconds:,.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def format_failures(fp: FailurePlan, *, mtbf_source: str) -> list[str]:
    """The plan's failure lines."""
    return [
        f"failures: node MTBF {fp.node_mtbf_hours:,.0f} h ({mtbf_source}); {fp.nodes} nodes: "
        f"{fp.interruptions_per_day:.2f} interruptions per day expected (24 N / MTBF; P(>= 1 in a day) = "
        f"1 - (1 - p)^N = {fp.p_interrupted_day:.0%}), one every {_duration(fp.job_mtbf_s)}",
        f"  restart from a checkpoint ({_duration(fp.checkpoint_s)} to write, {_duration(fp.restart_s)} to restart, "
        f"every rank): Young/Daly interval {_duration(fp.interval_s)} of work between checkpoints, goodput "
        f"{fp.goodput_restart:.2%}",
        f"  survive in place (hiersync on torchft): a failure costs the job {_duration(fp.in_place_cost_s)} "
        f"({_duration(fp.detect_s)} heartbeat timeout for all, plus 1/{fp.nodes} of: the dead node's window "
        f"{_duration(fp.window_s)} + its restart {_duration(fp.restart_s)} + a joiner's recovery from a live peer "
        f"{_duration(fp.recovery_s)}): goodput {fp.goodput_in_place:.2%}",
    ]
