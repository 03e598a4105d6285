"""HF Trainer integration under torchrun on CPU (gloo), 2 emulated nodes x 2 ranks.

One torchrun job (tests/hf_trainer_ranks.py) trains a tiny random GPT-2 in the same 4
processes: 12 steps in one go with the Trainer checkpointing every 6, then new Trainers
resumed from checkpoint-6. The references: the period-4 invariants of hiersync, and the
uninterrupted run for the resumed ones, bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness import torchrun

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a Trainer run in four processes: CI runs it with -m slow

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_AT, PERIOD = 12, 6, 4  # as in hf_trainer_ranks.py


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hf_trainer")
    args = [str(ROOT / "tests" / "hf_trainer_ranks.py"), str(out)]
    torchrun(args, 4, {"HIERSYNC_NODE_IDS": "0,0,1,1"}, 240, "the HF Trainer job", cwd=ROOT)
    checkpoint = out / "run" / f"checkpoint-{SAVE_AT}"
    for r in range(4):  # each rank's own state beside the Trainer's files
        assert (checkpoint / f"hiersync-rank{r}-of-4.pt").is_file(), sorted(os.listdir(checkpoint))
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


def test_trainer_period4_invariants(trainer_results):
    steps = [r["run"]["after_step"] for r in trainer_results]
    assert all(len(s) == STEPS for s in steps)
    for i in range(STEPS):
        assert torch.equal(steps[0][i], steps[1][i]) and torch.equal(steps[2][i], steps[3][i]), i
        if i % PERIOD == PERIOD - 1:  # a sync step, attached optimizer: every rank identical after it
            assert all(torch.equal(steps[0][i], s[i]) for s in steps), i
    assert not torch.equal(steps[0][SAVE_AT - 1], steps[2][SAVE_AT - 1])  # the checkpoint is taken mid-period
    run = trainer_results[0]["run"]
    assert run["step"] == STEPS and run["stats"]["sync_steps"] == STEPS // PERIOD
    assert run["stats"]["bytes_sent"]["inter"] > 0


@pytest.mark.parametrize("name", ["resumed", "elsewhere"])
def test_trainer_resume_from_checkpoint_is_the_uninterrupted_run(trainer_results, name):
    for rank, r in enumerate(trainer_results):
        resumed, uninterrupted = r[name]["after_step"], r["run"]["after_step"][SAVE_AT:]
        assert len(resumed) == len(uninterrupted) == STEPS - SAVE_AT
        for i, (a, b) in enumerate(zip(uninterrupted, resumed, strict=True)):
            assert torch.equal(a, b), f"rank {rank}, step {SAVE_AT + i}"
        # the schedule goes on from the checkpoint: step counter and counters as if never interrupted
        assert r[name]["step"] == STEPS
        for k in ("steps", "sync_steps", "local_steps", "exact_steps"):
            assert r[name]["stats"][k] == r["run"]["stats"][k], k


def test_trainer_resume_without_the_hiersync_state_raises_on_every_rank(trainer_results):
    # output_dir elsewhere and the folder not in TrainingArguments: the callback cannot find its state
    for r in trainer_results:
        assert "no hiersync-rank" in r["unfound"] and "resume_from_checkpoint=folder" in r["unfound"], r["unfound"]


def test_trainer_synchronizes_at_train_end(trainer_results):
    finals = [r["run"]["final"] for r in trainer_results]
    assert all(torch.equal(finals[0], f) for f in finals)
    assert torch.equal(finals[0], trainer_results[0]["resumed"]["final"])
