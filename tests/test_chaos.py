"""The chaos run (python -m hiersync chaos): its analysis on hand-made records, and a short run under -m slow.

The analysis is pure (records in, figures and violations out), so each invariant is checked here
against records that break it, in microseconds; the run itself (8 emulated nodes, two minutes,
a fault every 30 s) is long and lives under ``-m slow``.
"""

from __future__ import annotations

import pytest

from hiersync.tools.chaos import ChaosConfig, Event, RunRecord, analyze, report

PERIOD, STEP_S = 2, 0.3


def _run(nodes: int, steps: int, tweak=None, restart: dict | None = None) -> RunRecord:
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
    results = {n: {"val_loss": 0.5} for n in range(nodes)}
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


@pytest.mark.slow
@pytest.mark.timeout(900)  # two runs of two minutes and their starts: past the suite's 300 s per test
def test_chaos_run_of_two_minutes(tmp_path):
    """8 emulated nodes, two minutes of accelerator-like steps, a fault every 30 s: every invariant holds
    in every window, every node ends with success or hiersync's clear error, the final loss is the
    run's without faults (1%)."""
    pytest.importorskip("torchft")
    from hiersync.tools.chaos import run_chaos

    cfg = ChaosConfig(nodes=8, seconds=120.0, fault_every=30.0, seed=1)
    ((a, _, _),) = run_chaos(cfg, progress=False, logs=tmp_path)
    text = report(a, cfg)
    assert a["faults"] >= 3, text
    assert a["violations"] == [], text
    assert all("HierSyncError: hiersync:" in e for e in a["errors"]), text  # only hiersync's clear errors
    assert abs(a["val_loss"] / a["reference_val_loss"] - 1) <= 0.01, text
    assert a["goodput"] >= 0.8, text
