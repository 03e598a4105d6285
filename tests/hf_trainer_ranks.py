"""One rank of the HF Trainer check, under torchrun (tests/test_integrations_transformers.py).

A tiny randomly initialised GPT-2 (config built here: nothing is downloaded) trained by the
Trainer with :class:`hiersync.integrations.transformers.HierSyncCallback` (period 4):

* ``run``: MAX_STEPS steps in one go, the Trainer checkpointing every SAVE_STEPS steps;
* ``resumed``: a new model, Trainer and callback in this same process, resumed with
  ``train(resume_from_checkpoint=<run>/checkpoint-SAVE_STEPS)``;
* ``elsewhere``: the same resume by a Trainer whose ``output_dir`` is another folder, with
  that checkpoint's folder also given as ``TrainingArguments(resume_from_checkpoint=...)``;
* ``unfound``: as ``elsewhere`` without it: the callback cannot find its state and must raise.

Each rank writes its parameters after every optimizer step, the callback's step counter and
``state.stats`` and its final parameters to ``<out>/rank<r>.pt``.

    torchrun --standalone --nproc-per-node 4 tests/hf_trainer_ranks.py OUT   # HIERSYNC_NODE_IDS=0,0,1,1
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from hiersync.integrations.transformers import HierSyncCallback

MAX_STEPS = 12
SAVE_STEPS = 6  # mid-period for period=4 (syncs after steps 4, 8, 12) and mid-epoch (12 steps per epoch)
ACCUMULATE = 2  # micro-steps per optimizer step (under DDP's no_sync but the last): one hiersync step
PERIOD = 4


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank (the Trainer's sampler splits them)."""

    def __init__(self, count: int = 192, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    """This rank's parameters after each optimizer step (after hiersync's cross-node sync)."""

    def __init__(self) -> None:
        self.after_step: list[torch.Tensor] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after_step.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))


def train(out_dir: str, init_seed: int, resume: str | None, tell_args: bool = False) -> dict:
    torch.manual_seed(init_seed)  # the resumed run starts from other weights: the checkpoint must replace them
    # dropout off: the comparison is of hiersync's state, not of the RNG streams the Trainer restores
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        logging_steps=MAX_STEPS,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        resume_from_checkpoint=resume if tell_args else None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    hier, record = HierSyncCallback(trainer, period=PERIOD), Record()
    trainer.add_callback(hier)
    trainer.add_callback(record)
    trainer.train(resume_from_checkpoint=resume)
    assert hier.state is not None
    return {
        "after_step": record.after_step,
        "step": hier.state.step,
        "stats": hier.state.stats.as_dict(),
        "final": torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]),
    }


def main(out: str) -> None:
    run_dir = os.path.join(out, "run")
    checkpoint = os.path.join(run_dir, f"checkpoint-{SAVE_STEPS}")
    results: dict = {"run": train(run_dir, 0, None)}
    results["resumed"] = train(run_dir, 1, checkpoint)
    results["elsewhere"] = train(os.path.join(out, "elsewhere"), 1, checkpoint, tell_args=True)
    try:
        train(os.path.join(out, "unfound"), 1, checkpoint)
        results["unfound"] = "resumed"
    except RuntimeError as e:
        results["unfound"] = str(e)
    torch.save(results, os.path.join(out, f"rank{dist.get_rank()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    # torch 2.13 CPU gloo: a rank often aborts at interpreter exit; leave together and skip teardown
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
