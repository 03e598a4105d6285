"""Which all-reduce an exact step runs for a bucket: policy only (the mechanism is HierComm).

``algorithm="two_level"`` and ``"flat"`` are fixed; ``"auto"`` asks the cost model, once
per bucket size, with a calibration profile (``python -m hiersync calibrate``) or the
preset for the backend.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .collectives import HierComm

__all__ = ["ExactPolicy"]

logger = logging.getLogger(__name__)


class ExactPolicy:
    """Runs a bucket's exact (world) average with the algorithm the config asks for."""

    def __init__(self, comm: HierComm, algorithm: str, profile: Any, backend: str) -> None:
        self.comm = comm
        self.algorithm = algorithm
        self.profile = profile
        self.backend = backend
        self.choices: dict[int, str] = {}
        """Bucket size in bytes -> the algorithm ``"auto"`` chose for it."""

    def reduce(self, buf: torch.Tensor) -> torch.futures.Future:
        algorithm = self.algorithm
        if algorithm == "auto":
            nbytes = buf.numel() * buf.element_size()
            algorithm = self.choices.get(nbytes) or self._choose(nbytes)
        if algorithm == "flat":
            return self.comm.flat_allreduce(buf)
        return self.comm.allreduce(buf)

    def _choose(self, nbytes: int) -> str:
        from . import costmodel

        topo = self.comm.topology
        choice = "two_level"
        if topo.even:
            if not isinstance(self.profile, costmodel.Profile):  # load once
                loaded = costmodel.Profile.load(self.profile) if self.profile is not None else None
                self.profile = loaded or costmodel.PRESETS[costmodel.preset_for_backend(self.backend)]
            picked = costmodel.choose_exact_algorithm(
                nbytes, topo.num_nodes, topo.ranks_per_node, self.profile, intra_algorithm=self.comm.intra_algorithm
            )
            choice = "flat" if picked == "flat" else "two_level"
        self.choices[nbytes] = choice
        logger.debug("hiersync auto: %d-byte buckets use %s", nbytes, choice)
        return choice
