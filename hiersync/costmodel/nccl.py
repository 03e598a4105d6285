"""NCCL's tuning model: which algorithm and protocol NCCL runs, and how long that takes.

NCCL picks, for every collective call, the (algorithm, protocol) pair its tuner predicts to
be fastest (``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in NCCL's
``src/graph/tuning.cc``): Ring, Tree, NVLS (NVLink SHARP inside one node) or NVLSTree
(NVLS inside the node, a tree between nodes), each in the LL, LL128 or Simple protocol.
This module re-implements that model (not NCCL's code) on a :class:`Fabric`, the handful of
numbers the tuner reads: the node's ring and NVLS bus bandwidths, the NICs, the channels, the
GPU generation, and the network's latency. Its tables are NCCL's published constants (NCCL
master, 2026):

* base latencies per algorithm and protocol, and hop latencies per link class (NVLink, PCI,
  network): :data:`BASE_LATENCY_US`, :data:`HOP_LATENCY_US`;
* bandwidth refinements per protocol: LL runs at half the link and is capped
  (:data:`LL_MAX_BUSBW_ONE_NODE`, :data:`LL_MAX_BUSBW_NODES` by host CPU), LL128 at 0.92 of it with a
  per-channel cap, the tree at 0.92 of it with per-channel caps (:data:`PER_CHANNEL_MAX`),
  and the tree's mid-size correction (:data:`TREE_CORRECTION`, 64 B to 256 MiB);
* the step counts: a ring all-reduce crosses ``2(p - 1)`` steps, ``2(N - 1)`` of them
  between nodes; a tree ``2(L - 1)`` NVLink hops and ``2 floor(log2 N)`` network hops;
  NVLSTree one NVLS hop and ``2 floor(log2 N)`` network hops;
* the two-node case: NVLSTree (and the tree, where the node's links allow it) moves ``n``,
  not ``2n``, through each node's NICs, so the tuner doubles their bandwidth at N <= 2;
* the ring's "plateau": its latency times 1.4 once each channel carries 64 bytes per rank.

Choosing and pricing are two steps, as on a real cluster. :func:`tuner_choices` is what
NCCL's tuner estimates, from what it is told (the network plugin's *reported* latency,
:attr:`Fabric.tuner_net_latency_us`); :func:`allreduce` takes its pick and prices it with
:func:`allreduce_choices`, which adds what the tuner leaves out: the fabric's *measured*
step latency (:attr:`Fabric.net_latency_us`); the tree's network posts, one per chunk,
channel and message at NCCL's own post overhead (:func:`_tree_posts_s`; NCCL charges it to
ring steps only); and NVLS's and NVLSTree's mid-size shortfall on Hopper (NCCL corrects only
its trees there; the same table, :data:`NVLS_SIZE_CORRECTION`); and the switch tiers a job
spans beyond one leaf (:func:`switch_tiers`), each keeping :attr:`Fabric.tier_efficiency` of
the network bandwidth (flows hashed onto shared uplinks collide; NCCL's tuner assumes a flat
network).

Bandwidths follow NCCL's convention: a *bus* bandwidth (``busbw``, the figure nccl-tests
prints for rings), turned into the algorithm bandwidth by ``p / (2(p - 1))`` for ring, NVLS
and NVLSTree and by 1/2 for the tree. Pure: no torch.

Example::

    >>> fab = Fabric(nodes=1, ranks_per_node=8, ring_busbw=370e9, nvls_busbw=480e9, nic_busbw=376e9)
    >>> allreduce(2**20, fab).algorithm, allreduce(2**26, fab).algorithm
    ('ring', 'nvls')
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

__all__ = [
    "ALGORITHMS",
    "PROTOCOLS",
    "GPU_GENERATIONS",
    "INTRA_LINKS",
    "BASE_LATENCY_US",
    "HOP_LATENCY_US",
    "LL_MAX_BUSBW_ONE_NODE",
    "LL_MAX_BUSBW_NODES",
    "HOST_CPUS",
    "NET_OVERHEAD_US",
    "PER_CHANNEL_MAX",
    "TREE_CORRECTION",
    "NVLS_SIZE_CORRECTION",
    "RING_PLATEAU",
    "TREE_CHUNK_BYTES",
    "Fabric",
    "Choice",
    "tuner_choices",
    "allreduce_choices",
    "allreduce",
    "ring_collective",
    "switch_tiers",
]

ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree")
PROTOCOLS = ("LL", "LL128", "Simple")
GPU_GENERATIONS = ("volta", "ampere", "hopper", "blackwell")
INTRA_LINKS = ("nvlink", "pci")

# Microseconds, per protocol (LL, LL128, Simple).
BASE_LATENCY_US: dict[str, tuple[float, float, float]] = {
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
}
HOP_LATENCY_US: dict[str, dict[str, tuple[float, float, float]]] = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0, 0, 25.0), "nvls_tree": (0, 0, 25.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0, 0, 18.0), "nvls_tree": (0, 0, 20.9)},
}
# LL's busbw cap (GB/s): on one node by GPU generation; across nodes by the host CPU, indexed
# by N = 2 and N > 2 (NCCL uses its AMD row for AMD hosts, its Intel row for every other).
LL_MAX_BUSBW_ONE_NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
LL_MAX_BUSBW_NODES = {"intel": (39.0, 20.4), "amd": (22.5, 19.0), "arm": (39.0, 20.4)}
HOST_CPUS = ("intel", "amd", "arm")
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0, "arm": 1.0}
"""Microseconds the host's proxy thread spends posting one network message (NCCL's
``NCCL_NET_OVERHEAD`` defaults, by host CPU). NCCL charges it to every ring step between
nodes; the price charges it to every tree chunk too (:func:`_tree_posts_s`)."""
# Per-channel busbw caps (GB/s), indexed by N = 1, N = 2, N > 2.
PER_CHANNEL_MAX: dict[str, dict[str, tuple[float, float, float]]] = {
    "ring_ll128": {
        "volta": (20.0, 20.0, 20.0),
        "ampere": (20.0, 20.0, 20.0),
        "hopper": (36.7, 36.7, 36.7),
        "blackwell": (40.0, 40.0, 40.0),
    },
    "tree": {
        "volta": (26.5, 18.5, 10.0),
        "ampere": (24.0, 23.6, 17.8),
        "hopper": (38.7, 41.4, 36.0),
        "blackwell": (70.0, 42.8, 24.0),
    },
    "tree_ll128": {
        "volta": (20.0, 20.0, 20.0),
        "ampere": (20.0, 20.0, 20.0),
        "hopper": (36.7, 36.7, 29.0),
        "blackwell": (55.6, 31.67, 20.0),
    },
    "nvls_tree": {
        "volta": (26.5, 18.5, 10.0),
        "ampere": (24.0, 23.6, 17.8),
        "hopper": (0.0, 57.7, 45.5),
        "blackwell": (0.0, 96.0, 80.0),
    },
}
# Trees fall short of the model at medium sizes; NCCL scales their bandwidth by these
# factors, per protocol, for message sizes 64 B * 2^i (i = 0..23).
TREE_CORRECTION: dict[str, tuple[float, ...]] = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}  # fmt: skip
NVLS_SIZE_CORRECTION = True
"""Price NVLS (one node) and NVLSTree on Hopper with :data:`TREE_CORRECTION` (Simple) too, as
NCCL's tuner does for its trees (and for NVLSTree on Blackwell); see :func:`_size_factor`."""
RING_PLATEAU = 1.4
"""The multi-node Simple ring's latency factor once a channel moves >= 64 bytes per rank (Ampere on)."""
TREE_CHUNK_BYTES = {"LL": 32768, "LL128": 576000, "Simple": 524288}
"""Bytes of data a tree moves per step and channel (``calcCollChunking`` in NCCL's
``src/enqueue.cc``, on its default buffers): a 64 KiB LL step holds 32 KiB of data, an LL128
step 576,000 B (halved for smaller messages, :func:`_tree_chunk`), a Simple step 512 KiB
(4 MiB / 8 steps)."""
_NVLS_CHANNELS = 16  # NVLS needs no more than 16 channels for its peak


@dataclass(frozen=True, kw_only=True)
class Fabric:
    """What NCCL's tuner reads about a communicator: its shape and its links.

    Bandwidths are bytes per second of *bus* bandwidth (nccl-tests' busbw) of the whole
    node: ``ring_busbw`` is what a ring all-reduce inside one node reaches (e.g. ~370 GB/s
    on 8 x H100), ``nvls_busbw`` the NVLS all-reduce (~480 GB/s; None where NVLink SHARP is
    absent), ``nic_busbw`` all the node's NICs together (what a ring across nodes reaches).
    """

    nodes: int
    ranks_per_node: int
    ring_busbw: float
    nic_busbw: float
    nvls_busbw: float | None = None
    channels: int = 16
    """Ring/tree channels (NCCL's ``nChannels``); only per-channel caps read it."""
    gpu: str = "hopper"
    """GPU generation (:data:`GPU_GENERATIONS`): selects NCCL's per-channel caps."""
    intra_link: str = "nvlink"
    """``"nvlink"`` or ``"pci"``: the hop latencies inside the node; LL128 needs NVLink."""
    net_latency_us: float = 0.0
    """Microseconds the fabric adds to every inter-node step on top of NCCL's network hop
    latencies (twice with the Simple protocol, whose receiver flushes): 0 for NCCL's own
    InfiniBand/RoCE transport, which those constants describe; measured (``python -m
    hiersync calibrate`` fits it) on fabrics behind a network plugin."""
    tuner_net_latency_us: float | None = None
    """Microseconds the network plugin *reports* to NCCL (``ncclNetProperties_t.latency``):
    what NCCL's tuner chooses by. None: :attr:`net_latency_us`. aws-ofi-nccl reports 75 on
    p4d/p5, whatever the wire does (its platform table)."""
    host_cpu: str = "intel"
    """The nodes' CPU vendor (:data:`HOST_CPUS`): NCCL caps LL's bandwidth across nodes by it
    (:data:`LL_MAX_BUSBW_NODES`) and charges its network post overhead (:data:`NET_OVERHEAD_US`)."""
    leaf_nodes: int = 0
    """Nodes one leaf switch (one switch of a rail) connects; a job on more spans
    :func:`switch_tiers` tiers above it. 0: one flat switch, no tiers (NCCL's own model)."""
    tier_efficiency: float = 1.0
    """Fraction of the network bandwidth kept per switch tier a job spans above its leaf: the
    flows that cross the upper tiers are hashed onto shared uplinks, collide, and the pipelined
    ring or tree runs at its slowest link. 1: no loss (InfiniBand's adaptive routing)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1 or self.channels < 1:
            raise ValueError(f"nodes, ranks_per_node and channels must be >= 1, got {self}")
        if self.gpu not in GPU_GENERATIONS:
            raise ValueError(f"unknown gpu generation {self.gpu!r}; valid: {', '.join(GPU_GENERATIONS)}")
        if self.intra_link not in INTRA_LINKS:
            raise ValueError(f"unknown intra_link {self.intra_link!r}; valid: {', '.join(INTRA_LINKS)}")
        for name in ("ring_busbw", "nic_busbw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Fabric.{name} must be > 0 bytes/s, got {getattr(self, name)!r}")
        if self.nvls_busbw is not None and not self.nvls_busbw > 0:
            raise ValueError(f"Fabric.nvls_busbw must be > 0 or None (no NVLS), got {self.nvls_busbw!r}")
        if not self.net_latency_us >= 0:
            raise ValueError(f"Fabric.net_latency_us must be >= 0, got {self.net_latency_us!r}")
        if self.host_cpu not in HOST_CPUS:
            raise ValueError(f"unknown host_cpu {self.host_cpu!r}; valid: {', '.join(HOST_CPUS)}")
        if (
            isinstance(self.leaf_nodes, bool)
            or not isinstance(self.leaf_nodes, int)
            or self.leaf_nodes == 1
            or self.leaf_nodes < 0
        ):
            raise ValueError(f"Fabric.leaf_nodes must be 0 (one flat switch) or an int >= 2, got {self.leaf_nodes!r}")
        if not 0 < self.tier_efficiency <= 1:
            raise ValueError(f"Fabric.tier_efficiency must be in (0, 1] (1: no loss), got {self.tier_efficiency!r}")
        if self.tuner_net_latency_us is not None and not self.tuner_net_latency_us >= 0:
            raise ValueError(
                f"Fabric.tuner_net_latency_us must be >= 0 or None (as measured), got {self.tuner_net_latency_us!r}"
            )

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class Choice:
    """One (algorithm, protocol) the tuner considers, and the time it predicts for it."""

    algorithm: str
    protocol: str
    latency_s: float
    algbw: float
    """Algorithm bandwidth in bytes/s (message bytes per second), size corrections included."""
    time_s: float


def switch_tiers(nodes: int, leaf_nodes: int) -> int:
    """Switch tiers a job of ``nodes`` spans above its leaf, in a fat tree whose every switch
    joins ``leaf_nodes`` units of the tier below: 0 within one leaf (or ``leaf_nodes`` 0, a flat
    network), 1 up to ``leaf_nodes**2`` nodes, 2 up to ``leaf_nodes**3``.

    >>> [switch_tiers(n, 8) for n in (8, 16, 64, 65, 248)]
    [0, 1, 1, 2, 2]
    """
    if leaf_nodes < 2:
        return 0
    tiers, reach = 0, leaf_nodes
    while reach < nodes:
        tiers, reach = tiers + 1, reach * leaf_nodes
    return tiers


def _tier_factor(fab: Fabric) -> float:
    """The network bandwidth a job keeps across its switch tiers: ``tier_efficiency ** tiers``."""
    return fab.tier_efficiency ** switch_tiers(fab.nodes, fab.leaf_nodes) if fab.nodes > 1 else 1.0


def _node_index(nodes: int) -> int:
    return 0 if nodes == 1 else 1 if nodes == 2 else 2


def _bus_bandwidths(fab: Fabric) -> dict[str, float]:
    """Bus bandwidth (GB/s) per algorithm for an all-reduce, before protocol refinements; 0 = not run."""
    gb = 1e-9
    n, lpn = fab.nodes, fab.ranks_per_node
    ring, nic = fab.ring_busbw * gb, fab.nic_busbw * gb
    out = {"ring": ring if n == 1 else min(ring, nic), "nvls": 0.0, "nvls_tree": 0.0}
    # A tree's channels cross each node's NICs with 2n bytes, but only n on two nodes (each
    # node is the root of one of the two trees): the tuner lets its intra bandwidth reach
    # twice the NICs' there.
    out["tree"] = ring if n == 1 else min(ring, (2 if n <= 2 else 1) * nic)
    if fab.nvls_busbw is not None and lpn > 1:
        nvls = fab.nvls_busbw * gb
        if n == 1:
            out["nvls"] = nvls
        else:  # NVLS across nodes needs CollNet (SHARP switches): not modelled, off
            cap = _NVLS_CHANNELS * PER_CHANNEL_MAX["nvls_tree"][fab.gpu][_node_index(n)]
            out["nvls_tree"] = min(nvls, (2 if n <= 2 else 1) * nic, cap if cap > 0 else math.inf)
    return out


def _refine(algorithm: str, protocol: str, busbw: float, fab: Fabric) -> float:
    """NCCL's per-protocol refinements of one algorithm's bus bandwidth (GB/s); 0 = not run."""
    if busbw <= 0:
        return 0.0
    if algorithm in ("nvls", "nvls_tree"):
        return busbw if protocol == "Simple" else 0.0
    if protocol == "LL128" and fab.intra_link != "nvlink":
        return 0.0  # LL128 runs only over NVLink-class paths inside the node
    idx = _node_index(fab.nodes)
    ll_max = LL_MAX_BUSBW_ONE_NODE[fab.gpu] if fab.nodes == 1 else LL_MAX_BUSBW_NODES[fab.host_cpu][idx - 1]
    ch = fab.channels
    if algorithm == "ring":
        if protocol == "LL":
            return min(ll_max, busbw * 0.5)
        if protocol == "LL128":
            return min(busbw * 0.92, ch * PER_CHANNEL_MAX["ring_ll128"][fab.gpu][idx])
        return busbw
    busbw = min(busbw * 0.92, ch * PER_CHANNEL_MAX["tree"][fab.gpu][idx])
    if protocol == "LL":
        return min(busbw / 3.8, ll_max)
    if protocol == "LL128":
        factor = 7.0 / 9.0 if fab.nodes == 1 else 120.0 / 128.0
        return min(busbw * factor, ch * PER_CHANNEL_MAX["tree_ll128"][fab.gpu][idx])
    return busbw


def _latency_us(algorithm: str, protocol: str, fab: Fabric, net_us: float) -> float:
    """NCCL's latency (us) of one all-reduce by ``algorithm`` in ``protocol``, the fabric adding
    ``net_us`` to each network step."""
    p = PROTOCOLS.index(protocol)
    n, lpn = fab.nodes, fab.ranks_per_node
    intra = HOP_LATENCY_US[fab.intra_link][algorithm][p]
    # One rank per node exposes the whole network latency: NCCL prices it as the tree's.
    inter = HOP_LATENCY_US["net"]["tree" if lpn == 1 else algorithm][p]
    inter += net_us * (2 if protocol == "Simple" else 1)  # Simple adds a flush
    lat = BASE_LATENCY_US[algorithm][p]
    if algorithm == "ring":
        steps, inter_steps = 2 * (fab.ranks - 1), (2 * (n - 1) if n > 1 else 0)
        overhead = NET_OVERHEAD_US[fab.host_cpu] * (3 if protocol == "Simple" else 1) if n > 1 else 0.0
        return lat + (steps - inter_steps) * max(intra, overhead) + inter_steps * inter
    log_n = n.bit_length() - 1  # floor(log2 N)
    if algorithm == "tree":
        return lat + 2 * ((lpn - 1) * intra + log_n * inter)
    if algorithm == "nvls":
        return intra + (inter if n > 1 else 0.0)
    return intra + 2 * log_n * inter  # nvls_tree


def _size_factor(algorithm: str, protocol: str, nbytes: float, fab: Fabric, *, tuner: bool) -> float:
    """The mid-size bandwidth correction, 1 where none applies.

    NCCL's tuner (``tuner``) corrects its trees, and NVLSTree on Blackwell. NVLS and NVLSTree
    on Hopper fall short of their bandwidth at medium sizes in the same way, as the pipelines
    they are (2-256 MiB: 0.69-0.94 of the uncorrected model on one 8 x H200 node; 0.66-0.87 at
    16-256 MiB on two H100 nodes), so the price (:data:`NVLS_SIZE_CORRECTION`) applies the
    Simple protocol's factors to them too.
    """
    if algorithm == "tree" or (algorithm == "nvls_tree" and fab.gpu == "blackwell"):
        return _table_factor(protocol, nbytes, 23 if algorithm == "tree" else 24)
    if not tuner and NVLS_SIZE_CORRECTION and algorithm in ("nvls", "nvls_tree"):
        return _table_factor("Simple", nbytes, 23 if algorithm == "nvls" else 24)
    return 1.0


def _tree_chunk(protocol: str, nbytes: float, fab: Fabric) -> float:
    """Bytes per step and channel of a tree all-reduce of ``nbytes`` (NCCL's chunking): LL128
    halves its step while a channel would hold too few of them for the tree's depth."""
    chunk = float(TREE_CHUNK_BYTES[protocol])
    if protocol == "LL128":
        ppn = fab.ranks_per_node
        depth = 1 + (fab.nodes.bit_length() - 1) + 0.1 * ppn
        per_channel = nbytes / fab.channels
        while per_channel / chunk < depth * 64 / ppn and chunk > 131072:
            chunk /= 2
        while per_channel / chunk < depth * 16 / ppn and chunk > 32768:
            chunk /= 2
    return chunk


def _tree_posts_s(protocol: str, nbytes: float, fab: Fabric) -> float:
    """Seconds a tree all-reduce spends posting network messages, which NCCL's tuner leaves out.

    Every chunk of every channel crosses the network as separate messages, each posted by the
    proxy thread at NCCL's post overhead (:data:`NET_OVERHEAD_US`): 2 per chunk and node between
    two nodes (one up, one down the tree); 4 beyond, where NCCL's double binary tree makes each
    node inner in one tree (two children and a parent: 3 messages up, 3 down) and a leaf in the
    other (1 + 1). Small and mid-size messages, cut into small chunks, pay most of it.
    """
    if fab.nodes == 1 or nbytes <= 0:
        return 0.0
    chunks = nbytes / fab.channels / _tree_chunk(protocol, nbytes, fab)
    messages = 2 if fab.nodes == 2 else 4
    return chunks * messages * NET_OVERHEAD_US[fab.host_cpu] * 1e-6


def _table_factor(protocol: str, nbytes: float, limit: int) -> float:
    index = int(nbytes) >> 6
    index = index.bit_length() - 1 if index > 0 else -1  # floor(log2(n / 64))
    return TREE_CORRECTION[protocol][index] if 0 <= index < limit else 1.0


def _choices(nbytes: float, fab: Fabric, algorithms: tuple[str, ...], *, tuner: bool) -> list[Choice]:
    n = max(float(nbytes), 0.0)
    p = fab.ranks
    if p == 1:
        return [Choice("ring", "Simple", 0.0, math.inf, 0.0)]
    bus = _bus_bandwidths(fab)
    net_us = fab.net_latency_us
    if tuner and fab.tuner_net_latency_us is not None:
        net_us = fab.tuner_net_latency_us
    out = []
    for algo in algorithms:
        for proto in PROTOCOLS:
            busbw = _refine(algo, proto, bus[algo], fab)
            if busbw <= 0:
                continue
            ratio = 0.5 if algo == "tree" else p / (2 * (p - 1))
            algbw = busbw * ratio * _size_factor(algo, proto, n, fab, tuner=tuner) * 1e9
            if not tuner:  # NCCL's tuner sees a flat network; the switch tiers cost bandwidth
                algbw *= _tier_factor(fab)
            if algo == "tree" and not tuner and n > 0:
                algbw = n / (n / algbw + _tree_posts_s(proto, n, fab))
            lat = _latency_us(algo, proto, fab, net_us) * 1e-6
            if algo == "ring" and proto == "Simple" and fab.nodes > 1 and n / (fab.channels * p) >= 64:
                lat *= RING_PLATEAU if fab.gpu != "volta" else 1.9
            out.append(Choice(algo, proto, lat, algbw, lat + n / algbw))
    return out


def tuner_choices(nbytes: float, fab: Fabric, algorithms: tuple[str, ...] = ALGORITHMS) -> list[Choice]:
    """Every (algorithm, protocol) NCCL's tuner may run for an all-reduce of ``nbytes``, with the
    time the tuner estimates: what it chooses by (the plugin's reported latency, its own
    corrections only)."""
    return _choices(nbytes, fab, algorithms, tuner=True)


def allreduce_choices(nbytes: float, fab: Fabric, algorithms: tuple[str, ...] = ALGORITHMS) -> list[Choice]:
    """Every (algorithm, protocol) NCCL may run for an all-reduce of ``nbytes``, with the time it
    takes: the tuner's estimate on the fabric's measured latency, with NVLS's mid-size shortfall,
    the tree's network posts (:func:`_tree_posts_s`) and the switch tiers' bandwidth loss
    (:func:`switch_tiers`, :attr:`Fabric.tier_efficiency`) included."""
    return _choices(nbytes, fab, algorithms, tuner=False)


@functools.lru_cache(maxsize=1 << 16)
def allreduce(nbytes: float, fab: Fabric, algorithm: str = "auto") -> Choice:
    """What NCCL runs for ``nbytes`` and its time: the (algorithm, protocol) its tuner estimates
    fastest (``"auto"``), or the tuner's protocol for a forced ``algorithm`` (``NCCL_ALGO``):
    ``"ring"``, ``"tree"``, ``"nvls"``, ``"nvls_tree"``; priced by :func:`allreduce_choices`."""
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown NCCL algorithm {algorithm!r}; valid: auto, {', '.join(ALGORITHMS)}")
    algorithms = ALGORITHMS if algorithm == "auto" else (algorithm,)
    estimates = tuner_choices(nbytes, fab, algorithms)
    if not estimates:
        raise ValueError(f"NCCL cannot run {algorithm!r} on {fab.nodes} nodes x {fab.ranks_per_node} ranks")
    pick = min(estimates, key=lambda c: c.time_s)
    return next(
        c
        for c in allreduce_choices(nbytes, fab, (pick.algorithm,))
        if (c.algorithm, c.protocol) == (pick.algorithm, pick.protocol)
    )


@functools.lru_cache(maxsize=1 << 14)
def ring_collective(kind: str, nbytes: float, fab: Fabric) -> Choice:
    """A reduce-scatter (``nbytes`` of input per rank) or all-gather (``nbytes`` of output).

    Rings in the fastest protocol (or NVLS on one node where it wins: its reduce-scatter runs
    at about half its all-reduce's bus bandwidth, below the ring's): ``p - 1`` steps, and
    ``(p - 1) / p * nbytes`` through each rank's link.
    """
    if kind not in ("reduce_scatter", "all_gather"):
        raise ValueError(f"unknown collective {kind!r}; valid: reduce_scatter, all_gather")
    p, n = fab.ranks, max(float(nbytes), 0.0)
    if p == 1:
        return Choice("ring", "Simple", 0.0, math.inf, 0.0)
    ring = fab.ring_busbw * 1e-9 if fab.nodes == 1 else min(fab.ring_busbw, fab.nic_busbw) * 1e-9
    out = []
    for proto in PROTOCOLS:
        busbw = _refine("ring", proto, ring, fab)
        if busbw <= 0:
            continue
        idx = PROTOCOLS.index(proto)
        intra = max(HOP_LATENCY_US[fab.intra_link]["ring"][idx], 0.0)
        inter = HOP_LATENCY_US["net"]["tree" if fab.ranks_per_node == 1 else "ring"][idx]
        inter += fab.net_latency_us * (2 if proto == "Simple" else 1)
        inter_steps = fab.nodes - 1
        if fab.nodes > 1:
            intra = max(intra, NET_OVERHEAD_US[fab.host_cpu] * (3 if proto == "Simple" else 1))
        lat = (BASE_LATENCY_US["ring"][idx] + (p - 1 - inter_steps) * intra + inter_steps * inter) * 1e-6
        algbw = busbw * 1e9 * p / (p - 1) * _tier_factor(fab)
        out.append(Choice("ring", proto, lat, algbw, lat + n / algbw))
    if fab.nodes == 1 and fab.nvls_busbw is not None and fab.ranks_per_node > 1:
        # NVLS reduce-scatter/all-gather: the all-reduce's per-channel rate without its x2
        # pipelining, times (L-1)/L, converted with p / (p - 1).
        algbw = fab.nvls_busbw / 2 * (p - 1) / p * p / (p - 1)
        lat = HOP_LATENCY_US[fab.intra_link]["nvls"][2] * 1e-6
        out.append(Choice("nvls", "Simple", lat, algbw, lat + n / algbw))
    return min(out, key=lambda c: c.time_s)
