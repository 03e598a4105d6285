"""The cross-node leg: one interface, two implementations (the process-group rail, torchft's).

Every collective that crosses nodes runs on this rank's *rail* (the ranks with its local
rank on every node) and goes through a :class:`Transport`: an all-reduce, an all-to-all and
an all-gather of a rail piece, and the *window* the collectives belong to. A window is the
cross-node work of one agreement on who takes part: the start of training, one exact step,
one sync launch (the fragments due after one step), ``synchronize()``. It commits or is
dropped as a whole; a dropped window leaves parameters, anchors, momentum, residuals and
optimizer state as if it had never been launched (the engine restores what it backed up).

* :class:`GroupRail` is a ``torch.distributed`` group over the rail: its windows always
  commit, nothing is voted, nothing is backed up.
* :class:`TorchftRail` is the process group of a ``torchft.Manager``, rebuilt by torchft when
  nodes leave or join: each window holds a quorum (a joiner is healed inside it, and then
  sends zeros in that window, whose averages divide by the nodes that contribute), its
  collectives never fail their futures (a failure is recorded in the window, whose results
  nobody applies), and the node votes with ``should_commit``. Windows are decided in the
  order they were opened, each once, on every rank of the node alike, so torchft's step
  (committed windows) tells a node that missed a commit that it is behind.

Every codec, averager and schedule runs over either (tests/test_matrix.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import ftcompat
from .futures import HierSyncError, all_gather, completed, issue, then, wait

__all__ = ["Marker", "Window", "Transport", "GroupRail", "TorchftRail", "stale_step", "import_torchft"]

logger = logging.getLogger(__name__)

QUORUM_ATTEMPT_S = 10.0
"""The longest one request for a torchft quorum waits before it is asked again (within the
Manager's ``quorum_timeout``)."""
HEARTBEAT_TIMEOUT_S = 5.0
"""The Lighthouse's heartbeat timeout hiersync assumes when not told (torchft's default,
``torchft_lighthouse --heartbeat_timeout_ms 5000``): the *contact* bound of a window."""


def import_torchft() -> Any:
    """torchft, or an ImportError that names the extra to install."""
    try:
        import torchft
    except ImportError as e:
        msg = (
            "hiersync.register(..., manager=...) needs torchft: pip install 'hiersync[peers]' (or pip install torchft)"
        )
        raise ImportError(msg) from e
    return torchft


@dataclass(frozen=True)
class Marker:
    """Where in the schedule a window is opened; a joiner healed in it resumes exactly there.

    ``kind``: ``"start"`` (before the first step), ``"exact"`` (before exact step ``step``),
    ``"sync"`` (the launch of ``fragments``, which sync after step ``step``) or
    ``"synchronize"`` (``state.synchronize(model)``).
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
    """The cross-node work of one agreement: what it launched, whether it failed, whether it committed."""

    index: int
    """Order of opening on this rank (windows are decided in this order)."""
    marker: Marker
    quorum_id: int
    participants: int
    """Nodes taking part: the size of every rail collective in this window."""
    contributors: int = 0
    """Nodes that bring their own state: the divisor of every average in this window (a node
    healed in the window's quorum sends zeros and receives the others' average)."""
    contributes: bool = True
    """Whether this node's values enter the window's averages."""
    error: str | None = None
    """The first failure of one of its rail collectives, if any."""
    stale: str | None = None
    """Why this node may not go on with its own state (it opened a sync at another step than most
    of its peers): once the window is decided (this node voted no with the others), it counts one
    commit fewer, so that its next quorum heals it from a peer."""
    committed: bool | None = None
    """None until decided."""
    rows: list[list[float]] = field(default_factory=list)
    """Every member's row of the barrier that opened the window, in torchft's order of the quorum:
    ``[contributes, place, *extra]`` (:meth:`TorchftRail.open`; empty where the barrier failed)."""
    rank: int = 0
    """This node's row in :attr:`rows` (its place in torchft's quorum)."""
    futures: list[torch.futures.Future] = field(default_factory=list)
    """What must be complete before the vote (the corrections of an overlapped sync)."""
    restore: list[Callable[[], None]] = field(default_factory=list)
    """What puts the state a dropped window changed back (the engine's backups)."""
    dropping: threading.Thread | None = None
    """Drops the group of a failed window (:class:`TorchftRail`): its peers learn at once."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def kind(self) -> str:
        return self.marker.kind

    def fail(self, e: BaseException, what: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class Transport(Protocol):
    """What the collectives (:class:`~hiersync.collectives.HierComm`) and the engine ask of the rail."""

    droppable: bool
    """Whether a window can be dropped (then the engine backs up what a window changes)."""
    across_nodes: bool
    """Whether the rail joins other nodes (False: a one-node job; nothing to average)."""
    world_group: Any
    """A group over every rank of every node, for a flat all-reduce; None where there is none."""

    def nodes(self) -> int:
        """Nodes taking part in the current window's collectives."""
        ...

    def contributors(self) -> int:
        """Nodes whose values the current window's averages are taken over (their divisor)."""
        ...

    def contributes(self) -> bool:
        """Whether this node's values enter the current window's averages (else it sends zeros)."""
        ...

    def describe(self, ranks: list[int]) -> str:
        """Where this rank's rail collectives run, for errors (``ranks``: the rail's global ranks)."""
        ...

    def allreduce(self, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        """Sum ``tensor`` in place over the rail; the future's value is ``[tensor]``."""
        ...

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        """Piece ``j`` of ``tensor`` to rail rank ``j``, piece ``j`` of ``out`` from it."""
        ...

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        """Every rail rank's ``tensor`` into ``out``, in rail order."""
        ...

    def open(self, marker: Marker, device: torch.device) -> Window:
        """Agree on who takes part in the work ``marker`` names; that work's window."""
        ...

    def decide(self, window: Window) -> bool:
        """Commit or drop ``window`` (and every window opened before it); whether it committed."""
        ...

    def settle(self) -> None:
        """Decide every open window."""
        ...


class GroupRail:
    """The rail as a ``torch.distributed`` group: windows always commit."""

    droppable = False

    def __init__(self, group: dist.ProcessGroup | None, nodes: int) -> None:
        self.group = group
        self._nodes = nodes
        self.across_nodes = nodes > 1
        self.world_group = dist.group.WORLD
        self._count = 0

    def nodes(self) -> int:
        return self._nodes

    def contributors(self) -> int:
        return self._nodes

    def contributes(self) -> bool:
        return True

    def describe(self, ranks: list[int]) -> str:
        return f"rail ranks {ranks}"

    def allreduce(self, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        return issue(dist.all_reduce, tensor, group=self.group, what=what)

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        return issue(dist.all_to_all_single, out, tensor, group=self.group, what=what)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        return issue(all_gather, out, tensor, group=self.group, what=what)

    def open(self, marker: Marker, device: torch.device) -> Window:
        self._count += 1
        return Window(self._count - 1, marker, -1, self._nodes, self._nodes, committed=True)

    def decide(self, window: Window) -> bool:
        return True

    def settle(self) -> None:
        return None


def stale_step(mine: int, steps: Sequence[int], unit: str = "step") -> tuple[str, bool] | None:
    """Whether the contributors of one sync window opened it at the same step (``None``: they did).

    Otherwise the window is dropped and the step most of them are at goes on (a tie: the later
    step): ``(why, stale)``, ``stale`` on a node at another step, which must not go on with its
    state (it is a period or more away from the others). ``unit``: what the numbers count
    (adaptive pace compares each sync's place among the windows, ``window * fragments + fragment``).
    """
    counts = Counter(steps)
    if len(counts) <= 1:
        return None
    keep = max(counts, key=lambda s: (counts[s], s))
    seen = ", ".join(f"{n} at {unit} {s}" for s, n in sorted(counts.items()))
    at = (lambda s: f"after step {s}") if unit == "step" else (lambda s: f"at {unit} {s}")
    if mine != keep:
        why = (
            f"this node opened the sync {at(mine)} while its peers opened theirs {at(keep)} "
            f"(contributors: {seen}): it fell a period or more behind (a rail timeout its peers did not wait out?)"
        )
        return why, True
    return f"the sync {at(mine)} was opened at other {unit}s by some peers ({seen}): dropped", False


class TorchftRail:
    """The rail on a ``torchft.Manager``'s process group: quorums, commits, failures kept in the window.

    ``on_vote(window)`` is called once a window is decided (the front-end's counters).
    ``contact``: how long a window waits for a member to answer before it is dropped (the
    Lighthouse's heartbeat timeout: a member silent that long is declared dead anyway, and the
    next quorum goes on without it). It bounds the steps that find out who is alive: torchft's
    configuration of the quorum's process group (its store, the group's rendezvous), a joiner's
    first contact with its heal source and each read of the state, and the barrier that opens
    the window. The window's data collectives, once every member answered, keep the process
    group's own timeout (long: a large model's average may take it).
    """

    droppable = True
    across_nodes = True
    world_group = None  # torchft reconfigures one group per rail; none spans the nodes' ranks

    def __init__(
        self,
        manager: Any,
        on_vote: Callable[[Window], None] = lambda w: None,
        log: bool = False,
        contact: timedelta = timedelta(seconds=HEARTBEAT_TIMEOUT_S),
    ) -> None:
        self.manager = manager
        self.contact = contact
        self.on_vote = on_vote
        self.log = log  # this rank logs quorum changes (local rank 0 of each node)
        self.window: Window | None = None
        """The window whose collectives are being issued."""
        self.undecided: list[Window] = []
        self._count = 0
        self._members: list[int] | None = None
        self._dropping: list[threading.Thread] = []
        """Groups of failed windows being dropped: done before the next quorum builds a new one."""

    # ------------------------------------------------------------- collectives
    def nodes(self) -> int:
        assert self.window is not None, "a rail collective outside a window"
        return self.window.participants

    def contributors(self) -> int:
        assert self.window is not None, "a rail collective outside a window"
        return self.window.contributors

    def contributes(self) -> bool:
        assert self.window is not None, "a rail collective outside a window"
        return self.window.contributes

    def describe(self, ranks: list[int]) -> str:
        w = self.window
        return f"torchft quorum {w.quorum_id if w else '?'}"

    def _issue(
        self,
        op: Callable[..., Any],
        opts: Any,
        out: torch.Tensor,
        *inputs: torch.Tensor,
        what: str,
        limit: timedelta | None = None,
    ) -> torch.futures.Future:
        """Launch ``op(opts, out, *inputs)`` (a torchft work) in the current window; the future never fails.

        ``limit``: how long it may take (default: the group's own timeout, the data's). A failure
        (a peer killed or frozen, the group reconfigured) is recorded in the window and the
        future completes with ``[out]`` holding whatever the collective left there: garbage
        nobody applies, since the window then does not commit.
        """
        window = self.window
        assert window is not None, "a rail collective outside a window"
        if window.error is not None:  # a failed window issues nothing more (its group is being dropped)
            return completed([out], out.device)
        try:
            with ftcompat.op_timeout(self.manager, opts, limit):
                fut = issue(lambda *ts, async_op=True: op(opts, *ts), out, *inputs, what=what)
        except Exception as e:  # e.g. the group is gone: its reconfiguration failed in the quorum
            self._fail(window, e, what)
            return completed([out], out.device)

        def result(f: torch.futures.Future) -> list[torch.Tensor]:
            try:
                wait(f)
            except Exception as e:
                self._fail(window, e, what)
            return [out]

        return then(fut, result, out.device, what)

    def allreduce(self, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs type it as RedOpType
        if not self.contributes():  # a node healed in this window's quorum adds nothing to its sums
            tensor.zero_()
        return self._issue(lambda o, t: self._pg().allreduce([t], o), opts, tensor, what=what)

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        from torch.distributed.distributed_c10d import AllToAllOptions

        op = lambda opts, o, t: self._pg().alltoall_base(o, t, [], [], opts)
        return self._issue(op, AllToAllOptions(), out, tensor, what=what)

    def all_gather(
        self, out: torch.Tensor, tensor: torch.Tensor, what: str, limit: timedelta | None = None
    ) -> torch.futures.Future:
        from torch.distributed.distributed_c10d import AllgatherOptions

        op = lambda opts, o, t: self._pg().allgather([list(o.chunk(self.nodes()))], [t], opts)
        return self._issue(op, AllgatherOptions(), out, tensor, what=what, limit=limit)

    def _pg(self) -> Any:
        return ftcompat.process_group(self.manager)

    def _fail(self, window: Window, e: BaseException, what: str) -> None:
        """Record the window's failure and drop its group at once, so that a peer waiting on this
        node in the window fails on the closed connection, not on the data's timeout (and drops
        the group in turn: a death reaches every member in milliseconds). Once per window; on a
        thread of its own (this may run on the group's own worker thread, which its destruction
        joins); the next quorum waits for it."""
        window.fail(e, what)
        with window._lock:
            if window.dropping is not None:
                return
            window.dropping = threading.Thread(
                target=ftcompat.abort_group, args=(self.manager,), name="hiersync-drop-group", daemon=True
            )
        window.dropping.start()
        self._dropping.append(window.dropping)

    # ------------------------------------------------------------- windows
    def quorum(self, marker: Marker) -> None:
        """Decide every open window, then hold torchft's quorum for ``marker`` (may heal this node)."""
        self.settle()
        while self._dropping:
            self._dropping.pop().join()
        deadline = time.monotonic() + ftcompat.quorum_timeout(self.manager).total_seconds()
        while True:
            # In attempts of QUORUM_ATTEMPT_S: a request in flight when the Lighthouse dies is never
            # answered, so a Lighthouse restarted at the same address is reached by asking again.
            left = deadline - time.monotonic()
            try:
                with ftcompat.bounded(self.manager, self.contact):  # a dead member costs the contact bound
                    self.manager.start_quorum(timeout=timedelta(seconds=max(0.1, min(QUORUM_ATTEMPT_S, left))))
                return
            except Exception as err:  # the Lighthouse is gone or slow: torchft's error, kept for the message
                e = err
            if time.monotonic() + 0.5 >= deadline:
                break
            if self.log:
                logger.warning(
                    "hiersync: torchft's quorum for %s failed (%s: %s); asking again (for up to %.0f s more)",
                    marker.describe(),
                    type(e).__name__,
                    str(e).strip().splitlines()[-1][:200] if str(e).strip() else "",
                    deadline - time.monotonic(),
                )
            ftcompat.forget_failed_quorum(self.manager)
            time.sleep(0.5)
        address = os.environ.get("TORCHFT_LIGHTHOUSE", "the lighthouse_addr= given to torchft.Manager")
        raise HierSyncError(
            f"hiersync: torchft could not form a quorum for {marker.describe()}: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}. Is the Lighthouse ({address}) running "
            "and reachable from every node, and does the Manager's quorum_timeout cover the slowest node's time "
            "between two syncs?"
        ) from e

    def open(
        self,
        marker: Marker,
        device: torch.device,
        contributes: bool = True,
        place: int | None = None,
        extra: Sequence[float] = (),
    ) -> Window:
        """The window of the quorum just held (:meth:`quorum`); its members wait for each other once.

        ``contributes``: False on a node healed in this quorum for a window that averages
        state (a sync, ``synchronize()``): it brings no state of its own, so its values are
        zeros and every average of the window is divided by the nodes that do contribute.
        ``place``: where a sync sits in the schedule, equal on every node that opens the same
        sync (default the step; adaptive pace: the window and fragment, as nodes' steps differ).
        ``extra``: values this node adds to the barrier's row (the tally's samples and step time),
        every member's in :attr:`Window.rows`: the same length on every node.
        """
        manager = self.manager
        participants = max(1, int(manager.num_participants()))
        window = self._new(marker, ftcompat.quorum_id(manager), participants)
        self._log_members(window)
        # Holds every member until a joiner healed in this quorum has its copy (torchft serves
        # the live tensors of a CPU model until the next should_commit), counts who contributes and
        # checks that they all opened the same sync: a node that lost a rail timeout in a window its
        # peers left at once is a period behind them while torchft's step (the same committed
        # windows) cannot tell; averaging its step s with their s + k would mix two places.
        at = marker.step if place is None else place
        values = [1.0 if contributes else 0.0, float(at), *map(float, extra)]
        width = len(values)
        row = torch.tensor(values, dtype=torch.float64, device=device)
        rows = torch.zeros(participants * width, dtype=torch.float64, device=device)
        failed = manager.errored()
        if failed is not None:  # torchft's configuration of this quorum's group or a heal failed (within contact)
            self._fail(window, getattr(failed, "original_exception", failed), "torchft's quorum")
        wait(self.all_gather(rows, row, "the rail barrier after the quorum", limit=self.contact))
        window.contributes = contributes
        if window.error:  # a failed barrier leaves garbage; its window never commits, so its divisor is moot
            window.contributors = participants
            return window
        window.rows = rows.view(participants, width).tolist()  # one host read per window
        window.rank = ftcompat.participating_rank(manager)
        flags, steps = [r[0] for r in window.rows], [r[1] for r in window.rows]
        window.contributors = max(1, round(sum(flags)))
        if marker.kind == "sync" and contributes:
            unit = "step" if place is None else "window place"
            verdict = stale_step(int(at), [int(s) for f, s in zip(flags, steps) if f], unit)
            if verdict is not None:
                why, stale = verdict
                self._fail(window, RuntimeError(why), "the rail barrier after the quorum")
                window.stale = why if stale else None
        return window

    def reuse(self, marker: Marker) -> Window:
        """A window for work without a quorum of its own (an exact step whose ``optimizer.step()``
        was skipped on every node): the last quorum's members."""
        last = self.window
        return self._new(marker, last.quorum_id if last else -1, last.participants if last else 1)

    def _new(self, marker: Marker, quorum_id: int, participants: int) -> Window:
        window = Window(self._count, marker, quorum_id, participants, participants)
        self._count += 1
        self.undecided.append(window)
        self.window = window
        return window

    def abandon(self, window: Window) -> None:
        """Forget a window that launched nothing but its barrier, without a vote (torchft's step stays)."""
        assert window is self.undecided[-1] and not window.futures and not window.restore
        self.undecided.remove(window)
        window.committed = False

    def decide(self, window: Window) -> bool:
        while window.committed is None:
            self._vote(self.undecided[0])
        return bool(window.committed)

    def settle(self) -> None:
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
        restore, window.restore = window.restore, []
        if not ok:
            for put_back in restore:
                put_back()
            why = window.error or str(manager.errored() or "a peer voted no")
            logger.warning(
                "hiersync: %s did not commit (%s): %s; training goes on with the nodes that remain",
                window.marker.describe(),
                why,
                "its corrections are dropped, local progress is kept"
                if window.kind == "sync"
                else "it changes nothing",
            )
        self.on_vote(window)
        if window.stale:
            self._fall_back(window.stale)

    def _fall_back(self, why: str) -> None:
        """A node a period behind its peers (it waited in a window they left at once) is healed at its
        next quorum: it counts one commit fewer, so torchft sees it behind and sends it a peer's state."""
        step = int(self.manager.current_step())
        if step < 1:
            raise HierSyncError(
                f"hiersync: {why}. It voted no with them and stops here (it has no commit to count back); start it "
                "again (its torchrun does, with --max-restarts) and it is healed from a live peer at the peers' step"
            )
        self.manager.load_state_dict({"step": step - 1, "batches_committed": int(self.manager.batches_committed())})
        if self.log:
            logger.warning(
                "hiersync: %s. It voted no with them and is healed from a live peer at their step in its next quorum",
                why,
            )

    # ------------------------------------------------------------- log
    def _log_members(self, window: Window) -> None:
        """Local rank 0 of each node logs the nodes that left and joined (from the replica ids' numbers)."""
        members = ftcompat.members(self.manager)
        before, self._members = self._members, members
        if not self.log or before == members:
            return
        what = (
            f"hiersync: torchft quorum {window.quorum_id} for {window.marker.describe()}: {window.participants} nodes"
        )
        if before is None or members is None:  # the first quorum: who is in
            logger.info("%s %s", what, members if members is not None else "")
            return
        left, joined = [n for n in before if n not in members], [n for n in members if n not in before]
        logger.warning("%s %s; left: %s; joined: %s", what, members, left or "-", joined or "-")
