"""The FSDP2 rows' own table (``python -m hiersync bench --fsdp``): each row against FSDP2 HSDP. Pure.

Beside :func:`.bench_table.format_table`'s phases: the step time against HSDP's (same compute
model, same run), the inter-node MB a node's link sent per step, and the memory: the worst
rank's extra peak over HSDP's, the rank's own fp32 parameter shard, and their ratio.
"""

from __future__ import annotations

from collections.abc import Sequence

from hiersync._table import render

__all__ = ["FSDP_HEAD", "format_fsdp_table"]

FSDP_HEAD = (
    "FSDP2 row",
    "step s",
    "p50 s",
    "p99 s",
    "vs HSDP",
    "inter MB/step",
    "peak MB",
    "extra MB",
    "own shard MB",
    "extra / shard",
)


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_fsdp_table(rows: Sequence[dict], markdown: bool = False) -> str | None:
    """The FSDP2 rows of one (model, bucket, compute model) group, or None where there are none."""
    mine = [r for r in rows if str(r.get("kind", "")).startswith("fsdp_") and not r.get("unsupported")]
    if not mine:
        return None
    body = [
        [
            r["schedule"],
            _fmt(r["step_s"], ".3f"),
            _fmt(r["step_p50_s"], ".3f"),
            _fmt(r["step_p99_s"], ".3f"),
            _fmt(r.get("vs_hsdp"), ".2f", "x"),
            _fmt(r["inter_mb_step_mean"], ".1f"),
            _fmt(r["inter_mb_step_peak"], ".1f"),
            _fmt(r.get("extra_mb"), ".0f"),
            _fmt(r.get("shard_mb"), ".1f"),
            _fmt(r.get("extra_per_shard"), ".2f", "x"),
        ]
        for r in mine
    ]
    note = (
        "FSDP2 rows: vs HSDP is the mean step against fsdp_hsdp's; extra MB is the worst rank's peak memory over "
        "fsdp_hsdp's (the same sharded model, gradients and SGD momentum), own shard MB the fp32 parameters a rank "
        "holds (1/L of the model); bwd holds the collectives FSDP2 runs inside backward"
    )
    return render(FSDP_HEAD, body, markdown=markdown) + ("\n\n" if markdown else "\n") + note
