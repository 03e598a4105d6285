"""What every rank runs for ``python -m hiersync bench``: build a model, train it under each schedule, time it.

:func:`worker` is the target :func:`hiersync.tools.cluster.run_ranks` calls on every rank
(``"hiersync.tools.bench_worker:worker"``); its result goes to
:func:`hiersync.tools.bench_rows.summarize`. The models are :mod:`.bench_compute`'s, the
probes (phases, copies, link bytes, memory) :mod:`.bench_probes`', the torchft rows
:mod:`.bench_torchft`'s, the FSDP2 rows :mod:`.bench_fsdp`'s; the step loop they share is
:func:`.bench_steps.train`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from typing import Any

from . import bench_fsdp
from .bench_claims import rounds
from .bench_probes import (
    LinkCounter,
    MemoryProbe,
    PhaseProbe,
    cached_host_memory,
    copy_probe,
    exact_rss,
    host_reserve_mb,
    rss_mb,
)
from .bench_spec import PERIODIC, ScheduleSpec, memory_steps, parse_schedule, run_steps
from .bench_steps import Method, Where, base_record, fresh_model, teardown, train

__all__ = ["worker", "memory_worker", "ring_inter_bytes"]

logger = logging.getLogger(__name__)


def _noop_hook(state: object, bucket: Any):
    """Communicate nothing: what the step would cost on an infinitely fast network."""
    import torch

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _bf16_hook(state: object, bucket: Any):
    """PyTorch's own ``bf16_compress_hook``, called through a differently named function.

    DDP refuses to register a function *named* ``bf16_compress_hook`` unless CUDA and NCCL
    are present, but its body (cast to bf16, divide, all-reduce, cast back) runs on gloo.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)  # type: ignore[arg-type]  # state: None, as registered


def _fix_hook_annotations() -> None:
    # DDP compares the hook's annotations with the real classes; this module uses
    # postponed (string) annotations, so spell them out once torch is imported.
    import torch
    import torch.distributed as dist

    for hook in (_noop_hook, _bf16_hook):
        hook.__annotations__ = {
            "state": object,
            "bucket": dist.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }


# ---------------------------------------------------------------------------- worker
def worker(config: dict) -> dict:
    """Run every (model, schedule, bucket) of ``config`` on this rank; return its timings.

    Runs on every rank of an initialized gloo process group (under torchrun on the testbed,
    or the private launcher on loopback). Rank 0 appends one line per step to
    ``config["progress"]`` for the launcher's progress bar; the first rank of each node
    counts the bytes its node's link sent (on the testbed).
    """
    import torch.distributed as dist

    import hiersync

    _fix_hook_annotations()
    # every rank of the run may be on this machine (the testbed, loopback): share it
    cached_host_memory(host_reserve_mb(dist.get_world_size(), 4 * float(config.get("mlp_params", 25e6)) / 2**20))
    rank = dist.get_rank()
    topo = hiersync.Topology.detect()
    # Intra-node groups for PyTorch's post-local SGD (its default assumes one GPU per rank)
    # and for DDP inside torchft's replica groups.
    intra_group, _ = dist.new_subgroups_by_enumeration([list(n) for n in topo.nodes])
    progress = config.get("progress") if rank == 0 else None
    link = LinkCounter.for_testbed() if any(n[0] == rank for n in topo.nodes) else None
    out: dict[str, Any] = {"rank": rank, "nodes": [list(n) for n in topo.nodes], "runs": [], "counts_link": bool(link)}
    # a sync launch's copies: one shard of a bucket-sized fragment per rank
    out["copy_probe"] = copy_probe(int(max(config["buckets_mb"]) * 2**20) // max(len(n) for n in topo.nodes))
    # Repeats go round the whole sweep, so a burst of load on a shared machine hits
    # one run of every schedule rather than every run of one schedule; the rows a claim's
    # noise needs then go round again, alone, STEADY_ROUNDS - 1 times (rounds A B .. A B ..).
    for rep in range(int(config.get("repeat", 1))):
        for model_name in config["models"]:
            for bucket_mb in config["buckets_mb"]:
                for compute in config.get("compute", ["cpu"]):
                    if compute == "accel" and model_name != "mlp":
                        continue  # the accel model is an MLP (the command says so)
                    for schedule in rounds(config["schedules"], compute):
                        spec = parse_schedule(schedule)
                        where = Where(intra_group, topo.nodes, progress, link)
                        run_one = bench_fsdp.run_one if bench_fsdp.is_fsdp(spec) else _run_one
                        record = run_one(config, model_name, compute, spec, float(bucket_mb), where)
                        out["runs"].append({**record, "repeat": rep})
                        # DDP, its hook state and the optimizer's hooks form reference cycles:
                        # free this run's model, gradients and buffers before the next one builds its own.
                        gc.collect()
                        out["runs"][-1]["rss_mb_after"] = rss_mb()
    return out


def memory_worker(config: dict) -> list[dict]:
    """Each schedule's peak memory on this rank, in fresh ranks of their own (``--memory``).

    Every allocation of 64 KiB or more is its own mmap here (``mallopt``, before anything is
    allocated), so a freed tensor leaves the resident set at once and the peak resident
    memory of a run measures the memory it held (as ``benchmarks/memory.py`` does), not the
    allocator's reuse of earlier runs' memory; that makes allocations slower, hence ranks of
    their own, after the timed sweep. One compute model (accel where it ran: the memory does
    not depend on it), the first bucket size, ``warmup + 2k`` steps per schedule: every
    fragment's sync is launched and applied at least once.
    """
    exact_rss()
    import torch.distributed as dist

    import hiersync

    _fix_hook_annotations()
    topo = hiersync.Topology.detect()
    intra_group, _ = dist.new_subgroups_by_enumeration([list(n) for n in topo.nodes])
    progress = config.get("progress") if dist.get_rank() == 0 else None
    where = Where(intra_group, topo.nodes, progress, None)
    model_name = config["models"][0]
    computes = config.get("compute", ["cpu"])
    compute = "accel" if "accel" in computes and model_name == "mlp" else "cpu"
    bucket_mb = float(config["buckets_mb"][0])
    out = []
    for schedule in config["schedules"]:
        spec = parse_schedule(schedule)
        memory_one = bench_fsdp.memory_one if bench_fsdp.is_fsdp(spec) else _memory_one
        peak = memory_one(config, model_name, compute, spec, bucket_mb, where)
        out.append(
            {"model": model_name, "compute": compute, "bucket_mb": bucket_mb, "schedule": schedule, "peak_mb": peak}
        )
        gc.collect()
    return out


def ring_inter_bytes(nbytes: float, node_of_rank: Sequence[int]) -> float:
    """Bytes per rank that cross nodes in a ring all-reduce over the world in rank order.

    The bandwidth-optimal accounting of :mod:`hiersync.stats`: every rank sends
    ``2 (p - 1) / p * n`` bytes to its right neighbour, which counts when that neighbour is
    on another node; the result is the mean over ranks (a node's link traffic / its ranks).
    A model of DDP's flat all-reduce (gloo's default ring), not a measurement.
    """
    p = len(node_of_rank)
    if p <= 1:
        return 0.0
    crossing = sum(1 for r in range(p) if node_of_rank[r] != node_of_rank[(r + 1) % p])
    return 2.0 * (p - 1) / p * nbytes * crossing / p


def _attach(spec: ScheduleSpec, config: dict, ddp: Any, opt: Any, where: Where, num_params: int) -> Method:
    """Register ``spec``'s hook, averager, hiersync state or torchft algorithm on ``ddp``; TypeError:
    the installed hiersync cannot build it."""
    import torch.distributed as dist

    import hiersync

    m = Method()
    node_of = {r: i for i, ranks in enumerate(where.nodes) for r in ranks}
    node_of_rank = [node_of[r] for r in range(dist.get_world_size())]
    ring = lambda nbytes: ring_inter_bytes(nbytes, node_of_rank)
    if spec.kind == "ddp":
        m.modelled = lambda: ring(4.0 * num_params)
    elif spec.kind == "compute_only":
        ddp.register_comm_hook(None, _noop_hook)
        m.modelled = lambda: 0.0
    elif spec.kind == "bf16_hook":
        ddp.register_comm_hook(None, _bf16_hook)
        m.modelled = lambda: ring(2.0 * num_params)
    elif spec.kind == "postlocal":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        warmup = int(config["warmup"])
        ddp.register_comm_hook(
            PostLocalSGDState(process_group=None, subgroup=where.intra_group, start_localSGD_iter=warmup),
            post_localSGD_hook,
        )
        averager = PeriodicModelAverager(period=spec.period, warmup_steps=warmup)
        params = list(ddp.parameters())
        averaged = [False]

        def average() -> None:
            # PeriodicModelAverager's own rule: it averages when step >= warmup and
            # (step - warmup) % period == 0, then counts the step.
            s = averager.step
            averaged[0] = s >= averager.warmup_steps and (s - averager.warmup_steps) % averager.period == 0
            averager.average_parameters(params)

        m.after_step = average
        m.modelled = lambda: ring(4.0 * num_params) if averaged[0] else 0.0
    elif spec.kind in ("hiersync", "intra_only"):
        m.state = hiersync.register(ddp, opt, **spec.hiersync_options(), **config.get("hiersync_options", {}))
    elif spec.kind == "torchft":
        from .bench_torchft import attach

        m.peer = attach(
            spec.algorithm or "", spec.period, spec.fragments, spec.overlap, ddp.module, opt, where.intra_group,
            where.nodes, timeout_s=float(config.get("pg_timeout", 120.0)),
        )  # fmt: skip
    return m


def _build(config: dict, spec: ScheduleSpec, bucket_mb: float, where: Where, model: Any) -> tuple:
    """DDP over ``model``, its optimizer and phase probe, and ``spec``'s method attached (TypeError:
    the installed hiersync cannot build it; the probe is removed then)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Every rank seeds identically, so the initial broadcast (100 MB over the slow link
    # per schedule) would only cost time. torchft's rows run DDP inside the node (its replica group).
    group = where.intra_group if spec.kind == "torchft" else None
    ddp = DDP(model, bucket_cap_mb=bucket_mb, init_sync=False, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=float(config["lr"]), momentum=0.9)
    probe = PhaseProbe(model, opt)
    try:
        method = _attach(spec, config, ddp, opt, where, sum(p.numel() for p in model.parameters()))
    except TypeError:
        probe.remove()
        raise
    return ddp, opt, probe, method


def _run_one(config: dict, model_name: str, compute: str, spec: ScheduleSpec, bucket_mb: float, where: Where) -> dict:
    started = time.perf_counter()
    model, data_fn, loss_fn = fresh_model(model_name, config, compute)
    base = base_record(config, model_name, compute, spec, bucket_mb, where.nodes, model)
    try:
        ddp, opt, probe, method = _build(config, spec, bucket_mb, where, model)
    except TypeError as e:
        # Raised by HierState's option check on every rank alike, before any collective.
        if where.progress:  # the steps this run would have taken, so the progress bar still ends full
            total_steps = run_steps(spec, int(config["warmup"]), int(config["steps"]))
            with open(where.progress, "a") as f:
                f.write(f"{model_name} {compute} {spec.name}\tskipped\n" * total_steps)
        return {**base, "unsupported": f"not supported by this hiersync version ({e})"}
    record: dict[str, Any] = {"setup_s": time.perf_counter() - started}
    try:
        label = f"{model_name} {compute} {spec.name} {bucket_mb:g}MB"
        record.update(train(config, spec, ddp, opt, data_fn, loss_fn, probe, method, where, label, compute))
    finally:
        if method.peer is not None:
            method.peer.close()
    teardown(method, probe)
    record["run_s"] = time.perf_counter() - started  # the whole run: setup, every step, teardown
    return {**base, **record}


def _memory_one(
    config: dict, model_name: str, compute: str, spec: ScheduleSpec, bucket_mb: float, where: Where
) -> float | None:
    """This rank's peak memory over ``warmup + 2k`` steps of ``spec`` (MB above its start; None: not built)."""
    import torch
    import torch.distributed as dist

    fresh_model(model_name, config, compute)  # the template exists before the window opens
    memory = MemoryProbe()
    memory.start()
    model, data_fn, loss_fn = fresh_model(model_name, config, compute)
    try:
        ddp, opt, probe, method = _build(config, spec, bucket_mb, where, model)
    except TypeError:
        return None
    gen = torch.Generator().manual_seed(int(config["seed"]) * 1000 + dist.get_rank())
    k = spec.period if spec.kind in PERIODIC and spec.period > 1 else 1
    try:
        for _ in range(memory_steps(spec, int(config["warmup"]))):
            x, y = data_fn(0, gen)
            loss_fn(ddp(x), y).backward()
            opt.step()
            method.after_step()
            opt.zero_grad(set_to_none=True)
            if where.progress:
                with open(where.progress, "a") as f:
                    f.write(f"{model_name} {compute} {spec.name} memory (k={k})\n")
        method.drain()
        dist.barrier()
    finally:
        if method.peer is not None:
            method.peer.close()
    peak = memory.peak_mb()
    teardown(method, probe)
    return peak
