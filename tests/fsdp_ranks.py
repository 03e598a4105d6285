"""Functions every rank runs for the FSDP2 front-end's tests (module level, so importable).

Each run trains hiersync over an FSDP2 model next to a reference on the same data and the
same initial weights, and compares after every step: FSDP2's own HSDP on a (node, local)
mesh for exact steps, hiersync's DDP front-end for period k (same layout of fragments).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from ranks import batch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync
from hiersync.quant import codec_for
from hiersync.vocab import COMPRESS_CODES


class Blocks(torch.nn.Module):
    """Three blocks and a head: each one FSDP unit (the head may stay in the root's); 8 parameters."""

    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Linear(8, width), torch.nn.Linear(width, width), torch.nn.Linear(width, width)]
        )
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _options(cfg: dict) -> dict:
    outer = cfg.get("outer")
    return dict(
        period=cfg["period"],
        warmup_steps=cfg.get("warmup", 0),
        overlap=cfg.get("tau", 0),
        fragments=cfg.get("fragments", 1),
        compress=cfg.get("compress"),
        outer_lr=outer[0] if outer else None,
        outer_momentum=outer[1] if outer else 0.0,
        state_device=cfg.get("state_device"),
        average_optimizer_state=cfg.get("average_optimizer_state", ()),
        rack_period=cfg.get("rack_period"),
    )


def _shard(model: torch.nn.Module, mesh, root_params: bool = False) -> torch.nn.Module:
    """Each block and the head one unit; ``root_params``: the head stays in the root unit."""
    for m in [*model.blocks] + ([] if root_params else [model.head]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _full(model: torch.nn.Module) -> torch.Tensor:
    """The whole parameters, flat (all-gathered inside the node for a sharded model)."""
    parts = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return torch.cat([t.reshape(-1) for t in parts])


def fsdp_check(cfg: dict) -> dict:
    """hiersync over FSDP2 against ``cfg["reference"]``: "hsdp" (FSDP2's own HSDP) or "ddp"
    (hiersync's DDP front-end with the same options), compared after every step."""
    steps = cfg["steps"]
    if "racks" in cfg:
        os.environ["HIERSYNC_RACK_IDS"] = ",".join(map(str, cfg["racks"]))
    mesh = hiersync.node_mesh()
    torch.manual_seed(0)
    base = Blocks()
    model = _shard(copy.deepcopy(base), mesh, root_params=cfg.get("eval_before_sync", False))
    opt = _optimizer(model.parameters())
    state = hiersync.register(model, opt, **_options(cfg))
    if cfg["reference"] == "hsdp":
        from torch.distributed.device_mesh import DeviceMesh

        topo = hiersync.Topology.detect()
        grid = torch.tensor([list(n) for n in topo.nodes])
        ref = _shard(copy.deepcopy(base), DeviceMesh("cpu", grid, mesh_dim_names=("node", "local")))
    else:
        ref = DDP(copy.deepcopy(base))
        ref_state = hiersync.register(ref, _optimizer(ref.parameters()), **_options(cfg))
    ref_opt = ref_state._optimizer if cfg["reference"] == "ddp" else _optimizer(ref.parameters())
    worst = 0.0
    nodes_differed = False
    # int8/int4: the codes' blocks follow each front-end's own shards (FSDP's per-parameter rows,
    # the DDP front-end's flat split), so the two round differently: each side is within a few
    # code steps of the exact average (error feedback carries the rest), and so is their gap.
    compress = cfg.get("compress")
    qmax = codec_for(compress).qmax if compress in COMPRESS_CODES else None
    seen, max_move = [], 0.0
    for step in range(steps):
        _step(model, opt, step)
        _step(ref, ref_opt, step)
        mine, theirs = _full(model), _full(ref)
        worst = max(worst, float((mine - theirs).abs().max()))
        if qmax:
            seen = [*seen[-cfg["period"] :], theirs]
            max_move = max(max_move, *(float((theirs - s).abs().max()) for s in seen))
            bound = 4 * max_move / qmax + 1e-6  # measured: about one step
            assert float((mine - theirs).abs().max()) <= bound, (step, worst, max_move)
        else:
            torch.testing.assert_close(
                mine,
                theirs,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, step=step: f"step {step} ({state.schedule.kind(step)}): {m}",
            )
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        nodes_differed |= any(not torch.equal(e, mine) for e in everyone)
    stats = state.stats.as_dict()
    in_flight = len(state.engine.in_flight)
    if cfg["reference"] == "hsdp":
        want = _full(model)
        dist.all_reduce(want)
        want /= dist.get_world_size()
    if cfg.get("eval_before_sync"):  # leaves the root unit (the head) unsharded: reshard_after_forward=False
        with torch.no_grad():
            model(batch(steps)[0])
    state.synchronize(model)  # with corrections still in flight
    for m in model.modules():  # the shards, not a copy FSDP2 may still hold unsharded
        if hiersync.fsdp.is_fsdp2(m):
            m.reshard()
    after = _full(model)
    if cfg["reference"] == "ddp":
        ref_state.synchronize(ref)
        want = _full(ref)
    if qmax:  # each front-end rounds its own blocks (see above)
        assert float((after - want).abs().max()) <= 4 * max_move / qmax + 1e-6
    else:
        torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-6)
    everyone = [torch.empty_like(after) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, after)
    return {
        "stats": stats,
        "worst": worst,
        "max_move": max_move,
        "nodes_differed": nodes_differed,
        "in_flight_at_synchronize": in_flight,
        "synchronized": all(torch.equal(e, after) for e in everyone),
        "layout": state.engine.layout(),
        "reference_layout": _layout_by_name(ref_state, ref) if cfg["reference"] == "ddp" else None,
        "fsdp_layout": _layout_by_name(state, model),
    }


def _layout_by_name(state, model: torch.nn.Module) -> list[list[str]]:
    """Each fragment's parameter names (the two front-ends number their parameters differently)."""
    name = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    return [sorted(name[id(state.registry.params[i])] for i in f) for f in state.engine.layout()]


def fsdp_checkpoint_run(cfg: dict, phase: str, folder: str, n: int) -> list:
    """'straight': 2n steps. 'first': n steps, then each rank saves its own model and optimizer
    shards and hiersync's state. 'resume': load them in new processes, n more steps.

    Per rank, not torch.distributed.checkpoint over the world: between syncs the nodes hold
    different values under the same names, which a world-wide checkpoint keeps once.
    """
    torch.manual_seed(0)
    model = _shard(Blocks(), hiersync.node_mesh())
    opt = _optimizer(model.parameters())
    state = hiersync.register(model, opt, **_options(cfg))
    path = os.path.join(folder, f"ckpt-rank{dist.get_rank()}.pt")
    if phase == "straight":
        for step in range(2 * n):
            _step(model, opt, step)
    elif phase == "first":
        for step in range(n):
            _step(model, opt, step)
        hier = state.state_dict()  # first: it finishes the syncs in flight (a correction stays to apply)
        assert hier["in_flight"] or not cfg.get("tau"), "the checkpoint should hold a correction in flight"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hiersync": hier}, path)
    else:
        ckpt = torch.load(path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        state.load_state_dict(ckpt["hiersync"])
        for step in range(n, 2 * n):
            _step(model, opt, step)
    return _full(model).tolist()


def fsdp_portable_checkpoint(folder: str) -> dict:
    """After synchronize(), torch.distributed.checkpoint saves one portable copy of the parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(0)
    model = _shard(Blocks(), hiersync.node_mesh())
    opt = _optimizer(model.parameters())
    state = hiersync.register(model, opt, period=4, fragments=2, overlap=1)
    for step in range(5):
        _step(model, opt, step)
    state.synchronize(model)
    saved = _full(model)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(folder, "dcp"))
    torch.manual_seed(1)
    fresh = _shard(Blocks(), hiersync.node_mesh())
    loaded = {"model": get_model_state_dict(fresh)}
    dcp.load(loaded, checkpoint_id=os.path.join(folder, "dcp"))
    set_model_state_dict(fresh, loaded["model"])
    return {"equal": torch.equal(_full(fresh), saved)}


def fsdp_bad_setup(case: str) -> str:
    """The error a wrong set-up raises (every rank), as text."""
    torch.manual_seed(0)
    model = Blocks()
    try:
        if case == "world_mesh":
            _shard(model, None)  # the default mesh: the whole world, not the node
            hiersync.register(model, _optimizer(model.parameters()), period=2)
        elif case == "uneven_node_mesh":
            hiersync.node_mesh()
        elif case == "uneven_register":
            _shard(model, None)
            hiersync.register(model, _optimizer(model.parameters()), period=2)
        elif case == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
            hiersync.register(wrapped, _optimizer(wrapped.parameters()), period=2)
        elif case == "no_optimizer":
            _shard(model, hiersync.node_mesh())
            hiersync.register(model, None, period=2)
        elif case == "too_many_fragments":
            _shard(model, hiersync.node_mesh())
            state = hiersync.register(model, _optimizer(model.parameters()), period=9, fragments=9)
            state.engine.layout()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def fsdp_scaler_overflow(inject: list[int], steps: int) -> dict:
    """torch's ShardedGradScaler over FSDP2 with hiersync (blocking, period 2): an overflow on
    one rank at ``inject`` steps makes every rank skip optimizer.step() (the scaler agrees over
    the world); the skipped sync step's average still runs, before the next forward."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = _shard(Blocks(), hiersync.node_mesh())
    opt = _optimizer(model.parameters())
    state = hiersync.register(model, opt, period=2)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10)
    scales, identical_after_sync = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step in inject and dist.get_rank() == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if state.schedule.kind(step) == "sync" and step not in inject:
            mine = _full(model)
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            identical_after_sync.append(all(torch.equal(e, mine) for e in everyone))
    state.drain()
    return {
        "scales": scales,
        "identical_after_sync": identical_after_sync,
        "finite": bool(torch.isfinite(_full(model)).all()),
        "stats": state.stats.as_dict(),
    }


def fsdp_nonfinite(policy: str) -> dict:
    """A NaN gradient on one rank (no scaler): the node skips the update on every one of its
    ranks (one verdict per node, its ranks hold different shards), or raises."""
    torch.manual_seed(0)
    model = _shard(Blocks(), hiersync.node_mesh())
    opt = _optimizer(model.parameters())
    state = hiersync.register(model, opt, period=2, nonfinite=policy)
    before = _full(model)
    x, y = batch(0)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if dist.get_rank() == 0:
        loss = loss * float("nan")
    try:
        loss.backward()
    except RuntimeError as e:
        return {"raised": str(e)}
    opt.step()
    opt.zero_grad()
    return {"unchanged": torch.equal(_full(model), before), "skips": state.stats.nonfinite_skips}
