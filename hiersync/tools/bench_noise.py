"""A bench run's own noise on the figures its claims compare: intervals and verdicts. Pure (numpy only).

A claim compares two rows of one run, each timed over its own steps, so a ratio (or a
difference) of two means carries both rows' scatter. The rows' per-step durations
(``step_durations_s``) give it:

* a row of period k is a sequence of windows of k steps whose steps differ by design (the
  k-th carries the sync, or each one fragment) while their means do not, and steps are
  autocorrelated (a busy second slows a few in a row): the samples are the means of batches,
  a window each (a period-1 row: 4 steps, or 2, while 4 batches remain), :func:`mean_and_se`;
* the ratio of two means gets a Student-t interval on its logarithm (the delta method; the
  degrees of freedom by Welch-Satterthwaite, so a row of 2 windows widens it as it should),
  :func:`ratio_interval`; a difference of two means the same on the linear scale,
  :func:`difference_interval`;
* a quantile (p50, p99) has no such formula: its ratio's interval is a bootstrap that resamples
  whole windows with a fixed seed, :func:`quantile_ratio_interval` (rough for p99 of a few dozen
  steps, which is near their maximum: the interval is as wide as the batches' slowest steps differ).

:func:`verdict` then says PASS or FAIL only when the interval is clear of the bound, and
``inconclusive`` where the bound lies inside it. The intervals describe the scatter of the steps
within each row; a load that changes between two rows (they are timed one after the other) moves
their ratio by more, which no single run can see: on a host that was loaded before the run
(:func:`loaded`) no step-time verdict is given.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CONFIDENCE",
    "Interval",
    "steps_of",
    "runs_of",
    "paired_interval",
    "t_quantile",
    "batch_length",
    "mean_and_se",
    "ratio_interval",
    "difference_interval",
    "quantile_ratio_interval",
    "verdict",
    "loaded",
]

CONFIDENCE = 0.95
"""Two-sided: a verdict is wrong about a bound by chance at most 2.5% of the time."""
MIN_BATCHES = 4
"""A period-1 row is batched (:func:`batch_length`) only where this many batches remain."""
BOOTSTRAP = 2000
"""Resamples of a quantile's interval (a fixed seed: the same run prints the same interval)."""


@dataclass(frozen=True)
class Interval:
    """An estimate and its ``CONFIDENCE`` interval."""

    estimate: float
    low: float
    high: float

    @property
    def noise(self) -> float:
        """The interval's half width relative to the estimate (0.05: +-5%)."""
        return (self.high - self.low) / 2 / abs(self.estimate) if self.estimate else math.inf

    def as_dict(self) -> dict[str, float]:
        return {"low": self.low, "high": self.high, "noise": self.noise}


def steps_of(row: dict) -> list[float]:
    """A row's per-step durations in seconds (``step_durations_s``, ";"-joined; empty when it has none)."""
    text = row.get("step_durations_s") or ""
    return [float(x) for x in str(text).split(";") if x]


def runs_of(row: dict) -> list[float]:
    """A row's mean step in each of its runs, in the order they ran (``step_s_runs``; one run: empty)."""
    text = row.get("step_s_runs") or ""
    runs = [float(x) for x in str(text).split(";") if x]
    return runs if len(runs) > 1 else []


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile ``p`` with ``df`` degrees of freedom (no scipy).

    ``df`` is rounded down (a larger quantile: a wider interval); 1 and 2 exactly, above that
    the Cornish-Fisher expansion (Abramowitz and Stegun 26.7.5), within 0.2% from 3 on.
    """
    if not 0.5 <= p < 1:
        raise ValueError(f"p={p} must be in [0.5, 1)")
    if not df >= 1:
        raise ValueError(f"df={df} must be >= 1")
    n = math.floor(df)
    if n == 1:
        return math.tan(math.pi * (p - 0.5))
    if n == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / n + g2 / n**2 + g3 / n**3 + g4 / n**4


def batch_length(count: int, period: int = 1) -> int:
    """Steps per batch: a row's window of ``period`` steps; a period-1 row's steps in batches of 4
    (else 2, else 1) while that leaves ``MIN_BATCHES`` batches (its steps are autocorrelated: a
    busy second slows a few steps in a row)."""
    if period > 1:
        return int(period)
    return next((b for b in (4, 2) if count // b >= MIN_BATCHES), 1)


def mean_and_se(steps: Sequence[float], period: int = 1) -> tuple[float, float, int] | None:
    """(mean step, its standard error, degrees of freedom) by batch means, or None with fewer than 2 batches.

    The steps are cut into batches (:func:`batch_length`; a trailing part batch is left out): a
    window's steps differ by design but their mean does not, so the batches' means are the
    samples, and the standard error is their standard deviation over sqrt(batches).
    """
    b = batch_length(len(steps), period)
    m = len(steps) // b
    if m < 2:
        return None
    means = [statistics.fmean(steps[i * b : (i + 1) * b]) for i in range(m)]
    return statistics.fmean(means), statistics.stdev(means) / math.sqrt(m), m - 1


def _welch_df(parts: Sequence[tuple[float, int]]) -> float:
    """Welch-Satterthwaite: degrees of freedom of a sum of variances ``v`` each with ``df``."""
    total = sum(v for v, _ in parts)
    denom = sum(v * v / df for v, df in parts)
    return total * total / denom if denom > 0 else float(sum(df for _, df in parts))


def _half_width(parts: Sequence[tuple[float, int]], confidence: float) -> float:
    """t x sqrt(sum of the variances ``v``) with Welch's degrees of freedom; 0 where they are all 0."""
    spread = math.sqrt(sum(v for v, _ in parts))
    return t_quantile(0.5 + confidence / 2, _welch_df(parts)) * spread if spread > 0 else 0.0


def ratio_interval(
    steps: Sequence[float],
    period: int,
    ref_steps: Sequence[float],
    ref_period: int,
    confidence: float = CONFIDENCE,
    *,
    estimate: float | None = None,
) -> Interval | None:
    """The ``confidence`` interval of mean(``steps``) / mean(``ref_steps``), two independent rows.

    On the log scale: log(a/b) +- t x sqrt((se_a/a)^2 + (se_b/b)^2). ``estimate``: the ratio to
    centre it on (the rows' printed means; default the steps' own). None where a row has fewer
    than 2 batches.
    """
    a, b = mean_and_se(steps, period), mean_and_se(ref_steps, ref_period)
    if a is None or b is None or a[0] <= 0 or b[0] <= 0:
        return None
    h = _half_width([((a[1] / a[0]) ** 2, a[2]), ((b[1] / b[0]) ** 2, b[2])], confidence)
    centre = a[0] / b[0] if estimate is None else estimate
    return Interval(centre, centre * math.exp(-h), centre * math.exp(h))


def difference_interval(
    steps: Sequence[float],
    period: int,
    ref_steps: Sequence[float],
    ref_period: int,
    confidence: float = CONFIDENCE,
    *,
    estimate: float | None = None,
) -> Interval | None:
    """The ``confidence`` interval of mean(``steps``) - mean(``ref_steps``) (seconds), two independent rows."""
    a, b = mean_and_se(steps, period), mean_and_se(ref_steps, ref_period)
    if a is None or b is None:
        return None
    h = _half_width([(a[1] ** 2, a[2]), (b[1] ** 2, b[2])], confidence)
    centre = a[0] - b[0] if estimate is None else estimate
    return Interval(centre, centre - h, centre + h)


def paired_interval(
    runs: Sequence[float],
    ref_runs: Sequence[float],
    confidence: float = CONFIDENCE,
    *,
    ratio: bool = True,
    estimate: float | None = None,
) -> Interval | None:
    """The ``confidence`` interval of two rows' ratio (``ratio``) or difference from runs timed in
    interleaved rounds: run ``i`` of each row in round ``i`` (:data:`.bench_spec.STEADY_ROUNDS`).

    Each round gives one sample, ``log(run / ref_run)`` or ``run - ref_run``, taken under that
    round's load, so the rounds' spread holds the drift between rows that one row's steps cannot
    show (and each run's own step noise). Student t with rounds - 1 degrees of freedom. None where
    the rows do not have the same number of runs, at least 2.
    """
    n = len(runs)
    if n < 2 or len(ref_runs) != n or (ratio and min(*runs, *ref_runs) <= 0):
        return None
    d = [math.log(a / b) if ratio else a - b for a, b in zip(runs, ref_runs)]
    h = _half_width([(statistics.variance(d) / n, n - 1)], confidence)
    mean = statistics.fmean(d)
    if ratio:
        centre = math.exp(mean) if estimate is None else estimate
        return Interval(centre, centre * math.exp(-h), centre * math.exp(h))
    centre = mean if estimate is None else estimate
    return Interval(centre, centre - h, centre + h)


def quantile_ratio_interval(
    steps: Sequence[float],
    period: int,
    ref_steps: Sequence[float],
    ref_period: int,
    q: float,
    confidence: float = CONFIDENCE,
    *,
    estimate: float | None = None,
    seed: int = 0,
) -> Interval | None:
    """A bootstrap interval of quantile ``q`` (0..100) of ``steps`` over that of ``ref_steps``.

    Each resample draws as many whole batches (:func:`batch_length`) of each row as it has, with
    replacement; the interval is the resampled ratios' percentiles. None where a row has fewer than
    2 batches.
    """
    import numpy as np

    def windows(xs: Sequence[float], k: int) -> np.ndarray | None:
        b = batch_length(len(xs), k)
        m = len(xs) // b
        return np.asarray(xs[: m * b], dtype=float).reshape(m, b) if m >= 2 else None

    a, b = windows(steps, period), windows(ref_steps, ref_period)
    if a is None or b is None:
        return None
    rng = np.random.default_rng(seed)

    def resampled(w: np.ndarray) -> np.ndarray:
        picks = rng.integers(0, len(w), size=(BOOTSTRAP, len(w)))
        return np.percentile(w[picks].reshape(BOOTSTRAP, -1), q, axis=1)

    ref = resampled(b)
    if not (ref > 0).all():
        return None
    ratios = resampled(a) / ref
    tail = (1 - confidence) / 2 * 100
    low, high = (float(x) for x in np.percentile(ratios, [tail, 100 - tail]))
    centre = float(np.percentile(a, q) / np.percentile(b, q)) if estimate is None else estimate
    return Interval(centre, min(low, centre), max(high, centre))


def loaded(environment: dict | None) -> str | None:
    """Why no step-time verdict can be trusted on this run's host, or None: the 1-minute load average
    before the run above the cores (``environment``: ``bench.json``'s). Rows are timed one after the
    other, and on a host whose other work takes the cores the ranks need, that load changes between
    two rows by more than the steps within a row scatter, which no interval from the steps holds."""
    if not environment:
        return None
    load, cpus = environment.get("loadavg_1min_before"), environment.get("cpus")
    if load is None or not cpus or load <= cpus:
        return None
    return f"host loaded: load average {load:.1f} on {cpus} cores before the run"


def verdict(interval: Interval, high: float, low: float = -math.inf) -> str:
    """``"pass"`` where the whole interval lies within [``low``, ``high``] (a claim ``<= high``: the
    default ``low``), ``"fail"`` where none of it does, else ``"inconclusive"``."""
    if low <= interval.low and interval.high <= high:
        return "pass"
    if interval.low > high or interval.high < low:
        return "fail"
    return "inconclusive"
