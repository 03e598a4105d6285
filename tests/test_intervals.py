"""The bench's intervals (hiersync.tools.bench_noise) against references computed here, and their coverage.

The t intervals are checked against the textbook formulas (Welch-Satterthwaite degrees of freedom,
Student's t from scipy.stats.t), and all of them, the bootstrap's included, by how often they hold
the true value over many seeded draws of a known distribution. Pure (no processes), a few seconds.
"""

from __future__ import annotations

import math
import statistics
import sys

import numpy as np
import pytest
import scipy.stats

from hiersync.tools import bench_noise

# two small rows of unequal size and spread: one step per sample (fewer than 8 steps: batches of 1)
A = [0.542, 0.477, 0.594, 0.503, 0.451]
B = [0.402, 0.461, 0.413, 0.440, 0.431, 0.392, 0.455]


def _welch(parts: list[tuple[float, int]]) -> float:
    """Welch-Satterthwaite: the degrees of freedom of a sum of variances ``v``, each with ``df``."""
    return sum(v for v, _ in parts) ** 2 / sum(v * v / df for v, df in parts)


def test_difference_interval_is_welchs():
    va, vb = statistics.variance(A) / len(A), statistics.variance(B) / len(B)
    df = _welch([(va, len(A) - 1), (vb, len(B) - 1)])
    assert 4 < df < 6 and abs(df - round(df)) > 0.1  # not the pooled test's 10, nor a whole number
    half = scipy.stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    diff = statistics.fmean(A) - statistics.fmean(B)
    got = bench_noise.difference_interval(A, 1, B, 1)
    assert got.estimate == pytest.approx(diff, rel=1e-12)
    assert (got.low, got.high) == pytest.approx((diff - half, diff + half), rel=1e-9)
    # the pooled-variance interval (equal variances, 10 degrees of freedom) is another one
    pooled = ((len(A) - 1) * statistics.variance(A) + (len(B) - 1) * statistics.variance(B)) / (len(A) + len(B) - 2)
    pooled_half = scipy.stats.t.ppf(0.975, 10) * math.sqrt(pooled * (1 / len(A) + 1 / len(B)))
    assert abs(got.high - got.low - 2 * pooled_half) > 0.05 * pooled_half
    # centred on a given estimate, the same width; a row of one batch has none
    moved = bench_noise.difference_interval(A, 1, B, 1, estimate=0.1)
    assert (moved.low, moved.high) == pytest.approx((0.1 - half, 0.1 + half), rel=1e-9)
    assert bench_noise.difference_interval(A[:1], 1, B, 1) is None


def test_ratio_interval_is_the_delta_method_on_the_log_scale():
    ma, mb = statistics.fmean(A), statistics.fmean(B)
    ra, rb = statistics.variance(A) / len(A) / ma**2, statistics.variance(B) / len(B) / mb**2
    df = _welch([(ra, len(A) - 1), (rb, len(B) - 1)])
    half = scipy.stats.t.ppf(0.975, df) * math.sqrt(ra + rb)
    got = bench_noise.ratio_interval(A, 1, B, 1)
    assert got.estimate == pytest.approx(ma / mb, rel=1e-12)
    assert (got.low, got.high) == pytest.approx((ma / mb * math.exp(-half), ma / mb * math.exp(half)), rel=1e-9)
    # the 90% interval lies inside the 95% one, by the ratio of their t quantiles on the log scale
    narrow = bench_noise.ratio_interval(A, 1, B, 1, confidence=0.9)
    assert math.log(narrow.high / narrow.estimate) == pytest.approx(
        half * scipy.stats.t.ppf(0.95, df) / scipy.stats.t.ppf(0.975, df), rel=1e-9
    )


def test_batches_of_a_window_are_the_samples():
    # period 4: a window of 4 steps is one sample (its mean), so 2 windows give 1 degree of freedom
    a = [0.4, 0.4, 0.4, 0.8, 0.5, 0.5, 0.5, 0.9]  # window means 0.5 and 0.6
    b = [0.5] * 3 + [0.51] * 3  # 6 samples of one step each: fewer than 8 steps
    se = statistics.stdev([0.5, 0.6]) / math.sqrt(2)
    sb = statistics.stdev(b) / math.sqrt(6)
    assert bench_noise.mean_and_se(a, 4) == pytest.approx((0.55, se, 1))
    df = _welch([(se**2, 1), (sb**2, 5)])
    half = scipy.stats.t.ppf(0.975, df) * math.sqrt(se**2 + sb**2)
    got = bench_noise.difference_interval(a, 4, b, 1)
    assert (got.low, got.high) == pytest.approx((0.55 - 0.505 - half, 0.55 - 0.505 + half), rel=1e-9)
    # no scatter at all: a point, not scipy's nan
    assert bench_noise.difference_interval([0.5] * 8, 4, [0.4] * 8, 4) == bench_noise.Interval(
        pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.1)
    )


def test_paired_interval_is_students_on_the_rounds():
    runs, ref = [1.0, 1.2, 1.1, 1.05], [0.97, 1.15, 1.08, 1.04]
    d = [math.log(a / b) for a, b in zip(runs, ref)]
    half = scipy.stats.t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    got = bench_noise.paired_interval(runs, ref)
    m = statistics.fmean(d)
    assert (got.estimate, got.low, got.high) == pytest.approx(
        (math.exp(m), math.exp(m - half), math.exp(m + half)), rel=1e-9
    )
    diffs = [a - b for a, b in zip(runs, ref)]
    half = scipy.stats.t.ppf(0.975, 3) * statistics.stdev(diffs) / math.sqrt(4)
    got = bench_noise.paired_interval(runs, ref, ratio=False)
    assert (got.low, got.high) == pytest.approx((statistics.fmean(diffs) - half, statistics.fmean(diffs) + half))


def _coverage(draw, contains, n: int) -> float:
    rng = np.random.default_rng(1234)
    return sum(contains(*draw(rng)) for _ in range(n)) / n


def test_t_intervals_hold_the_true_value_95_times_in_100():
    """Over 2000 seeded draws each interval holds the truth 93-97% of the time (3 standard errors of 95%).

    The rows are the case Welch's is for: the smaller row scatters more (a pooled variance's
    interval holds the truth 81% of the time here); the paired intervals have the bench's 3 rounds.
    """
    n = 2000

    def rows(rng):
        return list(rng.normal(0.55, 0.03, 5)), list(rng.normal(0.5, 0.01, 12))

    def has(lo_hi, truth):
        return lo_hi.low <= truth <= lo_hi.high

    diff = _coverage(rows, lambda a, b: has(bench_noise.difference_interval(a, 1, b, 1), 0.05), n)
    ratio = _coverage(rows, lambda a, b: has(bench_noise.ratio_interval(a, 1, b, 1), 0.55 / 0.5), n)

    def rounds(rng):  # 3 rounds, each one's load shared by both rows
        load = rng.normal(1.0, 0.1, 3)
        return list(load * 1.1 * rng.lognormal(0, 0.02, 3)), list(load * rng.lognormal(0, 0.02, 3))

    paired = _coverage(rounds, lambda a, b: has(bench_noise.paired_interval(a, b), 1.1), n)
    assert 0.93 <= diff <= 0.97 and 0.93 <= ratio <= 0.97 and 0.93 <= paired <= 0.97, (diff, ratio, paired)


def test_bootstrap_interval_of_a_mean_is_the_normal_theory_one():
    x = np.random.default_rng(7).normal(10.0, 2.0, 400)
    lo, hi = bench_noise.bootstrap_interval((x,), np.mean, 0.9)
    half = scipy.stats.norm.ppf(0.95) * x.std(ddof=1) / math.sqrt(len(x))
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.08) and (lo + hi) / 2 == pytest.approx(x.mean(), abs=0.1 * half)
    assert (lo, hi) == bench_noise.bootstrap_interval((x,), np.mean, 0.9)  # a fixed seed
    assert (lo, hi) != bench_noise.bootstrap_interval((x,), np.mean, 0.9, seed=1)
    # a statistic of several numbers: an interval each; of paired samples: resample their indices
    y = 2 * x + 1
    lows, highs = bench_noise.bootstrap_interval((np.arange(len(x)),), lambda i: np.array([x[i].mean(), y[i].mean()]),
                                                 0.9, vectorized=False, resamples=500)  # fmt: skip
    assert highs[1] == pytest.approx(2 * highs[0] + 1) and lows[1] == pytest.approx(2 * lows[0] + 1)


def test_bootstrap_interval_of_a_statistic_that_can_be_inf():
    """A draw whose loss curve never reaches the target is inf: an end beside such draws is inf, never nan."""
    x = np.array([1.0] * 9 + [math.inf])  # 0.9**10: 35% of the draws leave the inf out
    lo, hi = bench_noise.bootstrap_interval((x,), np.mean, 0.9)
    assert lo == 1.0 and hi == math.inf
    x = np.array([1.0, 2.0, math.inf, math.inf, math.inf])  # 0.4**5: 1% of the draws do
    assert bench_noise.bootstrap_interval((x,), np.mean, 0.9) == (math.inf, math.inf)


def test_bootstrap_interval_on_an_order_statistic_beside_an_inf_draw():
    """201 resamples at 90%: the upper end is the 191st of the sorted draws itself (numpy's linear rule at
    0.95 x 200), and here the 192nd is inf: scipy's (1 - g) x_j + g x_j+1 alone would be 0 x inf, nan."""
    x = np.arange(20.0)

    def mean_unless_three_zeros(i, axis=-1):  # inf where a draw holds index 0 three times or more
        return np.where((i == 0).sum(axis=-1) >= 3, np.inf, x[i].mean(axis=-1))

    lo, hi = bench_noise.bootstrap_interval((np.arange(20),), mean_unless_three_zeros, 0.9, resamples=201, seed=106)
    # the reference: the same resamples (scipy's, from the same seed), sorted, and the linear rule read off them
    with np.errstate(invalid="ignore"), pytest.warns(scipy.stats.DegenerateDataWarning):
        res = scipy.stats.bootstrap((np.arange(20),), mean_unless_three_zeros, n_resamples=201, confidence_level=0.9,
                                    method="percentile", rng=np.random.default_rng(106))  # fmt: skip
    d = np.sort(res.bootstrap_distribution)
    assert np.isfinite(d[190]) and d[191] == math.inf  # the case: an order statistic below an inf draw
    assert hi == d[190] and lo == d[10]


def test_quantile_ratio_interval_holds_the_true_ratio():
    """Steps log-normal around medians 0.6 s and 0.5 s: the p50 ratio's interval holds 1.2 about 95% of the time."""
    n = 300

    def rows(rng):
        return list(rng.lognormal(math.log(0.6), 0.1, 80)), list(rng.lognormal(math.log(0.5), 0.1, 80))

    def has(a, b):
        iv = bench_noise.quantile_ratio_interval(a, 1, b, 1, 50)
        return iv.low <= 1.2 <= iv.high

    assert 0.9 <= _coverage(rows, has, n) <= 0.99


def test_scipy_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    with pytest.raises(ImportError, match=r"pip install 'hiersync\[bench\]'"):
        bench_noise.difference_interval(A, 1, B, 1)
    with pytest.raises(ImportError, match=r"hiersync\[bench\]"):
        bench_noise.bootstrap_interval((np.array(A),), np.mean)
