"""The cost model against published all-reduce measurements that nobody here made.

Each row of the table (``benchmarks/data/published_allreduce.csv``: nccl-tests tables and
statements from NVIDIA/nccl and NVIDIA/nccl-tests issues, stas00/ml-engineering, AWS's and
Oracle's benchmark repositories, a GCP A3 Mega result) names its source, hardware, nodes,
GPUs and NICs per node, NIC rate, message size, and a measured time or bus bandwidth.
:func:`row_profile` turns a row into a :class:`~.profile.Profile`: the ``h100-8rail``
preset for Hopper GPUs or ``a100-1nic`` for Ampere, given the row's shape, its NICs at
:data:`NIC_EFFICIENCY` of their line rate, and its fabric (:func:`fabric_of`).

Two things are taken from data, per fabric behind a network plugin (:data:`FITTED_FABRICS`:
AWS EFA on p4d and on p5, GCP's GPUDirect-TCPXO), which nobody publishes: the step latency
(:func:`fit_latencies`, from rows of 1 MiB and below) and the switch tiers' bandwidth loss
(:func:`fit_tiers`: the leaf size and the efficiency per tier, from rows above 1 MiB on more
than two nodes). :func:`leave_one_source_out` is the honest score: for every source, both are
fitted on all the *other* sources and its rows predicted with them (a fabric no other source
measured gets :data:`DEFAULT_LATENCY_US` and no tiers). :func:`medians` gives the median ``|predicted / measured - 1|``
per regime over the clean rows (no flag ``degraded``, ``torch`` or ``statement``).
Pure: no torch.

Example::

    >>> rows = load_rows(DEFAULT_CSV)  # doctest: +SKIP
    >>> medians(leave_one_source_out(rows))["inter-mid"]  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import functools
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
    "fit_tiers",
    "LEAF_CHOICES",
    "score",
    "leave_one_source_out",
    "scale_out",
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
LEAF_CHOICES = (2, 4, 8, 16, 32)
"""Leaf sizes (nodes per leaf switch) :func:`fit_tiers` tries."""
_EFFICIENCY_SEARCH = (0.5, 1.0)
Tiers = Mapping[str, tuple[int, float]]
"""Per fabric, ``(leaf_nodes, tier_efficiency)``; a fabric missing: no tiers (one flat network)."""


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


def row_profile(row: Row, latencies: Mapping[str, float] | None = None, tiers: Tiers | None = None) -> Profile:
    """The preset for the row's GPU, on the row's shape, NICs, fabric and host CPU.

    ``latencies``: the fabric's step latency per fabric (:func:`fit_latencies`); missing ones
    are :data:`DEFAULT_LATENCY_US`. ``tiers``: ``(leaf_nodes, tier_efficiency)`` per fabric
    (:func:`fit_tiers`); missing ones: no tiers.
    """
    text = row.hardware.lower()
    base = PRESETS["a100-1nic"] if "a100" in text or "p4d" in text else PRESETS["h100-8rail"]
    nic = Link(base.inter.alpha, 1.0 / (row.nic_gbps / 8 * NIC_EFFICIENCY * 1e9))
    fabric = fabric_of(row)
    measured = (latencies or {}).get(fabric, DEFAULT_LATENCY_US[fabric])
    leaf, efficiency = (tiers or {}).get(fabric, (0, 1.0))
    return replace(
        base,
        nodes=row.nodes,
        ranks_per_node=row.gpus_per_node,
        rails=row.nics_per_node,
        inter=nic,
        net_latency_us=measured,
        tuner_net_latency_us=REPORTED_LATENCY_US.get(fabric),
        host_cpu=host_cpu_of(row),
        leaf_nodes=leaf,
        tier_efficiency=efficiency,
        name=row.id,
    )


def _busbw(nbytes: float, seconds: float, ranks: int) -> float:
    return nbytes / seconds * (2 * (ranks - 1) / ranks) / 1e9


def _predict(row: Row, latencies: Mapping[str, float] | None, tiers: Tiers | None = None) -> Point:
    profile = row_profile(row, latencies, tiers)
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


def _tier_rows(rows: Iterable[Row]) -> dict[str, list[Row]]:
    by_fabric: dict[str, list[Row]] = {}
    for r in rows:
        if r.clean and r.regime in ("inter-mid", "inter-bw") and r.nodes > 2 and fabric_of(r) in FITTED_FABRICS:
            by_fabric.setdefault(fabric_of(r), []).append(r)
    return by_fabric


@functools.lru_cache(maxsize=256)
def _fit_tier(fabric: str, members: tuple[Row, ...], latency_us: float) -> tuple[int, float] | None:
    latencies = {fabric: latency_us}

    def loss(leaf: int, efficiency: float) -> float:
        return sum(math.log(_predict(r, latencies, {fabric: (leaf, efficiency)}).ratio) ** 2 for r in members)

    flat = sum(math.log(_predict(r, latencies).ratio) ** 2 for r in members)
    best = min(
        ((leaf, _golden(lambda e, leaf=leaf: loss(leaf, e), *_EFFICIENCY_SEARCH, steps=20)) for leaf in LEAF_CHOICES),
        key=lambda fit: loss(*fit),
    )
    leaf, efficiency = best[0], round(best[1], 3)
    if efficiency >= 0.995 or loss(leaf, efficiency) >= flat or all(r.nodes <= leaf for r in members):
        return None
    return leaf, efficiency


def fit_tiers(rows: Iterable[Row], latencies: Mapping[str, float] | None = None) -> dict[str, tuple[int, float]]:
    """``(leaf_nodes, tier_efficiency)`` of each of :data:`FITTED_FABRICS`, read from its clean rows
    above 1 MiB on more than two nodes in ``rows``: for every leaf size of :data:`LEAF_CHOICES`,
    the efficiency per tier (golden-section search over 0.5-1) with the least squared log error;
    then the leaf whose fit is best. ``latencies``: the step latencies to predict with (default
    :func:`fit_latencies` of ``rows``). Fabrics without such rows, or whose rows gain nothing from
    tiers, are left out (no tiers)."""
    rows = list(rows)
    latencies = fit_latencies(rows) if latencies is None else latencies
    out = {}
    for fabric, members in sorted(_tier_rows(rows).items()):
        fit = _fit_tier(fabric, tuple(members), latencies.get(fabric, DEFAULT_LATENCY_US[fabric]))
        if fit is not None:
            out[fabric] = fit
    return out


def score(rows: Iterable[Row], latencies: Mapping[str, float] | None = None, tiers: Tiers | None = None) -> list[Point]:
    """Every row with the model's prediction, on ``latencies`` and ``tiers`` (default:
    :func:`fit_latencies` and :func:`fit_tiers` of these same rows: in-sample; pass ``tiers={}``
    for the model without switch tiers)."""
    rows = list(rows)
    latencies = fit_latencies(rows) if latencies is None else latencies
    tiers = fit_tiers(rows, latencies) if tiers is None else tiers
    return [_predict(r, latencies, tiers) for r in rows]


def leave_one_source_out(rows: Iterable[Row], *, tiers: bool = True) -> list[Point]:
    """Every row predicted with the latencies (and, with ``tiers``, the switch tiers) fitted on
    the rows of all *other* sources.

    A source is one publication (its ``source`` column): an issue thread's poster, a
    repository's README. ``tiers=False``: the model without switch tiers (every fabric flat).
    """
    rows = list(rows)
    by_source: dict[str, list[Row]] = {}
    for r in rows:
        by_source.setdefault(r.source, []).append(r)
    predicted = {}
    for source, members in by_source.items():
        others = [r for r in rows if r.source != source]
        latencies = fit_latencies(others)
        fitted = fit_tiers(others, latencies) if tiers else {}
        for r in members:
            predicted[id(r)] = _predict(r, latencies, fitted)
    return [predicted[id(r)] for r in rows]


def scale_out(rows: Iterable[Row], *, min_nodes: int = 16, tiers: bool = True) -> list[Point]:
    """The rows on ``min_nodes`` nodes or more, predicted with the latencies (and, with ``tiers``,
    the switch tiers) fitted on the rows below: what a cluster measured at small scale says of
    itself at large scale, as the planner uses it."""
    rows = list(rows)
    small = [r for r in rows if r.nodes < min_nodes]
    latencies = fit_latencies(small)
    fitted = fit_tiers(small, latencies) if tiers else {}
    return [_predict(r, latencies, fitted) for r in rows if r.nodes >= min_nodes]


def medians(points: Sequence[Point], *, min_nodes: int = 1) -> dict[str, tuple[float, int]]:
    """Median ``|ratio - 1|`` and the number of points per regime, over the clean rows (on at
    least ``min_nodes`` nodes)."""
    out = {}
    for regime in REGIMES:
        errors = [p.error for p in points if p.row.regime == regime and p.row.clean and p.row.nodes >= min_nodes]
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


def _summary(title: str, points: Sequence[Point], min_nodes: int = 1) -> list[str]:
    lines = [title]
    for regime, (m, n) in medians(points, min_nodes=min_nodes).items():
        if n:
            lines.append(f"  {regime:<10} {m:6.1%} over {n:3d} rows")
    return lines


def _fmt_tiers(tiers: Tiers) -> str:
    if not tiers:
        return "none"
    return ", ".join(f"{f} {eff:g} per tier above {leaf}-node leaves" for f, (leaf, eff) in sorted(tiers.items()))


def format_report(rows: Sequence[Row], *, worst: int = 10, table: bool = True, scale_nodes: int = 16) -> str:
    """Per-regime medians (in sample and leave-one-source-out, and on ``scale_nodes`` nodes and more
    with and without the switch tiers), the fitted latencies and tiers, every row's
    leave-one-source-out ratio (``table``) and the worst rows."""
    from hiersync._table import render  # here, not at the top: ``import hiersync.costmodel`` imports this module

    rows = list(rows)
    fitted = fit_latencies(rows)
    tiers = fit_tiers(rows, fitted)
    held_out = leave_one_source_out(rows)
    flat = leave_one_source_out(rows, tiers=False)
    sources = len({r.source for r in rows})
    lines = _summary(
        f"leave-one-source-out: median |predicted/measured - 1| per regime ({len(rows)} rows, {sources} sources; "
        "each source predicted with fabric latencies and tiers fitted on the others):",
        held_out,
    )
    lines += _summary("in sample (fabric latencies and tiers fitted on every row):", score(rows, fitted, tiers))
    lines += _summary(f"leave-one-source-out, rows on {scale_nodes}+ nodes:", held_out, scale_nodes)
    lines += _summary("  the same without switch tiers (a flat network):", flat, scale_nodes)
    lines += _summary(
        f"rows on {scale_nodes}+ nodes, latencies and tiers fitted on the rows below {scale_nodes} nodes:",
        scale_out(rows, min_nodes=scale_nodes),
    )
    lines += _summary(
        "  the same without switch tiers (a flat network):", scale_out(rows, min_nodes=scale_nodes, tiers=False)
    )
    lines += _summary(f"in sample, rows on {scale_nodes}+ nodes:", score(rows, fitted, tiers), scale_nodes)
    lines += _summary("  the same without switch tiers (a flat network):", score(rows, fitted, {}), scale_nodes)
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
    lines.append(f"switch tiers fitted on every row: {_fmt_tiers(tiers)} (other fabrics flat)")
    if table:
        head = ["id", "regime", "N x L", "NICs", "size", "measured", "predicted", "ratio", "model's choice", "flags"]
        cells = []
        for p in held_out:
            r = p.row
            unit, scale = ("GB/s", 1.0) if r.size_bytes is None else ("us", 1e6)
            cells.append(
                [
                    r.id,
                    r.regime,
                    f"{r.nodes}x{r.gpus_per_node}",
                    f"{r.nics_per_node}x{r.nic_gbps:g}G",
                    _fmt_size(r),
                    f"{p.measured * scale:.1f} {unit}",
                    f"{p.predicted * scale:.1f} {unit}",
                    f"{p.ratio:.2f}",
                    p.choice,
                    ",".join(r.flags),
                ]
            )
        lines += ["", render(head, cells, align="llrrrrrrl")]
    ranked = sorted((p for p in held_out if p.row.clean), key=lambda p: p.error, reverse=True)[:worst]
    lines += ["", f"worst {len(ranked)} clean rows, leave-one-source-out (ratio = predicted / measured time):"]
    if ranked:
        cells = [[p.row.id, f"{p.ratio:.2f}x", p.choice, f"{p.row.hardware} ({p.row.source})"] for p in ranked]
        table_text = render(["id", "ratio", "model's choice", "hardware (source)"], cells, align="lrl")
        lines += [f"  {line}" for line in table_text.splitlines()]
    return "\n".join(lines)
