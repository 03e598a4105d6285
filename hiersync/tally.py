"""The tally of a sync: the samples each node trained since it last synced a fragment, and its
step time, agreed by every rank with the sync's own launch.

Every cross-node average weights a node by its samples (``state.count_samples(n)`` per step,
one unit per rank and step by default; a node weighs the sum over its ranks). At each sync,
every rank writes its samples and its step time into its node's slots of a vector of ``2 N``
float64 values (``N`` nodes) and all-reduces it on a gloo group of its own (its rail on nodes of
one size, after the node's sum; the world otherwise): launched
with the sync, never queued behind the rail's data, and waited for only where the average is
read (a blocking sync's target, an overlapped sync's correction, in its callback). Nothing
waits for it at the launch, so an overlapped or streaming sync stays in flight.

How a node's values are weighted without knowing the others' samples at the launch: the
agreed *expected* total ``c`` (the default count every node knows alike) scales the own
contribution by ``s_i / c`` (as the unweighted average's ``1 / N`` when ``s_i`` is the
default), the rail sums, and the sum is scaled by ``c / S`` once the tally's total ``S`` is in
(:class:`Weighting`; ``S == c``, every node at its default, changes nothing: the numbers are
the unweighted average's, bit for bit). A node with no samples sends zeros; a sync whose
nodes all have none changes nothing.

Adaptive pace (:mod:`hiersync.pace`) reads the step times: the window that ends at a sync is
followed by one whose length comes from the step times of the window before it (the tally
launched one window earlier is long in by then: nobody waits for it), so the first two
windows run ``period`` steps on every node.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .collectives import collective_bytes
from .futures import issue, wait, wrap
from .pace import Windows, steps_per_window
from .stats import Stats
from .topology import Topology

__all__ = ["Agreed", "Tally", "Weighting", "TALLY"]

TALLY = "tally"
"""The level the tally's all-reduces are counted under in ``stats``."""


class Agreed:
    """The tally of one sync, read once (the first read waits for the all-reduce)."""

    def __init__(
        self, future: torch.futures.Future | None, values: list[float] | None = None, phase: str = "tally"
    ) -> None:
        self._future, self._values, self._phase = future, values, phase

    def values(self) -> list[float]:
        if self._values is None:
            assert self._future is not None
            try:
                self._values = wait(self._future)[0].tolist()
            except Exception as e:
                raise wrap(e, self._phase) from e
            self._future = None
        return self._values


@dataclass
class Weighting:
    """The weights of one fragment's cross-node averages in one sync."""

    own: float
    """This node's samples since the fragment last synced (the sum over its ranks)."""
    expected: float
    """``c``: the total every node agreed on before the launch (the default count)."""
    nodes: int
    agreed: Agreed = field(repr=False)
    contributors: int = 0
    """Nodes whose values enter the rail's sums (0: all :attr:`nodes`; the manager mode: less the
    nodes healed in the window, which send zeros)."""

    def samples(self) -> list[float]:
        """Every node's samples for this fragment (waits for the tally)."""
        return self.agreed.values()[: self.nodes]

    def total(self) -> float:
        """``S``: the samples of every node."""
        return float(sum(self.samples()))

    def rescale(self) -> float:
        """What the rail's sum is multiplied by: ``c / S`` (1 when every node had its default count;
        0 when no node had samples: the sum is all zeros then, and the sync changes nothing)."""
        total = self.total()
        return 1.0 if total == self.expected else self.expected / total if total else 0.0

    def scale_own(self, t: torch.Tensor) -> torch.Tensor:
        """This node's contribution to a rail sum, in place: ``t * s_i / c`` (``t / N`` at the default)."""
        n = self.contributors or self.nodes
        if self.own * n == self.expected:
            return t.div_(n)  # the unweighted average's own division: the same bits
        return t.mul_(self.own / self.expected)


class Tally:
    """One rank's samples and step times, and the all-reduce that agrees them at each sync.

    ``windows``: this node's windows under adaptive pace (closed here when a window's last
    fragment syncs); None under fixed pace (the tally then only weighs the averages).
    """

    def __init__(
        self,
        topology: Topology,
        rank: int,
        group: dist.ProcessGroup | None,
        intra: dist.ProcessGroup | None,
        stats: Stats,
        *,
        period: int,
        fragments: int,
        windows: Windows | None = None,
    ) -> None:
        self.topology, self.rank, self.group, self.intra, self.stats = topology, rank, group, intra, stats
        self.group_is_rail = topology.even
        """Even nodes: ``group`` is this rank's rail (one rank a node: the node's sums go in);
        else the world's (every rank adds its own)."""
        self.node = topology.node_of(rank)
        node_ranks = list(topology.node_ranks(rank))
        self.node_size = len(node_ranks)
        self._where = f"rank {rank}, node ranks {node_ranks}"  # named in errors
        self.period, self.fragments, self.windows = period, fragments, windows
        self.counting = False
        """Whether this rank ever counted (then its steps add no unit of their own)."""
        self.since = [0.0] * fragments
        """This rank's samples since each fragment's last sync."""
        self.steps_since = [0] * fragments
        """This rank's steps since each fragment's last sync."""
        self.step_times: list[float] = []
        """This rank's step times (seconds) since the last sync."""
        self._last: float | None = None  # when the last step's update ended
        self._previous: Agreed | None = None  # the tally at the last window's end (its step times pace the next)
        self.lengths = [period] * topology.num_nodes
        """Every node's steps in the open window (adaptive pace)."""

    # ------------------------------------------------------------- counting
    def count(self, n: float) -> None:
        """Add ``n`` samples to this rank's count (from then on, steps add none by themselves)."""
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not 0 <= n < float("inf"):
            raise ValueError(f"count_samples(n) needs a finite number >= 0 (the step's samples or tokens), got {n!r}")
        self.counting = True
        for f in range(self.fragments):
            self.since[f] += float(n)

    def end_step(self, exact: bool) -> None:
        """A step's backward ended: one more step (and one unit, without counts) since each fragment's sync.
        An exact step averages everything: what was counted before it is forgotten."""
        if exact:
            self.since, self.steps_since = [0.0] * self.fragments, [0] * self.fragments
            return
        for f in range(self.fragments):
            self.steps_since[f] += 1
            if not self.counting:
                self.since[f] += 1.0

    def step_timed(self) -> None:
        """A step's update begins: its time is since the last update ended (a sync's wait is not a step's)."""
        if self._last is not None:
            self.step_times.append(time.perf_counter() - self._last)

    def update_ended(self) -> None:
        """The update and the syncs after it are done: the next step's time starts now."""
        self._last = time.perf_counter()

    # ------------------------------------------------------------- the sync
    def open(
        self,
        step: int,
        fragments: Sequence[int],
        close: bool = True,
        rows: Sequence[Sequence[float]] | None = None,
        me: int = 0,
    ) -> dict[int, Weighting]:
        """Launch the tally of a sync of ``fragments`` after ``step``; the weighting of each fragment.

        One all-reduce per fragment (every node syncs every fragment once a window, in fragment
        order, though a slow node syncs several after one step). With ``close``: the counts since
        each fragment's sync start again, and the window closes (adaptive pace) when its last
        fragment is among them. ``rows``: the manager mode's window barrier already carried every
        node's :meth:`row` (``me``: this node's): nothing is launched.
        """
        if rows is not None:
            return self._from_rows(step, fragments, close, rows, me)
        topo, N = self.topology, self.topology.num_nodes
        step_s = statistics.median(self.step_times) if self.step_times else 0.0
        out = {}
        for f in fragments:
            mine = torch.tensor([self.since[f], step_s], dtype=torch.float64)
            if self.group_is_rail:  # the node's sums first (blocking: two values over the node's ranks)
                if self.intra is not None:
                    self._sum_over_node(mine, step)
                else:
                    mine[0] *= self.node_size
                mine[1] /= self.node_size
            else:  # over the world: every rank adds its own
                mine[1] /= self.node_size
            vec = torch.zeros(2 * N, dtype=torch.float64)
            vec[self.node :: N] = mine
            agreed = Agreed(self._all_reduce(vec), phase=self._phase("tally of samples and step times", step))
            if self.windows is None:  # fixed pace: every node took this rank's steps
                expected = float(self.steps_since[f] * topo.world_size)
            else:
                expected = float(self.period * topo.world_size)
            w = out[f] = Weighting(float(mine[0]), expected, N, agreed)
            if not self.group_is_rail:  # the node's sum is the world's tally's (waits: nodes of different sizes)
                w.own = w.samples()[self.node]
            if not close:
                continue
            self.since[f], self.steps_since[f] = 0.0, 0
            if self.windows is not None and self.windows.closes((f,)):
                self._close(step, agreed)
        if close:
            self.step_times = []
        return out

    def open_window(self, rows: Sequence[Sequence[float]] | None = None, me: int = 0) -> list[float]:
        """Every node's samples in the open window (since its last fragment's sync), agreed now:
        blocking and collective (``synchronize()``); nothing is reset. ``rows``: as :meth:`open`
        (empty: the window's barrier failed, and so does the window; no samples are known)."""
        f = self.fragments - 1
        w = self.open(-1, [f], close=False, rows=rows, me=me).get(f)
        return w.samples() if w is not None else []

    def backup(self, fragments: Sequence[int]) -> Callable[[], None]:
        """What puts back the counts a dropped window's launch reset: the samples it would have
        synced count again at the fragment's next sync (added to those counted since)."""
        kept = [(f, self.since[f], self.steps_since[f]) for f in fragments]

        def restore() -> None:
            for f, since, steps in kept:
                self.since[f] += since
                self.steps_since[f] += steps

        return restore

    # ------------------------------------------------------------- the manager mode
    def row(self, fragments: Sequence[int], device: torch.device, step: int) -> list[float]:
        """This node's values for the barrier of a torchft window (:meth:`TorchftRail.open
        <hiersync.transport.TorchftRail.open>`'s ``extra``): its samples since each fragment of
        ``fragments`` synced (0 for the others: ``fragments`` values), then its step time. The
        node's sums over its ranks (blocking, on its own group); every node's row the same length.
        ``step``: the sync's (-1: ``synchronize()``), named if the node's sum fails."""
        values = [self.since[f] if f in fragments else 0.0 for f in range(self.fragments)]
        values.append(statistics.median(self.step_times) if self.step_times else 0.0)
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        if self.intra is not None:
            self._sum_over_node(mine, step)
            mine[-1] /= self.node_size
        return mine.tolist()

    def _sum_over_node(self, mine: torch.Tensor, step: int) -> None:
        """Sum ``mine`` over this node's ranks, in place (blocking, on the node's own group)."""
        try:
            wait(issue(dist.all_reduce, mine, group=self.intra, what="the node's sum of the tally"))
        except Exception as e:
            raise wrap(e, self._phase("node's sum of the tally", step)) from e

    def _from_rows(
        self, step: int, fragments: Sequence[int], close: bool, rows: Sequence[Sequence[float]], me: int
    ) -> dict[int, Weighting]:
        """The weighting of each fragment from every node's barrier row ``[contributes, place, *row()]``.

        A node that does not contribute (healed in the window) counts no samples. Every node knows
        the total at the launch, so each scales its own values by ``s_i / S`` and the sum needs no
        rescale. The window closes (adaptive pace) on this window's step times: the barrier waited
        for them anyway.
        """
        N, F = len(rows), self.fragments
        if not rows:  # the barrier failed: the window is dropped on every node; the next keeps this one's length
            if close:
                for f in fragments:
                    self.since[f], self.steps_since[f] = 0.0, 0
                if self.windows is not None and self.windows.closes(fragments):
                    self.windows.close(step, self.windows.length, self.windows.grid)
                self.step_times = []
            return {}
        contributors = max(1, round(sum(r[0] for r in rows)))
        times = [float(r[2 + F]) for r in rows]
        out = {}
        for f in fragments:
            samples = [float(r[2 + f]) if r[0] else 0.0 for r in rows]
            total = float(sum(samples))
            out[f] = Weighting(samples[me], total, N, Agreed(None, samples + times), contributors)
            if not close:
                continue
            self.since[f], self.steps_since[f] = 0.0, 0
            if self.windows is not None and self.windows.closes((f,)):
                known = [t for t in times if t > 0]  # a node restarted and healed here has timed nothing yet
                step_s = [t if t > 0 else min(known) for t in times] if known else []
                self.lengths = steps_per_window(step_s, self.period) if step_s else [self.period] * N
                self.windows.close(step, self.lengths[me], min(self.lengths))
        if close:
            self.step_times = []
        return out

    def _phase(self, what: str, step: int) -> str:
        """``what`` with the step (-1: ``synchronize()``) and the ranks, as the comm names its collectives."""
        ctx = f"step {step}, sync step" if step >= 0 else "synchronize()"
        return f"{what} ({ctx}; {self._where})"

    def _step_times(self, agreed: Agreed) -> list[float]:
        """Every node's step time in a tally (its second row)."""
        N = self.topology.num_nodes
        return agreed.values()[N : 2 * N]

    def _close(self, step: int, agreed: Agreed) -> None:
        """The window ends after ``step``: the next one's length from the window before it."""
        assert self.windows is not None
        previous, self._previous = self._previous, agreed
        if previous is not None:
            step_s = self._step_times(previous)
            if all(s > 0 for s in step_s):
                self.lengths = steps_per_window(step_s, self.period)
        self.windows.close(step, self.lengths[self.node], min(self.lengths))

    def _all_reduce(self, vec: torch.Tensor) -> torch.futures.Future:
        if self.group is None:  # a world of one rank
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result([vec])
            return fut
        nbytes = collective_bytes("all_reduce", self.group.size(), vec.numel() * vec.element_size())
        self.stats.count_collective(TALLY, nbytes)
        return issue(dist.all_reduce, vec, group=self.group, what="the tally of samples and step times")

    # ------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        previous = self._step_times(self._previous) if self._previous is not None else None
        out: dict[str, Any] = {
            "since": list(self.since),
            "steps_since": list(self.steps_since),
            "lengths": list(self.lengths),
            "previous_step_s": previous,
        }
        if self.windows is not None:
            out["windows"] = self.windows.state()
        return out

    def load(self, state: dict[str, Any]) -> None:
        self.since = [float(v) for v in state["since"]]
        self.steps_since = [int(v) for v in state["steps_since"]]
        self.lengths = [int(v) for v in state["lengths"]]
        prev = state.get("previous_step_s")
        N = self.topology.num_nodes
        self._previous = None if prev is None else Agreed(None, [0.0] * N + [float(v) for v in prev])
        if self.windows is not None and "windows" in state:
            self.windows.load(state["windows"])
        self.step_times, self._last = [], None
