"""What the planner weighs beyond one step: the steps penalty per period, the break-even bandwidth,
and every ``compress`` option.

A period k > 1 (local SGD) usually needs more steps than DDP to reach the same loss. Its *steps
penalty* is steps to DDP's final loss with period k / DDP's steps (>= 1; k = 1, exact sync, has 1).
:func:`read_steps_penalty` reads it from ``--steps-penalty k=4:1.08,k=16:1.25`` or from the
``time_to_loss.json`` that benchmarks/time_to_loss.py writes, and :class:`StepsPenalties` gives it
at every period the planner tries (:func:`penalty_at`: interpolated log-linearly in k between
known values, extrapolated beyond the largest). The planner then ranks schedules by predicted
wall-clock to DDP's loss, step time x penalty (:func:`smallest_near_best`).
:func:`break_even_gbps` bisects the inter-node bandwidth below which hiersync helps;
:func:`compare_compress` prices each ``compress`` at the recommended configuration and
re-planned, and names the one that pays. Pure: no torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from hiersync import costmodel as cm
from hiersync.vocab import MiB

if TYPE_CHECKING:
    from .plans import Plan, PlanRow

__all__ = [
    "NEAR_BEST",
    "HOW_PENALTY",
    "StepsPenalty",
    "StepsPenalties",
    "penalty_at",
    "parse_steps_penalty",
    "read_time_to_loss",
    "read_steps_penalty",
    "smallest_near_best",
    "rank_by_time_to_loss",
    "BREAK_EVEN_GAIN",
    "BREAK_EVEN_RANGE_GBPS",
    "COMPRESS_NEAR",
    "COMPRESS_COMPARED",
    "COMPRESS_LOSSY",
    "compress_pays",
    "break_even_gbps",
    "compare_compress",
]

# Recommend the smallest period within 5% of the best (step time, or time to the loss with a
# steps penalty): a larger k costs accuracy, and a penalty is measured with an interval.
NEAR_BEST = 1.05
# The break-even: hiersync "helps" while its best configuration steps at least 5% faster than DDP.
BREAK_EVEN_GAIN = 1.05
BREAK_EVEN_RANGE_GBPS = (1e-3, 1e4)  # per node: 1 MB/s .. 10 TB/s
# Which compress pays: the least lossy option whose step is within 2% of the fastest's at the
# recommended configuration (fewer bits risk accuracy: every bit saved must buy time).
COMPRESS_NEAR = 1.02
COMPRESS_COMPARED = ("none", "bf16", "int8", "int4", "topk2")  # fp16 sends bf16's bytes
# Priced and shown, never recommended: sparse deltas cost loss at every density measured
# (docs/local-sgd.md, "Sparse 2-bit deltas"); a user who accepts that names it.
COMPRESS_LOSSY = ("topk2",)
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ---------------------------------------------------------------- the steps penalty
HOW_PENALTY = ("exact", "given", "measured", "interpolated", "extrapolated")
_FIX = "measure it with benchmarks/time_to_loss.py"
_SPEC = "k=PERIOD:PENALTY,... (e.g. k=4:1.08,k=16:1.25: period 4 needs 1.08x DDP's steps to reach DDP's loss)"


@dataclass(frozen=True, kw_only=True)
class StepsPenalty:
    """Steps to DDP's final loss with period ``period``, as a multiple of DDP's steps."""

    period: int
    value: float
    """>= 1; with ``reached=False`` a lower bound."""
    how: str
    """One of :data:`HOW_PENALTY`: ``"exact"`` (k = 1), ``"given"`` (the flag), ``"measured"``
    (a time_to_loss.json), or ``"interpolated"`` / ``"extrapolated"`` from those."""
    schedule: str | None = None
    """The measured schedule it comes from (``"hiersync_k4_stream"``)."""
    interval: tuple[float, float] | None = None
    """The measurement's 90% interval over seeds (``inf``: not reached in that share of draws)."""
    reached: bool = True
    """False: the measured run never came down to DDP's loss (or an end it is interpolated
    from did not), so the time to the loss is unknown."""
    note: str = ""
    """Anything the planner changed (a measured value below 1 counted as 1)."""

    def __post_init__(self) -> None:
        assert self.how in HOW_PENALTY, self.how
        if not (self.value >= 1 and math.isfinite(self.value)):
            raise ValueError(f"a steps penalty is a finite number >= 1, got k={self.period}:{self.value!r}; {_FIX}")

    @property
    def trusted(self) -> bool:
        """Whether the planner recommends on it: given, measured, or between two such values."""
        return self.reached and self.how != "extrapolated"

    @property
    def known(self) -> bool:
        """Whether ``value`` says something: an estimate, or (not reached, measured) a lower bound."""
        return self.reached or self.how == "measured"

    def describe(self) -> str:
        """``"k=4 1.08 (given)"``, ``"k=8 1.165 (interpolated)"``, ... for the plan's output."""
        if not self.reached and self.how == "measured":
            bound = f" > {self.value:.4g}" if self.value > 1 else ""
            return f"k={self.period}{bound} (not reached by {self.schedule} in the measured run: unknown)"
        if not self.reached:
            return f"k={self.period} ? ({self.how} from a value not reached: unknown)"
        how = self.how
        if self.schedule:
            how += f" {self.schedule}"
        if self.interval:
            how += f", 90% interval {_bound(self.interval[0])}-{_bound(self.interval[1])}"
        if self.note:
            how += f"; {self.note}"
        return f"k={self.period} {self.value:.4g} ({how})"

    @property
    def cell(self) -> str:
        """The table's cell: the value, ``~`` interpolated, ``?`` extrapolated, ``>`` a lower bound."""
        if not self.reached:
            return f">{self.value:.4g}" if self.how == "measured" else "?"
        return f"{self.value:.4g}" + {"interpolated": "~", "extrapolated": "?"}.get(self.how, "")


def _bound(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else "not reached"


_EXACT = StepsPenalty(period=1, value=1.0, how="exact")


def penalty_at(points: Sequence[StepsPenalty], period: int) -> StepsPenalty:
    """The penalty at ``period`` from known ``points`` (k > 1 each, at most one per k).

    k = 1 is exact (1 by definition). Between two known periods (k = 1 included) the penalty is
    linear in log k; past the largest it is extrapolated from the nearest two, never below 1
    and never decreasing in k. Between known values a monotone penalty is bounded by them;
    past the largest nothing bounds it (a large enough k may never reach the loss), so an
    extrapolated value is shown but not recommended on (:attr:`StepsPenalty.trusted`).
    """
    if period == 1:
        return _EXACT
    known = {p.period: p for p in points}
    if period in known:
        return known[period]
    knots = [_EXACT, *sorted(known.values(), key=lambda p: p.period)]
    above = next((p for p in knots if p.period > period), None)
    if above is not None:
        below = [p for p in knots if p.period < period][-1]
        f = math.log(period / below.period) / math.log(above.period / below.period)
        value = below.value + f * (above.value - below.value)
        return StepsPenalty(
            period=period, value=max(1.0, value), how="interpolated", reached=below.reached and above.reached
        )
    a, b = knots[-2], knots[-1]
    slope = max(0.0, (b.value - a.value) / math.log(b.period / a.period))
    value = max(1.0, b.value + slope * math.log(period / b.period))
    return StepsPenalty(period=period, value=value, how="extrapolated", reached=a.reached and b.reached)


@dataclass(frozen=True, kw_only=True)
class StepsPenalties:
    """The known steps penalties, blocking and streaming (the same unless a measurement gives them apart)."""

    source: str
    """Where they come from, for the output (the flag's text, or the file and its run)."""
    blocking: tuple[StepsPenalty, ...]
    """Known penalties of whole-model, blocking syncs (``fragments=1, overlap=0``), one per k > 1."""
    streaming: tuple[StepsPenalty, ...]
    """Known penalties of streaming syncs (``fragments > 1`` or ``overlap > 0``)."""

    def __post_init__(self) -> None:
        for points in (self.blocking, self.streaming):
            ks = [p.period for p in points]
            if not points or len(set(ks)) != len(ks) or min(ks) < 2:
                raise ValueError(f"steps penalties need one value per period k >= 2, got k={ks} ({self.source})")

    def at(self, period: int, *, streaming: bool = False) -> StepsPenalty:
        """The penalty of a period-``period`` schedule (:func:`penalty_at`)."""
        return penalty_at(self.streaming if streaming else self.blocking, period)

    @property
    def apart(self) -> bool:
        """Whether blocking and streaming have penalties of their own."""
        return self.blocking != self.streaming

    @property
    def periods(self) -> tuple[int, ...]:
        """The periods with a given or measured penalty."""
        return tuple(sorted({p.period for p in (*self.blocking, *self.streaming)}))


def parse_steps_penalty(text: str) -> StepsPenalties:
    """``"k=4:1.08,k=16:1.25"`` as :class:`StepsPenalties` (blocking and streaming alike).

    ``ValueError`` names the item and the fix: a malformed item, a period below 1, a penalty that
    is not a number >= 1, k = 1 with a penalty other than 1 (exact sync is DDP's own steps), or a
    period given twice.
    """
    points: dict[int, StepsPenalty] = {}
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--steps-penalty {text!r}: give {_SPEC}, or a time_to_loss.json; {_FIX}")
    for item in items:
        m = re.fullmatch(r"k\s*=\s*(\d+)\s*:\s*(\S+)", item)
        if m is None:
            raise ValueError(f"--steps-penalty: {item!r} is not k=PERIOD:PENALTY; give {_SPEC}")
        k = int(m.group(1))
        try:
            value = float(m.group(2))
        except ValueError:
            value = math.nan
        if k < 1:
            raise ValueError(f"--steps-penalty: {item!r}: the period k must be an int >= 1")
        if not math.isfinite(value):
            raise ValueError(
                f"--steps-penalty: {item!r}: the penalty must be a finite number >= 1 (steps to DDP's loss with "
                f"period {k} / DDP's steps); to rule a period out, leave it out of --periods; {_FIX}"
            )
        if value < 1:
            raise ValueError(
                f"--steps-penalty: {item!r}: a penalty below 1 means period {k} reaches DDP's loss in fewer steps "
                f"than DDP itself, which the planner does not assume (it would rank local SGD above exact sync on "
                f"a measurement's noise); the penalty is steps to DDP's loss with period {k} / DDP's steps, >= 1 "
                f"(1.08 for 8% more steps); {_FIX}"
            )
        if k == 1:
            if value != 1:
                raise ValueError(
                    f"--steps-penalty: {item!r}: period 1 is exact sync (DDP's own steps), its penalty is 1 by "
                    f"definition; drop it, or give the period you measured"
                )
            continue
        if k in points:
            raise ValueError(f"--steps-penalty: k={k} is given twice ({points[k].value:g} and {value:g}); give it once")
        points[k] = StepsPenalty(period=k, value=value, how="given")
    if not points:
        raise ValueError(f"--steps-penalty {text!r} gives no period above 1; give {_SPEC}")
    given = tuple(sorted(points.values(), key=lambda p: p.period))
    return StepsPenalties(source=f"--steps-penalty {','.join(items)}", blocking=given, streaming=given)


def _row_period(row: dict[str, Any]) -> int | None:
    """A time_to_loss.py row's period: its ``period`` key, else ``_k<N>`` in a hiersync schedule's name."""
    if isinstance(row.get("period"), int):
        return row["period"]
    m = re.match(r"hiersync_k(\d+)(_|$)", str(row.get("schedule", "")))
    return int(m.group(1)) if m else None


def _row_streaming(row: dict[str, Any]) -> bool:
    if "fragments" in row or "overlap" in row:
        return int(row.get("fragments") or 1) > 1 or int(row.get("overlap") or 0) > 0
    return "_stream" in str(row.get("schedule", ""))


def _measured(row: dict[str, Any], combined: bool, ddp_steps: float | None) -> StepsPenalty | None:
    """One time_to_loss.py row's penalty; None for DDP, period 1 and other libraries' rows."""
    k = _row_period(row)
    if k is None or k < 2 or row.get("warmup_steps") or re.search(r"_w\d+(_|$)", str(row.get("schedule", ""))):
        return None  # a warm-up row's first W steps are exact: its steps are not all priced at period k
    name = str(row["schedule"])
    iv = row.get("steps_interval") if combined else (row.get("interval_90") or {}).get("steps")
    interval = (float(iv[0]), float(iv[1])) if iv else None
    ratio = row.get("steps_x_ddp")
    if ratio is None:  # not reached: at least the steps it ran, when the row says how many
        ran = None if combined else row.get("steps_run")
        bound = float(ran) / ddp_steps if ran and ddp_steps else 1.0
        return StepsPenalty(
            period=k, value=max(1.0, bound), how="measured", schedule=name, interval=interval, reached=False
        )
    note = f"measured {float(ratio):.3g}, counted as 1" if float(ratio) < 1 else ""
    return StepsPenalty(
        period=k, value=max(1.0, float(ratio)), how="measured", schedule=name, interval=interval, note=note
    )


def read_time_to_loss(path: str | Path) -> StepsPenalties:
    """The steps penalties measured by benchmarks/time_to_loss.py, from the ``time_to_loss.json`` it writes.

    Reads the run's ``combined`` rows when it has them (``--steps-from``: steps from the loss-only
    run's seeds), else its ``table``: per hiersync schedule ``steps_x_ddp`` (steps to DDP's final
    loss / DDP's; null: not reached) and its 90% interval. The period comes from a row's
    ``period`` key, else from the schedule's name (``hiersync_k4_stream``: 4; streaming when the
    name says ``_stream``, or ``fragments``/``overlap`` keys say so). Per period and kind (blocking,
    streaming) the best schedule's ratio counts; a kind without its own row at a period shares
    the other's. Other libraries' rows (``postlocal_``, ``torchft_``) are not hiersync and are
    skipped, and so are warm-up rows (``_w<W>``, ``warmup_steps``): their first W steps run at
    k = 1, which a penalty at period k would price as k's. A ratio below 1 counts as 1, said in
    its note; a schedule that never reached the loss gives a lower bound (the steps it ran /
    DDP's) and is never recommended on.
    """
    path = Path(path)
    fix = "pass the time_to_loss.json that benchmarks/time_to_loss.py writes to its --out folder"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--steps-penalty {str(path)!r}: no such file; give {_SPEC}, or {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--steps-penalty {str(path)!r}: not readable JSON ({err}); {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("table"), list):
        raise ValueError(f"--steps-penalty {str(path)!r}: not a time_to_loss.json (no 'table' of rows); {fix}")
    combined = data.get("combined") or None
    rows: list[dict[str, Any]] = combined if isinstance(combined, list) else data["table"]
    ddp = next((r for r in data["table"] if isinstance(r, dict) and r.get("schedule") == "ddp"), None)
    ddp_steps = ddp.get("steps_to_target") if ddp else None  # DDP's --steps
    best: dict[tuple[int, bool], StepsPenalty] = {}
    for row in rows:
        try:
            point = _measured(row, combined is not None, ddp_steps)
        except (AttributeError, TypeError, ValueError, KeyError, IndexError) as err:
            raise ValueError(
                f"--steps-penalty {str(path)!r}: a row it cannot read ({err}): {row!r:.200}; {fix}"
            ) from None
        if point is None:
            continue
        key = (point.period, _row_streaming(row))
        old = best.get(key)
        if old is None or (point.reached, -point.value) > (old.reached, -old.value):
            best[key] = point
    if not best:
        names = ", ".join(str(r.get("schedule")) for r in rows)
        raise ValueError(
            f"--steps-penalty {str(path)!r}: no hiersync schedule with a period k >= 2 among its rows ({names}); "
            f"run benchmarks/time_to_loss.py with --schedules ddp hiersync_k4_stream ... and pass its time_to_loss.json"
        )
    kinds = {}
    for streaming in (False, True):
        own = {k: p for (k, s), p in best.items() if s == streaming}
        other = {k: p for (k, s), p in best.items() if s != streaming}
        kinds[streaming] = tuple(sorted({**other, **own}.values(), key=lambda p: p.period))
    seeds = data.get("seeds")
    if combined:  # this run's seeds timed the steps; the steps come from the loss-only run
        detail = f"steps to the loss from its --steps-from run {data.get('steps_from') or ''}".strip()
    else:
        detail = f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}" if isinstance(seeds, list) else ""
    if data.get("budget"):
        detail += f"; --budget {data['budget']:g}"
    detail = detail.strip("; ")
    return StepsPenalties(
        source=f"{path}" + (f" ({detail})" if detail else ""), blocking=kinds[False], streaming=kinds[True]
    )


def read_steps_penalty(text: str) -> StepsPenalties:
    """``--steps-penalty``: ``k=4:1.08,...`` (:func:`parse_steps_penalty`), or a time_to_loss.json
    (:func:`read_time_to_loss`) when ``text`` is a file or ends in ``.json``."""
    if Path(text).is_file() or text.strip().lower().endswith(".json"):
        return read_time_to_loss(text)
    return parse_steps_penalty(text)


class _Ranked(Protocol):
    @property
    def period(self) -> int | None: ...

    @property
    def overlap(self) -> int: ...


R = TypeVar("R", bound=_Ranked)


class _Priced(_Ranked, Protocol):
    @property
    def penalty(self) -> StepsPenalty | None: ...

    @property
    def to_loss_s(self) -> float: ...


P = TypeVar("P", bound=_Priced)


def smallest_near_best(rows: Sequence[R], cost: Callable[[R], float], tiebreak: Callable[[R], float]) -> R:
    """The smallest period within :data:`NEAR_BEST` of the lowest ``cost``; at it the smallest overlap
    within reach, then the lowest cost, then the lowest ``tiebreak``."""
    target = min(cost(r) for r in rows) * NEAR_BEST
    near = [r for r in rows if cost(r) <= target]
    period = min(r.period or 1 for r in near)
    return min((r for r in near if (r.period or 1) == period), key=lambda r: (r.overlap, cost(r), tiebreak(r)))


def rank_by_time_to_loss(rows: Sequence[P], tiebreak: Callable[[P], float]) -> tuple[P, P | None]:
    """The recommendation by predicted wall-clock to DDP's loss (``to_loss_s``) among ``rows`` whose
    penalty is trusted (or absent: k = 1, intra-only), and the row held back: one that would reach
    the loss sooner but whose penalty is extrapolated or only a lower bound (None if none)."""
    priced = [r for r in rows if r.penalty is None or r.penalty.trusted]
    rec = smallest_near_best(priced, lambda r: r.to_loss_s, tiebreak)
    unpriced = [r for r in rows if r.penalty and r.penalty.known and not r.penalty.trusted]
    held_back = min((r for r in unpriced if r.to_loss_s < rec.to_loss_s), key=lambda r: r.to_loss_s, default=None)
    return rec, held_back


def compare_compress(
    plan: Plan, replan: Callable[[str], Plan]
) -> tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float, str], ...], str]:
    """(step per option at ``plan``'s recommendation, (step, schedule) per option re-planned by
    ``replan``, the option that pays)."""
    same, steps = [], []
    for option in COMPRESS_COMPARED:
        alt = replan(option)
        steps.append((option, alt.recommended.step_s, alt.recommended.schedule))
        same.append((option, _row_step(plan, option)))
    return tuple(same), tuple(steps), compress_pays(same)


def compress_pays(same: Sequence[tuple[str, float]]) -> str:
    """The least lossy option of ``(compress, step s)`` whose step is within :data:`COMPRESS_NEAR` of
    the fastest one's, :data:`COMPRESS_LOSSY` left out."""
    kept = [(option, step) for option, step in same if option not in COMPRESS_LOSSY]
    fastest = min(step for _, step in kept)
    return next(option for option, step in kept if step <= fastest * COMPRESS_NEAR)


def _row_step(plan: Plan, compress: str) -> float:
    """The step of the plan's recommended configuration with ``compress`` instead."""
    rec = plan.recommended
    if rec.period in (None, 1) or plan.profile.nodes == 1:
        return rec.step_s  # nothing crosses nodes compressed
    return cm.step_time(
        "hiersync", profile=plan.profile, grad_bytes=plan.grad_bytes, bucket_bytes=rec.bucket_mb * MiB,
        backward_s=plan.backward_s, compute_s=plan.compute_s, period=rec.period, fragments=rec.fragments,
        overlap=rec.overlap, placement=rec.placement,
        copy_s_per_byte=0.0 if math.isinf(plan.copy_gbps) else 1 / (plan.copy_gbps * 1e9),
        compress=None if compress == "none" else compress, param_bytes=_DTYPE_BYTES[plan.dtype],
    ).step_s  # fmt: skip


def break_even_gbps(plan: Plan, *, gain: float = BREAK_EVEN_GAIN) -> float | None:
    """Inter-node bandwidth per node (GB/s) below which hiersync helps, by bisection.

    "Helps": the fastest of the plan's hiersync configurations (every row's period, F, tau
    and placement, each at the bucket size it does best at in the plan) steps at least
    ``gain`` times faster than DDP at its best bucket size of the grid, with the inter link's
    bandwidth (all NICs of a node together) set to the candidate and its latency kept. With
    a steps penalty (:attr:`PlanRow.penalty`) each step counts times its penalty: it helps when
    it reaches DDP's loss ``gain`` times sooner; rows the plan does not recommend on (an
    extrapolated penalty, a loss not reached) are left out.
    Returns ``math.inf`` when it helps even at 10 TB/s, None on one node or when it does
    not help even at 1 MB/s. Precision: about 1%.
    """
    p = plan.profile
    if p.nodes == 1:
        return None
    nics = min(p.rails or p.ranks_per_node, p.ranks_per_node)
    fastest: dict[tuple, PlanRow] = {}
    priced = (r for r in plan.rows if r.period and (r.penalty is None or r.penalty.trusted))
    for r in sorted(priced, key=lambda r: r.to_loss_s):
        fastest.setdefault((r.period, r.fragments, r.overlap, r.placement), r)
    # fastest first: helps() stops early
    configs = [(*key, r.bucket_mb, r.penalty.value if r.penalty else 1.0) for key, r in fastest.items()]
    ddp_buckets = sorted({r.bucket_mb for r in plan.rows if r.schedule == "ddp"})
    kw: dict[str, Any] = dict(
        grad_bytes=plan.grad_bytes,
        backward_s=plan.backward_s,
        compute_s=plan.compute_s,
        copy_s_per_byte=0.0 if math.isinf(plan.copy_gbps) else 1 / (plan.copy_gbps * 1e9),
    )

    def helps(node_gbps: float) -> bool:
        inter = cm.Link(p.inter.alpha, nics / (node_gbps * 1e9), p.inter.gamma)
        prof = replace(p, inter=inter)
        ddp = min(cm.step_time("ddp", profile=prof, bucket_bytes=mb * MiB, **kw).step_s for mb in ddp_buckets)
        target = ddp / gain
        for k, f, t, where, mb, penalty in configs:
            st = cm.step_time(
                "hiersync", profile=prof, bucket_bytes=mb * MiB, period=k, fragments=f, overlap=t,
                placement=where, compress=None if plan.compress == "none" else plan.compress,
                param_bytes=_DTYPE_BYTES[plan.dtype], **kw,
            )  # fmt: skip
            if st.step_s * penalty <= target:
                return True
        return False

    lo, hi = BREAK_EVEN_RANGE_GBPS
    if helps(hi):
        return math.inf
    if not helps(lo):
        return None
    for _ in range(12):  # log-space bisection: 7 decades to ~0.4%
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if helps(mid) else (lo, mid)
    return lo
