"""Flat versus two-level all-reduce on N nodes of L ranks, and the period-k parameter average.

The textbook alpha-beta formulas on a cluster of ``nodes`` x ``ranks_per_node`` ranks with
``rails`` NICs per node: a flat all-reduce (:func:`flat_allreduce_time`), hiersync's exact
two-level all-reduce (:func:`hierarchical_allreduce_time`, in either intra algorithm) and the
inter-node parameter average of period k (:func:`param_sync_time`). Two-level formulas take
the node's ``intra`` link (per GPU) and ``inter`` link (per NIC). These are what gloo runs
(rings); under NCCL, :func:`hiersync.costmodel.predict_allreduce` prices what NCCL's tuner
runs instead, and everything that predicts a step goes through it. Pure: no torch.

Example::

    >>> from hiersync.costmodel import Link
    >>> round(flat_allreduce_time(100e6, 2, 2, Link(1e-5, 1e-9), Link(5e-4, 1e-8), rails=1) * 1e3, 2)
    1502.02
"""

from __future__ import annotations

from hiersync.vocab import INTRA_ALGORITHMS, IntraAlgorithm, default_intra_algorithm

from .links import (
    DEFAULT_TREE_EFFICIENCY,
    Link,
    affine_crossover,
    all_gather_time,
    allreduce_time,
    broadcast_time,
    ceil_log2,
    check_count,
    check_efficiency,
    check_number,
    collective_affine,
    reduce_scatter_time,
)

__all__ = [
    "FLAT_ALGORITHMS",
    "INTRA_ALGORITHMS",
    "intra_algorithm_for_backend",
    "check_intra_algorithm",
    "check_topology",
    "rail_link",
    "flat_affine",
    "flat_allreduce_time",
    "rail_allreduce_time",
    "two_level_stages",
    "hierarchical_allreduce_time",
    "param_sync_time",
    "flat_crossover_bytes",
]

FLAT_ALGORITHMS = ("ring", "tree", "auto")
# How the two-level all-reduce reduces and gathers inside the node (HierComm.intra_algorithm):
# "rs_ag": reduce-scatter -> rail all-reduce of the 1/L shard -> all-gather (bandwidth-optimal;
# NCCL); "allreduce_bcast": all-reduce of the whole bucket -> rail all-reduce of this rank's 1/L
# shard -> L broadcasts of n/L, each local rank the source of its own shard (gloo, whose CPU
# reduce-scatter and all-gather are slower than its all-reduce and broadcast).


def intra_algorithm_for_backend(backend: str) -> IntraAlgorithm:
    """The intra algorithm ``HierComm`` picks on ``backend``: ``"allreduce_bcast"`` on gloo, else ``"rs_ag"``."""
    return default_intra_algorithm(str(backend).strip())


def check_intra_algorithm(intra_algorithm: str | None, backend: str) -> str:
    """``intra_algorithm``, or the one ``backend`` runs when None; ``ValueError`` for an unknown one."""
    algo = intra_algorithm_for_backend(backend) if intra_algorithm is None else intra_algorithm
    if algo not in INTRA_ALGORITHMS:
        raise ValueError(f"unknown intra_algorithm {algo!r}; valid: {', '.join(INTRA_ALGORITHMS)} (or None)")
    return algo


def check_topology(nodes: int, ranks_per_node: int, rails: int | None) -> tuple[int, int, int]:
    """``(nodes, ranks_per_node, rails)`` validated; rails default to one per rank and are capped at L."""
    n = check_count("nodes", nodes)
    lpn = check_count("ranks_per_node", ranks_per_node)
    r = lpn if rails is None else check_count("rails", rails)
    return n, lpn, min(r, lpn)  # a rank drives one NIC at most; extra NICs are not modelled


def rail_link(inter: Link, ranks_per_node: int, rails: int | None = None) -> Link:
    """The link one rail (the ranks with one local rank) sees when ``rails`` NICs serve ``ranks_per_node`` ranks.

    With one NIC per rank the rail owns its NIC. With fewer NICs the L rails share them,
    so each rail gets ``rails / L`` of a NIC: beta scales by ``L / rails``.
    """
    _, lpn, r = check_topology(1, ranks_per_node, rails)
    return Link(inter.alpha, inter.beta * lpn / r, inter.gamma)


def flat_affine(
    algorithm: str, nodes: int, ranks_per_node: int, intra: Link, inter: Link, rails: int | None, efficiency: float
) -> tuple[float, float]:
    """``(latency_s, seconds_per_byte)`` of :func:`flat_allreduce_time`'s ``"ring"`` or ``"tree"``."""
    n_nodes, lpn, r = check_topology(nodes, ranks_per_node, rails)
    if algorithm not in ("ring", "tree"):
        raise ValueError(f"unknown flat all-reduce algorithm {algorithm!r}; valid: {', '.join(FLAT_ALGORITHMS)}")
    if n_nodes == 1:
        return collective_affine("allreduce", algorithm, lpn, intra, efficiency)
    eta = check_efficiency(efficiency)
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
    latency = 2 * ((lpn - 1) * intra.alpha + ceil_log2(n_nodes) * inter.alpha)
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
    n = check_number("nbytes", nbytes)
    if algorithm == "auto":
        return min(
            flat_allreduce_time(n, nodes, ranks_per_node, intra, inter, rails, a, efficiency=efficiency)
            for a in ("ring", "tree")
        )
    a, b = flat_affine(algorithm, nodes, ranks_per_node, intra, inter, rails, efficiency)
    return a + b * n


def rail_allreduce_time(nbytes: float, nodes: int, rail: Link, algorithm: str, efficiency: float) -> float:
    """All-reduce of ``nbytes`` on the ``nodes`` ranks of one rail; ``"auto"``: the faster of ring and tree."""
    if algorithm == "auto":
        return min(allreduce_time(a, nodes, nbytes, rail, efficiency=efficiency) for a in ("ring", "tree"))
    return allreduce_time(algorithm, nodes, nbytes, rail, efficiency=efficiency)


def two_level_stages(
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
    """(intra reduction, rail all-reduce of n/L, intra gather) in seconds: the three legs in order.

    ``"rs_ag"``: ring reduce-scatter of n, ring all-gather of n. ``"allreduce_bcast"``:
    ring all-reduce of n on ``intra``, then L binomial broadcasts of n/L one after the
    other. ``rs_link`` / ``ag_link`` / ``bcast_link``: measured effective links of the
    node's reduce-scatter, all-gather and shard broadcast where they differ from what
    ``intra`` predicts (see :class:`Profile`).
    """
    n = check_number("nbytes", nbytes)
    n_nodes, lpn, _ = check_topology(nodes, ranks_per_node, rails)
    if n_nodes == 1 and (rs_link is not None or ag_link is not None or intra_algorithm == "allreduce_bcast"):
        # hiersync runs one intra all-reduce then; with plain links RS + AG equals it anyway
        return allreduce_time("ring", lpn, n, intra), 0.0, 0.0
    ar = rail_allreduce_time(n / lpn, n_nodes, rail_link(inter, lpn, rails), inter_algorithm, efficiency)
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
    algo = check_intra_algorithm(intra_algorithm, backend)
    return sum(
        two_level_stages(
            nbytes,
            nodes,
            ranks_per_node,
            intra,
            inter,
            rails,
            inter_algorithm,
            efficiency,
            reduce_scatter,
            all_gather,
            algo,
            broadcast,
        )
    )


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
    ratio = check_number("compress_ratio", compress_ratio, strict=True)
    algo = check_intra_algorithm(intra_algorithm, backend)
    if nodes == 1:
        return 0.0
    _, ar, gather = two_level_stages(
        nbytes * ratio,
        nodes,
        ranks_per_node,
        intra,
        inter,
        rails,
        inter_algorithm,
        efficiency,
        None,
        all_gather,
        algo,
        broadcast,
    )
    return ar + gather


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
    return affine_crossover(flat_affine(first, *args), flat_affine(second, *args))
