"""hiersync's public names, and ``register``: one call from a wrapped model to a running state.

``import hiersync`` loads this module on first use of a torch-dependent name. ``register``
picks the front-end from what it is given: a ``DistributedDataParallel`` model gets the DDP
hook (:class:`hiersync.HierState`), a module ``fully_shard`` was called on gets the FSDP2
front-end (:class:`hiersync.fsdp.FSDPState`), and ``manager=`` (a ``torchft.Manager``) puts
the cross-node leg of either on torchft (:mod:`hiersync.ft`). Importing this module also
registers the framework integrations' checkpoint adapters
(:mod:`hiersync.integrations.accelerate`). Nothing below imports it, so dependencies point
down only (``tests/test_imports.py`` checks the graph).
"""

from __future__ import annotations

from typing import Any, overload

import torch
import torch.distributed as dist

from .config import HierConfig
from .ddp import HierState, hook
from .ddp_checks import check_optimizer_needed, check_paceable, unwrap_optimizer
from .frontend import SyncState
from .fsdp import FSDPState, is_fsdp2, node_mesh
from .futures import HierSyncError
from .integrations import accelerate as _accelerate  # noqa: F401  (registers its checkpoint adapter)

__all__ = ["register", "HierState", "hook", "FSDPState", "node_mesh", "HierSyncError"]


@overload
def register(
    model: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None, **options: Any
) -> HierState: ...


@overload
def register(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: Any) -> SyncState: ...


def register(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> SyncState:
    """Build hiersync's state from ``options`` for a DDP or an FSDP2 model; attach ``optimizer``.

    A ``DistributedDataParallel`` model gets a :class:`HierState` with the hook registered
    (``optimizer`` optional; it may be a framework's wrapper, e.g. Accelerate's
    ``AcceleratedOptimizer``: the torch optimizer inside it is attached). ``manager=`` (a
    ``torchft.Manager``; DDP or FSDP2) puts the inter-node leg on torchft's fault-tolerant replica
    groups: each node is its own torchrun job and training goes on when nodes die or join
    (:mod:`hiersync.ft`). A module that ``fully_shard`` was called on (FSDP2, sharded over
    :func:`hiersync.node_mesh`) gets a :class:`hiersync.fsdp.FSDPState` (``optimizer`` required).

    Example::

        >>> state = hiersync.register(ddp_model, optimizer, period=4, warmup_steps=100)
    """
    manager = options.pop("manager", None)
    if manager is not None:
        from .ft import register_with_manager  # the inter-node leg on torchft (survives node loss)

        return register_with_manager(model, optimizer, manager, **options)
    for name in ("start_nodes", "heartbeat_timeout"):
        if name in options:
            raise ValueError(
                f"{name}={options[name]!r} belongs to the manager mode: pass it with manager=torchft.Manager(...), "
                "or drop it (without a manager there is no quorum to wait for)"
            )
    if is_fsdp2(model):
        if optimizer is None:
            raise TypeError(
                "hiersync.register(fsdp_model, optimizer, ...) needs the optimizer: with FSDP2 the cross-node sync "
                "runs after optimizer.step()"
            )
        return FSDPState(model, unwrap_optimizer(optimizer), **options)
    if type(model).__name__ == "FullyShardedDataParallel":
        raise TypeError(
            "hiersync supports FSDP2 (torch.distributed.fsdp.fully_shard), not FSDP1 (FullyShardedDataParallel): "
            "shard with fully_shard(module, mesh=hiersync.node_mesh()) instead"
        )
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"hiersync.register needs a DistributedDataParallel model or an FSDP2 module (fully_shard), got "
            f"{type(model).__name__}: wrap it first (DistributedDataParallel(model), or fully_shard(model, "
            "mesh=hiersync.node_mesh()))"
        )
    ddp_group = getattr(model, "process_group", None)
    if ddp_group is not None and dist.is_initialized() and ddp_group.size() != dist.get_world_size():
        raise ValueError(
            f"hiersync averages over the whole world ({dist.get_world_size()} ranks) but this DDP model "
            f"syncs a process group of {ddp_group.size()} ranks; build DDP without process_group=..."
        )
    if options.get("pace") == "adaptive":
        check_paceable(model)
    if optimizer is None:  # refused here, before any group is built, rather than at the first step
        config = {k: v for k, v in options.items() if k not in ("process_group", "topology", "comm")}
        check_optimizer_needed(HierConfig(**config), "pass it: hiersync.register(model, optimizer, ...)")
    state = HierState(**options)
    state._model = model
    model.register_comm_hook(state, hook)
    if optimizer is not None:
        state.attach_optimizer(optimizer)
    return state
