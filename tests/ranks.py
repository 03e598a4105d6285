"""Functions that run on every rank under hiersync.tools.launch (module level, so importable).

Shared by the multi-process tests. Models are tiny: the machine has two cores.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync
from hiersync.collectives import HierComm
from hiersync.futures import emulated, wait


# ---------------------------------------------------------------- models and data
class Net(torch.nn.Module):
    """A small MLP; ``unused`` adds a branch that never gets a gradient; ``bf16`` a bf16 layer."""

    def __init__(self, width: int = 16, unused: bool = False, bf16: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, width)
        self.fc2 = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 4)
        self.unused = torch.nn.Linear(width, 3) if unused else None
        self.low = torch.nn.Linear(width, width).to(torch.bfloat16) if bf16 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        if self.low is not None:
            h = h + self.low(h.to(torch.bfloat16)).float()
        return self.head(h)


def batch(step: int, micro: int = 0, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * dist.get_rank() + 100 * step + micro)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def train(ddp: DDP, opt: torch.optim.Optimizer, steps: int, accum: int = 1, start: int = 0, nan_at=None) -> None:
    for step in range(start, start + steps):
        for micro in range(accum):
            x, y = batch(step, micro)
            ctx = ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                if nan_at is not None and nan_at(step):
                    loss = loss * float("nan")
                loss.backward()
        opt.step()
        opt.zero_grad()


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


# ---------------------------------------------------------------- core checks
DDP_VARIANTS = {
    "plain": dict(model={}, ddp={}),
    "bucket_view": dict(model={}, ddp={"gradient_as_bucket_view": True}),
    "static_graph": dict(model={}, ddp={"static_graph": True}),
    "unused": dict(model={"unused": True}, ddp={"find_unused_parameters": True}),
    "no_sync": dict(model={}, ddp={}, accum=3),
    "tiny_buckets": dict(model={}, ddp={"bucket_cap_mb": 0.0005}),
    "bf16_mixed": dict(model={"bf16": True}, ddp={}),
}


def ddp_parity(
    variants: list[str], steps: int = 6, options: dict | None = None, low_precision_tol: bool = False
) -> dict:
    """Train DDP default and DDP+hiersync side by side; return per-variant max abs diffs.

    fp32 parameters must match to rtol 1e-5 / atol 1e-6. With ``low_precision_tol`` (bf16
    buckets on more than two ranks) the sums are rounded to bf16 in a different order than
    gloo's ring, so bf16 parameters may differ by an ulp and that difference feeds the fp32
    layers' next forward passes: the comparison then allows bf16-level differences.
    """
    out = {}
    for name in variants:
        v = DDP_VARIANTS[name]
        torch.manual_seed(0)
        model = Net(**v["model"])
        ref = DDP(copy.deepcopy(model), **v["ddp"])
        ddp = DDP(model, **v["ddp"])
        state = hiersync.HierState(period=1, **(options or {}))
        ddp.register_comm_hook(state, hiersync.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        train(ddp, opt, steps, v.get("accum", 1))
        train(ref, opt_ref, steps, v.get("accum", 1))
        diffs = []
        for p, q in zip(ddp.parameters(), ref.parameters()):
            tol = dict(rtol=1e-5, atol=1e-6)
            if low_precision_tol and name == "bf16_mixed":
                tol = dict(rtol=2**-7, atol=1e-3) if p.dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(p, q, **tol, msg=lambda m, name=name: f"{name}: {m}")
            diffs.append(float((p.detach().float() - q.detach().float()).abs().max()))
        out[name] = {"max_diff": max(diffs), "steps": state.stats.steps, "exact": state.stats.exact_steps}
    return out


def allreduce_sizes(sizes: list[int], dtype: str = "float32", intra_algorithm: str | None = None) -> dict:
    """Two-level all-reduce of random tensors of each size vs a flat all-reduce / world."""
    comm = HierComm(hiersync.Topology.detect().build_groups(), intra_algorithm=intra_algorithm)
    dt = getattr(torch, dtype)
    worst = 0.0
    futs = []
    for n in sizes:
        g = torch.Generator().manual_seed(7919 * n + dist.get_rank())
        x = torch.randn(n, generator=g).to(dt)
        ref = x.clone()
        dist.all_reduce(ref)
        ref.div_(dist.get_world_size())
        futs.append((comm.allreduce(x), ref))  # several in flight at once, like DDP buckets
    for fut, ref in futs:
        y = wait(fut)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        worst = max(worst, float((y - ref).abs().max()))
    return {"worst": worst, "count": len(sizes)}


def stats_for_bucket(numel: int, intra_algorithm: str | None = None) -> dict:
    """Reduce one tensor of ``numel`` fp32 with the exact path and return the stats."""
    comm = HierComm(hiersync.Topology.detect().build_groups(), intra_algorithm=intra_algorithm)
    wait(comm.allreduce(torch.ones(numel)))
    intra_only = torch.ones(numel)
    comm.stats.reset()
    wait(comm.allreduce(torch.ones(numel)))
    exact = comm.stats.as_dict()
    comm.stats.reset()
    wait(comm.intra_allreduce(intra_only))
    return {"exact": exact, "intra": comm.stats.as_dict()}


def detect_topology() -> list[list[int]]:
    return [list(n) for n in hiersync.Topology.detect().nodes]


def detect_by_node_key(missing_on: int = -1) -> tuple[list[list[int]], str]:
    """HIERSYNC_NODE_KEY=FAKE_NODE, with FAKE_NODE naming the node of each rank (2 per node)."""
    import os

    if dist.get_rank() != missing_on:
        os.environ["FAKE_NODE"] = f"node-{dist.get_rank() // 2}"
    topo = hiersync.Topology.detect()
    return [list(n) for n in topo.nodes], topo.source


def group_descriptions() -> list[str]:
    state = hiersync.HierState(period=2)
    g = state.groups
    return [getattr(x, "group_desc", "?") for x in (g.intra, g.intra_late, g.rail)]


def detect_by_group_rank() -> list[list[int]]:
    import os

    os.environ["GROUP_RANK"] = str(dist.get_rank() // 2)
    return detect_topology()


def allreduce_sizes_lowp(sizes: list[int], dtype: str) -> None:
    comm = HierComm(hiersync.Topology.detect().build_groups())
    dt = getattr(torch, dtype)
    for n in sizes:
        g = torch.Generator().manual_seed(n + dist.get_rank())
        x = torch.randn(n, generator=g).to(dt)
        exact = x.double()
        dist.all_reduce(exact)
        exact /= dist.get_world_size()
        scale = x.double().abs()
        dist.all_reduce(scale)
        scale /= dist.get_world_size()
        y = wait(comm.allreduce(x))
        assert y.dtype == dt
        # Divide, two partial sums and their rounding: each error is at most one unit
        # roundoff of a partial sum, and partial sums are bounded by the mean of |x|.
        err = (y.double() - exact).abs()
        bound = 4 * torch.finfo(dt).eps * scale + 1e-30
        assert bool((err <= bound).all()), f"{dtype} n={n}: max err/bound {float((err / bound).max()):.2f}"


def register_one_liner() -> dict:
    torch.manual_seed(0)
    model = Net()
    ref = DDP(copy.deepcopy(model))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state = hiersync.register(ddp, opt, period=1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    train(ddp, opt, 5)
    train(ref, opt_ref, 5)
    for p, q in zip(ddp.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return state.stats.as_dict()


def fail_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        raise ValueError(f"boom from rank {bad}")
    dist.barrier()


def fail_while_peers_sleep(bad: int) -> None:
    if dist.get_rank() == bad:
        raise ValueError(f"boom from rank {bad}")
    time.sleep(3600)  # only the launcher ends these


def sleep_forever() -> None:
    import time

    time.sleep(3600)


def die_on_rank(bad: int) -> None:
    import os
    import signal

    dist.barrier()
    if dist.get_rank() == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


# ---------------------------------------------------------------- period k (local SGD)
def _node_group(topo: hiersync.Topology):
    mine = None
    for node in topo.nodes:
        g = dist.new_group(list(node))
        if dist.get_rank() in node:
            mine = g
    return mine


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def _write(params, flat: torch.Tensor) -> None:
    off = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[off : off + p.numel()].view(p.shape))
            off += p.numel()


class SignMomentum(torch.optim.Optimizer):
    """A user's own optimizer (what ``outer_optimizer=`` must take): signed momentum, with a count."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.8) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["buf"], st["count"] = torch.zeros_like(p), 0
                st["buf"].mul_(group["beta"]).add_(p.grad)
                st["count"] += 1
                p.add_(st["buf"].sign(), alpha=-group["lr"] / st["count"] ** 0.5)


OUTER_OPTIMIZERS = {
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.02, betas=(0.8, 0.95)),
    "mine": lambda ps: SignMomentum(ps, lr=0.01),
}
"""``outer_optimizer=`` factories the tests run (``cfg["outer_opt"]``), and the reference with them."""


def _outer_by_optimizer(name: str, avg: torch.Tensor, anchor: torch.Tensor, state):
    """The reference's outer step by ``OUTER_OPTIMIZERS[name]`` on the whole flat model."""
    p = anchor.clone()
    p.grad = anchor - avg
    opt = OUTER_OPTIMIZERS[name]([p])
    if state is not None:
        opt.state[p] = state
    opt.step()
    return p.detach(), dict(opt.state[p])


class Reference:
    """Hand-written hierarchical local SGD on a plain module: the oracle for the hook."""

    def __init__(self, module, cfg, topo) -> None:
        self.m = module
        self.cfg = cfg
        self.node = _node_group(topo)
        self.L = len(topo.node_ranks(dist.get_rank()))
        self.W = dist.get_world_size()
        self.opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        self.anchor = None
        self.mom = None
        self.pending = None
        self.max_delta = 0.0
        # streaming: per-fragment anchor, momentum and corrections in flight
        self.frag_anchor: dict[int, torch.Tensor] = {}
        self.frag_mom: dict[int, torch.Tensor] = {}
        self.in_flight: list[tuple[int, int, torch.Tensor]] = []  # (apply after step, fragment, correction)
        self.state_in_flight: list[tuple[int, int, torch.Tensor]] = []  # the same, for the optimizer state
        self.pending_state = None

    def average(self, params=None, anchor=None, mom=None):
        """The new value of ``params`` (all by default): mean, or outer step; and the new momentum."""
        whole = params is None
        params = list(self.m.parameters()) if whole else params
        anchor, mom = (self.anchor, self.mom) if whole else (anchor, mom)
        x = _flat(params)
        compress, outer = self.cfg.get("compress"), self.cfg.get("outer")
        if compress in ("int8", "int4", "topk2"):  # the reference sends fp32 deltas: the test bounds the codes' error
            delta = x - anchor
            self.max_delta = max(self.max_delta, float((x - anchor).abs().max()))
            dist.all_reduce(delta)
            avg = anchor + delta / self.W
        elif compress:
            delta = (x - anchor).to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[compress])).float()
            self.max_delta = max(self.max_delta, float((x - anchor).abs().max()))
            dist.all_reduce(delta)
            avg = anchor + delta / self.W
        else:
            avg = x.clone()
            dist.all_reduce(avg)
            avg /= self.W
        if self.cfg.get("outer_opt"):
            avg, mom = _outer_by_optimizer(self.cfg["outer_opt"], avg, anchor, mom)
        elif outer:
            lr, mu = outer
            g = anchor - avg
            if mu:
                mom = g.clone() if mom is None else mom.mul_(mu).add_(g)
                g = g + mu * mom
            avg = anchor - lr * g
        if whole:
            self.mom = mom
            if self.anchor is not None:
                self.anchor = avg.clone()
            return avg
        return avg, mom

    def stream_after_step(self, step: int) -> None:
        """Streaming, after ``optimizer.step()`` of ``step``: apply due corrections, then sync the
        fragments whose turn it is (docs/design.md "Streaming"), written out by hand."""
        self.apply_due(step)
        self.launch_fragments(step)

    def apply_due(self, step: int) -> None:
        """Streaming: add the corrections due after ``step`` (the first half of an after-step)."""
        params = list(self.m.parameters())
        for _, f, corr in [job for job in self.in_flight if job[0] <= step]:
            group = [params[i] for i in self.layout[f]]
            _write(group, _flat(group) + corr)
        self.in_flight = [job for job in self.in_flight if job[0] > step]
        for _, f, corr in [job for job in self.state_in_flight if job[0] <= step]:
            group = [params[i] for i in self.layout[f]]
            self._state_write(group, self._state_flat(group) + corr)
        self.state_in_flight = [job for job in self.state_in_flight if job[0] > step]

    def launch_fragments(self, step: int) -> None:
        """Streaming: average the fragments whose turn it is after ``step`` (the second half)."""
        k, F, tau, warm = self.cfg["period"], self.cfg["fragments"], self.cfg["tau"], self.cfg.get("warmup", 0)
        params = list(self.m.parameters())
        if step < warm:
            return
        for f in range(F):
            if math.ceil((f + 1) * k / F) - 1 != (step - warm) % k:
                continue
            group = [params[i] for i in self.layout[f]]
            if f not in self.frag_anchor and self.anchor is not None:
                self.frag_anchor[f] = torch.cat(
                    [self.anchor[self.offsets[i] : self.offsets[i + 1]] for i in self.layout[f]]
                )
            target, self.frag_mom[f] = self.average(group, self.frag_anchor.get(f), self.frag_mom.get(f))
            if f in self.frag_anchor:
                self.frag_anchor[f] = target.clone()
            if tau == 0:
                _write(group, target)
            else:
                self.in_flight.append((step + tau, f, target - _flat(group)))
            if self.cfg.get("avg_state") and tau == 0:
                self._state_write(group, self._state_average(group))
            elif self.cfg.get("avg_state"):
                self.state_in_flight.append((step + tau, f, self._state_average(group) - self._state_flat(group)))

    def step(self, step: int, kind: str, accum: int) -> None:
        mode = self.cfg["mode"]
        params = list(self.m.parameters())
        for micro in range(accum):
            x, y = batch(step, micro)
            torch.nn.functional.mse_loss(self.m(x), y).backward()
        for p in params:
            if kind == "exact":
                dist.all_reduce(p.grad)
                p.grad /= self.W
            elif self.L > 1:
                dist.all_reduce(p.grad, group=self.node)
                p.grad /= self.L
        anchored = self.cfg.get("compress") or self.cfg.get("outer") or self.cfg.get("outer_opt")
        if kind != "exact" and self.anchor is None and anchored:
            self.anchor = _flat(params)
        if mode == "stream":
            self.opt.step()
            self.opt.zero_grad()
            self.stream_after_step(step)
            return
        if kind == "sync" and mode == "hook":
            _write(params, self.average())
        self.opt.step()
        self.opt.zero_grad()
        if mode == "overlap" and self.pending is not None:
            _write(params, _flat(params) + self.pending)
            self.pending = None
        if mode == "overlap" and self.pending_state is not None:
            self._state_write(params, self._state_flat(params) + self.pending_state)
            self.pending_state = None
        if kind == "sync" and mode == "blocking":
            _write(params, self.average())
            if self.cfg.get("avg_state"):
                self._state_write(params, self._state_average(params))
        if kind == "sync" and mode == "overlap":
            snap = _flat(params)
            self.pending = self.average() - snap
            if self.cfg.get("avg_state"):
                self.pending_state = self._state_average(params) - self._state_flat(params)

    # the optimizer state (SGD's momentum buffers), averaged with the parameters when cfg["avg_state"]
    def _state_flat(self, params) -> torch.Tensor:
        return torch.cat([self.opt.state[p]["momentum_buffer"].reshape(-1) for p in params])

    def _state_write(self, params, flat: torch.Tensor) -> None:
        _write([self.opt.state[p]["momentum_buffer"] for p in params], flat)

    def _state_average(self, params) -> torch.Tensor:
        x = self._state_flat(params)
        dist.all_reduce(x)
        return x / self.W


def localsgd_check(cfg: dict) -> dict:
    """Train hiersync period k next to the Reference (and DDP default during warmup).

    Checks after every step: intra-node replicas bitwise identical; hiersync == Reference;
    steps < warmup == DDP default; with an attached optimizer (no overlap) all ranks
    identical right after each sync step. Returns what happened for the caller's asserts.
    """
    from hiersync.schedule import Schedule

    mode, period, warmup = cfg["mode"], cfg["period"], cfg.get("warmup", 0)
    steps, accum = cfg["steps"], cfg.get("accum", 1)
    if "gather_piece_bytes" in cfg:  # several gather pieces per chunk even for this tiny model
        from hiersync import averagers

        averagers.GATHER_PIECE_BYTES = cfg["gather_piece_bytes"]
    topo = hiersync.Topology.detect()
    torch.manual_seed(0)
    model = Net(width=cfg.get("width", 16))
    ref = Reference(copy.deepcopy(model), cfg, topo)
    plain = DDP(copy.deepcopy(model))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    ddp = DDP(model, **cfg.get("ddp", {}))
    outer = cfg.get("outer")
    stream = mode == "stream"
    state = hiersync.HierState(
        period,
        warmup,
        overlap=cfg["tau"] if stream else mode == "overlap",
        fragments=cfg.get("fragments", 1),
        compress=cfg.get("compress"),
        outer_lr=outer[0] if outer else None,
        outer_momentum=outer[1] if outer else 0.0,
        outer_optimizer=OUTER_OPTIMIZERS[cfg["outer_opt"]] if cfg.get("outer_opt") else None,
        state_device=cfg.get("state_device"),
        average_optimizer_state=("momentum_buffer",) if cfg.get("avg_state") else (),
    )
    ddp.register_comm_hook(state, hiersync.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if mode != "hook":
        state.attach_optimizer(opt)
    sched = Schedule(period, warmup, cfg.get("fragments", 1))
    rank, W = dist.get_rank(), dist.get_world_size()
    launches: list[tuple[int, list[int]]] = []  # (step, registry positions) of every cross-node average
    if stream:
        logged = getattr(state.engine.averager, "base", state.engine.averager)  # the parameters' averager
        real_launch = logged._launch

        def logged_launch(chunk, *args, **kw):
            launched = real_launch(chunk, *args, **kw)
            launches.append((state.step - 1, list(launched.indices)))
            return launched

        logged._launch = logged_launch
    same_node = [r for r in range(W) if topo.node_of(r) == topo.node_of(rank)]
    worst = 0.0
    nodes_differed = False
    gathered_early: list[bool] = []  # per correction in flight after a step: gathered before its apply?
    for step in range(steps):
        kind = sched.kind(step)
        train(ddp, opt, 1, accum, start=step)
        for c in state.engine.in_flight:
            # waits for the node gather without applying anything: it must have been issued already.
            # Emulated NCCL completes it at enqueue: read its size without resolving the poison, so that
            # a skipped wait at apply time still shows (tests/test_emulation.py).
            held = emulated() and c.future.done()
            whole = c.future.value() if held else wait(c.future)
            first = whole[0] if isinstance(whole, list) else whole  # with the optimizer state: one per averager
            base = getattr(state.engine.averager, "base", state.engine.averager)
            gathered_early.append(first.numel() > base.shard_numel(c.indices))
        if stream and step == 0:
            # the fragments, as model.parameters() indices (the hook's registry order -> the model's)
            where = {id(p): j for j, p in enumerate(ddp.module.parameters())}
            ref.layout = [[where[id(state.registry.params[i])] for i in frag] for frag in state.engine.layout()]
            sizes = [p.numel() for p in ref.m.parameters()]
            ref.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        ref.step(step, kind, accum)
        mine = _flat(ddp.parameters())
        everyone = [torch.empty_like(mine) for _ in range(W)]
        dist.all_gather(everyone, mine)
        for r in same_node:
            assert torch.equal(everyone[r], mine), f"step {step}: rank {r} differs from rank {rank} on one node"
        if mode == "blocking" and kind == "sync":
            for r in range(W):
                assert torch.equal(everyone[r], mine), f"step {step} (sync): rank {r} != rank {rank}"
        if kind != "exact" and any(not torch.equal(everyone[r], mine) for r in range(W)):
            nodes_differed = True
        if step < warmup:
            train(plain, plain_opt, 1, accum, start=step)
            torch.testing.assert_close(mine, _flat(plain.parameters()), rtol=1e-5, atol=1e-6)
        diff = float((mine - _flat(ref.m.parameters())).abs().max())
        worst = max(worst, diff)
        if not cfg.get("compress"):
            torch.testing.assert_close(
                mine,
                _flat(ref.m.parameters()),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, step=step, kind=kind: f"step {step} ({kind}): {m}",
            )
    return {
        "sync_steps": list(state.stats.recent_sync_steps),
        "expected_sync_steps": [s for s in range(steps) if sched.is_sync(s)],
        "stats": state.stats.as_dict(),
        "worst_vs_reference": worst,
        "max_delta": ref.max_delta,
        "nodes_differed": nodes_differed,
        "launches": launches,
        "layout": [list(f) for f in state.engine.layout()] if stream else None,
        "num_params": len(state.registry.params),
        "param_scale": float(_flat(ddp.parameters()).abs().max()),
        "gathered_early": gathered_early,
    }


def _build(cfg: dict):
    if "racks" in cfg:
        import os

        os.environ["HIERSYNC_RACK_IDS"] = ",".join(map(str, cfg["racks"]))
    torch.manual_seed(0)
    ddp = DDP(Net(), **cfg.get("ddp", {}))
    outer = cfg.get("outer")
    state = hiersync.HierState(
        cfg["period"],
        cfg.get("warmup", 0),
        overlap=cfg["tau"] if cfg["mode"] == "stream" else cfg["mode"] == "overlap",
        fragments=cfg.get("fragments", 1),
        compress=cfg.get("compress"),
        outer_lr=outer[0] if outer else None,
        outer_momentum=outer[1] if outer else 0.0,
        outer_optimizer=OUTER_OPTIMIZERS[cfg["outer_opt"]] if cfg.get("outer_opt") else None,
        average_optimizer_state=("momentum_buffer",) if cfg.get("avg_state") else (),
        rack_period=cfg.get("rack_period"),
    )
    ddp.register_comm_hook(state, hiersync.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if cfg["mode"] != "hook":
        state.attach_optimizer(opt)
    return ddp, opt, state


def checkpoint_run(cfg: dict, phase: str, folder: str, n: int) -> list:
    """'straight': 2n steps. 'first': n steps then save. 'resume': load, then n more steps."""
    import os

    ddp, opt, state = _build(cfg)
    path = os.path.join(folder, f"ckpt-rank{dist.get_rank()}.pt")
    if phase == "straight":
        train(ddp, opt, 2 * n, cfg.get("accum", 1))
    elif phase == "first":
        train(ddp, opt, n, cfg.get("accum", 1))
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hier": state.state_dict()}, path)
    else:
        ckpt = torch.load(path, weights_only=False)
        ddp.module.load_state_dict(ckpt["model"])  # after DDP's construction-time broadcast
        opt.load_state_dict(ckpt["opt"])
        state.load_state_dict(ckpt["hier"])
        train(ddp, opt, n, cfg.get("accum", 1), start=n)
    return _flat(ddp.parameters()).tolist()


def load_another_ranks_state() -> str:
    """Every rank loads its node-mate's hiersync state_dict (2x2): the shards must not fit."""
    cfg = dict(mode="stream", period=2, fragments=2, tau=1, compress="bf16")
    ddp, opt, state = _build(cfg)
    train(ddp, opt, 3)
    saved: list = [None] * dist.get_world_size()
    dist.all_gather_object(saved, state.state_dict())
    try:
        state.load_state_dict(saved[dist.get_rank() ^ 1])
    except ValueError as e:
        state.load_state_dict(saved[dist.get_rank()])  # its own still loads after the refusal
        return str(e)
    return "loaded"


# ---------------------------------------------------------------- reliability
def die_mid_training(
    victim: int,
    die_at: int,
    period: int,
    timeout_s: float | None,
    how: str = "kill",
    in_hook: bool = False,
    bucket_cap_mb: float = 25.0,
) -> None:
    """Train; ``victim`` SIGKILLs (or SIGSTOPs) itself at step ``die_at``; survivors must raise.

    ``timeout_s=None``: hiersync inherits the job's own (``init_process_group``) timeout.
    A small ``bucket_cap_mb`` gives several buckets per step (the early-failure race).
    """
    import os
    import signal
    import time

    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    hiersync.register(ddp, None if in_hook else opt, period=period, timeout=timeout_s)
    for step in range(die_at + 3 * period + 2):
        if step == die_at:
            if dist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            time.sleep(0.5)  # the victim is gone (or frozen) before the next collective
        train(ddp, opt, 1, start=step)


def nan_check(mode: str, period: int, warmup: int, nan_steps: list[int], steps: int) -> dict:
    """Rank 1 produces NaN gradients at ``nan_steps``; no parameter may ever be non-finite."""
    from hiersync.schedule import Schedule

    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    options = {
        "stream": dict(fragments=period, overlap=1),
        "overlap": dict(overlap=1),
        "overlap_int4": dict(overlap=1, compress="int4"),
    }.get(mode, {})
    state = hiersync.register(ddp, None if mode == "hook" else opt, period=period, warmup_steps=warmup, **options)
    sched = Schedule(period, warmup)
    unchanged_on_skip = []
    for step in range(steps):
        before = _flat(ddp.parameters())
        train(ddp, opt, 1, start=step, nan_at=lambda s: s in nan_steps and dist.get_rank() == 1)
        after = _flat(ddp.parameters())
        assert bool(torch.isfinite(after).all()), f"step {step}: non-finite parameters on rank {dist.get_rank()}"
        everyone = [torch.empty_like(after) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, after)
        assert all(bool(torch.isfinite(t).all()) for t in everyone)
        if step in nan_steps and sched.kind(step) == "local" and mode != "hook":
            unchanged_on_skip.append(torch.equal(before, after))
    return {"stats": state.stats.as_dict(), "unchanged_on_skip": unchanged_on_skip}


def nan_raise() -> None:
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    hiersync.register(ddp, opt, period=1, nonfinite="raise")
    train(ddp, opt, 3, nan_at=lambda s: s == 1 and dist.get_rank() == 0)


def profiled_step(period: int) -> list[str]:
    """Names of the hiersync/... profiler ranges recorded during two steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    hiersync.register(ddp, opt, period=period)
    train(ddp, opt, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(ddp, opt, 2, start=1)
    return sorted({e.name for e in prof.events() if e.name.startswith("hiersync/")})


def synchronize_check(mode: str) -> dict:
    """After local steps the nodes differ; synchronize() makes every rank equal the world mean."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    ddp = DDP(model, broadcast_buffers=False)  # buffers drift per rank too
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = hiersync.register(ddp, None if mode == "hook" else opt, period=50)
    train(ddp, opt, 3)
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    mine = _flat(tensors)
    mean = mine.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    differed = any(not torch.equal(t, mine) for t in everyone)
    state.synchronize(ddp)
    after = _flat(tensors)
    dist.all_gather(everyone, after)
    assert all(torch.equal(t, after) for t in everyone), "ranks differ after synchronize()"
    torch.testing.assert_close(after, mean, rtol=1e-5, atol=1e-6)
    return {"differed_before": differed}


def streaming_with_a_sync_in_flight() -> tuple[DDP, hiersync.HierState]:
    """Streaming (k=2, F=2, tau=1) for 4 steps, rank 1 late to the last one: the last sync is
    still in flight at the end, and its node peer is further on by the time rank 1 launches it."""
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state = hiersync.register(ddp, opt, period=2, fragments=2, overlap=1)
    x = torch.randn(4, 64)
    for step in range(4):
        ddp(x).sum().backward()
        if step == 3 and dist.get_rank() == 1:
            time.sleep(0.5)
        opt.step()
        opt.zero_grad()
    return ddp, state


def close_in_flight(drain: bool) -> dict:
    """close() (after drain() or not) with a sync in flight: it applies nothing, and the job's
    own world collectives still go through."""
    ddp, state = streaming_with_a_sync_in_flight()
    in_flight = len(state.engine.in_flight)
    if drain:
        state.drain()
    before = _flat(ddp.parameters())
    state.close()
    assert torch.equal(_flat(ddp.parameters()), before), "close() applies nothing"
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.barrier()
    return {"in_flight": in_flight, "sum": float(t)}


def scaler_overflow(mode: str, period: int, inject: list[int], steps: int) -> dict:
    """fp16 autocast + GradScaler, the plain loop; rank 1 overflows at the ``inject`` steps.

    Parameters must stay finite on every rank after every step; ``synchronize`` at the end
    must make every rank identical.
    """
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.0005)  # several buckets per step
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    stream = dict(fragments=4, overlap=1) if mode == "stream" else {}
    state = hiersync.register(ddp, None if mode == "hook" else opt, period=period, **stream)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10_000)
    scales, losses = [], []
    for step in range(steps):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
        if step in inject and dist.get_rank() == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        losses.append(float(loss))
        assert bool(torch.isfinite(_flat(ddp.parameters())).all()), f"non-finite parameters after step {step}"
    state.synchronize(ddp)
    mine = _flat(ddp.parameters())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return {
        "scales": scales,
        "last_loss": losses[-1],
        "identical": all(torch.equal(t, mine) for t in everyone),
        "stats": state.stats.as_dict(),
    }


def bf16_autocast(period: int, steps: int) -> dict:
    """bf16 autocast (no scaler) trains through hiersync like through DDP at period 1."""
    torch.manual_seed(0)
    ddp = DDP(Net())
    ref = DDP(copy.deepcopy(ddp.module))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    hiersync.register(ddp, opt, period=period)
    for step in range(steps):
        x, y = batch(step)
        for net, o in ((ddp, opt), (ref, ref_opt)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            o.step()
            o.zero_grad()
    diff = max(float((p - q).abs().max()) for p, q in zip(ddp.parameters(), ref.parameters()))
    return {"max_diff": diff}


# ---------------------------------------------------------------- emulated NCCL
def with_wait_skipped(module: str, caller: str, target: str, *args):
    """Run ``target(*args)`` with one read of a collective's result put back *without* wait.

    Every call of ``futures.wait`` made by the function named ``caller`` in ``module``
    returns the future's value directly, as a read without its wait would:
    on NCCL that read races the collective. Under ``HIERSYNC_EMULATE_NCCL=1`` the value
    is still poisoned, so the run must fail.
    """
    import importlib
    import sys

    mod = importlib.import_module(module)
    real = mod.wait
    skipped = [0]

    def skipping(fut):
        if sys._getframe(1).f_code.co_name == caller:
            skipped[0] += 1
            return fut.value()  # the defect: no wait
        return real(fut)

    mod.wait = skipping
    try:
        if "." in target:  # another test module's function, e.g. "fsdp_ranks.fsdp_check"
            where, name = target.rsplit(".", 1)
            result = getattr(importlib.import_module(where), name)(*args)
        else:
            result = globals()[target](*args)
    finally:
        mod.wait = real
    assert skipped[0], f"{module}.{caller} never called wait(): the site no longer exists"
    return result
