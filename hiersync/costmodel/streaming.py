"""Streaming sync in the schedule model: F fragments on staggered steps, each applied tau steps later.

``HierState(period=k, fragments=F, overlap=tau)`` splits the parameters into F fragments
of about equal bytes; fragment ``f`` is averaged across nodes once in every window of k
steps, at offset ``ceil((f + 1) k / F) - 1`` (as :meth:`hiersync.schedule.Schedule.offset`
staggers them), so a step carries ``ceil(F / k)`` fragments at most. The average is
launched right after ``optimizer.step()`` and, with ``overlap=tau >= 1``, applied after
the ``optimizer.step()`` tau steps later: the transfer hides behind tau whole steps.
``overlap=0`` blocks: the whole transfer is exposed on the step that launches it.

This module prices one window of k steps in steady state (:func:`sync_stalls`): the
fragments' transfers share one FIFO channel (the rail all-reduce and the intra gather,
:func:`~.hierarchy.param_sync_time`), the wait at each apply point is the step's exposed
sync time. While the channel keeps up, a fragment's wait is ``max(0, transfer - tau *
compute)``; when it cannot (``F * transfer > k * compute``), the queue throttles the steps
to the channel's pace (a window then lasts at least ``F * transfer``; close to that
capacity, where the queue takes many windows to settle, the stalls are completed to that
bound). :func:`fragments_per_step` and :func:`inter_bytes_per_rank` give
the traffic per step. Pure: no torch.

Example::

    >>> fragments_per_step(4, 2)
    (0, 1, 0, 1)
    >>> sync_stalls(4, 1, 1, transfer_s=3.0, compute_s=1.0)  # launched on step 3, applied after step 0
    (2.0, 0.0, 0.0, 0.0)
"""

from __future__ import annotations

from typing import Any

from .links import check_count, check_number

__all__ = [
    "SYNC_COPIES",
    "APPLY_PASSES",
    "DEFAULT_COPY_S_PER_BYTE",
    "launch_copy_bytes",
    "check_streaming",
    "fragment_offset",
    "fragments_per_step",
    "sync_stalls",
    "inter_bytes_per_rank",
]

SYNC_COPIES = 2
"""Copies of a rank's shard of a fragment per overlapped launch (the snapshot and the payload,
``ShardedAverager.launch``); see :func:`launch_copy_bytes`."""
APPLY_PASSES = 1.5
"""An overlapped correction added into its fragment's parameters, in copies of the fragment: an
add reads two vectors and writes one where a copy reads one and writes one."""
DEFAULT_COPY_S_PER_BYTE = 0.0
"""Copies are free by default, which keeps the whole-model placements' numbers as they were.
A device-to-device copy on an H100 (~3 TB/s of HBM, read + write) costs ~7e-13 s/B, one
into pinned host memory ~4e-11 s/B (PCIe 5.0, ~25 GB/s), a CPU memcpy ~2e-10 s/B."""
_WINDOWS = 64  # steady state is reached within a few windows unless the channel is just over capacity


def launch_copy_bytes(fragment_bytes: float, ranks_per_node: int, overlap: int, compress_ratio: float = 1.0) -> float:
    """Bytes, in copies, a rank moves on the compute stream for one fragment's cross-node average.

    The after-step state is sharded across the node: a rank flattens only its 1/L shard.
    Overlapped (``overlap >= 1``), it keeps a snapshot of the shard and a payload for the
    transfer (``SYNC_COPIES`` = 2 shard copies), and ``tau`` steps later adds the node's
    gathered correction into the whole fragment (``APPLY_PASSES`` copies of it); blocking, one
    payload, and the average is written back into the whole fragment's parameters once the
    node gathered it. Either way the payload is divided by the number of nodes in place before
    the rail all-reduce (one pass over it). With ``compress`` (``compress_ratio`` < 1) the
    payload is the delta from the anchor (one shard, in place when blocking) cast to 16 bits
    (``compress_ratio`` of a shard more), and the averaged delta comes back as a new fp32
    shard: on the compute stream when blocking, or when applying an overlapped correction on a
    node of one rank (with L > 1 that maths runs at the end of the rail leg, off the step); it
    is counted here, with the launch.
    """
    lpn = check_count("ranks_per_node", ranks_per_node)
    fragment_bytes = check_number("fragment_bytes", fragment_bytes)
    shard = fragment_bytes / lpn
    ratio = check_number("compress_ratio", compress_ratio, strict=True)
    cast = ratio * shard if ratio < 1 else 0.0
    back = shard if ratio < 1 and (not overlap or lpn == 1) else 0.0
    divide = min(ratio, 1.0) * shard
    if overlap:
        return SYNC_COPIES * shard + APPLY_PASSES * fragment_bytes + divide + cast + back
    return shard + fragment_bytes + divide + cast + back


def check_streaming(period: int, fragments: Any, overlap: Any) -> tuple[int, int]:
    """``(fragments, overlap)`` validated for ``period``; ``overlap`` True/False mean 1/0.

    Raises ``ValueError`` naming the bad value and the fix, as ``HierState`` does.
    """
    f = check_count("fragments", fragments)
    if isinstance(overlap, bool):
        overlap = int(overlap)
    if not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"overlap must be False/0 (blocking), True (= 1) or an int tau >= 1, got {overlap!r}")
    streaming = f > 1 or overlap > 0
    if streaming and period < 2:
        raise ValueError(
            f"fragments={f}, overlap={overlap} need period >= 2 (period=1 is exact: nothing to stream); "
            f"pass period >= 2 or fragments=1, overlap=0"
        )
    if overlap > period - 1:
        raise ValueError(
            f"overlap={overlap} must be at most period - 1 = {period - 1} (a fragment's average must be applied "
            f"before its next sync); lower overlap or raise period"
        )
    return f, overlap


def fragment_offset(fragment: int, period: int, fragments: int) -> int:
    """The step (0-based) in each window of ``period`` steps on which ``fragment`` syncs."""
    return -(-(fragment + 1) * period // fragments) - 1


def fragments_per_step(period: int, fragments: int) -> tuple[int, ...]:
    """How many fragments launch on each step of a window; F = 1: the last step only."""
    counts = [0] * period
    for f in range(fragments):
        counts[fragment_offset(f, period, fragments)] += 1
    return tuple(counts)


def sync_stalls(
    period: int,
    fragments: int,
    overlap: int,
    *,
    transfer_s: float,
    compute_s: float,
    copy_s: float = 0.0,
) -> tuple[float, ...]:
    """Exposed sync time of each step of one window of ``period`` steps, in steady state.

    ``transfer_s``: one fragment's cross-node average; ``compute_s``: one step's time
    without the sync (its compute and its exposed intra-node communication), the only time
    a transfer hides behind; ``copy_s``: one fragment's launch copies (:func:`launch_copy_bytes`)
    (exposed). After step ``s``'s compute, the fragments launched on step ``s - overlap``
    are applied (the step waits for their transfers), then step ``s``'s fragments are
    copied and launched into one FIFO channel. ``overlap=0``: each fragment's copies and
    transfer are exposed on its step. Step ``j`` of the result is the window's step ``j``
    (fragments as :func:`fragments_per_step`).
    """
    period = check_count("period", period)
    fragments, overlap = check_streaming(period, fragments, overlap)
    transfer_s, compute_s = check_number("transfer_s", transfer_s), check_number("compute_s", compute_s)
    copy_s = check_number("copy_s", copy_s)
    counts = fragments_per_step(period, fragments)
    if overlap == 0:
        return tuple(c * (copy_s + transfer_s) for c in counts)
    t, free = 0.0, 0.0  # now; when the channel finishes what it holds
    done: dict[int, float] = {}  # step -> when its fragments' transfers end
    tol = 1e-12 * (transfer_s + compute_s + copy_s)
    last: tuple[list[float], list[float]] = ([], [])
    stalls: list[float] = []
    for window in range(_WINDOWS):
        stalls = []
        for j, count in enumerate(counts):
            s = window * period + j
            t += compute_s
            start = t
            t = max(t, done.pop(s - overlap, t))
            if count:
                t += count * copy_s
                # rebase time on the launch, so a lone fragment's wait is transfer - elapsed compute
                free, done = free - t, {i: d - t for i, d in done.items()}
                t, start = 0.0, start - t
                for _ in range(count):
                    free = max(free, 0.0) + transfer_s
                done[s] = free
            stalls.append(t - start)
        # the state a window leaves (backlog, transfers in flight) fixes every later window
        state = [max(free - t, 0.0)] + [done[i] - t for i in sorted(done)]
        if len(state) == len(last[1]) and all(abs(a - b) <= tol for a, b in zip(stalls + state, last[0] + last[1])):
            return tuple(stalls)
        last = (stalls, state)
    # Not periodic yet: the backlog still grows by a little per window (the channel is just
    # over capacity). The channel must move F transfers per window: complete the stalls to
    # that throughput bound on the steps that apply fragments.
    deficit = fragments * transfer_s - period * compute_s - sum(stalls)
    if deficit > 0:
        applies = [counts[(j - overlap) % period] for j in range(period)]
        stalls = [st + deficit * a / fragments for st, a in zip(stalls, applies)]
    return tuple(stalls)


def inter_bytes_per_rank(kind: str, nbytes: float, nodes: int, ranks_per_node: int) -> float:
    """Bytes one rank sends between nodes for one collective on ``nbytes`` (bandwidth-optimal).

    The accounting of ``HierState.stats.bytes_sent["inter"]``: an all-reduce of m bytes on
    p ranks sends ``2(p-1)/p * m`` per rank. ``"rail"`` (hiersync's two-level all-reduce and
    the parameter average): each rank all-reduces its ``n / L`` shard on its rail of N
    ranks, ``2(N-1)/N * n / L``. ``"flat"`` (DDP): a node's NICs carry ``2(p-1)/p * n`` of a
    flat all-reduce over p = N L ranks (docs/costmodel-formulas.md), ``1/L`` of that per rank on
    average. One node: 0.
    """
    n = check_number("nbytes", nbytes)
    n_nodes, lpn = check_count("nodes", nodes), check_count("ranks_per_node", ranks_per_node)
    if n_nodes == 1:
        return 0.0
    if kind == "rail":
        return 2 * (n_nodes - 1) / n_nodes * n / lpn
    if kind == "flat":
        p = n_nodes * lpn
        return 2 * (p - 1) / p * n / lpn
    raise ValueError(f"unknown kind {kind!r}; valid: rail, flat")
