"""The sync engine alone: CrossNodeSync over each averager, the communication faked.

A fake :class:`~hiersync.collectives.HierComm` completes its futures at once and the other
nodes contribute nothing to the sum (their payloads are zero), so the rail average of a
payload is ``payload / N``, and a hand-written reference can follow every fragment, window,
correction and checkpoint. One process, no groups, a few milliseconds per case.
"""

from __future__ import annotations

import functools
import inspect
import types

import pytest
import torch

from hiersync.averagers import ReplicatedNodeAverager, ShardedNodeAverager
from hiersync.collectives import HierComm
from hiersync.futures import completed
from hiersync.localsgd import Registry
from hiersync.quant import codec_for
from hiersync.schedule import Schedule, fragment_layout
from hiersync.sync import AveragerComm, CrossNodeSync
from hiersync.topology import Topology
from hiersync.transport import GroupRail

N = 2  # nodes
SIZES = [6, 5, 7, 4, 3]  # parameter sizes (elements)


class _Comm:
    """The part of :class:`~hiersync.collectives.HierComm` the engine reaches, with futures
    completed at once (the other nodes send zeros). Its methods keep HierComm's signatures
    (checked below) and any other attribute raises, so the engine cannot lean on something
    this fake does not model. (A ``mock.create_autospec`` did the same at ~2 ms a case.)"""

    def __init__(self, sharded: bool) -> None:
        self.topology = Topology.from_node_ids([0, 0, 1, 1] if sharded else [0, 1])
        self.groups = types.SimpleNamespace(node_size=2 if sharded else 1, local_rank=0)
        self.rail = GroupRail(None, N)
        self.weighting = None  # the unweighted mean
        self.sent: list[int] = []  # elements of each payload, in launch order

    def rail_nodes(self) -> int:
        return N

    def average_shard(self, shard: torch.Tensor) -> torch.futures.Future:
        self.sent.append(shard.numel())
        return completed(shard.div_(N))

    def average_across_nodes(self, flat: torch.Tensor) -> torch.futures.Future:
        self.sent.append(flat.numel())
        return completed(flat.div_(N))

    def __getattr__(self, name: str):
        raise AttributeError(f"the engine used HierComm.{name}, which this test's fake does not model")


def test_hiercomm_and_the_fake_keep_the_averagers_comm_protocol():
    """Every method of :class:`AveragerComm` exists on HierComm with the same signature, and
    the fake's are the same; the fake's attributes are the protocol's."""
    members = [n for n in AveragerComm.__dict__ if not n.startswith("_")]
    methods = [n for n in members if callable(getattr(AveragerComm, n))]
    assert {"average_shard", "average_quantized", "gather_node", "rail_divisor"} <= set(methods)
    for name in methods:
        want = inspect.signature(getattr(AveragerComm, name))
        assert inspect.signature(getattr(HierComm, name)) == want, name
        if name in _Comm.__dict__:
            assert inspect.signature(getattr(_Comm, name)) == want, name
    fake = _Comm(sharded=True)
    for name in AveragerComm.__annotations__:
        assert name in vars(fake), name


def _engine(kind: str, cfg: dict, params: list[torch.Tensor]) -> CrossNodeSync:
    comm, registry = _Comm(kind == "sharded"), Registry()
    registry.register(params)
    codec = codec_for("bf16") if cfg.get("compress") is torch.bfloat16 else None
    opts = dict(codec=codec, outer_lr=cfg.get("outer_lr"), outer_momentum=cfg.get("mu", 0.0))
    if kind == "sharded":
        averager = ShardedNodeAverager(comm, registry, **opts)
    else:
        averager = ReplicatedNodeAverager(comm, registry, **opts)
    schedule = Schedule(period=cfg["period"], warmup_steps=cfg.get("warmup", 0), fragments=cfg["fragments"])
    return CrossNodeSync(
        averager,
        registry,
        schedule,
        overlap=cfg["tau"],
        chunk_bytes=cfg.get("chunk_bytes", 1 << 20),
        transport=comm.rail,
    )


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-6) -> None:
    """``torch.testing.assert_close(rtol=tol, atol=tol)`` without its first call's import of DTensor
    (and sympy: ~2.5 s, more than every case of this file together)."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape}/{got.dtype} vs {want.shape}"
    err = (got - want).abs()
    bad = err > tol + tol * want.abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} of {got.numel()} differ, max abs error {float(err.max()):.3g}"


@functools.cache
def _update(step: int, i: int, n: int) -> torch.Tensor:
    """The "optimizer step" of parameter ``i`` at ``step`` (deterministic; never written to)."""
    g = torch.Generator().manual_seed(1000 * step + i)
    return 0.1 * torch.randn(n, generator=g)


def _params() -> list[torch.Tensor]:
    """The starting parameters. (A generator of their own: ``torch.manual_seed`` also seeds
    every lazily initialised accelerator and formats a stack trace for each, ~1 ms a call.)"""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in SIZES]


class Reference:
    """Streaming local SGD written out by hand: fragment f's average after step s is
    ``target = mean(payload)`` (plus anchor, outer step), applied at once (tau = 0) or as
    ``target - snapshot`` added after step ``s + tau``."""

    def __init__(self, cfg: dict, layout: list[list[int]], params: list[torch.Tensor]) -> None:
        self.cfg, self.layout, self.x = cfg, layout, [p.clone() for p in params]
        self.anchor: dict[int, torch.Tensor] = {}
        self.momentum: dict[int, torch.Tensor] = {}
        self.in_flight: list[tuple[int, int, torch.Tensor]] = []  # (apply at steps done, fragment, correction)

    def flat(self, f: int) -> torch.Tensor:
        return torch.cat([self.x[i] for i in self.layout[f]])

    def put(self, f: int, flat: torch.Tensor, add: bool = False) -> None:
        o = 0
        for i in self.layout[f]:
            n = self.x[i].numel()
            self.x[i] = self.x[i] + flat[o : o + n] if add else flat[o : o + n].clone()
            o += n

    def target(self, f: int) -> torch.Tensor:
        cfg, x = self.cfg, self.flat(f)
        compress, lr, mu = cfg.get("compress"), cfg.get("outer_lr"), cfg.get("mu", 0.0)
        anchor = self.anchor.get(f)
        if compress is not None:
            avg = anchor + ((x - anchor).to(compress) / N).float()
        else:
            avg = x / N
        if lr is not None:
            g = anchor - avg
            if mu:
                m = self.momentum.get(f, torch.zeros_like(g)) * mu + g
                self.momentum[f] = m
                g = g + mu * m
            avg = anchor - lr * g
        if compress is not None or lr is not None:
            self.anchor[f] = avg.clone()
        return avg

    def capture(self) -> None:
        if self.cfg.get("compress") is not None or self.cfg.get("outer_lr") is not None:
            self.anchor = {f: self.flat(f) for f in range(len(self.layout)) if f not in self.anchor}

    def apply(self, steps_done: int | None, only: int | None = None) -> None:
        for at, f, corr in list(self.in_flight):
            if (steps_done is None or at <= steps_done) and (only is None or f == only):
                self.put(f, corr, add=True)
                self.in_flight.remove((at, f, corr))

    def sync(self, fragments, apply_at: int, tau: int) -> None:
        for f in fragments:
            self.apply(None, only=f)  # a fragment's previous correction lands before it syncs again
            if tau == 0:
                self.put(f, self.target(f))
            else:
                snapshot = self.flat(f)
                self.in_flight.append((apply_at, f, self.target(f) - snapshot))


def _run(kind: str, cfg: dict, steps: int, skip: tuple[int, ...] = (), save_at: int | None = None):
    """Train ``steps`` steps through the engine and the reference; optionally checkpoint the
    engine after ``save_at`` steps and go on with a new engine that loads it."""
    params = _params()
    engine = _engine(kind, cfg, params)
    ref = Reference(cfg, engine.layout(), params)
    sched, tau = engine.schedule, cfg["tau"]
    captured = False
    for s in range(steps):
        if s == save_at:
            saved = engine.state()
            params = [p.clone() for p in params]
            engine = _engine(kind, cfg, params)
            engine.load(saved["averager"], saved["in_flight"])
        kind_s = sched.kind(s)
        engine.launch_due()  # the next forward: a sync whose optimizer.step() was skipped launches here
        if kind_s != "exact" and not captured:
            engine.capture_anchor()
            ref.capture()
            captured = True
        if kind_s == "sync":
            engine.mark_due(s)
        elif kind_s == "local":
            engine.idle()  # as the front-end does: nothing syncs after this step
        if s in skip:  # a GradScaler skipped optimizer.step(): no update, no after_step
            if kind_s == "sync":
                due = sched.fragments_due(s) if sched.fragments > 1 else (0,)
                ref.sync(due, s + 1 + max(tau, 1), max(tau, 1))
            continue
        for i, p in enumerate(params):
            update = _update(s, i, p.numel())
            p.add_(update)
            ref.x[i] = ref.x[i] + update
        engine.after_step(s + 1)
        ref.apply(s + 1)
        if kind_s == "sync":
            due = sched.fragments_due(s) if sched.fragments > 1 else (0,)
            ref.sync(due, s + 1 + tau, tau)
    engine.apply_corrections()
    ref.apply(None)
    return params, ref.x, engine


CASES = [
    dict(period=k, fragments=f, tau=tau, warmup=w)
    for k, f, w in ((2, 1, 0), (4, 1, 1), (4, 2, 0), (4, 4, 2))
    for tau in range(k)
]
OPTIONS = {  # (bf16 deltas alone: the same path as with the outer step, less the step)
    "plain": {},
    "outer_bf16": dict(compress=torch.bfloat16, outer_lr=0.7, mu=0.9),
    "outer_chunked": dict(outer_lr=0.7, mu=0.9, chunk_bytes=24),
}


def _ids(cfg: dict) -> str:
    return f"k{cfg['period']}_F{cfg['fragments']}_tau{cfg['tau']}_warm{cfg['warmup']}"


@pytest.mark.parametrize("kind", ["replicated", "sharded"])
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("cfg", CASES, ids=_ids)
def test_engine_matches_reference(cfg, options, kind):
    cfg = dict(cfg, **OPTIONS[options])
    got, want, _ = _run(kind, cfg, steps=11)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_close(g, w, f"parameter {i}")


@pytest.mark.parametrize("kind", ["replicated", "sharded"])
@pytest.mark.parametrize("tau", [0, 1, 3])
@pytest.mark.parametrize("skip", [(3, 5), (3, 6, 7)], ids=["one_skip", "skips_until_the_fragment_syncs_again"])
def test_sync_launched_late_after_a_skipped_step(kind, tau, skip):
    """A sync step whose optimizer.step() is skipped still launches (before the next forward),
    overlapped, and is applied after the following step; a fragment whose correction is still
    in flight when it syncs again gets it applied first."""
    cfg = dict(period=4, fragments=2, tau=tau, **OPTIONS["outer_bf16"])
    got, want, engine = _run(kind, cfg, steps=10, skip=skip)
    for g, w in zip(got, want):
        _assert_close(g, w, "parameter")
    assert not engine.in_flight and engine.due is None


@pytest.mark.parametrize("kind", ["replicated", "sharded"])
@pytest.mark.parametrize("save_at", [2, 4, 6])
def test_checkpoint_with_corrections_in_flight_resumes_bitwise(kind, save_at):
    cfg = dict(period=4, fragments=2, tau=2, **OPTIONS["outer_bf16"])
    straight, _, _ = _run(kind, cfg, steps=10)
    resumed, _, _ = _run(kind, cfg, steps=10, save_at=save_at)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_fragments_follow_the_models_parameter_order(kind):
    """Whole parameters of about equal bytes, packed in ``model.parameters()`` order where the
    state knows the model (registry order otherwise): both front-ends get the same fragments."""
    engine = _engine(kind, dict(period=4, fragments=2, tau=1), _params())
    in_registry_order = fragment_layout([4 * n for n in SIZES], 2)
    assert engine.layout() == in_registry_order
    model_index = list(reversed(range(len(SIZES))))  # DDP registers the last layers first
    engine = _engine(kind, dict(period=4, fragments=2, tau=1), _params())
    engine.model_positions = lambda: model_index
    packed = fragment_layout([4 * n for n in reversed(SIZES)], 2)  # in model order
    assert engine.layout() == [sorted(model_index[j] for j in f) for f in packed]


def test_sync_sends_only_the_due_fragments():
    params = _params()
    engine = _engine("replicated", dict(period=4, fragments=4, tau=1), params)
    engine.capture_anchor()
    engine.mark_due(0)  # fragment 0 syncs after step 0
    engine.after_step(1)
    sent = engine.averager.comm.sent
    assert sent == [sum(SIZES[i] for i in engine.layout()[0])]
    assert [c.fragment for c in engine.in_flight] == [0] and engine.in_flight[0].apply_at == 2


def test_host_buffers_stay_while_syncs_follow_each_other_and_go_after_a_step_without_one():
    """The snapshot buffer is reused from one overlapped sync to the next (no new allocation to
    fault in), the two fragments of different sizes taking turns in one buffer, and freed by
    the first step after which nothing syncs."""
    engine = _engine("replicated", dict(period=2, fragments=2, tau=1), _params())
    pool = engine.averager._pool
    engine.capture_anchor()
    kept = []
    for s in range(4):  # a fragment syncs after every step
        engine.mark_due(s)
        engine.after_step(s + 1)
        assert len(pool._free) == 1, f"step {s}: the snapshot given back stays for the next sync"
        kept.append(pool._free[0].untyped_storage().data_ptr())
    assert len(set(kept[1:])) == 1, "from the larger fragment's first sync on, one buffer serves both"
    engine.idle()
    assert not pool._free, "a step after which nothing syncs frees the idle buffers"
