"""What every rank runs for ``python -m hiersync bench``: build a model, train it under each schedule, time it.

:func:`worker` is the target :func:`hiersync.tools.cluster.run_ranks` calls on every rank
(``"hiersync.tools.bench_worker:worker"``); its result goes to
:func:`hiersync.tools.report.summarize`.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from hiersync.vocab import Level

from .bench_spec import BURN_STEPS, ScheduleSpec, parse_schedule, run_steps, timed_steps

__all__ = ["worker"]

logger = logging.getLogger(__name__)


def _accel_function():
    """The autograd function of :class:`AccelLinear` (built lazily: this module imports torch lazily)."""
    global _ACCEL_FN
    if _ACCEL_FN is not None:
        return _ACCEL_FN
    import torch

    class _SleepLinear(torch.autograd.Function):
        """``y = x + b + (W @ mean_n x) / sqrt(width)``: sleeps, then does O(width^2) memory-bound work.

        The weight term uses the batch mean of ``x`` treated as a constant, so the exact
        gradients are cheap: ``dW = outer(sum_n g, mean_n x) / sqrt(width)`` (a full
        width x width tensor, like a linear layer's), ``db = sum_n g``, ``dx = g``.
        """

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, bias: Any, fwd_s: float, bwd_s: float) -> Any:
            _sleep(fwd_s)  # the device computes; the host is idle
            xbar = x.detach().mean(0)
            scale = 1.0 / math.sqrt(weight.shape[1])
            ctx.save_for_backward(xbar)
            ctx.scale, ctx.bwd_s = scale, bwd_s
            return x + bias + torch.mv(weight, xbar).mul_(scale)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            (g,) = grads
            _sleep(ctx.bwd_s)
            (xbar,) = ctx.saved_tensors
            gsum = g.sum(0)
            return g, torch.outer(gsum, xbar).mul_(ctx.scale), gsum, None, None

    _ACCEL_FN = _SleepLinear
    return _SleepLinear


_ACCEL_FN: Any = None
SLEPT = {"asked": 0.0, "slept": 0.0}
"""Seconds the accel layers asked to sleep and actually slept (wake-up latency on a busy machine)."""


def _sleep(seconds: float) -> None:
    t0 = time.perf_counter()
    time.sleep(seconds)
    SLEPT["asked"] += seconds
    SLEPT["slept"] += time.perf_counter() - t0


def accel_linear(width: int, fwd_ms: float, bwd_ms: float) -> Any:
    """A layer with ``torch.nn.Linear(width, width)``'s parameters whose compute is a sleep.

    Forward sleeps ``fwd_ms`` and backward ``bwd_ms`` with the CPU idle, as a host does
    while its accelerator runs the kernels; the gradients are real (exact for the cheap
    function the layer computes, see ``_SleepLinear``) and have the shapes and bytes of a
    linear layer's, so DDP and hiersync move exactly what they move for the CPU model.
    """
    import torch

    fn = _accel_function()

    class AccelLinear(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn.apply(x, self.weight, self.bias, fwd_ms / 1e3, bwd_ms / 1e3)

    return AccelLinear(width, width)


def _build_model(name: str, config: dict, compute: str = "cpu"):
    import torch

    if compute not in ("cpu", "accel"):
        raise ValueError(f"compute={compute!r} is not known; use 'cpu' or 'accel'")
    if compute == "accel" and name != "mlp":
        raise ValueError(f"the accel compute model is built for the mlp only, not {name!r}")
    if name == "mlp":
        depth = int(config["mlp_depth"])
        width = max(8, int(round(math.sqrt(float(config["mlp_params"]) / depth))))
        layers: list[torch.nn.Module] = []
        fwd_ms = float(config.get("accel_layer_ms", 25.0))
        for i in range(depth):
            if compute == "accel":
                layers.append(accel_linear(width, fwd_ms, 2 * fwd_ms))
                continue
            layers.append(torch.nn.Linear(width, width))
            if i < depth - 1:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers)
        batch = int(config["batch_size"])

        def data(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(out, y)

        return model, data, loss_fn
    if name == "transformer":
        t = config["transformer"]
        vocab, dim, seq = int(t["vocab"]), int(t["dim"]), int(t["seq"])

        class TinyLM(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(vocab, dim)
                self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
                layer = torch.nn.TransformerEncoderLayer(dim, int(t["heads"]), 4 * dim, dropout=0.0, batch_first=True)
                self.blocks = torch.nn.TransformerEncoder(layer, int(t["layers"]), enable_nested_tensor=False)
                self.head = torch.nn.Linear(dim, vocab)

            def forward(self, tokens: torch.Tensor) -> torch.Tensor:
                return self.head(self.blocks(self.embed(tokens) + self.pos))

        batch = int(t["batch"])

        def data(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
            return tokens[:, :-1], tokens[:, 1:]

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

        return TinyLM(), data, loss_fn
    raise ValueError(f"model={name!r} is not known; use 'mlp' or 'transformer'")


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


class _Probe:
    """Timestamps: the last gradient accumulated (end of backward compute) and the end of the update."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.last_grad = 0.0
        self.opt_done = 0.0
        self.handles = [p.register_post_accumulate_grad_hook(self._grad) for p in model.parameters() if p.requires_grad]
        # Registered before hiersync attaches its own step hooks, so this one runs first:
        # whatever runs after it inside optimizer.step() is hiersync's inter-node sync.
        self.handles.append(optimizer.register_step_post_hook(self._opt))

    def _grad(self, p: Any) -> None:
        self.last_grad = time.perf_counter()

    def _opt(self, *args: Any) -> None:
        self.opt_done = time.perf_counter()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _rss_mb() -> float | None:
    """This process's resident memory now (Linux), to see that runs free what they built."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------------- worker
def worker(config: dict) -> dict:
    """Run every (model, schedule, bucket) of ``config`` on this rank; return its timings.

    Runs on every rank of an initialized gloo process group (under torchrun on the testbed,
    or the private launcher on loopback). Rank 0 appends one line per step to
    ``config["progress"]`` for the launcher's progress bar.
    """
    import torch.distributed as dist

    import hiersync

    _fix_hook_annotations()
    rank = dist.get_rank()
    topo = hiersync.Topology.detect()
    # Intra-node groups for PyTorch's post-local SGD (its default assumes one GPU per rank).
    intra_group, _ = dist.new_subgroups_by_enumeration([list(n) for n in topo.nodes])
    progress = config.get("progress") if rank == 0 else None
    out: dict[str, Any] = {"rank": rank, "nodes": [list(n) for n in topo.nodes], "runs": []}
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
                        record = _run_one(
                            config, model_name, compute, spec, float(bucket_mb), intra_group, topo.nodes, progress
                        )
                        out["runs"].append({**record, "repeat": rep})
                        # DDP, its hook state and the optimizer's hooks form reference cycles:
                        # free this run's model, gradients and buffers before the next one builds its own.
                        gc.collect()
                        out["runs"][-1]["rss_mb_after"] = _rss_mb()
    return out


def copy_probe(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds of a copy into a fresh tensor of ``nbytes``, every rank at once.

    That is what a sync's launch does per rank (snapshot and payload of its shard): the cost
    model charges these copies at a device's copy speed, and on a CPU host that speed
    includes the page faults of fresh memory (a copy into reused memory was ~5x faster here)
    and whatever the other ranks take of the cores. Collective.
    """
    import torch
    import torch.distributed as dist

    src = torch.ones(max(1, nbytes // 4))
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dst = src.clone()
        times.append(time.perf_counter() - t0)
        del dst
    return {"bytes": float(src.numel() * 4), "seconds": statistics.median(times)}


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
        _BUILT[key] = _build_model(name, config, compute)
    model, data_fn, loss_fn = _BUILT[key]
    return copy.deepcopy(model), data_fn, loss_fn


def _run_one(
    config: dict,
    model_name: str,
    compute: str,
    spec: ScheduleSpec,
    bucket_mb: float,
    intra_group: Any,
    nodes: Sequence[Sequence[int]],
    progress: str | None,
) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    rank = dist.get_rank()
    warmup = int(config["warmup"])
    steps = timed_steps(spec, int(config["steps"]))
    total_steps = run_steps(spec, warmup, int(config["steps"]))
    model, data_fn, loss_fn = _fresh_model(model_name, config, compute)
    num_params = sum(p.numel() for p in model.parameters())
    node_of = {r: i for i, ranks in enumerate(nodes) for r in ranks}
    node_of_rank = [node_of[r] for r in range(dist.get_world_size())]
    base: dict[str, Any] = {
        "model": model_name,
        "compute": compute,
        "schedule": spec.name,
        "spec": asdict(spec),
        "bucket_mb": bucket_mb,
        "num_params": num_params,
        "warmup": warmup,
        "steps": steps,
        # what one whole-model inter-node parameter average sends per rank (fp32, hiersync's rails)
        "whole_sync_inter_bytes": 2.0 * (len(nodes) - 1) / len(nodes) * 4 * num_params / max(len(n) for n in nodes),
    }
    # Every rank seeds identically, so the initial broadcast (100 MB over the slow link
    # per schedule) would only cost time.
    ddp = DDP(model, bucket_cap_mb=bucket_mb, init_sync=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=float(config["lr"]), momentum=0.9)
    probe = _Probe(model, opt)
    after_step: Callable[[], None] = lambda: None
    state = None
    # Inter-node bytes per step of the schedules hiersync does not count: a ring model.
    modelled: Callable[[], float] | None = None
    if spec.kind == "ddp":
        modelled = lambda: ring_inter_bytes(4.0 * num_params, node_of_rank)
    elif spec.kind == "bf16_hook":
        modelled = lambda: ring_inter_bytes(2.0 * num_params, node_of_rank)
    elif spec.kind == "compute_only":
        modelled = lambda: 0.0
    if spec.kind == "compute_only":
        ddp.register_comm_hook(None, _noop_hook)
    elif spec.kind == "bf16_hook":
        ddp.register_comm_hook(None, _bf16_hook)
    elif spec.kind == "postlocal":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        ddp.register_comm_hook(
            PostLocalSGDState(process_group=None, subgroup=intra_group, start_localSGD_iter=warmup), post_localSGD_hook
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

        after_step = average
        modelled = lambda: ring_inter_bytes(4.0 * num_params, node_of_rank) if averaged[0] else 0.0
    elif spec.kind in ("hiersync", "intra_only"):
        try:
            state = hiersync.register(ddp, opt, **spec.hiersync_options(), **config.get("hiersync_options", {}))
        except TypeError as e:
            # Raised by HierState's option check on every rank alike, before any collective.
            probe.remove()
            if progress:  # the steps this run would have taken, so the progress bar still ends full
                with open(progress, "a") as f:
                    f.write(f"{model_name} {compute} {spec.name}\tskipped\n" * total_steps)
            return {**base, "unsupported": f"not supported by this hiersync version ({e})"}
    gen = torch.Generator().manual_seed(int(config["seed"]) * 1000 + rank)
    label = f"{model_name} {compute} {spec.name} {bucket_mb:g}MB"
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress:
            with open(progress, "a") as f:
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
    stats0 = state.stats.as_dict() if state is not None else None
    attributed = [step(True) for _ in range(steps)]
    # The first free-running step after the barriered ones was 40-130 ms slower than the rest in
    # every row of 40-step runs (the ranks leave the barrier together and contend): burn it.
    burn0 = state.stats.as_dict() if state is not None else None
    for _ in range(BURN_STEPS):
        step(False)
    burn1 = state.stats.as_dict() if state is not None else None
    dist.barrier()
    slept0 = dict(SLEPT)
    t0, cpu0 = time.perf_counter(), time.process_time()
    ends = []
    inter_steps: list[float] = []
    sent = state.stats.bytes_sent[Level.INTER.value] if state is not None else 0
    for _ in range(steps):
        step(False)
        ends.append(time.perf_counter())
        if state is not None:
            now = state.stats.bytes_sent[Level.INTER.value]
            inter_steps.append(float(now - sent))
            sent = now
        elif modelled is not None:
            inter_steps.append(modelled())
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0  # this rank's CPU seconds, every thread (gloo's included)
    # accel: compute time per timed step as asked, and as the scheduler delivered it
    sleep_per_step = {k: (SLEPT[k] - slept0[k]) / steps for k in SLEPT} if compute == "accel" else None
    stats1 = state.stats.as_dict() if state is not None else None
    if state is not None:
        state.drain()  # an overlapped sync still in flight lands before the next run
    dist.barrier()
    probe.remove()
    inter = None
    if stats0 is not None and stats1 is not None and burn0 is not None and burn1 is not None:
        # over the attributed and the timed steps (2 x a multiple of k), the burnt step left out
        at = lambda d, lvl: d["bytes_sent"][lvl]
        inter = {
            lvl: (at(stats1, lvl) - at(burn1, lvl) + at(burn0, lvl) - at(stats0, lvl)) / (2 * steps)
            for lvl in (Level.INTRA, Level.INTER)
        }
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
    return {
        **base,
        "attributed": attributed,
        "unsync_elapsed": elapsed,
        "unsync_cpu_s": cpu,
        "accel_sleep_per_step": sleep_per_step,
        "unsync_step_ends": [e - t0 for e in ends],
        "bytes_sent_per_step": inter,
        # inter-node bytes this rank sent in each unsynchronized step: counted by hiersync,
        # modelled (ring_inter_bytes) for DDP, post-local SGD and the bf16 hook
        "inter_bytes_steps": inter_steps if (state is not None or modelled is not None) else None,
        "inter_bytes_source": "counted" if state is not None else ("modelled" if modelled is not None else None),
    }
