"""Smoke tests of examples/: each LM script trains a few steps under torchrun on loopback.

4 ranks as 2 emulated nodes x 2 (``HIERSYNC_NODE_IDS=0,0,1,1``) for the torchrun and
Accelerate examples; the Lightning and HF Trainer examples (whose imports alone cost seconds
per rank) on 2 ranks as 2 nodes x 1. Each must print a finite ``final val loss`` below its initial one.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--steps", "8", "--text-mb", "0.5", "--eval-batches", "4", "--batch-size", "8", "--period", "2"]


def _run(script: str, nproc: int, *extra: str, timeout: float = 90.0) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["HIERSYNC_NODE_IDS"] = ",".join(str(r * 2 // nproc) for r in range(nproc))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.Popen(
        [*cmd, str(ROOT / "examples" / script), *FAST, *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script} did not finish in {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    initial = re.search(r"^initial val loss (\S+)$", out, re.M)
    final = re.search(r"^final val loss (\S+)$", out, re.M)
    assert initial and final, out[-3000:]
    return float(initial.group(1)), float(final.group(1))


@pytest.mark.parametrize(
    "script, nproc, extra",
    [
        ("lm_torchrun.py", 4, ()),
        ("lm_accelerate.py", 4, ("--fragments", "2", "--overlap", "1")),
        ("lm_lightning.py", 2, ()),
        ("lm_trainer.py", 2, ()),
    ],
)
def test_example_trains(script: str, nproc: int, extra: tuple[str, ...]) -> None:
    initial, final = _run(script, nproc, *extra)
    assert math.isfinite(final) and final < initial, (initial, final)


def test_time_to_loss_reads_the_mean_curve_over_seeds():
    """benchmarks/time_to_loss.py's report: target = DDP's mean final loss, hits on the mean curve."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import time_to_loss as ttl
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def run(points, final, wall):
        evals = [dict(step=s, wall_s=s * 0.1, val_loss=v) for s, v in points]
        return dict(evals=evals, final_val_loss=final, wall_s=wall, steps=points[-1][0])

    runs = {
        "ddp": [run([(0, 5), (10, 3), (20, 2.0)], 2.0, 2.0), run([(0, 5), (10, 3), (20, 2.2)], 2.2, 2.2)],
        # seed 0 reaches its DDP's 2.0 at 30; seed 1 its 2.2 at 30 (2.3 at 20); mean 2.225 at 20, 2.05 at 30
        "x": [run([(0, 5), (10, 2.5), (20, 2.15), (30, 2.0)], 2.0, 1.0), run([(0, 5), (10, 2.9), (20, 2.3)], 2.3, 1.0)],
    }
    runs["x"][1]["evals"].append(dict(step=30, wall_s=3.0, val_loss=2.1))
    target, rows = ttl.summarize(runs, 20)
    assert target == pytest.approx(2.1)
    ddp, x = rows
    assert ddp["steps_to_target"] == 20 and ddp["wall_to_target"] == pytest.approx(2.1) and ddp["steps_x_ddp"] == 1
    assert x["steps_to_target"] == 30 and x["steps_x_ddp"] == pytest.approx(1.5)
    assert x["wall_x_ddp"] == pytest.approx(3.0 / 2.1) and x["per_seed_steps"] == [30, 30]
    assert x["val_at_ddp_steps"] == pytest.approx(2.225) and x["spread_at_ddp_steps"] == pytest.approx(0.15)
    runs["x"][1]["evals"][-1]["val_loss"] = 2.5  # seed 1 never reaches: mean curve 2.25 at 30 > 2.1
    _, (_, x) = ttl.summarize(runs, 20)
    assert x["steps_to_target"] is None and x["per_seed_steps"] == [30, None]
    assert "not reached" in ttl.table([x], 20, 2.1, [0, 1])
    assert x["interval_90"] is None  # two seeds: no interval
    # three seeds alike: every resample gives the same crossing, so the interval is a point
    runs = {"ddp": [runs["ddp"][0]] * 3, "x": [runs["x"][0]] * 3}
    iv = ttl.ratio_interval(runs, "x", 20)
    assert iv is not None and iv["steps"] == (1.5, 1.5) and iv["wall"] == (1.5, 1.5)  # step 30, 3.0 s vs 2.0 s
    runs["x"] = [runs["x"][0], runs["x"][0], dict(runs["x"][0], evals=runs["x"][0]["evals"][:2])]
    iv = ttl.ratio_interval(runs, "x", 20)  # a seed whose curve stops above the target: some draws never reach
    assert iv is not None and iv["steps"][0] == 1.5 and iv["steps"][1] == math.inf
    assert "(1.50-not reached)" in ttl.table([{**x, "interval_90": iv}], 20, 2.1, [0, 1, 2])
    # --budget: final loss minus DDP's, seed by seed (2.0 - 2.0, 2.0 - 2.0, 2.0 - 2.0 here)
    gap = ttl.final_gap(runs, "x")
    assert gap == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    runs["x"] = [dict(r, final_val_loss=2.0 + d) for r, d in zip(runs["x"], (0.3, -0.1, 0.1))]
    gap = ttl.final_gap(runs, "x")
    assert gap["mean"] == pytest.approx(0.1) and -0.1 <= gap["lo"] < 0.1 < gap["hi"] <= 0.3
