"""What every rank runs for ``python -m hiersync bench``: build a model, train it under each schedule, time it.

:func:`worker` is the target :func:`hiersync.tools.cluster.run_ranks` calls on every rank
(``"hiersync.tools.bench_worker:worker"``); its result goes to
:func:`hiersync.tools.bench_rows.summarize`. The models are :mod:`.bench_compute`'s, the
probes (phases, copies, link bytes, memory) :mod:`.bench_probes`', the torchft rows
:mod:`.bench_torchft`'s.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from hiersync.vocab import Level

from .bench_compute import SLEPT, build_model
from .bench_probes import LinkCounter, MemoryProbe, PhaseProbe, copy_probe, exact_rss, rss_mb
from .bench_spec import BURN_STEPS, ScheduleSpec, memory_steps, parse_schedule, run_steps, timed_steps

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
    # one run of every schedule rather than every run of one schedule.
    for rep in range(int(config.get("repeat", 1))):
        for model_name in config["models"]:
            for bucket_mb in config["buckets_mb"]:
                for compute in config.get("compute", ["cpu"]):
                    if compute == "accel" and model_name != "mlp":
                        continue  # the accel model is an MLP (the command says so)
                    for schedule in config["schedules"]:
                        spec = parse_schedule(schedule)
                        where = _Where(intra_group, topo.nodes, progress, link)
                        record = _run_one(config, model_name, compute, spec, float(bucket_mb), where)
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
    where = _Where(intra_group, topo.nodes, progress, None)
    model_name = config["models"][0]
    computes = config.get("compute", ["cpu"])
    compute = "accel" if "accel" in computes and model_name == "mlp" else "cpu"
    bucket_mb = float(config["buckets_mb"][0])
    out = []
    for schedule in config["schedules"]:
        spec = parse_schedule(schedule)
        peak = _memory_one(config, model_name, compute, spec, bucket_mb, where)
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


_BUILT: dict[tuple, Any] = {}


def _fresh_model(name: str, config: dict, compute: str) -> Any:
    """A copy of the (model, compute) pair's seeded initial model, built once per process.

    Initializing 25M parameters costs ~0.3 s of CPU per rank; copying them 0.06 s.
    """
    import copy

    import torch

    key = (name, compute, repr(sorted((k, repr(v)) for k, v in config.items() if k != "progress")))
    if key not in _BUILT:
        _BUILT.clear()  # one template at a time
        torch.manual_seed(int(config["seed"]))
        _BUILT[key] = build_model(name, config, compute)
    model, data_fn, loss_fn = _BUILT[key]
    return copy.deepcopy(model), data_fn, loss_fn


class _Where:
    """Where a run happens: the node groups, the progress file (rank 0) and the link counter (node leaders)."""

    def __init__(self, intra_group: Any, nodes: Sequence[Sequence[int]], progress: str | None, link: Any) -> None:
        self.intra_group = intra_group
        self.nodes = nodes
        self.progress = progress
        self.link: LinkCounter | None = link


class _Method:
    """What a schedule attached to DDP: the after-step call, hiersync's state, a torchft row, a bytes model."""

    def __init__(self) -> None:
        self.after_step: Callable[[], None] = lambda: None
        self.state: Any = None
        self.peer: Any = None
        # inter-node bytes per step and rank of the rows nobody counts (off the testbed): a ring model
        self.modelled: Callable[[], float] | None = None

    def drain(self) -> None:
        """Let every inter-node transfer in flight land (nothing is in flight after it)."""
        if self.state is not None:
            self.state.drain()
        if self.peer is not None:
            self.peer.drain()


def _attach(spec: ScheduleSpec, config: dict, ddp: Any, opt: Any, where: _Where, num_params: int) -> _Method:
    """Register ``spec``'s hook, averager, hiersync state or torchft algorithm on ``ddp``; TypeError:
    the installed hiersync cannot build it."""
    import torch.distributed as dist

    import hiersync

    m = _Method()
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


def _base(config: dict, model_name: str, compute: str, spec: ScheduleSpec, bucket_mb: float, nodes, model) -> dict:
    num_params = sum(p.numel() for p in model.parameters())
    return {
        "model": model_name,
        "compute": compute,
        "schedule": spec.name,
        "spec": asdict(spec),
        "bucket_mb": bucket_mb,
        "num_params": num_params,
        "warmup": int(config["warmup"]),
        "steps": timed_steps(spec, int(config["steps"])),
        # what one whole-model fp32 inter-node average sends through each node's link at least
        "whole_sync_inter_bytes": 2.0 * (len(nodes) - 1) / len(nodes) * 4 * num_params,
    }


def _build(config: dict, spec: ScheduleSpec, bucket_mb: float, where: _Where, model: Any) -> tuple:
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


def _teardown(method: _Method, probe: PhaseProbe) -> None:
    probe.remove()
    state = method.state
    if state is not None:
        try:
            state.close()  # releases its optimizer hooks and groups
        except (RuntimeError, ValueError) as e:  # a leak of one idle group is harmless
            logger.debug("bench: could not close the hiersync state: %s", e)
        # DDP's C++ reducer holds the hook state, and the state holds the model, the
        # optimizer and its registry of parameters: a cycle through C++ that the garbage
        # collector cannot see (about 3x the model's bytes per run, 300 MB for the default
        # MLP). Emptying the closed state breaks it, so this run's tensors are freed.
        vars(state).clear()


def _run_one(config: dict, model_name: str, compute: str, spec: ScheduleSpec, bucket_mb: float, where: _Where) -> dict:
    started = time.perf_counter()
    model, data_fn, loss_fn = _fresh_model(model_name, config, compute)
    base = _base(config, model_name, compute, spec, bucket_mb, where.nodes, model)
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
        record.update(_train(config, spec, ddp, opt, data_fn, loss_fn, probe, method, where, model_name, compute))
    finally:
        if method.peer is not None:
            method.peer.close()
    _teardown(method, probe)
    record["run_s"] = time.perf_counter() - started  # the whole run: setup, every step, teardown
    return {**base, **record}


def _memory_one(
    config: dict, model_name: str, compute: str, spec: ScheduleSpec, bucket_mb: float, where: _Where
) -> float | None:
    """This rank's peak memory over ``warmup + 2k`` steps of ``spec`` (MB above its start; None: not built)."""
    import torch
    import torch.distributed as dist

    _fresh_model(model_name, config, compute)  # the template exists before the window opens
    memory = MemoryProbe()
    memory.start()
    model, data_fn, loss_fn = _fresh_model(model_name, config, compute)
    try:
        ddp, opt, probe, method = _build(config, spec, bucket_mb, where, model)
    except TypeError:
        return None
    gen = torch.Generator().manual_seed(int(config["seed"]) * 1000 + dist.get_rank())
    k = spec.period if spec.kind in ("hiersync", "postlocal", "torchft") and spec.period > 1 else 1
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
    _teardown(method, probe)
    return peak


def _train(
    config: dict,
    spec: ScheduleSpec,
    ddp: Any,
    opt: Any,
    data_fn: Callable,
    loss_fn: Callable,
    probe: PhaseProbe,
    method: _Method,
    where: _Where,
    model_name: str,
    compute: str,
) -> dict[str, Any]:
    """Warmup, attributed, burnt and timed steps of one run; the timings and bytes of the timed ones."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    warmup = int(config["warmup"])
    steps = timed_steps(spec, int(config["steps"]))
    total_steps = run_steps(spec, warmup, int(config["steps"]))
    state, after_step = method.state, method.after_step
    gen = torch.Generator().manual_seed(int(config["seed"]) * 1000 + rank)
    label = f"{model_name} {compute} {spec.name} {ddp.bucket_bytes_cap / 2**20:g}MB"
    done = [0]

    def tick() -> None:
        done[0] += 1
        if where.progress:
            with open(where.progress, "a") as f:
                f.write(f"{label}\t{done[0]}\t{total_steps}\n")

    def step(barriers: bool) -> dict[str, float]:
        sync = dist.barrier if barriers else (lambda: None)
        sync()
        t0 = time.perf_counter()
        x, y = data_fn(0, gen)
        sync()
        t1 = time.perf_counter()
        loss = loss_fn(ddp(x), y)
        sync()
        t2 = time.perf_counter()
        loss.backward()
        t_bwd = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        opt.step()
        t_step = time.perf_counter()
        after_step()
        t_avg = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t_zero = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        tick()
        return {
            "data": t1 - t0,
            "forward": t2 - t1,
            "backward_interval": t3 - t2,
            "backward_compute": max(0.0, probe.last_grad - t2),
            "backward_return": t_bwd - t2,
            "optimizer_interval": t4 - t3,
            "optimizer_compute": (probe.opt_done - t3) + (t_zero - t_avg),
            "after_update": (t_step - probe.opt_done) + (t_avg - t_step),
            "total": t4 - t0,
        }

    for _ in range(warmup):
        step(False)
    # The link's bytes per step are counted over the attributed steps (a multiple of k) from a
    # drained link to a drained link: a sync in flight at either end is counted once, in the
    # steps that launched it. (Draining changes no timed step: the burnt step follows.)
    method.drain()
    dist.barrier()
    link = where.link
    tx_begin = link.read() if link is not None else 0
    stats0 = state.stats.as_dict() if state is not None else None
    attributed = [step(True) for _ in range(steps)]
    method.drain()
    dist.barrier()
    tx_attributed = link.read() - tx_begin if link is not None else 0
    # The first free-running step after the barriered ones was 40-130 ms slower than the rest in
    # every row of 40-step runs (the ranks leave the barrier together and contend): burn it.
    burn0 = state.stats.as_dict() if state is not None else None
    for _ in range(BURN_STEPS):
        step(False)
    burn1 = state.stats.as_dict() if state is not None else None
    dist.barrier()
    slept0 = dict(SLEPT)
    tx = link.read() if link is not None else 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    ends = []
    inter_steps: list[float] = []
    link_steps: list[float] = []
    sent = state.stats.bytes_sent[Level.INTER.value] if state is not None else 0
    for _ in range(steps):
        step(False)
        ends.append(time.perf_counter())
        if link is not None:
            now_tx = link.read()
            link_steps.append(float(now_tx - tx))
            tx = now_tx
        if state is not None:
            now = state.stats.bytes_sent[Level.INTER.value]
            inter_steps.append(float(now - sent))
            sent = now
        elif method.modelled is not None:
            inter_steps.append(method.modelled())
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0  # this rank's CPU seconds, every thread (gloo's included)
    # accel: compute time per timed step as asked, and as the scheduler delivered it
    sleep_per_step = {k: (SLEPT[k] - slept0[k]) / steps for k in SLEPT} if compute == "accel" else None
    stats1 = state.stats.as_dict() if state is not None else None
    method.drain()  # a sync still in flight lands before the next run
    dist.barrier()
    inter = None
    if stats0 is not None and stats1 is not None and burn0 is not None and burn1 is not None:
        # over the attributed and the timed steps (2 x a multiple of k), the burnt step left out
        at = lambda d, lvl: d["bytes_sent"][lvl]
        inter = {
            lvl: (at(stats1, lvl) - at(burn1, lvl) + at(burn0, lvl) - at(stats0, lvl)) / (2 * steps)
            for lvl in (Level.INTRA, Level.INTER)
        }
    counted = state is not None or method.modelled is not None
    return {
        "attributed": attributed,
        "unsync_elapsed": elapsed,
        "unsync_cpu_s": cpu,
        "accel_sleep_per_step": sleep_per_step,
        "unsync_step_ends": [e - t0 for e in ends],
        "bytes_sent_per_step": inter,
        # inter-node bytes this rank sent in each unsynchronized step: counted by hiersync,
        # modelled (ring_inter_bytes) for DDP, post-local SGD and the bf16 hook
        "inter_bytes_steps": inter_steps if counted else None,
        "inter_bytes_source": "counted" if state is not None else ("modelled" if method.modelled is not None else None),
        # node leaders on the testbed: the bytes their node's link sent in each timed step, and per
        # attributed step (everything those steps launched, drained: the barriers' few bytes too)
        "link_tx_steps": link_steps if link is not None else None,
        "link_tx_per_step": tx_attributed / steps if link is not None else None,
    }
