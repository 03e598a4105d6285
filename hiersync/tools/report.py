"""Tables, targets, plots and files of ``python -m hiersync bench`` (pure but for matplotlib).

:func:`summarize` turns every rank's :func:`hiersync.tools.bench_worker.worker` result into
one row per (model, bucket size, schedule); :func:`format_table` and
:func:`format_targets` print them, :func:`write_outputs` writes bench.json, .csv, .md and
the plots atomically.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hiersync._io import atomic_write_bytes, atomic_write_json, atomic_write_text

from .bench_spec import NEVER

__all__ = ["PHASES", "TARGETS", "summarize", "check_targets", "format_table", "format_targets", "write_outputs"]

logger = logging.getLogger(__name__)

PHASES = ("data", "forward", "backward", "comm", "optimizer")


def summarize(rank_results: Sequence[dict]) -> list[dict]:
    """One row per (model, bucket, schedule) from every rank's :func:`worker` result.

    Phases are barrier to barrier; compute parts use the slowest rank (the critical path)
    and the rest of each interval is communication wait, so the phases add up to the
    attributed total. ``step_s`` is the unsynchronized step time of the slowest rank.
    With repeats, every number is the median over the repeats (``step_s_runs`` lists them).
    """
    rows: list[dict] = []
    for i, run0 in enumerate(rank_results[0]["runs"]):
        runs = [r["runs"][i] for r in rank_results]
        phases = {p: 0.0 for p in PHASES}
        n = len(run0["attributed"])
        for s in range(n):
            per = [r["attributed"][s] for r in runs]
            bwd_interval = statistics.fmean(p["backward_interval"] for p in per)
            opt_interval = statistics.fmean(p["optimizer_interval"] for p in per)
            bwd = min(bwd_interval, max(p["backward_compute"] for p in per))
            optc = min(opt_interval, max(p["optimizer_compute"] for p in per))
            phases["data"] += statistics.fmean(p["data"] for p in per) / n
            phases["forward"] += statistics.fmean(p["forward"] for p in per) / n
            phases["backward"] += bwd / n
            phases["optimizer"] += optc / n
            phases["comm"] += (bwd_interval - bwd + opt_interval - optc) / n
        attributed_total = statistics.fmean(
            statistics.fmean(r["attributed"][s]["total"] for r in runs) for s in range(n)
        )
        step_s = max(r["unsync_elapsed"] for r in runs) / run0["steps"]
        ends = runs[0]["unsync_step_ends"]
        per_step = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
        spec = run0["spec"]
        rows.append(
            {
                "model": run0["model"],
                "num_params": run0["num_params"],
                "grad_mb": run0["num_params"] * 4 / 1e6,
                "bucket_mb": run0["bucket_mb"],
                "schedule": run0["schedule"],
                "kind": spec["kind"],
                "period": spec["period"] if spec["period"] < NEVER else None,
                "overlap": spec["overlap"],
                "compress": spec["compress"],
                "steps": run0["steps"],
                "step_s": step_s,
                "step_std_s": statistics.pstdev(per_step) if len(per_step) > 1 else 0.0,
                "attributed_total_s": attributed_total,
                **{f"{p}_s": phases[p] for p in PHASES},
                "inter_mb_sent_per_step": (
                    run0["bytes_sent_per_step"]["inter"] / 1e6 if run0["bytes_sent_per_step"] else None
                ),
            }
        )
    merged = _merge_repeats(rows)
    _add_ratios(merged)
    return merged


def _merge_repeats(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["bucket_mb"], r["schedule"]), []).append(r)
    out = []
    for rs in groups.values():
        row = dict(rs[0])
        for k, v in rs[0].items():
            if isinstance(v, float) and k not in ("bucket_mb", "grad_mb"):
                vals = [r[k] for r in rs if r[k] is not None]
                row[k] = statistics.median(vals) if vals else None
        row["repeats"] = len(rs)
        row["step_s_runs"] = ";".join(f"{r['step_s']:.4f}" for r in rs)
        out.append(row)
    return out


def _add_ratios(rows: list[dict]) -> None:
    by = {(r["model"], r["bucket_mb"], r["schedule"]): r for r in rows}
    for r in rows:
        ddp = by.get((r["model"], r["bucket_mb"], "ddp"))
        r["vs_ddp"] = r["step_s"] / ddp["step_s"] if ddp else None
        post = None
        if r["kind"] in ("hiersync", "postlocal") and r["period"] and r["period"] > 1:
            post = by.get((r["model"], r["bucket_mb"], f"postlocal_k{r['period']}"))
        r["vs_postlocal"] = r["step_s"] / post["step_s"] if post else None


TARGETS = (
    # (schedule, reference, bound): the targets
    ("hiersync_p4_overlap", "ddp", 0.30),
    ("hiersync_p4_overlap", "postlocal_k4", 0.55),
    ("hiersync_p1", "ddp", 0.80),
)


def check_targets(rows: Sequence[dict]) -> list[dict]:
    """The issue's step-time targets, per model and bucket size, where both schedules ran."""
    by = {(r["model"], r["bucket_mb"], r["schedule"]): r for r in rows}
    out = []
    seen = sorted({(r["model"], r["bucket_mb"]) for r in rows})
    for model, bucket in seen:
        for sched, ref, bound in TARGETS:
            a, b = by.get((model, bucket, sched)), by.get((model, bucket, ref))
            if a and b:
                ratio = a["step_s"] / b["step_s"]
                out.append(
                    {
                        "model": model,
                        "bucket_mb": bucket,
                        "schedule": sched,
                        "reference": ref,
                        "ratio": ratio,
                        "target": bound,
                        "met": ratio <= bound,
                    }
                )
    return out


# ---------------------------------------------------------------------------- outputs
def _fmt(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """The comparison table: step time, ratios vs DDP and vs post-local SGD, attributed phases."""
    head = ["schedule", "step s", "vs DDP", "vs post-local", "data", "fwd", "bwd", "comm", "opt", "inter MB/step"]
    lines: list[str] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["bucket_mb"]), []).append(r)
    for (model, bucket), rs in groups.items():
        size = f"{rs[0]['num_params'] / 1e6:.1f}M params, {rs[0]['grad_mb']:.0f} MB fp32 grads"
        title = f"{model} ({size}), bucket {bucket:g} MB"
        body = [
            [r["schedule"], _fmt(r["step_s"]), _fmt(r["vs_ddp"], ".2f", "x"), _fmt(r["vs_postlocal"], ".2f", "x")]
            + [_fmt(r[f"{p}_s"]) for p in PHASES]
            + [_fmt(r["inter_mb_sent_per_step"], ".1f")]
            for r in rs
        ]
        if markdown:
            lines += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(b) + " |" for b in body]
            lines.append("")
        else:
            widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
            lines.append(title)
            lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
            for b in body:
                lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
            lines.append("")
    return "\n".join(lines)


def format_targets(targets: Sequence[dict]) -> str:
    lines = []
    for t in targets:
        ref = "DDP default" if t["reference"] == "ddp" else f"PyTorch post-local SGD ({t['reference']})"
        lines.append(
            f"target {t['schedule']} <= {t['target']:.2f}x {ref} [{t['model']}, {t['bucket_mb']:g} MB buckets]: "
            f"{t['ratio']:.2f}x -> {'met' if t['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def _plots(rows: Sequence[dict]) -> dict[str, bytes]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("bench: matplotlib is not installed (pip install 'hiersync[bench]'); no plots")
        return {}
    out: dict[str, bytes] = {}
    models = list(dict.fromkeys(r["model"] for r in rows))
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for sched in schedules:
            pts = sorted((r["bucket_mb"], r["step_s"]) for r in rows if r["model"] == model and r["schedule"] == sched)
            if pts:
                style = "--" if sched in ("ddp", "intra_only", "compute_only") or sched.startswith("postlocal") else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=sched)
        ax.set_xscale("log")
        ax.set_xlabel("DDP bucket size (MB)")
        ax.set_ylabel("step time (s, unsynchronized)")
        ax.set_title(f"{model}: step time vs bucket size")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out["step_time_vs_bucket.png"] = _png(fig)
    plt.close(fig)

    keys = list(dict.fromkeys((r["model"], r["bucket_mb"]) for r in rows))
    # one breakdown per model, at the bucket size closest to 25 MB
    picks = []
    for model in models:
        buckets = sorted({k[1] for k in keys if k[0] == model})
        picks.append((model, min(buckets, key=lambda b: abs(math.log(b / 25.0)))))
    fig, axes = plt.subplots(1, len(picks), figsize=(7 * len(picks), 4.5), squeeze=False)
    colors = {"data": "#bbbbbb", "forward": "#4c72b0", "backward": "#55a868", "comm": "#c44e52", "optimizer": "#8172b2"}
    for ax, (model, bucket) in zip(axes[0], picks):
        rs = [r for r in rows if r["model"] == model and r["bucket_mb"] == bucket]
        xs = range(len(rs))
        bottom = [0.0] * len(rs)
        for p in PHASES:
            vals = [r[f"{p}_s"] for r in rs]
            ax.bar(xs, vals, bottom=bottom, color=colors[p], label=p)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(xs, [r["step_s"] for r in rs], "k_", markersize=18, mew=2, label="unsynchronized step")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["schedule"] for r in rs], rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{model}, {bucket:g} MB buckets: attributed step breakdown")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    out["step_breakdown.png"] = _png(fig)
    plt.close(fig)
    return out


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write_outputs(results_dir: str | os.PathLike, raw: dict, rows: Sequence[dict], plots: bool = True) -> list[Path]:
    """Write bench.json (raw), bench.csv, bench.md and the PNG plots atomically; return the paths."""
    d = Path(results_dir)
    paths = [atomic_write_json(d / "bench.json", {**raw, "rows": list(rows)})]
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    paths.append(atomic_write_text(d / "bench.csv", buf.getvalue()))
    md = [
        "# hiersync bench",
        "",
        f"`{raw['command']}`",
        "",
        raw["testbed"]["describe"],
        "",
        format_table(rows, markdown=True),
    ]
    targets = check_targets(rows)
    if targets:
        md += ["", "```", format_targets(targets), "```", ""]
    paths.append(atomic_write_text(d / "bench.md", "\n".join(md)))
    if plots and rows:
        for name, data in _plots(rows).items():
            paths.append(atomic_write_bytes(d / name, data))
    return paths
