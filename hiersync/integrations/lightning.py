"""Lightning: :class:`HierSyncCallback` registers hiersync on the DDP model Lightning wraps.

Example::

    >>> from hiersync.integrations.lightning import HierSyncCallback
    >>> trainer = Trainer(strategy="ddp", callbacks=[HierSyncCallback(period=4, warmup_steps=100)])

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on CUDA, has no
step after ``optimizer.step()`` and does not checkpoint the hook's state; this callback does
all three, on CPU and CUDA. Needs ``pip install hiersync[lightning]`` (``lightning``, or the
older ``pytorch_lightning`` package).
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ..api import register
from ..ddp import HierState
from ..ddp_checks import unwrap_optimizer
from . import _per_rank

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package, or none
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError(
            "hiersync.integrations.lightning needs lightning (or pytorch_lightning): pip install 'hiersync[lightning]'"
        ) from e

__all__ = ["HierSyncCallback"]

CHECKPOINT_KEY = "hiersync"


class HierSyncCallback(pl.Callback):
    """Hierarchical gradient sync for ``Trainer(strategy="ddp")``.

    At ``on_fit_start`` (after Lightning wrapped the model in DDP and built the optimizer;
    collective on every rank) it calls :func:`hiersync.register` on the wrapped model with
    ``period``, ``warmup_steps`` and ``options`` (any :class:`~hiersync.HierState` option) and
    attaches the optimizer (``attach_optimizer=True``; exactly one optimizer). The
    :class:`HierState` is ``self.state`` from then on.

    * ``sync_before_validation``: ``state.synchronize(model)`` before each validation run
      of ``fit`` (not the sanity check): every rank evaluates the same world-mean model. It
      acts as an extra cross-node sync, so it changes the training trajectory.
    * ``sync_at_fit_end``: ``state.synchronize(model)`` when training ends (``on_train_end``,
      while the model is still wrapped and on its device), so the weights you use or save
      afterwards are the same on every rank.
    * ``per_rank_checkpoint``: Lightning writes one checkpoint from rank 0, but ranks of
      different nodes hold different parameters, optimizer states and hiersync states
      between syncs. The callback gathers every rank's (model, optimizers, hiersync) state
      into that checkpoint under ``"hiersync"`` (the file grows about world-size times)
      and, on resume, each rank restores its own at ``on_train_start`` (after Lightning
      restored rank 0's), so the resumed run is bitwise the uninterrupted one. With
      ``False`` only the hiersync states are gathered; resume is then exact only for a
      checkpoint taken when all ranks held the same values. A checkpoint from another world
      size raises ``ValueError``. ``trainer.save_checkpoint(path)`` after ``fit`` returned
      works the same way: the hiersync state as training ended is kept for it, so a later
      ``fit(ckpt_path=path)`` continues the schedule (step counter, period, warmup) from there.
    * ``log_stats``: logs this rank's ``state.stats`` each training batch through
      ``pl_module.log_dict`` (``hiersync/inter_bytes``, ``hiersync/intra_bytes``,
      ``hiersync/sync_steps``, ``hiersync/local_steps``, ``hiersync/exact_steps``,
      ``hiersync/nonfinite_skips``).

    The state is closed (hooks and process groups released) at the ``teardown`` of ``fit``;
    ``self.state.stats`` stays readable.
    """

    def __init__(
        self,
        period: int = 4,
        warmup_steps: int = 0,
        *,
        attach_optimizer: bool = True,
        sync_before_validation: bool = True,
        sync_at_fit_end: bool = True,
        per_rank_checkpoint: bool = True,
        log_stats: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        self.options = dict(period=period, warmup_steps=warmup_steps, **options)
        self.attach_optimizer = attach_optimizer
        self.sync_before_validation = sync_before_validation
        self.sync_at_fit_end = sync_at_fit_end
        self.per_rank_checkpoint = per_rank_checkpoint
        self.log_stats = log_stats
        self.state: HierState | None = None
        self._restore: dict[str, Any] | None = None
        self._ended: dict[str, Any] | None = None  # state.state_dict() as training ended, for later saves

    # ------------------------------------------------------------------ set-up
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"HierSyncCallback needs Trainer(strategy='ddp') (a DistributedDataParallel model), got "
                f"{type(model).__name__} from {type(trainer.strategy).__name__}"
            )
        optimizer = None
        if self.attach_optimizer and trainer.optimizers:
            if len(trainer.optimizers) != 1:
                raise ValueError(
                    f"HierSyncCallback attaches exactly one optimizer, the module configured "
                    f"{len(trainer.optimizers)}; use HierSyncCallback(attach_optimizer=False)"
                )
            optimizer = trainer.optimizers[0]
        self._ended = None
        self.state = register(model, optimizer, **self.options)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        entry, self._restore = self._restore, None
        if entry is None or self.state is None:
            return
        # Lightning restored rank 0's model and optimizer on every rank: put back this rank's own.
        if "model" in entry:
            pl_module.load_state_dict(entry["model"])
        if "optimizers" in entry:
            for opt, sd in zip(trainer.optimizers, entry["optimizers"], strict=True):
                opt.load_state_dict(sd)
        self.state.load_state_dict(entry["hier"])

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.state is not None:
            self.state.close()

    # ------------------------------------------------------------------ training
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Lightning runs forward and backward inside optimizer.step(closure), after the
        # optimizer's step pre-hook: skip a non-finite update here, where the step's
        # gradients exist (the pre-hook only saw the previous step's verdict).
        state = self.state
        if state is not None and state.guard.enabled and state.guard.skip_update():
            state.guard.drop_grads(unwrap_optimizer(optimizer))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.log_stats or self.state is None:
            return
        s = self.state.stats.as_dict()
        pl_module.log_dict(
            {
                "hiersync/inter_bytes": float(s["bytes_sent"]["inter"]),
                "hiersync/intra_bytes": float(s["bytes_sent"]["intra"]),
                "hiersync/sync_steps": float(s["sync_steps"]),
                "hiersync/local_steps": float(s["local_steps"]),
                "hiersync/exact_steps": float(s["exact_steps"]),
                "hiersync/nonfinite_skips": float(s["nonfinite_skips"]),
            },
            on_step=True,
            on_epoch=False,
        )

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.sync_before_validation and self._training() and not trainer.sanity_checking:
            assert self.state is not None
            self.state.synchronize(trainer.strategy.model)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Not on_fit_end: by then Lightning's strategy teardown has moved the module to the CPU,
        # where an NCCL group cannot average it.
        if not self._training():
            return
        assert self.state is not None
        if self.sync_at_fit_end:
            self.state.synchronize(trainer.strategy.model)
        # Collective (as every state_dict); on a normal end only, when every rank gets here.
        self._ended = self.state.state_dict()

    def _training(self) -> bool:
        return self.state is not None and not self.state._closed

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self._training():
            assert self.state is not None
            hier = self.state.state_dict()  # collective: Lightning dumps on every rank
        elif self._ended is not None:
            hier = self._ended  # trainer.save_checkpoint after fit() returned
        else:
            return
        entry: dict[str, Any] = {"hier": hier}
        if self.per_rank_checkpoint:
            entry["model"] = pl_module.state_dict()
            entry["optimizers"] = [opt.state_dict() for opt in trainer.optimizers]
        checkpoint[CHECKPOINT_KEY] = _per_rank.gather(entry)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return  # a checkpoint without hiersync: start a fresh schedule
        self._restore = _per_rank.pick(saved, "HierSyncCallback")
