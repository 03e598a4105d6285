"""``python -m hiersync plan``: predict step communication per schedule and bucket size.

Pure functions first (:func:`make_plan` returns a :class:`Plan` that tests can check),
text formatting in :mod:`.planner_report` (:func:`format_plan`), the command in
:mod:`.planner_cli`. The numbers come from :mod:`hiersync.costmodel` with a calibrated
profile (``--profile``), a preset, or links described by flags (``--inter-gbps`` ...).

Example::

    python -m hiersync plan --preset a100-1nic --params 7e9 \\
        --nodes 16 --gpus-per-node 8 --backward-ms 300 --forward-ms 150

    >>> from hiersync.costmodel import PRESETS
    >>> plan = make_plan(PRESETS["a100-1nic"], params=7e9, backward_s=0.3, forward_s=0.15)
    >>> plan.helps, plan.period > 1, plan.fragments >= 1, plan.overlap >= 0
    (True, True, True, True)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hiersync import costmodel as cm
from hiersync.vocab import MiB

from . import compression, planner_sweeps
from .memory import sync_memory
from .planner_report import collectives_assumed, edge_warnings, format_plan, verdict
from .planner_sweeps import (
    COMPRESS_NEAR,
    NEAR_BEST,
    StepsPenalties,
    break_even_gbps,
    rank_by_time_to_loss,
    read_steps_penalty,
    smallest_near_best,
)
from .plans import Plan, PlanRow

__all__ = [
    "PlanRow",
    "Plan",
    "make_plan",
    "break_even_gbps",
    "format_plan",
    "DTYPE_BYTES",
    "copy_s_per_byte",
    "check_compute",
    "compress_ratio_for",
    "copy_speed",
    "COMPRESS_NEAR",
    "NEAR_BEST",
    "StepsPenalties",
    "read_steps_penalty",
]

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# "Helps much" means at least 2x faster steps at the k -> infinity limit. Below that the
# gain is bounded by what never syncing across nodes would give, and a finite k that keeps
# accuracy gets less still: not worth the drift for most jobs.
HELPS_MUCH = 2.0
DEFAULT_BUCKET_MB = 25.0  # DDP's bucket_cap_mb default; preferred when times tie
# Streaming grid (HierState(period=k, fragments=F, overlap=tau)): F <= 2k, tau <= k - 1.
# Within 5% of the fastest, the smallest tau wins (a stale average costs accuracy).
DEFAULT_FRAGMENTS = (1, 2, 4, 8)
DEFAULT_OVERLAPS = (0, 1, 2)
DEFAULT_WARMUP_STEPS = 100  # docs/local-sgd.md's starting point; not modelled


def _ints(name: str, values: Sequence[int], low: int, hint: str = "") -> None:
    if any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
        raise ValueError(f"{name} must be ints >= {low}{hint}, got {list(values)}")


def check_compute(
    profile: cm.Profile, backward_s: float | None, forward_s: float | None, compute_s: float | None
) -> tuple[float, float]:
    """(backward, compute) seconds from the arguments or the profile; ValueError naming the flag."""
    backward = profile.backward_s if backward_s is None else backward_s
    if backward is None or not backward > 0:
        raise ValueError(
            f"the backward time per step is required (got {backward!r}): pass --backward-ms (backward_s=), or a "
            f"profile that records backward_s; without compute time every speed-up is inflated"
        )
    if compute_s is not None:
        if not compute_s >= backward:
            raise ValueError(f"compute_s={compute_s!r} must be >= backward_s={backward!r} (it includes the backward)")
        return float(backward), float(compute_s)
    forward = profile.forward_s if forward_s is None else forward_s
    if forward is None or not forward > 0:
        raise ValueError(
            f"the forward (+ optimizer) time per step is required and must be > 0 (got {forward!r}): pass "
            f"--forward-ms (forward_s=), or a profile that records forward_s; --forward-ms 0 prices a step "
            f"without a forward pass, which hides less communication and inflates the speed-ups"
        )
    return float(backward), float(backward + forward)


def compress_ratio_for(compress: str, dtype: str) -> float:
    """Bytes sent per byte of parameters on the inter-node sync leg (:func:`~.compression.compress_ratio`)."""
    return compression.compress_ratio(compression.check_compress(compress), DTYPE_BYTES[dtype])


def copy_speed(profile: cm.Profile, copy_s: float | None) -> tuple[float, str]:
    """(seconds per byte, where it comes from) of the launch copies."""
    if copy_s is not None:
        gbps = 1 / copy_s / 1e9 if copy_s > 0 else math.inf
        return copy_s, "given (copies free)" if copy_s == 0 else f"given ({gbps:,.4g} GB/s)"
    if profile.copy_gbps is not None:
        return 1 / (profile.copy_gbps * 1e9), f"the profile's ({profile.copy_gbps:,.4g} GB/s)"
    gbps = cm.default_copy_gbps(profile.backend)
    kind = "an A100-class GPU" if "nccl" in profile.backend.lower() else "a CPU memcpy"
    return 1 / (gbps * 1e9), f"assumed {gbps:,.4g} GB/s ({kind}; set --copy-gbps)"


def make_plan(
    profile: cm.Profile,
    *,
    params: float,
    backward_s: float | None = None,
    forward_s: float | None = None,
    compute_s: float | None = None,
    dtype: str = "fp32",
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    periods: Sequence[int] = (1, 2, 4, 8),
    bucket_mb: Sequence[float] = (1, 5, 25, 100),
    compress: str = "none",
    placement: str = "hook",
    fragments: Sequence[int] = DEFAULT_FRAGMENTS,
    overlaps: Sequence[int] = DEFAULT_OVERLAPS,
    copy_s_per_byte: float | None = None,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    break_even: bool = True,
    compare_compress: bool = False,
    steps_penalty: StepsPenalties | str | None = None,
) -> Plan:
    """Model every schedule x bucket size and pick the bucket size, period and streaming to use.

    ``params`` is the parameter count (gradients are ``params * bytes(dtype)``; ``dtype``
    is the parameters', fp32 by default: under autocast the gradients are still fp32).
    Compute time is required: ``backward_s`` and ``forward_s`` (forward + optimizer), or
    ``compute_s`` (the whole step's compute), or a profile that records them;
    ``ValueError`` names the missing one. ``compress="bf16"`` halves fp32 sync traffic
    (no effect on 16-bit parameters). ``placement``: where the whole-model period-k rows
    average. For every period k > 1 and bucket size the planner also searches streaming,
    ``HierState(period=k, fragments=F, overlap=tau)`` for F in ``fragments`` with F <= 2k
    and tau in ``overlaps`` with tau <= k - 1, and adds the row it prefers: within 5% of
    the fastest, the smallest tau. ``fragments=()`` searches no streaming.
    ``copy_s_per_byte``: the launch copies (:func:`hiersync.costmodel.step_time`); None:
    the profile's ``copy_gbps``, else an assumption by backend (``copy_source`` says
    which). ``break_even=False`` skips the bisection of :func:`break_even_gbps`.
    ``compare_compress=True`` also prices every ``compress`` option at the recommended
    configuration and re-planned (:attr:`Plan.compress_same`, :attr:`Plan.compress_steps`) and
    names the one that pays (:attr:`Plan.compress_pays`); ``python -m hiersync plan`` does.
    ``compress``: None/"none", "bf16", "fp16", "int8" or "int4" (:mod:`.compression`).
    ``steps_penalty`` (``"k=4:1.08,k=16:1.25"``, a time_to_loss.json path, or
    :class:`StepsPenalties`): steps to DDP's loss per period as x DDP's; the rows then carry it
    and the recommendation is the smallest period within 5% of the best predicted wall-clock to
    DDP's loss (step x penalty), among rows whose penalty is given, measured or interpolated
    (:attr:`Plan.held_back`: a faster one that is not). None: ranked by step time alone.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    compress = compression.check_compress(compress)
    if not periods:
        raise ValueError("periods must be ints >= 1, got []")
    _ints("periods", periods, 1)
    if not bucket_mb or any(not b > 0 for b in bucket_mb):
        raise ValueError(f"bucket sizes must be > 0 MB, got {list(bucket_mb)}")
    if not params > 0:
        raise ValueError(f"params must be > 0, got {params!r}")
    _ints("fragments", fragments, 1, " (1 = whole model)")
    if fragments and not overlaps:
        raise ValueError("overlaps must be ints >= 0 (0 = blocking), got []; e.g. overlaps=(0, 1, 2)")
    _ints("overlaps", overlaps, 0, " (0 = blocking)")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if isinstance(steps_penalty, str):
        steps_penalty = read_steps_penalty(steps_penalty)
    calibrated = profile.calibrated_nodes  # before the planned shape replaces the profile's
    profile = replace(
        profile,
        nodes=profile.nodes if nodes is None else nodes,
        ranks_per_node=profile.ranks_per_node if gpus_per_node is None else gpus_per_node,
    )
    backward, compute = check_compute(profile, backward_s, forward_s, compute_s)
    copy_beta, copy_source = copy_speed(profile, copy_s_per_byte)
    grad_bytes = float(params) * DTYPE_BYTES[dtype]
    ratio = compress_ratio_for(compress, dtype)
    periods = sorted(set(periods))
    common: dict[str, Any] = dict(
        grad_bytes=grad_bytes, backward_s=backward, compute_s=compute, copy_s_per_byte=copy_beta
    )
    sent = None if compress == "none" else compress
    common["param_bytes"] = DTYPE_BYTES[dtype]
    rows = _rows(profile, common, periods, bucket_mb, sent, placement, fragments, overlaps)
    if steps_penalty is not None:
        rows = tuple(
            r if r.period is None else replace(r, penalty=steps_penalty.at(r.period, streaming=_streams(r)))
            for r in rows
        )

    def bucket_pref(r: PlanRow) -> float:
        return abs(math.log(r.bucket_mb / DEFAULT_BUCKET_MB))

    def best(candidates: Sequence[PlanRow]) -> PlanRow:
        return min(candidates, key=lambda r: (r.step_s, bucket_pref(r)))

    best_ddp = best([r for r in rows if r.schedule == "ddp"])
    best_intra = best([r for r in rows if r.period is None])
    usable = [r for r in rows if r.period is not None]
    by_step = smallest_near_best(usable, lambda r: r.step_s, bucket_pref)
    recommended, held_back = by_step, None
    if steps_penalty is not None:
        recommended, held_back = rank_by_time_to_loss(usable, bucket_pref)

    flat_s = cm.predict_allreduce(grad_bytes, profile)
    intra_s = cm.predict_allreduce(grad_bytes, cm.node_profile(profile))
    rails = min(profile.rails or profile.ranks_per_node, profile.ranks_per_node)
    n = profile.nodes
    inter_bound = 2 * (n - 1) / n * grad_bytes * ratio * profile.inter.beta / rails
    step_cap = best_ddp.step_s / best_intra.step_s
    helps, text = verdict(profile, best_ddp, best_intra, recommended, flat_s, intra_s, step_cap, backward, HELPS_MUCH)
    warnings = edge_warnings(rows, recommended, periods, bucket_mb, fragments, overlaps)
    if calibrated is not None and calibrated != profile.nodes:
        warnings.append(
            f"calibrated on {calibrated} nodes, extrapolated to {profile.nodes}: the links were measured at "
            f"another scale; calibrate at the target scale (torchrun ... -m hiersync calibrate) to confirm"
        )
    memory = sync_memory(
        params=params,
        ranks_per_node=profile.ranks_per_node,
        period=recommended.period or 1,
        fragments=recommended.fragments,
        overlap=recommended.overlap,
        compress=compress != "none",
        error_feedback=compress if compression.is_quantized(compress) else False,
        nodes=profile.nodes,
        attached=recommended.placement not in (None, "hook"),
        param_bytes=DTYPE_BYTES[dtype],
        payload_bytes=4 + compression.QUANTIZED_BITS[compress] / 8 if compression.is_quantized(compress) else None,
    )
    logger.debug("plan: %d rows, recommended %s at %g MB", len(rows), recommended.schedule, recommended.bucket_mb)
    plan = Plan(
        profile=profile,
        params=float(params),
        dtype=dtype,
        grad_bytes=grad_bytes,
        backward_s=backward,
        compute_s=compute,
        compress=compress,
        compress_ratio=ratio,
        placement=placement,
        copy_gbps=1 / copy_beta / 1e9 if copy_beta > 0 else math.inf,
        copy_source=copy_source,
        warmup_steps=warmup_steps,
        rows=rows,
        best_ddp=best_ddp,
        recommended=recommended,
        flat_allreduce_s=flat_s,
        intra_allreduce_s=intra_s,
        inter_bound_s=inter_bound,
        step_cap=step_cap,
        helps=helps,
        verdict=text,
        warnings=tuple(warnings),
        memory=memory,
        collectives=collectives_assumed(profile, recommended, grad_bytes * ratio),
        calibrated_nodes=calibrated,
        steps_penalty=steps_penalty,
        by_step=by_step,
        held_back=held_back,
    )
    if compare_compress and profile.nodes > 1:
        others: dict[str, Any] = dict(
            params=params, backward_s=backward, compute_s=compute, dtype=dtype, periods=periods,
            bucket_mb=bucket_mb, placement=placement, fragments=fragments, overlaps=overlaps,
            copy_s_per_byte=copy_s_per_byte, warmup_steps=warmup_steps, break_even=False, compare_compress=False,
            steps_penalty=steps_penalty,
        )  # fmt: skip
        same, steps, pays = planner_sweeps.compare_compress(
            plan, lambda option: plan if option == compress else make_plan(profile, compress=option, **others)
        )
        plan = replace(plan, compress_same=tuple(same), compress_steps=tuple(steps), compress_pays=pays)
    return replace(plan, break_even_gbps=break_even_gbps(plan)) if break_even else plan


def _rows(
    profile: cm.Profile,
    common: dict[str, Any],
    periods: Sequence[int],
    bucket_mb: Sequence[float],
    compress: str | None,
    placement: str,
    fragments: Sequence[int],
    overlaps: Sequence[int],
) -> tuple[PlanRow, ...]:
    raw: list[tuple[str, int | None, float, cm.StepTime, str | None]] = []
    for mb in bucket_mb:
        kw: dict[str, Any] = dict(common, profile=profile, bucket_bytes=mb * MiB)
        raw.append(("ddp", 1, mb, cm.step_time("ddp", **kw), None))
        for k in periods:
            st = cm.step_time("hiersync", period=k, compress=compress, placement=placement, **kw)
            raw.append((st.label, k, mb, st, placement if k > 1 else None))
        for k in periods:
            if k > 1 and profile.nodes > 1 and fragments:
                st = _streaming(k, fragments, overlaps, dict(kw, compress=compress))
                where = "overlap" if st.overlap else "optimizer"
                raw.append((f"hiersync k={k} F={st.fragments} tau={st.overlap}", k, mb, st, where))
        raw.append(("intra-only", None, mb, cm.step_time("intra_only", **kw), None))
    best_ddp_step = min(st.step_s for name, _, _, st, _ in raw if name == "ddp")
    return tuple(
        PlanRow(
            schedule=name,
            period=k,
            bucket_mb=mb,
            comm_s=st.comm_s,
            exposed_s=st.exposed_s,
            step_s=st.step_s,
            speedup=best_ddp_step / st.step_s,
            fragments=st.fragments if where else 1,
            overlap=st.overlap if where else 0,  # period 1 has no average to place
            inter_bytes_peak=st.inter_bytes_peak,
            inter_bytes_mean=st.inter_bytes_mean,
            placement=where,
        )
        for name, k, mb, st, where in raw
    )


def _streams(row: PlanRow) -> bool:
    """Whether a row's sync streams (fragments or an overlap), for the penalty of its kind."""
    return row.fragments > 1 or row.overlap > 0


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


def copy_s_per_byte(gbps: float) -> float:
    """``--copy-gbps`` as seconds per byte; 0 means copies are free."""
    if not gbps >= 0:
        raise ValueError(f"--copy-gbps must be >= 0 (0 = copies free), got {gbps!r}")
    return 1 / (gbps * 1e9) if gbps > 0 else 0.0
