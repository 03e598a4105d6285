"""The step's futures and the policy, without extra processes (a one-rank world, comm mocked).

A failed bucket is reported only once every bucket of the step is done; a failed input
never breaks a group's issue order; a skipped ``optimizer.step()`` (a GradScaler overflow)
still launches its sync step's average, before the next forward; a non-finite step leaves
the gradients for the scaler to see and the parameters untouched.
"""

from __future__ import annotations

import types

import pytest
import torch
from harness import world1  # noqa: F401 - a fixture
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync
from hiersync import HierState
from hiersync.futures import HierSyncError, Sequencer, completed, failed, wait, when_all
from hiersync.stats import Stats
from hiersync.transport import GroupRail

CPU = torch.device("cpu")


def _bucket(buf: torch.Tensor, last: bool, params=None):
    params = params if params is not None else [torch.zeros_like(buf)]
    return types.SimpleNamespace(buffer=lambda: buf, parameters=lambda: params, is_last=lambda: last, index=lambda: 0)


def _error_of(fut) -> str:
    with pytest.raises(Exception) as info:
        wait(fut)
    return str(info.value)


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_step_fails_only_after_every_bucket_is_done(world1, nonfinite):
    """The dead-peer race: one bucket failed while another still runs.

    A bucket reduced without error goes to DDP as soon as it is done ("skip"); with
    ``nonfinite="raise"`` the step decides first, so every bucket of the step fails.
    """
    state = HierState(period=1, nonfinite=nonfinite)
    running = torch.futures.Future()
    results = iter([running, failed(RuntimeError("Connection closed by peer"))])
    state.comm.allreduce = lambda buf: next(results)
    out0 = hiersync.hook(state, _bucket(torch.ones(4), last=False))
    out1 = hiersync.hook(state, _bucket(torch.ones(4), last=True))
    # torch.futures.collect_all failed at once here, and the running bucket was read
    # (".value() INTERNAL ASSERT FAILED ... please report a bug to PyTorch").
    assert not out0.done() and not out1.done()
    running.set_result(torch.ones(4))
    failing = [out1] if nonfinite == "skip" else [out0, out1]
    if nonfinite == "skip":
        assert torch.equal(wait(out0), torch.ones(4))
    for out in failing:
        text = _error_of(out)
        assert "hiersync" in text and "step 0" in text and "Connection closed by peer" in text, text
        assert "INTERNAL ASSERT" not in text, text


def test_sync_in_the_hook_writes_nothing_after_a_failed_step(world1):
    """The parameter average still in flight when the gradient leg failed never lands."""
    state = HierState(period=2)
    param = torch.nn.Parameter(torch.full((4,), 3.0))
    state.comm.intra_allreduce = lambda buf: completed(buf)
    wait(hiersync.hook(state, _bucket(torch.ones(4), True, [param])))  # step 0: local
    state.comm.intra_allreduce = lambda buf: failed(RuntimeError("peer died"))
    averaging = torch.futures.Future()
    state.engine.averager.transfer = lambda flat: averaging  # the engine's cross-node leg
    out = hiersync.hook(state, _bucket(torch.ones(4), True, [param]))  # step 1: sync
    assert not out.done()
    averaging.set_result(torch.zeros(4))
    assert "peer died" in _error_of(out)
    assert torch.equal(param.detach(), torch.full((4,), 3.0))


def test_sequencer_keeps_order_when_an_input_fails():
    seq, order = Sequencer(), []

    def launch(name):
        return lambda: (order.append(name), completed(name))[1]

    a_ready = torch.futures.Future()
    a = seq.submit(a_ready, launch("a"), CPU, "leg a")
    b = seq.submit(failed(RuntimeError("upstream")), launch("b"), CPU, "leg b")
    c = seq.submit(completed(None), launch("c"), CPU, "leg c")
    # before the fix, b was marked issued at once and c was launched ahead of a
    assert order == [] and not b.done() and not c.done()
    a_ready.set_result(None)
    assert order == ["a", "c"]
    assert wait(a) == "a" and wait(c) == "c"
    with pytest.raises(HierSyncError, match="hiersync leg b failed: RuntimeError: upstream"):
        wait(b)


def test_when_all_waits_for_every_source():
    slow, dead = torch.futures.Future(), failed(RuntimeError("boom"))
    joined = when_all([slow, dead], CPU, "two legs")
    assert not joined.done()
    slow.set_result(1)
    with pytest.raises(HierSyncError, match="hiersync two legs failed: RuntimeError: boom"):
        wait(joined)
    assert wait(when_all([completed(1), completed(2)], CPU, "ok")) == [1, 2]
    assert wait(when_all([], CPU, "none")) == []


# ---------------------------------------------------------------- policy with the comm mocked
class FakeComm:
    """Records what the policy asks for; every collective completes at once."""

    def __init__(self, target_scale: float = 0.5) -> None:
        self.topology = hiersync.Topology.from_node_ids([0])
        self.groups = types.SimpleNamespace(destroy=lambda: self.calls.append("destroy"))
        self.stats = Stats()
        self.rail = GroupRail(None, nodes=1)
        self.intra_algorithm = "allreduce_bcast"
        self.calls: list[str] = []
        self.target_scale = target_scale  # "the average across nodes" = this x the local value

    def intra_allreduce(self, t):
        self.calls.append("intra")
        return completed(t)

    def allreduce(self, t):
        self.calls.append("exact")
        return completed(t)

    flat_allreduce = allreduce

    def average_across_nodes(self, flat):
        self.calls.append("average")
        return completed(flat * self.target_scale)


def _setup(period: int, attach: bool = True, **options):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = FakeComm()
    state = HierState(period=period, comm=comm, **options)
    state._model = model
    model.register_comm_hook(state, hiersync.hook)
    if attach:
        state.attach_optimizer(opt)
    return model, opt, comm, state


def _backward(model, scale: float = 1.0):
    (model(torch.ones(2, 3)).sum() * scale).backward()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("attach", [True, False], ids=["after_optimizer_step", "in_the_hook"])
def test_schedule_drives_the_collectives(world1, attach):
    model, opt, comm, state = _setup(period=3, attach=attach, warmup_steps=1)
    idle = state.engine.idle
    state.engine.idle = lambda: (comm.calls.append("idle"), idle())  # frees host buffers no sync follows
    kinds = []
    for _ in range(5):  # exact, local, local, sync, local
        comm.calls.clear()
        _backward(model)
        in_backward = list(comm.calls)
        opt.step()
        opt.zero_grad()
        kinds.append((in_backward, comm.calls[len(in_backward) :]))
    assert kinds == [
        (["exact"], []),
        (["intra", "idle"], []),
        (["intra", "idle"], []),
        # blocking after optimizer.step(), not inside backward; without an optimizer, launched in
        # the hook, and then nothing syncs after the step
        (["intra"], ["average"]) if attach else (["intra", "average", "idle"], []),
        (["intra", "idle"], []),
    ]
    assert state.stats.sync_steps == 1 and state.stats.recent_sync_steps[-1] == 3


def test_skipped_optimizer_step_still_syncs_before_next_forward(world1):
    """A node whose GradScaler skips optimizer.step() at a sync step keeps collective order."""
    model, opt, comm, state = _setup(period=2)
    _backward(model)
    opt.step()
    opt.zero_grad()
    _backward(model)  # step 1: sync; the scaler finds an overflow and skips opt.step()
    before = _params(model)
    opt.zero_grad()
    assert "average" not in comm.calls
    out = model(torch.ones(2, 3))  # the next forward launches the owed average first
    assert comm.calls[-1] == "average"
    assert [torch.equal(p, q) for p, q in zip(_params(model), before)] == [True, True]  # deferred
    out.sum().backward()
    opt.step()  # then the correction (target - snapshot = -0.5 x snapshot) is applied
    grads_step = [q - 0.1 * p.grad for p, q in zip(model.parameters(), before)]
    for p, g, snap in zip(model.parameters(), grads_step, before):
        torch.testing.assert_close(p.detach(), g - 0.5 * snap)
    assert comm.calls.count("average") == 1 and not state.engine.in_flight


def test_nonfinite_gradient_reaches_the_scaler_and_skips_the_update(world1):
    model, opt, _comm, state = _setup(period=1)
    before = _params(model)
    _backward(model, scale=float("inf"))
    grads = [p.grad for p in model.parameters()]
    assert not all(bool(torch.isfinite(g).all()) for g in grads)  # left for a GradScaler to see
    opt.step()  # no scaler: hiersync drops the grads, so SGD leaves the parameters alone
    assert [torch.equal(p, q) for p, q in zip(_params(model), before)] == [True, True]
    assert state.stats.nonfinite_skips == 1
    opt.zero_grad()
    _backward(model)
    opt.step()
    assert state.stats.nonfinite_skips == 1 and not torch.equal(_params(model)[0], before[0])


def test_nonfinite_without_attached_optimizer_is_skipped_too(world1):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = HierState(period=1, comm=FakeComm())
    model.register_comm_hook(state, hiersync.hook)
    before = _params(model)
    _backward(model, scale=float("nan"))
    opt.step()
    assert [torch.equal(p, q) for p, q in zip(_params(model), before)] == [True, True]
    assert state.stats.nonfinite_skips == 1
    state.close()


def test_close_releases_hooks_and_groups(world1):
    model, opt, comm, state = _setup(period=2)
    _backward(model)
    opt.step()
    _backward(model)  # sync step: the forward pre-hook is armed until optimizer.step()
    with state:
        pass
    assert comm.calls[-1] == "destroy" and state._skip_hook is None and not state._handles
    opt.step()  # no hiersync hook runs any more
    assert "average" not in comm.calls
    with pytest.raises(RuntimeError, match="was closed"):
        _backward(model)


def test_closed_state_keeps_no_model_alive(world1):
    """DDP holds its hook's state as long as it lives: a closed state must not hold the model."""
    import gc
    import weakref

    model, opt, _comm, state = _setup(period=2, compress="bf16")
    _backward(model)
    opt.step()
    probe = weakref.ref(next(model.parameters()))
    state.close()
    del model, opt
    gc.collect()
    assert probe() is None, "the closed HierState still references the model's parameters"


def test_sharded_state_dict_is_a_snapshot():
    """Anchor and momentum shards are updated in place by later syncs: what state() returned,
    and what load() was given, must not change with them."""
    from hiersync.averagers import ReplicatedNodeAverager
    from hiersync.localsgd import Registry

    comm = types.SimpleNamespace(
        topology=hiersync.Topology.from_node_ids([0, 0, 1, 1]),
        groups=types.SimpleNamespace(node_size=2, local_rank=0),
        average_shard=lambda t: completed(t),
        rail=GroupRail(None, nodes=2),
        weighting=None,
    )
    registry = Registry()
    params = [torch.nn.Parameter(torch.arange(6.0))]
    registry.register(params)
    avg = ReplicatedNodeAverager(comm, registry, outer_lr=0.7, outer_momentum=0.9)
    avg.capture(lambda: [[0]])
    with torch.no_grad():
        params[0].add_(1.0)
    avg.complete(avg.launch([0]))  # creates the momentum shard, moves the anchor
    state = avg.state()
    saved = state["chunks"][0]
    anchor, momentum = saved["anchor"].clone(), saved["momentum"].clone()
    avg.complete(avg.launch([0]))  # updates both in place
    assert torch.equal(saved["anchor"], anchor) and torch.equal(saved["momentum"], momentum)
    given = dict(state, chunks=[dict(saved, indices=[0])])
    avg.load(given)
    avg.complete(avg.launch([0]))
    assert torch.equal(given["chunks"][0]["anchor"], anchor), "load() must not alias the caller's tensors"
