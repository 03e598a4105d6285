"""``python -m hiersync project``: predicted all-reduce and step times from 8 to 1024 GPUs.

For each preset and cluster size (8 GPUs per node by default) it tabulates the flat ring,
the flat tree (each forced, as ``NCCL_ALGO`` does, in its fastest protocol) and hiersync's
two-level all-reduce of one message (:func:`hiersync.costmodel.predict_allreduce`), the step time of
DDP (ring, tree), hiersync k=1 (two-level), hiersync k=2/4/8 and streaming hiersync
(``HierState(period=4, fragments=4, overlap=1)``), and the bytes one rank sends between
nodes in its busiest step (DDP, k=4 whole-model, k=4 streaming) and on average (k=4).
``--out DIR`` writes ``projection.csv``, ``projection.md`` and ``projection.png`` atomically.

Example::

    python -m hiersync project --params 7e9 --backward-ms 300 --out docs/img

    >>> rows = project(["emulated"], gpus=(8, 16), grad_bytes=100e6, backward_s=0.3)
    >>> [r["gpus"] for r in rows]
    [8, 16]
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hiersync import costmodel as cm
from hiersync._table import render
from hiersync.vocab import MiB

from .planner import DTYPE_BYTES, copy_s_per_byte

__all__ = ["COLUMNS", "project", "to_csv", "to_markdown", "plot", "add_arguments", "run"]

logger = logging.getLogger(__name__)

DEFAULT_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
ALLREDUCE_COLUMNS = {"ar_ring_ms": "ring", "ar_tree_ms": "tree", "ar_two_level_ms": "two-level"}
STEP_COLUMNS = {
    "step_ring_ms": "DDP ring",
    "step_tree_ms": "DDP tree",
    "step_k1_ms": "hiersync k=1",
    "step_k2_ms": "hiersync k=2",
    "step_k4_ms": "hiersync k=4",
    "step_k8_ms": "hiersync k=8",
    "step_k4_F4_tau1_ms": "hiersync k=4 F=4 tau=1",
}
STREAMING = {"period": 4, "fragments": 4, "overlap": 1}
"""The streaming configuration of the ``step_k4_F4_tau1_ms`` and ``peak_k4_F4_MB`` columns."""
BYTES_COLUMNS = {
    "peak_ddp_MB": "DDP, busiest step",
    "peak_k4_MB": "hiersync k=4, busiest step",
    "peak_k4_F4_MB": "hiersync k=4 F=4 tau=1, busiest step",
    "mean_k4_MB": "hiersync k=4, per step on average (whole-model or streaming)",
}
"""Bytes (MiB) one rank sends between nodes per step (bandwidth-optimal accounting)."""
COLUMNS = ("preset", "gpus", "nodes", *ALLREDUCE_COLUMNS, *STEP_COLUMNS, *BYTES_COLUMNS)


def project(
    presets: Sequence[str],
    *,
    grad_bytes: float,
    backward_s: float,
    gpus: Sequence[int] = DEFAULT_GPUS,
    gpus_per_node: int = 8,
    message_bytes: float = 25 * MiB,
    bucket_bytes: float = 25 * MiB,
    compress_ratio: float = 1.0,
    placement: str = "hook",
    copy_s_per_byte: float = cm.DEFAULT_COPY_S_PER_BYTE,
) -> list[dict[str, Any]]:
    """One row per preset x GPU count; times in milliseconds, bytes in MiB (see :data:`COLUMNS`).

    ``placement`` applies to the whole-model k=2/4/8 columns; the streaming column runs
    after ``optimizer.step()`` (:data:`STREAMING`), its copies at ``copy_s_per_byte``.
    """
    rows = []
    for name in presets:
        base = cm.get_preset(name)
        for count in gpus:
            if count % gpus_per_node:
                raise ValueError(f"GPU count {count} is not a multiple of gpus_per_node={gpus_per_node}")
            nodes = count // gpus_per_node
            profile = replace(base, nodes=nodes, ranks_per_node=gpus_per_node)
            row: dict[str, Any] = {"preset": name, "gpus": count, "nodes": nodes}
            row["ar_ring_ms"] = cm.predict_allreduce(message_bytes, profile, "ring") * 1e3
            row["ar_tree_ms"] = cm.predict_allreduce(message_bytes, profile, "tree") * 1e3
            row["ar_two_level_ms"] = sum(cm.predict_two_level(message_bytes, profile)) * 1e3
            kw: dict[str, Any] = dict(
                profile=profile, grad_bytes=grad_bytes, bucket_bytes=bucket_bytes, backward_s=backward_s
            )
            ddp = cm.step_time("ddp", algorithm="ring", **kw)
            row["step_ring_ms"] = ddp.step_s * 1e3
            row["step_tree_ms"] = cm.step_time("ddp", algorithm="tree", **kw).step_s * 1e3
            for k in (1, 2, 4, 8):
                st = cm.step_time("hiersync", period=k, compress_ratio=compress_ratio, placement=placement, **kw)
                row[f"step_k{k}_ms"] = st.step_s * 1e3
                if k == STREAMING["period"]:
                    row["peak_k4_MB"], row["mean_k4_MB"] = st.inter_bytes_peak / MiB, st.inter_bytes_mean / MiB
            stream = cm.step_time(
                "hiersync",
                period=STREAMING["period"],
                fragments=STREAMING["fragments"],
                overlap=STREAMING["overlap"],
                compress_ratio=compress_ratio,
                copy_s_per_byte=copy_s_per_byte,
                **kw,
            )
            row["step_k4_F4_tau1_ms"] = stream.step_s * 1e3
            row["peak_ddp_MB"] = ddp.inter_bytes_peak / MiB
            row["peak_k4_F4_MB"] = stream.inter_bytes_peak / MiB
            rows.append(row)
    return rows


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _fmt(row[k]) for k in COLUMNS})
    return buf.getvalue()


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table: the preset's name, then its numbers (as :func:`to_csv` writes them)."""
    return render(COLUMNS, [[_fmt(row[k]) for k in COLUMNS] for row in rows], markdown=True) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Write a PNG: all-reduce time (top) and step time (bottom) vs GPUs, one column per preset."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "the projection plot needs matplotlib: pip install matplotlib (or pip install 'hiersync[plot]')"
        ) from err
    from hiersync._io import atomic_save

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(2, len(presets), figsize=(4.2 * len(presets), 7.5), squeeze=False)
    for col, name in enumerate(presets):
        mine = [r for r in rows if r["preset"] == name]
        x = [r["gpus"] for r in mine]
        for ax, columns, ylabel in (
            (axes[0][col], ALLREDUCE_COLUMNS, "all-reduce time (ms)"),
            (axes[1][col], STEP_COLUMNS, "step time (ms)"),
        ):
            for key, label in columns.items():
                ax.plot(x, [r[key] for r in mine], marker="o", markersize=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("GPUs")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].set_title(name)
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        return atomic_save(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", default=",".join(cm.PRESETS), help="comma-separated (default: all)")
    parser.add_argument("--params", type=float, default=7e9, help="parameter count (default 7e9)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="gradient dtype (default bf16)")
    parser.add_argument("--backward-ms", type=float, default=300.0, help="backward time per step (default 300)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (default 25)")
    parser.add_argument("--message-mb", type=float, default=25.0, help="all-reduce message size (default 25)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="default 8")
    parser.add_argument("--max-gpus", type=int, default=1024, help="largest cluster (default 1024)")
    parser.add_argument("--compress", choices=["none", "bf16"], default="none", help="16-bit sync deltas")
    parser.add_argument("--placement", choices=list(cm.PLACEMENTS), default="hook", help="period-k sync placement")
    parser.add_argument(
        "--copy-gbps", type=float, default=0.0, help="speed of the streaming launch copies, GB/s (default 0 = free)"
    )
    parser.add_argument("--out", metavar="DIR", help="write projection.{csv,md,png} here")


def run(args: argparse.Namespace) -> int:
    from hiersync._io import atomic_write_text

    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if args.gpus_per_node < 1 or args.max_gpus < args.gpus_per_node:
        raise ValueError(f"need 1 <= --gpus-per-node <= --max-gpus, got {args.gpus_per_node} and {args.max_gpus}")
    # one node, then doubling the node count up to --max-gpus
    gpus = [args.gpus_per_node * 2**i for i in range(64) if args.gpus_per_node * 2**i <= args.max_gpus]
    grad_bytes = args.params * DTYPE_BYTES[args.dtype]
    rows = project(
        presets,
        grad_bytes=grad_bytes,
        backward_s=args.backward_ms / 1e3,
        gpus=gpus,
        gpus_per_node=args.gpus_per_node,
        message_bytes=args.message_mb * MiB,
        bucket_bytes=args.bucket_mb * MiB,
        compress_ratio=1.0 if args.compress == "none" else min(1.0, 2 / DTYPE_BYTES[args.dtype]),
        placement=args.placement,
        copy_s_per_byte=copy_s_per_byte(args.copy_gbps),
    )
    caption = (
        f"{args.params:g} params {args.dtype} ({grad_bytes / 1e9:g} GB), backward {args.backward_ms:g} ms, "
        f"bucket {args.bucket_mb:g} MB, all-reduce of {args.message_mb:g} MB, {args.gpus_per_node} GPUs/node; "
        f"*_MB: MiB one rank sends between nodes per step"
    )
    table = to_markdown(rows)
    print(caption)
    print(table)
    if args.out:
        out = Path(args.out)
        atomic_write_text(out / "projection.csv", to_csv(rows))
        atomic_write_text(out / "projection.md", f"{caption}\n\n{table}")
        plot(rows, out / "projection.png", title=caption)
        logger.info("wrote %s/projection.{csv,md,png}", out)
    return 0
