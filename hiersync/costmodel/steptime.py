"""The schedule model: predicted communication and exposed time of one training step.

Buckets become ready uniformly during backward, in order; each bucket's collectives form a
*chain* of stages on process groups (``"world"``, ``"intra"``, ``"rail"``), and the stages
of one group run one at a time, first in first out (:func:`simulate`). :func:`step_time`
builds those chains for DDP, hiersync at period 1 or k, and intra-node-only averaging; every
collective in them is priced by :mod:`.predict` (:func:`~.predict.predict_allreduce`). Pure: no torch.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hiersync.vocab import Placement

from .compression import compress_ratio as compress_ratio_of
from .compression import is_quantized
from .hierarchy import FLAT_ALGORITHMS, check_intra_algorithm, check_topology
from .links import Link, check_count, check_number
from .predict import node_profile, predict_allreduce, predict_param_sync, predict_two_level
from .streaming import (
    DEFAULT_COPY_S_PER_BYTE,
    check_streaming,
    fragments_per_step,
    inter_bytes_per_rank,
    launch_copy_bytes,
    sync_stalls,
)

if TYPE_CHECKING:
    from .profile import Profile

__all__ = ["SCHEDULES", "PLACEMENTS", "StepTime", "bucket_sizes", "simulate", "step_time"]

SCHEDULES = ("ddp", "hiersync", "intra_only")
PLACEMENTS = tuple(p.value for p in Placement)
"""Where the period-k average runs (:class:`hiersync.vocab.Placement`): hook, optimizer, overlap."""


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
    exposed_peak_s: float = 0.0
    """Exposed communication of the slowest step of the period (``exposed_s`` is the mean)."""
    inter_bytes_peak: float = 0.0
    """Bytes a rank sends between nodes in its busiest step (bandwidth-optimal accounting,
    as ``HierState.stats.bytes_sent["inter"]``; an overlapped sync counts on its launch step)."""
    inter_bytes_mean: float = 0.0
    """Bytes a rank sends between nodes per step, averaged over the period."""
    fragments: int = 1
    """Fragments of the period-k sync (streaming); 1 = the whole model at once."""
    overlap: int = 0
    """Steps between a sync's launch and its application (tau); 0 = blocking."""


def bucket_sizes(grad_bytes: float, bucket_bytes: float) -> list[float]:
    """``grad_bytes`` cut into buckets of ``bucket_bytes``, the last one holding the rest."""
    count = max(1, math.ceil(grad_bytes / bucket_bytes - 1e-9))
    return [bucket_bytes] * (count - 1) + [grad_bytes - bucket_bytes * (count - 1)]


def simulate(ready: Sequence[float], chains: Sequence[Sequence[tuple[str, float]]]) -> float:
    """Finish time of the last collective: each chain's stages run in order, each group FIFO.

    Example::

        >>> chain = [("intra", 1.0), ("rail", 10.0), ("intra", 1.0)]
        >>> simulate([0.0, 0.0], [chain, chain])  # the second rail leg waits for the first
        22.0

    ``ready[i]`` is when chain ``i`` may start (its bucket's gradient is ready);
    ``chains[i]`` is its stages in order, each ``(group, seconds)``. A stage waits for the
    previous stage of its chain and for the group's previous stage (whatever chain issued
    it). Issues are served in issue-time order, and a stage is issued when the previous one
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
    placement: str | None = None,
    compute_s: float | None = None,
    nodes: int | None = None,
    ranks_per_node: int | None = None,
    algorithm: str | None = None,
    intra_algorithm: str | None = None,
    fragments: int = 1,
    overlap: int | bool = 0,
    copy_s_per_byte: float = DEFAULT_COPY_S_PER_BYTE,
    compress: str | None = None,
    param_bytes: int = 4,
) -> StepTime:
    """Predict per-step communication and exposed time of one schedule.

    ``schedule``: ``"ddp"`` (flat all-reduce of every bucket), ``"hiersync"`` (period 1:
    two-level all-reduce of every bucket; period k: intra all-reduce every step and a
    parameter average every k-th step, amortized) or ``"intra_only"`` (never across
    nodes: the k -> infinity bound). Buckets of ``bucket_bytes`` become ready uniformly
    during ``backward_s``, in order; the collectives of one process group run one at a
    time, first in first out. ``placement`` of the period-k average: ``"hook"`` (the
    default: launched with the sync step's first bucket, overlapped with backward), ``"optimizer"`` (after
    ``optimizer.step()``, fully exposed) or ``"overlap"`` (hidden behind the next step's
    ``compute_s``). ``compute_s`` defaults to ``backward_s``. ``algorithm`` (``"ring"``,
    ``"tree"``, ``"auto"``: what NCCL's tuner runs, gloo's ring) is the flat all-reduce and
    the rail all-reduce (:func:`~.predict.predict_allreduce`); default ``"auto"``.
    ``intra_algorithm`` (``"rs_ag"``, ``"allreduce_bcast"``) is
    how the two-level all-reduce and the parameter average reduce and gather inside the
    node; default :attr:`Profile.intra_algorithm` (by backend, as ``HierComm`` picks).
    ``nodes`` / ``ranks_per_node`` override the profile's. Warmup steps are not modelled.

    Streaming (``HierState(period=k, fragments=F, overlap=tau)``, :mod:`.streaming`):
    ``fragments=F`` fragments sync on staggered steps after ``optimizer.step()``, each
    applied ``overlap=tau`` steps after its launch (0: blocking; True: 1). Either one
    places the average after the optimizer step (``placement`` None, ``"optimizer"`` for
    tau = 0 or ``"overlap"``; ``"overlap"`` alone means tau = 1). ``fragments=1,
    overlap=0`` with ``placement="optimizer"`` is the blocking whole-model average,
    ``overlap=1`` the ``"overlap"`` placement. ``copy_s_per_byte``: cost of the
    launch copies of each fragment (:func:`.streaming.launch_copy_bytes`), exposed (default 0: free).

    ``compress`` (None, ``"bf16"``, ``"fp16"``, ``"int8"``, ``"int4"``) prices the period-k
    average's bits per element (:mod:`.compression`; ``param_bytes`` per parameter, fp32 by
    default): 16-bit values are all-reduced on the rail, int8/int4 go through the quantized rail
    average (all-to-all, fp32 sum, requantize, all-gather, and the quantize passes).
    ``compress_ratio`` is the older way to say the bytes sent per byte (all-reduced); give one.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
    check_count("period", period)
    n_frag, tau = check_streaming(period, fragments, overlap)
    streaming = n_frag > 1 or tau > 0
    if streaming and schedule != "hiersync":
        raise ValueError(f"fragments={n_frag}, overlap={tau} apply to schedule='hiersync' only, not {schedule!r}")
    if streaming and placement == "hook":
        raise ValueError(
            f"fragments={n_frag}, overlap={tau} run the average after optimizer.step() (an attached optimizer), "
            f"not in the hook: pass placement=None, 'optimizer' (overlap=0) or 'overlap'"
        )
    if placement == "optimizer" and tau > 0:
        raise ValueError(f"placement='optimizer' is blocking but overlap={tau}; pass placement='overlap' or None")
    if placement == "overlap" and tau == 0:
        tau = 1  # the whole-model overlap placement: applied one step after its launch
    # today's labels for the whole-model placements; "F=.. tau=.." when streaming was asked for
    suffix = f" F={n_frag} tau={tau}" if streaming else f" {placement}"
    if placement is None:
        placement = ("overlap" if tau else "optimizer") if streaming else "hook"
    copy_beta = check_number("copy_s_per_byte", copy_s_per_byte)
    g = check_number("grad_bytes", grad_bytes, strict=True)
    b = check_number("bucket_bytes", bucket_bytes, strict=True)
    backward = check_number("backward_s", backward_s)
    compute = backward if compute_s is None else check_number("compute_s", compute_s)
    ratio = check_number("compress_ratio", compress_ratio, strict=True)
    quant = None
    if compress is not None:
        if ratio != 1.0:
            raise ValueError(f"give compress={compress!r} or compress_ratio={ratio!r}, not both")
        ratio = compress_ratio_of(compress, param_bytes)
        quant = compress if is_quantized(compress) else None
    n_nodes = profile.nodes if nodes is None else nodes
    lpn = profile.ranks_per_node if ranks_per_node is None else ranks_per_node
    check_topology(n_nodes, lpn, profile.rails)
    algo = algorithm or "auto"
    if algo not in FLAT_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algo!r}; valid: {', '.join(FLAT_ALGORITHMS)}")
    intra_algo = check_intra_algorithm(intra_algorithm, profile.backend)
    shaped = profile.with_shape(nodes=n_nodes, ranks_per_node=lpn)
    # The intra-only chains never touch the network: one cache entry for every inter link.
    local = replace(node_profile(shaped), inter=_NO_LINK, rails=None, net_latency_us=0.0, metadata={})

    def run(kind: str) -> tuple[float, float]:
        return _run_buckets(
            kind, g, b, backward, local if kind == "intra" else shaped, algo, intra_algo, ratio, quant, param_bytes
        )

    k = period
    peak_bytes = mean_bytes = 0.0
    if schedule == "ddp" or (schedule == "hiersync" and (k == 1 or n_nodes == 1)):
        label = "ddp" if schedule == "ddp" else f"hiersync k={k}"
        comm, exposed = run("flat" if schedule == "ddp" else "two_level")
        peak_exposed = exposed
        peak_bytes = mean_bytes = inter_bytes_per_rank("flat" if schedule == "ddp" else "rail", g, n_nodes, lpn)
    else:
        comm, exposed = run("intra")
        peak_exposed = exposed
        label = "intra-only"
        if schedule == "hiersync":
            label = f"hiersync k={k}" + ("" if placement == "hook" else suffix)
            if placement == "hook":
                sync_comm, sync_exposed = run("sync")
                comm = ((k - 1) * comm + sync_comm) / k
                peak_exposed = max(exposed, sync_exposed)
                exposed = ((k - 1) * exposed + sync_exposed) / k
                peak_bytes = inter_bytes_per_rank("rail", g * ratio, n_nodes, lpn)
                mean_bytes = peak_bytes / k
            else:
                comm, exposed, peak_exposed, peak_bytes, mean_bytes = _after_step(
                    comm, exposed, k, n_frag, tau, g / n_frag, compute, copy_beta, ratio, n_nodes, lpn,
                    lambda n: (
                        predict_param_sync(n, shaped, intra_algo, algo, compress=quant, param_bytes=param_bytes)
                        if quant
                        else predict_param_sync(n * ratio, shaped, intra_algo, algo)
                    ),
                )  # fmt: skip
    return StepTime(
        label=label,
        comm_s=comm,
        exposed_s=exposed,
        compute_s=compute,
        step_s=compute + exposed,
        num_buckets=len(bucket_sizes(g, b)),
        exposed_peak_s=peak_exposed,
        inter_bytes_peak=peak_bytes,
        inter_bytes_mean=mean_bytes,
        fragments=n_frag,
        overlap=tau,
    )


_NO_LINK = Link(0.0, 1.0)


@functools.lru_cache(maxsize=512)
def _run_buckets(
    kind: str,
    g: float,
    b: float,
    backward: float,
    profile: Profile,
    algo: str,
    intra_algo: str,
    ratio: float,
    quant: str | None = None,
    param_bytes: int = 4,
) -> tuple[float, float]:
    """(busy, exposed) seconds of one step's bucket chains of ``kind``: ``"flat"``, ``"intra"``,
    ``"two_level"`` or ``"sync"`` (the intra all-reduces, and the parameter average of chunks of
    the buckets' sizes, every one launched when the first bucket is ready: the sync in the hook), on
    ``profile``'s shape. Every all-reduce is priced by :func:`.predict.predict_allreduce`.
    Cached: the planner asks for the same local step under every streaming variant."""
    sizes = bucket_sizes(g, b)
    ready, done = [], 0.0
    for s in sizes:
        done += s
        ready.append(backward * done / g)
    cache: dict[tuple[str, float], list[tuple[str, float]]] = {}

    def chain(kind: str, n: float) -> list[tuple[str, float]]:
        key = (kind, n)
        if key not in cache:
            if kind == "flat":
                cache[key] = [("world", predict_allreduce(n, profile, algo))]
            elif kind == "intra":
                cache[key] = [("intra", predict_allreduce(n, node_profile(profile)))]
            elif kind == "two_level":
                rs, ar, ag = predict_two_level(n, profile, intra_algo, algorithm=algo)
                cache[key] = [("intra", rs), ("rail", ar), ("intra", ag)]
            else:  # a chunk's parameter average: its rail leg, then the node's gather
                sent = n if quant else n * ratio  # a quantized average prices its own bytes
                _, ar, ag = predict_two_level(
                    sent, profile, intra_algo, reduce=False, algorithm=algo, compress=quant, param_bytes=param_bytes
                )
                cache[key] = [("rail", ar), ("intra", ag)]
        return cache[key]

    chains = [chain("intra" if kind == "sync" else kind, s) for s in sizes]
    if kind == "sync":  # the parameters do not change in backward: all launched with the first bucket
        chains += [chain("param", s) for s in sizes]
        ready += [ready[0]] * len(sizes)
    busy = sum(d for c in chains for _, d in c)
    return busy, max(0.0, simulate(ready, chains) - backward)


def _after_step(
    comm: float,
    exposed: float,
    k: int,
    fragments: int,
    tau: int,
    fragment_bytes: float,
    compute: float,
    copy_beta: float,
    ratio: float,
    nodes: int,
    lpn: int,
    sync_time: Callable[[float], float],
) -> tuple[float, float, float, float, float]:
    """(comm, exposed, peak exposed, peak bytes, mean bytes) per step of a period with the
    average after ``optimizer.step()``: :func:`.streaming.sync_stalls` over the window,
    added to the local steps' ``comm`` and ``exposed``. A transfer in flight hides behind
    the whole local step, ``compute + exposed``: while a step waits for its intra-node
    all-reduces the rail is as free as while it computes."""
    transfer = sync_time(fragment_bytes)
    counts = fragments_per_step(k, fragments)
    stalls = sync_stalls(
        k,
        fragments,
        tau,
        transfer_s=transfer,
        compute_s=compute + exposed,
        copy_s=launch_copy_bytes(fragment_bytes, lpn, tau, ratio) * copy_beta,
    )
    # sums in this order keep fragments=1 at today's "optimizer" figures bit for bit
    carrying = [c for c in counts if c]
    comm = ((k - len(carrying)) * comm + sum(c * transfer + comm for c in carrying)) / k
    stalled = [s for s in stalls if s > 0] or [0.0]
    peak_exposed = exposed + max(stalls)
    exposed = ((k - len(stalled)) * exposed + sum(exposed + s for s in stalled)) / k
    per_fragment = inter_bytes_per_rank("rail", fragment_bytes * ratio, nodes, lpn)
    return comm, exposed, peak_exposed, max(counts) * per_fragment, fragments * per_fragment / k
