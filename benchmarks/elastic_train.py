"""Elastic training with hiersync under ``torchrun --max-restarts``: the resume pattern.

Every ``--ckpt-every`` steps each rank saves (model, optimizer, ``state.state_dict()``)
to its own file, atomically; once every rank has saved, rank 0 atomically writes the
step number to ``latest``. After a failure torchrun restarts all workers: they rebuild
the process group, the topology and hiersync's groups (a new ``HierState``), load the
files named by ``latest`` and continue. The schedule continues as if uninterrupted, so
the result equals an uninterrupted run bit for bit (tests/test_elastic.py checks that).

Per-rank files are needed because between inter-node syncs the nodes' replicas differ;
call ``state.synchronize(model)`` first if you want one file for all ranks.

Example::

    HIERSYNC_NODE_IDS=0,0,1,1 torchrun --standalone --nproc-per-node 4 --max-restarts 1 \\
        benchmarks/elastic_train.py --ckpt /tmp/ckpt --steps 12 --period 3 --crash-at 7
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync
from hiersync._io import atomic_save, atomic_write_text


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)


def init_distributed(backend: str = "gloo") -> None:
    """``init_process_group`` that also works after a torchrun restart.

    Observed on torch 2.13 with ``torchrun --standalone --max-restarts``: the restarted
    workers reuse the agent's TCPStore without a per-attempt prefix, read the previous
    attempt's gloo addresses and fail in connectFullMesh ("Connection refused"). A prefix
    per restart keeps each attempt's keys apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)  # plain env://
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    store = dist.PrefixStore(f"/hiersync/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint folder")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--period", type=int, default=3)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--crash-at", type=int, default=-1, help="rank 1 SIGKILLs itself at this step, first attempt only")
    p.add_argument("--out", type=Path, default=None, help="write final parameters here (one file per rank)")
    args = p.parse_args()

    init_distributed("gloo")  # use "nccl" and tensors on cuda:LOCAL_RANK on GPUs
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = hiersync.register(ddp, opt, period=args.period, overlap=True)

    start = 0
    latest = args.ckpt / "latest"
    if latest.exists():
        start = int(latest.read_text())
        ckpt = torch.load(args.ckpt / f"step{start}-rank{rank}.pt", weights_only=False)
        ddp.module.load_state_dict(ckpt["model"])  # after DDP's construction-time broadcast
        opt.load_state_dict(ckpt["opt"])
        state.load_state_dict(ckpt["hiersync"])
        if rank == 0:
            print(f"resumed at step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})", flush=True)

    for step in range(start, args.steps):
        if step == args.crash_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.ckpt_every == 0:
            blob = {"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hiersync": state.state_dict()}
            atomic_save(args.ckpt / f"step{step + 1}-rank{rank}.pt", lambda tmp, blob=blob: torch.save(blob, tmp))
            dist.barrier()  # every rank's file is complete before 'latest' names it
            if rank == 0:
                atomic_write_text(latest, str(step + 1))

    if args.out is not None:
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        atomic_save(args.out / f"rank{rank}.pt", lambda tmp: torch.save(flat, tmp))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
