"""Keep training when a node dies: either front-end, with its rail on torchft's replica groups.

Each node is its own torchrun job, a torchft replica group with its own Manager; DDP or
FSDP2 (``fully_shard`` over :func:`hiersync.node_mesh`) runs over the node's own world.
hiersync's intra group is that world and its rail is a :class:`~hiersync.transport.TorchftRail`
on the Manager's process group (rank ``l`` of every replica group), which torchft rebuilds
when nodes leave or join. The engine, the averagers and the codecs are those of the plain
mode; what the Lighthouse, the quorum, ``should_commit`` and the recovery of a joiner from a
live peer do is torchft's. hiersync maps its schedule onto them (docs/design.md, "Surviving a
node loss"):

* one quorum per *window*: the start, each exact step (before it; its gradients are
  averaged over the quorum), each sync launch (the fragments due after one step),
  ``synchronize()``;
* a member that does not answer within ``heartbeat_timeout`` (the Lighthouse's) while the
  window finds out who is alive (torchft's configuration of the quorum's group, a heal's
  first contact, the barrier) drops the window: a node that died just before a quorum costs
  its peers that bound, not the Manager's timeout, which stays the bound of the window's data;
* a window commits or is dropped as a whole, on every rank of the node alike. A dropped
  sync keeps local progress: its corrections are never applied and the state it changed
  (anchors, outer momentum, error-feedback residuals) is restored. A dropped exact step
  skips its update. Survivors never raise;
* a node that joins (a replacement, or the dead node restarted by its torchrun) is healed
  in its first quorum: it receives the parameters and optimizer state the user registered
  with the Manager and hiersync's state (step, anchors, outer momentum) from a live peer
  (on a sharded node, each rank from the peer rank that holds the same shard), and
  resumes at that peer's place in the schedule. In the window it was healed in it brings
  no state of its own: it sends zeros, every average of that window is divided by the
  nodes that were not healed in it (the survivors' result is their own average), and it
  receives that average like them. Its error-feedback residuals start at zero (the peer's
  are the peer's debt). The corrections its peer still has in flight belong to the peer's
  own parameters; the joiner holds the peer's parameters and its next sync of each
  fragment brings it to the common average. A node that asks for its
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
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from . import ftcompat, state_io
from .collectives import HierComm
from .config import HierConfig
from .ddp import HierState, hook
from .ddp_checks import unwrap_optimizer
from .frontend import SyncState
from .fsdp import FSDPState, is_fsdp2
from .futures import HierSyncError
from .stats import Stats
from .tally import Tally
from .topology import Topology, world_timeout
from .transport import HEARTBEAT_TIMEOUT_S, Marker, TorchftRail, Window, import_torchft
from .vocab import StepKind

__all__ = ["FTStats", "FaultTolerantState", "FaultTolerantFSDPState", "register_with_manager", "STATE_KEY"]

logger = logging.getLogger(__name__)

EXACT = StepKind.EXACT
STATE_KEY = "hiersync"
"""The key hiersync's state is registered under with ``manager.register_state_dict_fn``."""
_PEER_FORMAT = "hiersync.peer/1"


@dataclass
class FTStats(Stats):
    """:class:`~hiersync.stats.Stats` plus what the manager mode counts."""

    failed_syncs: int = 0
    """Sync windows this node dropped (a failed collective or a False ``should_commit``)."""
    failed_exact_steps: int = 0
    """Exact steps whose update this node skipped because their window did not commit."""
    heals: int = 0
    """Times this node was recovered from a live peer (a joiner, or a node that missed a commit)."""
    sync_participants: int = 0
    """Nodes that took part in the last sync window."""
    quorum_id: int = -1
    """torchft's id of the last quorum (it changes when nodes leave or join)."""

    def count_vote(self, window: Window) -> None:
        if window.kind == "sync":
            self.sync_participants = window.participants
        if not window.committed and window.kind in ("sync", "exact"):
            self.failed_syncs += window.kind == "sync"
            self.failed_exact_steps += window.kind == "exact"


class ManagerMode(SyncState):
    """The manager mode of a front-end: quorums, heals and the windows of exact steps and
    ``synchronize()``. Mixed into :class:`FaultTolerantState` (DDP) and
    :class:`FaultTolerantFSDPState` (FSDP2); built by :func:`register_with_manager`."""

    rail: TorchftRail
    manager: Any
    _REPLICATED = True
    """Whether the node's ranks hold the same parameters (DDP) or their own shards (FSDP2)."""

    def _bind(self, manager: Any, rail: TorchftRail) -> None:
        self.manager, self.rail = manager, rail
        self.comm.label = self._label
        rail.on_vote = self.stats.count_vote  # type: ignore[attr-defined]
        self._marker = Marker("start", 0)
        """Where this node's current quorum is held (what a peer healed in it resumes at)."""
        self._healed = False
        self._exact_window: Window | None = None
        self.engine.open_window = self._engine_quorum
        if self.config.period > 1:  # samples and step times, carried by each window's barrier
            intra = self.groups.intra if self.groups.node_size > 1 else None
            self.tally = Tally(
                self.topology,
                self.rank,
                None,
                intra,
                self.stats,
                period=self.config.period,
                fragments=self.config.fragments,
                windows=self.windows,
            )
            self.engine.tally = self.tally
        if self.config.algorithm == "flat":
            logger.warning("hiersync: algorithm='flat' runs two-level with manager=... (no group spans the nodes)")
        try:
            manager.register_state_dict_fn(STATE_KEY, self._load_from_peer, self._state_for_peer)
        except AssertionError:
            raise ValueError(
                f"this torchft Manager already has a state registered under {STATE_KEY!r}: build one hiersync state "
                "per Manager"
            ) from None

    def _check_layout(self) -> None:
        if self.rank == 0:
            logger.info(
                "hiersync: manager mode: %d ranks on this node, one rail per rank on the torchft Manager's group; %s",
                self.world_size,
                self.config,
            )

    def join(self, start_nodes: int = 1) -> None:
        """The first quorum: start the job with the other nodes, or join it (healed from a live peer).

        A job that starts waits (up to the Manager's quorum timeout) until ``start_nodes``
        nodes are in its first quorum, so that they all start together; a node that joins a
        running job is healed at once whatever ``start_nodes`` says.
        """
        registered = ftcompat.registered_states(self.manager)
        if self.rank == 0 and not set(registered) - {STATE_KEY}:
            logger.warning(
                "hiersync: the torchft Manager has no state_dict for the model and optimizer: a node that joins gets "
                "only hiersync's state; pass load_state_dict= and state_dict= to torchft.Manager"
            )
        first = Marker("exact", self.step) if self.schedule.kind(self.step) == EXACT else Marker("start", self.step)
        deadline = time.monotonic() + ftcompat.quorum_timeout(self.manager).total_seconds()
        window = self._open(first)
        while window.marker == first and window.participants < start_nodes and time.monotonic() < deadline:
            # Not everyone is up yet: abandon this quorum (no collective but the barrier ran in
            # it, and no commit, so torchft's step stays where every starting node has it).
            self.rail.abandon(window)
            time.sleep(0.5)  # each quorum at step 0 may copy the first node's state to the others (init_sync)
            window = self._open(first)
        if window.marker == first and window.participants < start_nodes and self.rank == 0:
            logger.warning(
                "hiersync: starting with %d nodes, not the %d asked for (start_nodes): the others join when they come",
                window.participants,
                start_nodes,
            )
        # The Lighthouse numbers its quorums from 1 and moves on only when the members change: a
        # fresh node alone and not healed in quorum 2 or later comes after nodes that are all gone.
        alone = window.participants == 1 and window.quorum_id > 1 and self.step == 0
        if self.rank == 0 and alone and not self.stats.heals:  # type: ignore[attr-defined]
            logger.warning(
                "hiersync: no live peer to heal from: this node's first torchft quorum (%d) holds it alone, though the "
                "Lighthouse formed quorums with other nodes before, now gone (finished or dead). If this node was "
                "restarted to rejoin their run, it did not: it trains from its own fresh state from step %d. A "
                "restarted node rejoins only while another node still trains; a run whose nodes all stopped resumes "
                "from a checkpoint (docs/fault-tolerance.md). The first node of a new job on a Lighthouse that served "
                "an earlier job can ignore this",
                window.quorum_id,
                self.step,
            )
        self._resume(window)

    # ------------------------------------------------------------------ quorums
    def _model_device(self) -> torch.device:
        params = self.registry.params or (list(self._model.parameters()) if self._model is not None else [])
        return params[0].device if params else torch.device("cpu")

    def _open(self, marker: Marker) -> Window:
        """Hold the quorum for ``marker``; the window (the source's marker if this node was healed)."""
        self._marker = marker
        self._healed = False
        self.rail.quorum(marker)  # may call _load_from_peer
        if self.groups.node_size > 1:
            self._make_node_consistent()
        # A node healed here holds a copy of a peer: in a window that averages state it adds nothing
        # (the survivors' result is their own average). An exact step's gradients are computed after
        # the heal, on the common parameters: they count, as a new replica's would in DDP.
        contributes = not self._healed or self._marker.kind == "exact"
        m, device = self._marker, self._model_device()
        place: int | None = None
        extra: list[float] = []
        if self.tally is not None and m.kind in ("sync", "synchronize"):
            frags, at = (m.fragments, m.step) if m.kind == "sync" else ((self.config.fragments - 1,), -1)
            extra = self.tally.row(frags, device, at)
        elif self.tally is not None:  # the start, an exact step: nothing weighed, no step time read
            extra = [0.0] * (self.config.fragments + 1)
        if self.windows is not None and m.kind == "sync":  # nodes' steps differ: a sync's place is its window's
            place = self.windows.window * self.config.fragments + m.fragments[0]
        window = self.rail.open(m, device, contributes, place, extra)
        self.stats.quorum_id = window.quorum_id  # type: ignore[attr-defined]
        return window

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
            self.engine.run_window(window)
        elif kind == "exact":
            self._exact_window = window
        elif kind == "synchronize":
            self._average_model(self._model, window)
        else:
            self.rail.decide(window)

    @torch.no_grad()
    def _make_node_consistent(self) -> None:
        """torchft heals each rank from the peer its group rank maps to: one copy for the node.

        A node of replicas takes rank 0's parameters, buffers and optimizer state; on a sharded
        node each rank keeps the shard its peer rank sent. Every rank takes rank 0's step. A
        heal past the start that reached some ranks of the node and not others (a source that
        died while it sent) leaves no consistent copy to train on: the node raises, and its
        torchrun starts it again, to be healed whole.
        """
        device = self._model_device()
        healed = 1.0 if self._healed else 0.0
        flag = torch.tensor([healed, -healed, float(self.step)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.intra)
        any_healed, minus_all_healed, last_step = flag.tolist()  # one host read
        if any_healed == 0:
            return
        # Some rank not healed, past the start (torchft's init_sync may copy only some ranks' initial
        # state at step 0, which rank 0's broadcast below settles for a node of replicas).
        if minus_all_healed != -1 and last_step > 0:
            raise HierSyncError(
                f"hiersync: node heal failed: torchft healed some ranks of this node from a live peer and not others "
                f"(rank {self.rank} {'was' if self._healed else 'was not'}; a heal source that died while it sent?), "
                "so its ranks hold different copies of the run. This node stops here; start it again (its torchrun "
                "does, with --max-restarts) and it is healed whole from a live peer"
            )
        self._healed = True  # the whole node is a copy now
        src = self.topology.node_ranks(self.rank)[0]
        model, opt = self._model, self._optimizer if self._REPLICATED else None
        if model is not None and self._REPLICATED:
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
        assert not self.rail.undecided, "every window is decided before a quorum"
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
            state_io.load(self, _without_residuals(peer["state"]))
        except ValueError as e:
            raise HierSyncError(f"hiersync: cannot take the state of a live peer: {e}") from e
        self._marker = Marker.from_dict(peer["marker"])
        self._exact_window = None
        self._healed = True
        self.stats.heals += 1  # type: ignore[attr-defined]
        if self.step == 0:  # torchft's init_sync heals every node but the first at the start
            logger.info("hiersync: rank %d was recovered from a live peer at the start of training", self.rank)
            return
        if self.windows is not None:  # adaptive pace: each node's step is its own; the window is common
            logger.warning(
                "hiersync: rank %d was recovered from a live peer; it resumes at %s, with state.window = %d (and "
                "its peer's state.step = %d): drive the training loop by the window (while state.window < windows), "
                "as nodes' steps differ under pace='adaptive'",
                self.rank,
                self._marker.describe(),
                self.window,
                self.step,
            )
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
            self._exact_window = self.rail.reuse(Marker("exact", self.step))
        return kind

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        super()._before_optimizer_step(optimizer, args, kwargs)
        w = self._exact_window
        if w is not None and w.marker.step == self.step - 1 and self._stepped_for != self.step:
            self._exact_window = None
            if not self.rail.decide(w):
                self.guard.drop_grads(optimizer)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._stepped_for == self.step:
            return
        super()._after_optimizer_step(optimizer, args, kwargs)
        if self.schedule.kind(self.step) == EXACT and not self._closed:
            self._resume(self._open(Marker("exact", self.step)))

    # ------------------------------------------------------------------ public
    def close(self) -> None:
        """Decide the windows still open and take hiersync's state off the Manager (which
        can serve another hiersync state then), then close as the front-end does."""
        if not self._closed:
            self.rail.settle()  # every node votes as often as the others: torchft's step stays in lockstep
            ftcompat.unregister_state(self.manager, STATE_KEY)
        super().close()

    def _close_at_exit(self) -> None:
        """Left to the job: settling the windows at exit could wait on a quorum of a Manager
        already shut down."""

    def synchronize(self, model: torch.nn.Module | None = None) -> None:
        """:meth:`SyncState.synchronize` over the quorum, in one window: if it does not commit (a
        node died meanwhile) the parameters stay as they were, and a warning says so."""
        if self._model is None:
            self._model = model
        self.drain()
        self._resume(self._open(Marker("synchronize", self.step)))


class FaultTolerantState(ManagerMode, HierState):
    """The DDP front-end whose rail is a torchft Manager's process group (:func:`register_with_manager`).

    ``stats`` also counts ``failed_syncs``, ``failed_exact_steps``, ``heals``,
    ``sync_participants`` and ``quorum_id`` (:class:`FTStats`).
    """


class FaultTolerantFSDPState(ManagerMode, FSDPState):
    """The FSDP2 front-end whose rail is a torchft Manager's process group (:func:`register_with_manager`)."""

    _REPLICATED = False


def _manager_comm(
    manager: Any, options: dict[str, Any], heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S
) -> tuple[HierComm, TorchftRail]:
    """The node's groups (a one-node topology over its world) and a rail on ``manager``'s group."""
    import_torchft()
    _check_manager(manager)
    ftcompat.check(manager)
    for name in ("process_group", "topology", "comm"):
        if options.get(name) is not None:
            raise ValueError(
                f"hiersync.register(..., manager=...) builds its own groups: {name}= is not supported with a "
                "manager (the intra group is this node's world, the rail is the manager's process group)"
            )
    cfg = HierConfig(**options)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "hiersync's manager mode needs this node's process group: call torch.distributed."
            "init_process_group() first (each node is its own torchrun job)"
        )
    topology = Topology(nodes=(tuple(range(dist.get_world_size())),), source="this node's world, a replica group")
    groups = topology.build_groups(None, timeout=cfg.timeout or world_timeout())
    rail = TorchftRail(manager, log=groups.local_rank == 0, contact=timedelta(seconds=heartbeat_timeout))
    return HierComm(groups, FTStats(), intra_algorithm=cfg.intra_algorithm, rail=rail), rail


def register_with_manager(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    manager: Any,
    start_nodes: int = 1,
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
    **options: Any,
) -> ManagerMode:
    """:func:`hiersync.register` with ``manager=``: build, hook, attach, and hold the first quorum.

    ``model``: DDP over this node's world, or an FSDP2 module sharded over
    :func:`hiersync.node_mesh`. ``start_nodes``: a starting job waits until that many nodes
    are in its first quorum (:meth:`ManagerMode.join`). ``heartbeat_timeout``: the
    Lighthouse's (``--heartbeat_timeout_ms`` / 1000, seconds; torchft's default 5): a quorum
    member that has not answered within it (its group's rendezvous, a heal's first contact, the
    barrier that opens a window) is taken for dead and the window is dropped, instead of
    waiting for the Manager's timeout, which stays the bound of the window's data.
    """
    if isinstance(start_nodes, bool) or not isinstance(start_nodes, int) or start_nodes < 1:
        raise ValueError(f"start_nodes={start_nodes!r} must be an int >= 1 (the nodes a starting job waits for)")
    if isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, int | float) or heartbeat_timeout <= 0:
        raise ValueError(
            f"heartbeat_timeout={heartbeat_timeout!r} must be a number of seconds > 0: the Lighthouse's "
            "--heartbeat_timeout_ms divided by 1000 (torchft's default is 5)"
        )
    if optimizer is None:
        raise TypeError(
            "hiersync.register(model, optimizer, manager=...) needs the optimizer: a window's commit decides "
            "whether optimizer.step() applies on exact steps, and syncs run after it"
        )
    if options.get("rack_period") is not None:
        raise ValueError(
            f"rack_period={options['rack_period']} does not combine with manager= in this version: torchft's replica "
            "groups form one level across nodes; drop rack_period (or the manager)"
        )
    fsdp = is_fsdp2(model)
    if not fsdp and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "hiersync.register(..., manager=...) needs a DistributedDataParallel model over this node's world or an "
            f"FSDP2 module (fully_shard over hiersync.node_mesh()), got {type(model).__name__}"
        )
    comm, rail = _manager_comm(manager, options, float(heartbeat_timeout))
    optimizer = unwrap_optimizer(optimizer)
    state: ManagerMode
    if fsdp:
        state = FaultTolerantFSDPState(model, optimizer, comm=comm, **options)
    else:
        state = FaultTolerantState(comm=comm, **options)
        state._model = model
        cast(Any, model).register_comm_hook(state, hook)
        state.attach_optimizer(optimizer)
    state._bind(manager, rail)
    state.join(start_nodes)
    return state


def _without_residuals(saved: Any) -> Any:
    """``saved`` with every error-feedback residual left out: what a peer's codes still owe is the
    peer's own debt, which a copy of it must not send a second time (the copy starts at zero)."""
    if isinstance(saved, dict):
        return {k: None if k in ("residual", "reduced_residual") else _without_residuals(v) for k, v in saved.items()}
    if isinstance(saved, list):
        return [_without_residuals(v) for v in saved]
    return saved


def _check_manager(manager: Any) -> None:
    for name in ("start_quorum", "should_commit", "register_state_dict_fn", "num_participants"):
        if not callable(getattr(manager, name, None)):
            raise TypeError(f"manager= must be a torchft.Manager, got {type(manager).__name__} (no {name}())")
    if ftcompat.async_quorum(manager):
        raise ValueError(
            "hiersync needs a synchronous quorum: build torchft.Manager(..., use_async_quorum=False) (as torchft's "
            "own DiLoCo requires): a window's members must be known before its averages are launched"
        )
