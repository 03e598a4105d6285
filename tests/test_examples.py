"""Smoke tests of examples/: each LM script trains a few steps under torchrun on loopback.

4 ranks as 2 emulated nodes x 2 (``HIERSYNC_NODE_IDS=0,0,1,1``) for the torchrun and
Accelerate examples; the Lightning and HF Trainer examples (whose imports alone cost seconds
per rank) on 2 ranks as 2 nodes x 1. Each must print a finite ``final val loss`` below its initial one.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from harness import torchrun

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--steps", "8", "--text-mb", "0.5", "--eval-batches", "4", "--batch-size", "8", "--period", "2"]


def _run(script: str, nproc: int, *extra: str, timeout: float = 90.0) -> tuple[float, float]:
    nodes = ",".join(str(r * 2 // nproc) for r in range(nproc))
    args = [str(ROOT / "examples" / script), *FAST, *extra]
    out = torchrun(args, nproc, {"HIERSYNC_NODE_IDS": nodes}, timeout, script, cwd=ROOT)
    initial = re.search(r"^initial val loss (\S+)$", out, re.M)
    final = re.search(r"^final val loss (\S+)$", out, re.M)
    assert initial and final, out[-3000:]
    return float(initial.group(1)), float(final.group(1))


@pytest.mark.parametrize(
    "script, nproc, extra",
    [
        ("lm_torchrun.py", 4, ()),
        pytest.param("lm_accelerate.py", 4, ("--fragments", "2", "--overlap", "1"), marks=pytest.mark.slow),
        pytest.param("lm_lightning.py", 2, (), marks=pytest.mark.slow),
        pytest.param("lm_trainer.py", 2, (), marks=pytest.mark.slow),
    ],
)
def test_example_trains(script: str, nproc: int, extra: tuple[str, ...]) -> None:
    initial, final = _run(script, nproc, *extra)
    assert math.isfinite(final) and final < initial, (initial, final)
