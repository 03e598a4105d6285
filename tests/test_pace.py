"""Pace: the steps each node takes a window (hiersync.pace) and what fixed and adaptive pace buy on
nodes of different speeds (hiersync.costmodel.pace, ``plan --node-speeds``). Pure: microseconds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hiersync.costmodel.pace import ddp_paced, paced, parse_speeds
from hiersync.pace import TOLERANCE, check_pace, steps_per_window


def test_the_fastest_takes_the_period_and_the_others_what_fits():
    assert steps_per_window([0.1, 0.2, 0.4, 0.8], period=8) == [8, 4, 2, 1]
    assert steps_per_window([0.3, 0.1], period=4) == [1, 4]  # 4 x 0.1 = 0.4 holds one step of 0.3
    assert steps_per_window([0.1, 10.0], period=4) == [4, 1]  # never fewer than 1
    assert steps_per_window([0.1], period=5) == [5]


def test_timer_noise_never_costs_a_step():
    # within the tolerance of the fastest: the fastest's count, not period - 1
    assert steps_per_window([0.100, 0.1049, 0.1001], period=16) == [16, 16, 16]
    # beyond it: one step fewer
    assert steps_per_window([0.100, 0.112], period=16) == [16, 15]
    assert steps_per_window([0.100, 0.1049], period=16, tolerance=0.0) == [16, 15]


@given(
    st.lists(st.floats(min_value=1e-3, max_value=10.0), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=64),
)
def test_every_node_fills_the_window_and_the_window_pays(times, period):
    """The fastest takes ``period``; no node could take one more step inside the window as it lasts
    (its slowest node's steps); and the job trains at least as many samples a second as with the
    window of ``period`` fastest steps, each node taking what fits in it."""
    steps = steps_per_window(times, period)
    assert steps[times.index(min(times))] == period
    lasts = max(n * t for n, t in zip(steps, times))
    for n, t in zip(steps, times):
        assert 1 <= n <= period
        assert n == period or (n + 1) * t > lasts * (1 - 1e-12)  # one more would lengthen the window
    base = period * min(times) * (1 + TOLERANCE)
    plain = [min(period, max(1, math.floor(base / t))) for t in times]
    plain_rate = sum(plain) / max(n * t for n, t in zip(plain, times))
    assert sum(steps) / lasts >= plain_rate * (1 - 1e-12)


def test_a_node_that_fits_most_of_a_step_more_takes_it_when_that_pays():
    # 4.7 steps fit: 5, the window 4% longer, 3.4% more samples a second
    assert steps_per_window([0.45, 0.77], period=8) == [8, 5]
    # among many fast nodes the same slow node stays at 4: stretching would cost every other node
    assert steps_per_window([0.45] * 15 + [0.77], period=8) == [8] * 15 + [4]
    # 4.2 steps fit: 4 (a fifth would stretch the window by 20%)
    assert steps_per_window([0.45, 0.86], period=8) == [8, 4]


@pytest.mark.parametrize(
    "times, period, match",
    [
        ([], 4, "none given"),
        ([0.1, 0.0], 4, "finite and > 0"),
        ([0.1, math.nan], 4, "finite and > 0"),
        ([0.1], 0, "period must be an int >= 1"),
        ([0.1], True, "period must be an int >= 1"),
    ],
)
def test_bad_inputs_are_named(times, period, match):
    with pytest.raises(ValueError, match=match):
        steps_per_window(times, period)


def test_pace_names():
    assert check_pace("fixed") == "fixed" and check_pace("adaptive") == "adaptive"
    with pytest.raises(ValueError, match="'fixed', 'adaptive'"):
        check_pace("auto")


def test_fixed_and_adaptive_pace_by_hand():
    """4 nodes, node 3 at half speed, 0.1 s steps, k = 8, a sync that adds 0.2 s a window."""
    speeds = [1, 1, 1, 0.5]
    fixed = paced(speeds, compute_s=0.1, period=8, sync_s=0.2, pace="fixed")
    adaptive = paced(speeds, compute_s=0.1, period=8, sync_s=0.2, pace="adaptive")
    ideal = 3 * 8 / (0.8 + 0.2) + 8 / (1.6 + 0.2)  # each node alone: its 8 steps and the sync
    assert fixed.steps == (8, 8, 8, 8) and fixed.window_s == pytest.approx(8 * 0.2 + 0.2)
    assert fixed.samples_per_s == pytest.approx(32 / 1.8) and fixed.ideal_per_s == pytest.approx(ideal)
    assert adaptive.steps == (8, 8, 8, 4) and adaptive.window_s == pytest.approx(0.8 + 0.2)
    assert adaptive.samples_per_s == pytest.approx(28 / 1.0) and adaptive.of_ideal == pytest.approx(28 / ideal)
    assert adaptive.samples_per_window == pytest.approx(28 / 32) and fixed.samples_per_window == 1
    # without communication the ideal is sum(s) / N of equal speeds: 3.5/4, which adaptive pace reaches
    free = paced(speeds, compute_s=0.1, period=8, pace="adaptive")
    equal = paced([1, 1, 1, 1], compute_s=0.1, period=8, pace="adaptive")
    assert free.of_ideal == pytest.approx(1.0) and free.samples_per_s / equal.samples_per_s == pytest.approx(3.5 / 4)
    assert paced(speeds, compute_s=0.1, period=8, pace="fixed").of_ideal == pytest.approx(2 / 3.5)


def test_ddp_waits_for_the_slowest_every_step():
    got = ddp_paced([1, 0.5], compute_s=0.1, exposed_s=0.05)
    assert got.window_s == pytest.approx(0.2 + 0.05) and got.samples_per_s == pytest.approx(2 / 0.25)
    assert got.ideal_per_s == pytest.approx(1 / 0.15 + 1 / 0.25)


def test_speeds_are_checked():
    assert parse_speeds("1, 1,0.5") == [1.0, 1.0, 0.5] == parse_speeds("2,2,1")  # relative to the fastest
    for text, match in [("1,x", "numbers separated by commas"), ("1,-1", "finite and > 0"), ("1,0", "finite and > 0")]:
        with pytest.raises(ValueError, match=match):
            parse_speeds(text)


def test_plan_prices_a_slow_node(capsys):
    from hiersync.tools.cli import main

    argv = "plan --preset a100-1nic --nodes 4 --params 1e9 --backward-ms 200 --forward-ms 100 --periods 1,8"
    main([*argv.split(), "--node-speeds", "1,1,1,0.5"])
    out = capsys.readouterr().out
    table = out[out.index("nodes of different speeds") :].splitlines()
    rows = {line[:20].strip(): line[20:].split() for line in table[2:5]}
    assert set(rows) == {"DDP", "k=8, fixed pace", "k=8, adaptive pace"}, table
    assert rows["k=8, adaptive pace"][:4] == ["8", "8", "8", "4"] and rows["k=8, fixed pace"][:4] == ["8"] * 4
    fixed, adaptive = float(rows["k=8, fixed pace"][-2]), float(rows["k=8, adaptive pace"][-2])
    assert adaptive > fixed and adaptive <= 1.0  # x ideal
    assert "pace='adaptive'" in out and "samples/window" in out
    with pytest.raises(SystemExit, match="3 speeds for 4 nodes"):
        main([*argv.split(), "--node-speeds", "1,1,0.5"])
