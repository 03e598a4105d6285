"""The plots of ``python -m hiersync bench``: step time vs bucket size, and the attributed step breakdown.

Needs matplotlib (``pip install 'hiersync[bench]'``); without it, no plots and a warning.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from typing import Any

from .bench_rows import PHASES

__all__ = ["plots"]

logger = logging.getLogger(__name__)


def plots(rows: Sequence[dict]) -> dict[str, bytes]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("bench: matplotlib is not installed (pip install 'hiersync[bench]'); no plots")
        return {}
    """PNG bytes by file name (empty without matplotlib or rows with numbers)."""
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
