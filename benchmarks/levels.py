"""Three levels (node -> rack -> world) against two, on the emulated testbed with a slow spine.

4 emulated nodes x 1 rank in 2 racks of 2 nodes (network namespaces, each node's egress shaped
with htb: ``--rack-rate`` to the other node of its rack, ``--world-rate`` to the other rack),
DDP over an MLP (``--params``, fp32), SGD. Side by side in one run, each mode in fresh
processes, the modes alternated over ``--rounds``:

* two levels, ``period=rack_period`` (every node averaged with every other every 4 steps),
* two levels, ``period=world_period``,
* three levels, ``rack_period`` / ``world_period`` (nodes averaged with their rack every 4
  steps, with the other rack every 16).

Printed: the mean step (95% confidence interval from the per-step times), the ratio to the
two-level run at the rack's period, the bytes each rank sent per level, and the cost model's
prediction (:mod:`hiersync.costmodel.racks`, the ``emulated`` preset with the spine at the
world rate). ``--compute accel`` (default): layers that sleep while the host idles, as on an
accelerator; ``cpu``: real CPU compute, which competes with gloo's socket work on this box.
Needs root and iproute2 (else it runs on loopback, unshaped, and says so)::

    python benchmarks/levels.py                 # about 3 minutes on 2 cores
    python benchmarks/levels.py --compute cpu --rounds 1
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rank_main(cfg: dict) -> dict:
    """One rank: train ``cfg["steps"]`` steps with ``cfg["options"]``; per-step times and bytes."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync
    from hiersync.tools.bench_compute import build_model

    torch.manual_seed(0)
    model, data, loss_fn = build_model("mlp", cfg, compute=cfg["compute"])
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    state = hiersync.register(ddp, opt, **cfg["options"])
    gen = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        x, y = data(step, gen)
        loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    state.synchronize(ddp)
    return {"times": times[cfg["skip"] :], "bytes": dict(state.stats.bytes_sent), "racks": state.topology.racks}


def _ci95(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    return m, 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=4e6, help="MLP parameters (default 4e6: 16 MB of fp32)")
    p.add_argument("--rack-rate", default="800mbit", help="tc rate between the nodes of a rack")
    p.add_argument("--world-rate", default="100mbit", help="tc rate between racks")
    p.add_argument("--rack-period", type=int, default=4)
    p.add_argument("--world-period", type=int, default=16)
    p.add_argument("--compute", choices=("accel", "cpu"), default="accel")
    p.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternated")
    args = p.parse_args(argv)

    from hiersync._table import render
    from hiersync.costmodel import get_preset
    from hiersync.costmodel.racks import price_levels
    from hiersync.tools.cluster import run_ranks
    from hiersync.tools.netns import parse_rate

    kr, kw = args.rack_period, args.world_period
    modes = {
        f"two levels, period={kr}": dict(period=kr),
        f"two levels, period={kw}": dict(period=kw),
        f"three levels, {kr} / {kw}": dict(period=kw, rack_period=kr),
    }
    steps = 2 * kw + kr  # two world windows after a first rack window
    cfg = dict(
        mlp_depth=4, mlp_params=args.params, batch_size=32, accel_layer_ms=25.0, compute=args.compute,
        steps=steps + kr, skip=kr,
    )  # fmt: skip
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    times: dict[str, list[float]] = {m: [] for m in modes}
    sent: dict[str, dict] = {}
    where = ""
    for _ in range(args.rounds):
        for name, options in modes.items():
            results, info = run_ranks(
                "levels:rank_main", dict(cfg, options=options), nodes=4, procs_per_node=1,
                inter_rate=args.rack_rate, nodes_per_rack=2, world_rate=args.world_rate, timeout=900,
            )  # fmt: skip
            where = info["describe"]
            times[name] += [t for r in results for t in r["times"]]
            sent[name] = results[0]["bytes"]
    print(f"hiersync three levels on {where}; {args.compute} compute, {args.params:.3g} fp32 parameters, "
          f"{args.rounds} rounds x {steps} steps per mode (the first {kr} of each run not timed)")  # fmt: skip
    base = _ci95(times[f"two levels, period={kr}"])[0]
    profile = get_preset("emulated")
    ratio = profile.inter.beta * parse_rate(args.world_rate) / 8  # the spine's bytes/s against the NIC's
    rows = price_levels(
        replace(profile, ranks_per_node=1, nodes=4),
        params=args.params, nodes=4, nodes_per_rack=2, oversubscription=2 / ratio, compute_s=0.0,
        rack_period=kr, period=kw,
    )  # fmt: skip
    table = []
    for (name, ts), row in zip(times.items(), rows):
        m, ci = _ci95(ts)
        b = sent[name]
        cells = [name, f"{m * 1e3:.1f}", f"{ci * 1e3:.1f}", f"{base / m:.2f}x"]
        table.append(
            [*cells, f"{b.get('rack', 0) / 1e6:.1f}", f"{b.get('inter', 0) / 1e6:.1f}", f"{row.step_s * 1e3:.1f}"]
        )
    head = ["mode", "step ms", "95% CI", f"vs 2-level k={kr}", "rack MB", "world MB", "model sync ms/step"]
    print(render(head, table))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
