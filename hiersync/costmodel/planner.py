"""``python -m hiersync plan``: predict step communication per schedule and bucket size.

Pure functions first (:func:`make_plan` returns a :class:`Plan` that tests can check),
text formatting second (:func:`format_plan`), the command last. The numbers come from
:mod:`hiersync.costmodel` with a calibrated profile (``--profile``) or a preset.

Example::

    python -m hiersync plan --preset a100-1nic --params 7e9 --dtype bf16 \\
        --nodes 16 --gpus-per-node 8 --backward-ms 300

    >>> from hiersync.costmodel import PRESETS
    >>> plan = make_plan(PRESETS["a100-1nic"], params=7e9, backward_s=0.3)
    >>> plan.helps, plan.period > 1, plan.fragments >= 1, plan.overlap >= 0
    (True, True, True, True)
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hiersync import costmodel as cm
from hiersync.vocab import COMPRESS_DTYPES, MiB

__all__ = [
    "PlanRow",
    "Plan",
    "make_plan",
    "format_plan",
    "add_arguments",
    "add_profile_arguments",
    "load_profile",
    "run",
    "DTYPE_BYTES",
]

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# "Helps much" means at least 2x faster steps at the k -> infinity limit. Below that the
# gain is bounded by what never syncing across nodes would give, and a finite k that keeps
# accuracy gets less still: not worth the drift for most jobs.
HELPS_MUCH = 2.0
# Recommend the smallest period within 5% of the best step time: larger k costs accuracy.
NEAR_BEST = 1.05
DEFAULT_BUCKET_MB = 25.0  # DDP's bucket_cap_mb default; preferred when times tie
# Streaming grid (HierState(period=k, fragments=F, overlap=tau)): F <= 2k, tau <= k - 1.
# Within 5% of the fastest, the smallest tau wins (a stale average costs accuracy).
DEFAULT_FRAGMENTS = (1, 2, 4, 8)
DEFAULT_OVERLAPS = (0, 1, 2)


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


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's table, recommendation and verdict."""

    profile: cm.Profile
    """Profile with the planned topology (nodes, ranks per node)."""
    grad_bytes: float
    """Bytes of gradients (= parameters) per rank."""
    backward_s: float
    """Backward compute time per step."""
    compute_s: float
    """Compute time per step (forward + backward)."""
    compress_ratio: float
    """Bytes sent per byte of parameters on the inter-node sync leg."""
    placement: str
    """Where period-k averaging runs: ``"hook"``, ``"optimizer"`` or ``"overlap"``."""
    rows: tuple[PlanRow, ...]
    """Every schedule x bucket size."""
    best_ddp: PlanRow
    """Fastest DDP row."""
    recommended: PlanRow
    """Row to use: the smallest period within 5% of the best step time."""
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


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def _nics(count: int) -> str:
    return f"{count} NIC" if count == 1 else f"{count} NICs"


def _verdict(
    profile: cm.Profile,
    best_ddp: PlanRow,
    best_intra: PlanRow,
    rec: PlanRow,
    flat_s: float,
    intra_s: float,
    step_cap: float,
    backward_s: float,
) -> tuple[bool, str]:
    if profile.nodes == 1:
        return False, "one node: there is no inter-node traffic to save; use plain DDP."
    share = intra_s / flat_s if flat_s > 0 else 1.0
    hidden = 1.0 - best_ddp.exposed_s / best_ddp.comm_s if best_ddp.comm_s > 0 else 1.0
    numbers = (
        f"the intra-node all-reduce of the whole gradient alone takes {_ms(intra_s)}, {share:.0%} of the flat "
        f"all-reduce's {_ms(flat_s)}, so never syncing across nodes shrinks communication by at most "
        f"{1 / share:.2f}x; DDP (bucket {best_ddp.bucket_mb:g} MB) hides {hidden:.0%} of its "
        f"{_ms(best_ddp.comm_s)} of communication behind the {_ms(backward_s)} backward, and the k -> inf "
        f"step is {_ms(best_intra.step_s)} vs DDP's {_ms(best_ddp.step_s)} ({step_cap:.2f}x)."
    )
    if step_cap < HELPS_MUCH:
        return False, f"hierarchical sync cannot help much here (at most {step_cap:.2f}x faster steps): {numbers}"
    return True, (
        f"hierarchical sync helps: {rec.schedule} cuts the step from {_ms(best_ddp.step_s)} to "
        f"{_ms(rec.step_s)} ({rec.speedup:.2f}x); {numbers}"
    )


def make_plan(
    profile: cm.Profile,
    *,
    params: float,
    backward_s: float,
    dtype: str = "bf16",
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    compute_s: float | None = None,
    periods: Sequence[int] = (1, 2, 4, 8),
    bucket_mb: Sequence[float] = (1, 5, 25, 100),
    compress: str = "none",
    placement: str = "hook",
    fragments: Sequence[int] = DEFAULT_FRAGMENTS,
    overlaps: Sequence[int] = DEFAULT_OVERLAPS,
    copy_s_per_byte: float = cm.DEFAULT_COPY_S_PER_BYTE,
) -> Plan:
    """Model every schedule x bucket size and pick the bucket size, period and streaming to use.

    ``params`` is the parameter count (gradients are ``params * bytes(dtype)``);
    ``compress="bf16"`` halves fp32 sync traffic (no effect on 16-bit parameters).
    ``placement``: where the whole-model period-k rows average. For every period k > 1
    and bucket size the planner also searches streaming, ``HierState(period=k,
    fragments=F, overlap=tau)`` for F in ``fragments`` with F <= 2k and tau in
    ``overlaps`` with tau <= k - 1, and adds the row it prefers: within 5% of the
    fastest, the smallest tau. ``fragments=()`` searches no streaming. ``copy_s_per_byte``:
    see :func:`hiersync.costmodel.step_time`.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    if compress not in ("none", *COMPRESS_DTYPES):
        raise ValueError(f"unknown compress {compress!r}; valid: none, bf16, fp16")
    if not periods or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in periods):
        raise ValueError(f"periods must be ints >= 1, got {list(periods)}")
    if not bucket_mb or any(not b > 0 for b in bucket_mb):
        raise ValueError(f"bucket sizes must be > 0 MB, got {list(bucket_mb)}")
    if not params > 0:
        raise ValueError(f"params must be > 0, got {params!r}")
    if any(isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in fragments):
        raise ValueError(f"fragments must be ints >= 1 (1 = whole model), got {list(fragments)}")
    if fragments and (not overlaps or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in overlaps)):
        raise ValueError(f"overlaps must be ints >= 0 (0 = blocking), got {list(overlaps)}; e.g. overlaps=(0, 1, 2)")
    profile = replace(
        profile,
        nodes=profile.nodes if nodes is None else nodes,
        ranks_per_node=profile.ranks_per_node if gpus_per_node is None else gpus_per_node,
    )
    grad_bytes = float(params) * DTYPE_BYTES[dtype]
    ratio = 1.0 if compress == "none" else min(1.0, 2 / DTYPE_BYTES[dtype])
    compute = backward_s if compute_s is None else compute_s
    periods = sorted(set(periods))
    common: dict[str, Any] = dict(profile=profile, grad_bytes=grad_bytes, backward_s=backward_s, compute_s=compute)

    raw: list[tuple[str, int | None, float, cm.StepTime]] = []
    for mb in bucket_mb:
        kw: dict[str, Any] = dict(common, bucket_bytes=mb * MiB)
        raw.append(("ddp", 1, mb, cm.step_time("ddp", **kw)))
        for k in periods:
            st = cm.step_time("hiersync", period=k, compress_ratio=ratio, placement=placement, **kw)
            raw.append((st.label, k, mb, st))
        for k in periods:
            if k > 1 and profile.nodes > 1 and fragments:
                st = _streaming(k, fragments, overlaps, dict(kw, compress_ratio=ratio, copy_s_per_byte=copy_s_per_byte))
                raw.append((f"hiersync k={k} F={st.fragments} tau={st.overlap}", k, mb, st))
        raw.append(("intra-only", None, mb, cm.step_time("intra_only", **kw)))
    best_ddp_step = min(st.step_s for name, _, _, st in raw if name == "ddp")
    rows = tuple(
        PlanRow(
            schedule=name,
            period=k,
            bucket_mb=mb,
            comm_s=st.comm_s,
            exposed_s=st.exposed_s,
            step_s=st.step_s,
            speedup=best_ddp_step / st.step_s,
            fragments=st.fragments,
            overlap=st.overlap,
            inter_bytes_peak=st.inter_bytes_peak,
            inter_bytes_mean=st.inter_bytes_mean,
        )
        for name, k, mb, st in raw
    )

    def best(candidates: Sequence[PlanRow]) -> PlanRow:
        return min(candidates, key=lambda r: (r.step_s, abs(math.log(r.bucket_mb / DEFAULT_BUCKET_MB))))

    best_ddp = best([r for r in rows if r.schedule == "ddp"])
    best_intra = best([r for r in rows if r.period is None])
    usable = [r for r in rows if r.period is not None]
    target = min(r.step_s for r in usable) * NEAR_BEST
    period = min(r.period for r in usable if r.period is not None and r.step_s <= target)
    # at that period: the smallest overlap within reach, then the fastest
    near = [r for r in usable if r.period == period and r.step_s <= target]
    recommended = min(near, key=lambda r: (r.overlap, r.step_s, abs(math.log(r.bucket_mb / DEFAULT_BUCKET_MB))))

    algo, eta = profile.flat_algorithm, profile.tree_efficiency
    links = (profile.intra, profile.inter, profile.rails)
    flat_s = cm.flat_allreduce_time(grad_bytes, profile.nodes, profile.ranks_per_node, *links, algo, efficiency=eta)
    intra_s = cm.allreduce_time("ring", profile.ranks_per_node, grad_bytes, profile.intra)
    rails = min(profile.rails or profile.ranks_per_node, profile.ranks_per_node)
    n = profile.nodes
    inter_bound = 2 * (n - 1) / n * grad_bytes * ratio * profile.inter.beta / rails
    step_cap = best_ddp.step_s / best_intra.step_s
    helps, verdict = _verdict(profile, best_ddp, best_intra, recommended, flat_s, intra_s, step_cap, backward_s)
    logger.debug("plan: %d rows, recommended %s at %g MB", len(rows), recommended.schedule, recommended.bucket_mb)
    return Plan(
        profile=profile,
        grad_bytes=grad_bytes,
        backward_s=backward_s,
        compute_s=compute,
        compress_ratio=ratio,
        placement=placement,
        rows=rows,
        best_ddp=best_ddp,
        recommended=recommended,
        flat_allreduce_s=flat_s,
        intra_allreduce_s=intra_s,
        inter_bound_s=inter_bound,
        step_cap=step_cap,
        helps=helps,
        verdict=verdict,
    )


def _streaming(k: int, fragments: Sequence[int], overlaps: Sequence[int], kw: dict[str, Any]) -> cm.StepTime:
    """The preferred streaming step at period ``k``: within 5% of the fastest, the smallest tau."""
    grid = [
        cm.step_time("hiersync", period=k, fragments=f, overlap=t, placement="overlap" if t else "optimizer", **kw)
        for f in sorted(set(fragments))
        if f <= 2 * k
        for t in sorted(set(overlaps))
        if t <= k - 1
    ]
    if not grid:  # every F > 2k or every tau > k - 1: the nearest point
        f, t = min(fragments), min(min(overlaps), k - 1)
        grid = [
            cm.step_time("hiersync", period=k, fragments=f, overlap=t, placement="overlap" if t else "optimizer", **kw)
        ]
    target = min(st.step_s for st in grid) * NEAR_BEST
    return min((st for st in grid if st.step_s <= target), key=lambda st: (st.overlap, st.step_s, st.fragments))


def _hierstate(plan: Plan) -> str:
    """The ``HierState`` call of the recommendation."""
    rec = plan.recommended
    if rec.period == 1:
        return "HierState(period=1)"
    args = f"period={rec.period}"
    if rec.fragments > 1:
        args += f", fragments={rec.fragments}"
    if rec.overlap:
        args += f", overlap={rec.overlap}"
    after_step = rec.fragments > 1 or rec.overlap > 0 or plan.placement != "hook"
    return f"HierState({args})" + (" + state.attach_optimizer(optimizer)" if after_step else "")


def format_plan(plan: Plan) -> str:
    """The plan as a fixed-width text table with a recommendation and a verdict."""
    p = plan.profile
    rails = p.rails or p.ranks_per_node
    lines = [
        f"profile {p.name or '(unnamed)'} [{p.backend}]: {p.nodes} nodes x {p.ranks_per_node} GPUs "
        f"= {p.nodes * p.ranks_per_node} ranks; gradients {plan.grad_bytes / 1e9:,.2f} GB; "
        f"backward {_ms(plan.backward_s)}, compute {_ms(plan.compute_s)}",
        f"links: intra {p.intra.alpha * 1e6:g} us, {p.intra.bandwidth / 1e9:,.3g} GB/s per GPU; "
        f"inter {p.inter.alpha * 1e6:g} us, {p.inter.bandwidth / 1e9:,.3g} GB/s per NIC x {_nics(rails)}; "
        f"flat all-reduce: {p.flat_algorithm}; sync placement: {plan.placement}; "
        f"sync bytes x{plan.compress_ratio:g}",
        "",
        f"{'schedule':<26} {'bucket_MB':>9} {'comm_ms':>11} {'exposed_ms':>11} {'step_ms':>11} {'speedup':>8} "
        f"{'peak_inter_MB':>13}",
    ]
    for r in plan.rows:
        mark = "  <- recommended" if r is plan.recommended else ""
        lines.append(
            f"{r.schedule:<26} {r.bucket_mb:>9g} {r.comm_s * 1e3:>11,.1f} {r.exposed_s * 1e3:>11,.1f} "
            f"{r.step_s * 1e3:>11,.1f} {r.speedup:>7.2f}x {r.inter_bytes_peak / MiB:>13,.1f}{mark}"
        )
    rec = plan.recommended
    if not plan.use_hiersync:
        how = "plain DDP (exact all-reduce)"
    elif rec.period == 1:
        how = "hiersync period=1 (exact two-level all-reduce)"
    else:
        where = "after optimizer.step()" if rec.fragments > 1 or rec.overlap else f"placement {plan.placement}"
        how = f"hiersync period={rec.period}, fragments={rec.fragments}, overlap={rec.overlap} ({where})"
    lines += [
        "",
        f"recommend: bucket_cap_mb={plan.bucket_cap_mb:g}, {how}: step {_ms(rec.step_s)}, "
        f"{rec.speedup:.2f}x vs best DDP ({_ms(plan.best_ddp.step_s)} at {plan.best_ddp.bucket_mb:g} MB); "
        f"peak {rec.inter_bytes_peak / MiB:,.1f} MB between nodes per rank per step (DDP "
        f"{plan.best_ddp.inter_bytes_peak / MiB:,.1f} MB)" + (f"; {_hierstate(plan)}" if plan.use_hiersync else ""),
        "peak_inter_MB: bytes one rank sends between nodes in its busiest step (MiB); streaming rows "
        "(F fragments, applied tau steps after launch) run after optimizer.step()",
        f"bound: one inter-node sync moves >= 2(N-1)/N * n bytes per node through "
        f"{_nics(min(rails, p.ranks_per_node))}: >= {_ms(plan.inter_bound_s)}",
        f"verdict: {plan.verdict}",
    ]
    return "\n".join(lines)


def _list(kind: type, text: str) -> list:
    try:
        values = [kind(float(v)) if kind is int else kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {text!r}")
    return values


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", metavar="P.json", help="calibrated profile (python -m hiersync calibrate)")
    src.add_argument("--preset", choices=sorted(cm.PRESETS), help="published hardware numbers (docs/costmodel.md)")


def load_profile(args: argparse.Namespace) -> cm.Profile:
    return cm.Profile.load(args.profile) if args.profile else cm.get_preset(args.preset)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7e9")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="gradient dtype (default bf16)")
    parser.add_argument("--nodes", type=int, help="nodes (default: the profile's)")
    parser.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the profile's)")
    parser.add_argument("--backward-ms", type=float, required=True, help="backward compute time per step")
    parser.add_argument("--forward-ms", type=float, default=0.0, help="other compute per step (default 0)")
    parser.add_argument("--periods", type=lambda s: _list(int, s), default=[1, 2, 4, 8], help="default 1,2,4,8")
    parser.add_argument(
        "--bucket-mb",
        type=lambda s: _list(float, s),
        default=[1, 5, 25, 100],
        help="DDP bucket_cap_mb values (default 1,5,25,100)",
    )
    parser.add_argument(
        "--compress",
        choices=["none", *COMPRESS_DTYPES],
        default="none",
        help="16-bit deltas on the inter-node sync leg (default none)",
    )
    parser.add_argument(
        "--placement", choices=list(cm.PLACEMENTS), default="hook", help="where period-k averaging runs (default hook)"
    )
    parser.add_argument(
        "--fragments",
        type=lambda s: _list(int, s),
        default=list(DEFAULT_FRAGMENTS),
        help="streaming fragments F to search, F <= 2k (default 1,2,4,8; 0 = no streaming)",
    )
    parser.add_argument(
        "--overlap",
        type=lambda s: _list(int, s),
        default=list(DEFAULT_OVERLAPS),
        help="streaming overlaps tau to search, tau <= k-1 (default 0,1,2)",
    )
    parser.add_argument(
        "--copy-gbps",
        type=float,
        default=0.0,
        help="speed of the sync's launch copies in GB/s (default 0 = copies free; e.g. 1500 for H100 HBM)",
    )


def copy_s_per_byte(gbps: float) -> float:
    """``--copy-gbps`` as seconds per byte; 0 means copies are free."""
    if not gbps >= 0:
        raise ValueError(f"--copy-gbps must be >= 0 (0 = copies free), got {gbps!r}")
    return 1 / (gbps * 1e9) if gbps > 0 else 0.0


def run(args: argparse.Namespace) -> int:
    plan = make_plan(
        load_profile(args),
        params=args.params,
        dtype=args.dtype,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        backward_s=args.backward_ms / 1e3,
        compute_s=(args.backward_ms + args.forward_ms) / 1e3,
        periods=args.periods,
        bucket_mb=args.bucket_mb,
        compress=args.compress,
        placement=args.placement,
        fragments=[f for f in args.fragments if f != 0],
        overlaps=args.overlap,
        copy_s_per_byte=copy_s_per_byte(args.copy_gbps),
    )
    print(format_plan(plan))
    return 0
