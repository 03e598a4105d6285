"""What every bench run shares, DDP's rows and FSDP2's alike: the seeded model, where the run
happens, what a schedule attached, the step loop and its timings, and the teardown.

:func:`train` runs one row's warmup, attributed, burnt and timed steps and returns the
numbers :func:`hiersync.tools.bench_rows.summarize` reads; :mod:`.bench_worker` (DDP) and
:mod:`.bench_fsdp` (FSDP2) build the model, the optimizer and the :class:`Method` around it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from hiersync.vocab import Level

from .bench_compute import SLEPT, build_model
from .bench_probes import LinkCounter, PhaseProbe
from .bench_spec import (
    BURN_SECONDS,
    BURN_STEPS,
    ScheduleSpec,
    attributed_steps,
    run_steps,
    timed_steps,
)

__all__ = ["Where", "Method", "fresh_model", "base_record", "train", "teardown"]

logger = logging.getLogger(__name__)

_BUILT: dict[tuple, Any] = {}


def fresh_model(name: str, config: dict, compute: str) -> Any:
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


class Where:
    """Where a run happens: the node groups, the progress file (rank 0) and the link counter (node leaders)."""

    def __init__(self, intra_group: Any, nodes: Sequence[Sequence[int]], progress: str | None, link: Any) -> None:
        self.intra_group = intra_group
        self.nodes = nodes
        self.progress = progress
        self.link: LinkCounter | None = link


class Method:
    """What a schedule attached to the model: the after-step call, hiersync's state, a torchft row, a bytes model."""

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


def base_record(
    config: dict, model_name: str, compute: str, spec: ScheduleSpec, bucket_mb: float, nodes, model
) -> dict:
    """The fields of a run's record that do not depend on its timings (``model``: the whole model, before sharding)."""
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


def teardown(method: Method, probe: PhaseProbe) -> None:
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


def _timed_count(spec: ScheduleSpec, steps: int, attributed: list[dict[str, float]], min_seconds: float) -> int:
    """``steps`` timed steps, or more whole windows if those would last under ``min_seconds``.

    At the attributed steps' pace (barriers included, so a little slow): a fast row's mean
    then averages enough steps to be steady on a noisy 2-core box (a step here scatters by
    +-10%), while a slow row (DDP's 2 s steps) is not timed for longer than it needs. Every
    rank times the number rank 0 decides.
    """
    window = timed_steps(spec, 1)
    return _rank0_count(max(steps, window * math.ceil(min_seconds / _pace(attributed) / window)))


def _burn_count(attributed: list[dict[str, float]], seconds: float) -> int:
    """Untimed free-running steps before the timed ones: ``BURN_STEPS``, or more lasting ``seconds``.

    At the attributed steps' pace, decided by rank 0 (every rank burns the same steps).
    """
    return _rank0_count(max(BURN_STEPS, math.ceil(seconds / _pace(attributed))))


def _pace(attributed: list[dict[str, float]]) -> float:
    """Seconds per attributed step (barriers included, so a little slow)."""
    return max(1e-3, statistics.fmean(a["total"] for a in attributed))


def _rank0_count(n: int) -> int:
    """Rank 0's ``n`` on every rank (collective): every rank runs the same steps."""
    import torch
    import torch.distributed as dist

    want = torch.tensor([n])
    dist.broadcast(want, src=0)
    return int(want)


def train(
    config: dict,
    spec: ScheduleSpec,
    model: Any,
    opt: Any,
    data_fn: Callable,
    loss_fn: Callable,
    probe: PhaseProbe,
    method: Method,
    where: Where,
    label: str,
    compute: str,
) -> dict[str, Any]:
    """Warmup, attributed, burnt and timed steps of one run; the timings and bytes of the timed ones.

    ``model``: what the step calls (DDP over the model, or the FSDP2 module); ``label``: the
    row's name on the progress bar.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    warmup = int(config["warmup"])
    steps = timed_steps(spec, int(config["steps"]))
    total_steps = run_steps(spec, warmup, int(config["steps"]))
    state, after_step = method.state, method.after_step
    gen = torch.Generator().manual_seed(int(config["seed"]) * 1000 + rank)
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
        loss = loss_fn(model(x), y)
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
    attributed = [step(True) for _ in range(attributed_steps(spec))]
    # every run of a row at least --min-seconds (a row a claim's noise needs runs once per round)
    steps = _timed_count(spec, steps, attributed, float(config.get("min_seconds", 0.0)))
    method.drain()
    dist.barrier()
    tx_attributed = link.read() - tx_begin if link is not None else 0
    # The first free-running steps after the barriered ones and the drain are slower than the
    # rest (the ranks leave the barrier together and contend, a drained streaming pipeline
    # refills, TCP windows reopen): 40-130 ms in the first step of every row of 40-step runs,
    # and up to 2-3 s of outliers in 24-step runs of the streaming and intra_only rows. Burn them.
    burn0 = state.stats.as_dict() if state is not None else None
    for _ in range(_burn_count(attributed, float(config.get("burn_seconds", BURN_SECONDS)))):
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
    phases = []
    for _ in range(steps):
        phases.append(step(False))
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
        # over the attributed and the timed steps (each a multiple of k), the burnt step left out
        at = lambda d, lvl: d["bytes_sent"][lvl]
        inter = {
            lvl: (at(stats1, lvl) - at(burn1, lvl) + at(burn0, lvl) - at(stats0, lvl)) / (len(attributed) + steps)
            for lvl in (Level.INTRA, Level.INTER)
        }
    counted = state is not None or method.modelled is not None
    return {
        "steps": steps,
        "attributed": attributed,
        "unsync_elapsed": elapsed,
        "unsync_cpu_s": cpu,
        "accel_sleep_per_step": sleep_per_step,
        "unsync_step_ends": [e - t0 for e in ends],
        # each timed step's phases on this rank, without barriers (they add up to its step)
        "unsync_phases": phases,
        "bytes_sent_per_step": inter,
        # inter-node bytes this rank sent in each unsynchronized step: counted by hiersync,
        # modelled (ring_inter_bytes) for DDP, post-local SGD and the bf16 hook
        "inter_bytes_steps": inter_steps if counted else None,
        "inter_bytes_source": "counted" if state is not None else ("modelled" if method.modelled is not None else None),
        # node leaders on the testbed: the bytes their node's link sent in each timed step, and per
        # attributed step (everything those steps launched, drained: the barriers' few bytes too)
        "link_tx_steps": link_steps if link is not None else None,
        "link_tx_per_step": tx_attributed / len(attributed) if link is not None else None,
    }
