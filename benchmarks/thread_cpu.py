"""Where a rank's CPU goes per step, by thread: streaming against the intra-node-only step.

Two emulated nodes of two ranks on loopback (gloo, no shaped link), DDP over a 25M-parameter
MLP (4 x Linear(2500, 2500)), 0.3 s of sleep per step as accelerator-like compute (the CPU idle
while a device would compute). ``intra``: ``hiersync.register(ddp, opt, period=10**6)`` (every
step averages inside the node only); ``stream``: ``period=4, fragments=4, overlap=1``. Each
rank reads its threads' CPU from ``/proc/self/task`` over 20 steps after 10 warm-up steps.
Printed: per configuration and repeat, the ms of CPU per step of each rank and rank 0's
busiest threads. Linux only.

    python benchmarks/thread_cpu.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch

import hiersync
from hiersync.tools.launch import run

WARMUP, STEPS = 10, 20


def _thread_cpu_s() -> collections.Counter:
    """CPU seconds so far of each of this process's threads, summed by thread name."""
    out: collections.Counter = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[name] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _rank(stream: bool) -> dict[str, float]:
    torch.manual_seed(0)
    d = 2500
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(4)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-5)
    options = dict(period=4, fragments=4, overlap=1) if stream else dict(period=10**6, warmup_steps=0)
    state = hiersync.register(ddp, opt, **options)
    x = torch.randn(2, d)
    before = collections.Counter()
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            before = _thread_cpu_s()
        ddp(x).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.3)
    after = _thread_cpu_s()
    state.close()
    return {k: 1e3 * (after[k] - before.get(k, 0.0)) / STEPS for k in after if after[k] > before.get(k, 0.0)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for _ in range(args.repeats):
        for stream in (False, True):
            per_rank = run(_rank, 4, (stream,), node_ids=[0, 0, 1, 1], timeout=600)
            totals = [round(sum(r.values()), 1) for r in per_rank]
            top = dict(sorted(per_rank[0].items(), key=lambda kv: -kv[1])[:3])
            print(
                f"{'stream' if stream else 'intra '}  ms CPU per step, ranks {totals}; rank 0's busiest threads "
                f"{ {k: round(v, 1) for k, v in top.items()} }",
                flush=True,
            )


if __name__ == "__main__":
    main()
