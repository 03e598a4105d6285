"""The rows of benchmarks/time_to_loss.py and the training every rank of one run does.

One run is one schedule on one seed, launched by the driver (``time_to_loss.py``) under the
testbed's torchrun: each rank trains the example char-LM with AdamW and the example's lr
schedule, evaluates the world-mean model every ``--eval-every`` steps, and rank 0 writes the
curve, the wall-clock and the final loss of the synchronized model as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import _lm
import torch
import torch.distributed as dist

from hiersync.vocab import WIRE_FORMATS

__all__ = ["SCHEDULES", "TORCHFT", "PLAIN_OUTER", "worker", "hiersync_options", "GRAMMAR"]

_CODECS = tuple(n for n, f in WIRE_FORMATS.items() if f.delta and n != "fp16")  # the coded rows and bf16
_SUFFIXES = "|".join("_" + c for c in _CODECS)
GRAMMAR = f"hiersync_k<k>[_stream[<F>]][_tau<t>][_w<W>][_o<lr>m<mu>][{_SUFFIXES}][_t<topk>][_expavg]"
_NAME = re.compile(
    r"^hiersync_k(\d+)(?:_stream(\d*))?(?:_tau(\d+))?(?:_w(\d+))?(?:_o([\d.]+)m([\d.]+))?"
    rf"(?:_({'|'.join(_CODECS)}))?(?:_t(\d+))?(_expavg)?$"
)


def hiersync_options(name: str) -> dict[str, Any] | None:
    """The options of a hiersync row named by :data:`GRAMMAR` (None: not such a name).

    ``_stream[F]``: ``fragments=F`` (default k), ``overlap=1`` unless ``_tau``; ``_w<W>``: W
    exact warm-up steps (post-local SGD's warm-up); ``_o<lr>m<mu>``: DiLoCo's outer Nesterov
    step (``outer_lr``, ``outer_momentum``; an lr above 1 with mu 0 lengthens each window's
    averaged step: the per-window correction); a codec for the deltas (``_t<topk>``: topk2's values
    sent of each block); ``_expavg``: AdamW's
    ``exp_avg`` averaged with the parameters.

    >>> hiersync_options("hiersync_k16_stream4_w50_o0.7m0.9_int4")["fragments"]
    4
    """
    m = _NAME.match(name)
    if m is None:
        return None
    k, frags, tau, warm, olr, mu, codec, topk, expavg = m.groups()
    out: dict[str, Any] = {"period": int(k)}
    if "_stream" in name:
        out.update(fragments=int(frags or k), overlap=1)
    if tau is not None:
        out["overlap"] = int(tau)
    if warm is not None:
        out["warmup_steps"] = int(warm)
    if olr is not None:
        out.update(outer_lr=float(olr), outer_momentum=float(mu))
    if codec is not None:
        out["compress"] = codec
    if topk is not None:
        out["topk"] = int(topk)
    if expavg:
        out["average_optimizer_state"] = ("exp_avg",)
    return out


SCHEDULES: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "postlocal_k4": None,
    "hiersync_k4": dict(period=4),
    "hiersync_k4_stream": dict(period=4, fragments=4, overlap=1),
    "hiersync_k2_stream": dict(period=2, fragments=2, overlap=1),
    "hiersync_k4_stream_expavg": dict(period=4, fragments=4, overlap=1, average_optimizer_state=("exp_avg",)),
    "hiersync_k4_stream_adam": dict(
        period=4, fragments=4, overlap=1, average_optimizer_state=("exp_avg", "exp_avg_sq")
    ),
    # not in the default run: further loss-only comparisons (docs/time-to-loss.md)
    "postlocal_k4_aligned": None,  # PeriodicModelAverager(warmup_steps=3): averages after steps 4, 8, ...
    "hiersync_k4_warm30": dict(period=4, warmup_steps=30),
    "hiersync_k4_outer": dict(period=4, outer_lr=1.0, outer_momentum=0.5),
    "hiersync_k4_diloco": dict(period=4, outer_lr=0.7, outer_momentum=0.9),
}
# torchft's rows (--peers torchft): (algorithm, sync_every, fragments, fragment_sync_delay, outer SGD)
PLAIN_OUTER = {"lr": 1.0, "momentum": 0.0}  # the outer step of plain averaging: x = mean of the replicas
TORCHFT: dict[str, tuple[str, int, int, int, dict[str, float]]] = {
    "torchft_diloco_k4": ("diloco", 4, 1, 0, PLAIN_OUTER),
    "torchft_diloco_k4_d3": ("diloco", 4, 1, 3, PLAIN_OUTER),
    "torchft_streaming_k4": ("diloco", 4, 2, 1, PLAIN_OUTER),
    "torchft_diloco_k4_nesterov": ("diloco", 4, 1, 0, {"lr": 0.7, "momentum": 0.9}),
}
SCHEDULES.update(dict.fromkeys(TORCHFT))


def _noop_hook(state: Any, bucket: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks the real types (this module's annotations are strings)
_noop_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


@torch.no_grad()
def _world_mean_into(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in src.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    torch.nn.utils.vector_to_parameters(flat, dst.parameters())


def worker(args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    rank, _, device = _lm.setup()
    train, val = _lm.load_text(args.text_mb)
    model = _lm.GPT(args).to(device)
    probe = copy.deepcopy(model)
    state, averager, peer, name = None, None, None, args.schedule
    nodes = hiersync.Topology.detect().nodes
    intra = None
    if name.startswith(("postlocal", "torchft")):
        intra, _ = dist.new_subgroups_by_enumeration([list(n) for n in nodes])
    # torchft: DDP inside the node (its replica group); everything else: DDP over the world
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=intra if name in TORCHFT else None,
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lm.lr_at(s, args))
    if name in TORCHFT:
        from hiersync.tools.bench_torchft import attach

        algorithm, period, fragments, delay, outer = TORCHFT[name]
        peer = attach(algorithm, period, fragments, delay, model, opt, intra, nodes, outer=outer)
    elif name == "compute_only":
        ddp.register_comm_hook(None, _noop_hook)
    elif name.startswith("postlocal_k4"):
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        ddp.register_comm_hook(PostLocalSGDState(None, intra, start_localSGD_iter=0), post_localSGD_hook)
        averager = PeriodicModelAverager(period=4, warmup_steps=3 if name.endswith("aligned") else 0)
    elif (options := SCHEDULES.get(name) or hiersync_options(name)) is not None:
        state = hiersync.register(ddp, opt, **options)

    try:
        evals: list[dict[str, float]] = []
        step_s: list[float] = []
        wall = 0.0

        def evaluate(step: int) -> float:
            _world_mean_into(model, probe)
            loss = _lm.evaluate(probe, val, args, device)
            evals.append(dict(step=step, wall_s=wall, val_loss=loss))
            return loss

        evaluate(0)
        dist.barrier()
        steps = 0
        while True:
            t0 = time.perf_counter()
            x, y = _lm.train_batch(train, args, rank, steps, device)
            _, loss = ddp(x, y)
            loss.backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(ddp.parameters())
            opt.zero_grad(set_to_none=True)
            sched.step()
            steps += 1
            last = steps >= args.max_steps
            if steps % args.eval_every == 0 or steps == args.steps or last:
                dist.barrier()  # the clock stops when the slowest rank is done
                wall += time.perf_counter() - t0
                step_s.append(wall)
                if name != "compute_only":
                    evaluate(steps)
                if last:
                    break
                dist.barrier()
            else:
                wall += time.perf_counter() - t0
        t0 = time.perf_counter()
        if state is not None:
            state.synchronize(ddp)
        elif averager is not None or peer is not None:
            if peer is not None:
                peer.drain()  # a fragment still in flight
            _world_mean_into(model, model)
        dist.barrier()
        wall += time.perf_counter() - t0
        final = _lm.evaluate(model, val, args, device) if name != "compute_only" else math.nan
        if rank == 0:
            out = dict(schedule=name, steps=steps, wall_s=wall, final_val_loss=final, evals=evals)
            if state is not None:
                out["inter_bytes_rank0"] = state.stats.as_dict()["bytes_sent"]["inter"]
            Path(args.out).write_text(json.dumps(out))
        if state is not None:
            state.close()
    except BaseException:
        # rank 0's Lighthouse is stopped on any failure (not a collective: the other ranks
        # may be gone); it also dies with this process (bench_torchft.Lighthouse)
        if peer is not None and peer.lighthouse is not None:
            peer.lighthouse.close()
        raise
    if peer is not None:
        peer.close()  # collective; stops the Lighthouse in a finally
    dist.destroy_process_group()
