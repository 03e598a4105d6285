"""The cross-node sync engine: period-k parameter averaging after the optimizer step.

Free of DDP (so an FSDP2 front-end can reuse it; docs/design.md): it works on the averager's registry of
parameters and is told, by a front-end, when a sync step's update is done. It runs the
average blocking (every rank holds identical parameters when it returns), overlapped
(launched now, applied later as a delta correction ``x += target - snapshot``, so the
rank's own progress since the snapshot is kept), or deferred (the same, for a node whose
``optimizer.step()`` was skipped: its collectives still run, in the same order as on
every other node, so the nodes never desynchronize).

A sync step's average is *due* from the end of its backward (:meth:`mark_due`). It runs
after ``optimizer.step()`` (:meth:`after_step`); if that step is skipped (a GradScaler
overflow on this node) a process-wide forward pre-hook launches it, deferred, before the
next forward (:meth:`launch_owed`), so every node issues the same collectives in the
same order.

Example::

    >>> engine = CrossNodeSync(averager, overlap=True, chunk_bytes=25 * 2**20)
    >>> engine.mark_due(); engine.after_step()   # sync step: launched after optimizer.step()
    >>> engine.after_step()                      # next step: the correction is applied
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.profiler import record_function

from .futures import wait
from .localsgd import ParamAverager, Pending, chunk_by_bytes

__all__ = ["CrossNodeSync", "world_mean"]

logger = logging.getLogger(__name__)


class CrossNodeSync:
    """Blocking, overlapped and deferred cross-node parameter averages of one rank."""

    def __init__(self, averager: ParamAverager, *, overlap: bool, chunk_bytes: int) -> None:
        self.averager = averager
        self.overlap = overlap
        self.chunk_bytes = chunk_bytes
        self.pending: list[Pending] = []
        self.due = False  # a sync step's backward ended; its average has not been launched
        self._forward_hook: Any = None

    @property
    def in_flight(self) -> int:
        """Corrections launched or loaded but not applied yet."""
        return len(self.pending)

    def mark_due(self) -> None:
        """A sync step's backward ended: its average runs after ``optimizer.step()``."""
        self.due = True
        if self._forward_hook is None:
            ref = weakref.ref(self)
            self._forward_hook = register_module_forward_pre_hook(lambda *_: _launch_owed(ref))

    def after_step(self) -> None:
        """Call after every ``optimizer.step()``: apply due corrections, then run a due sync."""
        self._unhook()
        self.apply_pending()
        sync, self.due = self.due, False
        if not sync:
            return
        with torch.no_grad(), record_function("hiersync/sync_after_step"):
            if self.overlap:
                self.launch_deferred()
            else:
                self.run_blocking()

    def launch_owed(self, where: str = "") -> None:
        """If a due sync was not launched (``optimizer.step()`` skipped): launch it now, deferred."""
        self._unhook()
        if not self.due:
            return
        self.due = False
        logger.info(
            "hiersync: optimizer.step() was skipped after a sync step%s (e.g. a GradScaler overflow); its "
            "cross-node average runs now and is applied after the next optimizer.step()",
            where,
        )
        with torch.no_grad(), record_function("hiersync/sync_deferred"):
            self.launch_deferred()

    def close(self) -> None:
        """Drop syncs in flight and the forward pre-hook."""
        self._unhook()
        self.pending, self.due = [], False

    def _unhook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def run_blocking(self) -> None:
        """Average every parameter across nodes now (chunked, all chunks in flight at once)."""
        avg = self.averager
        launched = [avg.launch([avg.params[i] for i in idx]) for idx in avg.chunks(self.chunk_bytes)]
        for job in launched:
            avg.write(job.indices, avg.complete(job))

    @torch.no_grad()
    def launch_deferred(self) -> None:
        """Launch the average of every parameter; apply it later as a delta correction."""
        avg = self.averager
        for idx in avg.chunks(self.chunk_bytes):
            snapshot = avg.flat(idx)
            self.pending.append(Pending(idx, snapshot, avg.launch([avg.params[i] for i in idx], snapshot)))

    def resolve_all(self) -> None:
        """Wait for every transfer in flight (their completion updates anchor and momentum)."""
        for p in self.pending:
            p.resolve(self.averager)

    @torch.no_grad()
    def apply_pending(self) -> None:
        """Wait for and add every pending correction to the parameters.

        Checked first, all of them: a correction that does not fit the registered
        parameters raises ``ValueError`` and nothing is applied or dropped.
        """
        if not self.pending:
            return
        params = self.averager.params
        for p in self.pending:
            bad = [i for i in p.indices if not 0 <= i < len(params)]
            expected = None if bad else sum(params[i].numel() for i in p.indices)
            got = p.correction.numel() if p.correction is not None else expected
            if bad or got != expected:
                raise ValueError(
                    f"hiersync pending correction for parameter positions {p.indices[:4]}... has {got} values "
                    f"but this model has {len(params)} registered parameters"
                    + (f" (no position {bad[0]})" if bad else f" holding {expected} values there")
                    + ": the checkpoint is from a different model"
                )
        pending, self.pending = self.pending, []
        for p in pending:
            corr = p.resolve(self.averager)
            self.averager.write(p.indices, corr.to(params[p.indices[0]].device), add=True)

    # ------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """Averager state plus corrections in flight (resolved first: that updates the anchor)."""
        self.resolve_all()
        return {
            "averager": self.averager.state(),
            "pending": [
                {"indices": list(p.indices), "correction": p.resolve(self.averager).cpu()} for p in self.pending
            ],
        }

    def load(self, averager_state: dict[str, Any], pending: list[dict[str, Any]]) -> None:
        self.due = False
        self.averager.load(averager_state)
        self.pending = [
            Pending(indices=list(p["indices"]), snapshot=None, launched=None, correction=p["correction"])
            for p in pending
        ]


def _launch_owed(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.launch_owed(" (launched before the next forward)")


@torch.no_grad()
def world_mean(comm: Any, tensors: list[torch.Tensor], chunk_bytes: int) -> None:
    """Overwrite ``tensors`` with their mean over the world (fp32 on the wire, chunked). Collective."""
    for idx in chunk_by_bytes([t.numel() * 4 for t in tensors], chunk_bytes):
        chunk = [tensors[i] for i in idx]
        flat = wait(comm.allreduce(torch.cat([t.detach().reshape(-1).float() for t in chunk])))
        offset = 0
        for t in chunk:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
