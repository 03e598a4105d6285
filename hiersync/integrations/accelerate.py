"""HF Accelerate: exact resume of hiersync through ``accelerator.save_state``/``load_state``.

``hiersync.register(model, optimizer, ...)`` works on what ``accelerator.prepare`` returns
(the DDP-wrapped model, the ``AcceleratedOptimizer``). For checkpoints::

    state = hiersync.register(model, opt, period=4)
    accelerator.register_for_checkpointing(state)   # or RankStates(state, model, opt): the same

Accelerate writes the model, the optimizer and registered objects from the main process
only, but between cross-node syncs every rank's parameters, optimizer state and hiersync
state may differ. :class:`RankStates` gathers all ranks' (model, optimizer, hiersync) states
into the object Accelerate writes, and on ``load_state`` (which loads registered objects
after the model and optimizer) puts back this rank's own. A :class:`~hiersync.HierState`
registered itself does the same through :func:`rank_states_of` (it knows its model and
optimizer from :func:`hiersync.register`); one that knows no optimizer is refused at
``save_state``. That is this module's checkpoint adapter, registered with the core on import
(:data:`hiersync.frontend.CHECKPOINT_ADAPTERS`; ``hiersync``'s public names import it): the
core knows neither Accelerate nor this module. This module does not import ``accelerate``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..frontend import CHECKPOINT_ADAPTERS, SyncState
from . import _per_rank

__all__ = ["RankStates", "rank_states_of"]


class RankStates:
    """``state_dict``/``load_state_dict`` of every rank's model, optimizer and :class:`HierState`.

    Both are collective (``state_dict`` gathers to rank 0); Accelerate calls them on every
    process inside ``save_state``/``load_state``. ``model`` may be the DDP-wrapped model and
    ``optimizer`` the ``AcceleratedOptimizer``; pass ``None`` for either to keep only the
    hiersync state per rank (then the framework's rank-0 copy of it is what every rank gets,
    which is exact only when all ranks hold the same values, e.g. after ``state.synchronize``).
    """

    def __init__(
        self,
        state: SyncState,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.state = state
        self.model = getattr(model, "module", model)
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"hier": self.state.state_dict()}
        if self.model is not None:
            entry["model"] = self.model.state_dict()
        if self.optimizer is not None:
            entry["optimizer"] = self.optimizer.state_dict()
        return _per_rank.gather(entry)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        entry = _per_rank.pick(state_dict, "hiersync RankStates")
        if self.model is not None and "model" in entry:
            self.model.load_state_dict(entry["model"])
        if self.optimizer is not None and "optimizer" in entry:
            self.optimizer.load_state_dict(entry["optimizer"])
        self.state.load_state_dict(entry["hier"])


def rank_states_of(state: SyncState) -> RankStates:
    """``RankStates(state, model, optimizer)`` for a state given to ``register_for_checkpointing`` itself.

    The model and optimizer are those :func:`hiersync.register` bound the state to. A state
    without them (the hook registered by hand, no attached optimizer, or closed) cannot bring
    the other ranks' states along: ``TypeError`` naming the fix, at ``save_state`` time.
    """
    missing = [name for name, obj in (("model", state._model), ("optimizer", state._optimizer)) if obj is None]
    if missing:
        raise TypeError(
            "accelerator.register_for_checkpointing(state) with a HierState that knows no "
            f"{' and no '.join(missing)}: Accelerate writes registered objects from rank 0 only, and between "
            "cross-node syncs every rank holds its own model, optimizer and hiersync state. Register "
            "RankStates(state, model, optimizer) instead (from hiersync.integrations.accelerate import RankStates)"
        )
    return RankStates(state, state._model, state._optimizer)


def _called_by_save_state() -> bool:
    """Whether Accelerate's ``save_custom_state`` called :meth:`SyncState.state_dict`.

    ``save_state`` calls ``obj.state_dict()`` of each registered object on every process and
    writes rank 0's result; nothing but the caller tells the object who asks. Frames: this
    function, the adapter, ``SyncState.state_dict``, its caller.
    """
    return sys._getframe(3).f_globals.get("__name__") == "accelerate.checkpointing"


class _SaveStateAdapter:
    """Every rank's state for Accelerate's ``save_state``; this rank's own back on ``load_state``."""

    def state_dict(self, state: SyncState) -> dict[str, Any] | None:
        return rank_states_of(state).state_dict() if _called_by_save_state() else None

    def load_state_dict(self, state: SyncState, state_dict: Any) -> bool:
        if not _per_rank.is_per_rank(state_dict):
            return False
        rank_states_of(state).load_state_dict(state_dict)
        return True


if not any(isinstance(a, _SaveStateAdapter) for a in CHECKPOINT_ADAPTERS):
    CHECKPOINT_ADAPTERS.append(_SaveStateAdapter())
