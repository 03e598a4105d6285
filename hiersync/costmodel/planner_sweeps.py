"""What the planner tries beyond its grid: the break-even bandwidth and every ``compress`` option.

:func:`break_even_gbps` bisects the inter-node bandwidth below which hiersync helps;
:func:`compare_compress` prices each ``compress`` at the recommended configuration and
re-planned, and names the one that pays. Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hiersync import costmodel as cm
from hiersync.vocab import MiB

if TYPE_CHECKING:
    from .planner import Plan, PlanRow

__all__ = [
    "BREAK_EVEN_GAIN",
    "BREAK_EVEN_RANGE_GBPS",
    "COMPRESS_NEAR",
    "COMPRESS_COMPARED",
    "break_even_gbps",
    "compare_compress",
]

# The break-even: hiersync "helps" while its best configuration steps at least 5% faster than DDP.
BREAK_EVEN_GAIN = 1.05
BREAK_EVEN_RANGE_GBPS = (1e-3, 1e4)  # per node: 1 MB/s .. 10 TB/s
# Which compress pays: the least lossy option whose step is within 2% of the fastest's at the
# recommended configuration (fewer bits risk accuracy: every bit saved must buy time).
COMPRESS_NEAR = 1.02
COMPRESS_COMPARED = ("none", "bf16", "int8", "int4")  # fp16 sends bf16's bytes
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def compare_compress(
    plan: Plan, replan: Callable[[str], Plan]
) -> tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float, str], ...], str]:
    """(step per option at ``plan``'s recommendation, (step, schedule) per option re-planned by
    ``replan``, the option that pays)."""
    same, steps = [], []
    for option in COMPRESS_COMPARED:
        alt = replan(option)
        steps.append((option, alt.recommended.step_s, alt.recommended.schedule))
        same.append((option, _row_step(plan, option)))
    fastest = min(step for _, step in same)
    pays = next(option for option, step in same if step <= fastest * COMPRESS_NEAR)
    return tuple(same), tuple(steps), pays


def _row_step(plan: Plan, compress: str) -> float:
    """The step of the plan's recommended configuration with ``compress`` instead."""
    rec = plan.recommended
    if rec.period in (None, 1) or plan.profile.nodes == 1:
        return rec.step_s  # nothing crosses nodes compressed
    return cm.step_time(
        "hiersync", profile=plan.profile, grad_bytes=plan.grad_bytes, bucket_bytes=rec.bucket_mb * MiB,
        backward_s=plan.backward_s, compute_s=plan.compute_s, period=rec.period, fragments=rec.fragments,
        overlap=rec.overlap, placement=rec.placement,
        copy_s_per_byte=0.0 if math.isinf(plan.copy_gbps) else 1 / (plan.copy_gbps * 1e9),
        compress=None if compress == "none" else compress, param_bytes=_DTYPE_BYTES[plan.dtype],
    ).step_s  # fmt: skip


def break_even_gbps(plan: Plan, *, gain: float = BREAK_EVEN_GAIN) -> float | None:
    """Inter-node bandwidth per node (GB/s) below which hiersync helps, by bisection.

    "Helps": the fastest of the plan's hiersync configurations (every row's period, F, tau
    and placement, each at the bucket size it does best at in the plan) steps at least
    ``gain`` times faster than DDP at its best bucket size of the grid, with the inter link's
    bandwidth (all NICs of a node together) set to the candidate and its latency kept.
    Returns ``math.inf`` when it helps even at 10 TB/s, None on one node or when it does
    not help even at 1 MB/s. Precision: about 1%.
    """
    p = plan.profile
    if p.nodes == 1:
        return None
    nics = min(p.rails or p.ranks_per_node, p.ranks_per_node)
    fastest: dict[tuple, PlanRow] = {}
    for r in sorted((r for r in plan.rows if r.period), key=lambda r: r.step_s):
        fastest.setdefault((r.period, r.fragments, r.overlap, r.placement), r)
    configs = [(*key, r.bucket_mb) for key, r in fastest.items()]  # fastest first: helps() stops early
    ddp_buckets = sorted({r.bucket_mb for r in plan.rows if r.schedule == "ddp"})
    kw: dict[str, Any] = dict(
        grad_bytes=plan.grad_bytes,
        backward_s=plan.backward_s,
        compute_s=plan.compute_s,
        copy_s_per_byte=0.0 if math.isinf(plan.copy_gbps) else 1 / (plan.copy_gbps * 1e9),
    )

    def helps(node_gbps: float) -> bool:
        inter = cm.Link(p.inter.alpha, nics / (node_gbps * 1e9), p.inter.gamma)
        prof = replace(p, inter=inter)
        ddp = min(cm.step_time("ddp", profile=prof, bucket_bytes=mb * MiB, **kw).step_s for mb in ddp_buckets)
        target = ddp / gain
        for k, f, t, where, mb in configs:
            st = cm.step_time(
                "hiersync", profile=prof, bucket_bytes=mb * MiB, period=k, fragments=f, overlap=t,
                placement=where, compress=None if plan.compress == "none" else plan.compress,
                param_bytes=_DTYPE_BYTES[plan.dtype], **kw,
            )  # fmt: skip
            if st.step_s <= target:
                return True
        return False

    lo, hi = BREAK_EVEN_RANGE_GBPS
    if helps(hi):
        return math.inf
    if not helps(lo):
        return None
    for _ in range(12):  # log-space bisection: 7 decades to ~0.4%
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if helps(mid) else (lo, mid)
    return lo
