"""What every rank runs for ``python -m hiersync bench``: build a model, train it under each schedule, time it.

:func:`worker` is the target :func:`hiersync.tools.cluster.run_ranks` calls on every rank
(``"hiersync.tools.bench_worker:worker"``); its result goes to
:func:`hiersync.tools.report.summarize`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from hiersync.vocab import Level

from .bench_spec import ScheduleSpec, parse_schedule, timed_steps

__all__ = ["worker"]

logger = logging.getLogger(__name__)


def _build_model(name: str, config: dict):
    import torch

    if name == "mlp":
        depth = int(config["mlp_depth"])
        width = max(8, int(round(math.sqrt(float(config["mlp_params"]) / depth))))
        layers: list[torch.nn.Module] = []
        for i in range(depth):
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
    # Repeats go round the whole sweep, so a burst of load on a shared machine hits
    # one run of every schedule rather than every run of one schedule.
    for rep in range(int(config.get("repeat", 1))):
        for model_name in config["models"]:
            for bucket_mb in config["buckets_mb"]:
                for schedule in config["schedules"]:
                    spec = parse_schedule(schedule)
                    record = _run_one(config, model_name, spec, float(bucket_mb), intra_group, progress)
                    out["runs"].append({**record, "repeat": rep})
    return out


def _run_one(
    config: dict, model_name: str, spec: ScheduleSpec, bucket_mb: float, intra_group: Any, progress: str | None
) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    rank = dist.get_rank()
    warmup = int(config["warmup"])
    steps = timed_steps(spec, int(config["steps"]))
    torch.manual_seed(int(config["seed"]))
    model, data_fn, loss_fn = _build_model(model_name, config)
    num_params = sum(p.numel() for p in model.parameters())
    # Every rank seeds identically, so the initial broadcast (100 MB over the slow link
    # per schedule) would only cost time.
    ddp = DDP(model, bucket_cap_mb=bucket_mb, init_sync=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=float(config["lr"]), momentum=0.9)
    probe = _Probe(model, opt)
    after_step: Callable[[], None] = lambda: None
    state = None
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
        after_step = lambda: averager.average_parameters(params)
    elif spec.kind in ("hiersync", "intra_only"):
        state = hiersync.register(
            ddp,
            opt,
            period=spec.period,
            overlap=spec.overlap,
            compress=spec.compress,
            **config.get("hiersync_options", {}),
        )
    gen = torch.Generator().manual_seed(int(config["seed"]) * 1000 + rank)
    label = f"{model_name} {spec.name} {bucket_mb:g}MB"
    done = [0]
    total_steps = warmup + 2 * steps

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
    dist.barrier()
    t0 = time.perf_counter()
    ends = []
    for _ in range(steps):
        step(False)
        ends.append(time.perf_counter())
    elapsed = time.perf_counter() - t0
    stats1 = state.stats.as_dict() if state is not None else None
    if state is not None:
        state.drain()  # an overlapped sync still in flight lands before the next run
    dist.barrier()
    probe.remove()
    inter = None
    if stats0 is not None and stats1 is not None:
        inter = {
            lvl: (stats1["bytes_sent"][lvl] - stats0["bytes_sent"][lvl]) / (2 * steps)
            for lvl in (Level.INTRA, Level.INTER)
        }
    if state is not None:
        try:
            state.close()  # releases its optimizer hooks and groups
        except (RuntimeError, ValueError) as e:  # a leak of one idle group is harmless
            logger.debug("bench: could not close the hiersync state: %s", e)
    return {
        "model": model_name,
        "schedule": spec.name,
        "spec": asdict(spec),
        "bucket_mb": bucket_mb,
        "num_params": num_params,
        "warmup": warmup,
        "steps": steps,
        "attributed": attributed,
        "unsync_elapsed": elapsed,
        "unsync_step_ends": [e - t0 for e in ends],
        "bytes_sent_per_step": inter,
    }
