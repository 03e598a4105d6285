"""benchmarks/time_to_loss.py's report: the target, crossings on the mean curve, intervals, verdicts.

Pure functions over hand-made runs (no processes); the benchmark's training runs live in benchmarks/.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import _ttl_stats as stats
    import time_to_loss as ttl
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def _run(points, final, wall):
    evals = [dict(step=s, wall_s=s * 0.1, val_loss=v) for s, v in points]
    return dict(evals=evals, final_val_loss=final, wall_s=wall, steps=points[-1][0])


def _two_seeds():
    runs = {
        "ddp": [_run([(0, 5), (10, 3), (20, 2.0)], 2.0, 2.0), _run([(0, 5), (10, 3), (20, 2.2)], 2.2, 2.2)],
        # mean curve 2.7 at 10, 2.225 at 20, 2.05 at 30; DDP's mean final 2.1
        "x": [
            _run([(0, 5), (10, 2.5), (20, 2.15), (30, 2.0)], 2.0, 1.0),
            _run([(0, 5), (10, 2.9), (20, 2.3)], 2.3, 1.0),
        ],
    }
    runs["x"][1]["evals"].append(dict(step=30, wall_s=3.0, val_loss=2.1))
    return runs


def test_reach_interpolates_between_evaluations():
    ev = [dict(step=0, wall_s=0, val_loss=5), dict(step=10, wall_s=1, val_loss=3), dict(step=20, wall_s=3, val_loss=2)]
    assert stats.reach(ev, 2.5) == pytest.approx(dict(step=15.0, wall_s=2.0))
    assert stats.reach(ev, 3.0) == pytest.approx(dict(step=10.0, wall_s=1.0))  # on an evaluation: that one
    assert stats.reach(ev, 4.0) == pytest.approx(dict(step=10.0, wall_s=1.0))  # step 0 is never a crossing
    assert stats.reach(ev, 1.9) is None


def test_mean_curve_target_and_crossings():
    target, (ddp, x) = ttl.summarize(_two_seeds(), 20)
    assert target == pytest.approx(2.1)
    assert ddp["steps_to_target"] == 20 and ddp["wall_to_target"] == pytest.approx(2.1) and ddp["steps_x_ddp"] == 1
    f = 0.125 / 0.175  # 2.225 -> 2.05 between steps 20 and 30 crosses 2.1 there
    assert x["steps_to_target"] == pytest.approx(20 + 10 * f) and x["steps_x_ddp"] == pytest.approx((20 + 10 * f) / 20)
    assert x["wall_x_ddp"] == pytest.approx((2.0 + f) / 2.1)
    assert x["per_seed_steps"] == [30, 25]  # seed 0 reaches its 2.0 at 30, seed 1 its 2.2 halfway from 20 to 30
    assert x["val_at_ddp_steps"] == pytest.approx(2.225) and x["spread_at_ddp_steps"] == pytest.approx(0.15)
    assert x["gap_at_steps"] == pytest.approx([0.15, 0.1])
    gap = x["paired_gap"]  # the mean of the seeds' gaps, and an interval inside their range
    assert gap["mean"] == pytest.approx(0.125) and 0.1 - 1e-9 <= gap["lo"] <= gap["hi"] <= 0.15 + 1e-9
    assert "+0.1250 (" in ttl.table([x], 20, 2.1, [0, 1])
    runs = _two_seeds()
    runs["x"][1]["evals"][-1]["val_loss"] = 2.5  # seed 1 never reaches: mean curve 2.25 at 30 > 2.1
    _, (_, x) = ttl.summarize(runs, 20)
    assert x["steps_to_target"] is None and x["per_seed_steps"] == [30, None]
    assert "not reached" in ttl.table([x], 20, 2.1, [0, 1])
    assert x["interval_90"] is None  # two seeds: no interval
    assert ttl.verdict(x, 1.05).startswith("FAIL on the mean (not reached")


def test_interval_verdict_and_budget_gap():
    one = _two_seeds()
    runs = {"ddp": [one["ddp"][0]] * 3, "x": [one["x"][0]] * 3}
    # three seeds alike: every resample gives the same crossing, so the interval is a point
    iv = stats.ratio_interval(runs, "x", 20)
    assert iv is not None and iv["steps"] == (1.5, 1.5) and iv["wall"] == (1.5, 1.5)  # step 30, 3.0 s vs 2.0 s
    row = dict(steps_x_ddp=1.5, interval_90=iv)
    assert ttl.verdict(row, 1.05).startswith("FAIL") and ttl.verdict(row, 1.5).startswith("PASS")
    runs["x"] = [runs["x"][0], runs["x"][0], dict(runs["x"][0], evals=runs["x"][0]["evals"][:2])]
    iv = stats.ratio_interval(runs, "x", 20)  # a seed whose curve stops above the target: some draws never reach
    assert iv is not None and iv["steps"][0] == 1.5 and iv["steps"][1] == math.inf
    assert ttl.verdict(dict(steps_x_ddp=1.5, interval_90=iv), 1.6).startswith("UNDECIDED")
    _, x = ttl.summarize(one, 20)[1]
    assert "(1.50-not reached)" in ttl.table([{**x, "interval_90": iv}], 20, 2.1, [0, 1, 2])
    # --budget: final loss minus DDP's, seed by seed (2.0 - 2.0 three times here)
    assert ttl.final_gap(runs, "x") == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    runs["x"] = [dict(r, final_val_loss=2.0 + d) for r, d in zip(runs["x"], (0.3, -0.1, 0.1))]
    gap = ttl.final_gap(runs, "x")
    assert gap["mean"] == pytest.approx(0.1) and -0.1 <= gap["lo"] < 0.1 < gap["hi"] <= 0.3


def test_wall_clock_from_a_loss_only_run():
    """Steps to DDP's loss from a many-seed run, s/step from this one: wall-clock ratio = their product."""
    rows = [
        dict(schedule="ddp", s_per_step=0.5),
        dict(schedule="x", s_per_step=0.1),
        dict(schedule="y", s_per_step=0.2),
    ]
    loss_rows = [
        dict(schedule="ddp", steps_x_ddp=1.0, interval_90=None),
        dict(schedule="x", steps_x_ddp=1.1, interval_90={"steps": (1.0, 1.2)}),
    ]
    got = stats.combine_steps(rows, loss_rows)
    assert [c["schedule"] for c in got] == ["ddp", "x"]  # y: not in the loss-only run
    assert got[1]["wall_x_ddp"] == pytest.approx(0.22) and got[1]["wall_interval"] == pytest.approx((0.2, 0.24))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in stats.combined_table(got, 8).splitlines()]
    assert rows[0][2] == "steps vs DDP (8 seeds, 90% interval)"
    assert ["x", "0.100", "1.10 (1.00-1.20)", "0.22 (0.20-0.24)"] in rows


def test_a_warm_up_row_is_timed_by_its_phases():
    """W exact steps at hiersync_k1's s/step, the rest at the steady twin's: not the row's own short run."""
    assert stats.timed_schedules(["ddp", "hiersync_k4_stream_w100_o0.7m0.5", "hiersync_k4_stream"]) == [
        "ddp",
        "hiersync_k1",
        "hiersync_k4_stream_o0.7m0.5",
        "hiersync_k4_stream",
    ]
    rows = [
        dict(schedule="ddp", s_per_step=0.5),
        dict(schedule="hiersync_k1", s_per_step=0.4),
        dict(schedule="hiersync_k4_stream", s_per_step=0.1),
    ]
    loss_rows = [dict(schedule="hiersync_k4_stream_w100", steps_x_ddp=1.2, interval_90={"steps": (0.2, 1.4)})]
    (got,) = stats.combine_steps(rows, loss_rows, ddp_steps=300)
    # 360 steps: 100 x 0.4 + 260 x 0.1 = 66 s against DDP's 300 x 0.5 = 150 s
    assert got["wall_x_ddp"] == pytest.approx(66 / 150)
    # 60 steps, all warm-up: 24 s; 420 steps: 40 + 32 = 72 s
    assert got["wall_interval"] == pytest.approx((24 / 150, 72 / 150))
    assert "warm-up at k=1, then hiersync_k4_stream" in stats.combined_table([got], 3)
    assert stats.combine_steps(rows[:2], loss_rows, ddp_steps=300) == []  # its steady twin not timed


def test_schedules_name_what_they_run():
    assert ttl.SCHEDULES["hiersync_k4_stream_expavg"]["average_optimizer_state"] == ("exp_avg",)
    assert ttl.SCHEDULES["hiersync_k4_stream_adam"]["average_optimizer_state"] == ("exp_avg", "exp_avg_sq")
    for name in ttl.DEFAULT_SCHEDULES + ttl.PEER_SCHEDULES["torchft"]:
        assert name in ttl.SCHEDULES


def test_hiersync_rows_are_named_by_their_options():
    from _ttl_worker import hiersync_options

    assert hiersync_options("hiersync_k4_stream") == {"period": 4, "fragments": 4, "overlap": 1}
    assert hiersync_options("hiersync_k16_stream4_tau2_w50_o0.7m0.9_int4_expavg") == {
        "period": 16,
        "fragments": 4,
        "overlap": 2,
        "warmup_steps": 50,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "compress": "int4",
        "average_optimizer_state": ("exp_avg",),
    }
    assert hiersync_options("hiersync_k4_w30") == {"period": 4, "warmup_steps": 30}
    assert hiersync_options("ddp") is None and hiersync_options("hiersync_k4_fast") is None
    with pytest.raises(SystemExit):
        ttl.main(["--schedules", "hiersync_kfour"])


def test_seed_lists():
    assert ttl.parse_seeds("0,1,2") == [0, 1, 2] and ttl.parse_seeds("0-3,8") == [0, 1, 2, 3, 8]
    with pytest.raises(Exception, match="repeats"):
        ttl.parse_seeds("0-2,1")


def test_an_interrupted_launch_stops_the_testbed_with_sigterm(tmp_path):
    """The testbed cleans up (torchrun, ranks, namespaces, rank 0's Lighthouse) on SIGTERM, not on SIGKILL."""
    import signal

    mark = tmp_path / "terminated"
    child = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(mark)!r}, 'w').close(), sys.exit(3)))\n"
        "print('up', flush=True)\n"
        "time.sleep(3600)\n"
    )
    assert ttl._run_testbed([sys.executable, "-c", "print('ok')"]).stdout == "ok\n"

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            ttl._run_testbed([sys.executable, "-c", child])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert mark.exists()  # the child, which would sleep an hour, was sent SIGTERM


def test_steps_from_several_loss_only_runs(tmp_path):
    """Two loss-only runs of the same seeds and DDP (e.g. two --max-steps-factor) count as one."""
    import json

    def write(name, rows, target=2.1):
        path = tmp_path / name
        path.write_text(json.dumps(dict(seeds=[0, 1], target=target, lm_args=["--lr", "0.001"], table=rows)))
        return str(path)

    ddp = dict(schedule="ddp", steps_x_ddp=1.0)
    a = write("a.json", [ddp, dict(schedule="hiersync_k4_stream", steps_x_ddp=1.3)])
    b = write("b.json", [ddp, dict(schedule="hiersync_k16_stream4", steps_x_ddp=1.2)])
    got = ttl.loss_runs([a, b])
    assert [r["schedule"] for r in got["table"]] == ["ddp", "hiersync_k4_stream", "hiersync_k16_stream4"]
    other = write("c.json", [ddp], target=2.3)  # another DDP: its steps count against another loss
    with pytest.raises(SystemExit, match="pass loss-only runs of the same seeds and DDP"):
        ttl.loss_runs([a, other])
