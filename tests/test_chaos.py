"""The chaos run (python -m hiersync chaos): its analysis on hand-made records, and a short run under -m slow.

The analysis is pure (records in, figures and violations out), so each invariant is checked here
against records that break it, in microseconds; the run itself (8 emulated nodes, two minutes,
a fault every 30 s) is long and lives under ``-m slow``.
"""

from __future__ import annotations

import pytest

from hiersync.tools.chaos import ChaosConfig, Event, RunRecord, analyze, report, table
from hiersync.tools.chaos_analysis import loss_at, reference_curve

PERIOD, STEP_S = 2, 0.3


def _run(nodes: int, steps: int, tweak=None, restart: dict | None = None, final: float = 0.5) -> RunRecord:
    """``nodes`` nodes that each record ``steps`` steps of STEP_S with a sync every PERIOD, then finish.

    ``tweak(node, step, fields)`` edits a record; ``restart``: ``{node: step}``, that node dies
    before ``step`` and a fresh incarnation is healed into the sync after ``step + 1``."""
    records = {}
    events = []
    for n in range(nodes):
        recs = [(0.0, -1, {"event": "up"}), (0.1, -1, {"event": "joined", "heal_s": "0.1", "heal_bytes": "100"})]
        for s in range(steps):
            t = 0.2 + STEP_S * s
            if restart and n in restart and s == restart[n]:
                events += [Event(t, "kill", n), Event(t + 0.3, "restart", n)]
                recs.append((t + 0.3, -1, {"event": "up"}))
                healed = {"event": "joined", "heal_s": "0.2", "heal_bytes": "100", "n": str(nodes), "q": "1"}
                healed["sum"] = f"{float((s + 1) // PERIOD):.12e}"  # the sync after step s + 1, its peers' result
                recs.append((t + 0.5, s + 1, healed))
            if restart and n in restart and restart[n] <= s <= restart[n] + 1:
                continue  # dead, then healed into the sync after step restart[n] + 1
            f = {"loss": "1.0", "n": str(nodes), "q": "1", "failed": "0", "heals": "0", "canary": "0", "nan": "0"}
            f["sum"] = f"{float(s // PERIOD):.12e}" if (s + 1) % PERIOD == 0 else f"{s + 0.01 * n:.12e}"
            if tweak is not None:
                tweak(n, s, f)
            recs.append((t, s, f))
        recs.append((0.2 + STEP_S * steps, steps, {"event": "done", "val": "0.5"}))
        records[n] = recs
    end = 0.2 + STEP_S * steps
    results = {n: {"val_loss": final} for n in range(nodes)}
    return RunRecord(
        steps,
        0.0,
        end,
        0,
        records,
        events,
        results,
        [{"t": e.t, "kind": "kill", "nodes": [e.node]} for e in events if e.kind == "kill"],
    )


def _analyze(run: RunRecord, nodes: int = 3) -> dict:
    return analyze(run, _run(nodes, run.steps), PERIOD, nodes)


def test_a_run_without_faults_has_goodput_one_and_no_violation():
    a = _analyze(_run(3, 12))
    assert a["violations"] == [] and a["goodput"] == pytest.approx(1.0)
    assert a["syncs_checked"] == 6 and a["windows_dropped"] == 0
    assert "all held" in report(a, ChaosConfig(nodes=3))


def test_nodes_that_differ_after_a_sync_are_a_violation():
    def tweak(n, s, f):
        if n == 2 and s == 5:
            f["sum"] = "9.0"

    a = _analyze(_run(3, 12, tweak))
    assert any("step 5" in v and "differ after the sync" in v for v in a["violations"]), a["violations"]
    assert "1 VIOLATED" in report(a, ChaosConfig(nodes=3))


@pytest.mark.parametrize("field, value, what", [("canary", "1", "canary off"), ("nan", "1", "NaN")])
def test_a_wrong_canary_or_a_nan_is_a_violation(field, value, what):
    a = _analyze(_run(3, 12, lambda n, s, f: f.update({field: value}) if (n, s) == (1, 4) else None))
    assert any(what in v and "node 1 step 4" in v for v in a["violations"]), a["violations"]


def test_a_node_missing_from_a_sync_without_a_fault_is_a_violation():
    def tweak(n, s, f):
        if n == 0 and s == 7:
            f["failed"] = "1"  # it dropped a sync the others committed with it

    a = _analyze(_run(3, 12, tweak))
    assert any("only nodes [1, 2] recorded it" in v for v in a["violations"]), a["violations"]


def test_a_dropped_window_is_counted_and_its_steps_stay_useful():
    def tweak(n, s, f):
        if s >= 7:
            f["failed"] = "1"  # every node dropped the sync after step 7

    a = _analyze(_run(3, 12, tweak))
    assert a["windows_dropped"] == 3 and a["violations"] == [] and a["goodput"] == pytest.approx(1.0)


def test_a_restarted_node_healed_into_a_sync_is_one_of_its_peers():
    a = _analyze(_run(3, 12, restart={2: 4}))
    assert a["violations"] == [], a["violations"]
    assert a["restarts"] == 1 and a["healed_at_once"] == 1
    # its lost step 4 and step 5 (healed into the sync after it) were not its own; everything else is
    assert a["useful_node_steps"] == 3 * 12 - 2
    assert a["restart_to_contributing_sync_s"]["n"] == 1


def test_a_stall_is_a_survivors_longest_step_until_the_next_fault_not_a_later_victims_downtime():
    run = _run(3, 40, restart={1: 4, 2: 20})  # node 2 killed by the second fault is down, not stalled
    a = _analyze(run)
    assert [f["stall_s"] for f in a["stall_per_fault"]] == pytest.approx([0.0, 0.0], abs=1e-9)
    # node 0 stands 2 s at the step after the first fault: the first fault's stall, not the second's
    run.records[0] = [(t + 2.0 if s >= 6 else t, s, f) for t, s, f in run.records[0]]
    a = _analyze(run)
    assert [f["stall_s"] for f in a["stall_per_fault"]] == pytest.approx([2.0, 0.0], abs=1e-6)


def _curve(s: int) -> float:
    """The reference's validation loss after ``s`` steps per node."""
    return 10.0 / s


def _reference(nodes: int, steps: int, spread: float = 0.0) -> RunRecord:
    """A run without faults whose nodes record ``val=`` after each sync (node n off by ``n * spread``)."""

    def val(n, s, f):
        if (s + 1) % PERIOD == 0:
            f["val"] = f"{_curve(s + 1) * (1 + n * spread):.6f}"

    return _run(nodes, steps, val, final=_curve(steps))


def test_the_reference_curve_is_the_nodes_loss_after_each_sync_then_the_final_one():
    curve, spread = reference_curve(_reference(3, 12, spread=0.001), PERIOD)
    assert [x for x, _ in curve] == [2, 4, 6, 8, 10, 12]
    assert curve[0][1] == pytest.approx(5.0 * 1.001)  # the mean of 5.0, 5.005, 5.010
    assert curve[-1][1] == pytest.approx(10.0 / 12)  # the final loss, after synchronize()
    assert spread == pytest.approx(0.002, rel=0.01)
    assert loss_at(curve, 11.0) == pytest.approx((10.0 / 10 * 1.001 + 10.0 / 12) / 2)
    assert loss_at(curve, 12.0) == pytest.approx(10.0 / 12)
    assert loss_at(curve, 1.0) is None and loss_at(curve, 13.0) is None


def test_nothing_lost_is_judged_at_the_same_useful_work():
    # node 2 dies and loses 2 steps: 34 of 36 node-steps useful, 11.33 per node; its final loss is
    # the reference's at that work, 6.7% above the reference's final loss at 12 steps
    at_work = 1.0 + (10.0 / 12 - 1.0) * (34 / 3 - 10) / 2
    a = analyze(_run(3, 12, restart={2: 4}, final=at_work), _reference(3, 12), PERIOD, 3)
    assert a["useful_steps_per_node"] == pytest.approx(34 / 3)
    assert a["val_loss_vs_reference"] == pytest.approx(at_work / (10.0 / 12) - 1)
    assert a["work_matched_val_loss"] == pytest.approx(at_work)
    assert a["val_loss_vs_work_matched"] == pytest.approx(0.0, abs=1e-6) and a["nothing_lost"] is True
    text = report(a, ChaosConfig(nodes=3))
    assert "vs no faults (same steps)" in text and "+6.67%" in text
    assert "vs no faults at the same useful work" in text and "nothing lost        yes" in text
    assert "+0.00% (yes)" in table([a], [1])


def test_a_loss_above_the_reference_at_the_same_work_is_lost_one_below_it_is_not():
    at_work = 1.0 + (10.0 / 12 - 1.0) * (34 / 3 - 10) / 2
    a = analyze(_run(3, 12, restart={2: 4}, final=1.02 * at_work), _reference(3, 12), PERIOD, 3)
    assert a["val_loss_vs_work_matched"] == pytest.approx(0.02, rel=1e-4) and a["nothing_lost"] is False
    assert "nothing lost        NO: the final loss is +2.00%" in report(a, ChaosConfig(nodes=3))
    assert "+2.00% (NO)" in table([a], [1])
    # below the reference at its useful work (its peers lost no optimizer step): nothing lost
    a = analyze(_run(3, 12, restart={2: 4}, final=0.95 * at_work), _reference(3, 12), PERIOD, 3)
    assert a["val_loss_vs_work_matched"] == pytest.approx(-0.05, rel=1e-4) and a["nothing_lost"] is True
    assert "-5.00% (yes)" in table([a], [1])


def test_without_a_reference_curve_nothing_lost_is_not_judged():
    a = _analyze(_run(3, 12))  # the reference recorded no val= after its syncs
    assert a["work_matched_val_loss"] is None and a["nothing_lost"] is None
    assert "not judged" in report(a, ChaosConfig(nodes=3))


@pytest.mark.slow
@pytest.mark.timeout(900)  # two runs of two minutes and their starts: past the suite's 300 s per test
def test_chaos_run_of_two_minutes(tmp_path):
    """8 emulated nodes, two minutes of accelerator-like steps, a fault every 30 s: every invariant holds
    in every window, every node ends with success or hiersync's clear error, the final loss is the
    run's without faults at the same useful work (1%)."""
    pytest.importorskip("torchft")
    from hiersync.tools.chaos import run_chaos

    # short timeouts, so that two minutes hold several faults and their recoveries
    cfg = ChaosConfig(
        nodes=8, seconds=120.0, fault_every=30.0, seed=1, heartbeat_timeout_ms=1000, join_timeout_ms=2000, timeout_s=5.0
    )
    ((a, _, _),) = run_chaos(cfg, progress=False, logs=tmp_path)
    text = report(a, cfg)
    assert a["faults"] >= 3, text
    assert a["violations"] == [], text
    assert all("HierSyncError: hiersync:" in e for e in a["errors"]), text  # only hiersync's clear errors
    assert a["reference_sync_spread"] < 1e-5, text  # every node holds the same model after a sync
    assert a["nothing_lost"] is True, text
    assert a["goodput"] >= 0.8, text


def test_a_slow_node_lowers_the_ideal_not_the_goodput():
    """A node at 1/2 speed for 4 of the run's 3.8 s x 3 node-seconds could do 2 s of them: goodput is
    against that ideal (the run without faults' rate at each node's speed)."""
    from hiersync.tools.chaos_analysis import ideal_node_seconds

    run = _run(3, 12)
    plain = _analyze(run)["goodput"]
    run.events += [Event(0.5, "slow", 1, 0, "2"), Event(2.5, "unslow", 1)]
    run.faults.append({"t": 0.5, "kind": "slow", "nodes": [1]})
    total = 3 * (run.ended - run.started)
    assert ideal_node_seconds(run, 3) == pytest.approx(total - 2.0 * 0.5)
    a = _analyze(run)
    assert a["goodput"] == pytest.approx(plain * total / (total - 1.0))
    assert a["fault_kinds"]["slow"] == 1 and "node-seconds at full speed" in report(a, ChaosConfig(nodes=3))


def _paced(steps_per_window: list[int], windows: int, bad: tuple[int, int] | None = None) -> RunRecord:
    """Nodes under adaptive pace: node n takes ``steps_per_window[n]`` steps a window, records
    name the window (``w``) and mark its last step (``sync``); ``bad=(node, window)``: that node's
    sum after that sync is off."""
    records = {}
    for n, k in enumerate(steps_per_window):
        recs = [(0.0, -1, {"event": "up"}), (0.1, -1, {"event": "joined", "heal_s": "0.1", "heal_bytes": "1"})]
        for s in range(k * windows):
            w, end = s // k + (s % k == k - 1), s % k == k - 1
            f = {"n": str(len(steps_per_window)), "q": "1", "failed": "0", "canary": "0", "nan": "0"}
            f.update(w=str(w), sync=str(int(end)))
            f["sum"] = f"{float(w) + (0.5 if bad == (n, w) and end else 0.0):.12e}" if end else f"{n + 0.1 * s:.12e}"
            recs.append((0.2 + 0.3 * (s + 1) * 8 / k, s, f))
        recs.append((0.3 + 0.3 * 8 * windows, k * windows, {"event": "done"}))
        records[n] = recs
    end = 0.3 + 0.3 * 8 * windows
    return RunRecord(8 * windows, 0.0, end, 0, records, [], {n: {"val_loss": 0.5} for n in records}, [])


def test_adaptive_pace_syncs_are_matched_by_window_not_step():
    """Node 1 takes 2 steps a window to node 0's 8: their syncs are at different steps and the
    same windows; a sum that differs after one of them is a violation naming that window."""
    good = _paced([8, 2], 3)
    a = analyze(good, good, 8, 2)
    assert a["violations"] == [] and a["syncs_checked"] == 3
    bad = _paced([8, 2], 3, bad=(1, 2))
    assert any(v.startswith("window 2 quorum 1") for v in analyze(bad, good, 8, 2)["violations"])
