"""A bench run's own noise on the figures its claims compare: intervals and verdicts. Pure (numpy, scipy.stats).

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

The t intervals are scipy's (``ttest_1samp``, and ``ttest_ind(equal_var=False)`` for Welch's), the
bootstrap is :func:`bootstrap_interval` (``scipy.stats.bootstrap``), which benchmarks/time_to_loss.py's
intervals over seeds share; every quantile is numpy's default (linear) rule. scipy is the ``bench``
extra's: ``pip install 'hiersync[bench]'``.

:func:`verdict` then says PASS or FAIL only when the interval is clear of the bound, and
``inconclusive`` where the bound lies inside it. The intervals describe the scatter of the steps
within each row; a load that changes between two rows (they are timed one after the other) moves
their ratio by more, which no single run can see: on a host that was loaded before the run
(:func:`loaded`) no step-time verdict is given.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CONFIDENCE",
    "Interval",
    "steps_of",
    "runs_of",
    "paired_interval",
    "batch_length",
    "mean_and_se",
    "ratio_interval",
    "difference_interval",
    "bootstrap_interval",
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


def _scipy_stats() -> Any:
    """``scipy.stats``, imported where an interval is computed (scipy is the bench's extra, not hiersync's)."""
    try:
        from scipy import stats
    except ImportError as e:
        raise ImportError("the bench's intervals need scipy: pip install 'hiersync[bench]'") from e
    return stats


def batch_length(count: int, period: int = 1) -> int:
    """Steps per batch: a row's window of ``period`` steps; a period-1 row's steps in batches of 4
    (else 2, else 1) while that leaves ``MIN_BATCHES`` batches (its steps are autocorrelated: a
    busy second slows a few steps in a row)."""
    if period > 1:
        return int(period)
    return next((b for b in (4, 2) if count // b >= MIN_BATCHES), 1)


def _batches(steps: Sequence[float], period: int) -> np.ndarray | None:
    """``steps`` cut into batches (:func:`batch_length`; a trailing part batch left out), a row each, or None
    with fewer than 2 batches."""
    b = batch_length(len(steps), period)
    m = len(steps) // b
    return np.asarray(steps[: m * b], dtype=float).reshape(m, b) if m >= 2 else None


def _batch_means(steps: Sequence[float], period: int) -> np.ndarray | None:
    batches = _batches(steps, period)
    return None if batches is None else batches.mean(axis=1)


def mean_and_se(steps: Sequence[float], period: int = 1) -> tuple[float, float, int] | None:
    """(mean step, its standard error, degrees of freedom) by batch means, or None with fewer than 2 batches.

    The steps are cut into batches (:func:`batch_length`; a trailing part batch is left out): a
    window's steps differ by design but their mean does not, so the batches' means are the
    samples, and the standard error is their standard deviation over sqrt(batches).
    """
    means = _batch_means(steps, period)
    if means is None:
        return None
    return float(means.mean()), float(means.std(ddof=1)) / math.sqrt(len(means)), len(means) - 1


def _t_half_width(x: np.ndarray, y: np.ndarray | None, confidence: float) -> float:
    """Half the width of Student's t interval of mean(``x``) (``y`` None: n - 1 degrees of freedom) or of
    mean(``x``) - mean(``y``) (Welch's: unequal variances, Welch-Satterthwaite degrees of freedom); 0 where
    neither sample scatters (a point: scipy's t would be 0/0)."""
    if not (np.var(x) > 0 or (y is not None and np.var(y) > 0)):
        return 0.0
    stats = _scipy_stats()
    with warnings.catch_warnings():
        # a sample whose values agree to float precision warns of precision loss: its spread is ~0 either way
        warnings.filterwarnings("ignore", "Precision loss", RuntimeWarning)
        test = stats.ttest_1samp(x, 0.0) if y is None else stats.ttest_ind(x, y, equal_var=False)
    ci = test.confidence_interval(confidence_level=confidence)
    return float(ci.high - ci.low) / 2


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
    a, b = _batch_means(steps, period), _batch_means(ref_steps, ref_period)
    if a is None or b is None or a.mean() <= 0 or b.mean() <= 0:
        return None
    # each row's batch means over their mean: Welch's interval of their difference has log(a/b)'s delta-method
    # variance, (se_a/a)^2 + (se_b/b)^2, and Welch's degrees of freedom from those two terms
    h = _t_half_width(a / a.mean(), b / b.mean(), confidence)
    centre = float(a.mean() / b.mean()) if estimate is None else estimate
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
    a, b = _batch_means(steps, period), _batch_means(ref_steps, ref_period)
    if a is None or b is None:
        return None
    h = _t_half_width(a, b, confidence)  # Welch's: the batch means of two rows
    centre = float(a.mean() - b.mean()) if estimate is None else estimate
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
    d = np.array([math.log(a / b) if ratio else a - b for a, b in zip(runs, ref_runs)])
    h = _t_half_width(d, None, confidence)
    mean = float(d.mean())
    if ratio:
        centre = math.exp(mean) if estimate is None else estimate
        return Interval(centre, centre * math.exp(-h), centre * math.exp(h))
    centre = mean if estimate is None else estimate
    return Interval(centre, centre - h, centre + h)


def bootstrap_interval(
    samples: Sequence[np.ndarray],
    statistic: Callable[..., Any],
    confidence: float = CONFIDENCE,
    *,
    vectorized: bool = True,
    resamples: int = BOOTSTRAP,
    seed: int = 0,
) -> tuple[Any, Any]:
    """The percentile bootstrap interval ``(low, high)`` of ``statistic(*samples)`` (``scipy.stats.bootstrap``).

    Each sample is resampled with replacement on its own (a statistic of paired samples resamples
    their indices: one sample of ``np.arange(n)``), ``resamples`` times by a generator seeded with
    ``seed``, so the same data gives the same interval. ``statistic`` takes the resampled samples
    (and ``axis``, along which they lie, where ``vectorized``) and returns a number, or a vector
    (then ``low`` and ``high`` are vectors). The ends are the resampled statistics' (1 - confidence)/2
    and (1 + confidence)/2 quantiles by numpy's linear rule. The percentile method, not scipy's
    default BCa: BCa gives no interval for samples alike (three seeds of one run: a point here) nor
    for a statistic that can be inf (a resample whose loss curve never reaches the target), whose
    draws are ordered as numbers are: an end between a finite draw and an inf one is inf.
    """
    stats = _scipy_stats()
    # inf draws: their (unused) standard error and an end beside one are nan, put right below
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=stats.DegenerateDataWarning)
        res = stats.bootstrap(
            tuple(samples),
            statistic,
            n_resamples=resamples,
            vectorized=vectorized,
            confidence_level=confidence,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    # the linear rule, (1 - g) x_j + g x_j+1, is nan (0 x inf) where it lands on an order statistic (g = 0)
    # below an inf draw: there it is that order statistic, x_j
    tail = (1 - confidence) / 2
    ends = res.confidence_interval.low, res.confidence_interval.high
    low, high = (
        np.where(np.isnan(e), np.quantile(res.bootstrap_distribution, p, axis=-1, method="lower"), e)
        for e, p in zip(ends, (tail, 1 - tail))
    )
    return low, high


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
    replacement (:func:`bootstrap_interval`). None where a row has fewer than 2 batches or a
    reference step is not positive.
    """
    a, b = _batches(steps, period), _batches(ref_steps, ref_period)
    if a is None or b is None or b.min() <= 0:
        return None

    def ratio(i: np.ndarray, j: np.ndarray, axis: int = -1) -> np.ndarray:
        """The quantiles' ratio over resampled batch indices ``i``, ``j`` (..., batches): the drawn batches' steps."""
        qa = np.percentile(a[i].reshape(*i.shape[:-1], -1), q, axis=-1)
        qb = np.percentile(b[j].reshape(*j.shape[:-1], -1), q, axis=-1)
        return qa / qb

    low, high = (
        float(x) for x in bootstrap_interval((np.arange(len(a)), np.arange(len(b))), ratio, confidence, seed=seed)
    )
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
