"""How long one collective takes on a cluster :class:`~.profile.Profile`: the one entry point.

:func:`predict_allreduce` is what every part of hiersync that prices an all-reduce asks: the
planner, ``project``, ``HierState(algorithm="auto")`` and the bench's model column. Under
NCCL it is NCCL's own tuning model (:mod:`.nccl`) on the profile's links: the (algorithm,
protocol) NCCL's tuner runs for that size and shape, and the time it predicts. On other
backends (gloo) it is the alpha-beta ring of :mod:`.hierarchy` on the profile's links, which
``python -m hiersync calibrate`` fits there.

The legs of hiersync's own collectives go through the same functions: the intra-node
all-reduce is :func:`predict_allreduce` on one node (:func:`node_profile`), the rail
all-reduce is :func:`predict_allreduce` on N ranks of one local rank each, sharing the node's
NICs with the other rails (:func:`rail_profile`), and the node's reduce-scatter and
all-gather are :func:`predict_reduce_scatter` / :func:`predict_all_gather`. Pure: no torch.

Example::

    >>> from hiersync.costmodel import PRESETS
    >>> h100 = PRESETS["h100-8rail"]
    >>> round(predict_allreduce(25 * 2**20, h100.with_shape(nodes=2)) * 1e3, 3)  # ms
    0.213
    >>> explain_allreduce(25 * 2**20, h100.with_shape(nodes=2)), explain_allreduce(2**20, h100.with_shape(nodes=16))
    ('nvls_tree/Simple', 'tree/LL128')
    >>> choose_exact_algorithm(100e6, 2, 2, PRESETS["emulated"])
    'two_level'
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from hiersync.vocab import wire_format

from . import nccl
from .compression import QUANTIZED_BITS, bits_per_element, compress_ratio, is_quantized, quantize_seconds
from .hierarchy import check_intra_algorithm, flat_allreduce_time, two_level_stages
from .links import Link, all_gather_time, check_number, reduce_scatter_time

if TYPE_CHECKING:
    from .profile import Profile

__all__ = [
    "PREDICT_ALGORITHMS",
    "fabric",
    "node_profile",
    "rail_profile",
    "predict_allreduce",
    "explain_allreduce",
    "predict_reduce_scatter",
    "predict_all_gather",
    "predict_rail_collective",
    "quantized_average_seconds",
    "predict_two_level",
    "predict_param_sync",
    "choose_exact_algorithm",
]

PREDICT_ALGORITHMS = ("auto", "ring", "tree")


def _uses_nccl(profile: Profile) -> bool:
    return "nccl" in profile.backend.lower()


def fabric(profile: Profile) -> nccl.Fabric:
    """The :class:`~.nccl.Fabric` NCCL's tuner sees on ``profile``'s shape and links."""
    nics = (
        profile.rails or profile.ranks_per_node
    )  # all of them: NCCL drives several NICs per GPU where a node has them
    return nccl.Fabric(
        nodes=profile.nodes,
        ranks_per_node=profile.ranks_per_node,
        ring_busbw=profile.intra.bandwidth,
        nic_busbw=nics * profile.inter.bandwidth,
        nvls_busbw=None if profile.nvls_gbps is None else profile.nvls_gbps * 1e9,
        channels=profile.channels,
        gpu=profile.gpu,
        intra_link=profile.intra_link,
        net_latency_us=profile.net_latency_us,
        tuner_net_latency_us=profile.tuner_net_latency_us,
        host_cpu=profile.host_cpu,
        leaf_nodes=profile.leaf_nodes,
        tier_efficiency=profile.tier_efficiency,
    )


def node_profile(profile: Profile) -> Profile:
    """``profile`` on one of its nodes: the intra-node group."""
    return replace(profile, nodes=1)


def rail_profile(profile: Profile) -> Profile:
    """``profile``'s rail: one rank on each of its nodes, all L rails sharing the node's NICs.

    Each rail gets ``rails / L`` of the node's NICs, as hiersync runs every rail's all-reduce at
    once: a fraction of one with fewer NICs than ranks, two with 16 NICs for 8 GPUs (NCCL drives
    every NIC; :func:`~.hierarchy.rail_link`, the alpha-beta model's, stops at one).
    """
    lpn = profile.ranks_per_node
    rail = Link(profile.inter.alpha, profile.inter.beta * lpn / (profile.rails or lpn), profile.inter.gamma)
    return replace(profile, ranks_per_node=1, rails=1, inter=rail, nvls_gbps=None)


def _check(nbytes: float, algorithm: str) -> float:
    if algorithm not in PREDICT_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(PREDICT_ALGORITHMS)}")
    return check_number("nbytes", nbytes)


def predict_allreduce(nbytes: float, profile: Profile, algorithm: str = "auto") -> float:
    """Seconds for one all-reduce of ``nbytes`` on ``profile.nodes x profile.ranks_per_node`` ranks.

    ``"auto"``: as NCCL runs it (the fastest algorithm and protocol of its tuner: Ring, Tree,
    NVLS on one node, NVLSTree across nodes; LL, LL128, Simple), or gloo's ring on other
    backends. ``"ring"`` / ``"tree"``: forced (``NCCL_ALGO``), in its fastest protocol; on
    gloo, the alpha-beta ring or tree of :func:`~.hierarchy.flat_allreduce_time`.
    """
    n = _check(nbytes, algorithm)
    if _uses_nccl(profile):
        return nccl.allreduce(n, fabric(profile), algorithm).time_s
    algo = "ring" if algorithm == "auto" else algorithm
    return flat_allreduce_time(
        n,
        profile.nodes,
        profile.ranks_per_node,
        profile.intra,
        profile.inter,
        profile.rails,
        algo,
        efficiency=profile.tree_efficiency,
    )


def explain_allreduce(nbytes: float, profile: Profile, algorithm: str = "auto") -> str:
    """``"algorithm/protocol"`` that :func:`predict_allreduce` priced, e.g. ``"nvls_tree/Simple"``."""
    n = _check(nbytes, algorithm)
    if _uses_nccl(profile):
        choice = nccl.allreduce(n, fabric(profile), algorithm)
        return f"{choice.algorithm}/{choice.protocol}"
    return f"{'ring' if algorithm == 'auto' else algorithm} ({profile.backend})"


def _intra_collective(kind: str, nbytes: float, profile: Profile) -> float:
    n = check_number("nbytes", nbytes)
    if profile.ranks_per_node == 1:
        return 0.0
    if _uses_nccl(profile):
        return nccl.ring_collective(kind, n, fabric(node_profile(profile))).time_s
    if kind == "reduce_scatter":
        return reduce_scatter_time("ring", profile.ranks_per_node, n, profile.intra_reduce_scatter or profile.intra)
    return all_gather_time("ring", profile.ranks_per_node, n, profile.intra_all_gather or profile.intra)


def predict_rail_collective(kind: str, nbytes: float, profile: Profile) -> float:
    """Seconds for a ``"reduce_scatter"``, ``"all_gather"`` or ``"all_to_all"`` of ``nbytes`` per
    rank on ``profile``'s rail (one rank per node, every rail at once: :func:`rail_profile`).

    An all-to-all moves what a reduce-scatter moves ((N-1)/N of the input per rank, N-1
    messages) and is priced as NCCL's ring reduce-scatter of it (an upper bound on its
    latency), or gloo's alpha-beta ring.
    """
    if kind not in ("reduce_scatter", "all_gather", "all_to_all"):
        raise ValueError(f"unknown rail collective {kind!r}; valid: reduce_scatter, all_gather, all_to_all")
    n = check_number("nbytes", nbytes)
    if profile.nodes == 1:
        return 0.0
    rail = rail_profile(profile)
    ring = "all_gather" if kind == "all_gather" else "reduce_scatter"
    if _uses_nccl(rail):
        return nccl.ring_collective(ring, n, fabric(rail)).time_s
    time = all_gather_time if ring == "all_gather" else reduce_scatter_time
    return time("ring", rail.nodes, n, rail.inter)


def predict_reduce_scatter(nbytes: float, profile: Profile) -> float:
    """Seconds for the node's reduce-scatter of an ``nbytes`` input (each rank keeps 1/L)."""
    return _intra_collective("reduce_scatter", nbytes, profile)


def predict_all_gather(nbytes: float, profile: Profile) -> float:
    """Seconds for the node's all-gather into an ``nbytes`` output (each rank brings 1/L)."""
    return _intra_collective("all_gather", nbytes, profile)


def predict_two_level(
    nbytes: float,
    profile: Profile,
    intra_algorithm: str | None = None,
    *,
    reduce: bool = True,
    algorithm: str = "auto",
    compress: str | None = None,
    param_bytes: int = 4,
) -> tuple[float, float, float]:
    """(intra reduction, rail all-reduce of n/L, intra gather) of hiersync's exact two-level all-reduce.

    ``intra_algorithm`` (default :attr:`Profile.intra_algorithm`): ``"rs_ag"`` reduces by a
    reduce-scatter and gathers by an all-gather; ``"allreduce_bcast"`` (gloo) reduces by an
    all-reduce of the whole bucket and gathers by L shard broadcasts (the calibrated
    ``intra_broadcast`` link). ``reduce=False``: no intra reduction (the period-k parameter
    average, whose ranks of a node already agree): its first leg is 0. ``algorithm``: the
    rail all-reduce's (:func:`predict_allreduce`). ``compress="int8"`` / ``"int4"``: the rail
    leg is the quantized rail average of the shard
    (:func:`quantized_average_seconds`) and the gather moves the quantized bytes;
    ``nbytes`` is then the full-precision size (other values of ``compress``: pass the bytes
    actually sent).
    """
    n = check_number("nbytes", nbytes)
    algo = check_intra_algorithm(intra_algorithm, profile.backend)
    lpn = profile.ranks_per_node
    if compress is not None and is_quantized(compress):
        if profile.nodes == 1:
            return 0.0, 0.0, 0.0
        sent = n * compress_ratio(compress, param_bytes)
        first, _, last = predict_two_level(sent, profile, intra_algorithm, reduce=reduce, algorithm=algorithm)
        return first, quantized_average_seconds(n / lpn, profile, compress, param_bytes), last
    if not _uses_nccl(profile):
        rs_link = profile.intra_reduce_scatter if reduce else None
        first, ar, last = two_level_stages(
            n, profile.nodes, lpn, profile.intra, profile.inter, profile.rails, "ring",
            profile.tree_efficiency, rs_link, profile.intra_all_gather, algo, profile.intra_broadcast,
        )  # fmt: skip
        if profile.nodes > 1:
            ar = predict_allreduce(n / lpn, rail_profile(profile), algorithm)
        return (first if reduce else 0.0), ar, last
    if profile.nodes == 1:
        return (predict_allreduce(n, profile) if reduce else 0.0), 0.0, 0.0
    ar = predict_allreduce(n / lpn, rail_profile(profile), algorithm)
    if algo == "allreduce_bcast":  # NCCL runs rs_ag; priced on request as an intra all-reduce + the gather
        first = predict_allreduce(n, node_profile(profile)) if reduce else 0.0
    else:
        first = predict_reduce_scatter(n, profile) if reduce else 0.0
    return first, ar, predict_all_gather(n, profile)


def predict_param_sync(
    nbytes: float,
    profile: Profile,
    intra_algorithm: str | None = None,
    algorithm: str = "auto",
    *,
    compress: str | None = None,
    param_bytes: int = 4,
) -> float:
    """Seconds for one period-k parameter average of ``nbytes``: the rail all-reduce of each
    rank's 1/L shard and the node's gather (no intra reduction: the ranks of a node agree).
    ``compress``: as :func:`predict_two_level`."""
    if profile.nodes == 1:
        return 0.0
    _, ar, gather = predict_two_level(
        nbytes, profile, intra_algorithm, reduce=False, algorithm=algorithm, compress=compress, param_bytes=param_bytes
    )
    return ar + gather


def choose_exact_algorithm(
    nbytes: float, nodes: int, ranks_per_node: int, profile: Profile, *, intra_algorithm: str | None = None
) -> str:
    """``"flat"`` or ``"two_level"``: the faster exact all-reduce of one ``nbytes`` bucket.

    What ``HierState(algorithm="auto")`` asks: :func:`predict_allreduce` of the bucket over the
    world against hiersync's two-level all-reduce (:func:`predict_two_level`) on ``profile``'s
    links, shaped ``nodes`` x ``ranks_per_node``. One node or one rank per node: ``"flat"``
    (two levels would add steps for nothing). Ties: flat. ``intra_algorithm``: the two-level
    variant (default :attr:`Profile.intra_algorithm`).
    """
    check_intra_algorithm(intra_algorithm, profile.backend)
    if nodes <= 1 or ranks_per_node <= 1:
        return "flat"
    shaped = profile.with_shape(nodes=nodes, ranks_per_node=ranks_per_node)
    flat = predict_allreduce(nbytes, shaped)
    two = sum(predict_two_level(nbytes, shaped, intra_algorithm))
    return "two_level" if two < flat else "flat"


def quantized_average_seconds(shard_bytes: float, profile: Profile, compress: str, param_bytes: int = 4) -> float:
    """One coded rail average (int8/int4, sparse) of a rank's ``shard_bytes`` shard on ``profile``'s rail.

    Its row's collectives (:data:`hiersync.vocab.WIRE_FORMATS`), priced on the rail: an
    all-to-all of the coded shard and an all-gather of the requantized pieces, or an all-gather
    of every node's whole payload; plus :func:`~.compression.quantize_seconds`. One node: 0.
    """
    if not is_quantized(compress):
        raise ValueError(f"compress={compress!r} is not quantized; valid: {', '.join(QUANTIZED_BITS)}")
    if profile.nodes == 1:
        return 0.0
    elements = check_number("shard_bytes", shard_bytes) / param_bytes
    wire = elements * bits_per_element(compress, param_bytes) / 8
    if wire_format(compress).average == "all_gather":
        gathered = predict_rail_collective("all_gather", wire * profile.nodes, profile)
        return gathered + quantize_seconds(elements, profile.nodes, profile, compress)
    exchange = predict_rail_collective("all_to_all", wire, profile)
    gather = predict_rail_collective("all_gather", wire, profile)
    return exchange + gather + quantize_seconds(elements, profile.nodes, profile, compress)
