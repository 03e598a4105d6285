"""The claims hiersync makes on the emulated testbed, checked against one bench run (reports, not assertions).

Each :class:`Claim` compares two rows of the same run and compute model: a statistic of one
schedule (mean step, p99 step, mean or peak inter-node MB per step) against a statistic of a
reference (another schedule, a whole-model sync, or torchft's Streaming DiLoCo at the same k),
with a bound. :func:`check_claims` evaluates every claim whose rows ran, with the interval the
run's own step-to-step noise puts around each ratio of step times (:mod:`.bench_noise`): PASS or
FAIL only where that interval is clear of the bound, ``inconclusive`` where it holds it;
:func:`peer_ratios` puts hiersync's streaming rows beside each torchft row. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hiersync._table import render

from . import bench_noise
from .bench_rows import row_key
from .bench_spec import NEVER, STEADY_ROUNDS, parse_schedule

__all__ = [
    "Claim",
    "CLAIMS",
    "check_claims",
    "format_claims",
    "format_verdict",
    "MODEL_ROWS",
    "peer_ratios",
    "format_peer_ratios",
    "steady_rows",
    "rounds",
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
    # the rows steady_rows names run in STEADY_ROUNDS interleaved rounds (bench_claims.rounds).
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


MODEL_ROWS: frozenset[tuple[str, str]] = frozenset(
    {("hiersync_p4", "accel"), ("hiersync_p4_stream", "accel"), ("hiersync_p4_stream_bf16", "accel"),
     ("intra_only", "accel")}
)  # fmt: skip
"""The default run's rows whose exposed sync the cost model's check judges (:mod:`.bench_model`), and its reference."""


def _windowed(name: str) -> bool:
    try:
        period = parse_schedule(name).period
    except ValueError:
        return False
    return 1 < period < NEVER


def steady_rows(
    claims: Sequence[Claim] = CLAIMS, near: float = 0.06, judged: frozenset[tuple[str, str]] = MODEL_ROWS
) -> frozenset[tuple[str, str]]:
    """(schedule, compute model) of the rows that run in ``STEADY_ROUNDS`` interleaved rounds
    (:func:`rounds`): the rows whose mean step a claim compares with a bound within ``near`` of 1x
    (two nearly equal means), the rows of period k > 1 whose mean a claim compares (in --min-seconds
    they run 2 windows: too few to know a mean's noise), and ``judged``. References that are not one
    schedule (torchft's fastest row) are left out.
    """
    out = set(judged)
    for c in claims:
        if c.statistic != "mean":
            continue
        names = [c.schedule]
        if c.reference_statistic == "mean" and not c.reference.startswith("torchft_"):
            names.append(c.reference)
        for compute in c.computes:
            for name in names:
                if abs(c.bound - 1.0) <= near or _windowed(name):
                    out.add((name, compute))
    return frozenset(out)


def rounds(schedules: Sequence[str], compute: str) -> list[str]:
    """The schedules one sweep of ``compute`` runs, in order: every one, then the rows whose noise a
    claim needs (:func:`steady_rows`) ``STEADY_ROUNDS - 1`` more times, round by round."""
    needed = steady_rows()
    steady = [s for s in schedules if (s, compute) in needed]
    return list(schedules) + steady * (STEADY_ROUNDS - 1)


def _reference(by: dict, key: tuple, claim: Claim, row: dict) -> tuple[float | None, str, dict | None] | None:
    """(the reference's value, its name, its row where it is one row of the run), or None where it did not run."""
    model, bucket, compute = key
    if claim.reference == "own_shard":
        return row.get("shard_mb"), "the rank's own fp32 shard", None
    if claim.reference == "whole_sync":
        p4 = by.get((model, bucket, compute, "hiersync_p4"))
        if p4 is not None and p4.get("inter_mb_step_peak"):
            return p4["inter_mb_step_peak"], "hiersync_p4's sync step", p4
        return row.get("whole_sync_mb"), "one whole-model fp32 average, 2(N-1)/N x 4P per node", None
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
    value = None if ref["unsupported"] else ref[_STAT[claim.reference_statistic]]
    return value, f"{name} {claim.reference_statistic}", ref


_QUANTILE = {"p50": 50.0, "p99": 99.0}


def _interval(claim: Claim, row: dict, ref: dict | None, ratio: float) -> tuple[bench_noise.Interval | None, str]:
    """The ratio's interval from both rows' per-step times, and what it comes from (or why there is none)."""
    if claim.statistic in _MB:
        return None, "counted"
    if ref is None or claim.statistic != claim.reference_statistic:
        return None, "noise unknown"
    steps, ref_steps = bench_noise.steps_of(row), bench_noise.steps_of(ref)
    k, ref_k = row.get("period") or 1, ref.get("period") or 1
    runs, ref_runs = bench_noise.runs_of(row), bench_noise.runs_of(ref)
    if claim.statistic == "mean" and runs and len(runs) == len(ref_runs):
        return bench_noise.paired_interval(runs, ref_runs, estimate=ratio), "rounds"
    if claim.statistic == "mean":
        got = bench_noise.ratio_interval(steps, k, ref_steps, ref_k, estimate=ratio)
    else:
        got = bench_noise.quantile_ratio_interval(
            steps, k, ref_steps, ref_k, _QUANTILE[claim.statistic], estimate=ratio
        )
    if got is None:
        few = [
            f"{r['schedule']} ran {len(s)} steps"
            for r, s, p in ((row, steps, k), (ref, ref_steps, ref_k))
            if len(s) < 2 * bench_noise.batch_length(len(s), p)
        ]
        return None, f"noise unknown: {', '.join(few) or 'no per-step times'}, under 2 windows; more --min-seconds"
    return got, "mean" if claim.statistic == "mean" else "bootstrap"


def check_claims(
    rows: Sequence[dict], claims: Sequence[Claim] = CLAIMS, *, environment: dict | None = None
) -> list[dict]:
    """Every claim, per model and bucket size, where both of its rows ran.

    ``verdict``: ``"pass"`` or ``"fail"`` where the ratio's interval (``low``..``high``, from both
    rows' per-step times: :mod:`.bench_noise`) is clear of the bound, ``"inconclusive"`` where it
    holds the bound or the noise is not known (a row of under 2 windows), None where a row ran but
    has no number (the installed hiersync cannot build it, or nothing counted its bytes). ``met``:
    True on a pass, False on a fail, else None. Bytes and memory are counted, not sampled: their
    ratio is judged as it is. ``environment`` (``bench.json``'s): on a host loaded before the run
    (:func:`.bench_noise.loaded`) a step-time claim is ``"inconclusive"`` whatever its interval, and
    ``loaded`` says why.
    """
    busy = bench_noise.loaded(environment)
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
            ref_value, ref_name, ref_row = ref
            value = None if row["unsupported"] else row[_STAT[claim.statistic]]
            ratio = value / ref_value if value is not None and ref_value else None
            interval, source = (None, "") if ratio is None else _interval(claim, row, ref_row, ratio)
            if ratio is None:
                verdict = None
            elif interval is not None:
                verdict = "inconclusive" if busy else bench_noise.verdict(interval, claim.bound)
            elif source == "counted":
                verdict = "pass" if ratio <= claim.bound else "fail"
            else:
                verdict = "inconclusive"
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
                    **(interval.as_dict() if interval else {"low": None, "high": None, "noise": None}),
                    "confidence": bench_noise.CONFIDENCE if interval else None,
                    "interval_from": source or None,
                    "loaded": busy if ratio is not None and source != "counted" else None,
                    "verdict": verdict,
                    "met": {"pass": True, "fail": False}.get(verdict or ""),
                    "why_not": row["unsupported"] or None,
                }
            )
    return out


def format_verdict(t: dict) -> str:
    """``1.03x [0.98, 1.08] inconclusive (noise +-5%)``: the ratio, its interval and the verdict."""
    ratio = f"{t['ratio']:.2f}x"
    if t.get("low") is not None:
        ratio += f" [{t['low']:.2f}, {t['high']:.2f}]"
    word = {"pass": "PASS", "fail": "FAIL"}.get(t["verdict"], t["verdict"])
    if t.get("noise") is not None:
        why = f"noise +-{t['noise']:.0%}" + (", from the rounds" if t.get("interval_from") == "rounds" else "")
    else:
        why = t.get("interval_from") or "noise unknown"
    if t.get("loaded"):
        why = f"{t['loaded']}; {why}"
    return f"{ratio} {word} ({why})"


def format_claims(checked: Sequence[dict]) -> str:
    """One line per claim: the ratio, its interval and the verdict, then both numbers (or n/a and why)."""
    lines = []
    for t in checked:
        where = f"[{t['compute']}, {t['model']}, {t['bucket_mb']:g} MB buckets]"
        if t["verdict"] is None:
            lines.append(f"{t['claim']} {where}: n/a ({t['why_not'] or 'no number'})")
            continue
        fmt = ".1f" if t["unit"] == "MB" else ".3f"
        lines.append(
            f"{t['claim']} {where}: {format_verdict(t)}; {t['schedule']} {t['value']:{fmt}} {t['unit']}"
            f" / {t['reference_name']} {t['reference_value']:{fmt}} {t['unit']}"
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
    return (
        "hiersync streaming / each torchft row (same run, same compute model; below 1x: hiersync's is smaller):\n"
        + render(head, body, align="lllr")
    )
