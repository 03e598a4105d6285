"""What a bench rank runs for the FSDP2 rows (``python -m hiersync bench --fsdp``).

:mod:`.bench_worker` calls :func:`run_one` (timed rows) and :func:`memory_one` (the memory
pass) for the schedules :mod:`.bench_spec` names. Each row shards a fresh copy of the
bench's seeded MLP with ``fully_shard``: every layer is one FSDP unit, then the root. The
step loop, the link counter and the probes are the DDP rows' (:func:`.bench_steps.train`),
so the numbers compare one to one. A row's record adds ``shard_bytes``: the fp32 bytes of
this rank's own parameter shard (the largest over the ranks goes into the row).

The phase probe's "last gradient" is FSDP2's post-accumulate-grad hook on the sharded
parameter, which runs after the unit's reduce-scatter (and HSDP's all-reduce across
nodes): in FSDP2 rows ``bwd`` holds the collectives FSDP2 runs inside backward, and ``comm``
what is exposed after them (hiersync's sync after ``optimizer.step()``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .bench_probes import MemoryProbe, PhaseProbe
from .bench_spec import PERIODIC, ScheduleSpec, memory_steps
from .bench_steps import Method, Where, base_record, fresh_model, teardown, train

__all__ = ["is_fsdp", "run_one", "memory_one", "shard_model"]

logger = logging.getLogger(__name__)

_MESHES: dict[str, Any] = {}
"""This process's meshes, built once (each build creates process groups, collectively)."""


def is_fsdp(spec: ScheduleSpec) -> bool:
    return spec.kind.startswith("fsdp_")


def _mesh(kind: str) -> Any:
    """The node's 1-D mesh (hiersync, intra-only) or the (node, local) mesh of HSDP. Collective on first use."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    import hiersync

    which = "hsdp" if kind == "fsdp_hsdp" else "node"
    if which not in _MESHES:
        if which == "node":
            _MESHES[which] = hiersync.node_mesh("cpu")
        else:
            grid = torch.tensor([list(n) for n in hiersync.Topology.detect().nodes], dtype=torch.int)
            _MESHES[which] = DeviceMesh("cpu", grid, mesh_dim_names=("node", "local"))
    return _MESHES[which]


def shard_model(model: Any, mesh: Any) -> Any:
    """``fully_shard`` every layer with parameters (one FSDP unit each), then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.children():
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _shard_bytes(model: Any) -> int:
    return sum(4 * (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def _build(config: dict, spec: ScheduleSpec, model: Any) -> tuple[Any, Any, PhaseProbe, Method]:
    import torch

    import hiersync

    model = shard_model(model, _mesh(spec.kind))
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]), momentum=0.9)
    probe = PhaseProbe(model, opt)  # before hiersync's step hook: what runs after it is the sync
    method = Method()
    if spec.kind == "fsdp_hiersync":
        try:
            method.state = hiersync.register(
                model, opt, **spec.hiersync_options(), **config.get("hiersync_options", {})
            )
        except TypeError:
            probe.remove()
            raise
    return model, opt, probe, method


def run_one(config: dict, model_name: str, compute: str, spec: ScheduleSpec, bucket_mb: float, where: Where) -> dict:
    """One timed FSDP2 row on this rank (collective): the record :func:`.bench_rows.summarize` reads."""
    if model_name != "mlp":
        raise ValueError(f"the FSDP2 rows shard the mlp, not {model_name!r}: run them with --models mlp")
    started = time.perf_counter()
    model, data_fn, loss_fn = fresh_model(model_name, config, compute)
    base = base_record(config, model_name, compute, spec, bucket_mb, where.nodes, model)
    model, opt, probe, method = _build(config, spec, model)
    record: dict[str, Any] = {"setup_s": time.perf_counter() - started, "shard_bytes": _shard_bytes(model)}
    label = f"{model_name} {compute} {spec.name}"
    record.update(train(config, spec, model, opt, data_fn, loss_fn, probe, method, where, label, compute))
    teardown(method, probe)
    record["run_s"] = time.perf_counter() - started
    return {**base, **record}


def memory_one(
    config: dict, model_name: str, compute: str, spec: ScheduleSpec, bucket_mb: float, where: Where
) -> float | None:
    """This rank's peak memory over ``warmup + 2k`` steps of an FSDP2 row (MB above its start)."""
    fresh_model(model_name, config, compute)  # the template exists before the window opens
    _mesh(spec.kind)  # and the meshes' groups
    if not _WARM:
        # FSDP2's first run in a process initializes what every later one reuses (13-15 MB per rank
        # with a 20k-parameter MLP): one unmeasured step, so no row is charged for it.
        _WARM.append(True)
        _steps(config, spec, model_name, compute, 1, None)
    memory = MemoryProbe()
    memory.start()
    _steps(config, spec, model_name, compute, memory_steps(spec, int(config["warmup"])), where.progress)
    return memory.peak_mb()


_WARM: list[bool] = []


def _steps(config: dict, spec: ScheduleSpec, model_name: str, compute: str, n: int, progress: str | None) -> None:
    """``n`` steps of a fresh FSDP2 row, drained and torn down (collective)."""
    import torch
    import torch.distributed as dist

    model, data_fn, loss_fn = fresh_model(model_name, config, compute)
    model, opt, probe, method = _build(config, spec, model)
    gen = torch.Generator().manual_seed(int(config["seed"]) * 1000 + dist.get_rank())
    k = spec.period if spec.kind in PERIODIC else 1
    for _ in range(n):
        x, y = data_fn(0, gen)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if progress:
            with open(progress, "a") as f:
                f.write(f"{model_name} {compute} {spec.name} memory (k={k})\n")
    method.drain()
    dist.barrier()
    teardown(method, probe)
