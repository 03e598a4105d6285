"""Rank functions of the pace tests (tests/test_pace_runtime.py): nodes of different speeds under
adaptive pace, counted samples, and the reference they are checked against (one process, no
collectives: each node's local SGD by hand, then the average weighted by its samples)."""

from __future__ import annotations

import itertools
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync

LR = 0.05


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def counted(rank: int, step: int) -> float:
    """The samples a rank counts at a step when the test counts (uneven on purpose)."""
    return float(1 + (rank * 7 + step * 3) % 5)


def flat(module: torch.nn.Module) -> torch.Tensor:
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]  # FSDP2: gathered
    return torch.cat([p.detach().reshape(-1) for p in full])


def run(cfg: dict) -> dict:
    """Train under ``cfg`` until ``cfg['windows']`` windows closed; each node sleeps ``step_s[node]``
    a step (its speed). Returns this rank's window lengths, final parameters and the tally's counters."""
    rank = dist.get_rank()
    topo = hiersync.Topology.detect()
    node = topo.node_of(rank)
    model = DDP(net())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {k: v for k, v in cfg["options"].items()}
    state = hiersync.register(model, opt, **options)
    starts, step, counts = [0], 0, []
    while state.window < cfg["windows"]:
        time.sleep(cfg["step_s"][node])
        x, y = batch(rank, step)
        if cfg.get("count"):
            n = 0.0 if cfg.get("zero") == [node, state.window] else counted(rank, step)
            state.count_samples(n)
            counts.append(n)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if state.window == len(starts):
            starts.append(step)
    if cfg.get("synchronize"):
        state.synchronize(model)
    where = {id(p): i for i, p in enumerate(model.parameters())}
    out = {
        "node": node,
        "lengths": [b - a for a, b in itertools.pairwise(starts)],
        "params": flat(model).tolist(),
        "tally": state.stats.collectives.get("tally", 0),
        "pid": os.getpid(),
        "layout": [[where[id(state.registry.params[j])] for j in f] for f in state.engine.layout()],
    }
    state.close()
    return out


def run_manager(cfg: dict) -> dict:
    """:func:`run` with ``manager=``: each node its own world and torchft Manager (tests/test_ft.py's
    harness); a rank's batches are those of its place ``node * L + local`` in the reference."""
    from hiersync.tools import ft_nodes

    node, local, L = ft_nodes.node_index(), dist.get_rank(), dist.get_world_size()
    rank = node * L + local
    if cfg.get("fsdp"):  # FSDP2 over the node: each rank holds its own shards
        from torch.distributed.fsdp import fully_shard

        model, mesh = net(), hiersync.node_mesh()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    else:
        model = DDP(net())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mgr = ft_nodes.manager(
        timeout_s=10.0,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
    )
    state = hiersync.register(model, opt, manager=mgr, start_nodes=cfg["nodes"], **cfg["options"])
    seen, first = {state.window: state.step}, state.step  # a joiner resumes at its heal source's step
    kill = cfg.get("kill", {})
    while state.window < cfg["windows"]:
        if kill.get("node") == node and state.window == kill["window"]:
            os.kill(os.getpid(), signal.SIGKILL)
        ft_nodes.progress(state.window)
        time.sleep(cfg["step_s"][node])
        step = state.step
        x, y = batch(rank, step)
        if cfg.get("count"):
            state.count_samples(counted(rank, step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        seen.setdefault(state.window, state.step)
    if cfg.get("synchronize"):
        state.synchronize(model)
    out = {
        "node": node,
        "lengths": [seen[w + 1] - seen[w] for w in sorted(seen) if w + 1 in seen],
        "params": flat(model).tolist(),
        "failed": state.stats.failed_syncs,
        "heals": state.stats.heals,
        "first": first,
    }
    mgr.shutdown(wait=False)
    return out


def reference(
    node_ids: list[int],
    lengths: dict[int, list[int]],
    count: bool = False,
    weighted: bool = True,
    zero: list[int] | None = None,
    outer: tuple[float, float] | None = None,
) -> torch.Tensor:
    """The parameters after the windows ``lengths`` (steps of each node, per window), by hand: each
    node's ranks average their gradients every step; at each window's end the nodes' parameters are
    averaged, weighted by the samples of their ranks in the window (one a step, or ``counted``);
    ``weighted=False``: the plain mean of the nodes (what a test must tell apart from it);
    ``zero=[node, window]``: that node counted no samples in that window (it adds nothing to it);
    ``outer=(lr, mu)``: DiLoCo's outer Nesterov step on the weighted average (g = anchor - average,
    m = mu m + g, new = anchor - lr (g + mu m))."""
    nodes = sorted(set(node_ids))
    ranks = {n: [r for r, m in enumerate(node_ids) if m == n] for n in nodes}
    model = net()
    p = [t.detach().clone() for t in model.parameters()]
    done = dict.fromkeys(nodes, 0)
    m: list[torch.Tensor] = []
    for w in range(len(lengths[nodes[0]])):
        outs, weights = [], []
        for n in nodes:
            q = [t.clone().requires_grad_(True) for t in p]
            samples = 0.0
            for s in range(done[n], done[n] + lengths[n][w]):
                grads = None
                for r in ranks[n]:
                    x, y = batch(r, s)
                    h = torch.tanh(x @ q[0].T + q[1]) @ q[2].T + q[3]
                    g = torch.autograd.grad(torch.nn.functional.mse_loss(h, y), q)
                    grads = g if grads is None else [a + b for a, b in zip(grads, g)]
                    samples += 0.0 if zero == [n, w] else counted(r, s) if count else 1.0
                with torch.no_grad():
                    for t, g in zip(q, grads):
                        t -= LR * g / len(ranks[n])
            done[n] += lengths[n][w]
            outs.append([t.detach() for t in q])
            weights.append(samples if weighted else 1.0)
        total = sum(weights)
        avg = [sum(wt * o[i] for wt, o in zip(weights, outs)) / total for i in range(len(p))]
        if outer is None:
            p = avg
            continue
        lr, mu = outer
        g = [a - b for a, b in zip(p, avg)]
        m = [mu * mi + gi for mi, gi in zip(m, g)] if w else g
        p = [a - lr * (gi + mu * mi) for a, gi, mi in zip(p, g, m)]
    return torch.cat([t.reshape(-1) for t in p])


def resumed(cfg: dict, phase: str, folder: str) -> dict:
    """``phase="save"``: train until window ``cfg['save_at']`` opens (``cfg['mid']``: and one step
    into it) and save every rank's
    model, optimizer and hiersync state; ``"load"``: a fresh job loads them and trains on until
    ``cfg['windows']`` windows closed (the same as :func:`run` without the restart)."""
    rank = dist.get_rank()
    node = hiersync.Topology.detect().node_of(rank)
    model = DDP(net())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = hiersync.register(model, opt, **cfg["options"])
    path = os.path.join(folder, f"rank{rank}.pt")
    step = 0
    if phase == "load":
        saved = torch.load(path, weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hiersync"])
        step = saved["step"]
    target = cfg["save_at"] if phase == "save" else cfg["windows"]
    while state.window < target or (phase == "save" and cfg.get("mid") and step == state.windows.start):
        time.sleep(cfg["step_s"][node])
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
    if phase == "save":
        saved = {"model": model.module.state_dict(), "opt": opt.state_dict(), "hiersync": state.state_dict()}
        torch.save({**saved, "step": step}, path)
    out = {"node": node, "step": step, "window": state.window, "params": flat(model).tolist()}
    state.close()
    return out


def reference_streaming(
    node_ids: list[int], lengths: dict[int, list[int]], layout: list[list[int]]
) -> dict[int, torch.Tensor]:
    """:func:`reference` for streaming (blocking, ``len(layout)`` fragments: ``layout[f]`` holds the
    indices in ``model.parameters()`` of fragment f's tensors), by hand: in window w node n takes
    ``lengths[n][w]`` steps and syncs fragment f after its step ``offset(f)`` of the window, on the
    slowest node's grid (``g = min`` of the window's lengths: ``ceil(ceil((f + 1) g / F) n / g) - 1``);
    fragments due after the same step sync together, in fragment order, on every node. A sync
    replaces the fragment's tensors on every node with their mean weighted by the steps (x ranks)
    each node took since that fragment last synced. Each node's parameters at the end (a fragment
    synced before the window's last step has trained on since)."""
    nodes = sorted(set(node_ids))
    ranks = {n: [r for r, m in enumerate(node_ids) if m == n] for n in nodes}
    F = len(layout)
    p0 = [t.detach().clone() for t in net().parameters()]
    q = {n: [t.clone() for t in p0] for n in nodes}
    done = dict.fromkeys(nodes, 0)  # steps taken
    since = {(n, f): 0 for n in nodes for f in range(F)}

    def step(n: int) -> None:
        ts = [t.clone().requires_grad_(True) for t in q[n]]
        grads = None
        for r in ranks[n]:
            x, y = batch(r, done[n])
            h = torch.tanh(x @ ts[0].T + ts[1]) @ ts[2].T + ts[3]
            g = torch.autograd.grad(torch.nn.functional.mse_loss(h, y), ts)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        with torch.no_grad():
            q[n] = [t.detach() - LR * g / len(ranks[n]) for t, g in zip(ts, grads)]
        done[n] += 1
        for f in range(F):
            since[(n, f)] += len(ranks[n])

    for w in range(len(lengths[nodes[0]])):
        start = dict(done)
        grid = min(lengths[n][w] for n in nodes)

        def offset(n: int, f: int, w: int = w, grid: int = grid) -> int:
            on_grid = -(-(f + 1) * grid // F)
            return -(-on_grid * lengths[n][w] // grid) - 1

        groups: dict[int, list[int]] = {}  # the slowest node's step -> fragments synced after it
        for f in range(F):
            groups.setdefault(-(-(f + 1) * grid // F), []).append(f)
        for frags in (groups[k] for k in sorted(groups)):
            for n in nodes:
                while done[n] <= start[n] + offset(n, frags[0]):
                    step(n)
            for f in frags:
                total = sum(since[(n, f)] for n in nodes)
                for i in layout[f]:
                    avg = sum(since[(n, f)] * q[n][i] for n in nodes) / total
                    for n in nodes:
                        q[n][i] = avg.clone()
                for n in nodes:
                    since[(n, f)] = 0
        for n in nodes:
            assert done[n] == start[n] + lengths[n][w], (n, w, done[n], start[n], lengths[n][w])
    return {n: torch.cat([t.reshape(-1) for t in q[n]]) for n in nodes}
