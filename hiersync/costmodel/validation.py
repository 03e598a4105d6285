"""The cost model against published all-reduce measurements that nobody here made.

Each row of the table (``benchmarks/data/published_allreduce.csv``: nccl-tests tables and
statements from NVIDIA/nccl and NVIDIA/nccl-tests issues, stas00/ml-engineering, an AWS p5
EFA benchmark repository, a GCP A3 Mega result) names its hardware, nodes, GPUs and NICs per
node, NIC rate, message size, and a measured time or bus bandwidth. :func:`row_profile`
turns a row into a :class:`~.profile.Profile`: the ``h100-8rail`` preset for Hopper GPUs
or ``a100-1nic`` for Ampere, given the row's shape, its NICs at :data:`NIC_EFFICIENCY` of
their line rate, and its fabric's plugin latency (:data:`FABRIC_NET_LATENCY_US`).
:func:`score` compares :func:`~.predict.predict_allreduce` with every row; :func:`medians`
gives the median ``|predicted / measured - 1|`` per regime over the clean rows (no flag
``degraded``, ``torch`` or ``statement``).

No constant of the model was fitted to these rows. Two things were taken from some of them
and those rows are kept out of the held-out medians (:data:`INFORMED_ROWS`): the TCPXO
plugin latency, which nobody publishes, solved from the A3 Mega 16-byte row, and the choice
to give single-node NVLS NCCL's mid-size tree correction, which the 8 x H200 rows from 2 to
256 MiB showed. Pure: no torch.

Example::

    >>> points = score(load_rows(DEFAULT_CSV))  # doctest: +SKIP
    >>> medians(points)["intra"]  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .links import Link
from .predict import explain_allreduce, predict_allreduce
from .profile import PRESETS, Profile

__all__ = [
    "DEFAULT_CSV",
    "REGIMES",
    "EXCLUDED_FLAGS",
    "NIC_EFFICIENCY",
    "FABRIC_NET_LATENCY_US",
    "INFORMED_ROWS",
    "PEAK_SWEEP_END",
    "Row",
    "Point",
    "load_rows",
    "fabric_of",
    "row_profile",
    "score",
    "medians",
    "format_report",
]

DEFAULT_CSV = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "published_allreduce.csv"
"""The table, copied into the repository from the project's shared data."""
REGIMES = ("intra", "inter-bw", "inter-mid", "latency")
"""As the rows label them: one node above 1 MiB; across nodes at 512 MiB and up (or a sweep's
peak); across nodes 1-512 MiB; below ~1 MiB."""
EXCLUDED_FLAGS = ("degraded", "torch", "statement")
"""Rows left out of the medians: a thread about a slow cluster, a torch-timed (not nccl-tests)
figure, and a maintainer's round number rather than a measurement."""
NIC_EFFICIENCY = 0.94
"""Achieved fraction of a NIC's line rate: 400 Gb/s NDR moves 46-48 GB/s of 50 (published
anchor, also the h100-8rail preset's 47 GB/s)."""
FABRIC_NET_LATENCY_US = {"infiniband": 0.0, "efa": 75.0, "tcpxo": 49.0}
"""The latency each fabric's network plugin reports to NCCL (:attr:`Profile.net_latency_us`):
NCCL's own InfiniBand/RoCE transport reports 0; aws-ofi-nccl sets 75 us on p4d/p5 (its
platform table); GPUDirect-TCPXO's plugin is closed, so its value is solved from the A3 Mega
16-byte row (a tree/LL all-reduce: 25.2 + 2 x latency = 123.2 us)."""
INFORMED_ROWS = {
    "A3M-2n-16": "TCPXO plugin latency (FABRIC_NET_LATENCY_US['tcpxo'])",
    **{
        f"SB-H200x8-{2**k}": "NVLS's mid-size correction (nccl.NVLS_SIZE_CORRECTION), a choice these rows showed"
        for k in range(21, 29)
    },
}
"""Rows a constant was solved from, kept out of the held-out medians."""
PEAK_SWEEP_END = {
    "NT290-H100": 4 * 2**30,  # "sweep 128M-4G"
    "N1221-4n": 8 * 2**30,  # "-b 4G -e 8G"
    "N1368-5n-ring": 2**30,  # "-e 1G"
    "N1368-5n-tree": 2**30,
    "NT100-2n": 8 * 2**30,  # "(1G-8G)"
    "NT175-A100": 4 * 2**30,  # "(sweep 8 B-4 GB)"
}
"""Largest size of the sweep a ``peak`` row reports the best busbw of, where its note says;
16 GiB (nccl-tests runs to it, NVIDIA/nccl-tests#309's "sweep to 16 GB") otherwise."""
_DEFAULT_SWEEP_END = 16 * 2**30
_FORCED = {"ring": "ring", "tree": "tree", "auto": "auto"}


@dataclass(frozen=True)
class Row:
    """One published measurement."""

    id: str
    source: str
    hardware: str
    nodes: int
    gpus_per_node: int
    nics_per_node: int
    nic_gbps: float
    size_bytes: int | None
    """None for a ``peak`` row (the best busbw of a sweep)."""
    measured_time_us: float | None
    measured_busbw: float | None
    """GB/s."""
    algorithm: str
    regime: str
    flags: tuple[str, ...]
    note: str

    @property
    def clean(self) -> bool:
        return not any(f in EXCLUDED_FLAGS for f in self.flags)


@dataclass(frozen=True)
class Point:
    """A row, its prediction, and the ratio predicted / measured (of time; of 1/busbw for peaks)."""

    row: Row
    predicted: float
    """Seconds, or bus GB/s for a peak row."""
    measured: float
    ratio: float
    choice: str
    """The algorithm/protocol the model priced."""

    @property
    def error(self) -> float:
        return abs(self.ratio - 1.0)


def _number(text: str) -> float | None:
    text = text.strip()
    return float(text) if text else None


def load_rows(path: str | os.PathLike = DEFAULT_CSV) -> list[Row]:
    """The rows of a published-measurements CSV."""
    with open(path, newline="", encoding="utf-8") as f:
        out = []
        for r in csv.DictReader(f):
            size = r["size_bytes"].strip()
            out.append(
                Row(
                    id=r["id"],
                    source=r["source"],
                    hardware=r["hardware"],
                    nodes=int(r["nodes"]),
                    gpus_per_node=int(r["gpus_per_node"]),
                    nics_per_node=int(r["nics_per_node"]),
                    nic_gbps=float(r["nic_gbps"]),
                    size_bytes=None if size == "peak" else int(size),
                    measured_time_us=_number(r["measured_time_us"]),
                    measured_busbw=_number(r["measured_busbw_GBps"]),
                    algorithm=r["algo_stated"].strip().lower() or "auto",
                    regime=r["regime"].strip(),
                    flags=tuple(f for f in r["flags"].split(";") if f),
                    note=r["note"],
                )
            )
    return out


def fabric_of(row: Row) -> str:
    """The row's fabric: ``"efa"``, ``"tcpxo"`` or ``"infiniband"`` (IB and RoCE: NCCL's own transport)."""
    text = row.hardware.lower()
    if "efa" in text or "p4dn" in text or "p5." in text:
        return "efa"
    if "tcpxo" in text:
        return "tcpxo"
    return "infiniband"


def row_profile(row: Row) -> Profile:
    """The preset for the row's GPU, on the row's shape, NICs and fabric."""
    text = row.hardware.lower()
    base = PRESETS["a100-1nic"] if "a100" in text or "p4d" in text else PRESETS["h100-8rail"]
    nic = Link(base.inter.alpha, 1.0 / (row.nic_gbps / 8 * NIC_EFFICIENCY * 1e9))
    return replace(
        base,
        nodes=row.nodes,
        ranks_per_node=row.gpus_per_node,
        rails=row.nics_per_node,
        inter=nic,
        net_latency_us=FABRIC_NET_LATENCY_US[fabric_of(row)],
        name=row.id,
    )


def _busbw(nbytes: float, seconds: float, ranks: int) -> float:
    return nbytes / seconds * (2 * (ranks - 1) / ranks) / 1e9


def _predict(row: Row) -> Point:
    profile = row_profile(row)
    algo = _FORCED.get(row.algorithm, "auto")
    ranks = row.nodes * row.gpus_per_node
    if row.size_bytes is None:  # peak busbw of a sweep: the best the model gives up to its end
        end = PEAK_SWEEP_END.get(row.id, _DEFAULT_SWEEP_END)
        sizes = [2**k for k in range(20, 40) if 2**k <= end]
        best = max(sizes, key=lambda n: _busbw(n, predict_allreduce(n, profile, algo), ranks))
        busbw = _busbw(best, predict_allreduce(best, profile, algo), ranks)
        assert row.measured_busbw is not None, row.id
        return Point(row, busbw, row.measured_busbw, row.measured_busbw / busbw, explain_allreduce(best, profile, algo))
    seconds = predict_allreduce(row.size_bytes, profile, algo)
    if row.measured_time_us is not None:
        measured = row.measured_time_us * 1e-6
    else:
        assert row.measured_busbw is not None, row.id
        measured = row.size_bytes / (row.measured_busbw * 1e9 / (2 * (ranks - 1) / ranks))
    choice = explain_allreduce(row.size_bytes, profile, algo)
    return Point(row, seconds, measured, seconds / measured, choice)


def score(rows: Iterable[Row]) -> list[Point]:
    """Every row with the model's prediction."""
    return [_predict(r) for r in rows]


def medians(points: Sequence[Point], *, held_out: bool = False) -> dict[str, tuple[float, int]]:
    """Median ``|ratio - 1|`` and the number of points per regime, over the clean rows
    (``held_out``: also without :data:`INFORMED_ROWS`)."""
    out = {}
    for regime in REGIMES:
        errors = [
            p.error
            for p in points
            if p.row.regime == regime and p.row.clean and not (held_out and p.row.id in INFORMED_ROWS)
        ]
        out[regime] = (statistics.median(errors) if errors else math.nan, len(errors))
    return out


def _fmt_size(row: Row) -> str:
    if row.size_bytes is None:
        return "peak"
    n = row.size_bytes
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def format_report(points: Sequence[Point], *, worst: int = 8) -> str:
    """Per-regime medians (clean and held-out rows), every point's ratio, and the worst points."""
    lines = ["median |predicted/measured - 1| per regime (clean rows; held out = without rows a constant came from):"]
    clean, held = medians(points), medians(points, held_out=True)
    for regime in REGIMES:
        (m, n), (mh, nh) = clean[regime], held[regime]
        lines.append(f"  {regime:<10} {m:6.1%} over {n:2d} points   held out {mh:6.1%} over {nh:2d}")
    lines += [
        "",
        f"{'id':<22} {'regime':<10} {'N x L':>6} {'NICs':>9} {'size':>9} {'measured':>12} {'predicted':>12} "
        f"{'ratio':>6}  model's choice  flags",
    ]
    for p in points:
        r = p.row
        unit = "GB/s" if r.size_bytes is None else "us"
        scale = 1.0 if r.size_bytes is None else 1e6
        flags = ",".join(r.flags) + (" informed" if r.id in INFORMED_ROWS else "")
        lines.append(
            f"{r.id:<22} {r.regime:<10} {r.nodes:>3}x{r.gpus_per_node:<2} {r.nics_per_node:>2}x{r.nic_gbps:<4g}G "
            f"{_fmt_size(r):>9} {p.measured * scale:>9.1f} {unit:<3}{p.predicted * scale:>9.1f} {unit:<3}"
            f"{p.ratio:>6.2f}  {p.choice:<15} {flags}"
        )
    ranked = sorted((p for p in points if p.row.clean), key=lambda p: p.error, reverse=True)[:worst]
    lines += ["", f"worst {len(ranked)} clean points:"]
    lines += [f"  {p.row.id:<22} {p.ratio:5.2f}x  {p.choice:<15} {p.row.hardware} ({p.row.source})" for p in ranked]
    return "\n".join(lines)
