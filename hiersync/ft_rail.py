"""The rail on torchft's Manager: quorums, windows and commits. Mechanism and policy of the manager mode.

In the manager mode (:func:`hiersync.register` with ``manager=``) each node is its own
torchrun job, a torchft *replica group*. Rank ``l`` of every replica group shares the
Manager's process group, so that group *is* rail ``l``; it is rebuilt by torchft whenever
nodes leave or join. hiersync's intra group is the node's own world.

A *window* is the cross-node work one quorum covers (docs/design.md, "Surviving a node
loss"): the start of training, one exact step, or one sync launch (the fragments that
sync after one step). Its life is

1. **open**: every window earlier than this one is decided first, then
   ``manager.start_quorum()`` agrees on the nodes that take part (a joiner is healed from a
   live peer inside it) and a one-value all-reduce on the rail holds every member until a
   joiner has its copy, so nobody changes the parameters it is downloading;
2. **collectives**: every rail all-reduce of the window goes through
   :meth:`ManagerComm.rail_allreduce`, which never fails its future: a failure (a peer
   killed or frozen, the group reconfigured) is recorded in the window and the result is
   garbage that nobody applies. So the node's own collectives stay in step whatever the
   rail does;
3. **decide**: once its collectives are done, the node votes with
   ``manager.should_commit()`` (all ranks of the node agree; a failure on any rank is a
   "no"). A window that does not commit is *dropped*: its corrections are never applied,
   its anchors and outer momentum go back to what they were, local progress is kept.

Windows are decided in the order they were opened, each exactly once, so every rank of a
node calls ``should_commit`` the same number of times in the same order, and torchft's
step (the number of committed windows) tells a node that missed a commit its peers made:
it is behind, and the next quorum heals it from a peer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .collectives import HierComm
from .futures import HierSyncError, completed, then, wait
from .stats import Stats
from .topology import Groups
from .vocab import Level

__all__ = ["import_torchft", "Marker", "Window", "ManagerComm", "Windows", "FTStats"]

logger = logging.getLogger(__name__)

INTER = Level.INTER


def import_torchft() -> Any:
    """torchft, or an ImportError that names the extra to install."""
    try:
        import torchft
    except ImportError as e:
        raise ImportError(
            "hiersync.register(..., manager=...) needs torchft: pip install 'hiersync[peers]' (or pip install torchft)"
        ) from e
    return torchft


@dataclass(frozen=True)
class Marker:
    """Where in the schedule a quorum is held; a joiner healed in it resumes exactly there.

    ``kind``: ``"start"`` (before the first step), ``"exact"`` (before exact step ``step``),
    ``"sync"`` (the launch of ``fragments``, which sync after step ``step``) or
    ``"synchronize"`` (:meth:`HierState.synchronize`).
    """

    kind: str
    step: int
    fragments: tuple[int, ...] = ()
    overlapped: bool = False
    """A sync applied later as a correction (else blocking)."""
    apply_at: int = 0
    """An overlapped sync's corrections apply after this many steps are done."""

    def describe(self) -> str:
        if self.kind == "sync":
            frags = "" if self.fragments == (0,) else f" of fragments {list(self.fragments)}"
            return f"the sync{frags} after step {self.step}"
        if self.kind == "exact":
            return f"exact step {self.step}"
        if self.kind == "synchronize":
            return f"synchronize() at step {self.step}"
        return "the start of training"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "step": self.step,
            "fragments": list(self.fragments),
            "overlapped": self.overlapped,
            "apply_at": self.apply_at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Marker:
        return cls(d["kind"], int(d["step"]), tuple(d["fragments"]), bool(d["overlapped"]), int(d["apply_at"]))


@dataclass(eq=False)
class Window:
    """The cross-node work of one quorum: what it launched, whether it failed, whether it committed."""

    index: int
    """Order of opening on this node (windows are decided in this order)."""
    marker: Marker
    quorum_id: int
    participants: int
    """Nodes in the quorum: the divisor of every average in this window."""
    error: str | None = None
    """The first failure of one of its rail collectives, if any."""
    committed: bool | None = None
    """None until decided."""
    futures: list[torch.futures.Future] = field(default_factory=list)
    """What must be complete before the vote (the corrections of an overlapped sync)."""
    backups: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    """(chunk state, anchor, momentum) as they were before this window: restored if it is dropped."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def kind(self) -> str:
        return self.marker.kind

    def fail(self, e: BaseException, what: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


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

    def _snapshot(self) -> dict:
        out = super()._snapshot()
        out.update(
            failed_syncs=self.failed_syncs,
            failed_exact_steps=self.failed_exact_steps,
            heals=self.heals,
            sync_participants=self.sync_participants,
            quorum_id=self.quorum_id,
        )
        return out

    def reset(self) -> None:
        fresh = FTStats()
        with self._lock:
            for name in self._snapshot():
                setattr(self, name, getattr(fresh, name))


class ManagerComm(HierComm):
    """:class:`~hiersync.collectives.HierComm` whose rail is the torchft Manager's process group.

    The node's groups (intra, intra_late) are those of a one-node topology over the node's
    world; every collective across nodes goes through :meth:`rail_allreduce` on the
    Manager's group, divided by the quorum's node count (:meth:`rail_nodes`).
    """

    def __init__(
        self,
        groups: Groups,
        manager: Any,
        stats: Stats,
        label: Callable[[], str] = lambda: "",
        intra_algorithm: str | None = None,
    ) -> None:
        super().__init__(groups, stats, label=label, intra_algorithm=intra_algorithm)
        self.manager = manager
        self.window: Window | None = None
        """The window whose collectives are being issued (set when it opens)."""

    def _phase(self, what: str) -> str:
        w = self.window
        where = f"rank {self.groups.rank} of this node, torchft quorum {w.quorum_id if w else '?'}"
        ctx = self.label()
        return f"{what} ({ctx}; {where})" if ctx else f"{what} ({where})"

    def rail_nodes(self) -> int:
        w = self.window
        assert w is not None, "a rail collective outside a window"
        return w.participants

    def rail_allreduce(self, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        """Sum ``tensor`` over the quorum on the Manager's group; the future never fails.

        A failure is recorded in the current window (which then does not commit) and the
        future completes with ``[tensor]`` holding whatever the collective left there.
        """
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        from .issuing import issue

        window = self.window
        assert window is not None, "a rail collective outside a window"
        # torchft has no public accessor for the process group a Manager reconfigures.
        pg = self.manager._pg
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs type it as RedOpType

        def allreduce(t: torch.Tensor, async_op: bool = True) -> Any:
            return pg.allreduce([t], opts)

        try:
            fut = issue(allreduce, tensor, what=what)
        except Exception as e:  # e.g. the group is gone: its reconfiguration failed in the quorum
            window.fail(e, what)
            return completed([tensor], tensor.device)

        def result(f: torch.futures.Future) -> list[torch.Tensor]:
            try:
                return wait(f)
            except Exception as e:
                window.fail(e, what)
                return [tensor]

        return then(fut, result, tensor.device, what)

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Exact steps: inside the node, then across the quorum on the rail, then back."""
        L = self.groups.node_size
        if L == 1:
            return self._flat(tensor, None, INTER, "exact all-reduce over the quorum", rail=True)
        return self._allreduce_two_level(tensor, L)

    def flat_allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        # One all-reduce over every rank of every node would need a group spanning replica
        # groups; torchft reconfigures one group per rail only.
        return self.allreduce(tensor)

    def average_across_nodes(self, flat: torch.Tensor) -> torch.futures.Future:
        raise RuntimeError(
            "internal: average_across_nodes is the pure hook's and uneven nodes' path; the manager mode averages "
            "each rank's shard with average_shard"
        )


class Windows:
    """Opens, decides and drops the windows of one rank (see the module docstring)."""

    def __init__(self, manager: Any, comm: ManagerComm, stats: FTStats, log: bool) -> None:
        self.manager = manager
        self.comm = comm
        self.stats = stats
        self.log = log  # this rank logs quorum changes (local rank 0 of each node)
        self.undecided: list[Window] = []
        self._count = 0
        self._members: list[int] | None = None

    # ------------------------------------------------------------- open
    def quorum(self, marker: Marker) -> None:
        """Decide every open window, then hold torchft's quorum for ``marker`` (may heal this node)."""
        self.settle()
        try:
            self.manager.start_quorum()
        except Exception as e:
            address = os.environ.get("TORCHFT_LIGHTHOUSE", "the lighthouse_addr= given to torchft.Manager")
            raise HierSyncError(
                f"hiersync: torchft could not form a quorum for {marker.describe()}: {type(e).__name__}: "
                f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}. Is the Lighthouse ({address}) running "
                "and reachable from every node, and does the Manager's quorum_timeout cover the slowest node's time "
                "between two syncs?"
            ) from e

    def open(self, marker: Marker, device: torch.device) -> Window:
        """The window of the quorum just held; its members wait for each other once on the rail."""
        manager = self.manager
        window = Window(
            index=self._count,
            marker=marker,
            quorum_id=int(getattr(manager, "_quorum_id", -1)),
            participants=max(1, int(manager.num_participants())),
        )
        self._count += 1
        self.undecided.append(window)
        self.comm.window = window
        self.stats.quorum_id = window.quorum_id
        self._log_members(window)
        # Holds every member until a joiner healed in this quorum has its copy (torchft serves
        # the live tensors of a CPU model until the next should_commit).
        one = torch.ones(1, device=device)
        wait(self.comm.rail_allreduce(one, "the rail barrier after the quorum"))
        return window

    def reuse(self, marker: Marker) -> Window:
        """A window for work that runs without a quorum of its own (an exact step whose
        ``optimizer.step()`` was skipped on every node): the last quorum's members."""
        last = self.comm.window
        window = Window(
            index=self._count,
            marker=marker,
            quorum_id=last.quorum_id if last else -1,
            participants=last.participants if last else 1,
        )
        self._count += 1
        self.undecided.append(window)
        self.comm.window = window
        return window

    def abandon(self, window: Window) -> None:
        """Forget a window that launched nothing but its barrier, without a vote (torchft's step stays)."""
        assert window is self.undecided[-1] and not window.futures and not window.backups
        self.undecided.remove(window)
        window.committed = False

    # ------------------------------------------------------------- decide
    def decide(self, window: Window) -> bool:
        """Vote on ``window`` (and every window opened before it): whether it committed."""
        while window.committed is None:
            self._vote(self.undecided[0])
        return bool(window.committed)

    def settle(self) -> None:
        """Decide every open window."""
        while self.undecided:
            self._vote(self.undecided[0])

    def _vote(self, window: Window) -> None:
        for fut in window.futures:
            wait(fut)  # rail legs never fail; a failure inside the node does, and ends this node
        window.futures = []
        manager = self.manager
        if window.error is not None:
            manager.report_error(RuntimeError(window.error))
        try:
            ok = bool(manager.should_commit())
        except Exception as e:
            raise HierSyncError(
                f"hiersync: torchft's should_commit for {window.marker.describe()} failed: {type(e).__name__}: {e} "
                "(a rank of this node is gone or stuck?)"
            ) from e
        window.committed = ok
        self.undecided.remove(window)
        if window.kind == "sync":
            self.stats.sync_participants = window.participants
        if ok:
            window.backups = []
            return
        for chunk, anchor, momentum in window.backups:
            chunk.anchor = _restored(chunk.anchor, anchor)
            chunk.momentum = _restored(chunk.momentum, momentum)
        window.backups = []
        if window.kind == "sync":
            self.stats.failed_syncs += 1
        elif window.kind == "exact":
            self.stats.failed_exact_steps += 1
        why = window.error or str(manager.errored() or "a peer voted no")
        logger.warning(
            "hiersync: %s did not commit (%s): %s; training goes on with the nodes that remain",
            window.marker.describe(),
            why,
            "its corrections are dropped, local progress is kept" if window.kind == "sync" else "its update is skipped",
        )

    # ------------------------------------------------------------- log
    def _log_members(self, window: Window) -> None:
        """Local rank 0 of each node logs the nodes that left and joined (from the replica ids' numbers)."""
        ranks = getattr(getattr(self.manager, "_pg", None), "_global_ranks", None)
        size = max(1, int(getattr(self.manager, "_group_world_size", 1)))
        members = sorted({int(r) // size for r in ranks}) if ranks else None
        before, self._members = self._members, members
        if not self.log or before == members:
            return
        if before is None or members is None:
            logger.info(
                "hiersync: torchft quorum %d for %s: %d nodes %s",
                window.quorum_id,
                window.marker.describe(),
                window.participants,
                members if members is not None else "",
            )
            return
        left = [n for n in before if n not in members]
        joined = [n for n in members if n not in before]
        logger.warning(
            "hiersync: torchft quorum %d for %s: %d nodes %s; left: %s; joined: %s",
            window.quorum_id,
            window.marker.describe(),
            window.participants,
            members,
            left or "-",
            joined or "-",
        )


def _restored(now: torch.Tensor | None, saved: torch.Tensor | None) -> torch.Tensor | None:
    if saved is None or now is None:
        return saved
    now.copy_(saved)  # the persistent (possibly pinned) buffer, reused
    return now
