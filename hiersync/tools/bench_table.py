"""The comparison table of ``python -m hiersync bench``: one per model, bucket size and compute model. Pure."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from hiersync._table import render

from .bench_fsdp_table import format_fsdp_table
from .bench_rows import PHASES, row_key

__all__ = ["COMPUTE_LABELS", "BYTES_NOTES", "format_table"]

COMPUTE_LABELS = {
    "cpu": "real CPU compute",
    "accel": "accelerator-like compute (layers sleep, CPU idle)",
}
BYTES_NOTES = {
    "link": (
        "inter MB/step, peak MB: what each node's link sent per step (the mean over the attributed steps, "
        "drained link to drained link; the largest timed step), counted on the link the same way for every row "
        "(frames: payload and TCP/IP headers)"
    ),
    "counted": "inter MB/step, peak MB: hiersync's own counters, summed over the node's ranks (bandwidth-optimal)",
    "modelled": (
        "* modelled, not counted: a ring all-reduce over the world in rank order (gloo's default), "
        "bandwidth-optimal bytes crossing nodes, per node"
    ),
}
"""Where a table's inter-node bytes come from (a row's ``inter_source``)."""


def _fmt(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """The comparison table per model, bucket size and compute model: step time and its spread,
    ratios vs DDP and vs post-local SGD (same compute model), attributed phases, inter-node MB."""
    head = [
        "schedule",
        "compute",
        "step s",
        "p50 s",
        "p99 s",
        "vs DDP",
        "vs post-local",
        "data",
        "fwd",
        "bwd",
        "comm",
        "opt",
        "inter MB/step",
        "peak MB",
        "extra MB",
    ]
    lines: list[str] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(row_key(r)[:3], []).append(r)
    for (model, bucket, compute), rs in groups.items():
        size = f"{rs[0]['num_params'] / 1e6:.1f}M params, {rs[0]['grad_mb']:.0f} MB fp32 grads"
        title = f"{model} ({size}), bucket {bucket:g} MB, compute {compute}: {COMPUTE_LABELS.get(compute, compute)}"
        body = []
        for r in rs:
            if r["unsupported"]:  # its reason under the table: the cell would widen the column
                body.append([r["schedule"], r.get("compute", "cpu"), "n/a"])
                continue
            star = "*" if r.get("inter_source") == "modelled" else ""
            body.append(
                [
                    r["schedule"],
                    r.get("compute", "cpu"),
                    _fmt(r["step_s"]),
                    _fmt(r["step_p50_s"]),
                    _fmt(r["step_p99_s"]),
                    _fmt(r["vs_ddp"], ".2f", "x"),
                    _fmt(r["vs_postlocal"], ".2f", "x"),
                ]
                + [_fmt(r[f"{p}_s"]) for p in PHASES]
                + [_fmt(r["inter_mb_step_mean"], ".1f", star), _fmt(r["inter_mb_step_peak"], ".1f", star)]
                + [_fmt(r.get("extra_mb"), ".0f")]
            )
        notes = [n for n in (_unsupported_note(rs), _bytes_note(rs), _memory_note(rs), _sleep_note(rs)) if n]
        fsdp = format_fsdp_table(rs, markdown)
        if fsdp:
            notes.append(("\n" if markdown else "") + fsdp)
        if markdown:
            lines += [f"**{title}**", "", render(head, body, align="llr", markdown=True)]
            for note in notes:
                lines += ["", note]
            lines.append("")
        else:
            lines += [title, render(head, body, align="llr"), *notes, ""]
    return "\n".join(lines)


def _unsupported_note(rows: Sequence[dict]) -> str | None:
    """Why a row's numbers are n/a: the schedule this hiersync could not build, and its reason."""
    why = [f"{r['schedule']} {r['unsupported']}" for r in rows if r["unsupported"]]
    return "n/a: " + "; ".join(why) if why else None


def _bytes_note(rows: Sequence[dict]) -> str | None:
    """Where this table's inter-node bytes come from (one note per source present)."""
    sources = {r.get("inter_source") for r in rows if not r["unsupported"]}
    notes = [BYTES_NOTES[s] for s in ("link", "counted", "modelled") if s in sources]
    if None in sources and any(r["kind"] == "torchft" for r in rows):
        notes.append("torchft rows: '-' off the testbed (nothing counts their bytes there)")
    return "; ".join(notes) if notes else None


def _memory_note(rows: Sequence[dict]) -> str | None:
    over = {r.get("extra_over") for r in rows if r.get("extra_mb") is not None}
    if not over:
        return None
    what = {
        "compute_only": "compute_only's (DDP with a hook that sends nothing: the model, gradients, buckets and "
        "optimizer every row has)",
        "ddp": "DDP's",
        "fsdp_hsdp": "FSDP2 HSDP's (FSDP2 rows)",
        "fsdp_intra_only": "FSDP2 intra-node only's (FSDP2 rows)",
    }
    ref = " or ".join(what.get(str(o), str(o)) for o in sorted(over, key=str))
    return (
        f"extra MB: the worst rank's peak memory over {ref}, each measured in fresh ranks after the timed runs "
        f"(every freed tensor leaves the resident set there); the fp32 parameters are {rows[0]['grad_mb']:.0f} MB"
    )


def _sleep_note(rows: Sequence[dict]) -> str | None:
    """accel: how long the layers slept per step against what they asked (a busy machine wakes them late)."""
    pairs = [(r["accel_asked_s"], r["accel_slept_s"]) for r in rows if r.get("accel_slept_s") is not None]
    if not pairs:
        return None
    asked = statistics.fmean(a for a, _ in pairs)
    slept = [s for _, s in pairs]
    return (
        f"accel layers asked to sleep {asked:.3f} s per step and slept {min(slept):.3f}-{max(slept):.3f} s "
        "(slowest rank; the excess is the scheduler waking them late on a loaded machine)"
    )
