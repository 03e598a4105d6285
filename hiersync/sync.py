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

    >>> engine = CrossNodeSync(averager, Schedule(period=4), overlap=1, chunk_bytes=25 * 2**20)
    >>> engine.mark_due(3); engine.after_step(4)   # sync step 3: launched after optimizer.step()
    >>> engine.after_step(5)                       # step 4: the correction is applied

Streaming (``Schedule(fragments=F)``): only the fragments due after a step are averaged,
each applied ``overlap`` steps after its launch; several may be in flight.
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
from .schedule import Schedule, fragment_layout
from .shards import ShardedAverager

__all__ = ["CrossNodeSync", "build_sync", "world_mean"]

logger = logging.getLogger(__name__)


class CrossNodeSync:
    """Blocking, overlapped, streaming and deferred cross-node parameter averages of one rank.

    ``schedule`` says which fragments sync after which step (one fragment, the whole
    model, unless ``schedule.fragments > 1``); ``overlap`` is tau: 0 runs each average
    blocking, tau >= 1 applies it ``tau`` steps after its launch.
    """

    def __init__(
        self, averager: ParamAverager | ShardedAverager, schedule: Schedule, *, overlap: int, chunk_bytes: int
    ) -> None:
        self.averager = averager
        self.schedule = schedule
        self.overlap = int(overlap)
        self.chunk_bytes = chunk_bytes
        self.pending: list[Pending] = []
        self.due: tuple[int, tuple[int, ...]] | None = None  # (step, fragments) not launched yet
        self._layout: list[list[int]] | None = None
        self._forward_hook: Any = None

    @property
    def in_flight(self) -> int:
        """Corrections launched or loaded but not applied yet."""
        return len(self.pending)

    def layout(self) -> list[list[int]]:
        """Registry positions of each fragment (computed once every parameter is registered)."""
        if self._layout is None:
            sizes = [p.numel() * 4 for p in self.averager.params]
            self._layout = fragment_layout(sizes, self.schedule.fragments)
        return self._layout

    def mark_due(self, step: int) -> None:
        """``step``'s backward ended and some fragment syncs after it: run after ``optimizer.step()``."""
        fragments = self.schedule.fragments_due(step) if self.schedule.fragments > 1 else (0,)
        if not fragments:
            return
        self.due = (step, fragments)
        if self._forward_hook is None:
            ref = weakref.ref(self)
            self._forward_hook = register_module_forward_pre_hook(lambda *_: _launch_owed(ref))

    def after_step(self, steps_done: int) -> None:
        """Call after every ``optimizer.step()`` (``steps_done``: backward passes completed):
        apply the corrections that are due, then run the syncs due after this step."""
        self._unhook()
        self.apply_pending(steps_done)
        due, self.due = self.due, None
        if due is None:
            return
        step, fragments = due
        with torch.no_grad(), record_function("hiersync/sync_after_step"):
            if self.overlap:
                self.launch_deferred(fragments, apply_at=step + 1 + self.overlap)
            else:
                self.run_blocking(fragments)

    def launch_owed(self, where: str = "") -> None:
        """If a due sync was not launched (``optimizer.step()`` skipped): launch it now, deferred."""
        self._unhook()
        if self.due is None:
            return
        (step, fragments), self.due = self.due, None
        logger.info(
            "hiersync: optimizer.step() was skipped after a sync step%s (e.g. a GradScaler overflow); its "
            "cross-node average runs now and is applied after the next optimizer.step()",
            where,
        )
        with torch.no_grad(), record_function("hiersync/sync_deferred"):
            self.launch_deferred(fragments, apply_at=step + 1 + max(self.overlap, 1))

    def close(self) -> None:
        """Drop syncs in flight, the forward pre-hook and every reference to parameters and state.

        DDP keeps its comm hook's state alive as long as the DDP module lives, so a closed
        state must not keep the model, its copies or the optimizer alive with it.
        """
        self._unhook()
        self.pending, self.due, self._layout = [], None, None
        self.averager.release()

    def _unhook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _chunks(self, fragments: tuple[int, ...]) -> list[tuple[int, list[int]]]:
        """(fragment, registry positions) per transfer, in the same order on every rank."""
        avg, out = self.averager, []
        for f in fragments:
            idx = self.layout()[f] if self.schedule.fragments > 1 else list(range(len(avg.params)))
            sizes = [avg.params[i].numel() * 4 for i in idx]
            out += [(f, [idx[j] for j in part]) for part in chunk_by_bytes(sizes, self.chunk_bytes)]
        return out

    def _settle_fragment(self, f: int) -> None:
        """Apply what is still in flight for fragment ``f`` before it syncs again.

        With tau <= period - 1 this happens only after skipped optimizer steps: a
        fragment's next average needs the anchor its previous one sets.
        """
        if any(p.fragment == f for p in self.pending):
            self.apply_pending(None, only=f)

    def run_blocking(self, fragments: tuple[int, ...] = (0,)) -> None:
        """Average ``fragments`` across nodes now (chunked, all chunks in flight at once)."""
        avg = self.averager
        for f in fragments:
            self._settle_fragment(f)
        launched = [avg.launch([avg.params[i] for i in idx]) for _, idx in self._chunks(fragments)]
        for job in launched:
            avg.write(job.indices, avg.complete(job))

    @torch.no_grad()
    def launch_deferred(self, fragments: tuple[int, ...] = (0,), apply_at: int = 0) -> None:
        """Launch the average of ``fragments``; apply it at ``apply_at`` as a delta correction."""
        avg = self.averager
        for f in fragments:
            self._settle_fragment(f)
        for f, idx in self._chunks(fragments):
            launched = avg.launch([avg.params[i] for i in idx], keep_snapshot=True)
            gathered = avg.gather_correction(launched)
            if gathered is not None:  # the node gathers it as soon as the rail leg is done
                self.pending.append(Pending(idx, None, None, apply_at=apply_at, fragment=f, gathered=gathered))
            else:
                self.pending.append(Pending(idx, launched.snapshot, launched, apply_at=apply_at, fragment=f))

    def capture_anchor(self) -> None:
        """Remember the current parameters as the anchor of every chunk (first post-warmup step)."""
        self.averager.capture_chunks([idx for _, idx in self._chunks(tuple(range(self.schedule.fragments)))])

    def resolve_all(self) -> None:
        """Wait for every transfer in flight (their completion updates anchor and momentum)."""
        for p in self.pending:
            p.resolve(self.averager)

    @torch.no_grad()
    def apply_pending(self, steps_done: int | None = None, only: int | None = None) -> None:
        """Wait for and add the pending corrections due at ``steps_done`` (None: all of them;
        ``only``: those of that fragment) to the parameters, in launch order.

        Checked first, all of them: a correction that does not fit the registered
        parameters raises ``ValueError`` and nothing is applied or dropped.
        """
        due = [
            p
            for p in self.pending
            if (steps_done is None or p.apply_at <= steps_done) and (only is None or p.fragment == only)
        ]
        if not due:
            return
        avg, params = self.averager, self.averager.params
        for p in due:
            bad = [i for i in p.indices if not 0 <= i < len(params)]
            whole = None if bad else sum(params[i].numel() for i in p.indices)
            expected = None if bad else avg.part_numel(p.indices)
            got = p.correction.numel() if p.correction is not None else expected
            if p.correction is not None and got == whole != expected:  # saved whole (older checkpoint)
                p.correction, got = avg.part_of(p.indices, p.correction), expected
            if bad or got != expected:
                raise ValueError(
                    f"hiersync pending correction for parameter positions {p.indices[:4]}... has {got} values "
                    f"but this model has {len(params)} registered parameters"
                    + (f" (no position {bad[0]})" if bad else f" holding {expected} values there")
                    + ": the checkpoint is from a different model"
                )
        self.pending = [p for p in self.pending if all(p is not d for d in due)]
        for p in due:
            gathered = p.whole()
            if gathered is not None:
                assert isinstance(avg, ShardedAverager)
                avg.add_gathered(p.indices, gathered)
            else:
                corr = p.resolve(avg)
                avg.write(p.indices, corr.to(params[p.indices[0]].device), add=True)

    # ------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """Averager state plus corrections in flight (resolved first: that updates the anchor)."""
        self.resolve_all()
        return {
            "averager": self.averager.state(),
            "pending": [
                {
                    "indices": list(p.indices),
                    "correction": p.resolve(self.averager).cpu(),
                    "apply_at": p.apply_at,
                    "fragment": p.fragment,
                }
                for p in self.pending
            ],
        }

    def load(self, averager_state: dict[str, Any], pending: list[dict[str, Any]]) -> None:
        self.due = None
        self.averager.load(averager_state)
        self.pending = [
            Pending(
                indices=list(p["indices"]),
                snapshot=None,
                launched=None,
                correction=p["correction"],
                apply_at=int(p.get("apply_at", 0)),  # older checkpoints: at the next optimizer.step()
                fragment=int(p.get("fragment", 0)),
            )
            for p in pending
        ]


_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_sync(comm: Any, cfg: Any) -> tuple[ParamAverager, CrossNodeSync]:
    """The averager (registry, pure-hook state) and the post-step engine for a ``HierConfig``.

    After ``optimizer.step()`` a rank keeps the local-SGD state of its 1/L shard only
    (:mod:`hiersync.shards`); uneven nodes and a single node keep it whole.
    """
    averager = ParamAverager(
        comm, compress=_DTYPES[cfg.compress], outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum
    )
    topo = comm.topology
    sharded = topo.even and topo.num_nodes > 1
    engine_averager = ShardedAverager(averager, cfg.state_device) if sharded else averager
    engine = CrossNodeSync(engine_averager, cfg.schedule, overlap=cfg.overlap, chunk_bytes=cfg.chunk_bytes)
    return averager, engine


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
