"""Three levels (node -> rack -> world) against a hand-written three-level local SGD.

Every rank runs :func:`three_level_check`: hiersync's DDP front-end with ``rack_period``
next to :class:`ThreeLevelReference` (the two-level :class:`ranks.Reference` plus a plain
fp32 average over the rack's ranks on the rack's steps), compared after every step.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import torch
import torch.distributed as dist
from ranks import Net, Reference, _flat, _write, batch, train
from test_sparse_codec import reference_sparse
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync
from hiersync.levels import due
from hiersync.quant import codec_for
from hiersync.vocab import COMPRESS_CODES, WIRE_FORMATS

BLOCK, KEEP = WIRE_FORMATS["topk2"].block, WIRE_FORMATS["topk2"].keep


def _rack_group(topo: hiersync.Topology):
    """Every rank of this rank's rack (its nodes' replicas are identical, so this is the nodes' mean)."""
    assert topo.racks is not None
    mine = None
    for rack in topo.racks:
        ranks = sorted(r for n in rack for r in topo.nodes[n])
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = g
    return mine


class ThreeLevelReference(Reference):
    """Two-level local SGD plus the rack's average, where :func:`hiersync.levels.due` says."""

    def __init__(self, module, cfg, topo, levels) -> None:
        super().__init__(module, cfg, topo)
        self.levels = levels
        self.rack = _rack_group(topo)
        self.rack_size = dist.get_world_size(self.rack)
        self.residual: np.ndarray | None = None

    def average(self, params=None, anchor=None, mom=None):
        """topk2 (blocking, one rank per node: a node's shard is its whole model, one layout):
        the numpy reference of each node's sparse payload of delta + residual, summed in rail
        order; anything else: the two-level reference's."""
        if self.cfg.get("compress") != "topk2" or params is not None:
            return super().average(params, anchor, mom)
        assert self.L == 1, "one rank per node: the node's shard is its whole model"
        x = _flat(self.m.parameters())
        d = (x - self.anchor).numpy()
        n = -(-d.size // BLOCK) * BLOCK
        e = np.zeros(n, np.float32)
        e[: d.size] = d + (self.residual if self.residual is not None else 0.0)
        sent = reference_sparse(e, BLOCK, KEEP)
        self.residual = (e - sent)[: d.size]
        every = [torch.empty(n) for _ in range(self.W)]
        dist.all_gather(every, torch.from_numpy(sent))
        total = torch.zeros(n)
        for j in range(self.W):  # rail order: node j is rank j here
            total += every[j]
        avg = self.anchor + (total / self.W)[: d.size]
        self.anchor = avg.clone()
        return avg

    def rack_average(self) -> None:
        params = list(self.m.parameters())
        x = _flat(params)
        dist.all_reduce(x, group=self.rack)
        _write(params, x / self.rack_size)

    def step(self, step: int, kind: str, accum: int) -> None:
        names = due(self.levels, step) if kind != "exact" else ()
        if self.cfg["mode"] != "stream":
            # the world's own schedule as the two-level reference runs it; the rack's in between
            super().step(step, "sync" if "world" in names else ("exact" if kind == "exact" else "local"), accum)
            if "rack" in names:
                self.rack_average()
            return
        params = list(self.m.parameters())
        x, y = batch(step)
        torch.nn.functional.mse_loss(self.m(x), y).backward()
        for p in params:
            if kind == "exact":
                dist.all_reduce(p.grad)
                p.grad /= self.W
            elif self.L > 1:
                dist.all_reduce(p.grad, group=self.node)
                p.grad /= self.L
        if kind != "exact" and self.anchor is None and (self.cfg.get("compress") or self.cfg.get("outer")):
            self.anchor = _flat(params)
        self.opt.step()
        self.opt.zero_grad()
        self.apply_due(step)  # the world's corrections first, then the rack, then the world's launches
        if "rack" in names:
            self.rack_average()
        self.launch_fragments(step)


def three_level_check(cfg: dict) -> dict:
    """hiersync with ``rack_period`` == :class:`ThreeLevelReference` after every step (rtol 1e-5)."""
    os.environ["HIERSYNC_RACK_IDS"] = ",".join(map(str, cfg["racks"]))
    topo = hiersync.Topology.detect()
    assert topo.racks is not None
    torch.manual_seed(0)
    model = Net()
    initial = copy.deepcopy(model)
    outer = cfg.get("outer")
    stream = cfg["mode"] == "stream"
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = hiersync.register(
        ddp,
        opt,
        period=cfg["period"],
        rack_period=cfg["rack_period"],
        warmup_steps=cfg.get("warmup", 0),
        overlap=cfg.get("tau", 0) if stream else cfg["mode"] == "overlap",
        fragments=cfg.get("fragments", 1),
        outer_lr=outer[0] if outer else None,
        outer_momentum=outer[1] if outer else 0.0,
        compress=cfg.get("compress"),
    )
    levels = state.config.levels
    # int8/int4: the reference sends fp32 deltas, so bound the codes' error; topk2's is exact
    coded = state.config.compress in COMPRESS_CODES and state.config.compress != "topk2"
    moved, before = 0.0, None
    qmax = codec_for(state.config.compress).qmax if coded else 1
    ref = ThreeLevelReference(initial, cfg, topo, levels)
    rank, W = dist.get_rank(), dist.get_world_size()
    rack_of = [topo.rack_of(r) for r in range(W)]
    racks_differed = nodes_in_rack_differed = False
    rack_steps, world_steps = [], []
    for step in range(cfg["steps"]):
        kind = state.schedule.kind(step)
        train(ddp, opt, 1, start=step)
        if stream and step == 0:
            where = {id(p): j for j, p in enumerate(ddp.module.parameters())}
            ref.layout = [[where[id(state.registry.params[i])] for i in frag] for frag in state.engine.layout()]
            sizes = [p.numel() for p in ref.m.parameters()]
            ref.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        ref.step(step, kind, 1)
        names = due(levels, step) if kind != "exact" else ()
        rack_steps += [step] if "rack" in names else []
        world_steps += [step] if "world" in names else []
        mine = _flat(ddp.parameters())
        everyone = [torch.empty_like(mine) for _ in range(W)]
        dist.all_gather(everyone, mine)
        same_rack = [r for r in range(W) if rack_of[r] == rack_of[rank]]
        if "rack" in names and cfg["mode"] == "blocking":
            for r in same_rack:
                assert torch.equal(everyone[r], mine), f"step {step} (rack sync): rank {r} != rank {rank}"
        if "world" in names and cfg["mode"] == "blocking":
            for r in range(W):
                assert torch.equal(everyone[r], mine), f"step {step} (world sync): rank {r} != rank {rank}"
        if kind != "exact":
            racks_differed |= any(not torch.equal(everyone[r], mine) for r in range(W) if r not in same_rack)
            nodes_in_rack_differed |= any(
                not torch.equal(everyone[r], mine) for r in same_rack if topo.node_of(r) != topo.node_of(rank)
            )
        want = _flat(ref.m.parameters())
        if coded:  # within a code's step (error feedback sends the rest later)
            if before is not None and not names:  # a local step's movement, not a sync's jump
                moved = max(moved, float((want - before).abs().max()))
            before = want
            # a code's step is a window's largest delta / qmax; with the residual, about one step apart
            err, bound = float((mine - want).abs().max()), moved * cfg["period"] / qmax + 1e-6
            assert err <= bound, f"step {step} ({kind}, levels due {names}): {err} > {bound}"
            continue
        torch.testing.assert_close(
            mine,
            want,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, step=step, kind=kind, names=names: f"step {step} ({kind}, levels due {names}): {m}",
        )
    state.synchronize(ddp)
    final = _flat(ddp.parameters())
    everyone = [torch.empty_like(final) for _ in range(W)]
    dist.all_gather(everyone, final)
    return {
        "rack_steps": rack_steps,
        "world_steps": world_steps,
        "racks_differed": racks_differed,
        "nodes_in_rack_differed": nodes_in_rack_differed,
        "bytes": dict(state.stats.bytes_sent),
        "synchronized": all(torch.equal(e, final) for e in everyone),
        "describe": topo.describe(),
    }


def without_racks() -> str:
    """``rack_period`` on a job that named no racks: the error."""
    os.environ.pop("HIERSYNC_RACK_IDS", None)
    try:
        hiersync.HierState(period=4, rack_period=2)
    except ValueError as e:
        return str(e)
    return "no error"


def rack_without_optimizer() -> list[str]:
    """``rack_period`` and no optimizer, on 2 racks x 1 node x 1 rank: ``register(ddp, None, ...)``
    refuses at once; ``HierState`` + the hook without ``attach_optimizer`` at the first step. Each
    refusal: its type and message."""
    os.environ["HIERSYNC_RACK_IDS"] = "0,1"
    out = []
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    try:
        hiersync.register(ddp, None, period=8, rack_period=2)
        out.append("register: no error")
    except Exception as e:
        out.append(f"register: {type(e).__name__}: {e}")
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp.register_comm_hook(hiersync.HierState(period=8, rack_period=2), hiersync.hook)
    try:
        ddp(torch.ones(3, 4)).sum().backward()
        out.append("first step: no error")
    except Exception as e:
        out.append(f"first step: {type(e).__name__}: {e}")
    return out
