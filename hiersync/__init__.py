"""hiersync: hierarchical gradient sync for PyTorch DDP.

Gradient buckets are averaged inside each node every step (fast links) and parameters
across nodes only every ``period`` steps (slow links), with cost models that predict when
that pays off. One line to use it::

    state = hiersync.register(ddp_model, optimizer, period=4)

or, equivalently, ``ddp_model.register_comm_hook(hiersync.HierState(period=4), hiersync.hook)``.
"""

from __future__ import annotations

from .collectives import HierSyncError
from .hook import HierState, hook, register
from .schedule import Schedule
from .stats import Stats
from .topology import Topology

__all__ = ["HierState", "hook", "register", "Topology", "Schedule", "Stats", "HierSyncError"]
__version__ = "0.1.0"
