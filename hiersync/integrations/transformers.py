"""HF Trainer: :class:`HierSyncCallback` registers hiersync on the DDP model the Trainer wraps.

Example::

    >>> from hiersync.integrations.transformers import HierSyncCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=train)
    >>> trainer.add_callback(HierSyncCallback(trainer, period=4, warmup_steps=100))
    >>> trainer.train()                                   # or train(resume_from_checkpoint=True)

The Trainer wraps the model in DDP inside ``train()`` (``accelerator.prepare``, after
``create_optimizer``), and a callback is handed only the unwrapped model, so the callback
takes the trainer and reads ``trainer.model_wrapped`` and ``trainer.optimizer`` at
``on_train_begin``: the first event after the wrap, after a resumed run's weights and
optimizer state are loaded, before the first forward. Needs
``pip install hiersync[transformers]``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..api import register
from ..ddp import HierState

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hiersync.integrations.transformers needs the transformers package: pip install 'hiersync[transformers]'"
    ) from e

__all__ = ["HierSyncCallback", "state_file"]

logger = logging.getLogger(__name__)

FORMAT = "hiersync.integrations.transformers/1"


def state_file(checkpoint_dir: str, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its hiersync state in a Trainer checkpoint folder."""
    return os.path.join(checkpoint_dir, f"hiersync-rank{rank}-of-{world_size}.pt")


class HierSyncCallback(TrainerCallback):
    """Hierarchical gradient sync for the HF ``Trainer`` on DDP (``torchrun``, more than one process).

    At ``on_train_begin`` (collective on every rank) it calls :func:`hiersync.register` on
    ``trainer.model_wrapped`` with ``period``, ``warmup_steps`` and ``options`` (any
    :class:`~hiersync.HierState` option) and attaches ``trainer.optimizer``
    (``attach_optimizer=True``). The :class:`HierState` is ``self.state`` from then on.
    Gradient-accumulation micro-steps run under DDP's ``no_sync`` and do not count: one
    hiersync step per optimizer step.

    * ``per_rank_checkpoint``: the Trainer writes the model and optimizer from rank 0 only,
      but ranks of different nodes hold different parameters, optimizer states and hiersync
      states between syncs. At every checkpoint (``on_save``) each rank writes its own
      :func:`state_file` (its model and optimizer ``state_dict`` and ``state.state_dict()``)
      into the checkpoint folder, beside the Trainer's ``rng_state_<rank>.pth``; the folder
      grows by about world-size copies of model + optimizer state. With ``False`` only the
      hiersync state is written (small; exact only for a checkpoint taken when all ranks
      held the same values).
    * ``resume``: when ``train(resume_from_checkpoint=...)`` resumed (``state.global_step > 0``
      at ``on_train_begin``), each rank loads its own file back after the Trainer loaded
      rank 0's model and optimizer, so the run continues bit for bit, schedule included. The
      Trainer does not tell callbacks which folder it resumed from: the callback reads
      ``args.resume_from_checkpoint`` when set, else ``<output_dir>/checkpoint-<global_step>``
      (what ``resume_from_checkpoint=True`` picks), and checks that rank 0's saved weights
      are the ones the Trainer loaded. A missing file, another world size or other weights
      raise on every rank; ``resume=False`` starts a fresh hiersync schedule instead.
    * ``sync_at_train_end``: ``state.synchronize(model)`` at ``on_train_end``, so the weights
      ``trainer.save_model()`` writes afterwards (rank 0's) are every rank's.

    The state is closed (hooks and process groups released) at ``on_train_end``;
    ``self.state.stats`` stays readable.
    """

    def __init__(
        self,
        trainer: Any,
        period: int = 4,
        warmup_steps: int = 0,
        *,
        attach_optimizer: bool = True,
        per_rank_checkpoint: bool = True,
        resume: bool = True,
        sync_at_train_end: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        self.trainer = trainer
        self.options = dict(period=period, warmup_steps=warmup_steps, **options)
        self.attach_optimizer = attach_optimizer
        self.per_rank_checkpoint = per_rank_checkpoint
        self.resume = resume
        self.sync_at_train_end = sync_at_train_end
        self.state: HierState | None = None

    # ------------------------------------------------------------------ set-up
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        model = trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"HierSyncCallback needs the Trainer to wrap the model in DistributedDataParallel (launch with "
                f"torchrun, more than one process, no DeepSpeed/FSDP), got {type(model).__name__}"
            )
        self.state = register(model, trainer.optimizer if self.attach_optimizer else None, **self.options)
        if state.global_step > 0 and self.resume:
            self._load(args, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.state is None or self.state._closed:
            return
        if self.sync_at_train_end:
            self.state.synchronize(self.trainer.model_wrapped)
        self.state.close()

    # ------------------------------------------------------------------ checkpoints
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After the Trainer wrote checkpoint-<global_step> (every rank calls on_save).
        if self.state is None or self.state._closed:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        entry: dict[str, Any] = {
            "format": FORMAT,
            "global_step": state.global_step,
            "hier": self.state.state_dict(),  # collective when a sync is owed: every rank is here
        }
        if self.per_rank_checkpoint:
            entry["model"] = self.trainer.model.state_dict()
            entry["optimizer"] = self.trainer.optimizer.state_dict()
        os.makedirs(folder, exist_ok=True)
        path = state_file(folder, dist.get_rank(), dist.get_world_size())
        torch.save(entry, path + ".tmp")
        os.replace(path + ".tmp", path)  # a rank killed while writing leaves no half-written file

    def _load(self, args: Any, global_step: int) -> None:
        assert self.state is not None
        trainer, rank, world = self.trainer, dist.get_rank(), dist.get_world_size()
        folder = args.resume_from_checkpoint if isinstance(args.resume_from_checkpoint, str) else None
        folder = folder or os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")
        path = state_file(folder, rank, world)
        entry, problem = None, None
        if not os.path.isfile(path):
            held = sorted(f for f in os.listdir(folder) if f.startswith("hiersync-")) if os.path.isdir(folder) else []
            problem = f"no {os.path.basename(path)} in {folder}" + (f" (it holds {held[:2]}...)" if held else "")
        else:
            entry = torch.load(path, map_location="cpu", weights_only=True)
            if entry.get("format") != FORMAT or entry.get("global_step") != global_step:
                problem = f"{path} is from step {entry.get('global_step')}, the Trainer resumed at step {global_step}"
            elif rank == 0 and "model" in entry and not _same_trainable(trainer.model, entry["model"]):
                problem = f"the weights in {path} are not those the Trainer resumed from"
        # decide together: a rank that raised alone would leave the others waiting in the first step
        problems: list[Any] = [None] * world
        dist.all_gather_object(problems, problem)
        if any(problems):
            where = next(p for p in problems if p)
            self.state.close()
            raise RuntimeError(
                f"HierSyncCallback cannot resume the hiersync state at step {global_step}: {where}. Resume from a "
                "checkpoint this callback wrote, with the same world size; when its folder is not "
                "<output_dir>/checkpoint-<step>, set TrainingArguments(resume_from_checkpoint=folder) as well; or "
                "HierSyncCallback(..., resume=False) to start a fresh hiersync schedule"
            )
        assert entry is not None
        # The Trainer loaded rank 0's model and optimizer on every rank: put back this rank's own.
        if "model" in entry:
            trainer.model.load_state_dict(entry["model"])
        if "optimizer" in entry:
            trainer.optimizer.load_state_dict(entry["optimizer"])
        self.state.load_state_dict(entry["hier"])


def _same_trainable(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> bool:
    """Whether ``model``'s trainable parameters equal ``saved``'s (the ones the Trainer writes and loads)."""
    for name, p in model.named_parameters():
        if p.requires_grad and (name not in saved or not torch.equal(p.detach().cpu(), saved[name])):
            return False
    return True
