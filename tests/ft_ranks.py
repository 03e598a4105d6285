"""Rank functions of the manager-mode tests (hiersync.ft), run on emulated torchft nodes.

Each node trains a tiny model on data drawn from (node, rank, step), so a reference run in
the test process (:func:`reference`) can replay exactly what the surviving nodes computed.
A node can kill itself (SIGKILL: every rank at the same point) at a local step, or right
after it joined a sync's quorum, before its averages go out (the survivors then have that
sync in flight when it dies).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync
from hiersync.schedule import Schedule, fragment_layout
from hiersync.tools import ft_nodes

DIM_IN, DIM_HID, DIM_OUT = 4, 8, 2


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM_IN, DIM_HID), nn.Tanh(), nn.Linear(DIM_HID, DIM_OUT))


def batch(node: int, rank: int, step: int, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``shift``: even nodes' targets move up by it, odd nodes' down (the nodes drift apart)."""
    g = torch.Generator().manual_seed(1_000_003 * node + 1009 * rank + step)
    x = torch.randn(8, DIM_IN, generator=g)
    return x, torch.sin(x[:, :DIM_OUT] * 2) + (shift if node % 2 == 0 else -shift)


def flat(model: nn.Module) -> torch.Tensor:
    """The whole parameters (gathered inside the node for an FSDP2 model)."""
    parts = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return torch.cat([t.reshape(-1).clone() for t in parts])


def _start_barrier(path: str | None, nodes: int) -> None:
    """Hold the first nodes until all of them heartbeat, so the first quorum holds them all."""
    if not path or dist.get_rank() != 0:
        return
    store = dist.FileStore(path, -1)
    store.add("up", 1)
    deadline = time.monotonic() + 60
    while int(store.add("up", 0)) < nodes:
        if time.monotonic() > deadline:
            raise TimeoutError("the other nodes did not start")
        time.sleep(0.02)


def _wait_for(path: str, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come within {timeout:.0f} s")
        time.sleep(0.02)


class _Warnings(logging.Handler):
    """hiersync's warnings on this rank (what a user sees in the log)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _optimizer(cfg: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    if cfg.get("adam"):
        return torch.optim.Adam(params, lr=cfg.get("lr", 0.01))
    return torch.optim.SGD(params, lr=cfg.get("lr", 0.1))


def _options(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg["options"]`` for ``register``, an ``outer_optimizer`` named there made its factory."""
    options = dict(cfg.get("options", {}))
    if isinstance(options.get("outer_optimizer"), str):
        from ranks import OUTER_OPTIMIZERS

        options["outer_optimizer"] = OUTER_OPTIMIZERS[options["outer_optimizer"]]
    return options


def train_plain(cfg: dict[str, Any]) -> list[torch.Tensor]:
    """The same training with hiersync's plain mode (one job, emulated nodes): parameters after each step."""
    topo = hiersync.Topology.detect()
    rank = dist.get_rank()
    node, local = topo.node_of(rank), topo.local_rank(rank)
    model = tiny_model()
    ddp = DDP(model)
    opt = _optimizer(cfg, ddp.parameters())
    state = hiersync.register(ddp, opt, **_options(cfg))
    out = []
    for s in range(cfg["steps"]):
        if s == cfg.get("checkpoint_at"):
            state.load_state_dict(state.state_dict())
        x, y = batch(node, local, s)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        out.append(flat(model))
    return out


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``cfg["steps"]`` steps with hiersync on the torchft manager; record parameters per step.

    ``announce``: a file this node creates right before it registers (a restarted node says it
    is up); ``hold``: ``{"step": s, "path": p, "then": t}``, wait before step ``s`` until ``p`` exists
    and ``t`` s more (the survivors are still training when the restarted node asks for its first
    quorum); ``kill``: ``{"how": "first_quorum"}`` dies 0.5 s after it asked for its first quorum;
    ``final_synchronize``: end with ``state.synchronize`` (the result's ``final``).
    """
    node, rank = ft_nodes.node_index(), dist.get_rank()
    warned = _Warnings()
    logging.getLogger("hiersync").addHandler(warned)
    model = tiny_model()
    if cfg.get("frontend") == "fsdp":  # FSDP2 over the node: each rank holds its own shards
        from torch.distributed.fsdp import fully_shard

        mesh = hiersync.node_mesh()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = DDP(model)
    opt = _optimizer(cfg, ddp.parameters())
    mgr = ft_nodes.manager(
        timeout_s=cfg.get("timeout_s", 10.0),
        quorum_timeout_s=cfg.get("quorum_timeout_s", 60.0),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
    )
    _start_barrier(cfg.get("start_barrier"), cfg.get("nodes", 1))
    if cfg.get("register_after"):  # the test stops the Lighthouse first
        ft_nodes.progress(-1)
        while not os.path.exists(cfg["register_after"]):
            time.sleep(0.02)
        try:
            hiersync.register(ddp, opt, manager=mgr, **_options(cfg))
        except hiersync.HierSyncError as e:
            return {"error": str(e)}
        return {"error": None}
    if cfg.get("kill", {}).get("how") == "first_quorum":  # dies while the Lighthouse holds its first request
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if cfg.get("announce") and rank == 0:
        open(cfg["announce"], "w").close()
    state = hiersync.register(ddp, opt, manager=mgr, **_options(cfg))
    first = state.step
    joined = flat(model)  # after the first quorum: a joiner healed at a sync already ran it
    kill = cfg.get("kill", {})
    if kill.get("node") == node and kill.get("how") in ("in_flight", "freeze_in_flight"):
        sig = signal.SIGKILL if kill["how"] == "in_flight" else signal.SIGSTOP
        _signal_on_next_sync(state, after_step=kill["step"], sig=sig)
    records = []
    while state.step < cfg["steps"]:
        s = state.step
        if kill.get("node") == node and kill.get("how") == "local" and s == kill["step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if s == cfg.get("checkpoint_at"):
            state.load_state_dict(state.state_dict())
        hold = cfg.get("hold")
        if hold and s == hold["step"]:
            _wait_for(hold["path"], "the restarted node")
            time.sleep(hold.get("then", 0.0))
        x, y = batch(node, rank, s, cfg.get("shift", 0.0))
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        records.append((s, flat(model), state.stats.sync_participants))
        ft_nodes.progress(s, loss=f"{loss.item():.6f}")
        time.sleep(cfg.get("step_sleep", 0.0))
    final = portable = None
    if cfg.get("final_synchronize"):
        state.synchronize(ddp)
        final = flat(model)
    if cfg.get("dcp_dir"):  # FSDP2: one portable copy per node with torch.distributed.checkpoint
        portable = _dcp_round_trip(ddp, os.path.join(cfg["dcp_dir"], f"node{node}"), cfg)
    stats = state.stats.as_dict()
    mgr.shutdown(wait=False)
    return {
        "first": first,
        "joined": joined,
        "records": records,
        "stats": stats,
        "final": final,
        "portable": portable,
        "last_step": state.step,
        "warnings": warned.messages,
    }


def _dcp_round_trip(model: nn.Module, folder: str, cfg: dict[str, Any]) -> bool:
    """Save ``model`` with torch.distributed.checkpoint, load it into a fresh sharded model: equal?"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(DIM_IN, DIM_HID), nn.Tanh(), nn.Linear(DIM_HID, DIM_OUT))
    mesh = hiersync.node_mesh()
    for layer in (fresh[0], fresh[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    loaded = {"model": get_model_state_dict(fresh)}
    dcp.load(loaded, checkpoint_id=folder)
    set_model_state_dict(fresh, loaded["model"])
    return torch.equal(flat(fresh), flat(model))


def _signal_on_next_sync(state: Any, after_step: int, sig: int) -> None:
    """Send ``sig`` to this rank when its first sync after ``after_step`` sends its averages (after its quorum)."""
    comm = state.comm
    real = comm.rail_allreduce

    def rail_allreduce(tensor: torch.Tensor, what: str) -> Any:
        w = comm.rail.window
        if w is not None and w.kind == "sync" and w.marker.step > after_step and "barrier" not in what:
            os.kill(os.getpid(), sig)
        return real(tensor, what)

    comm.rail_allreduce = rail_allreduce


def reference(
    cfg: dict[str, Any],
    nodes: int,
    ranks: int,
    members: Any,
    dropped: set[int] = frozenset(),
    heals: dict[int, tuple[int, int]] | None = None,
) -> dict[int, dict[int, torch.Tensor]]:
    """Local SGD of ``nodes`` replicas on the same data as :func:`train` (SGD, plain averages).

    ``members(step)``: the nodes alive at ``step`` and in the quorum of the sync after it;
    syncs after the steps in ``dropped`` are launched but never applied. ``heals``: ``{node:
    (step, source)}``, a node that joins in the quorum of the sync after ``step`` (it is in
    ``members`` from ``step + 1`` on): it brings nothing to that sync, whose average is the
    other members' own, and leaves it a copy of ``source`` (with ``source``'s correction of
    it in flight, when overlapped). Returns each node's parameters after each of its steps
    (what :func:`train` records), blocking or overlapped (``overlap`` steps later) syncs of
    the whole model or, streaming (``fragments``), of each fragment on its own step, with
    ``outer_lr`` (and ``outer_momentum``) DiLoCo's outer step; a dropped sync leaves anchor
    and momentum alone.
    """
    opts = cfg.get("options", {})
    F = opts.get("fragments", 1)
    sched = Schedule(period=opts.get("period", 1), warmup_steps=opts.get("warmup_steps", 0), fragments=F)
    tau = int(opts.get("overlap", 0))
    lr = cfg.get("lr", 0.1)
    models = {n: tiny_model() for n in range(nodes)}
    sizes = [p.numel() for p in models[0].parameters()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    masks = []  # flat positions of each fragment's parameters (hiersync.schedule.fragment_layout)
    for frag in fragment_layout([4 * n for n in sizes], F):
        mask = torch.zeros(sum(sizes), dtype=torch.bool)
        for i in frag:
            mask[starts[i] : starts[i] + sizes[i]] = True
        masks.append(mask)
    outer_lr, mu = opts.get("outer_lr"), opts.get("outer_momentum", 0.0)
    anchor = flat(models[0])  # captured on the first step (no warmup here)
    momentum = torch.zeros_like(anchor)
    pending: list[tuple[int, dict[int, torch.Tensor]]] = []  # (apply once this many steps are done, corrections)
    out: dict[int, dict[int, torch.Tensor]] = {n: {} for n in range(nodes)}
    for s in range(cfg["steps"]):
        alive = members(s)
        for n in alive:
            m = models[n]
            grads = None
            for r in range(ranks):
                m.zero_grad()
                x, y = batch(n, r, s, cfg.get("shift", 0.0))
                nn.functional.mse_loss(m(x), y).backward()
                g = [p.grad.detach().clone() / ranks for p in m.parameters()]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            with torch.no_grad():
                for p, g in zip(m.parameters(), grads):
                    p.sub_(lr * g)
        for _, corr in [p for p in pending if p[0] <= s + 1]:
            for n, c in corr.items():
                if n in alive:
                    _add(models[n], c)
        pending = [p for p in pending if p[0] > s + 1]
        due = sched.fragments_due(s) if F > 1 else ((0,) if sched.kind(s) == "sync" else ())
        joiners = {n: src for n, (at, src) in (heals or {}).items() if at == s}
        if due and s not in dropped:
            mask = torch.stack([masks[f] for f in due]).any(0)
            snaps = {n: flat(models[n]) for n in alive}
            target = torch.stack([snaps[n] for n in alive]).mean(0)  # the joiners bring nothing
            if outer_lr is not None:  # DiLoCo's outer Nesterov step from the common anchor
                g = anchor - target
                m_new = mu * momentum + g
                target = anchor - outer_lr * (g + mu * m_new)
                momentum = torch.where(mask, m_new, momentum)
                anchor = torch.where(mask, target, anchor)
            for n, src in joiners.items():
                _set(models[n], flat(models[src]))
                snaps[n] = snaps[src]
            if tau == 0:
                for n in list(alive) + list(joiners):
                    _set(models[n], torch.where(mask, target, snaps[n]))
            else:
                corr = {n: torch.where(mask, target - snaps[n], 0.0) for n in list(alive) + list(joiners)}
                pending.append((s + 1 + tau, corr))
        else:
            for n, src in joiners.items():
                _set(models[n], flat(models[src]))
        for n in alive:
            out[n][s] = flat(models[n])
    return out


def _set(model: nn.Module, values: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(values[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()


def _add(model: nn.Module, values: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(values[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()


def train_window_dropped(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """``cfg["how"]``: ``"kill"``, the last node dies inside the sync after step ``cfg["at"]``
    (after its quorum, in its first rail collective), so the survivors drop that window; or
    ``"skip"``, no node launches that sync and the last node leaves right after that step.
    The survivors return their parameters, the optimizer state and hiersync's state at the end.
    ``cfg["frontend"]``: ``"ddp"`` or ``"fsdp"`` (the matrix's tiny model, AdamW)."""
    import matrix_ranks

    node, rank, last = ft_nodes.node_index(), dist.get_rank(), cfg["nodes"] - 1
    torch.manual_seed(0)
    model = matrix_ranks._build(cfg["frontend"], matrix_ranks.Blocks())
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    mgr = ft_nodes.manager(timeout_s=cfg.get("timeout_s", 10.0), load_state_dict=lambda sd: None, state_dict=dict)
    state = hiersync.register(model, opt, manager=mgr, start_nodes=cfg["nodes"], **cfg["options"])
    at = cfg["at"]
    if cfg["how"] == "kill" and node == last:
        rail = state.comm.rail
        for name in ("allreduce", "all_to_all"):
            real = getattr(rail, name)

            def dying(*args: Any, real: Any = real) -> Any:
                w = rail.window
                if w is not None and w.kind == "sync" and w.marker.step == at and "barrier" not in args[-1]:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args)

            setattr(rail, name, dying)
    if cfg["how"] == "skip":
        due = state.engine.mark_due
        state.engine.mark_due = lambda step: None if step == at else due(step)
    while state.step < cfg["steps"]:
        x, y = matrix_ranks._batch(node, rank, state.step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if cfg["how"] == "skip" and node == last and state.step == at + 1:
            mgr.shutdown(wait=False)  # leaves without a window for that sync
            return None
    saved = state.state_dict()
    residuals = [
        c[key].float()
        for c in saved["averager"]["chunks"]
        for key in ("residual", "reduced_residual")
        if c.get(key) is not None
    ]
    exp_avg = [s["exp_avg"] for s in opt.state_dict()["state"].values()]
    out = {
        "params": matrix_ranks._full(model),
        "exp_avg": torch.cat([(t.to_local() if hasattr(t, "to_local") else t).reshape(-1) for t in exp_avg]),
        "residuals": residuals,
        "stats": state.stats.as_dict(),
    }
    mgr.shutdown(wait=False)
    return out
