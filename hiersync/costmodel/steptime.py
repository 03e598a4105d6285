"""The schedule model: predicted communication and exposed time of one training step.

Buckets become ready uniformly during backward, in order; each bucket's collectives form a
*chain* of stages on process groups (``"world"``, ``"intra"``, ``"rail"``), and the stages
of one group run one at a time, first in first out (:func:`simulate`). :func:`step_time`
builds those chains for DDP, hiersync at period 1 or k, and intra-node-only averaging, from
the formulas of :mod:`.links` and :mod:`.hierarchy`. Pure: no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hiersync.vocab import Placement

from .hierarchy import (
    FLAT_ALGORITHMS,
    check_intra_algorithm,
    check_topology,
    flat_allreduce_time,
    param_sync_time,
    two_level_stages,
)
from .links import allreduce_time, check_count, check_number

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
    check_count("period", period)
    g = check_number("grad_bytes", grad_bytes, strict=True)
    b = check_number("bucket_bytes", bucket_bytes, strict=True)
    backward = check_number("backward_s", backward_s)
    compute = backward if compute_s is None else check_number("compute_s", compute_s)
    ratio = check_number("compress_ratio", compress_ratio, strict=True)
    n_nodes = profile.nodes if nodes is None else nodes
    lpn = profile.ranks_per_node if ranks_per_node is None else ranks_per_node
    check_topology(n_nodes, lpn, profile.rails)
    algo, eta = algorithm or profile.flat_algorithm, profile.tree_efficiency
    if algo not in FLAT_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algo!r}; valid: {', '.join(FLAT_ALGORITHMS)}")
    links = (profile.intra, profile.inter, profile.rails)
    rs_link, ag_link = profile.intra_reduce_scatter, profile.intra_all_gather
    bc_link = profile.intra_broadcast
    intra_algo = check_intra_algorithm(intra_algorithm, profile.backend)

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
                cache[key] = [("world", flat_allreduce_time(n, n_nodes, lpn, *links, algo, efficiency=eta))]
            elif kind == "intra":
                cache[key] = [("intra", allreduce_time("ring", lpn, n, profile.intra))]
            else:
                rs, ar, ag = two_level_stages(n, n_nodes, lpn, *links, algo, eta, rs_link, ag_link, intra_algo, bc_link)
                if kind == "two_level":
                    cache[key] = [("intra", rs), ("rail", ar), ("intra", ag)]
                else:  # intra all-reduce of the gradient, then the bucket's parameter average
                    _, ar, ag = two_level_stages(
                        n * ratio, n_nodes, lpn, *links, algo, eta, None, ag_link, intra_algo, bc_link
                    )
                    cache[key] = [*chain("intra", n), ("rail", ar), ("intra", ag)]
        return cache[key]

    def run(kind: str) -> tuple[float, float]:
        chains = [chain(kind, s) for s in sizes]
        busy = sum(d for c in chains for _, d in c)
        return busy, max(0.0, simulate(ready, chains) - backward)

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
                    g,
                    n_nodes,
                    lpn,
                    *links,
                    algo,
                    compress_ratio=ratio,
                    efficiency=eta,
                    all_gather=ag_link,
                    intra_algorithm=intra_algo,
                    broadcast=bc_link,
                )
                hidden = compute if placement == "overlap" else 0.0
                sync_exposed = exposed + max(0.0, sync_comm - hidden)
                sync_comm += comm
            comm = ((k - 1) * comm + sync_comm) / k
            exposed = ((k - 1) * exposed + sync_exposed) / k
    return StepTime(
        label=label,
        comm_s=comm,
        exposed_s=exposed,
        compute_s=compute,
        step_s=compute + exposed,
        num_buckets=len(sizes),
    )
