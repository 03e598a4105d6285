"""Rank functions for tests/gpu: the CPU checks of tests/ranks.py, on CUDA tensors."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ranks import Net, batch

import hiersync
from hiersync.collectives import HierComm


def _device() -> torch.device:
    # several ranks may share one GPU (gloo on CUDA tensors); NCCL needs one GPU per rank
    dev = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def two_level_sizes(sizes: list[int]) -> float:
    """Two-level all-reduce of CUDA tensors == flat all-reduce; several in flight at once."""
    dev = _device()
    comm = HierComm(hiersync.Topology.detect().build_groups())
    worst = 0.0
    futs = []
    for n in sizes:
        g = torch.Generator(device="cpu").manual_seed(1000 * dist.get_rank() + n)
        x = torch.randn(n, generator=g).to(dev)
        ref = x.clone()
        dist.all_reduce(ref)
        ref /= dist.get_world_size()
        futs.append((comm.allreduce(x), ref))
    for fut, ref in futs:
        got = hiersync.futures.wait(fut)
        worst = max(worst, float((got - ref).abs().max()))
    return worst


def hook_parity(period: int, steps: int, options: dict) -> dict:
    """DDP + hiersync on CUDA vs a plain reference; NaN at one step must be skipped."""
    nan_step = options.pop("_nan_step", None)
    dev = _device()
    torch.manual_seed(0)
    model = Net().to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dist.get_backend() == "nccl" else None, bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = hiersync.register(ddp, opt, period=period, **options)
    ref = DDP(Net().to(dev), device_ids=[dev.index] if dist.get_backend() == "nccl" else None)
    ref.load_state_dict(ddp.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = (t.to(dev) for t in batch(step))
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if step == nan_step:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad()
        if period == 1 and step != nan_step:
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert bool(torch.isfinite(torch.cat([p.detach().flatten() for p in ddp.parameters()])).all())
    state.synchronize(ddp)
    flat = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    ref_flat = torch.cat([p.detach().flatten() for p in ref.parameters()])
    return {
        "identical": all(torch.equal(t, flat) for t in everyone),
        "max_diff_vs_ddp": float((flat - ref_flat).abs().max()) if period == 1 else None,
        "skips": state.stats.nonfinite_skips,
    }
