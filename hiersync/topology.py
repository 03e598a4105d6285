"""Who is on which node, and the process groups that follow from it.

Vocabulary (used everywhere in hiersync):

* *node*: a host. *L*: ranks per node. *N*: number of nodes.
* *local rank*: index of a rank inside its node (ranks sorted by global rank).
* *intra group*: the ranks of one node.
* *rail*: the ranks with the same local rank across nodes (local rank 0 of every node,
  local rank 1 of every node, ...). On a real cluster rail r usually maps to NIC r.
* *rack* (optional third level): a group of nodes, as a node is a group of ranks; the
  *rack rail* of a rank is its rail restricted to the nodes of its rack.

Ranks of a node need not be contiguous (``[0, 1, 0, 1]`` is two nodes of two ranks)
and nodes may hold different numbers of ranks (*uneven*: ``[0, 0, 0, 1]``).

Detection (:meth:`Topology.detect`) groups ranks by host identity: one
``all_gather_object`` of ``(hostname, GROUP_RANK)``, where ``GROUP_RANK`` is set by
torchrun for each agent, so one torchrun per emulated node is enough to make nodes on a
single host. ``HIERSYNC_NODE_IDS="0,0,1,1"`` (one node id per global rank) overrides
detection entirely. Note that ``ip netns exec`` keeps the hostname. Racks come from
``HIERSYNC_RACK_IDS`` (one rack id per global rank) or ``HIERSYNC_RACK_KEY`` (the name of an
environment variable naming the rank's rack), the same way; without either there are none.

Example::

    >>> topo = Topology.from_node_ids([0, 1, 0, 1])
    >>> topo.nodes
    ((0, 2), (1, 3))
    >>> topo.ranks_per_node, topo.local_rank(2), topo.rail(1)
    (2, 1, (2, 3))
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "Topology",
    "Groups",
    "ENV_NODE_IDS",
    "ENV_NODE_KEY",
    "ENV_RACK_IDS",
    "ENV_RACK_KEY",
    "parse_node_ids",
    "world_timeout",
    "check_layout",
]

logger = logging.getLogger(__name__)

ENV_NODE_IDS = "HIERSYNC_NODE_IDS"
ENV_NODE_KEY = "HIERSYNC_NODE_KEY"
"""The *name* of an environment variable whose value, read on each rank, names its node
(e.g. ``SLURM_NODEID``, or a Kubernetes node name passed through the downward API)."""
ENV_RACK_IDS = "HIERSYNC_RACK_IDS"
"""One rack id per global rank (``"0,0,0,0,1,1,1,1"``): the third level, nodes grouped into racks."""
ENV_RACK_KEY = "HIERSYNC_RACK_KEY"
"""The *name* of an environment variable whose value, read on each rank, names its rack
(e.g. a topology label of the scheduler: Kubernetes' ``topology.kubernetes.io/zone`` passed
through the downward API, or a Slurm switch name)."""


def world_timeout(process_group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The timeout the job gave its world process group (``init_process_group(timeout=...)``).

    ``new_group`` would otherwise default to torch's own (30 min on gloo, 10 min on NCCL),
    whatever the job asked for. Read from the group's backend options (gloo and NCCL both
    keep it as ``options._timeout``; a CUDA group's NCCL backend first, then its CPU one);
    ``None`` where the backend does not expose it (then torch's default applies).
    """
    import torch
    import torch.distributed as dist

    pg = process_group if process_group is not None else dist.group.WORLD
    if pg is None:
        return None
    for device in ("cuda", "cpu"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    return None


def parse_node_ids(text: str, world_size: int | None = None, env: str = ENV_NODE_IDS) -> list[int]:
    """Parse ``"0,0,1,1"`` (one node id per global rank; ``env``: whose value it is) into ints."""
    what = "rack" if env == ENV_RACK_IDS else "node"
    parts = [p.strip() for p in text.split(",")]
    ids: list[int] = []
    for i, p in enumerate(parts):
        try:
            ids.append(int(p))
        except ValueError:
            raise ValueError(
                f"{env}={text!r}: entry {i} ({p!r}) is not an integer; "
                f"expected one integer {what} id per global rank, e.g. '0,0,1,1'"
            ) from None
    if world_size is not None and len(ids) != world_size:
        raise ValueError(
            f"{env}={text!r} has {len(ids)} entries but the world has {world_size} ranks; "
            f"give exactly one {what} id per global rank"
        )
    return ids


def _keys_from_env(ids_env: str, key_env: str, world: int, process_group) -> tuple[list[object] | None, str]:
    """One key per global rank from ``ids_env`` (a list) or ``key_env`` (a variable's name, read on
    every rank: collective), and where they came from; ``(None, "")`` when neither is set."""
    import torch.distributed as dist

    text = os.environ.get(ids_env)
    if text:
        return list(parse_node_ids(text, world, ids_env)), ids_env
    var = os.environ.get(key_env, "").strip()
    if not var:
        return None, ""
    keys: list[object] = [None] * world
    dist.all_gather_object(keys, os.environ.get(var), group=process_group)
    missing = [r for r, k in enumerate(keys) if k is None]
    if missing:
        raise ValueError(
            f"{key_env}={var} but {var} is not set on ranks {missing[:8]}: set it on every rank "
            f"(e.g. {ENV_NODE_KEY}=SLURM_NODEID under srun) or unset {key_env}"
        )
    return keys, f"{key_env}={var}"


@dataclass(frozen=True)
class Topology:
    """Assignment of global ranks to nodes. Pure data: building it needs no process group."""

    nodes: tuple[tuple[int, ...], ...]
    """Global ranks of each node, each tuple sorted; nodes ordered by their lowest rank."""
    _node_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _local: tuple[int, ...] = field(init=False, repr=False, compare=False)
    source: str = field(default="", repr=False, compare=False)
    """How the nodes were found (``Topology.detect``), for the log."""
    racks: tuple[tuple[int, ...], ...] | None = None
    """The third level, if any: the node indices of each rack (nodes ordered as ``nodes``)."""

    def __post_init__(self) -> None:
        ranks = sorted(r for node in self.nodes for r in node)
        if not self.nodes or any(len(n) == 0 for n in self.nodes):
            raise ValueError(f"every node needs at least one rank, got nodes={self.nodes!r}")
        if ranks != list(range(len(ranks))):
            raise ValueError(f"nodes={self.nodes!r} must cover global ranks 0..{len(ranks) - 1} exactly once each")
        node_of = [0] * len(ranks)
        local = [0] * len(ranks)
        for n, members in enumerate(self.nodes):
            for i, r in enumerate(members):
                node_of[r] = n
                local[r] = i
        object.__setattr__(self, "_node_of", tuple(node_of))
        object.__setattr__(self, "_local", tuple(local))
        if self.racks is not None:
            flat = sorted(n for rack in self.racks for n in rack)
            if any(len(r) == 0 for r in self.racks) or flat != list(range(len(self.nodes))):
                raise ValueError(
                    f"racks={self.racks!r} must hold node indices 0..{len(self.nodes) - 1} exactly once each"
                )
            object.__setattr__(self, "racks", tuple(tuple(sorted(r)) for r in sorted(self.racks, key=min)))

    # ----------------------------------------------------------------- builders
    @classmethod
    def from_node_ids(cls, node_ids: Sequence[int], rack_ids: Sequence[object] | None = None) -> Topology:
        """Build from one node id per global rank, e.g. ``[0, 0, 1, 1]``; ``rack_ids``: one rack
        id per global rank (the same for every rank of a node), e.g. ``[0, 0, 0, 0, 1, 1, 1, 1]``.

        Node ids are arbitrary hashable integers; nodes are renumbered by their lowest rank.
        """
        topo = cls._from_node_ids(node_ids)
        return topo if rack_ids is None else topo.with_racks(rack_ids)

    def with_racks(self, rack_ids: Sequence[object], source: str = "the given rack ids") -> Topology:
        """This topology with its nodes grouped into racks: ``rack_ids`` holds one key per global
        rank (equal keys: the same rack; every rank of a node in one rack)."""
        if isinstance(rack_ids, (str, bytes)) or len(rack_ids) != self.world_size:
            raise ValueError(
                f"rack_ids={rack_ids!r}: give one rack id per global rank ({self.world_size} of them), "
                "e.g. [0, 0, 0, 0, 1, 1, 1, 1]"
            )
        of_node: list[object] = []
        for node in self.nodes:
            ids = {rack_ids[r] for r in node}
            if len(ids) != 1:
                raise ValueError(
                    f"the ranks {list(node)} of one node have rack ids {sorted(map(str, ids))}: every rank of a "
                    f"node must name the same rack (fix {ENV_RACK_IDS} or {ENV_RACK_KEY})"
                )
            of_node.append(ids.pop())
        racks: dict[object, list[int]] = {}
        for n, rid in enumerate(of_node):
            racks.setdefault(rid, []).append(n)
        where = f"{self.source}; racks from {source}" if self.source else f"racks from {source}"
        return Topology(nodes=self.nodes, source=where, racks=tuple(tuple(r) for r in racks.values()))

    @classmethod
    def _from_node_ids(cls, node_ids: Sequence[int]) -> Topology:
        if isinstance(node_ids, (str, bytes)) or not hasattr(node_ids, "__len__"):
            raise TypeError(f"node_ids must be a sequence of ints (one per global rank), got {node_ids!r}")
        if len(node_ids) == 0:
            raise ValueError("node_ids is empty: give one node id per global rank, e.g. [0, 0, 1, 1]")
        groups: dict[int, list[int]] = {}
        for rank, nid in enumerate(node_ids):
            if isinstance(nid, bool) or not isinstance(nid, int):
                raise ValueError(
                    f"node_ids[{rank}]={nid!r} is not an integer; give one integer node id per global rank"
                )
            groups.setdefault(nid, []).append(rank)
        return cls(nodes=tuple(tuple(g) for g in sorted(groups.values(), key=lambda g: g[0])))

    @classmethod
    def from_keys(cls, keys: Sequence[object]) -> Topology:
        """Build from one host key per global rank (ranks with equal keys share a node)."""
        ids: dict[object, int] = {}
        return cls.from_node_ids([ids.setdefault(k, len(ids)) for k in keys])

    @classmethod
    def detect(cls, process_group: dist.ProcessGroup | None = None) -> Topology:
        """Detect the topology of ``process_group`` (default: the world). Collective.

        ``HIERSYNC_NODE_IDS`` overrides detection; otherwise ranks are grouped by
        ``(hostname, GROUP_RANK)`` gathered from every rank.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Topology.detect() needs an initialized process group: call "
                "torch.distributed.init_process_group() first (or use Topology.from_node_ids)"
            )
        world = dist.get_world_size(process_group)
        topo = cls._detect_nodes(world, process_group)
        rack_keys, where = _keys_from_env(ENV_RACK_IDS, ENV_RACK_KEY, world, process_group)
        return topo if rack_keys is None else topo.with_racks(rack_keys, where)

    @classmethod
    def _detect_nodes(cls, world: int, process_group) -> Topology:
        import torch.distributed as dist

        keys, where = _keys_from_env(ENV_NODE_IDS, ENV_NODE_KEY, world, process_group)
        if keys is None:
            key = (socket.gethostname(), os.environ.get("GROUP_RANK", ""))
            keys = [None] * world
            dist.all_gather_object(keys, key, group=process_group)
            where = "hostname + GROUP_RANK"
        topo = cls.from_keys(keys)
        object.__setattr__(topo, "source", where)
        return topo

    # ----------------------------------------------------------------- queries
    @property
    def world_size(self) -> int:
        return len(self._node_of)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def even(self) -> bool:
        """Whether every node has the same number of ranks."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def ranks_per_node(self) -> int:
        """L. Raises on uneven topologies, where it is not defined."""
        if not self.even:
            raise ValueError(f"ranks_per_node is undefined for uneven nodes {self.nodes}")
        return len(self.nodes[0])

    @property
    def max_ranks_per_node(self) -> int:
        return max(len(n) for n in self.nodes)

    def node_of(self, rank: int) -> int:
        return self._node_of[self._check(rank)]

    def local_rank(self, rank: int) -> int:
        return self._local[self._check(rank)]

    def node_ranks(self, rank: int) -> tuple[int, ...]:
        """Ranks on the same node as ``rank`` (its intra group)."""
        return self.nodes[self.node_of(rank)]

    def rail(self, local_rank: int) -> tuple[int, ...]:
        """Global ranks with local rank ``local_rank``, one per node that has it, by node."""
        if not 0 <= local_rank < self.max_ranks_per_node:
            raise ValueError(f"local_rank {local_rank} out of range 0..{self.max_ranks_per_node - 1}")
        return tuple(n[local_rank] for n in self.nodes if local_rank < len(n))

    @property
    def rails(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.rail(i) for i in range(self.max_ranks_per_node))

    # ----------------------------------------------------------------- racks
    def rack_of(self, rank: int) -> int:
        """Index of the rack that holds ``rank`` (needs racks)."""
        if self.racks is None:
            raise ValueError(f"this topology has no racks: set {ENV_RACK_IDS} or {ENV_RACK_KEY}")
        node = self.node_of(rank)
        return next(i for i, r in enumerate(self.racks) if node in r)

    def rack_rail(self, rank: int) -> tuple[int, ...]:
        """``rank``'s rail restricted to the nodes of its rack (one rank per node there)."""
        rack = self.racks[self.rack_of(rank)] if self.racks is not None else ()
        lr = self.local_rank(rank)
        return tuple(self.nodes[n][lr] for n in rack if lr < len(self.nodes[n]))

    @property
    def rack_rails(self) -> tuple[tuple[int, ...], ...]:
        """Every rack's rails (rack by rack, local rank by local rank)."""
        if self.racks is None:
            return ()
        out = []
        for rack in self.racks:
            for lr in range(max(len(self.nodes[n]) for n in rack)):
                out.append(tuple(self.nodes[n][lr] for n in rack if lr < len(self.nodes[n])))
        return tuple(out)

    @property
    def leaders(self) -> tuple[int, ...]:
        """Local rank 0 of every node (rail 0)."""
        return self.rail(0)

    def describe(self) -> str:
        shape = f"{self.num_nodes}x{len(self.nodes[0])}" if self.even else "uneven"
        nodes = list(map(list, self.nodes))
        shown = nodes if len(nodes) <= 4 else [*nodes[:2], "...", nodes[-1]]
        how = f", detected from {self.source}" if self.source else ""
        sizes = sorted({len(r) for r in self.racks or ()})
        racks = "" if self.racks is None else f" in {len(self.racks)} racks of {sizes} nodes"
        return (
            f"{shape} ({self.num_nodes} nodes{racks}, {self.max_ranks_per_node} ranks per node at most, "
            f"{len(self.rails)} rails, world {self.world_size}{how}): {shown}"
        )

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in this topology (world size {self.world_size})")
        return rank

    # ----------------------------------------------------------------- groups
    def build_groups(self, process_group: dist.ProcessGroup | None = None, timeout=None, racks: bool = False) -> Groups:
        """Create this rank's intra and rail groups (``racks``: and its rack rail). Collective:
        every rank must call it.

        ``new_group`` must be called by every rank for every group in the same order, so
        all nodes' groups are created everywhere and each rank keeps its own.
        ``process_group`` must be the world: hiersync's groups are subgroups of it.
        """
        import torch.distributed as dist

        if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
            raise ValueError(
                "hiersync needs the default (world) process group; got a subgroup of size "
                f"{dist.get_world_size(process_group)} (world {dist.get_world_size()})"
            )
        rank = dist.get_rank()
        if self.world_size != dist.get_world_size():
            raise ValueError(
                f"topology has {self.world_size} ranks but the process group has {dist.get_world_size()}; "
                "detect it with Topology.detect() or fix HIERSYNC_NODE_IDS"
            )
        if timeout is None:
            timeout = world_timeout(process_group)
        kw = {} if timeout is None else {"timeout": timeout}
        logger.debug("hiersync: subgroups use timeout %s", timeout)

        def make(ranks_list: Sequence[Sequence[int]], desc: str, **more) -> dist.ProcessGroup | None:
            # group_desc names the group in NCCL's flight recorder and watchdog messages
            mine = None
            for i, ranks in enumerate(ranks_list):
                name = desc.format(i=i)
                try:
                    g = dist.new_group(list(ranks), group_desc=name, **kw, **more)
                except TypeError:  # torch without group_desc
                    g = dist.new_group(list(ranks), **kw, **more)
                if rank in ranks:
                    mine = g
            return mine

        def make_gloo(ranks_list: Sequence[Sequence[int]], desc: str) -> dist.ProcessGroup | None:
            return make(ranks_list, desc, backend="gloo")

        # Two intra groups: the second carries collectives that are launched from future
        # callbacks (all-gathers after the rail leg); keeping them off the first group means
        # every group sees its collectives issued in one deterministic order on every rank.
        intra = make(self.nodes, "hiersync/intra{i}")
        intra_late = make(self.nodes, "hiersync/intra{i}_late")
        rail = make(self.rails, "hiersync/rail{i}")
        rack_rail = make(self.rack_rails, "hiersync/rack_rail{i}") if racks else None
        # The tally of each sync (samples, step times; hiersync.tally): a few values, on the host
        # (gloo): over each rail, the node's sum taken on the node's group first; over the world
        # where nodes differ in size (a rail then misses nodes).
        tally = tally_intra = None
        if self.num_nodes > 1:
            if self.even:
                tally = make_gloo(self.rails, "hiersync/tally_rail{i}")
                tally_intra = (
                    make_gloo(self.nodes, "hiersync/tally_intra{i}") if max(map(len, self.nodes)) > 1 else None
                )
            else:
                tally = make_gloo([range(self.world_size)], "hiersync/tally")
        return Groups(
            topology=self,
            rank=rank,
            intra=intra,
            intra_late=intra_late,
            rail=rail,
            rack_rail=rack_rail,
            tally=tally,
            tally_intra=tally_intra,
        )


@dataclass
class Groups:
    """This rank's process groups. ``None`` where the group would hold only this rank.

    Where the rank sits (its node, local rank, rail) is read once here, so the collectives
    of a sync read plain attributes."""

    topology: Topology
    rank: int
    intra: dist.ProcessGroup | None
    intra_late: dist.ProcessGroup | None
    rail: dist.ProcessGroup | None
    rack_rail: dist.ProcessGroup | None = None
    """The rail inside this rank's rack (built only for a rack level)."""
    tally: dist.ProcessGroup | None = None
    """gloo: where each sync's tally is all-reduced (:mod:`hiersync.tally`): this rank's rail, or the
    world where nodes differ in size; None on one node."""
    tally_intra: dist.ProcessGroup | None = None
    """gloo: the node's ranks, whose counts the tally sums first (even nodes of several ranks)."""
    node: tuple[int, ...] = field(init=False)
    """The global ranks of this rank's node."""
    local_rank: int = field(init=False)
    node_size: int = field(init=False)
    rail_ranks: tuple[int, ...] = field(init=False)
    """The global ranks of this rank's rail, one per node that has its local rank."""
    is_leader: bool = field(init=False)
    even: bool = field(init=False)
    """Whether every node has the same number of ranks."""

    def __post_init__(self) -> None:
        topo = self.topology
        self.node = topo.node_ranks(self.rank)
        self.local_rank = topo.local_rank(self.rank)
        self.node_size = len(self.node)
        self.rail_ranks = topo.rail(self.local_rank)
        self.is_leader = self.local_rank == 0
        self.even = topo.even

    @property
    def rail_size(self) -> int:
        return len(self.rail_ranks)

    def destroy(self) -> None:
        """Destroy this rank's groups (local; collectives on them fail afterwards). Nothing to do
        once the job's ``destroy_process_group()`` destroyed its world, these groups with it."""
        import torch.distributed as dist

        mine = (self.intra, self.intra_late, self.rail, self.rack_rail, self.tally, self.tally_intra)
        if dist.is_initialized():
            for g in {id(g): g for g in mine if g is not None}.values():
                dist.destroy_process_group(g)
        self.intra = self.intra_late = self.rail = self.rack_rail = self.tally = self.tally_intra = None


def check_layout(topo: Topology, period: int, rank: int, detail: str = "") -> list[str]:
    """Log the topology once (rank 0) and warn about a layout that would silently defeat
    hierarchical sync.

    Returns the warnings (also issued as ``UserWarning`` and logged; the layout-wide ones
    on rank 0 only, the per-node one on each node's first rank).
    """
    import warnings

    if rank == 0:
        logger.info("hiersync: topology %s%s", topo.describe(), f"; {detail}" if detail else "")
    out = []
    fix = (
        f"if the real nodes hold several ranks, name them with {ENV_NODE_KEY} (e.g. {ENV_NODE_KEY}=SLURM_NODEID, "
        "or a Kubernetes node name passed through the downward API)"
    )
    if rank == 0 and period > 1 and topo.max_ranks_per_node == 1 and topo.world_size > 1:
        out.append(
            f"hiersync: every node holds one rank (detected from {topo.source or 'node ids'}), so local steps "
            f"average nothing and period={period} is per-GPU local SGD; {fix}"
        )
    if rank == 0 and period > 1 and topo.num_nodes == 1 and topo.world_size > 1:
        out.append(
            f"hiersync: all {topo.world_size} ranks are on one node (detected from {topo.source or 'node ids'}), "
            f"so period={period} saves no inter-node traffic; containers sharing one hostname? {fix}"
        )
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
    node = topo.node_ranks(rank)
    if local_world.isdigit() and rank == node[0] and len(node) > int(local_world):
        out.append(
            f"hiersync: node {topo.node_of(rank)} holds {len(node)} ranks but torchrun's LOCAL_WORLD_SIZE is "
            f"{local_world} (several agents share one hostname?); {fix}"
        )
    for msg in out:
        logger.warning("%s", msg)
        warnings.warn(msg, UserWarning, stacklevel=3)
    return out
