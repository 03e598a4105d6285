"""What every rank of a chaos run trains (:mod:`hiersync.tools.chaos`): a small regression on the manager mode.

The model is ``Linear -> Tanh -> accel layer -> Linear`` (the accel layer's forward and
backward sleep with the CPU idle, as a host does while its accelerator computes:
:mod:`hiersync.tools.bench_compute`), trained with AdamW on a fixed teacher, each node on
its own data. It is registered with a torchft Manager (``manager=``), so a node that dies
or falls behind is healed from a live peer. After each step local rank 0 appends a record
to its node's progress file: the step (``state.step - 1``, the schedule's step that just
ended, which a healed node takes from its peer), the loss, the last sync window's
participants and torchft quorum, counters of dropped windows and heals, a checksum of the
parameters (after the sync on a sync step), the step-counter canary and whether any value
is NaN. With ``eval_syncs`` (the run without faults) a sync step's record also holds the
validation loss of the synchronized model (``val=``; every node holds that model right after
a committed sync), computed without the accel layer's sleep, so the analysis can read off the
loss the run reached at any amount of work. At the end every node runs ``synchronize()`` and
reports its validation loss.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hiersync

from . import ft_nodes
from .bench_compute import accel_linear

__all__ = ["train", "build", "val_loss", "val_loss_of"]

SENDING = "sending-{node}"
"""A file a node creates in the run's folder when torchft asks it for its state (it heals a peer)."""
SLOW = "slow-{node}"
"""While this file is in the run's folder, the node's accelerator-like compute takes the factor it
holds times as long (the chaos run's ``slow`` fault): the extra time is slept before backward."""
SLOW_SEND = "slow-send"
"""While this file is in the run's folder, a node asked for its state takes a second to hand it
over, as a large model's state takes seconds to send: time enough to kill it while it sends."""

DIM_IN, WIDTH = 8, 64


def build(cfg: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(DIM_IN, WIDTH), nn.Tanh(), accel_linear(WIDTH, cfg["fwd_ms"], cfg["bwd_ms"]), nn.Linear(WIDTH, 1)
    )
    model.register_buffer("canary", torch.zeros((), dtype=torch.int64))  # steps this copy has seen
    return model


def _teacher(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x @ torch.linspace(-1.0, 1.0, DIM_IN)).unsqueeze(1) + 0.1 * x[:, :1] ** 2


def batch(node: int, rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * node + 1009 * rank + step)
    x = torch.randn(size, DIM_IN, generator=g)
    return x, _teacher(x)


@functools.cache
def _val_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(424242)
    x = torch.randn(512, DIM_IN, generator=g)
    return x, _teacher(x)


def val_loss(model: nn.Module) -> float:
    x, y = _val_batch()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def val_loss_of(params: list[torch.Tensor]) -> float:
    """:func:`val_loss` of the model with these parameters (``model.parameters()`` in order, full
    tensors), computed as its forward does but without the accel layer's sleep (well under a ms)."""
    w0, b0, w1, b1, w2, b2 = params
    x, y = _val_batch()
    with torch.no_grad():
        h = torch.tanh(nn.functional.linear(x, w0, b0))
        h = h + b1 + torch.mv(w1, h.mean(0)).mul_(1.0 / w1.shape[1] ** 0.5)
        return float(nn.functional.mse_loss(nn.functional.linear(h, w2, b2), y))


def _full(model: nn.Module) -> list[torch.Tensor]:
    params: list[Any] = [p.detach() for p in model.parameters()]
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]


def _checksum(model: nn.Module) -> float:
    with torch.no_grad():
        parts = _full(model)
        flat = torch.cat([t.double().reshape(-1) for t in parts])
        return float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64).sin()).sum())


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``cfg["steps"]`` steps on the manager mode; the result: validation loss and counters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    node, rank = ft_nodes.node_index(), dist.get_rank()
    # Each rank's stderr (torchft's and hiersync's logs, tracebacks) goes to its own file in the run's folder.
    log = os.open(os.path.join(cfg["dir"], f"node{node}-rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 2)
    model = build(cfg)
    canary = model.get_buffer("canary")
    frontend = cfg.get("frontend", "ddp")
    if frontend == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = hiersync.node_mesh()
        wrapped: Any = fully_shard(model, mesh=mesh)
    else:
        wrapped = DDP(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.get("lr", 3e-3))
    sending = os.path.join(cfg["dir"], SENDING.format(node=node))

    def state_dict() -> dict[str, Any]:
        if rank == 0:  # torchft asks a live node for its state when it heals a peer
            open(sending, "w").close()
        if os.path.exists(os.path.join(cfg["dir"], SLOW_SEND)):
            time.sleep(1.0)
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    mgr = ft_nodes.manager(
        timeout_s=cfg.get("timeout_s", 5.0),
        quorum_timeout_s=cfg.get("quorum_timeout_s", 60.0),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])),
        state_dict=state_dict,
    )
    started = time.time()
    ft_nodes.progress(-1, event="up")
    state = hiersync.register(wrapped, opt, manager=mgr, start_nodes=cfg.get("start_nodes", 1), **cfg["options"])
    heal_s = time.time() - started
    heal_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    heal_bytes += sum(
        t.numel() * t.element_size()
        for s in opt.state_dict()["state"].values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    first = state.step
    period = int(cfg["options"].get("period", 1))
    adaptive = cfg["options"].get("pace") == "adaptive"
    windows = max(1, cfg["steps"] // period)  # adaptive pace: the run ends at a window, as its nodes' steps differ
    slow = os.path.join(cfg["dir"], SLOW.format(node=node))
    step_s = (cfg["fwd_ms"] + cfg["bwd_ms"]) / 1000
    st: Any = state.stats  # the window it was healed in (or the start): its peers' step and parameters
    ft_nodes.progress(
        first - 1,
        event="joined",
        # adaptive pace: healed into a sync if the window it takes opened at the peer's step
        **({"w": state.window, "sync": int(first > 0 and state.windows.start == first)} if adaptive else {}),
        heal_s=f"{heal_s:.3f}",
        heal_bytes=heal_bytes,
        n=st.sync_participants,
        q=st.quorum_id,
        failed=st.failed_syncs,
        sum=f"{_checksum(model):.12e}",
    )
    while (state.window < windows) if adaptive else (state.step < cfg["steps"]):
        x, y = batch(node, rank, state.step)
        loss = nn.functional.mse_loss(wrapped(x), y)
        if os.path.exists(slow):  # the slow fault: this node's accelerator takes factor x as long
            try:
                with open(slow) as f:
                    time.sleep(step_s * (float(f.read() or 1) - 1))
            except (OSError, ValueError):  # removed while read: full speed again
                pass
        loss.backward()
        canary.add_(1)  # before optimizer.step(): a sync (and a peer's heal) runs inside it
        window = state.window
        opt.step()
        opt.zero_grad()
        stats: Any = state.stats
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        nan = any(not bool(torch.isfinite(t.detach()).all()) for t in local)
        fields = {
            "loss": f"{loss.item():.6f}",
            "n": stats.sync_participants,
            "q": stats.quorum_id,
            "failed": stats.failed_syncs,
            "heals": stats.heals,
            "sum": f"{_checksum(model):.12e}",
            "canary": int(canary) - state.step,
            "nan": int(nan),
        }
        synced = state.window != window if adaptive else state.step % period == 0
        if adaptive:  # each node's steps differ: its syncs are named by their window, and marked
            fields.update(w=state.window, sync=int(synced))
        if cfg.get("eval_syncs") and synced:  # just after a sync: the synchronized model
            fields["val"] = f"{val_loss_of(_full(model)):.6f}"
        ft_nodes.progress(state.step - 1, **fields)
    state.synchronize(wrapped)
    loss_val = val_loss(model)
    ft_nodes.progress(state.step, event="done", val=f"{loss_val:.6f}", sum=f"{_checksum(model):.12e}")
    out = {
        "val_loss": loss_val,
        "first": first,
        "heal_s": heal_s,
        "heal_bytes": heal_bytes,
        "stats": state.stats.as_dict(),
        "steps": state.step,
    }
    state.close()
    mgr.shutdown(wait=False)
    return out
