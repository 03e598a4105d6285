"""Tables, targets, plots and files of ``python -m hiersync bench`` (pure but for matplotlib).

:func:`summarize` turns every rank's :func:`hiersync.tools.bench_worker.worker` result into
one row per (model, bucket size, compute model, schedule); :func:`format_table` and
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

from .bench_model import format_comparison, format_model_targets
from .bench_spec import NEVER

__all__ = [
    "PHASES",
    "TARGETS",
    "percentile",
    "step_durations",
    "inter_bytes_per_step",
    "summarize",
    "check_targets",
    "format_table",
    "format_targets",
    "write_outputs",
]

logger = logging.getLogger(__name__)

PHASES = ("data", "forward", "backward", "comm", "optimizer")
COMPUTE_LABELS = {
    "cpu": "real CPU compute",
    "accel": "accelerator-like compute (layers sleep, CPU idle)",
}
MODELLED_NOTE = (
    "* modelled, not counted: a ring all-reduce over the world in rank order (gloo's default), "
    "bandwidth-optimal bytes crossing nodes per rank; hiersync rows are its own counters"
)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_durations(runs: Sequence[dict]) -> list[float]:
    """The job's unsynchronized step durations: step i ends when its last rank ends it.

    Every rank times its step ends from the same barrier, so step i lasts from the last
    rank's end of step i - 1 to the last rank's end of step i; the durations add up to
    the slowest rank's elapsed time, so their mean is the mean step time. (The largest
    per-rank duration of each step would count a rank that merely caught up after a slow
    step as a second slow step: ranks of different nodes drift apart by tens of ms.)
    """
    ends = [max(e) for e in zip(*(r["unsync_step_ends"] for r in runs))]
    return [b - a for a, b in zip([0.0] + ends[:-1], ends)]


def inter_bytes_per_step(runs: Sequence[dict]) -> list[float] | None:
    """Per unsynchronized step, the most inter-node bytes any rank sent (None where not known)."""
    lists = [r.get("inter_bytes_steps") for r in runs]
    if any(x is None for x in lists):
        return None
    return [max(v) for v in zip(*lists)]


def summarize(rank_results: Sequence[dict]) -> list[dict]:
    """One row per (model, bucket, compute model, schedule) from every rank's :func:`worker` result.

    Phases are barrier to barrier; compute parts use the slowest rank (the critical path)
    and the rest of each interval is communication wait, so the phases add up to the
    attributed total. ``step_s`` is the unsynchronized step time of the slowest rank (the
    mean over the timed steps), ``step_p50_s``/``step_p99_s`` percentiles of the job's per-step
    durations (:func:`step_durations`; ``step_durations_s`` lists them, ";"-joined, over
    every repeat); ``inter_mb_step_mean``/``inter_mb_step_peak`` the mean and
    the largest per-step inter-node MB a rank sent in those steps. With repeats, every number
    is the median over the repeats (``step_s_runs`` lists them). A schedule the installed
    hiersync cannot build has ``unsupported`` set and no numbers.
    """
    rows: list[dict] = []
    for i, run0 in enumerate(rank_results[0]["runs"]):
        runs = [r["runs"][i] for r in rank_results]
        spec = run0["spec"]
        row: dict[str, Any] = {
            "model": run0["model"],
            "compute": run0.get("compute", "cpu"),
            "num_params": run0["num_params"],
            "grad_mb": run0["num_params"] * 4 / 1e6,
            "bucket_mb": run0["bucket_mb"],
            "schedule": run0["schedule"],
            "kind": spec["kind"],
            "period": spec["period"] if spec["period"] < NEVER else None,
            "overlap": spec["overlap"],
            "fragments": spec.get("fragments", 1),
            "compress": spec["compress"],
            "steps": run0["steps"],
            "unsupported": run0.get("unsupported"),
            "whole_sync_mb": run0["whole_sync_inter_bytes"] / 1e6 if run0.get("whole_sync_inter_bytes") else None,
        }
        numbers = [
            "step_s",
            "step_p50_s",
            "step_p99_s",
            "step_std_s",
            "cpu_s_per_step",
            "attributed_total_s",
            *(f"{p}_s" for p in PHASES),
            "inter_mb_sent_per_step",
            "inter_mb_step_mean",
            "inter_mb_step_peak",
        ]
        row.update(dict.fromkeys(numbers))
        row["inter_source"] = run0.get("inter_bytes_source")
        row["accel_asked_s"] = row["accel_slept_s"] = None
        row["step_durations_s"] = ""
        if row["unsupported"]:
            rows.append(row)
            continue
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
        per_step = step_durations(runs)
        inter = inter_bytes_per_step(runs)
        row.update(
            {
                "step_s": max(r["unsync_elapsed"] for r in runs) / run0["steps"],
                "step_p50_s": percentile(per_step, 50),
                "step_p99_s": percentile(per_step, 99),
                "step_std_s": statistics.pstdev(per_step) if len(per_step) > 1 else 0.0,
                "step_durations_s": ";".join(f"{d:.4f}" for d in per_step),
                # CPU seconds per timed step, mean over ranks (all threads: compute, gloo's transfers)
                "cpu_s_per_step": (
                    statistics.fmean(r["unsync_cpu_s"] for r in runs) / run0["steps"]
                    if all("unsync_cpu_s" in r for r in runs)
                    else None
                ),
                "attributed_total_s": attributed_total,
                **{f"{p}_s": phases[p] for p in PHASES},
                "inter_mb_sent_per_step": (
                    run0["bytes_sent_per_step"]["inter"] / 1e6 if run0.get("bytes_sent_per_step") else None
                ),
                "inter_mb_step_mean": statistics.fmean(inter) / 1e6 if inter else None,
                "inter_mb_step_peak": max(inter) / 1e6 if inter else None,
            }
        )
        sleeps = [r["accel_sleep_per_step"] for r in runs if r.get("accel_sleep_per_step")]
        if sleeps:  # the slowest rank's delivered compute per step
            row["accel_asked_s"] = max(x["asked"] for x in sleeps)
            row["accel_slept_s"] = max(x["slept"] for x in sleeps)
        rows.append(row)
    merged = _merge_repeats(rows)
    _add_ratios(merged)
    return merged


def _key(r: dict, schedule: str | None = None) -> tuple:
    return (r["model"], r["bucket_mb"], r.get("compute", "cpu"), schedule or r["schedule"])


def _merge_repeats(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for rs in groups.values():
        row = dict(rs[0])
        for k in rs[0]:
            if k in ("bucket_mb", "grad_mb", "whole_sync_mb"):
                continue
            vals = [r[k] for r in rs if isinstance(r[k], float)]
            if vals:
                row[k] = statistics.median(vals)
        row["repeats"] = len(rs)
        row["step_s_runs"] = ";".join(f"{r['step_s']:.4f}" for r in rs if r["step_s"] is not None)
        row["step_durations_s"] = ";".join(r["step_durations_s"] for r in rs if r.get("step_durations_s"))
        out.append(row)
    return out


def _add_ratios(rows: list[dict]) -> None:
    """Ratios against DDP and post-local SGD at the same k, always within one compute model."""
    by = {_key(r): r for r in rows}

    def ratio(r: dict, ref: dict | None) -> float | None:
        if ref is None or r["step_s"] is None or not ref["step_s"]:
            return None
        return r["step_s"] / ref["step_s"]

    for r in rows:
        r["vs_ddp"] = ratio(r, by.get(_key(r, "ddp")))
        post = None
        if r["kind"] in ("hiersync", "postlocal") and r["period"] and r["period"] > 1:
            post = by.get(_key(r, f"postlocal_k{r['period']}"))
        r["vs_postlocal"] = ratio(r, post)


# (issue, compute models, schedule, statistic, reference, reference statistic, bound)
TARGETS: tuple[tuple[str, tuple[str, ...], str, str, str, str, float], ...] = (
    # issue 12 "Must show": on accelerator-like compute, where communication can hide
    ("12", ("accel",), "hiersync_p4_stream", "mean", "intra_only", "mean", 1.10),
    ("12", ("accel",), "hiersync_p4_stream", "p99", "intra_only", "mean", 1.25),
    ("12", ("accel",), "hiersync_p4_stream", "mean", "ddp", "mean", 0.30),
    ("12", ("accel",), "hiersync_p4_stream", "mean", "postlocal_k4", "mean", 0.65),
    ("12", ("accel",), "intra_only", "mean", "postlocal_k4", "p50", 1.00),
    ("12", ("accel",), "hiersync_p4_stream", "peak", "whole_sync", "peak", 0.30),
    ("12", ("cpu",), "hiersync_p4_stream", "mean", "hiersync_p4", "mean", 1.00),
    # issue 5, on both compute models
    ("5", ("cpu", "accel"), "hiersync_p4_overlap", "mean", "ddp", "mean", 0.30),
    ("5", ("cpu", "accel"), "hiersync_p4_overlap", "mean", "postlocal_k4", "mean", 0.55),
    ("5", ("cpu", "accel"), "hiersync_p1", "mean", "ddp", "mean", 0.80),
)
_STAT = {"mean": "step_s", "p50": "step_p50_s", "p99": "step_p99_s", "peak": "inter_mb_step_peak"}


def _whole_sync(by: dict, model: str, bucket: float, compute: str, row: dict) -> tuple[float | None, str]:
    """A whole-model inter-node sync's MB per rank: hiersync_p4's peak step in the same run, else the formula."""
    p4 = by.get((model, bucket, compute, "hiersync_p4"))
    if p4 is not None and p4.get("inter_mb_step_peak"):
        return p4["inter_mb_step_peak"], "hiersync_p4's sync step"
    return row.get("whole_sync_mb"), "one whole-model fp32 rail average, 2(N-1)/N * 4P/L"


def check_targets(rows: Sequence[dict]) -> list[dict]:
    """The issues' targets, per model and bucket size, where both schedules ran (reports, not assertions).

    Every ratio compares rows of one compute model. ``met`` is None where a schedule ran but
    has no number (not supported by the installed hiersync).
    """
    by = {_key(r): r for r in rows}
    out = []
    seen = list(dict.fromkeys((r["model"], r["bucket_mb"], r.get("compute", "cpu")) for r in rows))
    for issue, computes, sched, stat, ref, ref_stat, bound in TARGETS:
        for model, bucket, compute in seen:
            if compute not in computes:
                continue
            a = by.get((model, bucket, compute, sched))
            if a is None:
                continue
            if ref == "whole_sync":
                ref_value, ref_name = _whole_sync(by, model, bucket, compute, a)
            else:
                b = by.get((model, bucket, compute, ref))
                if b is None:
                    continue
                ref_value = None if b["unsupported"] else b[_STAT[ref_stat]]
                ref_name = f"{ref} {ref_stat}"
            value = None if a["unsupported"] else a[_STAT[stat]]
            ratio = value / ref_value if value is not None and ref_value else None
            unit = "MB" if stat == "peak" else "s"
            out.append(
                {
                    "issue": issue,
                    "model": model,
                    "bucket_mb": bucket,
                    "compute": compute,
                    "schedule": sched,
                    "statistic": stat,
                    "reference": ref,
                    "reference_statistic": ref_stat,
                    "reference_name": ref_name,
                    "value": value,
                    "reference_value": ref_value,
                    "unit": unit,
                    "ratio": ratio,
                    "target": bound,
                    "met": None if ratio is None else ratio <= bound,
                    "why_not": a["unsupported"] if a["unsupported"] else None,
                }
            )
    return out


def format_targets(targets: Sequence[dict]) -> str:
    """One line per target: PASS/FAIL (or n/a) with both numbers and the ratio against the bound."""
    lines = []
    for t in targets:
        what = f"{t['schedule']} {t['statistic']} <= {t['target']:.2f}x {t['reference_name']}"
        where = f"[issue {t['issue']}, {t['compute']}, {t['model']}, {t['bucket_mb']:g} MB buckets]"
        if t["met"] is None:
            why = t["why_not"] or "no number"
            lines.append(f"n/a   {what} {where}: {why}")
            continue
        fmt = ".1f" if t["unit"] == "MB" else ".3f"
        lines.append(
            f"{'PASS' if t['met'] else 'FAIL'}  {what} {where}: {t['value']:{fmt}} {t['unit']} / "
            f"{t['reference_value']:{fmt}} {t['unit']} = {t['ratio']:.2f}x"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- outputs
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
    ]
    lines: list[str] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["bucket_mb"], r.get("compute", "cpu")), []).append(r)
    for (model, bucket, compute), rs in groups.items():
        size = f"{rs[0]['num_params'] / 1e6:.1f}M params, {rs[0]['grad_mb']:.0f} MB fp32 grads"
        title = f"{model} ({size}), bucket {bucket:g} MB, compute {compute}: {COMPUTE_LABELS.get(compute, compute)}"
        body = []
        modelled = False
        for r in rs:
            if r["unsupported"]:
                body.append([r["schedule"], r.get("compute", "cpu"), "not supported by this hiersync version"])
                continue
            star = "*" if r.get("inter_source") == "modelled" else ""
            modelled = modelled or bool(star)
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
            )
        if markdown:
            lines += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(b + [""] * (len(head) - len(b))) + " |" for b in body]
            if modelled:
                lines += ["", MODELLED_NOTE]
            note = _sleep_note(rs)
            if note:
                lines += ["", note]
            lines.append("")
        else:
            full = [b for b in body if len(b) == len(head)]
            widths = [max(len(str(x)) for x in col) for col in zip(head, *full)]
            widths[0] = max([widths[0]] + [len(b[0]) for b in body])
            widths[1] = max([widths[1]] + [len(b[1]) for b in body])
            lines.append(title)
            lines.append("  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
            for b in body:
                lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
            if modelled:
                lines.append(MODELLED_NOTE)
            note = _sleep_note(rs)
            if note:
                lines.append(note)
            lines.append("")
    return "\n".join(lines)


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


def _plots(rows: Sequence[dict]) -> dict[str, bytes]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("bench: matplotlib is not installed (pip install 'hiersync[bench]'); no plots")
        return {}
    out: dict[str, bytes] = {}
    rows = [r for r in rows if r["step_s"] is not None]  # schedules the installed hiersync could not run
    if not rows:
        return out
    models = list(dict.fromkeys(r["model"] for r in rows))
    series = list(dict.fromkeys((r["schedule"], r.get("compute", "cpu")) for r in rows))
    computes = {c for _, c in series}
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for sched, compute in series:
            pts = sorted(
                (r["bucket_mb"], r["step_s"])
                for r in rows
                if r["model"] == model and r["schedule"] == sched and r.get("compute", "cpu") == compute
            )
            if pts:
                style = "--" if sched in ("ddp", "intra_only", "compute_only") or sched.startswith("postlocal") else "-"
                label = sched if len(computes) == 1 else f"{sched} [{compute}]"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("DDP bucket size (MB)")
        ax.set_ylabel("step time (s, unsynchronized)")
        ax.set_title(f"{model}: step time vs bucket size")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out["step_time_vs_bucket.png"] = _png(fig)
    plt.close(fig)

    keys = list(dict.fromkeys((r["model"], r["bucket_mb"], r.get("compute", "cpu")) for r in rows))
    # one breakdown per model and compute model, at the bucket size closest to 25 MB
    picks = []
    for model, compute in dict.fromkeys((k[0], k[2]) for k in keys):
        buckets = sorted({k[1] for k in keys if k[0] == model and k[2] == compute})
        picks.append((model, compute, min(buckets, key=lambda b: abs(math.log(b / 25.0)))))
    fig, axes = plt.subplots(1, len(picks), figsize=(7 * len(picks), 4.5), squeeze=False)
    colors = {"data": "#bbbbbb", "forward": "#4c72b0", "backward": "#55a868", "comm": "#c44e52", "optimizer": "#8172b2"}
    for ax, (model, compute, bucket) in zip(axes[0], picks):
        rs = [
            r for r in rows if r["model"] == model and r["bucket_mb"] == bucket and r.get("compute", "cpu") == compute
        ]
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
        ax.set_title(f"{model}, {bucket:g} MB buckets, {compute} compute: attributed step breakdown", fontsize=9)
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
    model = raw.get("model") or {}
    if model.get("entries"):
        md += ["", "```", format_comparison(model["entries"], model["source"])]
        if model.get("targets"):
            md.append(format_model_targets(model["targets"]))
        md += ["```", ""]
    paths.append(atomic_write_text(d / "bench.md", "\n".join(md)))
    if plots and rows:
        for name, data in _plots(rows).items():
            paths.append(atomic_write_bytes(d / name, data))
    return paths
