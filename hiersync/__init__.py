"""hiersync: hierarchical gradient sync for PyTorch DDP and FSDP2.

Gradient buckets are averaged inside each node every step (fast links) and parameters
across nodes only every ``period`` steps (slow links), with cost models that predict when
that pays off. One line to use it::

    state = hiersync.register(ddp_model, optimizer, period=4)

or, equivalently, ``ddp_model.register_comm_hook(hiersync.HierState(period=4), hiersync.hook)``.

The torch-dependent names are imported on first use, so the pure parts
(``hiersync.costmodel``, ``python -m hiersync plan``) start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .schedule import Schedule
from .stats import Stats
from .topology import Topology

if TYPE_CHECKING:
    from .ddp import HierState, hook, register
    from .fsdp import FSDPState, node_mesh
    from .futures import HierSyncError

__all__ = ["HierState", "hook", "register", "node_mesh", "FSDPState", "Topology", "Schedule", "Stats", "HierSyncError"]
__version__ = "0.1.0"

_LAZY = {
    "HierState": "ddp",
    "hook": "ddp",
    "register": "ddp",
    "node_mesh": "fsdp",
    "FSDPState": "fsdp",
    "HierSyncError": "futures",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        for other, where in _LAZY.items():
            if where == _LAZY[name]:
                globals()[other] = getattr(module, other)
        return globals()[name]
    raise AttributeError(f"module 'hiersync' has no attribute {name!r}")
