"""Byte-level GPT on the Python standard library, HF Trainer + hiersync, under torchrun.

    python -m hiersync testbed --nodes 2 --procs-per-node 2 -- examples/lm_trainer.py --steps 20
    torchrun --nnodes 16 --nproc-per-node 8 ... examples/lm_trainer.py --save-steps 100   # then --resume

The Trainer gets the same model, batches, optimizer and lr schedule as examples/lm_torchrun.py:
dataset item j is the batch rank j % world trains on at step j // world (a sequential
sampler, one item per rank per step), and the optimizer and schedule are passed in.
"""

import os
import sys
import tempfile

import _lm
import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from hiersync.integrations.transformers import HierSyncCallback

p = _lm.parser(__doc__)
p.add_argument("--output-dir", help="the Trainer's output_dir (default: a new temporary folder)")
p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True): the last checkpoint")
args = p.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
train, val = _lm.load_text(args.text_mb)


class LM(torch.nn.Module):
    """The example GPT with the Trainer's calling convention: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _lm.GPT(args)

    def forward(self, input_ids, labels=None):
        logits, loss = self.net(input_ids, labels)
        return {"loss": loss, "logits": logits}


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return args.steps * world

    def __getitem__(self, j):
        x, y = _lm.train_batch(train, args, j % world, j // world, torch.device("cpu"))
        return {"input_ids": x, "labels": y}


model = LM()
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lm.lr_at(s, args))
targs = TrainingArguments(
    output_dir=args.output_dir or tempfile.mkdtemp(prefix="lm_trainer-"),
    max_steps=args.steps,
    per_device_train_batch_size=1,  # an item is a whole batch
    train_sampling_strategy="sequential",
    max_grad_norm=0.0,  # as the other examples: no clipping
    ddp_find_unused_parameters=False,  # every parameter gets a gradient: skip DDP's graph traversal
    save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or 500,
    logging_steps=50,
    report_to=[],
    disable_tqdm=True,
    use_cpu=not torch.cuda.is_available(),
    seed=args.seed,
)
trainer = Trainer(
    model=model, args=targs, train_dataset=Batches(), data_collator=lambda items: items[0], optimizers=(opt, sched)
)
trainer.add_callback(HierSyncCallback(trainer, **_lm.hiersync_options(args)))
device = targs.device  # the process group exists from here on (the Trainer's Accelerate state)
rank = dist.get_rank()
say = print if rank == 0 else (lambda *a: None)
say(f"{sum(p.numel() for p in model.parameters()):,} parameters, {world} ranks")
say(f"initial val loss {_lm.evaluate(model.net.to(device), val, args, device):.4f}")
trainer.train(resume_from_checkpoint=args.resume or None)  # the callback synchronizes at the end
say(f"final val loss {_lm.evaluate(model.net, val, args, device):.4f}")
# torch 2.13 CPU gloo: a rank often aborts at interpreter exit; leave together and skip teardown
dist.barrier()
sys.stdout.flush()
os._exit(0)
