"""The claims hiersync makes on the emulated testbed, checked against one bench run (reports, not assertions).

Each :class:`Claim` compares two rows of the same run and compute model: a statistic of one
schedule (mean step, p99 step, mean or peak inter-node MB per step) against a statistic of a
reference (another schedule, a whole-model sync, or torchft's Streaming DiLoCo at the same k),
with a bound. :func:`check_claims` evaluates every claim whose rows ran; :func:`peer_ratios`
puts hiersync's streaming rows beside each torchft row. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .bench_rows import row_key

__all__ = [
    "Claim",
    "CLAIMS",
    "check_claims",
    "format_claims",
    "peer_ratios",
    "format_peer_ratios",
    "steady_rows",
]


@dataclass(frozen=True)
class Claim:
    """``schedule``'s ``statistic`` <= ``bound`` x ``reference``'s ``reference_statistic``, on ``computes``."""

    label: str
    """What it claims, in words."""
    computes: tuple[str, ...]
    schedule: str
    statistic: str
    """``mean``, ``p50``, ``p99`` (step seconds), ``bytes`` or ``peak`` (inter-node MB per step and node),
    ``extra`` (the worst rank's extra peak MB, ``--memory``)."""
    reference: str
    """A schedule, ``whole_sync`` (one whole-model average's MB), ``torchft_streaming`` (its row at k),
    ``torchft_fastest`` (the torchft row at k with the smallest ``reference_statistic``) or ``own_shard``
    (the row's own fp32 parameter shard per rank, FSDP2 rows)."""
    reference_statistic: str
    bound: float


CLAIMS: tuple[Claim, ...] = (
    # Accelerator-like compute: a GPU host's CPU is idle while the device computes, so transfers
    # can hide behind compute; with real CPU compute the 2 cores of this box run both. Each row's
    # mean is over at least --min-seconds of whole windows (8 steps of the k=4 rows by default);
    # the rows of a claim with a bound within 6% of 1x are timed STEADY_FACTOR times as long (steady_rows).
    Claim("streaming k=4 step <= 0.62x PyTorch post-local SGD k=4", ("accel",), "hiersync_p4_stream", "mean",
          "postlocal_k4", "mean", 0.62),
    Claim("streaming k=4 step <= 0.45x DDP", ("accel",), "hiersync_p4_stream", "mean", "ddp", "mean", 0.45),
    Claim("streaming k=4 step <= 1.05x a step without inter-node traffic", ("accel",), "hiersync_p4_stream", "mean",
          "intra_only", "mean", 1.05),
    Claim("streaming k=4 slowest step (p99) <= 0.6x blocking k=4's: no sync step", ("accel",), "hiersync_p4_stream",
          "p99", "hiersync_p4", "p99", 0.6),
    # counted on the link, a step's reading holds the tail of the transfer before it: a fragment is 0.25x
    Claim("streaming k=4's busiest step sends <= 0.4x a whole-model sync", ("accel", "cpu"), "hiersync_p4_stream",
          "peak", "whole_sync", "peak", 0.4),
    Claim("exact k=1 step <= 0.9x DDP", ("accel",), "hiersync_p1", "mean", "ddp", "mean", 0.9),
    Claim("streaming k=4 step <= every torchft row's at k=4", ("accel",), "hiersync_p4_stream", "mean",
          "torchft_fastest", "mean", 1.0),
    Claim("streaming k=4 link bytes per step <= 0.6x torchft Streaming DiLoCo's", ("accel", "cpu"),
          "hiersync_p4_stream", "bytes", "torchft_streaming", "bytes", 0.6),
    # FSDP2 (--fsdp): against FSDP2's own HSDP; memory: the worst rank's peak over HSDP's, in units of
    # the rank's own fp32 parameter shard (measured once per run: checked on the first compute model)
    Claim("FSDP2 streaming k=4 step <= 0.65x FSDP2 HSDP's", ("accel",), "fsdp_hiersync_p4_stream", "mean",
          "fsdp_hsdp", "mean", 0.65),
    Claim("FSDP2 streaming k=4 extra memory per rank <= 3x the rank's own fp32 shard", ("accel", "cpu"),
          "fsdp_hiersync_p4_stream", "extra", "own_shard", "shard", 3.0),
    Claim("FSDP2 blocking k=4 extra memory per rank <= 3x the rank's own fp32 shard", ("accel", "cpu"),
          "fsdp_hiersync_p4", "extra", "own_shard", "shard", 3.0),
)  # fmt: skip
_STAT = {
    "mean": "step_s",
    "p50": "step_p50_s",
    "p99": "step_p99_s",
    "bytes": "inter_mb_step_mean",
    "peak": "inter_mb_step_peak",
    "extra": "extra_mb",
    "shard": "shard_mb",
}
_MB = ("bytes", "peak", "extra", "shard")
_ONCE = ("extra",)
"""Statistics measured once per run (the memory pass), whatever the compute model: checked once."""


def steady_rows(claims: Sequence[Claim] = CLAIMS, near: float = 0.06) -> frozenset[tuple[str, str]]:
    """(schedule, compute model) of the rows whose mean step a claim compares with a bound within
    ``near`` of 1x: two nearly equal means, which must each be steady to about 1% (a step here
    scatters by +-5%, so 8 steps are not enough). References that are not one schedule
    (torchft's fastest row) are left out.
    """
    out = set()
    for c in claims:
        if c.statistic != "mean" or abs(c.bound - 1.0) > near:
            continue
        for compute in c.computes:
            out.add((c.schedule, compute))
            if c.reference_statistic == "mean" and not c.reference.startswith("torchft_"):
                out.add((c.reference, compute))
    return frozenset(out)


def _reference(by: dict, key: tuple, claim: Claim, row: dict) -> tuple[float | None, str] | None:
    model, bucket, compute = key
    if claim.reference == "own_shard":
        return row.get("shard_mb"), "the rank's own fp32 shard"
    if claim.reference == "whole_sync":
        p4 = by.get((model, bucket, compute, "hiersync_p4"))
        if p4 is not None and p4.get("inter_mb_step_peak"):
            return p4["inter_mb_step_peak"], "hiersync_p4's sync step"
        return row.get("whole_sync_mb"), "one whole-model fp32 average, 2(N-1)/N x 4P per node"
    name = claim.reference
    k = row["period"]
    if name == "torchft_streaming":
        found = [s for (m, b, c, s) in by if (m, b, c) == key and s.startswith(f"torchft_streaming_k{k}_")]
        if not found:
            return None
        name = found[0]
    elif name == "torchft_fastest":
        stat = _STAT[claim.reference_statistic]
        peers = [r for r in by.values() if row_key(r)[:3] == key and r["kind"] == "torchft" and r["period"] == k]
        peers = [r for r in peers if not r["unsupported"] and r.get(stat) is not None]
        if not peers:
            return None
        name = min(peers, key=lambda r: r[stat])["schedule"]
    ref = by.get((model, bucket, compute, name))
    if ref is None:
        return None
    return (
        None if ref["unsupported"] else ref[_STAT[claim.reference_statistic]]
    ), f"{name} {claim.reference_statistic}"


def check_claims(rows: Sequence[dict], claims: Sequence[Claim] = CLAIMS) -> list[dict]:
    """Every claim, per model and bucket size, where both of its rows ran.

    ``met`` is None where a row ran but has no number (the installed hiersync cannot build it,
    or nothing counted its bytes).
    """
    by = {row_key(r): r for r in rows}
    out = []
    groups = list(dict.fromkeys(row_key(r)[:3] for r in rows))
    for claim in claims:
        done: set[tuple] = set()
        for key in groups:
            if key[2] not in claim.computes:
                continue
            row = by.get((*key, claim.schedule))
            if row is None or (claim.statistic in _ONCE and key[:2] in done):
                continue
            if claim.statistic in _ONCE and row.get(_STAT[claim.statistic]) is None:
                continue  # no memory pass
            done.add(key[:2])
            ref = _reference(by, key, claim, row)
            if ref is None:
                continue
            ref_value, ref_name = ref
            value = None if row["unsupported"] else row[_STAT[claim.statistic]]
            ratio = value / ref_value if value is not None and ref_value else None
            out.append(
                {
                    "claim": claim.label,
                    "model": key[0],
                    "bucket_mb": key[1],
                    "compute": key[2],
                    "schedule": claim.schedule,
                    "statistic": claim.statistic,
                    "reference_name": ref_name,
                    "value": value,
                    "reference_value": ref_value,
                    "unit": "MB" if claim.statistic in _MB else "s",
                    "ratio": ratio,
                    "bound": claim.bound,
                    "met": None if ratio is None else ratio <= claim.bound,
                    "why_not": row["unsupported"] or None,
                }
            )
    return out


def format_claims(checked: Sequence[dict]) -> str:
    """One line per claim: PASS/FAIL (or n/a) with both numbers and the ratio."""
    lines = []
    for t in checked:
        where = f"[{t['compute']}, {t['model']}, {t['bucket_mb']:g} MB buckets]"
        if t["met"] is None:
            lines.append(f"n/a   {t['claim']} {where}: {t['why_not'] or 'no number'}")
            continue
        fmt = ".1f" if t["unit"] == "MB" else ".3f"
        lines.append(
            f"{'PASS' if t['met'] else 'FAIL'}  {t['claim']} {where}: {t['schedule']} {t['value']:{fmt}} {t['unit']}"
            f" / {t['reference_name']} {t['reference_value']:{fmt}} {t['unit']} = {t['ratio']:.2f}x"
        )
    return "\n".join(lines)


_PEER_STATS = (("step", "step_s"), ("p99", "step_p99_s"), ("MB/step", "inter_mb_step_mean"),
               ("peak MB", "inter_mb_step_peak"))  # fmt: skip


def peer_ratios(rows: Sequence[dict]) -> list[dict]:
    """hiersync's streaming rows (``hiersync_p<k>_stream``, ``_stream_outer``) / each torchft row at the same k.

    Per (model, bucket, compute model): the ratios of mean and p99 step, mean and peak
    inter-node MB per step and node, and both rows' extra memory per rank (MB over DDP's).
    """
    by = {row_key(r): r for r in rows}
    out = []
    for r in rows:
        if r["kind"] != "torchft" or r["unsupported"] or r["step_s"] is None:
            continue
        for mine in (f"hiersync_p{r['period']}_stream", f"hiersync_p{r['period']}_stream_outer"):
            h = by.get(row_key(r, mine))
            if h is None or h["unsupported"] or h["step_s"] is None:
                continue
            ratios = {label: (h[k] / r[k] if h.get(k) is not None and r.get(k) else None) for label, k in _PEER_STATS}
            out.append(
                {
                    "model": r["model"],
                    "bucket_mb": r["bucket_mb"],
                    "compute": r["compute"],
                    "hiersync": mine,
                    "torchft": r["schedule"],
                    "ratios": ratios,
                    "extra_mb": (h.get("extra_mb"), r.get("extra_mb")),
                }
            )
    return out


def format_peer_ratios(ratios: Sequence[dict]) -> str:
    if not ratios:
        return ""
    head = ["compute", "hiersync row", "/ torchft row", *(label for label, _ in _PEER_STATS), "extra MB (both)"]
    body = []
    for p in ratios:
        cells = ["-" if v is None else f"{v:.2f}x" for v in p["ratios"].values()]
        extra = " / ".join("-" if v is None else f"{v:.0f}" for v in p["extra_mb"])
        body.append([p["compute"], p["hiersync"], p["torchft"], *cells, extra])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = [
        "hiersync streaming / each torchft row (same run, same compute model; below 1x: hiersync's is smaller):",
        "  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))),
    ]
    for b in body:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)
