"""Every bad input gets a clear ValueError/TypeError/RuntimeError naming the value and the fix.

These run in-process on a one-rank gloo group (no extra processes needed).
"""

from __future__ import annotations

import datetime
import types

import pytest
import torch
import torch.distributed as dist
from harness import world1  # noqa: F401 - a fixture
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync
from hiersync import HierState
from hiersync._io import atomic_save, atomic_write_json


def _model(width: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 2))


def _step(ddp, opt=None) -> None:
    ddp(torch.randn(5, 3)).sum().backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(period=0), ValueError, "period must be >= 1.*got 0"),
        (dict(period=-3), ValueError, "got -3"),
        (dict(period=2.5), TypeError, r"period must be an int >= 1, got 2.5"),
        (dict(period="4"), TypeError, r"got '4'"),
        (dict(period=True), TypeError, "got True"),
        (dict(warmup_steps=-1), ValueError, "warmup_steps must be >= 0, got -1"),
        (dict(warmup_steps=1.0), TypeError, "warmup_steps must be an int"),
        (dict(compress="int2"), ValueError, r"compress='int2' is not supported; use one of"),
        (dict(period=2, average_optimizer_state="exp_avg"), TypeError, r"must be a tuple of names.*\('exp_avg',\)"),
        (dict(period=2, average_optimizer_state=("exp_avg", "exp_avg")), ValueError, "give distinct state names"),
        (dict(average_optimizer_state=("exp_avg",)), ValueError, "needs period >= 2"),
        (dict(algorithm="ring"), ValueError, r"algorithm='ring' is not supported"),
        (dict(nonfinite="zero"), ValueError, r"nonfinite='zero' is not supported"),
        (dict(period=1, overlap=True), ValueError, "overlap=True needs period >= 2"),
        (dict(overlap="yes"), TypeError, "overlap must be a bool or an int"),
        (dict(period=4, overlap=4), ValueError, r"overlap=4 must be between 1 and period - 1 = 3"),
        (dict(period=4, overlap=-1), ValueError, r"overlap=-1 must be between 1 and period - 1"),
        (dict(period=4, fragments=0), ValueError, r"fragments must be an int >= 1"),
        (dict(period=1, fragments=2), ValueError, r"fragments=2 needs period >= 2"),
        (dict(outer_lr=-0.7), ValueError, "outer_lr must be a positive number"),
        (dict(outer_lr=0.7, outer_momentum=1.5), ValueError, r"outer_momentum must be in \[0, 1\), got 1.5"),
        (dict(outer_momentum=0.9), ValueError, "outer_momentum=0.9 needs outer_lr"),
        (dict(outer_optimizer="adam"), TypeError, r"outer_optimizer must be a factory params -> torch.optim"),
        (dict(period=2, outer_optimizer=lambda ps: None), TypeError, "outer_optimizer must return a torch.optim"),
        (
            dict(outer_lr=0.7, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7)),
            ValueError,
            "outer_optimizer and outer_lr=0.7 are two outer steps",
        ),
        (dict(timeout=-1), ValueError, "timeout must be > 0 seconds, got -1"),
        (dict(timeout="5s"), TypeError, "timeout must be a timedelta or seconds"),
        (dict(chunk_mb=0), ValueError, "chunk_mb must be > 0"),
        (dict(state_device="cuda:1"), ValueError, r"state_device=.cuda:1. is not supported"),
        (dict(topology=[0, 0]), TypeError, "topology must be a hiersync.Topology"),
    ],
)
def test_bad_options(world1, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        HierState(**kwargs)


def test_process_group_not_initialized():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group\(\)"):
        HierState(period=2)


@pytest.mark.parametrize(
    "env, match",
    [("0,x", r"entry 1 \('x'\) is not an integer"), ("0,0", "has 2 entries but the world has 1 ranks")],
)
def test_bad_node_ids_env(world1, monkeypatch, env, match):
    monkeypatch.setenv("HIERSYNC_NODE_IDS", env)
    with pytest.raises(ValueError, match=match):
        HierState()


def test_overlap_without_attached_optimizer(world1):
    ddp = DDP(_model())
    ddp.register_comm_hook(HierState(period=2, overlap=True), hiersync.hook)
    with pytest.raises(ValueError, match=r"overlap=1, fragments=1\) needs an optimizer: .*call state.attach_optimizer"):
        _step(ddp)


def test_streaming_without_attached_optimizer(world1):
    # streaming runs after optimizer.step(): a HierState syncing in the hook cannot stream, and says so
    ddp = DDP(_model())
    ddp.register_comm_hook(HierState(period=2, fragments=2), hiersync.hook)
    with pytest.raises(ValueError, match=r"fragments=2\) needs an optimizer: the sync runs after optimizer.step"):
        _step(ddp)


def test_state_from_a_dead_process_group(world1, tmp_path):
    ddp = DDP(_model())
    ddp.register_comm_hook(HierState(period=2), hiersync.hook)
    _step(ddp)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store2"), 1), rank=0, world_size=1)
    with pytest.raises(RuntimeError, match=r"built for another process group.*Build a new HierState"):
        _step(ddp)


def test_hook_needs_a_hierstate(world1):
    ddp = DDP(_model())
    ddp.register_comm_hook(object(), hiersync.hook)
    with pytest.raises(TypeError, match=r"hiersync.hook needs a hiersync.HierState as its state, got object"):
        _step(ddp)


def test_register_needs_ddp(world1):
    with pytest.raises(
        TypeError, match=r"needs a DistributedDataParallel model or an FSDP2 module \(fully_shard\), got Sequential"
    ):
        hiersync.register(_model())


def _fake_bucket(buffer, params):
    return types.SimpleNamespace(
        buffer=lambda: buffer, parameters=lambda: params, is_last=lambda: True, index=lambda: 0
    )


def test_non_float_bucket_with_compression(world1):
    state = HierState(period=2, compress="bf16")
    with pytest.raises(TypeError, match=r"compress='bf16' needs floating-point gradients, got a torch.int32 bucket"):
        hiersync.hook(state, _fake_bucket(torch.zeros(4, dtype=torch.int32), [torch.zeros(4)]))


def test_parameters_on_mixed_devices(world1):
    state = HierState(period=2)
    params = [torch.zeros(2), torch.zeros(2, device="meta")]
    with pytest.raises(RuntimeError, match=r"on several devices \['cpu', 'meta'\].*model.to\(device\)"):
        hiersync.hook(state, _fake_bucket(torch.zeros(4), params))


def test_attach_optimizer_that_does_not_own_the_model(world1):
    ddp = DDP(_model())
    foreign = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not own 4 of the model's parameters"):
        hiersync.register(ddp, foreign, period=2)


def test_attach_optimizer_without_model_is_checked_at_first_step(world1):
    ddp = DDP(_model())
    state = HierState(period=2)
    ddp.register_comm_hook(state, hiersync.hook)
    foreign = torch.optim.SGD(_model().parameters(), lr=0.1)
    state.attach_optimizer(foreign)
    with pytest.raises(ValueError, match="does not own"):
        _step(ddp, foreign)


def test_attach_optimizer_bad_calls(world1):
    state = HierState(period=2)
    with pytest.raises(TypeError, match=r"needs a torch.optim.Optimizer, got list"):
        state.attach_optimizer([])
    state.attach_optimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="already attached"):
        state.attach_optimizer(torch.optim.SGD(_model().parameters(), lr=0.1))


def _trained_state(width: int, steps: int = 3, **options):
    ddp = DDP(_model(width))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = hiersync.register(ddp, opt, period=2, **options)
    for _ in range(steps):
        _step(ddp, opt)
    return state, ddp, opt


def test_average_optimizer_state_names_what_the_optimizer_has(world1):
    ddp = DDP(_model(4))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    hiersync.register(ddp, opt, period=2, average_optimizer_state=("exp_avg",))
    _step(ddp, opt)
    with pytest.raises(
        ValueError, match=r"SGD's state has no tensor 'exp_avg' per parameter \(it has \['momentum_buffer'\]\)"
    ):
        _step(ddp, opt)  # step 1 syncs


def test_load_state_dict_rejects_garbage(world1):
    state, _, _ = _trained_state(4)
    with pytest.raises(ValueError, match="not a hiersync HierState state_dict"):
        state.load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="not a hiersync HierState state_dict"):
        state.load_state_dict([1, 2])
    sd = state.state_dict()
    del sd["averager"]
    with pytest.raises(ValueError, match=r"corrupt hiersync state_dict: missing keys \['averager'\]"):
        state.load_state_dict(sd)
    sd = state.state_dict()
    sd["step"] = -2
    with pytest.raises(ValueError, match="step=-2"):
        state.load_state_dict(sd)


def test_load_state_dict_wrong_world_size(world1):
    state, _, _ = _trained_state(4)
    sd = state.state_dict()
    sd["world_size"] = 8
    with pytest.raises(ValueError, match="saved with world size 8 but this job has 1"):
        state.load_state_dict(sd)


def test_load_state_dict_wrong_parameter_shapes(world1):
    saved = _trained_state(4, compress="bf16")[0].state_dict()
    other, _, _ = _trained_state(6, compress="bf16")
    with pytest.raises(ValueError, match="do not match this model's"):
        other.load_state_dict(saved)


def test_load_state_dict_wrong_shapes_before_first_step(world1):
    """The documented order (load before the first backward) is checked at load time."""
    saved = _trained_state(4, compress="bf16")[0].state_dict()
    ddp = DDP(_model(6))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = hiersync.register(ddp, opt, period=2, compress="bf16")
    with pytest.raises(ValueError, match=r"do not match this model's .* the checkpoint is from a different model"):
        state.load_state_dict(saved)
    assert state.step == 0 and not state.engine.in_flight  # a failed load changes nothing
    _step(ddp, opt)  # and training goes on


def test_load_state_dict_wrong_shapes_bare_hook_checked_at_first_step(world1):
    """Without register() the state does not know the model: the first backward checks."""
    saved = _trained_state(4, compress="bf16")[0].state_dict()
    ddp = DDP(_model(6))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = HierState(period=2, compress="bf16")
    ddp.register_comm_hook(state, hiersync.hook)
    state.attach_optimizer(opt)
    state.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"the checkpoint is from a different model"):
        _step(ddp, opt)


def test_synchronize_right_after_load_state_dict(world1):
    """A restart that loads a checkpoint with corrections in flight, then synchronizes."""
    state, ddp, _opt = _trained_state(4, steps=2, overlap=True)  # step 1 synced, its correction in flight
    sd = state.state_dict()
    assert len(sd["in_flight"]) == 1
    expected = [p.detach().clone() + c for p, c in zip(ddp.parameters(), _split(sd, ddp))]
    fresh = DDP(_model(4))
    with torch.no_grad():
        for p, q in zip(fresh.parameters(), ddp.parameters()):
            p.copy_(q)
    state2 = hiersync.register(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), period=2, overlap=True)
    state2.load_state_dict(sd)
    state2.synchronize(fresh)  # applies the correction (world of 1: the mean is itself)
    for p, e in zip(fresh.parameters(), expected):
        torch.testing.assert_close(p, e, rtol=0, atol=0)
    assert not state2.engine.in_flight


def _split(sd, ddp):
    """The saved flat correction, cut into per-parameter tensors in model.parameters() order."""
    params = list(ddp.parameters())
    order = sd["model_positions"]
    flat = sd["in_flight"][0]["correction"]
    assert sd["in_flight"][0]["indices"] == list(range(len(order)))
    out = [None] * len(params)
    offset = 0
    for j in order:
        n = params[j].numel()
        out[j] = flat[offset : offset + n].view(params[j].shape)
        offset += n
    return out


def test_corrections_that_do_not_fit_are_kept(world1):
    state, _ddp, _opt = _trained_state(4, steps=2, overlap=True)
    sd = state.state_dict()
    sd["in_flight"][0]["indices"] = [0, 1, 2, 99]
    state.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"no position 99.*different model"):
        state.drain()
    assert len(state.engine.in_flight) == 1  # nothing dropped


def test_timeout_accepts_seconds_and_timedelta(world1):
    assert HierState(timeout=5).timeout == datetime.timedelta(seconds=5)
    assert HierState(timeout=datetime.timedelta(minutes=1)).timeout == datetime.timedelta(minutes=1)


def test_atomic_write_never_leaves_a_truncated_file(tmp_path):
    target = tmp_path / "profile.json"
    atomic_write_json(target, {"ok": 1})

    def half_then_crash(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write('{"trunc')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_save(target, half_then_crash)
    assert target.read_text().strip() == '{\n  "ok": 1\n}'
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no temp file left behind
    assert oct(target.stat().st_mode & 0o777) != oct(0o600)
