"""User-error checks of the DDP front-end: each raises naming the bad value and the fix.

Kept apart from :mod:`hiersync.ddp` so that the step lifecycle reads without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .topology import Topology

if TYPE_CHECKING:
    from .frontend import SyncState

__all__ = [
    "check_constructible",
    "unwrap_optimizer",
    "check_attachable",
    "check_usable",
    "check_optimizer_needed",
    "check_bucket",
    "check_same_device",
    "check_optimizer_owns",
]


def check_constructible(topology: Any) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "hiersync.HierState needs an initialized process group: call "
            "torch.distributed.init_process_group() on every rank first"
        )
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a hiersync.Topology, got {type(topology).__name__}")


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer``
    keeps it in ``.optimizer``, Lightning's ``LightningOptimizer`` in ``._optimizer``).

    Hooks go on the inner optimizer: a wrapper's own ``step()`` never runs the step hooks
    registered on the wrapper, but it calls the inner ``step()``, which does.
    """
    for name in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, name, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return unwrap_optimizer(inner)
    return optimizer


def check_attachable(state: SyncState, optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"attach_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if state._optimizer is not None:
        raise RuntimeError("an optimizer is already attached to this HierState; attach exactly one")
    if state._model is not None:
        check_optimizer_owns(optimizer, state._model.parameters())


def check_usable(state: SyncState) -> None:
    if state._closed:
        raise RuntimeError("this HierState was closed; build a new one and register the hook again")
    if not dist.is_initialized() or dist.group.WORLD is not state._world_group:
        now = dist.get_world_size() if dist.is_initialized() else "no"
        raise RuntimeError(
            f"this HierState was built for another process group (world size {state.world_size}; now: {now} "
            "ranks): its subgroups died with that group. Build a new HierState (and register the hook "
            "again) after every init_process_group, e.g. after an elastic restart"
        )
    if state._optimizer is None:
        fix = "call state.attach_optimizer(optimizer) before training (or hiersync.register(model, optimizer, ...))"
        check_optimizer_needed(state.config, fix)


def check_optimizer_needed(cfg: Any, fix: str) -> None:
    """Refuse a configuration that works after ``optimizer.step()`` when no optimizer is attached: at
    ``register(model, None, ...)``, or at the first step of a hook with no ``attach_optimizer``."""
    if cfg.rack_period is not None:
        why = f"rack_period={cfg.rack_period} needs an optimizer: the rack level averages parameters after"
    elif cfg.average_optimizer_state:
        why = f"average_optimizer_state={cfg.average_optimizer_state!r} needs an optimizer: its state is averaged after"
    elif cfg.overlap or cfg.fragments > 1:
        why = f"HierState(overlap={cfg.overlap}, fragments={cfg.fragments}) needs an optimizer: the sync runs after"
    else:
        return
    raise ValueError(f"{why} optimizer.step(); {fix}")


def check_bucket(
    buf: torch.Tensor, params: list[torch.Tensor], device: torch.device | None, compress: str | None
) -> torch.device:
    """The device of the model's buckets, after checking this one's (first backward only)."""
    devices = {p.device for p in params} | {buf.device}
    if len(devices) > 1:
        raise RuntimeError(
            f"hiersync: parameters of one DDP bucket are on several devices {sorted(map(str, devices))}; "
            "move the whole model to one device per rank (model.to(device)) before wrapping it in DDP"
        )
    check_same_device(buf, device)
    if compress is not None and not buf.is_floating_point():
        raise TypeError(
            f"hiersync: compress={compress!r} needs floating-point gradients, got a {buf.dtype} "
            "bucket; use compress=None for this model"
        )
    return buf.device


def check_same_device(buf: torch.Tensor, device: torch.device | None) -> None:
    if device is not None and buf.device != device:
        raise RuntimeError(
            f"hiersync: gradient bucket on {buf.device} but earlier buckets were on {device}; "
            "keep the whole model on one device per rank"
        )


def check_optimizer_owns(optimizer: torch.optim.Optimizer, params: Any) -> None:
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [tuple(p.shape) for p in params if p.requires_grad and id(p) not in owned]
    if missing:
        raise ValueError(
            f"attach_optimizer: the optimizer does not own {len(missing)} of the model's parameters "
            f"(shapes {missing[:3]}...); build the optimizer from ddp_model.parameters()"
        )


def check_paceable(model: Any) -> None:
    """Under adaptive pace nodes run different numbers of forwards and backwards: refuse a DDP model
    that issues a collective over the world in every one of them."""
    will_sync = getattr(model, "will_sync_module_buffers", None)
    if will_sync is not None:
        syncs = bool(will_sync())
    else:  # torch before forward_sync_buffers
        syncs = bool(getattr(model, "broadcast_buffers", False)) and any(True for _ in model.module.buffers())
    if syncs:
        raise ValueError(
            "pace='adaptive' with a DistributedDataParallel model that broadcasts its buffers: DDP broadcasts them "
            "over the world before every forward, and under adaptive pace the nodes take different numbers of "
            "forwards; build DDP with forward_sync_buffers=False (broadcast_buffers=False before torch 2.13; "
            "state.synchronize(model) averages the buffers), or use pace='fixed'"
        )
    if getattr(model, "find_unused_parameters", False):
        raise ValueError(
            "pace='adaptive' with DistributedDataParallel(find_unused_parameters=True): DDP all-reduces its map of "
            "used parameters over the world in every backward, and under adaptive pace the nodes take different "
            "numbers of them; build DDP with find_unused_parameters=False, or use pace='fixed'"
        )
