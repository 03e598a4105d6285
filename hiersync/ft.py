"""Keep training when a node dies: the inter-node leg on torchft's fault-tolerant replica groups.

Each node is its own torchrun job, a torchft replica group with its own Manager; DDP runs
over the node's own world. hiersync's intra group is that world and its rails are the
Manager's process group (rank ``l`` of every replica group), which torchft rebuilds when
nodes leave or join. What the Lighthouse, the quorum, ``should_commit`` and the recovery
of a joiner from a live peer do is torchft's; hiersync maps its schedule onto them
(:mod:`hiersync.ft_rail`, docs/design.md "Surviving a node loss"):

* one quorum per *window*: the start, each exact step (before it; its gradients are
  averaged over the quorum), each sync launch (the fragments due after one step);
* a window commits or is dropped as a whole, on every rank of the node alike. A dropped
  sync keeps local progress: its corrections are never applied and its anchors and outer
  momentum are restored. A dropped exact step skips its update. Survivors never raise;
* a node that joins (a replacement, or the dead node restarted by its torchrun) is healed
  in its first quorum: it receives the parameters and optimizer state the user registered
  with the Manager and hiersync's state (step, anchors, outer momentum) from a live peer,
  and resumes at that peer's place in the schedule. The corrections its peer still has in
  flight belong to the peer's own parameters; the joiner holds the peer's parameters and
  its next sync of each fragment brings it to the common average. A node that asks for its
  first quorum after every other node of the run has stopped (the survivors finished) has
  nobody to heal from: it is alone in that quorum, trains from its own state, and says so.

Example::

    >>> manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1, use_async_quorum=False,
    ...                           load_state_dict=load_fn, state_dict=state_fn)
    >>> state = hiersync.register(DDP(model), opt, period=4, fragments=4, overlap=1, manager=manager)
    >>> while state.step < steps:   # a joiner resumes at its peers' step
    ...     loss = ddp(batch(state.step)).backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import state_io
from .config import HierConfig
from .ddp import HierState, hook
from .ddp_checks import unwrap_optimizer
from .ft_rail import FTStats, ManagerComm, Marker, Window, Windows, import_torchft
from .futures import HierSyncError
from .sync import Averager, Correction, CrossNodeSync, world_mean
from .topology import Topology, world_timeout
from .vocab import StepKind

__all__ = ["FaultTolerantState", "FaultTolerantSync", "register_with_manager", "STATE_KEY"]

logger = logging.getLogger(__name__)

EXACT = StepKind.EXACT
STATE_KEY = "hiersync"
"""The key hiersync's state is registered under with ``manager.register_state_dict_fn``."""
_PEER_FORMAT = "hiersync.peer/1"
_UNSUPPORTED_COMPRESS = ("int8", "int4")


@dataclass
class WindowCorrection(Correction):
    """A correction in flight and the window it belongs to (None: loaded, hence committed)."""

    window: Window | None = None


class FaultTolerantSync(CrossNodeSync):
    """The cross-node sync engine with one torchft quorum per sync launch and a commit per window.

    ``quorum(marker)`` holds the quorum of a sync launch and returns its window, or None
    when this node was healed into another place of the schedule (the front-end resumes
    there). Blocking syncs are decided right after their averages arrive; overlapped ones
    when their corrections are applied (or at the next quorum, whichever comes first).
    """

    def __init__(
        self,
        averager: Averager,
        schedule: Any,
        *,
        overlap: int,
        chunk_bytes: int,
        windows: Windows,
        quorum: Callable[[Marker], Window | None],
        model_positions: Callable[[], Sequence[int] | None] | None = None,
    ) -> None:
        super().__init__(averager, schedule, overlap=overlap, chunk_bytes=chunk_bytes, model_positions=model_positions)
        self.windows = windows
        self.quorum = quorum

    def after_step(self, steps_done: int) -> None:
        self._unhook()
        self.apply_corrections(steps_done)
        due, self.due = self.due, None
        if due is None:
            return
        step, fragments = due
        apply_at = step + 1 + self.overlap if self.overlap else 0
        with torch.no_grad(), record_function("hiersync/sync_after_step"):
            self._sync(Marker("sync", step, tuple(fragments), bool(self.overlap), apply_at))

    def launch_due(self, where: str = "") -> None:
        late = self._take_due(where)
        if late is not None:
            step, fragments = late
            with torch.no_grad(), record_function("hiersync/sync_launched_late"):
                self._sync(Marker("sync", step, tuple(fragments), True, step + 1 + max(self.overlap, 1)))

    def run_blocking(self, fragments: Sequence[int] = (0,)) -> None:
        raise RuntimeError("internal: in the manager mode every sync runs in a window (run_window)")

    def launch_overlapped(self, fragments: Sequence[int] = (0,), apply_at: int = 0) -> None:
        raise RuntimeError("internal: in the manager mode every sync runs in a window (run_window)")

    def _sync(self, marker: Marker) -> None:
        window = self.quorum(marker)
        if window is not None:
            self.run_window(window)

    @torch.no_grad()
    def run_window(self, window: Window) -> None:
        """Launch the sync ``window.marker`` names: blocking (decided now) or overlapped (in flight)."""
        m, avg = window.marker, self.averager
        for f in m.fragments:
            self._settle_fragment(f)
        chunks = self.chunks(m.fragments)
        for _, idx in chunks:
            c = avg.chunk(idx)  # type: ignore[attr-defined]  # a RailAverager's chunk state
            if c.anchor is not None or c.momentum is not None:
                window.backups.append((c, _copy(c.anchor), _copy(c.momentum)))
        if m.overlapped:
            for f, idx in chunks:
                future = avg.launch_correction(idx)
                window.futures.append(future)
                self.in_flight.append(WindowCorrection(idx, f, m.apply_at, future=future, window=window))
            return
        launched = [avg.launch(idx) for _, idx in chunks]
        targets = [avg.complete(job) for job in launched]  # garbage where the rail failed: never written
        if self.windows.decide(window):
            for job, target in zip(launched, targets):
                avg.write(job.indices, target)

    @torch.no_grad()
    def apply_corrections(self, steps_done: int | None = None, fragment: int | None = None) -> None:
        """Decide the windows of the corrections due, then add those that committed."""
        due = self._due_corrections(steps_done, fragment)
        for c in due:
            window = getattr(c, "window", None)
            if window is not None:
                self.windows.decide(window)
        self._apply(due, keep=_committed)  # a dropped window's corrections: local progress is kept

    def state(self) -> dict[str, Any]:
        """As the plain engine's, after deciding every window: only committed corrections are saved."""
        self.windows.settle()
        self.in_flight = [c for c in self.in_flight if _committed(c)]
        return super().state()


class FaultTolerantState(HierState):
    """The DDP front-end whose inter-node leg is a torchft Manager's process group.

    Build it with :func:`hiersync.register` (``manager=...``), which also attaches the
    optimizer and holds the first quorum. Options are those of :class:`HierState`, except
    ``compress="int8"/"int4"`` (their rail leg is not an all-reduce). ``stats`` also counts
    ``failed_syncs``, ``failed_exact_steps``, ``heals``, ``sync_participants`` and
    ``quorum_id`` (:class:`~hiersync.ft_rail.FTStats`).
    """

    def __init__(self, manager: Any, period: int = 1, warmup_steps: int = 0, **options: Any) -> None:
        import_torchft()
        _check_manager(manager)
        for name in ("process_group", "topology", "comm"):
            if options.get(name) is not None:
                raise ValueError(
                    f"hiersync.register(..., manager=...) builds its own groups: {name}= is not supported with a "
                    "manager (the intra group is this node's world, the rail is the manager's process group)"
                )
        if options.get("compress") in _UNSUPPORTED_COMPRESS:
            raise ValueError(
                f"compress={options['compress']!r} is not supported with manager=...: its rail leg is an all-to-all "
                "and an all-gather, and only the rail all-reduce runs on the torchft Manager's process group here; "
                "use compress='bf16' or 'fp16' with a manager"
            )
        if options.get("average_optimizer_state"):
            raise ValueError(
                f"average_optimizer_state={options['average_optimizer_state']!r} is not supported with manager=...: a "
                "dropped window restores the parameters' anchors only, and a joiner is healed with the optimizer "
                "state its peer registered with the Manager; leave average_optimizer_state unset with a manager"
            )
        cfg = HierConfig(period=period, warmup_steps=warmup_steps, **options)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "hiersync's manager mode needs this node's process group: call torch.distributed."
                "init_process_group() first (each node is its own torchrun job)"
            )
        world = dist.get_world_size()
        topology = Topology(nodes=(tuple(range(world)),), source="this node's world, a torchft replica group")
        groups = topology.build_groups(None, timeout=cfg.timeout or world_timeout())
        stats = FTStats()
        comm = ManagerComm(groups, manager, stats, label=lambda: self._label(), intra_algorithm=cfg.intra_algorithm)
        self.manager = manager
        self.windows = Windows(manager, comm, stats, log=groups.local_rank == 0)
        self._marker = Marker("start", 0)
        """Where this node's current quorum is held (what a peer healed in it resumes at)."""
        self._healed = False
        self._exact_window: Window | None = None
        super().__init__(period, warmup_steps, comm=comm, **options)
        if cfg.algorithm == "flat":
            logger.warning("hiersync: algorithm='flat' runs two-level with manager=... (no group spans the nodes)")
        try:
            manager.register_state_dict_fn(STATE_KEY, self._load_from_peer, self._state_for_peer)
        except AssertionError:
            raise ValueError(
                f"this torchft Manager already has a state registered under {STATE_KEY!r}: build one hiersync state "
                "per Manager"
            ) from None

    # ------------------------------------------------------------------ set-up
    def _check_layout(self) -> None:
        if self.rank == 0:
            logger.info(
                "hiersync: manager mode: %d ranks on this node, one rail per rank on the torchft Manager's group; %s",
                self.world_size,
                self.config,
            )

    def _use(self, averager: Averager) -> None:
        # The rail spans the quorum's nodes, which this node's one-node topology does not list:
        # split each chunk by local rank as on an even multi-node job.
        comm = self.comm
        averager.transfer = comm.average_shard  # type: ignore[attr-defined]
        if comm.groups.node_size > 1:
            averager.split, averager.index = comm.groups.node_size, comm.groups.local_rank  # type: ignore[attr-defined]
        cfg = self.config
        self.engine = FaultTolerantSync(
            averager,
            cfg.schedule,
            overlap=cfg.overlap,
            chunk_bytes=cfg.chunk_bytes,
            windows=self.windows,
            quorum=self._engine_quorum,
            model_positions=lambda: state_io.model_positions(self),
        )

    def join(self, start_nodes: int = 1) -> None:
        """The first quorum: start the job with the other nodes, or join it (healed from a live peer).

        A job that starts waits (up to the Manager's quorum timeout) until ``start_nodes``
        nodes are in its first quorum, so that they all start together; a node that joins a
        running job is healed at once whatever ``start_nodes`` says.
        """
        registered = getattr(self.manager, "_user_state_dicts", {})
        if self.rank == 0 and not set(registered) - {STATE_KEY}:
            logger.warning(
                "hiersync: the torchft Manager has no state_dict for the model and optimizer: a node that joins gets "
                "only hiersync's state; pass load_state_dict= and state_dict= to torchft.Manager"
            )
        first = Marker("exact", self.step) if self.schedule.kind(self.step) == EXACT else Marker("start", self.step)
        limit = getattr(self.manager, "_quorum_timeout", None)
        deadline = time.monotonic() + (limit.total_seconds() if limit is not None else 60.0)
        window = self._open(first)
        while window.marker == first and window.participants < start_nodes and time.monotonic() < deadline:
            # Not everyone is up yet: abandon this quorum (no collective but the barrier ran in
            # it, and no commit, so torchft's step stays where every starting node has it).
            self.windows.abandon(window)
            time.sleep(0.5)  # each quorum at step 0 may copy the first node's state to the others (init_sync)
            window = self._open(first)
        if window.marker == first and window.participants < start_nodes and self.rank == 0:
            logger.warning(
                "hiersync: starting with %d nodes, not the %d asked for (start_nodes): the others join when they come",
                window.participants,
                start_nodes,
            )
        if self.rank == 0 and self._left_behind(window):
            logger.warning(
                "hiersync: no live peer to heal from: this node's first torchft quorum (%d) holds this node alone, "
                "though the Lighthouse formed quorums with other nodes before, and those nodes are gone (finished or "
                "dead). If this node was restarted to rejoin their run, it did not: it trains from its own fresh "
                "state from step %d. A restarted node rejoins a run only while another node of the run still "
                "trains; a run whose nodes all stopped resumes from a checkpoint loaded before hiersync.register() "
                "(docs/fault-tolerance.md). The first node of a new job on a Lighthouse that served an earlier job "
                "can ignore this",
                window.quorum_id,
                self.step,
            )
        self._resume(window)

    def _left_behind(self, window: Window) -> bool:
        """Whether a fresh node's first quorum says that the run it restarts in has no live node left.

        The Lighthouse numbers its quorums from 1 and moves on only when the members change: a
        node alone and not healed in quorum 2 or later comes after other nodes that are all
        gone now. A run's first node (quorum 1) and a node healed from a live peer are not.
        """
        heals = self.stats.heals  # type: ignore[attr-defined]
        return window.participants == 1 and window.quorum_id > 1 and heals == 0 and self.step == 0

    # ------------------------------------------------------------------ quorums
    def _model_device(self) -> torch.device:
        model = self._model
        if model is not None:
            for p in model.parameters():
                return p.device
        return torch.device("cpu")

    def _open(self, marker: Marker) -> Window:
        """Hold the quorum for ``marker``; the window (the source's marker if this node was healed)."""
        self._marker = marker
        self._healed = False
        self.windows.quorum(marker)  # may call _load_from_peer
        if self.groups.node_size > 1:
            self._make_node_consistent()
        return self.windows.open(self._marker, self._model_device())

    def _engine_quorum(self, marker: Marker) -> Window | None:
        window = self._open(marker)
        if window.marker == marker:
            return window
        self._resume(window)  # healed into another place of the schedule
        return None

    def _resume(self, window: Window) -> None:
        """Carry on with what ``window`` was opened for (after a heal: what the peer was doing)."""
        kind = window.kind
        if kind == "sync":
            self.engine.run_window(window)  # type: ignore[attr-defined]
        elif kind == "exact":
            self._exact_window = window
        elif kind == "synchronize":
            self._average_all(window)
        else:
            self.windows.decide(window)

    @torch.no_grad()
    def _make_node_consistent(self) -> None:
        """torchft heals each rank from the peer its group rank maps to: give the node rank 0's copy."""
        device = self._model_device()
        flag = torch.tensor([1.0 if self._healed else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.intra)
        if flag.item() == 0:
            return
        src = self.topology.node_ranks(self.rank)[0]
        model, opt = self._model, self._optimizer
        if model is not None:
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=src, group=self.groups.intra)
        mine = [(opt.state_dict() if opt is not None else None, self.step, self._marker.as_dict())]
        box = mine if self.rank == src else [None]
        dist.broadcast_object_list(box, src=src, group=self.groups.intra, device=device)
        if self.rank != src:
            opt_state, step, marker = box[0]  # type: ignore[misc]
            if opt is not None and opt_state is not None:
                opt.load_state_dict(opt_state)
            self.step, self._stepped_for, self._marker = step, step, Marker.from_dict(marker)

    # ------------------------------------------------------------------ torchft state
    def _state_for_peer(self) -> dict[str, Any]:
        """What a joiner receives from this rank (called in torchft's quorum thread)."""
        if self._closed:
            raise RuntimeError("this hiersync state is closed: it cannot heal a peer")
        assert not self.windows.undecided, "every window is decided before a quorum"
        saved = state_io.save(self)  # launches nothing: no sync is due and every window is decided
        saved["in_flight"] = []  # corrections of syncs launched before the joiner joined are this node's own
        return {"format": _PEER_FORMAT, "marker": self._marker.as_dict(), "state": saved}

    def _load_from_peer(self, peer: dict[str, Any]) -> None:
        """Become a copy of a live peer's hiersync state (called by torchft while healing this node)."""
        if not isinstance(peer, dict) or peer.get("format") != _PEER_FORMAT:
            raise HierSyncError(
                f"hiersync: the state received from a live peer is not a {_PEER_FORMAT!r} state: do all nodes run "
                "the same hiersync version?"
            )
        self.engine.in_flight = []  # they belonged to the parameters torchft just replaced
        try:
            state_io.load(self, peer["state"])
        except ValueError as e:
            raise HierSyncError(f"hiersync: cannot take the state of a live peer: {e}") from e
        self._marker = Marker.from_dict(peer["marker"])
        self._exact_window = None
        self._healed = True
        self.stats.heals += 1  # type: ignore[attr-defined]
        if self.step == 0:  # torchft's init_sync heals every node but the first at the start
            logger.info("hiersync: rank %d was recovered from a live peer at the start of training", self.rank)
            return
        logger.warning(
            "hiersync: rank %d was recovered from a live peer; it resumes at %s, with state.step = %d: drive the "
            "training loop by the step (while state.step < steps), as a loop over range(steps) would train %d "
            "steps past its peers",
            self.rank,
            self._marker.describe(),
            self.step,
            self.step,
        )

    # ------------------------------------------------------------------ the step
    def _begin_step(self) -> StepKind:
        kind = super()._begin_step()
        w = self._exact_window
        if kind == EXACT and (w is None or w.marker.step != self.step):
            # optimizer.step() was skipped on every node (the same averaged gradients): no quorum ran
            self._exact_window = self.windows.reuse(Marker("exact", self.step))
        return kind

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        super()._before_optimizer_step(optimizer, args, kwargs)
        w = self._exact_window
        if w is not None and w.marker.step == self.step - 1 and self._stepped_for != self.step:
            self._exact_window = None
            if not self.windows.decide(w):
                self.guard.drop_grads(optimizer)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._stepped_for == self.step:
            return
        super()._after_optimizer_step(optimizer, args, kwargs)
        if self.schedule.kind(self.step) == EXACT and not self._closed:
            self._resume(self._open(Marker("exact", self.step)))

    # ------------------------------------------------------------------ public
    def synchronize(self, model: torch.nn.Module) -> None:
        """Blocking: average parameters and floating buffers over the quorum (one window). Collective.

        If the window does not commit (a node died meanwhile) the parameters stay as they were
        and a warning says so.
        """
        if self._model is None:
            self._model = model
        self.drain()
        self._resume(self._open(Marker("synchronize", self.step)))

    @torch.no_grad()
    def _average_all(self, window: Window) -> None:
        model = self._model
        assert model is not None
        tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
        copies = [t.detach().clone() for t in tensors]
        with record_function("hiersync/synchronize"):
            world_mean(self.comm, copies, self.config.chunk_bytes)
        if self.windows.decide(window):
            for t, c in zip(tensors, copies):
                t.copy_(c)


def register_with_manager(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    manager: Any,
    start_nodes: int = 1,
    **options: Any,
) -> FaultTolerantState:
    """:func:`hiersync.register` with ``manager=``: build, hook, attach, and hold the first quorum.

    ``start_nodes``: a starting job waits until that many nodes are in its first quorum
    (:meth:`FaultTolerantState.join`).
    """
    if isinstance(start_nodes, bool) or not isinstance(start_nodes, int) or start_nodes < 1:
        raise ValueError(f"start_nodes={start_nodes!r} must be an int >= 1 (the nodes a starting job waits for)")
    if optimizer is None:
        raise TypeError(
            "hiersync.register(ddp_model, optimizer, manager=...) needs the optimizer: a window's commit decides "
            "whether optimizer.step() applies on exact steps, and syncs run after it"
        )
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"hiersync.register(..., manager=...) needs a DistributedDataParallel model over this node's world, got "
            f"{type(model).__name__}"
        )
    state = FaultTolerantState(manager, **options)
    state._model = model
    model.register_comm_hook(state, hook)
    state.attach_optimizer(unwrap_optimizer(optimizer))
    state.join(start_nodes)
    return state


def _check_manager(manager: Any) -> None:
    for name in ("start_quorum", "should_commit", "register_state_dict_fn", "num_participants"):
        if not callable(getattr(manager, name, None)):
            raise TypeError(f"manager= must be a torchft.Manager, got {type(manager).__name__} (no {name}())")
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "hiersync needs a synchronous quorum: build torchft.Manager(..., use_async_quorum=False) (as torchft's "
            "own DiLoCo requires): a window's members must be known before its averages are launched"
        )


def _committed(c: Correction) -> bool:
    window = getattr(c, "window", None)
    return window is None or bool(window.committed)


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def lighthouse_address() -> str:
    """The Lighthouse this process points its Manager to by default (``TORCHFT_LIGHTHOUSE``)."""
    return os.environ.get("TORCHFT_LIGHTHOUSE", "")
