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
    from .api import FSDPState, HierState, HierSyncError, hook, node_mesh, register

__all__ = ["HierState", "hook", "register", "node_mesh", "FSDPState", "Topology", "Schedule", "Stats", "HierSyncError"]
__version__ = "0.1.0"

_LAZY = ("HierState", "hook", "register", "node_mesh", "FSDPState", "HierSyncError")
"""The torch-dependent names, all from :mod:`hiersync.api`."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        api = importlib.import_module(".api", __name__)
        globals().update({other: getattr(api, other) for other in _LAZY})
        return globals()[name]
    raise AttributeError(f"module 'hiersync' has no attribute {name!r}")
