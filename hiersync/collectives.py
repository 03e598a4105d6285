"""Two-level collectives: mechanism only, no policy.

:class:`HierComm` averages a flat tensor over the world as

1. reduce-scatter inside the node (each rank gets a 1/L shard of the node's sum),
2. all-reduce of that shard on the rail (all L rails run concurrently, so every NIC carries
   1/L of the bucket),
3. all-gather inside the node.

Sizes not divisible by L are padded. Uneven nodes (different L) fall back to reduce to a
leader per node -> all-reduce among the leaders -> broadcast inside the node. The tensor
is divided by the world size *before* any reduction, so fp16 sums cannot overflow where
the average would not (the same order as DDP's default hook).

Everything is asynchronous and returns a :class:`torch.futures.Future`. Legs 2 and 3 are
launched from the completion callback of the previous leg, which on gloo runs on a
backend worker thread, so completion order may differ between ranks. A
:class:`Sequencer` per group makes every group see its collectives in submission order on
every rank; the late all-gathers use a second intra-node group so they never interleave
with the reduce-scatters that the hook thread issues on the first one.

Example::

    >>> comm = HierComm(Topology.detect().build_groups())
    >>> avg = wait(comm.allreduce(torch.ones(10)))   # == flat all-reduce / world
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from .futures import (
    Sequencer,
    after,
    all_gather,
    completed,
    issue,
    ready_now,
    reduce_scatter,
    span,
    then,
    wait,
    when_all,
    wrap,
)
from .stats import Stats
from .topology import Groups
from .transport import GroupRail, Transport
from .vocab import INTRA_ALGORITHMS, Level, default_intra_algorithm

INTRA, INTER = Level.INTRA, Level.INTER

__all__ = ["HierComm", "collective_bytes"]

_FACTORS = dict(all_reduce=2.0, reduce_scatter=1.0, all_gather=1.0, all_to_all=1.0, reduce=1.0, broadcast=1.0)


class RailWeights(Protocol):
    """How a node's values enter a weighted rail sum (:class:`hiersync.tally.Weighting`)."""

    own: float
    expected: float

    def scale_own(self, t: torch.Tensor) -> torch.Tensor: ...


def collective_bytes(kind: str, group_size: int, nbytes: int) -> int:
    """Bytes one rank sends for collective ``kind`` over ``group_size`` ranks on ``nbytes`` (the
    full input; an all-gather's full output): ``2 (p - 1) / p * n`` for an all-reduce, ``(p - 1) / p * n``
    for the others, 0 for a group of one (the cost model's bandwidth-optimal accounting)."""
    if group_size <= 1:
        return 0
    return int(round(_FACTORS[kind] * (group_size - 1) / group_size * nbytes))


class HierComm:
    """Two-level averaging over a :class:`~hiersync.topology.Groups`. Mechanism only.

    Every public method returns a future and records collectives and bytes in ``stats``.
    ``label`` is a callable returning a short context (e.g. ``"step 12"``) put into errors.
    """

    def __init__(
        self,
        groups: Groups,
        stats: Stats | None = None,
        label: Callable[[], str] = lambda: "",
        intra_algorithm: str | None = None,
        rail: Transport | None = None,
    ) -> None:
        self.groups = groups
        self.topology = groups.topology
        self.rail: Transport = rail if rail is not None else GroupRail(groups.rail, groups.topology.num_nodes)
        """The cross-node leg: every collective between nodes goes through it."""
        self.stats = stats if stats is not None else Stats()
        self.label = label
        self.world_size = self.topology.world_size
        self.level: str = INTER
        """The level its rail collectives are counted under in ``stats`` (``"rack"`` for a rack's)."""
        self.weighting: RailWeights | None = None
        """The weights of the rail averages being launched (:mod:`hiersync.tally`), set by the engine
        around a sync's launch; None: the unweighted mean (exact steps, ``synchronize()``)."""
        self._seq_rail = Sequencer()
        self._seq_late = Sequencer()
        # rs_ag on NCCL; allreduce_bcast on gloo, whose RS/AG are slow (vocab.default_intra_algorithm).
        if intra_algorithm is None:
            backend = str(dist.get_backend(groups.intra)) if groups.intra is not None else "gloo"
            intra_algorithm = default_intra_algorithm(backend)
        if intra_algorithm not in INTRA_ALGORITHMS:
            raise ValueError(
                f"intra_algorithm={intra_algorithm!r} is not supported; use one of {list(INTRA_ALGORITHMS)}"
            )
        self.intra_algorithm = intra_algorithm

    def over(self, rail: Transport, level: str) -> HierComm:
        """The same node, another cross-node leg: the averages of a higher level's sibling (a rack's
        rail). Its node gathers share this one's issue order (the same intra groups)."""
        other = HierComm(self.groups, self.stats, self.label, self.intra_algorithm, rail=rail)
        other.level = level
        other._seq_late = self._seq_late
        return other

    # ------------------------------------------------------------- helpers
    def _count(self, level: str, kind: str, group_size: int, nbytes: int) -> None:
        """One collective of ``kind`` on ``nbytes`` over ``group_size`` ranks, in ``stats``."""
        if group_size > 1:
            self.stats.count_collective(level, collective_bytes(kind, group_size, nbytes))

    def _phase(self, what: str) -> str:
        """``what`` plus the step context, this rank and the ranks of the groups involved."""
        g = self.groups
        ctx = self.label()
        where = f"rank {g.rank}, node ranks {list(g.node)}, {self.rail.describe(list(g.rail_ranks))}"
        return f"{what} ({ctx}; {where})" if ctx else f"{what} ({where})"

    # ------------------------------------------------------------- the rail
    def rail_nodes(self) -> int:
        """Nodes that take part in a rail collective: the topology's (torchft's rail: the quorum's)."""
        return self.rail.nodes() if self.rail.across_nodes else 1

    def rail_divisor(self) -> int:
        """Nodes whose values a rail average is taken over: :meth:`rail_nodes`, less the nodes
        healed in torchft's quorum for a window that averages state (they send zeros)."""
        return self.rail.contributors() if self.rail.across_nodes else 1

    def contributes(self) -> bool:
        """Whether this node's values enter the current rail average (False: it sends zeros)."""
        return self.rail.contributes() if self.rail.across_nodes else True

    def rail_allreduce(self, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        """Sum ``tensor`` in place over this rank's rail (callers divide by :meth:`rail_divisor`)."""
        return self.rail.allreduce(tensor, what)

    def _sequenced_rail_allreduce(self, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        """:meth:`rail_allreduce` in the rail's issue order: at once when nothing waits before it.

        Legs launched from callbacks (the two-level all-reduce's, the quantized average's
        all-gather) share the rail with these, so every rail collective is sequenced.
        """
        return self._seq_rail.submit(
            ready_now(tensor.device), lambda: self.rail_allreduce(tensor, what), tensor.device, what
        )

    # ------------------------------------------------------------- exact (period 1)
    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Average ``tensor`` (1-D) over the world; the future's value is the averaged tensor.

        ``tensor`` may be modified in place (it is divided by the world size).
        """
        g = self.groups
        L, N = g.node_size, self.rail_nodes()
        if L * N == 1:
            return completed(tensor, tensor.device)
        if not g.even:
            return self._via_leaders(tensor, replicated=False)
        if L == 1:
            return self._flat(tensor, None, INTER, "exact all-reduce over nodes", rail=True)
        if N == 1:
            return self._flat(tensor, g.intra, INTRA, "exact all-reduce inside the node")
        return self._allreduce_two_level(tensor, L)

    def _flat(self, tensor: torch.Tensor, group, level: str, what: str, rail: bool = False) -> torch.futures.Future:
        size = self.rail_nodes() if rail else dist.get_world_size(group)
        tensor.div_(self.rail_divisor() if rail else size)
        self._count(level, "all_reduce", size, tensor.numel() * tensor.element_size())
        try:
            if rail:
                fut = self._sequenced_rail_allreduce(tensor, what)
            else:
                fut = issue(dist.all_reduce, tensor, group=group, what=what)
        except Exception as e:
            raise wrap(e, self._phase(what)) from e
        fut = then(fut, lambda f: wait(f)[0], tensor.device, self._phase(what))
        return span(f"hiersync/{level}_allreduce", fut)

    def _allreduce_two_level(self, tensor: torch.Tensor, L: int) -> torch.futures.Future:
        g = self.groups
        n = tensor.numel()
        shard_len = -(-n // L)
        if shard_len * L == n:
            flat = tensor
        else:
            flat = torch.zeros(shard_len * L, dtype=tensor.dtype, device=tensor.device)
            flat[:n].copy_(tensor)
        N = self.rail_nodes()
        flat.div_(L * self.rail_divisor())
        esize = tensor.element_size()
        lo = g.local_rank * shard_len
        if self.intra_algorithm == "rs_ag":
            shard = torch.empty(shard_len, dtype=tensor.dtype, device=tensor.device)
            phase = self._phase("intra reduce-scatter")
            self._count(INTRA, "reduce_scatter", L, flat.numel() * esize)
            launch = lambda: issue(reduce_scatter, shard, flat, group=g.intra, what=phase)
            span_name = "hiersync/intra_reduce_scatter"
        else:
            shard = flat[lo : lo + shard_len]  # reduced in place by the node-wide all-reduce
            phase = self._phase("intra all-reduce")
            self._count(INTRA, "all_reduce", L, flat.numel() * esize)
            launch = lambda: issue(dist.all_reduce, flat, group=g.intra, what=phase)
            span_name = "hiersync/intra_allreduce"
        try:
            first = launch()
        except Exception as e:
            raise wrap(e, phase) from e
        first = span(span_name, then(first, wait, tensor.device, phase))

        def rail_leg() -> torch.futures.Future:
            return self.rail_allreduce(shard, "inter all-reduce on the rail")

        self._count(self.level, "all_reduce", N, shard_len * esize)
        ar = self._seq_rail.submit(first, rail_leg, tensor.device, self._phase("inter all-reduce on the rail"))
        ar = span("hiersync/inter_allreduce", ar)
        done = self._gather_shards(lambda: (flat, shard), shard_len, flat, ar, "all-gather")
        return after(done, lambda: flat if flat is tensor else flat[:n], tensor.device)

    def _gather_shards(
        self,
        buffers: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        shard_len: int,
        like: torch.Tensor,
        ready: torch.futures.Future,
        what: str,
    ) -> torch.futures.Future:
        """Once ``ready``, give every rank of the node all L shards of a padded vector.

        ``buffers()`` returns ``(padded, shard)``: the output (``L * shard_len`` values) and
        this rank's slice (a view of ``padded`` or a separate tensor). It is called once
        ``ready`` is done, on hiersync's side stream, in submission order (:class:`Sequencer`),
        so it may also compute the shard or allocate the output. ``like`` gives the dtype and
        device. The future holds nothing: read ``padded`` after waiting on it.
        """
        g = self.groups
        L = g.node_size
        esize = like.element_size()
        lo = g.local_rank * shard_len
        if self.intra_algorithm == "rs_ag":
            self._count(INTRA, "all_gather", L, L * shard_len * esize)

            def launch() -> torch.futures.Future:
                padded, shard = buffers()
                return issue(all_gather, padded, shard, group=g.intra_late, what=f"intra {what}")

            span_name = "hiersync/intra_all_gather"
        else:
            node = g.node
            for _ in range(L):
                self._count(INTRA, "broadcast", L, shard_len * esize)

            def launch() -> torch.futures.Future:
                padded, shard = buffers()
                if shard.data_ptr() != padded[lo:].data_ptr():
                    padded[lo : lo + shard_len].copy_(shard)
                futs = [
                    issue(
                        dist.broadcast,
                        padded[r * shard_len : (r + 1) * shard_len],
                        src=node[r],
                        group=g.intra_late,
                        what=f"intra {what}",
                    )
                    for r in range(L)
                ]
                return when_all(futs, padded.device, self._phase(f"intra {what}"))

            span_name = "hiersync/intra_broadcast_shards"
        fut = self._seq_late.submit(ready, launch, like.device, self._phase(f"intra {what}"))
        return span(span_name, fut)

    def _via_leaders(self, tensor: torch.Tensor, replicated: bool) -> torch.futures.Future:
        """Uneven nodes: reduce to the node's leader, all-reduce among the leaders, node broadcast.

        ``replicated``: every rank of the node holds the same values (parameters), so there is
        nothing to reduce and the leader weighs its node by its ranks (the mean over all ranks).
        """
        g, topo = self.groups, self.topology
        leader, L = g.node[0], g.node_size
        nbytes = tensor.numel() * tensor.element_size()
        what = "parameter " if replicated else ""
        ready = ready_now(tensor.device)
        if replicated and g.is_leader:
            w = self.weighting
            tensor.mul_(L / self.world_size if w is None else w.own / w.expected)
        elif not replicated:
            tensor.div_(self.world_size)
            if L > 1:
                phase = self._phase("intra reduce to the node leader")
                self._count(INTRA, "reduce", L, nbytes)
                try:
                    ready = issue(dist.reduce, tensor, dst=leader, group=g.intra, what=phase)
                except Exception as e:
                    raise wrap(e, phase) from e
                ready = span("hiersync/intra_reduce", then(ready, wait, tensor.device, phase))
        if g.is_leader and topo.num_nodes > 1:
            phase = self._phase(f"inter {what}all-reduce among leaders")
            self._count(INTER, "all_reduce", topo.num_nodes, nbytes)
            ready = self._seq_rail.submit(ready, lambda: self.rail_allreduce(tensor, phase), tensor.device, phase)
            ready = span("hiersync/inter_param_allreduce" if replicated else "hiersync/inter_allreduce", ready)
        if L > 1:
            phase = self._phase(f"intra {what}broadcast from the leader")

            def bcast_leg() -> torch.futures.Future:
                return issue(dist.broadcast, tensor, src=leader, group=g.intra_late, what=phase)

            self._count(INTRA, "broadcast", L, nbytes)
            ready = span("hiersync/intra_broadcast", self._seq_late.submit(ready, bcast_leg, tensor.device, phase))
        return after(ready, lambda: tensor, tensor.device)

    def flat_allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Average ``tensor`` with one all-reduce over the world (what DDP's default does).

        Where no group spans the nodes' ranks (torchft's rail), the two-level all-reduce."""
        if self.rail.world_group is None:
            return self.allreduce(tensor)
        if self.world_size == 1:
            return completed(tensor, tensor.device)
        level = INTER if self.topology.num_nodes > 1 else INTRA
        return self._flat(tensor, None, level, "flat all-reduce over the world")

    # ------------------------------------------------------------- local steps
    def intra_allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Average ``tensor`` inside the node only (modified in place)."""
        if self.groups.node_size == 1:
            return completed(tensor, tensor.device)
        return self._flat(tensor, self.groups.intra, INTRA, "intra all-reduce")

    # ------------------------------------------------------------- parameters
    def average_across_nodes(self, flat: torch.Tensor) -> torch.futures.Future:
        """Average a node-identical 1-D tensor across nodes; the future holds the result.

        Every rank of a node must pass the same values (intra replicas are identical), so
        no reduce-scatter is needed: each rank all-reduces its 1/L shard on its rail and
        the node all-gathers the shards. ``flat`` is overwritten with the result. On uneven
        nodes each node is weighted by its number of ranks (= the mean over all ranks).

        The rail all-reduce is issued immediately from the calling thread; callers must
        issue these calls in the same order on every rank.
        """
        g = self.groups
        N = self.rail_nodes()
        if N == 1:
            return completed(flat, flat.device)
        if not g.even:
            return self._via_leaders(flat, replicated=True)
        L = g.node_size
        n = flat.numel()
        shard_len = -(-n // L)
        if shard_len * L != n:
            padded = torch.zeros(shard_len * L, dtype=flat.dtype, device=flat.device)
            padded[:n].copy_(flat)
        else:
            padded = flat
        lo = g.local_rank * shard_len
        shard = padded[lo : lo + shard_len].clone()
        ar = self.average_shard(shard)
        if L == 1:
            return after(ar, lambda: flat.copy_(shard), flat.device)
        done = self._gather_shards(lambda: (padded, shard), shard_len, padded, ar, "parameter gather")
        if padded is flat:
            return after(done, lambda: flat, flat.device)
        return after(done, lambda: flat.copy_(padded[:n]), flat.device)

    def average_shard(self, shard: torch.Tensor) -> torch.futures.Future:
        """Average this rank's shard of a node-sharded vector across nodes, on its rail.

        The first half of :meth:`average_across_nodes` for callers that keep per-shard
        state (:mod:`hiersync.averagers`): ``shard`` is divided by the number of nodes and
        all-reduced in place; the future holds it. Even nodes only.
        """
        N = self.rail_nodes()
        if N == 1:
            return completed(shard, shard.device)
        if not self.groups.even:
            raise ValueError("average_shard needs nodes with equal numbers of ranks; use average_across_nodes")
        if self.weighting is not None:
            self.weighting.scale_own(shard)
        else:
            shard.div_(self.rail_divisor())
        phase = self._phase("inter parameter all-reduce on the rail")
        self._count(self.level, "all_reduce", N, shard.numel() * shard.element_size())
        try:
            fut = self._sequenced_rail_allreduce(shard, phase)
        except Exception as e:
            raise wrap(e, phase) from e
        fut = then(fut, lambda f: wait(f)[0], shard.device, phase)
        return span("hiersync/inter_param_allreduce", fut)

    def average_quantized(
        self, packed: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.futures.Future:
        """Average a quantized shard on the rail: all-to-all, reduce, all-gather (even nodes only).

        ``packed`` holds :meth:`rail_nodes` pieces of equal bytes (codes and scales of
        consecutive blocks, :mod:`hiersync.quant`); rank ``j`` of the rail receives piece
        ``j`` of every node, ``reduce(received)`` (run once they are in, on hiersync's side
        stream) turns those ``N`` pieces into this rank's averaged piece, and the rail
        all-gathers the averaged pieces. The future holds the gathered bytes (``N`` pieces,
        in piece order). Both legs go through the rail's :class:`Sequencer`, in the order
        of these calls on every rank.
        """
        N = self.rail_nodes()
        if N == 1:
            return completed(reduce(packed), packed.device)
        if packed.numel() % N:
            raise ValueError(f"average_quantized: {packed.numel()} bytes do not split into {N} pieces")
        piece = packed.numel() // N
        received = torch.empty_like(packed)
        phase = self._phase("inter all-to-all of quantized pieces on the rail")
        self._count(self.level, "all_to_all", N, packed.numel())
        first = self._seq_rail.submit(
            ready_now(packed.device),
            lambda: self.rail_all_to_all(received, packed, phase),
            packed.device,
            phase,
        )
        cell: list[torch.Tensor] = []

        def gather() -> torch.futures.Future:
            mine = reduce(received)
            if mine.numel() != piece:
                raise ValueError(f"average_quantized: the reduced piece has {mine.numel()} bytes, expected {piece}")
            cell.append(torch.empty(N * piece, dtype=packed.dtype, device=packed.device))
            return self.rail_all_gather(cell[0], mine, "inter all-gather of averaged pieces on the rail")

        self._count(self.level, "all_gather", N, N * piece)
        done = self._seq_rail.submit(first, gather, packed.device, self._phase("inter all-gather of averaged pieces"))
        return span("hiersync/inter_quantized_average", after(done, lambda: cell.pop(), packed.device))

    def gather_payloads(self, packed: torch.Tensor) -> torch.futures.Future:
        """Every node's ``packed`` (equal bytes on every node) all-gathered on the rail: the
        future holds the ``N`` payloads end to end, in rail order (even nodes only). For payloads
        that cannot be summed in transit and are decoded and summed on every rank (a sparse
        codec's); through the rail's :class:`Sequencer`, in the order of these calls on every rank.
        """
        N = self.rail_nodes()
        if N == 1:
            return completed(packed, packed.device)
        gathered = torch.empty(N * packed.numel(), dtype=packed.dtype, device=packed.device)
        phase = self._phase("inter all-gather of payloads on the rail")
        self._count(self.level, "all_gather", N, gathered.numel() * gathered.element_size())
        done = self._seq_rail.submit(
            ready_now(packed.device), lambda: self.rail_all_gather(gathered, packed, phase), packed.device, phase
        )
        return span("hiersync/inter_gathered_average", after(done, lambda: gathered, packed.device))

    def rail_all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        """Piece ``j`` of ``tensor`` to rail rank ``j``, piece ``j`` of ``out`` from it."""
        return self.rail.all_to_all(out, tensor, what)

    def rail_all_gather(self, out: torch.Tensor, tensor: torch.Tensor, what: str) -> torch.futures.Future:
        """Every rail rank's ``tensor`` into ``out``, in rail order."""
        return self.rail.all_gather(out, tensor, what)

    def gather_node(self, out: torch.Tensor, shard: torch.Tensor) -> torch.futures.Future:
        """All-gather the node's shards (``L * len(shard)`` values) into ``out``; the future holds it."""
        L = self.groups.node_size
        if L == 1:
            out.copy_(shard)
            return completed(out, out.device)
        n = shard.numel()
        if out.numel() != L * n:
            raise ValueError(f"gather_node: out has {out.numel()} values, needs {L} x {n}")
        done = self._gather_shards(lambda: (out, shard), n, out, ready_now(out.device), "parameter gather")
        return after(done, lambda: out, out.device)

    def gather_node_after(
        self,
        ready: torch.futures.Future,
        make_shard: Callable[[], torch.Tensor],
        like: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.futures.Future:
        """Once ``ready`` is done, all-gather the node's shards ``make_shard()`` into a new vector.

        ``make_shard`` runs once ``ready`` is done, on hiersync's side stream (a backend
        thread on gloo), and returns this rank's shard, ``len(like)`` values of ``like``'s
        dtype and device; the output (``L`` shards) is allocated then, so it exists only
        from then on. The gather is issued in the order of the calls to this method (not
        in the order the ``ready`` futures complete), so the node's ranks issue the same
        gathers in the same order. The future holds the gathered vector; it fails with
        ``ready``'s or ``make_shard``'s error. Needs L > 1. ``out``: the output, given (a shard
        that is its own slot of ``out`` is not copied).
        """
        L = self.groups.node_size
        if L == 1:
            raise ValueError("gather_node_after needs a node of more than one rank")
        n = like.numel()
        cell: list[torch.Tensor] = []

        def buffers() -> tuple[torch.Tensor, torch.Tensor]:
            shard = make_shard()
            if shard.numel() != n:
                raise ValueError(f"gather_node_after: the shard has {shard.numel()} values, expected {n}")
            cell.append(out if out is not None else torch.empty(L * n, dtype=shard.dtype, device=shard.device))
            return cell[0], shard

        done = self._gather_shards(buffers, n, like, ready, "parameter gather")
        return after(done, lambda: cell.pop(), like.device)
