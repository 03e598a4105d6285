"""Timing collectives per level for ``python -m hiersync calibrate`` (collective: every rank calls these).

:func:`sweep` times all-reduces on the intra groups and on the rails, and the node's
reduce-scatter, all-gather and shard broadcasts, at every size of a :class:`SweepConfig`;
:func:`time_ops` is the timing loop (warmup, loop counts agreed across the world,
interleaved repetitions, median of the slowest rank).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hiersync.vocab import KiB, Level, format_size

if TYPE_CHECKING:
    import torch

__all__ = [
    "QUICK_SIZES",
    "FULL_SIZES",
    "LEVELS",
    "INTRA_COLLECTIVES",
    "SweepConfig",
    "sync_device",
    "world_max",
    "time_op",
    "time_ops",
    "sweep",
]

logger = logging.getLogger(__name__)

# Every power of two from 4 KiB to 256 MiB: alpha dominates below ~10-25 KB on slow
# links, beta above ~1 MB on fast ones (docs/costmodel.md "Calibrating your cluster").
FULL_SIZES: tuple[int, ...] = tuple(4 * KiB * 2**i for i in range(17))
# Every fourth power of two up to 64 MiB: enough points on both sides of the
# alpha/beta knee, and it finishes in well under a minute on a two-core laptop.
QUICK_SIZES: tuple[int, ...] = tuple(4 * KiB * 4**i for i in range(9))[:-1]
LEVELS = (Level.INTRA, Level.INTER)
# What the two-level all-reduce runs inside the node, measured as well: a backend may
# implement them less efficiently than its all-reduce (gloo does; see costmodel.Profile).
# "intra_broadcast" is the shard gather of HierComm's "allreduce_bcast" variant (gloo): L
# broadcasts of n/L issued together, each local rank the source of its own shard.
INTRA_COLLECTIVES = {
    "intra_reduce_scatter": "reduce_scatter",
    "intra_all_gather": "all_gather",
    "intra_broadcast": "broadcast",
}
# The algorithm each intra collective is fitted with: gloo's broadcast is a binomial tree.


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """How to time each message size. Every rank must use the same values."""

    sizes: tuple[int, ...] = QUICK_SIZES
    """Message sizes in bytes (fp32 tensors; rounded down to whole elements)."""
    warmup: int = 2
    """Untimed calls first: connections, buffers, caches."""
    reps: int = 5
    """Timed repetitions; the median is reported (at least 3 survive the budget)."""
    min_rep_s: float = 0.02
    """A repetition loops the collective until it lasts this long, so one barrier's skew
    (tens of microseconds) does not swamp a 4 KB all-reduce."""
    budget_s: float = 2.0
    """Seconds per size and level (on average) after warmup: when the sizes' repetitions
    would take longer, fewer (but at least 3) are made."""

    def __post_init__(self) -> None:
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in self.sizes):
            raise ValueError(f"sizes must be ints >= 4 bytes, got {list(self.sizes)}")
        if len(set(self.sizes)) < 2:
            raise ValueError(f"need at least 2 distinct sizes to fit alpha and beta, got {list(self.sizes)}")
        for name in ("warmup", "reps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'warmup' else 1}, got {value!r}")
        for name in ("min_rep_s", "budget_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def world_max(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise maximum of ``values`` over every rank of the world. Collective."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]


def time_ops(
    ops: Sequence[Callable[[], Any]], device: torch.device, config: SweepConfig = SweepConfig()
) -> list[float]:
    """Median seconds per call of each of ``ops`` (slowest rank of each repetition). Collective.

    Every rank of the world must call this at the same time with as many ``ops``, each
    rank with its own (e.g. all-reduces on its own intra group): loop counts are agreed
    across the world from the slowest rank's warm times, so every group issues equally
    many calls. A repetition of one op starts after a world barrier, loops it until about
    ``config.min_rep_s`` has passed, and divides. Repetitions are *interleaved* (op 0,
    op 1, ..., op 0, op 1, ...) so that a burst of load from another process spreads over
    every op instead of biasing one message size.
    """
    import torch.distributed as dist

    warm = []
    for op in ops:
        for _ in range(config.warmup):
            op()
        sync_device(device)
        dist.barrier()
        start = time.perf_counter()
        op()
        sync_device(device)
        warm.append(time.perf_counter() - start)
    estimates = [max(t, 1e-7) for t in world_max(warm, device)]
    inner = [max(1, min(100_000, math.ceil(config.min_rep_s / e))) for e in estimates]
    per_rep = sum(i * e for i, e in zip(inner, estimates))
    affordable = int(config.budget_s * len(ops) // per_rep)
    reps = min(config.reps, max(3, affordable))
    times: list[list[float]] = [[] for _ in ops]
    for _ in range(reps):
        for j, op in enumerate(ops):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(inner[j]):
                op()
            sync_device(device)
            times[j].append((time.perf_counter() - start) / inner[j])
    flat = world_max([t for row in times for t in row], device)
    return [statistics.median(flat[j * reps : (j + 1) * reps]) for j in range(len(ops))]


def time_op(op: Callable[[], Any], device: torch.device, config: SweepConfig = SweepConfig()) -> float:
    """:func:`time_ops` of one op."""
    return time_ops([op], device, config)[0]


def sweep(groups: Any, config: SweepConfig, device: torch.device) -> dict[str, list[tuple[int, float]]]:
    """Collective times per level and size: ``{"intra": [(bytes, s), ...], ...}``. Collective.

    ``groups`` is this rank's :class:`hiersync.topology.Groups`. ``"intra"`` and
    ``"inter"`` are all-reduces on the intra groups (all nodes at once) and on the rails
    (all rails at once); ``"intra_reduce_scatter"`` and ``"intra_all_gather"`` time the
    node's reduce-scatter (bytes = input) and all-gather (bytes = output) that the
    two-level all-reduce uses, ``"intra_broadcast"`` the L shard broadcasts of its
    ``"allreduce_bcast"`` variant (bytes = the whole message, n/L per broadcast, all L
    issued at once as ``HierComm`` does). Every size is interleaved with the others (see
    :func:`time_ops`). Levels whose groups hold one rank are left out.
    """
    import torch
    import torch.distributed as dist

    # The functions HierComm calls (torch 2.13 renamed reduce_scatter_tensor and
    # all_gather_into_tensor; older releases have only the old names).
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    L = groups.node_size
    sizes: dict[str, list[int]] = {level: [max(1, n // 4) for n in config.sizes] for level in LEVELS}
    # Reduce-scatter and all-gather need whole shards: round down to a multiple of L.
    for level in INTRA_COLLECTIVES:
        sizes[level] = [max(L, n // 4 // L * L) for n in config.sizes]
    # One buffer (views) serves every size, so the full sweep needs 256 MiB, not 512.
    # Zeros stay zeros under summation: no overflow, no denormals, whatever the count.
    buf = torch.zeros(max(sizes["intra"]), dtype=torch.float32, device=device)
    shard = torch.zeros(max(sizes["intra_all_gather"]) // L, dtype=torch.float32, device=device)
    intra, rail = groups.intra, groups.rail
    node = groups.topology.node_ranks(groups.rank)

    def shard_broadcasts(x: torch.Tensor) -> None:
        step = x.numel() // L
        works = [
            dist.broadcast(x[r * step : (r + 1) * step], src=node[r], group=intra, async_op=True) for r in range(L)
        ]
        for work in works:
            work.wait()

    def make_op(level: str, m: int) -> Callable[[], Any]:
        """One call of ``level``'s collective on ``m`` fp32 elements (views of the shared buffers)."""
        x, y = buf[:m], shard[: m // L]
        if level == "intra":
            return lambda: dist.all_reduce(x, group=intra)
        if level == "inter":
            return lambda: dist.all_reduce(x, group=rail)
        if level == "intra_reduce_scatter":
            return lambda: reduce_scatter(y, x, group=intra)
        if level == "intra_all_gather":
            return lambda: all_gather(x, y, group=intra)
        return lambda: shard_broadcasts(x)

    group_size = {"intra": L, "inter": groups.rail_size, **{level: L for level in INTRA_COLLECTIVES}}
    out: dict[str, list[tuple[int, float]]] = {}
    for level in (*LEVELS, *INTRA_COLLECTIVES):
        if group_size[level] < 2:
            continue
        seconds = time_ops([make_op(level, m) for m in sizes[level]], device, config)
        out[level] = [(m * 4, t) for m, t in zip(sizes[level], seconds)]
        if dist.get_rank() == 0:
            for m, t in zip(sizes[level], seconds):
                logger.info(
                    "calibrate: %s of %s on %d ranks: %.1f us", level, format_size(m * 4), group_size[level], t * 1e6
                )
    return out
