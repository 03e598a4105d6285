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


def _schedules(out: str) -> list[str]:
    """The first cell of each body row of the markdown tables in ``out`` (header and separator rows not)."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines() if line.startswith("|")
    ]
    return [r[0] for r in rows if r[0] != "schedule" and not set(r[0]) <= set(":-")]


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
    assert _schedules(capsys.readouterr().out) == ["ddp", "k=4"]

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


def test_lm_task_refuses_the_digits_only_flags() -> None:
    with pytest.raises(SystemExit):
        convergence.main(["--task", "lm", "--momentum", "0.5"])


def test_lm_task_reports_final_losses_and_gaps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--task lm``: the char-LM trains under DDP and int4 streaming, the table gives per-seed losses,
    gaps to the references and bytes per sync; int4's link bytes are well under bf16's."""
    schedules = ["ddp", "k=4 stream bf16", "k=4 stream int4"]
    argv = ["--task", "lm", "--steps", "16", "--seeds", "0", "--eval-batches", "4", "--out", str(tmp_path)]
    argv += ["--schedules", *schedules, "--refs", "ddp", "k=4 stream bf16", "--dim", "32", "--text-mb", "0.5"]
    assert convergence.main([*argv, "--lr", "4e-3"]) == 0
    out = capsys.readouterr().out
    assert "k=4 stream int4" in _schedules(out) and "vs k=4 stream bf16" in out
    assert "AdamW lr 0.004," in out  # the shared flag reaches the LM (its default: 3e-3)

    data = json.loads((tmp_path / "convergence_lm.json").read_text())
    (run,) = data["runs"]
    for name in schedules:
        loss = run[name]["loss"]
        assert len(loss) == 16
        # bytes start at ln(256) = 5.5; 16 steps of AdamW at the example's lr already learn byte frequencies
        assert run[name]["final_val_loss"] < loss[0] - 0.5, (name, loss[0], run[name]["final_val_loss"])
    assert run["ddp"]["inter_bytes_per_sync"] is None
    bf16, int4 = run["k=4 stream bf16"]["inter_bytes_per_sync"], run["k=4 stream int4"]["inter_bytes_per_sync"]
    assert 0 < int4 <= 0.30 * bf16, (int4, bf16)
    rows = {r["schedule"]: r for r in data["table"]}
    gap = rows["k=4 stream int4"]["gap:ddp"]["mean"]
    assert gap == pytest.approx(run["k=4 stream int4"]["final_val_loss"] / run["ddp"]["final_val_loss"] - 1)
