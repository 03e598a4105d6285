"""What ``python -m hiersync plan`` says: the verdict, the warnings, the lines to paste, the table.

Pure text from a :class:`~.planner.Plan` and its rows; :mod:`.planner` computes them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hiersync import costmodel as cm
from hiersync._table import render
from hiersync.vocab import MiB

from .planner_sweeps import COMPRESS_LOSSY, COMPRESS_NEAR

if TYPE_CHECKING:
    from .planner_sweeps import StepsPenalties, StepsPenalty
    from .plans import Plan, PlanRow

__all__ = [
    "verdict",
    "edge_warnings",
    "collectives_assumed",
    "links_line",
    "compress_line",
    "lossy_clause",
    "ddp_call",
    "register_call",
    "format_plan",
    "RECOMMENDED",
    "render_plan_table",
    "BY_STEP_TIME",
    "penalty_lines",
    "held_back_warning",
    "to_loss_line",
    "to_loss_cell",
    "by_step_line",
]

BY_STEP_TIME = (
    "ranking: by step time alone; local SGD usually needs more steps than DDP to reach the same loss; pass "
    "--steps-penalty (measured with benchmarks/time_to_loss.py) to rank by time to the target loss"
)
"""What the plan says when it has no steps penalty."""

EDGE_ROOM = 1.01
"""An edge of the grid matters when the step there is more than 1% slower than what moving
past it could reach (the intra-only bound for k, F and tau; the neighbour for bucket sizes)."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def _nics(count: int) -> str:
    return f"{count} NIC" if count == 1 else f"{count} NICs"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / MiB:,.1f} MiB"


def _values(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in sorted(set(values)))


def verdict(
    profile: cm.Profile,
    best_ddp: PlanRow,
    best_intra: PlanRow,
    rec: PlanRow,
    flat_s: float,
    intra_s: float,
    step_cap: float,
    backward_s: float,
    helps_much: float,
) -> tuple[bool, str]:
    """(helps, plain-language verdict with the numbers behind it)."""
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
    if step_cap < helps_much:
        return False, f"hierarchical sync cannot help much here (at most {step_cap:.2f}x faster steps): {numbers}"
    return True, (
        f"hierarchical sync helps: {rec.schedule} cuts the step from {_ms(best_ddp.step_s)} to "
        f"{_ms(rec.step_s)} ({rec.speedup:.2f}x); {numbers}"
    )


def edge_warnings(
    rows: Sequence[PlanRow],
    rec: PlanRow,
    periods: Sequence[int],
    buckets: Sequence[float],
    fragments: Sequence[int],
    overlaps: Sequence[int],
) -> list[str]:
    """Warnings for a recommended k, bucket size, F or tau at the edge of the searched grid.

    k, F and tau only while the recommended step is more than 1% above the intra-only step
    at its bucket size (nothing can beat that bound); a bucket size only while its neighbour
    in the grid is more than 1% slower for the same schedule.
    """
    out: list[str] = []
    bound = min((r.step_s for r in rows if r.period is None and r.bucket_mb == rec.bucket_mb), default=0.0)
    room = rec.step_s > bound * EDGE_ROOM
    k = rec.period or 1
    if room and k > 1 and len(set(periods)) > 1 and k == max(periods):
        out.append(
            f"the best k is the largest tried (k={k}): a larger k may be faster still (and drift more): "
            f"try --periods {_values([*periods, 2 * k, 4 * k])}"
        )
    if k > 1 and k == min(periods):
        out.append(
            f"the best k is the smallest tried (k={k}): a smaller k may do as well with less drift: "
            f"try --periods {_values([*periods, *(2**i for i in range(k.bit_length()))])}"
        )
    streaming = " F=" in rec.schedule
    if room and streaming and len(set(fragments)) > 1 and rec.fragments == max(fragments) < 2 * k:
        out.append(
            f"the best F is the largest tried (F={rec.fragments}, up to 2k = {2 * k} allowed): "
            f"try --fragments {_values([*fragments, min(2 * rec.fragments, 2 * k)])}"
        )
    if room and streaming and len(set(overlaps)) > 1 and rec.overlap == max(overlaps) < k - 1:
        out.append(
            f"the best tau is the largest tried (overlap={rec.overlap}, up to k-1 = {k - 1} allowed): "
            f"try --overlap {_values([*overlaps, rec.overlap + 1])}"
        )
    sizes = sorted(set(buckets))
    if len(sizes) > 1 and rec.bucket_mb in (sizes[0], sizes[-1]):
        largest = rec.bucket_mb == sizes[-1]
        neighbour = sizes[-2] if largest else sizes[1]
        same = [r.step_s for r in rows if r.bucket_mb == neighbour and r.period == rec.period]
        same = [r.step_s for r in rows if r.bucket_mb == neighbour and r.schedule == rec.schedule] or same
        if same and min(same) > rec.step_s * EDGE_ROOM:
            more = [*sizes, rec.bucket_mb * 4] if largest else [rec.bucket_mb / 4, *sizes]
            out.append(
                f"the best bucket size is the {'largest' if largest else 'smallest'} tried ({rec.bucket_mb:g} MB): "
                f"try --bucket-mb {_values(more)}"
            )
    return out


def penalty_lines(penalties: StepsPenalties, periods: Sequence[int]) -> list[str]:
    """The ranking line and every planned period's steps penalty, each said given, measured, interpolated
    or extrapolated."""
    ks = sorted(set(periods))

    def each(streaming: bool) -> str:
        return ", ".join(penalties.at(k, streaming=streaming).describe() for k in ks)

    says = f"blocking {each(False)}; streaming {each(True)}" if penalties.apart else each(False)
    lines = [
        "ranking: by predicted wall-clock to DDP's loss (the smallest k within 5% of the best): to_loss_ms = "
        "step_ms x steps penalty (steps to DDP's loss / DDP's steps), per DDP step; penalties from "
        f"{penalties.source}",
        f"steps penalty: {says}",
    ]
    unplanned = [k for k in penalties.periods if k not in ks]
    if unplanned:
        lines[-1] += f"; given but not planned: k={','.join(map(str, unplanned))} (add to --periods)"
    if any(penalties.at(k).how == "extrapolated" for k in ks):
        lines[-1] += (
            "; extrapolated values (?) are not recommended on: past the largest known k nothing bounds the penalty"
        )
    return lines


def to_loss_line(step_s: float, penalty: StepsPenalty, reference: str, reference_s: float) -> str:
    """The recommendation's predicted wall-clock to DDP's loss per DDP step, against exact sync's."""
    to_loss = step_s * penalty.value
    return (
        f"to DDP's loss: step {_ms(step_s)} x penalty {penalty.value:.4g} = {_ms(to_loss)} per DDP step, "
        f"{reference_s / to_loss:.2f}x sooner than {reference} ({_ms(reference_s)})"
    )


def to_loss_cell(step_s: float, penalty: StepsPenalty | None) -> str:
    """The table's to_loss_ms: step x penalty, ``>`` a lower bound (the loss not reached), ``?`` unknown."""
    if penalty is None:
        return "-"
    if not penalty.known:
        return "?"
    return f"{'' if penalty.reached else '>'}{step_s * penalty.value * 1e3:,.1f}"


def _to_loss(step_s: float, penalty: StepsPenalty) -> str:
    if not penalty.known:
        return "unknown"
    return f"{'' if penalty.reached else 'at least '}{_ms(step_s * penalty.value)} per DDP step"


def by_step_line(what: str, step_s: float, penalty: StepsPenalty | None) -> str:
    """What step time alone would have recommended, priced to DDP's loss."""
    if penalty is None:
        return f"by step time alone: {what}, step {_ms(step_s)}"
    return (
        f"by step time alone: {what}, step {_ms(step_s)} x penalty {penalty.cell}: to DDP's loss "
        f"{_to_loss(step_s, penalty)}"
    )


def held_back_warning(schedule: str, step_s: float, penalty: StepsPenalty) -> str:
    """Why a schedule that would reach the loss sooner is not the recommendation."""
    k = penalty.period
    if penalty.reached:
        why = "its penalty is extrapolated past the largest given or measured k, where nothing bounds it"
        priced = f"{_ms(step_s)} x {penalty.value:.4g} = {_ms(step_s * penalty.value)} per DDP step"
    else:
        why = f"period {k} did not reach DDP's loss in the measured run, so its time to the loss is unknown"
        priced = f"at least {_ms(step_s * penalty.value)} per DDP step"
    return (
        f"{schedule} might reach DDP's loss sooner ({priced}) but {why}: not recommended; measure period {k} with "
        f"benchmarks/time_to_loss.py, long enough to reach the loss (--max-steps-factor), and pass it to "
        f"--steps-penalty"
    )


def collectives_assumed(profile: cm.Profile, rec: PlanRow, sync_bytes: float) -> str:
    """The collective algorithms the model priced (:func:`hiersync.costmodel.explain_allreduce`), in words."""
    lpn, n = profile.ranks_per_node, profile.nodes
    bucket = rec.bucket_mb * MiB
    shard = (bucket if (rec.period or 1) == 1 else sync_bytes / max(rec.fragments, 1)) / lpn
    flat = cm.explain_allreduce(bucket, profile)
    local = cm.explain_allreduce(bucket, cm.node_profile(profile))
    rail = cm.explain_allreduce(shard, cm.rail_profile(profile)) if n > 1 else "none"
    intra = profile.intra_algorithm
    gather = "reduce-scatter + all-gather" if intra == "rs_ag" else "all-reduce + L shard broadcasts"
    how = (
        "NCCL's tuning model: the algorithm/protocol its tuner picks for each size and shape"
        if "nccl" in profile.backend.lower()
        else f"{profile.backend}'s ring, alpha-beta"
    )
    return (
        f"{how}; DDP: {flat} all-reduce of each {rec.bucket_mb:g} MB bucket; hiersync: intra-node {local} "
        f"all-reduce every step, inter-node {rail} all-reduce of {_gb(shard)} shards on {n} ranks per rail, "
        f"node gather by {gather} ({intra})"
    )


def ddp_call(plan: Plan) -> str:
    return f"DDP(model, device_ids=[local_rank], bucket_cap_mb={plan.bucket_cap_mb:g})"


def register_call(plan: Plan) -> str:
    """The ``hiersync.register(...)`` line of the recommendation."""
    rec = plan.recommended
    attached = rec.placement not in (None, "hook")
    args = ["ddp", "optimizer"] if attached else ["ddp"]
    args.append(f"period={rec.period or 1}")
    if (rec.period or 1) > 1:
        args.append(f"warmup_steps={plan.warmup_steps}")
        if plan.compress != "none":
            args.append(f'compress="{plan.compress}"')
        if rec.fragments > 1:
            args.append(f"fragments={rec.fragments}")
        if rec.overlap:
            args.append(f"overlap={rec.overlap}")
        args += outer_args(rec.penalty)
    return f"state = hiersync.register({', '.join(args)})"


def outer_args(penalty: StepsPenalty | None) -> list[str]:
    """The outer step a measured penalty's schedule ran (``hiersync_k4_stream_o0.7m0.5``), to paste with it."""
    outer = re.search(r"_o([\d.]+)m([\d.]+)", penalty.schedule or "") if penalty else None
    return [f"outer_lr={float(outer.group(1)):g}, outer_momentum={float(outer.group(2)):g}"] if outer else []


def _memory(plan: Plan) -> str:
    m = plan.memory
    if m is None or plan.period == 1:
        return "extra GPU memory per rank: none (period 1 keeps no local-SGD state)"
    p32 = plan.params * 4
    lpn = plan.profile.ranks_per_node
    share = f"1/{lpn}" if m.sharded else "whole"
    parts = [f"anchor {_gb(m.anchor)}" if m.anchor else "no anchor (no compress, no outer optimizer)"]
    if m.residual:
        parts.append(f"error-feedback residual {_gb(m.residual)}")
    if m.sharded:
        parts.append(f"in flight {_gb(m.in_flight)}")
        parts.append(f"gather buffer {_gb(m.gather)}")
    outer = p32 / lpn if m.sharded else p32
    extra = outer + (0.0 if m.anchor else outer)
    return (
        f"extra GPU memory per rank: {_gb(m.total)} ({'; '.join(parts)}; state {share} per rank); an outer "
        f"optimizer (outer_lr=...) adds {_gb(extra)}"
    )


def links_line(p: cm.Profile, nics: int) -> str:
    """The profile's links in words: NCCL's inputs under NCCL, alpha and bandwidth otherwise."""
    if "nccl" not in p.backend.lower():
        return (
            f"intra {p.intra.alpha * 1e6:g} us, {p.intra.bandwidth / 1e9:,.3g} GB/s per GPU; inter "
            f"{p.inter.alpha * 1e6:g} us, {p.inter.bandwidth / 1e9:,.3g} GB/s per NIC x {_nics(nics)}; rings"
        )
    nvls = f", NVLS {p.nvls_gbps:,.4g} GB/s" if p.nvls_gbps else ", no NVLS"
    return (
        f"intra ring {p.intra.bandwidth / 1e9:,.4g} GB/s busbw{nvls} ({p.gpu}, {p.intra_link}); inter "
        f"{p.inter.bandwidth / 1e9:,.4g} GB/s per NIC x {_nics(nics)}, fabric latency {p.net_latency_us:g} us; "
        f"hop latencies NCCL's"
    )


def compress_line(plan: Plan) -> str:
    """Which ``compress`` pays on this network: every option at the recommended configuration, and re-planned."""
    same = dict(plan.compress_same)
    pays = plan.compress_pays or "none"
    rec = plan.recommended
    config = rec.schedule if rec.period and rec.period > 1 else "the recommendation"
    at = ", ".join(f"{c} {_ms(step)}" for c, step in plan.compress_same)
    alone = "; ".join(f"{c} {_ms(step)} at {schedule}" for c, step, schedule in plan.compress_steps)
    if pays == "none":
        why = "no option is >= 2% faster: the step does not wait for inter-node bytes here"
    else:
        why = f"{same['none'] / same[pays]:.2f}x faster than none; fewer bits gain < 2% more"
    arg = "None" if pays == "none" else f'"{pays}"'
    return (
        f"compress: at {config}: {at}: use compress={arg} ({why}){lossy_clause(plan.compress_same, pays)}; "
        f"each re-planned (smallest k within 5% of its best): {alone}"
    )


def lossy_clause(same: Sequence[tuple[str, float]], pays: str) -> str:
    """What the options left out of the recommendation would buy, and why they are left out."""
    steps = dict(same)
    near = steps[pays] / COMPRESS_NEAR
    faster = [(c, steps[pays] / steps[c]) for c in COMPRESS_LOSSY if steps.get(c, math.inf) < near]
    if not faster:
        return ""
    gains = ", ".join(f"{c} {gain:.2f}x faster" for c, gain in faster)
    return f"; {gains}, but it costs loss at every density measured (docs/local-sgd.md)"


RECOMMENDED = "<- recommended"


def render_plan_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``plan``'s table (and ``plan --fsdp``'s): the schedule, its numbers, and a last column,
    headed by nothing, that marks the recommended row."""
    return render([*head, ""], rows, align="l" + "r" * (len(head) - 1) + "l")


def format_plan(plan: Plan) -> str:
    """The plan as a table, the recommendation, what to paste, assumptions and warnings."""
    p = plan.profile
    rails = p.rails or p.ranks_per_node
    nics = min(rails, p.ranks_per_node)
    sp = plan.steps_penalty
    lines = [
        f"profile {p.name or '(unnamed)'} [{p.backend}]: {p.nodes} nodes x {p.ranks_per_node} GPUs "
        f"= {p.nodes * p.ranks_per_node} ranks; {plan.params:,.4g} parameters, {plan.dtype} gradients "
        f"{plan.grad_bytes / 1e9:,.2f} GB; backward {_ms(plan.backward_s)}, compute {_ms(plan.compute_s)}",
        f"links: {links_line(p, nics)}; sync placement: {plan.placement}; "
        f"sync bytes x{plan.compress_ratio:g}; launch copies: {plan.copy_source}",
        "",
    ]
    head = ["schedule", "bucket_MB", "comm_ms", "exposed_ms", "step_ms", "speedup", "peak_inter_MB"]
    head += ["penalty", "to_loss_ms"] if sp else []
    table = []
    for r in plan.rows:
        cells = [r.schedule, f"{r.bucket_mb:g}", *(f"{s * 1e3:,.1f}" for s in (r.comm_s, r.exposed_s, r.step_s))]
        cells += [f"{r.speedup:.2f}x", f"{r.inter_bytes_peak / MiB:,.1f}"]
        if sp:
            cells += [r.penalty.cell if r.penalty else "-", to_loss_cell(r.step_s, r.penalty)]
        table.append([*cells, RECOMMENDED if r is plan.recommended else ""])
    lines.append(render_plan_table(head, table))
    rec = plan.recommended
    if not plan.use_hiersync:
        how = "plain DDP (exact all-reduce)"
    elif rec.period == 1:
        how = "hiersync period=1 (exact two-level all-reduce)"
    else:
        where = "after optimizer.step()" if rec.placement != "hook" else "in the hook"
        how = f"hiersync period={rec.period}, fragments={rec.fragments}, overlap={rec.overlap} ({where})"
    lines += ["", *(penalty_lines(sp, [r.period for r in plan.rows if r.period]) if sp else [BY_STEP_TIME])]
    lines += [
        f"recommend: bucket_cap_mb={plan.bucket_cap_mb:g}, {how}: step {_ms(rec.step_s)}, "
        f"{rec.speedup:.2f}x vs best DDP ({_ms(plan.best_ddp.step_s)} at {plan.best_ddp.bucket_mb:g} MB); "
        f"peak {rec.inter_bytes_peak / MiB:,.1f} MB between nodes per rank per step (DDP "
        f"{plan.best_ddp.inter_bytes_peak / MiB:,.1f} MB)",
    ]
    if sp and rec.penalty:
        ddp = plan.best_ddp
        lines.append(to_loss_line(rec.step_s, rec.penalty, "DDP", ddp.to_loss_s))
        by = plan.by_step
        if by is not None and by is not rec:
            lines.append(by_step_line(f"{by.schedule} at bucket {by.bucket_mb:g} MB", by.step_s, by.penalty))
    lines.append(f"paste: ddp = {ddp_call(plan)}")
    if plan.use_hiersync:
        lines.append(f"       {register_call(plan)}")
        lines.append(_memory(plan))
    if plan.compress_steps:
        lines.append(compress_line(plan))
    be = plan.break_even_gbps
    node_bw = p.inter.bandwidth * nics / 1e9
    faster = "reaches DDP's loss >= 5% sooner than DDP, at the steps penalty" if sp else ">= 5% faster steps than DDP"
    if be is None and p.nodes > 1:
        lines.append(f"break-even: hiersync does not help ({faster}) even at 1 MB/s per node")
    elif be is not None and math.isinf(be):
        lines.append(
            f"break-even: hiersync helps ({faster}) at every inter-node bandwidth tried, up to 10 TB/s "
            "per node: DDP's step is bound by something else here (intra-node links, per-bucket latency)"
        )
    elif be is not None:
        lines.append(
            f"break-even: hiersync helps ({faster}) while inter-node bandwidth per node is "
            f"below {be:,.3g} GB/s (this profile: {node_bw:,.3g} GB/s)"
        )
    lines += [
        f"collectives assumed: {plan.collectives}",
        f"assumptions: predictions of the cost model (see 'collectives assumed'), not measurements; an overlapped "
        f"sync hides only behind "
        f"tau local steps ({_ms(plan.compute_s)} of compute plus the local step's exposed intra-node communication "
        f"each), the rest is exposed; "
        f"launch copies (a rank's shard: snapshot, payload and its division, or payload and write-back; "
        f"an overlapped correction's add into its fragment) are exposed on the step; "
        f"communication never slows compute; "
        f"warmup steps not modelled",
        "peak_inter_MB: bytes one rank sends between nodes in its busiest step (MiB); streaming rows "
        "(F fragments, applied tau steps after launch) run after optimizer.step()",
        f"bound: one inter-node sync moves >= 2(N-1)/N * n bytes per node through {_nics(nics)}: "
        f">= {_ms(plan.inter_bound_s)}",
        f"verdict: {plan.verdict}",
    ]
    lines += [f"warning: {w}" for w in plan.warnings]
    held = plan.held_back
    if held is not None and held.penalty is not None:
        lines.append(
            f"warning: {held_back_warning(f'{held.schedule} at {held.bucket_mb:g} MB', held.step_s, held.penalty)}"
        )
    return "\n".join(lines)
