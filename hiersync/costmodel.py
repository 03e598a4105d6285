"""Alpha-beta cost models of collectives, of hiersync's schedules, and of real hardware.

Pure maths (numpy at most, never ``torch``): every formula here is unit-tested in
microseconds, and the planner, the projection and the hook's ``algorithm="auto"`` share it.

A :class:`Link` holds ``alpha`` (seconds per message or ring hop), ``beta`` (seconds per
byte on the wire) and ``gamma`` (seconds per byte of reduction compute). A collective on
``p`` ranks moving ``n`` bytes costs ``A(p) * alpha + B(p) * n * beta (+ C(p) * n * gamma)``;
docs/costmodel.md derives every ``A`` and ``B``. Two-level formulas take the node's
``intra`` link (per GPU) and ``inter`` link (per NIC) plus the number of NICs (*rails*).

Example::

    >>> link = Link(alpha=1e-5, beta=1e-9)
    >>> round(allreduce_time("ring", 8, 1e6, link), 6)
    0.00189
    >>> choose_exact_algorithm(100e6, 2, 2, PRESETS["emulated"])
    'two_level'
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "Link",
    "Profile",
    "StepTime",
    "LinkFit",
    "ALLREDUCE_ALGORITHMS",
    "SCHEDULES",
    "PLACEMENTS",
    "DEFAULT_TREE_EFFICIENCY",
    "PRESETS",
    "allreduce_time",
    "reduce_scatter_time",
    "all_gather_time",
    "broadcast_time",
    "reduce_time",
    "rail_link",
    "flat_allreduce_time",
    "hierarchical_allreduce_time",
    "param_sync_time",
    "crossover_bytes",
    "flat_crossover_bytes",
    "step_time",
    "fit_link",
    "get_preset",
    "preset_for_backend",
    "choose_exact_algorithm",
    "INTRA_ALGORITHMS",
    "intra_algorithm_for_backend",
]

logger = logging.getLogger(__name__)

# NCCL's tuning model multiplies the Tree all-reduce bus bandwidth by 0.92
# (src/graph/tuning.cc, "busBw*.92"): a pipelined tree never quite reaches line rate.
DEFAULT_TREE_EFFICIENCY = 0.92

ALLREDUCE_ALGORITHMS = ("ring", "tree", "binomial", "recursive_doubling", "rabenseifner")
FLAT_ALGORITHMS = ("ring", "tree", "auto")
SCHEDULES = ("ddp", "hiersync", "intra_only")
PLACEMENTS = ("hook", "optimizer", "overlap")
PROFILE_FORMAT = "hiersync.profile/1"
# How the two-level all-reduce reduces and gathers inside the node (HierComm.intra_algorithm):
# "rs_ag": reduce-scatter -> rail all-reduce of the 1/L shard -> all-gather (bandwidth-optimal;
# NCCL); "allreduce_bcast": all-reduce of the whole bucket -> rail all-reduce of this rank's 1/L
# shard -> L broadcasts of n/L, each local rank the source of its own shard (gloo, whose CPU
# reduce-scatter and all-gather are slower than its all-reduce and broadcast).
INTRA_ALGORITHMS = ("rs_ag", "allreduce_bcast")


def intra_algorithm_for_backend(backend: str) -> str:
    """The intra algorithm ``HierComm`` picks on ``backend``: ``"allreduce_bcast"`` on gloo, else ``"rs_ag"``."""
    return "allreduce_bcast" if str(backend).strip().lower() == "gloo" else "rs_ag"


def _check_intra_algorithm(intra_algorithm: str | None, backend: str) -> str:
    algo = intra_algorithm_for_backend(backend) if intra_algorithm is None else intra_algorithm
    if algo not in INTRA_ALGORITHMS:
        raise ValueError(f"unknown intra_algorithm {algo!r}; valid: {', '.join(INTRA_ALGORITHMS)} (or None)")
    return algo


def _check_number(name: str, value: Any, *, low: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value < low or (strict and value == low):
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {op} {low:g}, got {value!r}")
    return value


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class Link:
    """Cost of one level of the network in the alpha-beta(-gamma) model.

    Positional arguments are allowed (``Link(1e-5, 1e-9)``) because the order is the
    textbook one. Use :meth:`from_bandwidth` to build one from a latency and a bandwidth.
    """

    alpha: float
    """Latency in seconds per message (per ring step / tree level)."""
    beta: float
    """Transfer time in seconds per byte (1 / bandwidth of one GPU's or one NIC's link)."""
    gamma: float = 0.0
    """Reduction compute in seconds per byte (0 on GPUs, where it hides behind the wire)."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            object.__setattr__(self, name, _check_number(f"Link.{name}", getattr(self, name)))

    @classmethod
    def from_bandwidth(cls, latency_s: float, bytes_per_s: float, *, gamma: float = 0.0) -> Link:
        """Build a link from a latency (s) and a bandwidth (bytes/s, not bits: 400 Gb/s = 50e9)."""
        bw = _check_number("bytes_per_s", bytes_per_s, strict=True)
        return cls(latency_s, 1.0 / bw, gamma)

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``inf`` when ``beta`` is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def to_json(self) -> dict[str, float]:
        return {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Link:
        try:
            return cls(obj["alpha"], obj["beta"], obj.get("gamma", 0.0))
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"a link needs numeric 'alpha' and 'beta' (and optional 'gamma'), got {obj!r}") from err


# ---------------------------------------------------------------------------
# Single-level collectives. Each entry maps (p, lg, link, eta) to (latency_s,
# seconds_per_byte); time = latency + n * seconds_per_byte. lg = ceil(log2 p).

_Affine = Callable[[int, int, Link, float], "tuple[float, float]"]

_ALLREDUCE: dict[str, _Affine] = {
    "ring": lambda p, lg, l, eta: (2 * (p - 1) * l.alpha, (p - 1) / p * (2 * l.beta + l.gamma)),
    "tree": lambda p, lg, l, eta: (2 * lg * l.alpha, 2 * l.beta / eta + l.gamma),
    "binomial": lambda p, lg, l, eta: (2 * lg * l.alpha, lg * (2 * l.beta + l.gamma)),
    "recursive_doubling": lambda p, lg, l, eta: (lg * l.alpha, lg * (l.beta + l.gamma)),
    "rabenseifner": lambda p, lg, l, eta: (2 * lg * l.alpha, (p - 1) / p * (2 * l.beta + l.gamma)),
}
# reduce-scatter: n is the whole input of one rank (each rank ends with n / p).
_REDUCE_SCATTER: dict[str, _Affine] = {
    "ring": lambda p, lg, l, eta: ((p - 1) * l.alpha, (p - 1) / p * (l.beta + l.gamma)),
    "recursive_halving": lambda p, lg, l, eta: (lg * l.alpha, (p - 1) / p * (l.beta + l.gamma)),
}
# all-gather: n is the whole output (each rank contributes n / p), as in nccl-tests.
_ALL_GATHER: dict[str, _Affine] = {
    "ring": lambda p, lg, l, eta: ((p - 1) * l.alpha, (p - 1) / p * l.beta),
    "recursive_doubling": lambda p, lg, l, eta: (lg * l.alpha, (p - 1) / p * l.beta),
}
_BROADCAST: dict[str, _Affine] = {
    "binomial": lambda p, lg, l, eta: (lg * l.alpha, lg * l.beta),
    "ring": lambda p, lg, l, eta: ((p - 1) * l.alpha, l.beta),  # pipelined chain
    "scatter_allgather": lambda p, lg, l, eta: ((lg + p - 1) * l.alpha, 2 * (p - 1) / p * l.beta),
}
_REDUCE: dict[str, _Affine] = {
    "binomial": lambda p, lg, l, eta: (lg * l.alpha, lg * (l.beta + l.gamma)),
    "ring": lambda p, lg, l, eta: ((p - 1) * l.alpha, l.beta + l.gamma),  # pipelined chain
    "rabenseifner": lambda p, lg, l, eta: (2 * lg * l.alpha, (p - 1) / p * (2 * l.beta + l.gamma)),
}
_COLLECTIVES = {
    "allreduce": _ALLREDUCE,
    "reduce_scatter": _REDUCE_SCATTER,
    "all_gather": _ALL_GATHER,
    "broadcast": _BROADCAST,
    "reduce": _REDUCE,
}


def _lg(p: int) -> int:
    return (p - 1).bit_length()  # ceil(log2 p) for p >= 1


def _check_eta(efficiency: float) -> float:
    eta = _check_number("efficiency", efficiency, strict=True)
    if eta > 1.0:
        raise ValueError(f"efficiency is a fraction of line rate in (0, 1], got {eta!r}")
    return eta


def _affine(
    collective: str, algorithm: str, ranks: int, link: Link, efficiency: float = DEFAULT_TREE_EFFICIENCY
) -> tuple[float, float]:
    table = _COLLECTIVES[collective]
    if algorithm not in table:
        raise ValueError(f"unknown {collective} algorithm {algorithm!r}; valid: {', '.join(table)}")
    p = _check_count("ranks", ranks)
    if not isinstance(link, Link):
        raise TypeError(f"link must be a hiersync.costmodel.Link, got {type(link).__name__}")
    eta = _check_eta(efficiency)
    if p == 1:
        return 0.0, 0.0  # nothing to communicate
    return table[algorithm](p, _lg(p), link, eta)


def _time(collective: str, algorithm: str, ranks: int, nbytes: float, link: Link, efficiency: float) -> float:
    n = _check_number("nbytes", nbytes)
    a, b = _affine(collective, algorithm, ranks, link, efficiency)
    return a + b * n


def allreduce_time(
    algorithm: str, ranks: int, nbytes: float, link: Link, *, efficiency: float = DEFAULT_TREE_EFFICIENCY
) -> float:
    """Seconds to all-reduce ``nbytes`` per rank over ``ranks`` ranks on one ``link``.

    ``algorithm`` is one of :data:`ALLREDUCE_ALGORITHMS`; ``efficiency`` (eta) is the
    fraction of line rate a pipelined ``"tree"`` reaches (NCCL models 0.92).
    """
    return _time("allreduce", algorithm, ranks, nbytes, link, efficiency)


def reduce_scatter_time(algorithm: str, ranks: int, nbytes: float, link: Link) -> float:
    """Seconds to reduce-scatter an ``nbytes`` input (each rank keeps ``nbytes / ranks``)."""
    return _time("reduce_scatter", algorithm, ranks, nbytes, link, DEFAULT_TREE_EFFICIENCY)


def all_gather_time(algorithm: str, ranks: int, nbytes: float, link: Link) -> float:
    """Seconds to all-gather into an ``nbytes`` output (each rank brings ``nbytes / ranks``)."""
    return _time("all_gather", algorithm, ranks, nbytes, link, DEFAULT_TREE_EFFICIENCY)


def broadcast_time(algorithm: str, ranks: int, nbytes: float, link: Link) -> float:
    """Seconds to broadcast ``nbytes`` from one rank: ``"binomial"``, ``"ring"``, ``"scatter_allgather"``."""
    return _time("broadcast", algorithm, ranks, nbytes, link, DEFAULT_TREE_EFFICIENCY)


def reduce_time(algorithm: str, ranks: int, nbytes: float, link: Link) -> float:
    """Seconds to reduce ``nbytes`` onto one rank: ``"binomial"``, ``"ring"``, ``"rabenseifner"``."""
    return _time("reduce", algorithm, ranks, nbytes, link, DEFAULT_TREE_EFFICIENCY)


# ---------------------------------------------------------------------------
# Two-level topologies: N nodes x L ranks, `rails` NICs per node.


def _check_topology(nodes: int, ranks_per_node: int, rails: int | None) -> tuple[int, int, int]:
    n = _check_count("nodes", nodes)
    lpn = _check_count("ranks_per_node", ranks_per_node)
    r = lpn if rails is None else _check_count("rails", rails)
    return n, lpn, min(r, lpn)  # a rank drives one NIC at most; extra NICs are not modelled


def rail_link(inter: Link, ranks_per_node: int, rails: int | None = None) -> Link:
    """The link one rail (the ranks with one local rank) sees when ``rails`` NICs serve ``ranks_per_node`` ranks.

    With one NIC per rank the rail owns its NIC. With fewer NICs the L rails share them,
    so each rail gets ``rails / L`` of a NIC: beta scales by ``L / rails``.
    """
    _, lpn, r = _check_topology(1, ranks_per_node, rails)
    return Link(inter.alpha, inter.beta * lpn / r, inter.gamma)


def _flat_affine(
    algorithm: str, nodes: int, ranks_per_node: int, intra: Link, inter: Link, rails: int | None, efficiency: float
) -> tuple[float, float]:
    n_nodes, lpn, r = _check_topology(nodes, ranks_per_node, rails)
    if algorithm not in ("ring", "tree"):
        raise ValueError(f"unknown flat all-reduce algorithm {algorithm!r}; valid: {', '.join(FLAT_ALGORITHMS)}")
    if n_nodes == 1:
        return _affine("allreduce", algorithm, lpn, intra, efficiency)
    eta = _check_eta(efficiency)
    p = n_nodes * lpn
    # Per byte: the slower of one GPU's intra link and its node's NIC share. Every
    # channel's ring (or tree) crosses each node boundary once, so R channels spread the
    # node's 2(p-1)/p * n bytes (ring) over R NICs: beta_inter / R per byte of message.
    per_byte = inter.beta / r if lpn == 1 else max(intra.beta, inter.beta / r)
    gamma = max(intra.gamma, inter.gamma)
    if algorithm == "ring":
        # The critical path of a ring all-reduce walks 2(p-1) consecutive hops, about two
        # laps of the ring, and each lap crosses the N node boundaries once.
        hops = 2 * (p - 1)
        inter_hops = min(2 * n_nodes, hops)
        latency = inter_hops * inter.alpha + (hops - inter_hops) * intra.alpha
        return latency, (p - 1) / p * (2 * per_byte + gamma)
    # NCCL's Tree: a chain inside each node, a double binary tree between nodes.
    latency = 2 * ((lpn - 1) * intra.alpha + _lg(n_nodes) * inter.alpha)
    return latency, 2 * per_byte / eta + gamma


def flat_allreduce_time(
    nbytes: float,
    nodes: int,
    ranks_per_node: int,
    intra: Link,
    inter: Link,
    rails: int | None = None,
    algorithm: str = "ring",
    *,
    efficiency: float = DEFAULT_TREE_EFFICIENCY,
) -> float:
    """Seconds for DDP's flat all-reduce over all ``nodes * ranks_per_node`` ranks.

    ``"ring"``: ``(2(p-1) - 2N) a_i + 2N a_e + 2(p-1)/p * n * max(b_i, b_e / R)``; each of
    the R NCCL channels' rings enters and leaves every node once, so a node pushes
    ``2(p-1)/p * n`` bytes through its R NICs. ``"tree"``: NCCL's chain + double binary
    tree, ``2((L-1) a_i + ceil(lg N) a_e) + 2n * max(b_i, b_e / R) / eta``. ``"auto"``:
    the faster of the two (what NCCL's tuner picks). One node: the single-level formula.
    """
    n = _check_number("nbytes", nbytes)
    if algorithm == "auto":
        return min(
            flat_allreduce_time(n, nodes, ranks_per_node, intra, inter, rails, a, efficiency=efficiency)
            for a in ("ring", "tree")
        )
    a, b = _flat_affine(algorithm, nodes, ranks_per_node, intra, inter, rails, efficiency)
    return a + b * n


def _rail_allreduce(nbytes: float, nodes: int, rail: Link, algorithm: str, efficiency: float) -> float:
    if algorithm == "auto":
        return min(allreduce_time(a, nodes, nbytes, rail, efficiency=efficiency) for a in ("ring", "tree"))
    return allreduce_time(algorithm, nodes, nbytes, rail, efficiency=efficiency)


def _two_level_stages(
    nbytes: float,
    nodes: int,
    ranks_per_node: int,
    intra: Link,
    inter: Link,
    rails: int | None,
    inter_algorithm: str,
    efficiency: float,
    rs_link: Link | None = None,
    ag_link: Link | None = None,
    intra_algorithm: str = "rs_ag",
    bcast_link: Link | None = None,
) -> tuple[float, float, float]:
    """(intra reduction, rail all-reduce of n/L, intra gather) in seconds.

    ``"rs_ag"``: ring reduce-scatter of n, ring all-gather of n. ``"allreduce_bcast"``:
    ring all-reduce of n on ``intra``, then L binomial broadcasts of n/L one after the
    other. ``rs_link`` / ``ag_link`` / ``bcast_link``: measured effective links of the
    node's reduce-scatter, all-gather and shard broadcast where they differ from what
    ``intra`` predicts (see :class:`Profile`).
    """
    n = _check_number("nbytes", nbytes)
    n_nodes, lpn, _ = _check_topology(nodes, ranks_per_node, rails)
    if n_nodes == 1 and (rs_link is not None or ag_link is not None or intra_algorithm == "allreduce_bcast"):
        # hiersync runs one intra all-reduce then; with plain links RS + AG equals it anyway
        return allreduce_time("ring", lpn, n, intra), 0.0, 0.0
    ar = _rail_allreduce(n / lpn, n_nodes, rail_link(inter, lpn, rails), inter_algorithm, efficiency)
    if intra_algorithm == "allreduce_bcast":
        first = allreduce_time("ring", lpn, n, intra)
        # gloo's broadcast is a binomial tree: ceil(lg L) rounds of the whole message (one
        # send with 2 ranks). HierComm issues the L shard broadcasts on one group: in order.
        last = lpn * broadcast_time("binomial", lpn, n / lpn, bcast_link or intra)
        return first, ar, last
    rs = reduce_scatter_time("ring", lpn, n, rs_link or intra)
    ag = all_gather_time("ring", lpn, n, ag_link or intra)
    return rs, ar, ag


def hierarchical_allreduce_time(
    nbytes: float,
    nodes: int,
    ranks_per_node: int,
    intra: Link,
    inter: Link,
    rails: int | None = None,
    inter_algorithm: str = "ring",
    *,
    efficiency: float = DEFAULT_TREE_EFFICIENCY,
    reduce_scatter: Link | None = None,
    all_gather: Link | None = None,
    intra_algorithm: str | None = None,
    backend: str = "nccl",
    broadcast: Link | None = None,
) -> float:
    """Seconds for hiersync's exact two-level all-reduce (one bucket, stages back to back).

    ``intra_algorithm="rs_ag"``: ``[(L-1) a_i + (L-1)/L n b_i]`` (intra reduce-scatter)
    ``+`` all-reduce of ``n / L`` on the N ranks of each rail, all rails in parallel on a
    :func:`rail_link` ``+ [(L-1) a_i + (L-1)/L n b_i]`` (intra all-gather).
    ``"allreduce_bcast"``: ``[2(L-1) a_i + 2(L-1)/L n b_i]`` (intra ring all-reduce of the
    whole bucket) ``+`` the same rail leg ``+ L * ceil(lg L) * [a_i + n/L b_i]`` (L
    binomial broadcasts of ``n / L``, one per local rank; ``a_i + n/2 b_i`` each for L = 2).
    ``None``: what ``HierComm`` picks on ``backend`` (:func:`intra_algorithm_for_backend`;
    the default ``"nccl"`` gives ``"rs_ag"``). ``inter_algorithm`` may be ``"auto"``
    (faster of ring and tree). ``reduce_scatter`` / ``all_gather`` / ``broadcast`` replace
    ``intra`` in their stage with a measured effective link (a calibrated profile's
    :attr:`Profile.intra_reduce_scatter` / :attr:`Profile.intra_all_gather` /
    :attr:`Profile.intra_broadcast`); each is ignored by the variant that does not run it.
    """
    algo = _check_intra_algorithm(intra_algorithm, backend)
    return sum(_two_level_stages(
        nbytes, nodes, ranks_per_node, intra, inter, rails, inter_algorithm, efficiency, reduce_scatter, all_gather,
        algo, broadcast,
    ))


def param_sync_time(
    nbytes: float,
    nodes: int,
    ranks_per_node: int,
    intra: Link,
    inter: Link,
    rails: int | None = None,
    inter_algorithm: str = "ring",
    *,
    compress_ratio: float = 1.0,
    efficiency: float = DEFAULT_TREE_EFFICIENCY,
    all_gather: Link | None = None,
    intra_algorithm: str | None = None,
    backend: str = "nccl",
    broadcast: Link | None = None,
) -> float:
    """Seconds for one inter-node parameter average of ``nbytes`` (period > 1 sync).

    Ranks of a node hold identical parameters, so no intra reduce is needed: each rank
    all-reduces its ``1/L`` shard on its rail, then the node gathers the shards: one
    all-gather (``intra_algorithm="rs_ag"``) or L broadcasts of ``n / L``
    (``"allreduce_bcast"``); ``None``: by ``backend`` as in
    :func:`hierarchical_allreduce_time`. ``compress_ratio`` (0.5 for bf16 deltas of fp32
    parameters) scales the bytes of both legs. ``all_gather`` / ``broadcast``: measured
    effective links of the gather (default ``intra``).
    """
    ratio = _check_number("compress_ratio", compress_ratio, strict=True)
    algo = _check_intra_algorithm(intra_algorithm, backend)
    if nodes == 1:
        return 0.0
    _, ar, gather = _two_level_stages(
        nbytes * ratio, nodes, ranks_per_node, intra, inter, rails, inter_algorithm, efficiency, None, all_gather,
        algo, broadcast,
    )
    return ar + gather


def _crossover(first: tuple[float, float], second: tuple[float, float]) -> float:
    (a1, b1), (a2, b2) = first, second
    if b1 == b2:
        return math.inf
    n = (a2 - a1) / (b1 - b2)
    return n if n > 0 else math.inf


def crossover_bytes(
    ranks: int,
    link: Link,
    first: str = "ring",
    second: str = "tree",
    *,
    efficiency: float = DEFAULT_TREE_EFFICIENCY,
) -> float:
    """Message size (bytes) at which two all-reduce algorithms take equal time on one link.

    Every formula is affine in n, so ``n* = (A2 - A1) / (B1 - B2)``. Below n* the
    algorithm with less latency wins, above it the one with less time per byte. Returns
    ``math.inf`` when they never trade places for n > 0 (one is never slower).
    """
    return _crossover(
        _affine("allreduce", first, ranks, link, efficiency), _affine("allreduce", second, ranks, link, efficiency)
    )


def flat_crossover_bytes(
    nodes: int,
    ranks_per_node: int,
    intra: Link,
    inter: Link,
    rails: int | None = None,
    first: str = "ring",
    second: str = "tree",
    *,
    efficiency: float = DEFAULT_TREE_EFFICIENCY,
) -> float:
    """Like :func:`crossover_bytes` for :func:`flat_allreduce_time` on a two-level cluster."""
    args = (nodes, ranks_per_node, intra, inter, rails, efficiency)
    return _crossover(_flat_affine(first, *args), _flat_affine(second, *args))


# ---------------------------------------------------------------------------
# Hardware profiles and presets.


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Links and shape of a cluster: what the planner, the projection and ``algorithm="auto"`` read.

    ``python -m hiersync calibrate`` measures one; :data:`PRESETS` holds published ones.
    """

    intra: Link
    """Link between two ranks of one node (per GPU)."""
    inter: Link
    """Link of one NIC between nodes."""
    nodes: int
    """Number of nodes (N)."""
    ranks_per_node: int
    """Ranks per node (L)."""
    rails: int | None = None
    """NICs per node; None means one per rank."""
    backend: str = "nccl"
    """torch.distributed backend; ``"nccl"`` lets NCCL pick ring or tree, others use rings."""
    tree_efficiency: float = DEFAULT_TREE_EFFICIENCY
    """Fraction of line rate a pipelined tree reaches (eta)."""
    name: str = ""
    """Short name (the preset's key, or e.g. the cluster's)."""
    source: str = ""
    """Where the numbers come from (publication, or the calibration command)."""
    intra_reduce_scatter: Link | None = None
    """Measured effective link of the node's reduce-scatter, where it costs more than
    :attr:`intra` predicts; None: :attr:`intra`. torch's gloo backend, for one, runs
    reduce-scatter as an all-reduce of a fresh copy of the whole input plus a copy out
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), about 2-3x the ring's cost.
    ``python -m hiersync calibrate`` measures it."""
    intra_all_gather: Link | None = None
    """Measured effective link of the node's all-gather (gloo adds a flatten and a copy
    out through freshly allocated memory); None: :attr:`intra`."""
    intra_broadcast: Link | None = None
    """Measured effective link of one of the L shard broadcasts of the ``"allreduce_bcast"``
    gather (fitted as L broadcasts of n/L in a row, as ``HierComm`` issues them); None:
    :attr:`intra`, whose beta (fitted on all-reduces) also holds the reduction's cost."""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)
    """Free-form JSON-able details (fit quality, hostnames, versions)."""

    def __post_init__(self) -> None:
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"Profile.{name} must be a Link, got {type(getattr(self, name)).__name__}")
        for name in ("intra_reduce_scatter", "intra_all_gather", "intra_broadcast"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Link):
                raise TypeError(f"Profile.{name} must be a Link or None, got {type(getattr(self, name)).__name__}")
        _check_topology(self.nodes, self.ranks_per_node, self.rails)
        _check_eta(self.tree_efficiency)
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"Profile.backend must be a backend name such as 'nccl' or 'gloo', got {self.backend!r}")

    @property
    def flat_algorithm(self) -> str:
        """``"auto"`` under NCCL (its tuner picks ring or tree), ``"ring"`` otherwise (gloo)."""
        return "auto" if "nccl" in self.backend.lower() else "ring"

    @property
    def intra_algorithm(self) -> str:
        """What ``HierComm`` runs inside the node on :attr:`backend`: ``"allreduce_bcast"`` on gloo, else ``"rs_ag"``."""
        return intra_algorithm_for_backend(self.backend)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "name": self.name,
            "backend": self.backend,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "rails": self.rails,
            "tree_efficiency": self.tree_efficiency,
            "intra": self.intra.to_json(),
            "inter": self.inter.to_json(),
            "intra_reduce_scatter": None if self.intra_reduce_scatter is None else self.intra_reduce_scatter.to_json(),
            "intra_all_gather": None if self.intra_all_gather is None else self.intra_all_gather.to_json(),
            "intra_broadcast": None if self.intra_broadcast is None else self.intra_broadcast.to_json(),
            "source": self.source,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | str) -> Profile:
        """Build a profile from :meth:`to_json`'s dict or its JSON text."""
        if isinstance(obj, str):
            obj = json.loads(obj)
        if not isinstance(obj, Mapping):
            raise TypeError(f"a profile is a JSON object, got {type(obj).__name__}")
        fmt = obj.get("format", PROFILE_FORMAT)
        if fmt != PROFILE_FORMAT:
            raise ValueError(f"unsupported profile format {fmt!r}; this version reads {PROFILE_FORMAT!r}")
        missing = [k for k in ("intra", "inter", "nodes", "ranks_per_node") if k not in obj]
        if missing:
            raise ValueError(f"profile lacks {missing}; write it with Profile.save or `python -m hiersync calibrate`")
        return cls(
            intra=Link.from_json(obj["intra"]),
            inter=Link.from_json(obj["inter"]),
            nodes=obj["nodes"],
            ranks_per_node=obj["ranks_per_node"],
            rails=obj.get("rails"),
            backend=obj.get("backend", "nccl"),
            tree_efficiency=obj.get("tree_efficiency", DEFAULT_TREE_EFFICIENCY),
            intra_reduce_scatter=_optional_link(obj.get("intra_reduce_scatter")),
            intra_all_gather=_optional_link(obj.get("intra_all_gather")),
            intra_broadcast=_optional_link(obj.get("intra_broadcast")),
            name=obj.get("name", ""),
            source=obj.get("source", ""),
            metadata=dict(obj.get("metadata") or {}),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON atomically (a reader never sees half a file)."""
        from hiersync._io import atomic_write_json

        return atomic_write_json(path, self.to_json())


def _optional_link(obj: Mapping[str, Any] | None) -> Link | None:
    return None if obj is None else Link.from_json(obj)


_NCCL_SRC = "NCCL src/graph/tuning.cc hop latencies (Simple protocol)"
PRESETS: dict[str, Profile] = {
    # 8x H100 SXM: NVLS all-reduce busbw ~480 GB/s inside the node (ring alone ~370 GB/s);
    # 8x ConnectX-7 NDR 400 Gb/s, 46-48 GB/s measured each (line rate 50 GB/s).
    "h100-8rail": Profile(
        intra=Link.from_bandwidth(3.4e-6, 480e9),
        inter=Link.from_bandwidth(14e-6, 47e9),
        nodes=128, ranks_per_node=8, rails=8, backend="nccl", name="h100-8rail",
        source=f"8xH100 NVLS ~480 GB/s busbw (ring ~370); 8x NDR 400 Gb/s at 47 GB/s; {_NCCL_SRC}",
    ),
    # 8x A100 SXM: NCCL caps Ampere busbw at 235 GB/s; one 100 Gb/s NIC (12.5 GB/s line).
    "a100-1nic": Profile(
        intra=Link.from_bandwidth(3.4e-6, 235e9),
        inter=Link.from_bandwidth(14e-6, 11.5e9),
        nodes=16, ranks_per_node=8, rails=1, backend="nccl", name="a100-1nic",
        source=f"8xA100 NVLink 235 GB/s busbw (NCCL's Ampere cap); 1x 100 Gb/s at 11.5 GB/s; {_NCCL_SRC}",
    ),
    # 8 GPUs on PCIe 4.0 x16 (~25 GB/s per direction, ~20 GB/s ring busbw); one 25 GbE
    # port under NCCL's socket transport (~2.8 GB/s of 3.125 line rate, ~30 us per hop).
    "pcie-25gbe": Profile(
        intra=Link.from_bandwidth(5.7e-6, 20e9),
        inter=Link.from_bandwidth(30e-6, 2.8e9),
        nodes=8, ranks_per_node=8, rails=1, backend="nccl", name="pcie-25gbe",
        source=f"8 GPUs on PCIe 4.0 ~20 GB/s ring busbw; 1x 25 GbE TCP ~2.8 GB/s; {_NCCL_SRC} (PCI)",
    ),
    # The one-machine testbed of DESIGN.md: gloo over loopback (~3 GB/s) inside a node,
    # one veth per node shaped by tbf to 800 Mbit/s (~95 MB/s of 100 MB/s) between nodes.
    "emulated": Profile(
        intra=Link.from_bandwidth(30e-6, 3e9),
        inter=Link.from_bandwidth(60e-6, 95e6),
        nodes=2, ranks_per_node=2, rails=1, backend="gloo", name="emulated",
        source="emulated testbed (DESIGN.md): gloo loopback ~3 GB/s; tbf 800 Mbit/s ~95 MB/s; gloo ~tens of us",
    ),
}


def get_preset(name: str) -> Profile:
    """The preset :class:`Profile` called ``name`` (see :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}") from None


def preset_for_backend(backend: str) -> str:
    """Name of the preset that stands in for an uncalibrated cluster on ``backend``.

    ``"nccl"`` (or any backend string naming NCCL, e.g. ``"cpu:gloo,cuda:nccl"``) gives
    ``"h100-8rail"``; ``"gloo"`` gives ``"emulated"``. Others log a warning and get
    ``"emulated"``: calibrate (``python -m hiersync calibrate``) for real numbers.
    """
    name = str(backend).lower()
    if "nccl" in name:
        return "h100-8rail"
    if "gloo" not in name:
        logger.warning("hiersync: no preset for backend %r; using 'emulated' (calibrate for real numbers)", backend)
    return "emulated"


def choose_exact_algorithm(
    nbytes: float, nodes: int, ranks_per_node: int, profile: Profile, *, intra_algorithm: str | None = None
) -> str:
    """``"flat"`` or ``"two_level"``: the faster exact all-reduce of one ``nbytes`` bucket.

    Compares :func:`flat_allreduce_time` with :func:`hierarchical_allreduce_time` on
    ``profile``'s links; under NCCL both legs use the faster of ring and tree. One node
    or one rank per node: ``"flat"`` (two levels would add steps for nothing). Ties: flat.
    ``intra_algorithm``: the two-level variant (default :attr:`Profile.intra_algorithm`).
    """
    algo_intra = _check_intra_algorithm(intra_algorithm, profile.backend)
    if nodes <= 1 or ranks_per_node <= 1:
        return "flat"
    algo = profile.flat_algorithm
    args = (nbytes, nodes, ranks_per_node, profile.intra, profile.inter, profile.rails)
    flat = flat_allreduce_time(*args, algo, efficiency=profile.tree_efficiency)
    two = hierarchical_allreduce_time(
        *args, algo, efficiency=profile.tree_efficiency, reduce_scatter=profile.intra_reduce_scatter,
        all_gather=profile.intra_all_gather, intra_algorithm=algo_intra, broadcast=profile.intra_broadcast,
    )
    return "two_level" if two < flat else "flat"


# ---------------------------------------------------------------------------
# Schedule model: buckets become ready during backward and queue per process group.


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted communication of one training step (averaged over a period)."""

    label: str
    """Schedule name, e.g. ``"ddp"`` or ``"hiersync k=4"``."""
    comm_s: float
    """Busy time of all collectives per step, whether hidden or not."""
    exposed_s: float
    """Communication that does not hide behind compute and lengthens the step."""
    compute_s: float
    """Compute time of the step (forward + backward + optimizer, as given)."""
    step_s: float
    """``compute_s + exposed_s``."""
    num_buckets: int
    """Gradient buckets per step."""


def _bucket_sizes(grad_bytes: float, bucket_bytes: float) -> list[float]:
    count = max(1, math.ceil(grad_bytes / bucket_bytes - 1e-9))
    return [bucket_bytes] * (count - 1) + [grad_bytes - bucket_bytes * (count - 1)]


def _simulate(ready: Sequence[float], chains: Sequence[Sequence[tuple[str, float]]]) -> float:
    """Finish time of the last collective: each chain's stages run in order, each group FIFO.

    Issues are served in issue-time order, and a stage is issued when the previous one
    finishes (never earlier than the time being served), so popping the heap in time
    order serves every group first-in first-out.
    """
    free: dict[str, float] = {}
    heap = [(t, i, 0) for i, t in enumerate(ready)]
    heapq.heapify(heap)
    end = 0.0
    while heap:
        t, i, j = heapq.heappop(heap)
        group, duration = chains[i][j]
        finish = max(t, free.get(group, 0.0)) + duration
        free[group] = finish
        if j + 1 < len(chains[i]):
            heapq.heappush(heap, (finish, i, j + 1))
        else:
            end = max(end, finish)
    return end


def step_time(
    schedule: str,
    *,
    profile: Profile,
    grad_bytes: float,
    bucket_bytes: float,
    backward_s: float,
    period: int = 1,
    compress_ratio: float = 1.0,
    placement: str = "hook",
    compute_s: float | None = None,
    nodes: int | None = None,
    ranks_per_node: int | None = None,
    algorithm: str | None = None,
    intra_algorithm: str | None = None,
) -> StepTime:
    """Predict per-step communication and exposed time of one schedule.

    ``schedule``: ``"ddp"`` (flat all-reduce of every bucket), ``"hiersync"`` (period 1:
    two-level all-reduce of every bucket; period k: intra all-reduce every step and a
    parameter average every k-th step, amortized) or ``"intra_only"`` (never across
    nodes: the k -> infinity bound). Buckets of ``bucket_bytes`` become ready uniformly
    during ``backward_s``, in order; the collectives of one process group run one at a
    time, first in first out. ``placement`` of the period-k average: ``"hook"`` (bucket by
    bucket inside the sync step's backward), ``"optimizer"`` (after ``optimizer.step()``,
    fully exposed) or ``"overlap"`` (hidden behind the next step's ``compute_s``).
    ``compute_s`` defaults to ``backward_s``. ``algorithm`` (``"ring"``, ``"tree"``,
    ``"auto"``) is the flat all-reduce and the rail all-reduce; default
    ``profile.flat_algorithm``. ``intra_algorithm`` (``"rs_ag"``, ``"allreduce_bcast"``) is
    how the two-level all-reduce and the parameter average reduce and gather inside the
    node; default :attr:`Profile.intra_algorithm` (by backend, as ``HierComm`` picks).
    ``nodes`` / ``ranks_per_node`` override the profile's. Warmup steps are not modelled.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
    _check_count("period", period)
    g = _check_number("grad_bytes", grad_bytes, strict=True)
    b = _check_number("bucket_bytes", bucket_bytes, strict=True)
    backward = _check_number("backward_s", backward_s)
    compute = backward if compute_s is None else _check_number("compute_s", compute_s)
    ratio = _check_number("compress_ratio", compress_ratio, strict=True)
    n_nodes = profile.nodes if nodes is None else nodes
    lpn = profile.ranks_per_node if ranks_per_node is None else ranks_per_node
    _check_topology(n_nodes, lpn, profile.rails)
    algo, eta = algorithm or profile.flat_algorithm, profile.tree_efficiency
    if algo not in FLAT_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algo!r}; valid: {', '.join(FLAT_ALGORITHMS)}")
    links = (profile.intra, profile.inter, profile.rails)
    rs_link, ag_link = profile.intra_reduce_scatter, profile.intra_all_gather
    bc_link = profile.intra_broadcast
    intra_algo = _check_intra_algorithm(intra_algorithm, profile.backend)

    sizes = _bucket_sizes(g, b)
    ready, done = [], 0.0
    for s in sizes:
        done += s
        ready.append(backward * done / g)
    cache: dict[tuple[str, float], list[tuple[str, float]]] = {}

    def chain(kind: str, n: float) -> list[tuple[str, float]]:
        key = (kind, n)
        if key not in cache:
            if kind == "flat":
                cache[key] = [("world", flat_allreduce_time(n, n_nodes, lpn, *links, algo, efficiency=eta))]
            elif kind == "intra":
                cache[key] = [("intra", allreduce_time("ring", lpn, n, profile.intra))]
            else:
                rs, ar, ag = _two_level_stages(
                    n, n_nodes, lpn, *links, algo, eta, rs_link, ag_link, intra_algo, bc_link
                )
                if kind == "two_level":
                    cache[key] = [("intra", rs), ("rail", ar), ("intra", ag)]
                else:  # intra all-reduce of the gradient, then the bucket's parameter average
                    _, ar, ag = _two_level_stages(
                        n * ratio, n_nodes, lpn, *links, algo, eta, None, ag_link, intra_algo, bc_link
                    )
                    cache[key] = chain("intra", n) + [("rail", ar), ("intra", ag)]
        return cache[key]

    def run(kind: str) -> tuple[float, float]:
        chains = [chain(kind, s) for s in sizes]
        busy = sum(d for c in chains for _, d in c)
        return busy, max(0.0, _simulate(ready, chains) - backward)

    k = period
    if schedule == "ddp" or (schedule == "hiersync" and (k == 1 or n_nodes == 1)):
        label = "ddp" if schedule == "ddp" else f"hiersync k={k}"
        comm, exposed = run("flat" if schedule == "ddp" else "two_level")
    else:
        comm, exposed = run("intra")
        label = "intra-only"
        if schedule == "hiersync":
            label = f"hiersync k={k}" + ("" if placement == "hook" else f" {placement}")
            if placement == "hook":
                sync_comm, sync_exposed = run("sync")
            else:
                sync_comm = param_sync_time(
                    g, n_nodes, lpn, *links, algo, compress_ratio=ratio, efficiency=eta, all_gather=ag_link,
                    intra_algorithm=intra_algo, broadcast=bc_link,
                )
                hidden = compute if placement == "overlap" else 0.0
                sync_exposed = exposed + max(0.0, sync_comm - hidden)
                sync_comm += comm
            comm = ((k - 1) * comm + sync_comm) / k
            exposed = ((k - 1) * exposed + sync_exposed) / k
    return StepTime(
        label=label, comm_s=comm, exposed_s=exposed, compute_s=compute, step_s=compute + exposed,
        num_buckets=len(sizes),
    )


# ---------------------------------------------------------------------------
# Fitting alpha and beta from measurements.


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """Result of :func:`fit_link`."""

    link: Link
    """Fitted link; its beta absorbs any reduction cost (gamma is left at 0)."""
    r2: float
    """Coefficient of determination of the fitted times against the measured ones."""
    max_rel_error: float
    """Largest ``|predicted - measured| / measured`` over the points."""
    num_points: int
    """Number of (size, time) points used."""


def fit_link(
    sizes_bytes: Sequence[float],
    times_s: Sequence[float],
    *,
    ranks: int,
    collective: str = "allreduce",
    algorithm: str = "ring",
    efficiency: float = DEFAULT_TREE_EFFICIENCY,
) -> LinkFit:
    """Fit ``alpha`` and ``beta`` to times of a known collective on ``ranks`` ranks.

    The model is ``t = A(p) * alpha + B(p) * n * beta`` with ``A``, ``B`` taken from the
    same formulas as :func:`allreduce_time` (or ``collective`` = ``"reduce_scatter"``,
    ``"all_gather"``, ``"broadcast"``, ``"reduce"``). Least squares on *relative* errors
    (each row divided by its measured time), so a 4 KB point weighs as much as a 256 MB
    one and alpha is not lost in the noise of the large messages. A negative estimate is
    clamped to 0 and the other parameter refitted.
    """
    import numpy as np

    if collective not in _COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(_COLLECTIVES)}")
    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"sizes_bytes and times_s must be 1-D and equally long, got {n.shape} and {t.shape}")
    if len(np.unique(n)) < 2:
        raise ValueError(f"need at least 2 distinct message sizes to fit alpha and beta, got {n.tolist()}")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(n >= 0)):
        raise ValueError("times_s must be finite and > 0 and sizes_bytes >= 0")
    a_coef = _affine(collective, algorithm, ranks, Link(1.0, 0.0), efficiency)[0]
    b_coef = _affine(collective, algorithm, ranks, Link(0.0, 1.0), efficiency)[1]
    if a_coef == 0 or b_coef == 0:
        raise ValueError(f"{collective} on ranks={ranks} moves nothing; fit with ranks >= 2")
    x = np.stack([np.full_like(n, a_coef), b_coef * n], axis=1) / t[:, None]
    y = np.ones_like(t)
    theta = np.linalg.lstsq(x, y, rcond=None)[0]
    if np.any(theta < 0):  # two-parameter NNLS: keep the better one-parameter fit
        keep = int(np.argmax(theta))
        theta = np.zeros(2)
        theta[keep] = max(0.0, float(x[:, keep] @ y / (x[:, keep] @ x[:, keep])))
    pred = a_coef * theta[0] + b_coef * n * theta[1]
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0)
    return LinkFit(
        link=Link(float(theta[0]), float(theta[1])),
        r2=r2,
        max_rel_error=float(np.max(np.abs(pred - t) / t)),
        num_points=int(len(t)),
    )
