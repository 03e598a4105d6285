"""Every mode with every front-end over either transport: the cells of tests/test_matrix.py.

A *cell* is (front-end, codec, schedule); one world (or one set of torchft nodes) runs every
cell in turn, each on a fresh tiny model, so the processes, the groups and the Manager are
built once. A cell records the whole parameters after every step and after the final
``synchronize()``, or the error that refused it.
"""

from __future__ import annotations

import copy
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync

FRONTENDS = ("ddp", "fsdp")
CODECS = (None, "bf16", "int8", "int4", "topk2")
SCHEDULES: dict[str, dict[str, Any]] = {
    "hook": {"period": 2},  # DDP's hook alone, no optimizer attached
    "blocking": {"period": 2},
    "overlap": {"period": 2, "overlap": 1},
    "streaming": {"period": 4, "fragments": 2, "overlap": 1},
    "outer": {"period": 2, "overlap": 1, "outer_lr": 0.7, "outer_momentum": 0.9},
    "optimizer_state": {"period": 2, "average_optimizer_state": ("exp_avg",)},
}
STEPS = 6


def cells() -> list[tuple[str, str | None, str]]:
    return [(f, c, s) for f in FRONTENDS for c in CODECS for s in SCHEDULES]


def cell_name(frontend: str, codec: str | None, schedule: str) -> str:
    return f"{frontend}-{codec or 'fp32'}-{schedule}"


class Blocks(torch.nn.Module):
    """Three small layers, each one FSDP unit: 6 parameter tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 10), torch.nn.Linear(10, 10), torch.nn.Linear(10, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = b(x) if i == len(self.blocks) - 1 else torch.tanh(b(x))
        return x


def _batch(node: int, local: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * node + 1009 * local + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _full(model: torch.nn.Module) -> torch.Tensor:
    parts = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return torch.cat([t.reshape(-1) for t in parts]).clone()


def _build(frontend: str, base: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(base)
    if frontend == "ddp":
        return DDP(model)
    mesh = hiersync.node_mesh()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run_cell(frontend: str, codec: str | None, schedule: str, node: int, local: int, manager: Any = None) -> Any:
    """One cell on this rank: the parameters after each step and after ``synchronize()``, or
    ``"refused: <error>"`` when hiersync refuses the set-up (raised on every rank alike)."""
    torch.manual_seed(0)
    model = _build(frontend, Blocks())
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    options = dict(SCHEDULES[schedule], compress=codec)
    if manager is not None:
        options.update(manager=manager, start_nodes=2)  # both nodes in every cell's first quorum
    state = None
    try:
        state = hiersync.register(model, None if schedule == "hook" else opt, **options)
        out = []
        while state.step < STEPS:
            x, y = _batch(node, local, state.step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            out.append(_full(model))
        state.synchronize(model)
        out.append(_full(model))
        return out
    except (ValueError, TypeError, RuntimeError) as e:  # the test checks which cells may say so
        return f"refused: {type(e).__name__}: {e}"
    finally:
        if state is not None:
            state.close()


def _run_all(node: int, local: int, manager: Any = None) -> dict[str, Any]:
    return {cell_name(*c): run_cell(*c, node, local, manager) for c in cells()}


def group_rail() -> dict[str, Any]:
    """Every cell on hiersync's process-group rail (a world of emulated nodes)."""
    topo = hiersync.Topology.detect()
    rank = dist.get_rank()
    return _run_all(topo.node_of(rank), topo.local_rank(rank))


def torchft_rail(timeout_s: float = 20.0) -> dict[str, Any]:
    """Every cell on torchft's rail (one Manager per rank, reused by every cell)."""
    import torchft

    from hiersync.tools import ft_nodes

    timeout = datetime.timedelta(seconds=timeout_s)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=60),
        replica_id=f"node{ft_nodes.node_index()}",
        hostname="127.0.0.1",
        load_state_dict=lambda sd: None,  # nothing fails here: no node is healed
        state_dict=lambda: {},
    )
    try:
        return _run_all(ft_nodes.node_index(), dist.get_rank(), manager)
    finally:
        manager.shutdown(wait=False)
