"""The cross-node sync engine: period-k parameter averaging after the optimizer step.

Free of DDP and FSDP: it asks an :class:`Averager` (the one interface both front-ends
implement, :mod:`hiersync.averagers`) to average *chunks* of the registered parameters
across nodes, and a front-end tells it when a sync step's backward ended
(:meth:`CrossNodeSync.mark_due`; :meth:`CrossNodeSync.idle` when none of its syncs is due)
and when ``optimizer.step()`` ran (:meth:`CrossNodeSync.after_step`). Each fragment's average runs

* blocking (``overlap=0``): every rank holds identical parameters when it returns;
* overlapped (``overlap=tau``): launched now and *in flight*; its *correction*
  ``x += target - snapshot`` is added ``tau`` steps later, so the rank's own progress
  since the snapshot is kept.

A sync step's average is *due* from the end of its backward. It launches after
``optimizer.step()``; if that step is skipped (a GradScaler overflow on this node) a
process-wide forward pre-hook launches it before the next forward (:meth:`launch_due`),
overlapped, so every node issues the same collectives in the same order.

Example::

    >>> engine = CrossNodeSync(averager, registry, Schedule(period=4), overlap=1,
    ...                        chunk_bytes=25 * 2**20, transport=comm.rail)
    >>> engine.mark_due(3); engine.after_step(4)   # sync step 3: launched after optimizer.step()
    >>> engine.after_step(5)                       # step 4: its correction is applied

Streaming (``Schedule(fragments=F)``): only the fragments due after a step are averaged,
each applied ``overlap`` steps after its launch; several may be in flight.

Every sync runs in a *window* of the :class:`~hiersync.transport.Transport` (the rail): opened
at its launch, decided when its averages are in (blocking) or when its corrections are due
(overlapped). On a process-group rail every window commits; on torchft's a window can be
dropped, and then nothing it changed stays (its corrections are not applied, the chunks'
state it changed is restored from the backups taken at its launch).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.profiler import record_function

from .futures import wait
from .localsgd import Registry, chunk_by_bytes
from .pace import Windows
from .schedule import Schedule, fragment_layout
from .topology import Topology
from .transport import Marker, Transport, Window

__all__ = ["Averager", "AveragerComm", "Launched", "Correction", "CrossNodeSync"]

logger = logging.getLogger(__name__)


@dataclass
class Launched:
    """A chunk's cross-node average in flight: ``future`` holds the averaged payload.

    Read it only through the averager (:meth:`Averager.complete`), on the stream that uses it.
    """

    indices: tuple[int, ...]
    future: torch.futures.Future
    snapshot: torch.Tensor | None = None
    """This rank's shard as sent (fp32, before compression), kept when a correction needs it."""
    weighting: Any = None
    """The sync's weights (:class:`hiersync.tally.Weighting`); None: the unweighted mean."""


@dataclass
class Correction:
    """An overlapped sync in flight: ``target - snapshot`` is added to a chunk at ``apply_at``.

    Exactly one of ``future`` (launched here: what :meth:`Averager.add_correction` adds,
    once the rail leg is done and, on a node of replicas, gathered) and ``shard`` (this
    rank's shard of it, from a checkpoint) is set.
    """

    indices: tuple[int, ...]
    fragment: int
    apply_at: int
    """Applied by the first :meth:`CrossNodeSync.after_step` whose step count is at least this."""
    future: torch.futures.Future | None = None
    shard: torch.Tensor | None = None
    window: Window | None = None
    """The window it was launched in (None: loaded from a checkpoint, hence committed)."""

    @property
    def committed(self) -> bool:
        return self.window is None or bool(self.window.committed)


class AveragerComm(Protocol):
    """What an :class:`Averager` asks of the communication (:class:`~hiersync.collectives.HierComm`
    implements it; ``tests/test_sync_engine.py``'s fake does too, with the same signatures).

    Every cross-node leg goes through ``rail`` (a :class:`~hiersync.transport.Transport`);
    the node's legs (``gather_node*``) over the intra group. Calls are issued in the same
    order on every rank; every future is read through :func:`hiersync.futures.wait`.
    """

    topology: Topology
    groups: Any
    """This rank's groups: ``node_size`` (L) and ``local_rank`` are read."""
    rail: Transport
    weighting: Any
    """The weights of the averages being launched (:mod:`hiersync.tally`); None: the unweighted mean."""

    def rail_nodes(self) -> int:
        """Nodes that take part in a rail collective."""
        ...

    def rail_divisor(self) -> int:
        """Nodes whose values a rail average is taken over (healed nodes send zeros)."""
        ...

    def contributes(self) -> bool:
        """Whether this node's values enter the current rail average."""
        ...

    def average_shard(self, shard: torch.Tensor) -> torch.futures.Future:
        """This rank's shard averaged on its rail (divided, then all-reduced in place)."""
        ...

    def average_across_nodes(self, flat: torch.Tensor) -> torch.futures.Future:
        """A node-identical vector averaged across nodes (uneven nodes: through the leaders)."""
        ...

    def average_quantized(
        self, packed: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.futures.Future:
        """Quantized pieces averaged on the rail: all-to-all, ``reduce``, all-gather."""
        ...

    def gather_payloads(self, packed: torch.Tensor) -> torch.futures.Future:
        """Every node's payload all-gathered on the rail (``N`` payloads end to end, in rail order)."""
        ...

    def gather_node(self, out: torch.Tensor, shard: torch.Tensor) -> torch.futures.Future:
        """The node's shards all-gathered into ``out``."""
        ...

    def gather_node_after(
        self,
        ready: torch.futures.Future,
        make_shard: Callable[[], torch.Tensor],
        like: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.futures.Future:
        """Once ``ready`` is done, the node's shards ``make_shard()`` all-gathered."""
        ...


class Averager(Protocol):
    """What :class:`CrossNodeSync` asks of an averager; :mod:`hiersync.averagers` has both kinds.

    A *chunk* is a tuple of registry positions; every method is called with the same
    chunks in the same order on every rank. "This rank's shard" is the part of a chunk the
    rank averages on its rail: 1/L of it on a node of replicas, its own parameter shards
    on a sharded node.
    """

    def chunk_bytes(self, indices: Sequence[int]) -> list[int]:
        """The fp32 bytes each position of ``indices`` adds to this rank's transfers."""
        ...

    def capture(self, chunks: Callable[[], Sequence[Sequence[int]]]) -> None:
        """Remember the current values as the anchor of every chunk of ``chunks()`` that has none
        yet; without anchors to keep (no codec, no outer step), nothing (``chunks`` is not called:
        it fixes the fragment layout)."""
        ...

    def backup(self, indices: Sequence[int]) -> Callable[[], None]:
        """Copy what a sync of this chunk changes in the state kept between syncs (anchor,
        momentum, error feedback); the callable puts it back (a dropped window)."""
        ...

    def launch(self, indices: Sequence[int]) -> Launched:
        """Start averaging this rank's shard of a chunk across nodes (blocking sync)."""
        ...

    def complete(self, launched: Launched) -> torch.Tensor:
        """Wait for ``launched``; this rank's fp32 target; anchor and momentum updated."""
        ...

    def write(self, indices: Sequence[int], shard: torch.Tensor, add: bool = False) -> None:
        """Copy (or add) this rank's shard of a target or correction into the parameters.

        Collective inside a node of replicas (the node gathers the shards)."""
        ...

    def launch_correction(self, indices: Sequence[int]) -> torch.futures.Future:
        """Start an overlapped average of a chunk; the future holds what :meth:`add_correction` adds."""
        ...

    def add_correction(self, indices: Sequence[int], correction: torch.Tensor) -> None:
        """Add a correction from :meth:`launch_correction`'s future (local: no collective)."""
        ...

    def own_shard(self, indices: Sequence[int], correction: torch.Tensor) -> torch.Tensor:
        """This rank's shard of such a correction (what a checkpoint keeps)."""
        ...

    def shard_numel(self, indices: Sequence[int]) -> int:
        """Values in this rank's shard of a chunk."""
        ...

    def state(self) -> dict[str, Any]: ...

    def load(self, state: dict[str, Any]) -> None: ...

    def trim(self) -> None:
        """Free the host buffers kept for the next sync's reuse (no sync runs after this step)."""
        ...

    def release(self) -> None:
        """Forget the parameters and their state (the owner is closed)."""
        ...


class CrossNodeSync:
    """Blocking, overlapped and streaming cross-node parameter averages of one rank.

    ``schedule`` says which fragments sync after which step (one fragment, the whole
    model, unless ``schedule.fragments > 1``); ``overlap`` is tau: 0 runs each average
    blocking, tau >= 1 applies it ``tau`` steps after its launch.
    """

    def __init__(
        self,
        averager: Averager,
        registry: Registry,
        schedule: Schedule | Windows,
        *,
        overlap: int,
        chunk_bytes: int,
        transport: Transport,
        model_positions: Callable[[], Sequence[int] | None] | None = None,
        tally: Any = None,
        weights_to: Any = None,
    ) -> None:
        self.averager = averager
        self.registry = registry
        """The parameters averaged, by position (the averager's)."""
        self.schedule = schedule
        self.overlap = int(overlap)
        self.chunk_bytes = chunk_bytes
        self.transport = transport
        self.tally = tally
        """The samples and step times agreed with each sync (:class:`hiersync.tally.Tally`), whose
        weights the averages of ``weights_to`` (the averager's comm) take; None: unweighted means."""
        self.weights_to = weights_to
        self.model_positions = model_positions
        """Each registry position's index in ``model.parameters()`` (None: unknown). The fragments
        are packed in the model's order, so both front-ends stream the same fragments."""
        self.open_window: Callable[[Marker], Window | None] = self._open_window
        """Opens the window of a sync launch; None when the front-end resumed elsewhere (the
        manager mode: this node was healed into another place of the schedule)."""
        self.in_flight: list[Correction] = []
        self.due: tuple[int, tuple[int, ...]] | None = None  # (step, fragments) not launched yet
        self._layout: list[list[int]] | None = None
        self._chunks: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # by fragment, with the layout
        self._forward_hook: Any = None

    def layout(self) -> list[list[int]]:
        """Registry positions of each fragment (computed once every parameter is registered).

        Whole parameter tensors are packed in the order of ``model.parameters()`` where
        the state knows the model, else in registry order (DDP's first bucket order): the
        DDP and FSDP2 front-ends then give the same model the same fragments.
        """
        if self._layout is None:
            params = self.registry.params
            if not params:  # nothing registered yet: nothing to average (and nothing cached)
                return [[] for _ in range(self.schedule.fragments)]
            order = list(range(len(params)))
            where = self.model_positions() if self.model_positions is not None else None
            if where:
                order.sort(key=lambda i: where[i])
            # numel(): the whole tensor's, a DTensor's too, so both front-ends pack alike
            packed = fragment_layout([4 * params[i].numel() for i in order], self.schedule.fragments)
            self._layout = [sorted(order[j] for j in f) for f in packed]
        return self._layout

    def mark_due(self, step: int) -> None:
        """``step``'s backward ended and some fragment syncs after it: run after ``optimizer.step()``."""
        fragments = self.schedule.fragments_due(step) if self.schedule.fragments > 1 else (0,)
        if not fragments:
            return
        self.due = (step, fragments)
        if self._forward_hook is None:
            ref = weakref.ref(self)
            self._forward_hook = register_module_forward_pre_hook(lambda *_: _launch_due(ref))

    def after_step(self, steps_done: int) -> None:
        """Call after every ``optimizer.step()`` (``steps_done``: backward passes completed):
        apply the corrections that are due, then run the syncs due after this step."""
        self._unhook()
        self.apply_corrections(steps_done)
        due, self.due = self.due, None
        if due is not None:
            step, fragments = due
            # adaptive pace's windows count tau in the slowest node's steps (Windows.apply_at)
            at = getattr(self.schedule, "apply_at", None)
            apply_at = (at(step, self.overlap) if at is not None else step + 1 + self.overlap) if self.overlap else 0
            with torch.no_grad(), record_function("hiersync/sync_after_step"):
                self._sync(Marker("sync", step, tuple(fragments), bool(self.overlap), apply_at))

    def idle(self) -> None:
        """A step's backward ended and none of this engine's syncs runs after it: free the host
        buffers kept for the next sync's reuse (kept while syncs follow each other)."""
        self.averager.trim()

    def launch_due(self, where: str = "") -> None:
        """If a due sync was not launched (``optimizer.step()`` skipped): launch it now, overlapped."""
        self._unhook()
        if self.due is None:
            return
        (step, fragments), self.due = self.due, None
        logger.info(
            "hiersync: optimizer.step() was skipped after a sync step%s (e.g. a GradScaler overflow); its "
            "cross-node average runs now and is applied after the next optimizer.step()",
            where,
        )
        with torch.no_grad(), record_function("hiersync/sync_launched_late"):
            self._sync(Marker("sync", step, tuple(fragments), True, step + 1 + max(self.overlap, 1)))

    def _sync(self, marker: Marker) -> None:
        if (window := self.open_window(marker)) is not None:
            self.run_window(window)

    def _open_window(self, marker: Marker) -> Window:
        params = self.registry.params
        return self.transport.open(marker, params[0].device if params else torch.device("cpu"))

    def close(self) -> None:
        """Drop syncs in flight, the forward pre-hook and every reference to parameters and state.

        A sync in flight is dropped once its collectives have ended (nothing of it is applied):
        the peers take part in them, and destroying the groups under them leaves the peers'
        collectives, and the job's next one, waiting until their timeout. DDP keeps its comm
        hook's state alive as long as the DDP module lives, so a closed state must not keep
        the model, its copies or the optimizer alive with it.
        """
        self._unhook()
        for c in self.in_flight:
            if c.future is not None:
                try:
                    wait(c.future)
                except Exception as e:  # a peer is gone: nothing of the sync is applied anyway
                    logger.warning("hiersync: a cross-node sync in flight failed while closing: %s", e)
        self.in_flight, self.due, self._layout, self._chunks = [], None, None, {}
        self.averager.release()

    def _unhook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def chunks(self, fragments: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """(fragment, registry positions) per transfer, in the same order on every rank (packed
        once per fragment, with the layout)."""
        out = []
        for f in fragments:
            idx = self.layout()[f]
            if idx and f not in self._chunks:  # packed once (nothing registered yet: nothing to cache)
                parts = chunk_by_bytes(self.averager.chunk_bytes(idx), self.chunk_bytes)
                self._chunks[f] = [(f, tuple(idx[j] for j in part)) for part in parts]
            out += self._chunks.get(f, [])
        return out

    def _settle_fragment(self, f: int) -> None:
        """Apply what is still in flight for fragment ``f`` before it syncs again.

        With tau <= period - 1 this happens only after skipped optimizer steps: a
        fragment's next average needs the anchor its previous one sets.
        """
        if any(c.fragment == f for c in self.in_flight):
            self.apply_corrections(None, fragment=f)

    @torch.no_grad()
    def run_window(self, window: Window) -> None:
        """Launch the sync ``window.marker`` names (chunked, all chunks in flight at once):
        blocking (decided and written now) or overlapped (corrections in flight until ``apply_at``)."""
        m, avg, rail = window.marker, self.averager, self.transport
        for f in m.fragments:
            self._settle_fragment(f)
        chunks = self.chunks(m.fragments)
        if rail.droppable:
            window.restore += [avg.backup(idx) for _, idx in chunks]
        tally, weights = self.tally, {}
        if tally is not None:
            if rail.droppable:  # torchft's window: the barrier carried the tally; a drop counts the samples again
                window.restore.append(tally.backup(m.fragments))
            rows = window.rows if rail.droppable else None
            weights = tally.open(m.step, m.fragments, rows=rows, me=window.rank)
        try:
            if m.overlapped:
                for f, idx in chunks:
                    self._weigh(weights.get(f))
                    future = avg.launch_correction(idx)
                    if rail.droppable:  # the vote waits for it: a failure on the rail is known by then
                        window.futures.append(future)
                    self.in_flight.append(Correction(idx, f, m.apply_at, future=future, window=window))
                return
            launched = []
            for f, idx in chunks:
                self._weigh(weights.get(f))
                launched.append(avg.launch(idx))
        finally:
            self._weigh(None)
        if not rail.droppable:  # chunk by chunk: one target at a time
            for job in launched:
                avg.write(job.indices, avg.complete(job))
            return
        targets = [avg.complete(job) for job in launched]  # garbage where the rail failed: never written
        if rail.decide(window):
            for job, target in zip(launched, targets):
                avg.write(job.indices, target)

    def _weigh(self, weighting: Any) -> None:
        """The weights the next launches take (None: the unweighted mean)."""
        if self.weights_to is not None:
            self.weights_to.weighting = weighting

    def capture_anchor(self) -> None:
        """Remember the current parameters as the anchor of every chunk (first post-warmup step)."""
        self.averager.capture(lambda: [idx for _, idx in self.chunks(range(self.schedule.fragments))])

    def launch_now(self, step: int) -> list[Correction]:
        """Launch step ``step``'s average of every fragment now, overlapped (the sync step inside
        DDP's hook, before ``optimizer.step()``); :meth:`apply` adds them once they are in."""
        before = len(self.in_flight)
        with torch.no_grad(), record_function("hiersync/sync_in_hook"):
            self._sync(Marker("sync", step, tuple(range(self.schedule.fragments)), True, step + 1))
        return self.in_flight[before:]

    def apply_corrections(self, steps_done: int | None = None, fragment: int | None = None) -> None:
        """Wait for and add the corrections due at ``steps_done`` (None: all of them;
        ``fragment``: those of that fragment) to the parameters, in launch order.

        Checked first, all of them: a correction that does not fit the registered
        parameters raises ``ValueError`` and nothing is applied or dropped.
        """
        due = [
            c
            for c in self.in_flight
            if (steps_done is None or c.apply_at <= steps_done) and (fragment is None or c.fragment == fragment)
        ]
        for c in due:
            self._check_fits(c)
        self.apply(due)

    @torch.no_grad()
    def apply(self, due: Sequence[Correction]) -> None:
        """Take ``due`` out of flight and add them to the parameters, in launch order. Their windows
        are decided first: a dropped window's corrections are discarded (local progress kept)."""
        if not due:  # most steps (and every step's end in DDP's hook): nothing to take out of flight
            return
        for c in due:
            if c.window is not None:
                self.transport.decide(c.window)
        self.discard(due)
        avg = self.averager
        for c in due:
            if not c.committed:
                continue
            if c.future is not None:
                avg.add_correction(c.indices, wait(c.future))
            else:
                assert c.shard is not None
                avg.write(c.indices, c.shard, add=True)

    def discard(self, corrections: Sequence[Correction]) -> None:
        """Take ``corrections`` out of flight without applying them."""
        self.in_flight = [c for c in self.in_flight if all(c is not d for d in corrections)]

    def _check_fits(self, c: Correction) -> None:
        n = len(self.registry.params)
        bad = [i for i in c.indices if not 0 <= i < n]
        if c.shard is None and not bad:
            return
        expected = None if bad else self.averager.shard_numel(c.indices)
        if bad or c.shard is None or c.shard.numel() != expected:
            got = c.shard.numel() if c.shard is not None else None
            raise ValueError(
                f"hiersync correction for parameter positions {list(c.indices)[:4]}... has {got} values "
                f"but this model has {n} registered parameters"
                + (f" (no position {bad[0]})" if bad else f" holding {expected} values there")
                + ": the checkpoint is from a different model"
            )

    # ------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """Averager state plus corrections in flight (waited for first: that updates the anchor).

        Every window is decided first: only committed corrections are saved."""
        self.transport.settle()
        self.in_flight = [c for c in self.in_flight if c.committed]
        saved = []
        for c in self.in_flight:
            if c.future is not None:
                shard = self.averager.own_shard(c.indices, wait(c.future))
            else:
                assert c.shard is not None
                shard = c.shard
            correction = shard.detach().cpu().clone()
            saved.append(
                {"indices": list(c.indices), "fragment": c.fragment, "apply_at": c.apply_at, "correction": correction}
            )
        out = {"averager": self.averager.state(), "in_flight": saved}
        if self.tally is not None:
            out["tally"] = self.tally.state()
        return out

    def load(
        self, averager_state: dict[str, Any], in_flight: list[dict[str, Any]], tally: dict[str, Any] | None = None
    ) -> None:
        """Restore :meth:`state`'s; ``tally``: the samples and pace decisions (None: start them afresh)."""
        self.due = None
        self.averager.load(averager_state)
        if self.tally is not None and tally is not None:
            self.tally.load(tally)
        self.in_flight = [
            Correction(
                tuple(c["indices"]),
                fragment=int(c["fragment"]),
                apply_at=int(c["apply_at"]),
                shard=c["correction"].to(torch.float32),
            )
            for c in in_flight
        ]


def _launch_due(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.launch_due(" (launched before the next forward)")
