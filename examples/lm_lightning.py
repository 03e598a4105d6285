"""Byte-level GPT on the Python standard library, Lightning + hiersync, under torchrun.

    python -m hiersync testbed --nodes 2 --procs-per-node 2 -- examples/lm_lightning.py --steps 20
    torchrun --nnodes 16 --nproc-per-node 8 ... examples/lm_lightning.py

Lightning sees torchrun's variables and adopts its ranks (devices per node and node count
are read from them below).
"""

import os

import _lm
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from hiersync.integrations.lightning import HierSyncCallback

args = _lm.parser(__doc__).parse_args()
train, val = _lm.load_text(args.text_mb)
rank, local_world = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
world = int(os.environ.get("WORLD_SIZE", 1))


class Batches(Dataset):
    """This rank's batches: item i is the batch the torchrun example trains on at step i."""

    def __init__(self, data, count, seed_of):
        self.data, self.count, self.seed_of = data, count, seed_of

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        return _lm.get_batch(self.data, args.batch_size, args.block, self.seed_of(i), torch.device("cpu"))


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _lm.GPT(args)

    def training_step(self, batch, i):
        return self.net(*batch)[1]

    def validation_step(self, batch, i):
        self.log("val_loss", self.net(*batch)[1], sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lm.lr_at(s, args))
        return [opt], [{"scheduler": sched, "interval": "step"}]


train_set = Batches(train, args.steps, lambda i: (args.seed * 1_000_003 + i) * 4096 + rank)
val_set = Batches(val, len(range(rank, args.eval_batches, world)), lambda i: 10**9 + rank + i * world)
loader = lambda ds: DataLoader(ds, batch_size=None)  # items are whole batches
trainer = pl.Trainer(
    strategy="ddp",
    accelerator="gpu" if torch.cuda.is_available() else "cpu",
    devices=local_world,
    num_nodes=world // local_world,
    max_steps=args.steps,
    callbacks=[HierSyncCallback(**_lm.hiersync_options(args))],
    use_distributed_sampler=False,  # the datasets above are per rank already
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)
module = LM()
initial = trainer.validate(module, loader(val_set), verbose=False)[0]["val_loss"]
# validation runs at the end of the single epoch, after the callback's state.synchronize
trainer.fit(module, loader(train_set), loader(val_set))
if trainer.global_rank == 0:
    print(f"initial val loss {initial:.4f}")
    print(f"final val loss {float(trainer.callback_metrics['val_loss']):.4f}")
