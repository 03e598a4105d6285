"""``python -m hiersync plan --fsdp``: the planner for a model sharded with FSDP2 inside the node.

The same questions as the DDP planner (:mod:`.planner`), for ``fully_shard`` over
``hiersync.node_mesh()``: which period and streaming to use, the step each gives, whether it
pays, what to paste, and the memory per GPU (:mod:`.fsdp`). Rows: FSDP2 HSDP (every step's
gradient shards all-reduced on the rail; hiersync ``period=1`` runs exactly that), hiersync
period k whole-model and streaming (fragments made of FSDP units), and FSDP2 inside the node
only (the k -> infinity bound).

Example::

    >>> from hiersync.costmodel import PRESETS
    >>> plan = make_fsdp_plan(PRESETS["a100-1nic"], params=7e9, nodes=16, backward_s=0.3, forward_s=0.1)
    >>> plan.memory.total < 80e9, plan.recommended.period > 1
    (True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hiersync import costmodel as cm

from . import compression
from .fsdp import ADAMW_STATE_BYTES, FsdpMemory, fsdp_memory, fsdp_step_time
from .planner import (
    DEFAULT_FRAGMENTS,
    DEFAULT_OVERLAPS,
    DEFAULT_WARMUP_STEPS,
    DTYPE_BYTES,
    HELPS_MUCH,
    NEAR_BEST,
    check_compute,
    compress_ratio_for,
    copy_speed,
)
from .planner_report import (
    BY_STEP_TIME,
    RECOMMENDED,
    by_step_line,
    held_back_warning,
    lossy_clause,
    outer_args,
    penalty_lines,
    render_plan_table,
    to_loss_cell,
    to_loss_line,
)
from .planner_sweeps import (
    COMPRESS_COMPARED,
    StepsPenalties,
    StepsPenalty,
    compress_pays,
    rank_by_time_to_loss,
    read_steps_penalty,
    smallest_near_best,
)

__all__ = ["DEFAULT_UNITS", "FsdpRow", "FsdpPlan", "make_fsdp_plan", "format_fsdp_plan", "fsdp_register_lines"]

DEFAULT_UNITS = 32
"""FSDP units when not given: one per transformer block of a 7B-class model (32 layers)."""
GPU_MEMORY_GB = 80.0


@dataclass(frozen=True, kw_only=True)
class FsdpRow:
    schedule: str
    period: int | None
    """1 for HSDP, k for hiersync, None for FSDP inside the node only."""
    fragments: int
    overlap: int
    st: cm.StepTime
    speedup: float
    penalty: StepsPenalty | None = None
    """Steps to DDP's loss as x DDP's at this period (``--steps-penalty``); None: not given, or intra-only."""

    @property
    def to_loss_s(self) -> float:
        """Predicted wall-clock to DDP's loss per DDP step: step time x steps penalty (step time without one)."""
        return self.st.step_s * (self.penalty.value if self.penalty else 1.0)


@dataclass(frozen=True, kw_only=True)
class FsdpPlan:
    profile: cm.Profile
    params: float
    dtype: str
    units: int
    backward_s: float
    compute_s: float
    compress: str
    compress_ratio: float
    reshard_after_forward: bool
    copy_source: str
    warmup_steps: int
    rows: tuple[FsdpRow, ...]
    hsdp: FsdpRow
    recommended: FsdpRow
    memory: FsdpMemory
    gpu_memory_gb: float
    ddp_memory: float
    """Bytes per GPU the same model needs under DDP (a full replica, its gradients, its optimizer state)."""
    inter_bound_s: float
    verdict: str
    compress_same: tuple[tuple[str, float], ...] = ()
    """(compress, step s) of every option at the recommended configuration (period > 1 only)."""
    steps_penalty: StepsPenalties | None = None
    """The steps penalties the ranking priced; None: it ranked by step time alone."""
    by_step: FsdpRow | None = None
    """What step time alone would recommend."""
    held_back: FsdpRow | None = None
    """A row that would reach DDP's loss sooner but whose penalty is extrapolated or not reached."""

    @property
    def period(self) -> int:
        return self.recommended.period or 1

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu_memory_gb * 1e9


def make_fsdp_plan(
    profile: cm.Profile,
    *,
    params: float,
    backward_s: float | None = None,
    forward_s: float | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    dtype: str = "fp32",
    units: int = DEFAULT_UNITS,
    periods: Sequence[int] = (1, 2, 4, 8),
    fragments: Sequence[int] = DEFAULT_FRAGMENTS,
    overlaps: Sequence[int] = DEFAULT_OVERLAPS,
    compress: str = "none",
    reshard_after_forward: bool = True,
    optimizer_bytes: float = ADAMW_STATE_BYTES,
    outer: bool = False,
    copy_s_per_byte: float | None = None,
    gpu_memory_gb: float = GPU_MEMORY_GB,
    activations_gb: float = 0.0,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    steps_penalty: StepsPenalties | str | None = None,
) -> FsdpPlan:
    """Every FSDP schedule on ``profile`` and the one to use (the smallest period within 5% of the
    best step, then the smallest tau, as :func:`.planner.make_plan`; with ``steps_penalty``, of the
    best predicted wall-clock to DDP's loss), with the memory per GPU."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ValueError(f"--fsdp-units must be an int >= 1 (FSDP units: fully_shard calls), got {units!r}")
    if not periods or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in periods):
        raise ValueError(f"periods must be ints >= 1, got {list(periods)}")
    if not gpu_memory_gb > 0 or not activations_gb >= 0:
        raise ValueError(f"need --gpu-memory-gb > 0 and --activations-gb >= 0, got {gpu_memory_gb}, {activations_gb}")
    if isinstance(steps_penalty, str):
        steps_penalty = read_steps_penalty(steps_penalty)
    profile = profile.with_shape(nodes=nodes, ranks_per_node=gpus_per_node)
    backward, compute = check_compute(profile, backward_s, forward_s, None)
    copy_beta, copy_source = copy_speed(profile, copy_s_per_byte)
    ratio = compress_ratio_for(compress, dtype)
    sent = None if compress == "none" else compress
    pb = DTYPE_BYTES[dtype]
    common: dict[str, Any] = dict(
        profile=profile, params=params, units=units, forward_s=compute - backward, backward_s=backward,
        param_bytes=pb, grad_bytes=pb, reshard_after_forward=reshard_after_forward,
    )  # fmt: skip
    raw: list[tuple[str, int | None, int, int, cm.StepTime]] = [
        ("fsdp2 hsdp", 1, 1, 0, fsdp_step_time("hsdp", **common))
    ]
    for k in sorted(set(periods)):
        if k == 1 or profile.nodes == 1:
            continue
        grid = [
            fsdp_step_time(
                "hiersync", period=k, fragments=f, overlap=t, compress=sent, copy_s_per_byte=copy_beta, **common
            )
            for f in sorted({1, *fragments})
            if f <= min(2 * k, units)
            for t in sorted(set(overlaps))
            if t <= k - 1
        ]
        whole = min((st for st in grid if st.fragments == 1), key=lambda st: (st.overlap, st.step_s))
        raw.append((whole.label, k, 1, whole.overlap, whole))
        target = min(st.step_s for st in grid) * NEAR_BEST
        best = min((st for st in grid if st.step_s <= target), key=lambda st: (st.overlap, st.step_s, st.fragments))
        if best is not whole:
            raw.append((best.label, k, best.fragments, best.overlap, best))
    raw.append(("intra-only", None, 1, 0, fsdp_step_time("intra_only", **common)))
    hsdp_step = raw[0][4].step_s
    rows = tuple(
        FsdpRow(schedule=name, period=k, fragments=f, overlap=t, st=st, speedup=hsdp_step / st.step_s)
        for name, k, f, t, st in raw
    )
    if steps_penalty is not None:
        rows = tuple(
            r
            if r.period is None
            else replace(r, penalty=steps_penalty.at(r.period, streaming=r.fragments > 1 or r.overlap > 0))
            for r in rows
        )
    usable = [r for r in rows if r.period is not None]
    by_step = rec = smallest_near_best(usable, lambda r: r.st.step_s, lambda r: 0.0)
    held_back = None
    if steps_penalty is not None:
        rec, held_back = rank_by_time_to_loss(usable, lambda r: 0.0)
    memory = fsdp_memory(
        params=params, ranks_per_node=profile.ranks_per_node, units=units, period=rec.period or 1,
        fragments=rec.fragments, overlap=rec.overlap, param_bytes=pb, grad_bytes=pb,
        optimizer_bytes=optimizer_bytes, reshard_after_forward=reshard_after_forward,
        anchor=compress != "none", outer=outer,
        error_feedback=compress if compression.is_quantized(compress) else False,
        activations_bytes=activations_gb * 1e9, nodes=profile.nodes,
    )  # fmt: skip
    n = profile.nodes
    nics = min(profile.rails or profile.ranks_per_node, profile.ranks_per_node)
    bound = 2 * (n - 1) / n * params * pb * ratio * profile.inter.beta / nics
    intra = rows[-1]
    cap = hsdp_step / intra.st.step_s
    if n == 1:
        verdict = "one node: FSDP2 alone; there is no inter-node traffic to save."
    elif cap < HELPS_MUCH:
        verdict = (
            f"hierarchical sync cannot help much here: never syncing across nodes makes the step at most "
            f"{cap:.2f}x faster than HSDP ({_ms(intra.st.step_s)} vs {_ms(hsdp_step)})"
        )
    else:
        verdict = (
            f"hierarchical sync helps: {rec.schedule} cuts the step from HSDP's {_ms(hsdp_step)} to "
            f"{_ms(rec.st.step_s)} ({rec.speedup:.2f}x); FSDP2 inside the node alone would step in "
            f"{_ms(intra.st.step_s)} ({cap:.2f}x)"
        )
    same: list[tuple[str, float]] = []
    if rec.period and rec.period > 1:
        for option in COMPRESS_COMPARED:
            st = fsdp_step_time(
                "hiersync", period=rec.period, fragments=rec.fragments, overlap=rec.overlap,
                compress=None if option == "none" else option, copy_s_per_byte=copy_beta, **common,
            )  # fmt: skip
            same.append((option, st.step_s))
    return FsdpPlan(
        compress_same=tuple(same), steps_penalty=steps_penalty, by_step=by_step, held_back=held_back,
        profile=profile, params=float(params), dtype=dtype, units=units, backward_s=backward, compute_s=compute,
        compress=compress, compress_ratio=ratio, reshard_after_forward=reshard_after_forward,
        copy_source=copy_source, warmup_steps=warmup_steps, rows=rows, hsdp=rows[0], recommended=rec,
        memory=memory, gpu_memory_gb=gpu_memory_gb,
        ddp_memory=params * (2 * pb + optimizer_bytes), inter_bound_s=bound, verdict=verdict,
    )  # fmt: skip


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.2f} GB"


def fsdp_register_lines(plan: FsdpPlan) -> list[str]:
    """The FSDP2 front-end to paste (DESIGN "FSDP2 front-end"), with the recommendation's options."""
    rec = plan.recommended
    args = ["model", "opt", f"period={plan.period}"]
    if plan.period > 1:
        args.append(f"warmup_steps={plan.warmup_steps}")
        if plan.compress != "none":
            args.append(f'compress="{plan.compress}"')
        if rec.fragments > 1:
            args.append(f"fragments={rec.fragments}")
        if rec.overlap:
            args.append(f"overlap={rec.overlap}")
        args += outer_args(rec.penalty)
    reshard = "" if plan.reshard_after_forward else ", reshard_after_forward=False"
    return [
        "mesh = hiersync.node_mesh()",
        f"for block in model.blocks: fully_shard(block, mesh=mesh{reshard})",
        "fully_shard(model, mesh=mesh)",
        "opt = torch.optim.AdamW(model.parameters())",
        f"state = hiersync.register({', '.join(args)})",
    ]


def format_fsdp_plan(plan: FsdpPlan) -> str:
    """The FSDP plan as text: the table, the recommendation, the memory per GPU, what to paste."""
    p, m, rec, sp = plan.profile, plan.memory, plan.recommended, plan.steps_penalty
    unit = plan.params * DTYPE_BYTES[plan.dtype] / plan.units
    lines = [
        f"profile {p.name or '(unnamed)'} [{p.backend}]: {p.nodes} nodes x {p.ranks_per_node} GPUs; FSDP2 over each "
        f"node's {p.ranks_per_node} ranks (hiersync.node_mesh()); {plan.params:,.4g} parameters {plan.dtype} in "
        f"{plan.units} units of {_gb(unit)}; backward {_ms(plan.backward_s)}, compute {_ms(plan.compute_s)}; "
        f"reshard_after_forward={plan.reshard_after_forward}; launch copies: {plan.copy_source}",
        "",
    ]
    head = ["schedule", "comm_ms", "exposed_ms", "step_ms", "vs HSDP", "peak_inter_MB"]
    head += ["penalty", "to_loss_ms"] if sp else []
    table = []
    for r in plan.rows:
        cells = [r.schedule, *(f"{s * 1e3:,.1f}" for s in (r.st.comm_s, r.st.exposed_s, r.st.step_s))]
        cells += [f"{r.speedup:.2f}x", f"{r.st.inter_bytes_peak / 2**20:,.1f}"]
        if sp:
            cells += [r.penalty.cell if r.penalty else "-", to_loss_cell(r.st.step_s, r.penalty)]
        table.append([*cells, RECOMMENDED if r is rec else ""])
    lines.append(render_plan_table(head, table))
    if rec.period == 1:
        how = "FSDP2 HSDP: hiersync period=1 (the rail all-reduce of every gradient shard, every step)"
    else:
        how = (
            f"hiersync period={rec.period}, fragments={rec.fragments} (of {plan.units} FSDP units), "
            f"overlap={rec.overlap}: the rank's parameter shard averaged on its rail after optimizer.step()"
        )
    fits = "fits in" if plan.fits else "does NOT fit in"
    lines += ["", *(penalty_lines(sp, [r.period for r in plan.rows if r.period]) if sp else [BY_STEP_TIME])]
    lines.append(
        f"recommend: {how}: step {_ms(rec.st.step_s)}, {rec.speedup:.2f}x vs HSDP ({_ms(plan.hsdp.st.step_s)}); "
        f"peak {rec.st.inter_bytes_peak / 2**20:,.1f} MB between nodes per rank per step"
    )
    if sp and rec.penalty:
        hsdp = plan.hsdp
        lines.append(to_loss_line(rec.st.step_s, rec.penalty, "HSDP", hsdp.to_loss_s))
        by = plan.by_step
        if by is not None and by is not rec:
            lines.append(by_step_line(by.schedule, by.st.step_s, by.penalty))
    lines += [
        f"memory per GPU: {_gb(m.total)}, {fits} a GPU of {plan.gpu_memory_gb:g} GB: parameters {_gb(m.params)} + "
        f"gradients {_gb(m.grads)} + optimizer state {_gb(m.optimizer)} (each sharded 1/{p.ranks_per_node}) + "
        f"unsharded units {_gb(m.unsharded)} + hiersync {_gb(m.hiersync)} (anchor {_gb(m.anchor)}, outer momentum "
        f"{_gb(m.momentum)}, fragments in flight {_gb(m.in_flight)}, error-feedback residual {_gb(m.residual)}) + "
        f"activations {_gb(m.activations)} "
        f"(not modelled: --activations-gb); DDP would need {_gb(plan.ddp_memory)} before activations",
        "paste: from torch.distributed.fsdp import fully_shard",
    ]
    lines += [f"       {line}" for line in fsdp_register_lines(plan)]
    if plan.compress_same:
        pays = compress_pays(plan.compress_same)
        at = ", ".join(f"{c} {_ms(step)}" for c, step in plan.compress_same)
        arg = "None" if pays == "none" else f'"{pays}"'
        lines.append(
            f"compress: at {rec.schedule}: {at}: use compress={arg} (the least lossy within 2% of the fastest)"
            f"{lossy_clause(plan.compress_same, pays)}"
        )
    n = p.nodes
    lines += [
        f"collectives assumed: per FSDP unit an all-gather of {_gb(unit)} before its forward"
        f"{' and again before its backward' if plan.reshard_after_forward else ''} and a reduce-scatter of its "
        f"gradient after its backward, inside the node on one channel, prefetched as FSDP2 does; across nodes "
        f"predict_allreduce on the rail ({n} ranks per rail)",
        "assumptions: predictions of the cost model, not measurements; the forward time includes the optimizer "
        "step; activations, CUDA context and allocator fragmentation not counted; warmup steps not modelled",
        f"bound: one inter-node sync moves >= 2(N-1)/N * n bytes per node: >= {_ms(plan.inter_bound_s)}",
        f"verdict: {plan.verdict}",
    ]
    if not plan.fits:
        lines.append(
            "warning: the model does not fit: more GPUs per node shard it further; reshard_after_forward=True, "
            "bf16 parameters (--dtype bf16) or a smaller optimizer state cut the rest"
        )
    held = plan.held_back
    if held is not None and held.penalty is not None:
        lines.append(f"warning: {held_back_warning(held.schedule, held.st.step_s, held.penalty)}")
    k = rec.period or 1
    if k > 1 and k == max(r.period or 0 for r in plan.rows) and rec.st.step_s > plan.rows[-1].st.step_s * 1.01:
        lines.append(
            f"warning: the best k is the largest tried (k={k}): a larger k may be faster still (and drift more): "
            f"try --periods {','.join(str(v) for v in sorted({1, 2, 4, k, 2 * k, 4 * k}))}"
        )
    return "\n".join(lines)
