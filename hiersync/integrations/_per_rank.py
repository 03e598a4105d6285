"""Per-rank checkpoint state gathered to rank 0, for frameworks that write only rank 0's file.

Between cross-node syncs the ranks of different nodes hold different parameters, optimizer
states and hiersync states; a framework that saves one checkpoint from rank 0 loses the
others. :func:`gather` collects every rank's entry into rank 0's checkpoint (one object per
rank, so the file grows with the world size); :func:`pick` returns this rank's entry when
every rank loads that file.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

FORMAT = "hiersync.integrations/per-rank/1"


def gather(entry: dict[str, Any]) -> dict[str, Any]:
    """Collective: every rank's ``entry`` into rank 0's result (``None`` on the other ranks)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(entry, out, dst=0)
    return {"format": FORMAT, "world_size": world, "ranks": out}


def is_per_rank(saved: Any) -> bool:
    """Whether ``saved`` is a :func:`gather` result."""
    return isinstance(saved, dict) and saved.get("format") == FORMAT


def pick(saved: Any, what: str) -> dict[str, Any]:
    """This rank's entry of a :func:`gather` result read back from rank 0's file."""
    if not is_per_rank(saved):
        raise ValueError(f"{what}: not a hiersync per-rank checkpoint entry (missing or wrong 'format')")
    world, rank = dist.get_world_size(), dist.get_rank()
    if saved["world_size"] != world:
        raise ValueError(
            f"{what}: the checkpoint holds the hiersync state of {saved['world_size']} ranks but this job has "
            f"{world}; per-rank local-SGD state cannot be remapped. Resume with the same world size, or "
            "load only the model weights (synchronized) and start a fresh HierState"
        )
    ranks = saved.get("ranks")
    if not ranks or ranks[rank] is None:
        raise ValueError(
            f"{what}: the checkpoint has no per-rank entries (it was read from a non-zero rank's copy, "
            "which holds none); load the file that rank 0 wrote"
        )
    return ranks[rank]
