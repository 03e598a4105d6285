"""``python -m hiersync bench --slow NODE=FACTOR``: throughput with slow nodes, side by side.

Every rank trains the bench's accelerator-like MLP (:mod:`.bench_compute`: each layer sleeps, the
CPU idle); a slow node's layers sleep ``1 / FACTOR`` as long. One run measures, in turn:

* ``alone``: every node on its own (hiersync with no sync in the run: the node's own averages
  only), its step time: the ideal is the sum of the nodes' own rates;
* ``ddp``: DistributedDataParallel's all-reduce every step;
* ``fixed`` and ``adaptive``: hiersync streaming (``period``, ``fragments``, ``overlap=1``)
  under each pace, timed over ``windows`` windows after two untimed ones (adaptive pace paces
  from the third window on: :mod:`hiersync.tally`).

Throughput is samples per second over all ranks (each rank's steps times its batch, over the
slowest rank's wall time), each row's as a fraction of the ideal measured in the same run, and
beside it what the cost model predicts for the same speeds (:func:`hiersync.costmodel.pace.paced`,
from the fastest node's measured step alone). :func:`worker` runs on every rank
(:func:`hiersync.tools.cluster.run_ranks`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["worker", "summarize", "run"]

logger = logging.getLogger(__name__)

ROWS = ("alone", "ddp", "fixed", "adaptive")
ALONE_STEPS = 16


def _train_step(ddp: Any, opt: Any, data: Any, loss_fn: Any, gen: Any) -> None:
    x, y = data(0, gen)
    loss_fn(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def worker(config: dict) -> dict[str, Any]:
    """Every rank: the rows of :data:`ROWS` in turn; per row this rank's steps and timed wall seconds."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    from .bench_compute import build_model

    rank = dist.get_rank()
    node = hiersync.Topology.detect().node_of(rank)
    factor = float(config["slow"].get(node, config["slow"].get(str(node), 1.0)))
    model_cfg = {**config, "accel_layer_ms": float(config["accel_layer_ms"]) / factor}
    k, windows = int(config["period"]), int(config["windows"])
    out: dict[str, Any] = {"node": node, "factor": factor, "rows": {}}
    for row in config["rows"]:
        torch.manual_seed(0)
        model, data, loss_fn = build_model("mlp", model_cfg, "accel")
        gen = torch.Generator().manual_seed(rank)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        state = None
        if row == "alone":
            state = hiersync.register(ddp, opt, period=10**9)
        elif row != "ddp":
            state = hiersync.register(
                ddp, opt, period=k, fragments=int(config["fragments"]), overlap=1, pace=row, chunk_mb=25.0
            )

        step = functools.partial(_train_step, ddp, opt, data, loss_fn, gen)

        if row in ("alone", "ddp"):
            n = ALONE_STEPS if row == "alone" else int(config["ddp_steps"])
            for _ in range(2):
                step()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            wall, steps = time.perf_counter() - t0, n
        else:
            assert state is not None
            while state.window < 2:
                step()
            dist.barrier()
            t0, s0 = time.perf_counter(), state.step
            while state.window < 2 + windows:
                step()
            wall, steps = time.perf_counter() - t0, state.step - s0
        if state is not None:
            state.drain()
        dist.barrier()
        if state is not None:
            state.close()
        out["rows"][row] = {"steps": steps, "wall_s": wall, "batch": int(config["batch_size"])}
        logger.info("bench --slow: rank %d row %s: %d steps in %.2f s", rank, row, steps, wall)
    return out


def summarize(results: list[dict], config: dict) -> list[dict[str, Any]]:
    """Per row: samples/s over all ranks, its fraction of the ideal, the model's prediction."""
    from hiersync.costmodel.pace import paced

    nodes = sorted({r["node"] for r in results})
    alone: dict[int, list[float]] = {r["node"]: [] for r in results}
    for r in results:
        a = r["rows"]["alone"]
        alone[r["node"]].append(a["wall_s"] / a["steps"])
    step_alone = {n: sum(v) / len(v) for n, v in alone.items()}
    ideal = sum(r["rows"]["alone"]["batch"] / step_alone[r["node"]] for r in results)
    fast = min(step_alone.values())
    speeds = [fast / step_alone[n] for n in nodes]  # as measured: a node's CPU work does not slow with its FACTOR
    per_node = len(results) // len(nodes)
    out = []
    for row in config["rows"]:
        if row == "alone":
            continue
        wall = max(r["rows"][row]["wall_s"] for r in results)
        samples = sum(r["rows"][row]["steps"] * r["rows"][row]["batch"] for r in results)
        steps = {r["node"]: r["rows"][row]["steps"] for r in results}
        predicted = None
        if row != "ddp":  # DDP's all-reduce of every step is not in this model (plan prices it)
            model = paced(speeds, compute_s=fast, period=int(config["period"]), pace=row)
            predicted = model.samples_per_s * results[0]["rows"][row]["batch"] * per_node
        out.append(
            {
                "row": row,
                "samples_per_s": samples / wall,
                "of_ideal": samples / wall / ideal,
                "steps_per_node": [steps[n] for n in nodes],
                "wall_s": wall,
                "predicted_per_s": predicted,
                "measured_over_predicted": samples / wall / predicted if predicted else None,
            }
        )
    out.append(
        {"row": "ideal", "samples_per_s": ideal, "of_ideal": 1.0, "step_alone_s": [step_alone[n] for n in nodes]}
    )
    return out


def table(rows: list[dict], config: dict) -> str:
    from hiersync._table import render

    body = []
    for r in rows:
        if r["row"] == "ideal":
            continue
        body.append(
            [
                r["row"],
                " ".join(map(str, r["steps_per_node"])),
                f"{r['samples_per_s']:.1f}",
                f"{r['of_ideal']:.3f}",
                "-" if r["predicted_per_s"] is None else f"{r['predicted_per_s']:.1f}",
                "-" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.3f}",
            ]
        )
    ideal = rows[-1]
    head = (
        f"slow nodes {config['slow']} (speed relative to full); ideal {ideal['samples_per_s']:.1f} samples/s "
        f"(each node alone: {', '.join(f'{t * 1e3:.0f} ms' for t in ideal['step_alone_s'])} a step)"
    )
    return (
        head
        + "\n"
        + render(["row", "steps per node", "samples/s", "of ideal", "model samples/s", "measured / model"], body)
    )


def run(args: Any) -> int:
    """``bench --slow``: one run of :data:`ROWS` on the emulated cluster; a table and ``pace.json``."""
    from hiersync.vocab import parse_count

    from .cluster import cluster_args, run_ranks
    from .testbed import parse_slow

    slow = parse_slow(args.slow, args.nodes)
    config = {
        "slow": slow,
        "rows": list(ROWS),
        "period": args.pace_period,
        "fragments": args.pace_fragments,
        "windows": args.pace_windows,
        "ddp_steps": args.pace_period * 2,
        "mlp_params": parse_count(args.mlp_params),
        "mlp_depth": args.mlp_depth,
        "batch_size": args.batch_size,
        "accel_layer_ms": args.accel_layer_ms,
    }
    load = os.getloadavg()[0]
    results, _ = run_ranks(
        "hiersync.tools.bench_pace:worker",
        config,
        **cluster_args(args),
        timeout=args.timeout or 1800.0,
    )
    rows = summarize(results, config)
    text = table(rows, config)
    print(text)
    print(f"load average before the run: {load:.2f}")
    folder = Path(args.results)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pace.json").write_text(json.dumps({"config": config, "rows": rows, "load_before": load}, indent=1))
    return 0
