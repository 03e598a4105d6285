"""The manager mode (torchft) side by side with the plain mode, and what a node's death costs.

Trains examples/lm_torchrun.py's model (examples/_lm.py) on 3 emulated nodes of 1 rank on
this machine (loopback gloo; real CPU compute), in two parts:

* **overhead**: the same run in hiersync's plain mode (one job, ``HIERSYNC_NODE_IDS``)
  and in the manager mode (three torchft replica groups and a Lighthouse), alternating,
  ``--repeats`` times, at each ``--periods``; the median step time of each and their ratio.
  Nothing fails: the difference is the quorum, the rail barrier and the commit of each
  window (one per sync; one per step at period 1).
* **death**: the manager mode again; once node 2 reported step ``--kill-at``, it is sent
  SIGKILL (wherever it is in its step). For the survivors: seconds from the kill to their
  next completed step, the longest step after it (the one whose quorum waited for the
  Lighthouse to declare node 2 dead: its ``--heartbeat-ms``), the median step, syncs
  dropped, and whether their step counter ever went back (steps lost).

    flock /tmp/hiersync-heavy.lock python benchmarks/fault_tolerance.py
    python benchmarks/fault_tolerance.py --parts overhead --periods 4 --options fragments=4,overlap=1,compress=int4
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS_BURN = 5


def _args(steps: int, period: int):
    sys.path.insert(0, str(ROOT / "examples"))
    import _lm

    return _lm, _lm.parser("").parse_args(
        ["--steps", str(steps), "--batch-size", "8", "--text-mb", "0.5", "--period", str(period)]
    )


def _train(ddp, opt, state, lm, args, node: int, device, report) -> list[float]:
    train, _ = lm.load_text(args.text_mb)
    times = []
    while state.step < args.steps:
        s = state.step
        t0 = time.perf_counter()
        x, y = lm.train_batch(train, args, node, s, device)
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        report(s)
    return times


def plain_rank(steps: int, period: int, options: dict | None = None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    lm, args = _args(steps, period)
    model = lm.GPT(args)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    state = hiersync.register(ddp, opt, period=period, **(options or {}))
    times = _train(ddp, opt, state, lm, args, dist.get_rank(), torch.device("cpu"), lambda s: None)
    return {"times": times}


def ft_rank(steps: int, period: int, options: dict | None = None) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync
    from hiersync.tools import ft_nodes

    lm, args = _args(steps, period)
    node = ft_nodes.node_index()
    model = lm.GPT(args)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    mgr = ft_nodes.manager(
        timeout_s=10.0,
        load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), opt.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": opt.state_dict()},
    )
    state = hiersync.register(ddp, opt, manager=mgr, period=period, start_nodes=3, **(options or {}))
    times = _train(ddp, opt, state, lm, args, node, torch.device("cpu"), lambda s: ft_nodes.progress(s))
    stats = state.stats.as_dict()
    mgr.shutdown(wait=False)
    return {"times": times, "stats": stats}


def _median(times: list[float]) -> float:
    return statistics.median(times[STEPS_BURN:])


def _mean(times: list[float]) -> float:
    """Mean step: sync steps (where the manager mode's quorum and commit are) included."""
    return statistics.fmean(times[STEPS_BURN:])


def overhead(periods: list[int], steps: int, repeats: int, options: dict) -> None:
    from hiersync._table import render
    from hiersync.tools.ft_nodes import Lighthouse, Nodes
    from hiersync.tools.launch import run

    rows = []
    for period in periods:
        plain: list[tuple[float, float]] = []
        ft: list[tuple[float, float]] = []
        for _ in range(repeats):
            res = run(plain_rank, 3, (steps, period, options), node_ids=[0, 1, 2], timeout=900)
            plain.append(
                (statistics.fmean(_mean(r["times"]) for r in res), statistics.median(_median(r["times"]) for r in res))
            )
            with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
                for n in range(3):
                    nodes.start(n, ft_rank, (steps, period, options))
                out = nodes.wait([0, 1, 2], timeout=900)
            per_node = [out[n][0]["times"] for n in range(3)]
            ft.append((statistics.fmean(_mean(t) for t in per_node), statistics.median(_median(t) for t in per_node)))
        pm, pmed = statistics.median(m for m, _ in plain), statistics.median(m for _, m in plain)
        fm, fmed = statistics.median(m for m, _ in ft), statistics.median(m for _, m in ft)
        rows.append((period, pm, fm, pmed, fmed))
        print(f"period {period}: plain (mean, median) {plain} s; manager {ft} s", flush=True)
    table = [
        [
            str(period),
            f"{pm * 1e3:.1f} ms ({pmed * 1e3:.1f})",
            f"{fm * 1e3:.1f} ms ({fmed * 1e3:.1f})",
            f"{fm / pm:.3f}",
        ]
        for period, pm, fm, pmed, fmed in rows
    ]
    head = ["period", "plain: mean step (median)", "manager: mean step (median)", "manager / plain, mean"]
    print("\n" + render(head, table, align="r", markdown=True))


def death(steps: int, period: int, kill_at: int, heartbeat_ms: int) -> None:
    from hiersync._table import render
    from hiersync.tools.ft_nodes import Lighthouse, Nodes

    with Lighthouse(min_replicas=1, heartbeat_timeout_ms=heartbeat_ms) as lh, Nodes(lh.address) as nodes:
        for n in range(3):
            nodes.start(n, ft_rank, (steps, period))
        nodes.wait_step(2, kill_at, timeout=600)
        died = nodes.kill(2)
        out = nodes.wait([0, 1], timeout=900)
        steps_of = {n: nodes.steps(n) for n in (0, 1)}
    print(f"\nnode 2 killed after it reported step {kill_at} (period {period}, heartbeat timeout {heartbeat_ms} ms)")
    table = []
    for n in (0, 1):
        rec = steps_of[n]
        after = [(s, t) for t, s, _ in rec if t > died]
        before = [t for t, _, _ in rec if t <= died]
        times = [before[-1]] + [t for _, t in after]
        longest = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1])
        order = [s for _, s, _ in rec]
        back = any(b < a for a, b in itertools.pairwise(order))
        stats = out[n][0]["stats"]
        stall = f"{times[longest] - times[longest - 1]:.2f} s (step {after[longest - 1][0]})"
        median = f"{_median(out[n][0]['times']):.3f} s"
        table.append(
            [str(n), f"{after[0][1] - died:.2f}", stall, median, str(stats["failed_syncs"]), "yes" if back else "no"]
        )
    head = ["survivor", "s to next completed step", "longest step after the kill", "median step", "syncs dropped"]
    print(render([*head, "step counter went back"], table, align="rrrrrl", markdown=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--periods", default="4,1", help="comma-separated periods of the overhead part")
    ap.add_argument("--steps", type=int, default=30, help="steps per run (the first 5 are not timed)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode and period (the median counts)")
    ap.add_argument("--kill-at", type=int, default=14, help="death part: kill node 2 once it reported this step")
    ap.add_argument("--heartbeat-ms", type=int, default=2000, help="death part: the Lighthouse's heartbeat timeout")
    ap.add_argument("--parts", default="overhead,death")
    ap.add_argument(
        "--options",
        default="",
        help="hiersync options of both modes, e.g. fragments=4,overlap=1,compress=int4 (values: int or text)",
    )
    a = ap.parse_args(argv)
    options = {k: int(v) if v.isdigit() else v for k, v in (kv.split("=", 1) for kv in a.options.split(",") if kv)}
    os.environ.setdefault("RUST_LOG", "error")
    print(f"load average before: {os.getloadavg()}", flush=True)
    parts = a.parts.split(",")
    if "overhead" in parts:
        overhead([int(p) for p in a.periods.split(",")], a.steps, a.repeats, options)
    if "death" in parts:
        death(max(a.steps, a.kill_at + 16), 4, a.kill_at, a.heartbeat_ms)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
