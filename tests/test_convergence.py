"""Fast convergence check on real data: DDP's default vs hiersync k=4 on digits, 2x2 emulated nodes.

The full comparison (all schedules, three seeds, 600 steps) is ``benchmarks/convergence.py``;
this runs its ``main()`` with few steps and two schedules, so the script, its JSON and its
plot are exercised too.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the convergence check trains on scikit-learn's digits dataset")
pytest.importorskip("matplotlib", reason="the convergence script writes a plot")

# Appended, not prepended: benchmarks/ has its own conftest.py, which must not shadow tests/'.
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
import convergence

STEPS = 120


def test_digits_ddp_and_k4_learn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--steps",
        str(STEPS),
        "--seeds",
        "0",
        "--schedules",
        "ddp",
        "k=4",
        "--eval-every",
        "40",
        "--out",
        str(tmp_path),
    ]
    assert convergence.main(argv) == 0
    assert "| k=4 |" in capsys.readouterr().out

    data = json.loads((tmp_path / "convergence.json").read_text())
    assert (tmp_path / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run,) = data["runs"]
    for name in ("ddp", "k=4"):
        r = run[name]
        assert len(r["loss"]) == STEPS
        first, last = statistics.fmean(r["loss"][:10]), statistics.fmean(r["loss"][-10:])
        # cross-entropy starts near ln(10) = 2.3 and must fall well below it
        assert last < 0.5 * first, (name, first, last)
        # chance is 10%; a working run reaches ~95% in 120 steps
        assert r["final_test_acc"] > 80.0, (name, r["final_test_acc"])
        assert [e["step"] for e in r["evals"]] == [40, 80, 120]
    k4 = run["k=4"]
    assert k4["sync_steps"] == STEPS // 4 and k4["exact_steps"] == 0
    assert k4["inter_bytes"] > 0
    assert abs(k4["final_test_acc"] - run["ddp"]["final_test_acc"]) < 5.0
