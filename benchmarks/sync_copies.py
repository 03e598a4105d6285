"""Host-side copy time of one cross-node sync's launch and completion.

Compares, in one process with the communication mocked (no processes, no network), the
whole-vector average of the pure hook (``HookAverager``: ``torch.cat`` of the chunk's
parameters, delta and cast of the whole vector, whole-vector target maths) with the
rail-sharded one after ``optimizer.step()`` (``ReplicatedNodeAverager``: this rank's 1/L
shard only, in-place target maths), for an 8-layer
MLP of 8.4M parameters, bf16 deltas and the outer Nesterov step, as a rank of a node of L
ranks sees it. The node gather of the sharded path is a collective and is not timed here.

    python benchmarks/sync_copies.py [--ranks-per-node 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from hiersync.averagers import ReplicatedNodeAverager
from hiersync.futures import completed
from hiersync.localsgd import HookAverager, Registry
from hiersync.quant import codec_for
from hiersync.topology import Topology
from hiersync.transport import GroupRail


def _fake_comm(L: int):
    groups = types.SimpleNamespace(node_size=L, local_rank=0)
    return types.SimpleNamespace(
        topology=Topology.from_node_ids([n for n in range(2) for _ in range(L)]),
        groups=groups,
        rail=GroupRail(None, 2),
        average_across_nodes=lambda t: completed(t),
        average_shard=lambda t: completed(t),
    )


def _time(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1024, 1024)) for _ in range(8)]
    comm = _fake_comm(args.ranks_per_node)
    opts = dict(codec=codec_for("bf16"), outer_lr=0.7, outer_momentum=0.9)
    registry = Registry()
    idx = registry.register(params)
    whole = HookAverager(comm, registry, **opts)
    whole.capture_anchor(params)
    sharded = ReplicatedNodeAverager(comm, registry, **opts)
    sharded.capture([idx])

    def cycle_whole() -> None:  # launch, complete, correction against a snapshot
        snapshot = torch.cat([p.detach().reshape(-1) for p in params])
        whole.complete(whole.launch(params)).sub_(snapshot)

    def cycle_sharded() -> None:  # the same through the rail average's own snapshot
        c = sharded.chunk(idx)
        snapshot = torch.empty(c.s)
        sharded.complete(sharded._launch(c, keep=snapshot)).sub_(snapshot)

    t_whole, t_shard = _time(cycle_whole, args.repeats), _time(cycle_sharded, args.repeats)
    n = sum(p.numel() for p in params)
    print(f"{n / 1e6:.1f}M parameters, bf16 deltas + outer Nesterov, L={args.ranks_per_node}, median of {args.repeats}")
    print(f"whole-vector launch+complete: {t_whole * 1e3:7.1f} ms")
    print(f"1/L shard    launch+complete: {t_shard * 1e3:7.1f} ms  ({t_shard / t_whole:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
