"""The cost model against published all-reduce measurements that nobody here made.

Each row of the table (``benchmarks/data/published_allreduce.csv``: nccl-tests tables and
statements from NVIDIA/nccl and NVIDIA/nccl-tests issues, stas00/ml-engineering, AWS's and
Oracle's benchmark repositories, a GCP A3 Mega result) names its source, hardware, nodes,
GPUs and NICs per node, NIC rate, message size, and a measured time or bus bandwidth.
:func:`row_profile` turns a row into a :class:`~.profile.Profile`: the ``h100-8rail``
preset for Hopper GPUs or ``a100-1nic`` for Ampere, given the row's shape, its NICs at
:data:`NIC_EFFICIENCY` of their line rate, and its fabric (:func:`fabric_of`).

One number is taken from data at all: the step latency of a fabric behind a network plugin
(:data:`FITTED_FABRICS`: AWS EFA on p4d and on p5, GCP's GPUDirect-TCPXO), which nobody
publishes and ``python -m hiersync calibrate`` measures on a real cluster.
:func:`fit_latencies` solves it from a set of rows. :func:`leave_one_source_out` is the
honest score: for every source, the latencies are fitted on all the *other* sources and
its rows predicted with them (a fabric no other source measured gets
:data:`DEFAULT_LATENCY_US`). :func:`medians` gives the median ``|predicted / measured - 1|``
per regime over the clean rows (no flag ``degraded``, ``torch`` or ``statement``).
Pure: no torch.

Example::

    >>> rows = load_rows(DEFAULT_CSV)  # doctest: +SKIP
    >>> medians(leave_one_source_out(rows))["inter-mid"]  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .fit import _golden
from .links import Link
from .predict import explain_allreduce, predict_allreduce
from .profile import PRESETS, Profile

__all__ = [
    "DEFAULT_CSV",
    "REGIMES",
    "EXCLUDED_FLAGS",
    "NIC_EFFICIENCY",
    "FABRICS",
    "AMD_HOSTS",
    "FITTED_FABRICS",
    "REPORTED_LATENCY_US",
    "DEFAULT_LATENCY_US",
    "PEAK_SWEEP_END",
    "Row",
    "Point",
    "load_rows",
    "fabric_of",
    "host_cpu_of",
    "row_profile",
    "fit_latencies",
    "score",
    "leave_one_source_out",
    "medians",
    "format_report",
]

DEFAULT_CSV = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "published_allreduce.csv"
"""The table, copied into the repository from the project's shared data."""
REGIMES = ("intra", "inter-bw", "inter-mid", "latency")
"""As the rows label them: one node above 1 MiB; across nodes at 512 MiB and up (or a sweep's
peak); across nodes 1-512 MiB; 1 MiB and below."""
EXCLUDED_FLAGS = ("degraded", "torch", "statement")
"""Rows left out of the medians (and of every fit): a thread about a slow cluster, a
torch-timed (not nccl-tests) figure, and a maintainer's round number rather than a measurement."""
NIC_EFFICIENCY = 0.94
"""Achieved fraction of a NIC's line rate: 400 Gb/s NDR moves 46-48 GB/s of 50 (published
anchor, also the h100-8rail preset's 47 GB/s)."""
FABRICS = ("infiniband", "efa-p4", "efa-p5", "tcpxo")
"""InfiniBand and RoCE (NCCL's own transport); AWS EFA on p4d/p4de (EFA v1, 4 x 100 Gb/s) and
on p5 (EFA v2, 32 x 100 Gb/s); GCP's GPUDirect-TCPXO (A3 Mega)."""
AMD_HOSTS = ("p5.", "bm.gpu4.8", "bm.gpu.b4.8")
"""Instance types whose hosts are AMD EPYC (AWS p5: EPYC 7R13; OCI BM.GPU4.8: EPYC 7542;
BM.GPU.B4.8: EPYC 7J13), as their vendors list them; every other row is taken as Intel x86,
NCCL's default (:attr:`Profile.host_cpu`)."""
FITTED_FABRICS = ("efa-p4", "efa-p5", "tcpxo")
"""Fabrics whose step latency (:attr:`Profile.net_latency_us`) is solved from rows; NCCL's
network hop constants describe InfiniBand and RoCE, which add nothing to them."""
REPORTED_LATENCY_US = {"efa-p4": 75.0, "efa-p5": 75.0}
"""What each plugin reports to NCCL's tuner (:attr:`Profile.tuner_net_latency_us`):
aws-ofi-nccl's platform table gives 75 us for p4d, p4de and p5. TCPXO's plugin is closed."""
DEFAULT_LATENCY_US = {"infiniband": 0.0, "efa-p4": 75.0, "efa-p5": 75.0, "tcpxo": 0.0}
"""A fabric's step latency when no row informs it: none on InfiniBand/RoCE; the plugin's
reported value where it publishes one; otherwise 0, NCCL's own network model."""
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
_LATENCY_SEARCH_US = (0.0, 400.0)


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
    """The row's fabric (:data:`FABRICS`), read from its hardware column."""
    text = row.hardware.lower()
    if "p4d" in text:
        return "efa-p4"
    if "p5." in text:
        return "efa-p5"
    if "tcpxo" in text:
        return "tcpxo"
    return "infiniband"


def host_cpu_of(row: Row) -> str:
    """``"amd"`` for the instance types of :data:`AMD_HOSTS`, else ``"intel"``."""
    text = row.hardware.lower()
    return "amd" if any(name in text for name in AMD_HOSTS) else "intel"


def row_profile(row: Row, latencies: Mapping[str, float] | None = None) -> Profile:
    """The preset for the row's GPU, on the row's shape, NICs, fabric and host CPU.

    ``latencies``: the fabric's step latency per fabric (:func:`fit_latencies`); missing ones
    are :data:`DEFAULT_LATENCY_US`.
    """
    text = row.hardware.lower()
    base = PRESETS["a100-1nic"] if "a100" in text or "p4d" in text else PRESETS["h100-8rail"]
    nic = Link(base.inter.alpha, 1.0 / (row.nic_gbps / 8 * NIC_EFFICIENCY * 1e9))
    fabric = fabric_of(row)
    measured = (latencies or {}).get(fabric, DEFAULT_LATENCY_US[fabric])
    return replace(
        base,
        nodes=row.nodes,
        ranks_per_node=row.gpus_per_node,
        rails=row.nics_per_node,
        inter=nic,
        net_latency_us=measured,
        tuner_net_latency_us=REPORTED_LATENCY_US.get(fabric),
        host_cpu=host_cpu_of(row),
        name=row.id,
    )


def _busbw(nbytes: float, seconds: float, ranks: int) -> float:
    return nbytes / seconds * (2 * (ranks - 1) / ranks) / 1e9


def _predict(row: Row, latencies: Mapping[str, float] | None) -> Point:
    profile = row_profile(row, latencies)
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


def fit_latencies(rows: Iterable[Row]) -> dict[str, float]:
    """The step latency (us) of each of :data:`FITTED_FABRICS`, read from the clean latency-bound
    rows (1 MiB and below) across nodes in ``rows``: the value whose predictions have the least
    squared log error over them, by golden-section search over 0-400 us. Larger messages do not
    inform it: a latency that made up for a bandwidth the model misses would fit those rows, not
    the fabric. Fabrics without such rows are left out."""
    by_fabric: dict[str, list[Row]] = {}
    for r in rows:
        if r.clean and r.regime == "latency" and r.nodes > 1 and fabric_of(r) in FITTED_FABRICS:
            by_fabric.setdefault(fabric_of(r), []).append(r)
    out = {}
    for fabric, members in sorted(by_fabric.items()):

        def loss(us: float, fabric: str = fabric, members: list[Row] = members) -> float:
            return sum(math.log(_predict(r, {fabric: us}).ratio) ** 2 for r in members)

        out[fabric] = round(_golden(loss, *_LATENCY_SEARCH_US, steps=25), 1)
    return out


def score(rows: Iterable[Row], latencies: Mapping[str, float] | None = None) -> list[Point]:
    """Every row with the model's prediction, on ``latencies`` (default: :func:`fit_latencies`
    of these same rows: in-sample)."""
    rows = list(rows)
    return [_predict(r, fit_latencies(rows) if latencies is None else latencies) for r in rows]


def leave_one_source_out(rows: Iterable[Row]) -> list[Point]:
    """Every row predicted with the latencies fitted on the rows of all *other* sources.

    A source is one publication (its ``source`` column): an issue thread's poster, a
    repository's README. With nothing fitted this would equal :func:`score` with the
    defaults; here it holds out the one number taken from data.
    """
    rows = list(rows)
    by_source: dict[str, list[Row]] = {}
    for r in rows:
        by_source.setdefault(r.source, []).append(r)
    predicted = {}
    for source, members in by_source.items():
        latencies = fit_latencies(r for r in rows if r.source != source)
        for r in members:
            predicted[id(r)] = _predict(r, latencies)
    return [predicted[id(r)] for r in rows]


def medians(points: Sequence[Point]) -> dict[str, tuple[float, int]]:
    """Median ``|ratio - 1|`` and the number of points per regime, over the clean rows."""
    out = {}
    for regime in REGIMES:
        errors = [p.error for p in points if p.row.regime == regime and p.row.clean]
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


def _summary(title: str, points: Sequence[Point]) -> list[str]:
    lines = [title]
    for regime, (m, n) in medians(points).items():
        lines.append(f"  {regime:<10} {m:6.1%} over {n:3d} rows")
    return lines


def format_report(rows: Sequence[Row], *, worst: int = 10, table: bool = True) -> str:
    """Per-regime medians (in sample and leave-one-source-out), the fitted latencies, every
    row's leave-one-source-out ratio (``table``) and the worst rows."""
    rows = list(rows)
    fitted = fit_latencies(rows)
    held_out = leave_one_source_out(rows)
    sources = len({r.source for r in rows})
    lines = _summary(
        f"leave-one-source-out: median |predicted/measured - 1| per regime ({len(rows)} rows, {sources} sources; "
        "each source predicted with fabric latencies fitted on the others):",
        held_out,
    )
    lines += _summary("in sample (fabric latencies fitted on every row):", score(rows, fitted))
    lines.append("per held-out source (clean rows; its fabric's latency as fitted on the others):")
    for source in sorted({r.source for r in rows}):
        errors = [p.error for p in held_out if p.row.source == source and p.row.clean]
        if not errors:
            continue
        fabrics = sorted({fabric_of(r) for r in rows if r.source == source and r.clean})
        others = fit_latencies(r for r in rows if r.source != source)
        used = ", ".join(f"{f} {others.get(f, DEFAULT_LATENCY_US[f]):g} us" for f in fabrics)
        lines.append(f"  {statistics.median(errors):6.1%} over {len(errors):2d} rows  {source} ({used})")
    lines.append(
        "fabric step latency fitted on every row (us): "
        + ", ".join(f"{f} {fitted.get(f, DEFAULT_LATENCY_US[f]):g}" for f in FABRICS)
        + " (infiniband is NCCL's own constants, not fitted)"
    )
    if table:
        lines += [
            "",
            f"{'id':<22} {'regime':<10} {'N x L':>6} {'NICs':>9} {'size':>9} {'measured':>12} {'predicted':>12} "
            f"{'ratio':>6}  model's choice  flags",
        ]
        for p in held_out:
            r = p.row
            unit = "GB/s" if r.size_bytes is None else "us"
            scale = 1.0 if r.size_bytes is None else 1e6
            lines.append(
                f"{r.id:<22} {r.regime:<10} {r.nodes:>3}x{r.gpus_per_node:<2} {r.nics_per_node:>2}x{r.nic_gbps:<4g}G "
                f"{_fmt_size(r):>9} {p.measured * scale:>9.1f} {unit:<3}{p.predicted * scale:>9.1f} {unit:<3}"
                f"{p.ratio:>6.2f}  {p.choice:<16} {','.join(r.flags)}"
            )
    ranked = sorted((p for p in held_out if p.row.clean), key=lambda p: p.error, reverse=True)[:worst]
    lines += ["", f"worst {len(ranked)} clean rows, leave-one-source-out (ratio = predicted / measured time):"]
    lines += [f"  {p.row.id:<22} {p.ratio:5.2f}x  {p.choice:<16} {p.row.hardware} ({p.row.source})" for p in ranked]
    return "\n".join(lines)
