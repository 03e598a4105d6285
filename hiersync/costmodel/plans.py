"""What the planner returns: a :class:`Plan` (the table of :class:`PlanRow`, the recommendation,
the verdict and the assumptions behind them). Pure data; :mod:`.planner` makes it and
:mod:`.planner_report` prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import profile as _profile
from .memory import SyncMemory
from .planner_sweeps import StepsPenalties, StepsPenalty

__all__ = ["PlanRow", "Plan"]


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    """One schedule at one bucket size."""

    schedule: str
    """``"ddp"``, ``"hiersync k=4"``, ... or ``"intra-only"`` (the k -> infinity bound)."""
    period: int | None
    """Steps between inter-node syncs; 1 for exact schedules, None for intra-only."""
    bucket_mb: float
    """DDP ``bucket_cap_mb`` (MiB)."""
    comm_s: float
    """Communication busy time per step (hidden or not)."""
    exposed_s: float
    """Communication that lengthens the step."""
    step_s: float
    """Compute plus exposed communication."""
    speedup: float
    """Best DDP step time divided by this step time."""
    fragments: int = 1
    """Fragments of the period-k sync (streaming); 1 = the whole model at once."""
    overlap: int = 0
    """Steps between a sync's launch and its application (tau); 0 = blocking."""
    inter_bytes_peak: float = 0.0
    """Bytes one rank sends between nodes in its busiest step."""
    inter_bytes_mean: float = 0.0
    """Bytes one rank sends between nodes per step, on average."""
    placement: str | None = None
    """Where the period-k average runs (``"hook"``, ``"optimizer"``, ``"overlap"``); None for
    DDP, period 1 and intra-only."""
    penalty: StepsPenalty | None = None
    """Steps to DDP's loss as x DDP's steps at this row's period (``--steps-penalty``); None:
    not given, or intra-only (k -> infinity)."""

    @property
    def to_loss_s(self) -> float:
        """Predicted wall-clock to DDP's loss per DDP step: step time x steps penalty (step time without one)."""
        return self.step_s * (self.penalty.value if self.penalty else 1.0)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's table, recommendation, verdict and the assumptions behind them."""

    profile: _profile.Profile
    """Profile with the planned topology (nodes, ranks per node)."""
    params: float
    """Parameter count."""
    dtype: str
    """Gradient (= parameter) dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``."""
    grad_bytes: float
    """Bytes of gradients (= parameters) per rank."""
    backward_s: float
    """Backward compute time per step."""
    compute_s: float
    """Compute time per step (forward + backward + optimizer)."""
    compress: str
    """``"none"``, ``"bf16"`` or ``"fp16"``: the inter-node sync leg's dtype."""
    compress_ratio: float
    """Bytes sent per byte of parameters on the inter-node sync leg."""
    placement: str
    """Where the whole-model period-k rows average: ``"hook"``, ``"optimizer"`` or ``"overlap"``."""
    copy_gbps: float
    """Speed of the sync's launch copies (GB/s) the rows assume."""
    copy_source: str
    """Where :attr:`copy_gbps` comes from (the flag, the profile, or an assumption)."""
    warmup_steps: int
    """``warmup_steps`` of the pasted call (not modelled)."""
    rows: tuple[PlanRow, ...]
    """Every schedule x bucket size."""
    best_ddp: PlanRow
    """Fastest DDP row."""
    recommended: PlanRow
    """Row to use: the smallest period within 5% of the best step time, or with a steps penalty
    of the best predicted wall-clock to DDP's loss (:attr:`PlanRow.to_loss_s`)."""
    flat_allreduce_s: float
    """Flat all-reduce of the whole gradient as one message (bandwidth view)."""
    intra_allreduce_s: float
    """Intra-node all-reduce of the whole gradient as one message."""
    inter_bound_s: float
    """Physical lower bound of one inter-node sync: 2(N-1)/N * n bytes through the node's NICs."""
    step_cap: float
    """Best DDP step / best intra-only step: the most any period can gain."""
    helps: bool
    """Whether hierarchical sync can make steps at least ``HELPS_MUCH`` times faster."""
    verdict: str
    """Plain-language statement with the numbers behind it."""
    warnings: tuple[str, ...] = ()
    """Cautions: a best k, bucket size, F or tau at the edge of the searched grid; links
    calibrated on fewer or more nodes than planned."""
    break_even_gbps: float | None = None
    """Inter-node bandwidth per node (GB/s) below which hiersync's best configuration steps
    at least ``BREAK_EVEN_GAIN`` times faster than DDP; inf: at any bandwidth; None: one node,
    or not even at 1 MB/s."""
    memory: SyncMemory | None = None
    """Extra GPU memory per rank of the recommendation (:func:`.memory.sync_memory`)."""
    collectives: str = ""
    """The collective algorithms the model assumed, in words."""
    calibrated_nodes: int | None = None
    """Nodes the profile's links were measured on (None: a preset or flags)."""
    compress_same: tuple[tuple[str, float], ...] = ()
    """(compress, step s) for every option at the recommended configuration; () when not compared."""
    compress_steps: tuple[tuple[str, float, str], ...] = ()
    """(compress, recommended step s, its schedule) for every option, each re-planned (its own k, F, tau)."""
    compress_pays: str | None = None
    """The option to use: the least lossy one within :data:`COMPRESS_NEAR` of the fastest at the
    recommended configuration."""
    steps_penalty: StepsPenalties | None = None
    """The steps penalties the ranking priced; None: it ranked by step time alone."""
    by_step: PlanRow | None = None
    """What step time alone would recommend (the same row as :attr:`recommended` without a penalty)."""
    held_back: PlanRow | None = None
    """The row that might reach DDP's loss soonest, sooner than :attr:`recommended`, but whose penalty
    is extrapolated, or only a lower bound (its period did not reach DDP's loss in the measurement),
    so it is not recommended; None if none."""

    @property
    def bucket_cap_mb(self) -> float:
        return self.recommended.bucket_mb

    @property
    def period(self) -> int:
        return self.recommended.period or 1

    @property
    def fragments(self) -> int:
        """``HierState(fragments=...)`` of the recommendation (1: no streaming)."""
        return self.recommended.fragments

    @property
    def overlap(self) -> int:
        """``HierState(overlap=...)`` of the recommendation (0: blocking)."""
        return self.recommended.overlap

    @property
    def use_hiersync(self) -> bool:
        return self.recommended.schedule != "ddp"

    @property
    def comm_cap(self) -> float:
        """Flat / intra all-reduce time: the most k -> infinity can shrink communication."""
        return self.flat_allreduce_s / self.intra_allreduce_s if self.intra_allreduce_s > 0 else math.inf
