"""Time to loss: the example LM on the emulated 2 x 2 testbed, DDP vs post-local SGD vs hiersync.

Trains examples/lm_torchrun.py's model (a byte-level GPT on the Python standard library,
examples/_lm.py) under ``python -m hiersync testbed --nodes 2 --procs-per-node 2`` with
every schedule on the same initial weights, the same per-rank batches and the same lr
schedule; only the synchronization differs:

* ``ddp``: DDP's all-reduce every step (no hook), the reference.
* ``postlocal_k4``: PyTorch's post-local SGD (``post_localSGD_hook`` on intra-node
  subgroups + ``PeriodicModelAverager(period=4)``).
* ``hiersync_k4``: ``hiersync.register(ddp, opt, period=4)`` (blocking sync after the step).
* ``hiersync_k4_stream``: ``period=4, fragments=4, overlap=1`` (streaming).
* ``hiersync_k2_stream``: ``period=2, fragments=2, overlap=1`` (streaming at k=2: each step
  syncs half the model, hidden behind the next step).

With ``--peers torchft`` (``pip install 'hiersync[peers]'``), torchft's rows beside them, built as
the bench builds them (:mod:`hiersync.tools.bench_torchft`: a Lighthouse, one replica group
per node, DDP over the node's ranks inside it), on the same data and seeds:

* ``torchft_diloco_k4``: ``DiLoCo(sync_every=4)``, the whole model as one fragment;
* ``torchft_diloco_k4_d3``: the same with ``fragment_sync_delay=3``, the fastest configuration
  torchft accepts at ``sync_every=4`` in the bench (its all-reduce starts 3 steps before the
  step that applies it; the 3 local steps taken meanwhile are dropped then);
* ``torchft_streaming_k4``: Streaming DiLoCo, ``DiLoCo`` with 2 fragments and
  ``fragment_sync_delay=1`` (torchft refuses 4 fragments with a delay at ``sync_every=4``: it
  keeps one fragment in flight).

Both use an outer SGD step of lr 1 without momentum, which makes DiLoCo's outer step plain
parameter averaging, as in the hiersync rows beside them (``torchft_diloco_k4_nesterov``, not
in the default run: torchft's example outer optimizer, lr 0.7, Nesterov momentum 0.9).

Every ``--eval-every`` steps the ranks stop the clock, evaluate the validation loss of the
world-mean parameters (computed aside: the trajectory is not touched) and start it again;
the final value is measured after ``state.synchronize`` (post-local SGD: a parameter
all-reduce), included in the wall-clock. DDP runs ``--steps`` steps; the other schedules
run ``--max-steps-factor`` x as many (the lr held at its floor after ``--steps``), or, with
``--budget B``, an lr schedule sized to B x ``--steps`` that ends there, as a run planned for
a step budget would: the report then compares each schedule's final loss with DDP's, seed
by seed, with a 90% bootstrap interval over seeds.

**Seeds.** One seed's trajectory decides "steps to DDP's loss" by noise: on this model two
schedules that differ only in the step on which they average end 0.04 apart in val loss,
while seed-to-seed spread of that difference is as large. Every schedule therefore runs
every seed of ``--seeds`` (initial weights and batches; default 0,1,2), and the report
reads its mean curve over seeds: the target is DDP's mean final val loss, steps and
wall-clock to it are the first evaluation of the schedule's mean curve at or below it.
Each seed's own steps to its own DDP's loss are listed beside.

**Link rate.** A 2-core CPU box computes this model in a few hundred ms per step, so the
800 Mbit default link would make communication a small share of DDP's step: nothing like a
large model on a real cluster. The run first asks the planner (``python -m hiersync plan``,
``--plan-args``: by default a 7B model on 16 x 8 A100, one 100 Gb NIC per node,
``--preset a100-1nic``, forward 400 ms and backward 800 ms per step) what fraction of DDP's
step is exposed communication there, then measures this model's step without
communication (a no-op hook) and with DDP at ``--inter-rate``, prints the measured
fraction beside the planner's and the rate that would match it (communication time scales
as 1/rate). The default ``--inter-rate`` was picked that way on this machine
(docs/benchmarks.md, "Time to loss").

    sudo python benchmarks/time_to_loss.py --plot docs/img/time_to_loss.png

Writes ``time_to_loss.json`` (curves, table, planner output, measured fractions) and a
loss-vs-wall-clock PNG to ``--out`` (default results/time_to_loss). Needs root for the
shaped link (else plain loopback, which it says).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import _lm  # noqa: E402

SCHEDULES: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "postlocal_k4": None,
    "hiersync_k4": dict(period=4),
    "hiersync_k4_stream": dict(period=4, fragments=4, overlap=1),
    "hiersync_k2_stream": dict(period=2, fragments=2, overlap=1),
    # not in the default run: the loss-only comparisons of docs/benchmarks.md ("Time to loss")
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
DEFAULT_SCHEDULES = ["ddp", "postlocal_k4", "hiersync_k4", "hiersync_k4_stream", "hiersync_k2_stream"]
PEER_SCHEDULES = {"torchft": ["torchft_diloco_k4", "torchft_diloco_k4_d3", "torchft_streaming_k4"]}
PLAN_ARGS = "--preset a100-1nic --params 7e9 --nodes 16 --gpus-per-node 8 --forward-ms 400 --backward-ms 800"


# ---------------------------------------------------------------- one rank (under the testbed's torchrun)
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
    elif SCHEDULES.get(name) is not None:
        state = hiersync.register(ddp, opt, **SCHEDULES[name])

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
    if peer is not None:
        peer.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver
def _launch(a: argparse.Namespace, schedule: str, max_steps: int, seed: int, schedule_steps: int | None = None) -> dict:
    """One testbed run of ``schedule``; its lr schedule spans ``schedule_steps`` (default ``--steps``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "hiersync", "testbed", "--nodes", "2", "--procs-per-node", "2"]
        cmd += ["--inter-rate", a.inter_rate, "--timeout", str(a.timeout), "--log-dir", tmp]
        cmd += ["--", str(Path(__file__).resolve()), "--worker", "--schedule", schedule, "--out", str(out)]
        cmd += ["--steps", str(schedule_steps or a.steps), "--max-steps", str(max_steps)]
        cmd += ["--eval-every", str(a.eval_every)]
        cmd += ["--seed", str(seed), *a.lm_args]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            logs = "".join(p.read_text()[-4000:] for p in sorted(Path(tmp).glob("*.log")))
            raise SystemExit(f"{schedule} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}\n{logs}")
        result = json.loads(out.read_text())
        result["launch_s"] = time.perf_counter() - t0
        shaped = "network namespaces" in proc.stderr + "".join(p.read_text() for p in Path(tmp).glob("*.log"))
        result["link"] = f"tbf {a.inter_rate}" if shaped else "loopback (not shaped)"
    result["seed"] = seed
    print(
        f"  seed {seed} {schedule:20s} {result['steps']:5d} steps {result['wall_s']:7.1f} s"
        f"  final val {result['final_val_loss']:.4f}"
        f"  (launch {result['launch_s']:.0f} s)",
        flush=True,
    )
    return result


def plan_fraction(plan_args: str) -> dict[str, Any]:
    """DDP's exposed-communication share of the step at its best bucket size, per the planner."""
    cmd = [sys.executable, "-m", "hiersync", "plan", *plan_args.split()]
    text = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in text.splitlines():
        if line.startswith("ddp "):
            nums = [float(v.replace(",", "")) for v in line.split()[1:5]]
            rows.append(dict(bucket_mb=nums[0], comm_ms=nums[1], exposed_ms=nums[2], step_ms=nums[3]))
    best = min(rows, key=lambda r: r["step_ms"])
    best_hier = re.search(r"recommend: .*?step ([\d,.]+) ms, ([\d.]+)x vs best DDP", text)
    return dict(
        command="python -m hiersync plan " + plan_args,
        ddp=best,
        exposed_fraction=best["exposed_ms"] / best["step_ms"],
        recommended_step_ms=float(best_hier.group(1).replace(",", "")) if best_hier else None,
        recommended_speedup=float(best_hier.group(2)) if best_hier else None,
    )


def reach(evals: list[dict], target: float) -> dict | None:
    """The first evaluation after step 0 at or below ``target``."""
    return next((e for e in evals if e["step"] > 0 and e["val_loss"] <= target), None)


def mean_curve(runs: list[dict]) -> list[dict]:
    """Mean validation loss and wall-clock over seeds, at the evaluation steps every seed has."""
    steps = sorted(set.intersection(*({e["step"] for e in r["evals"]} for r in runs)))
    by_seed = [{e["step"]: e for e in r["evals"]} for r in runs]
    return [
        dict(
            step=s,
            wall_s=sum(b[s]["wall_s"] for b in by_seed) / len(runs),
            val_loss=sum(b[s]["val_loss"] for b in by_seed) / len(runs),
            spread=max(b[s]["val_loss"] for b in by_seed) - min(b[s]["val_loss"] for b in by_seed),
        )
        for s in steps
    ]


def ratio_interval(
    runs: dict[str, list[dict]], name: str, steps: int, level: float = 0.9, draws: int = 2000
) -> dict[str, tuple[float, float]] | None:
    """Bootstrap interval over seeds of ``name``'s steps and wall-clock to DDP's loss, as x DDP's.

    Each draw resamples the seeds with replacement, the same seeds for DDP and ``name`` (a
    seed gives both the same weights and batches), and recomputes the target (DDP's mean
    final loss over the drawn seeds), DDP's mean wall-clock and the first evaluation of
    ``name``'s mean curve at or below the target; a draw that never reaches it counts as
    ``inf``. Returns the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of both ratios
    (``inf`` as the upper end: not reached in that share of the draws), or None with fewer
    than 3 seeds. Deterministic (a fixed generator seed).
    """
    ddp, rs = runs["ddp"], runs[name]
    n = len(ddp)
    if n < 3 or len(rs) != n:
        return None
    rng = random.Random(0)
    got: dict[str, list[float]] = {"steps": [], "wall": []}
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        target = sum(ddp[i]["final_val_loss"] for i in idx) / n
        hit = reach(mean_curve([rs[i] for i in idx]), target)
        got["steps"].append(hit["step"] / steps if hit else math.inf)
        got["wall"].append(hit["wall_s"] / (sum(ddp[i]["wall_s"] for i in idx) / n) if hit else math.inf)

    return {k: _interval(v, level) for k, v in got.items()}


def _interval(draws: list[float], level: float) -> tuple[float, float]:
    """The ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of bootstrap draws."""
    xs = sorted(draws)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]
    return at((1 - level) / 2), at((1 + level) / 2)


def final_gap(runs: dict[str, list[dict]], name: str, level: float = 0.9, draws: int = 2000) -> dict[str, float]:
    """``name``'s final val loss minus DDP's, seed by seed: the mean and a bootstrap interval over seeds."""
    gaps = [r["final_val_loss"] - d["final_val_loss"] for r, d in zip(runs[name], runs["ddp"])]
    rng = random.Random(0)
    lo, hi = _interval([sum(rng.choice(gaps) for _ in gaps) / len(gaps) for _ in range(draws)], level)
    return {"mean": sum(gaps) / len(gaps), "lo": lo, "hi": hi}


def summarize(runs: dict[str, list[dict]], steps: int) -> tuple[float, list[dict]]:
    """DDP's mean final loss (the target) and one row per schedule, from every seed's run.

    Steps and wall-clock to the target are read off the schedule's mean curve over seeds
    (DDP's own: its ``steps`` and mean wall-clock); ``per_seed_steps`` is each seed's first
    evaluation at or below *that seed's* DDP final loss (None: not reached).
    """
    ddp = runs["ddp"]
    target = sum(r["final_val_loss"] for r in ddp) / len(ddp)
    ddp_wall = sum(r["wall_s"] for r in ddp) / len(ddp)
    rows = []
    for name, rs in runs.items():
        curve = mean_curve(rs)
        hit = dict(step=steps, wall_s=ddp_wall) if name == "ddp" else reach(curve, target)
        at = next((e for e in curve if e["step"] == steps), None)
        own = [None if name == "ddp" else reach(r["evals"], d["final_val_loss"]) for r, d in zip(rs, ddp)]
        row = dict(
            schedule=name,
            s_per_step=sum(r["wall_s"] / r["steps"] for r in rs) / len(rs),
            val_at_ddp_steps=at["val_loss"] if at else None,
            spread_at_ddp_steps=at["spread"] if at else None,
            final_val_loss=sum(r["final_val_loss"] for r in rs) / len(rs),
            steps_run=max(r["steps"] for r in rs),
            steps_to_target=hit["step"] if hit else None,
            wall_to_target=hit["wall_s"] if hit else None,
            per_seed_steps=[steps if name == "ddp" else h["step"] if h else None for h in own],
            curve=curve,
        )
        row["wall_x_ddp"] = row["wall_to_target"] / ddp_wall if hit else None
        row["steps_x_ddp"] = row["steps_to_target"] / steps if hit else None
        row["interval_90"] = None if name == "ddp" else ratio_interval(runs, name, steps)
        rows.append(row)
    return target, rows


def plot(runs: dict[str, list[dict]], rows: list[dict], target: float, path: Path, title: str) -> None:
    """Mean loss over seeds vs wall-clock and vs steps; each seed's curve faint behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, row in enumerate(rows):
        color = f"C{i}"
        for r in runs[row["schedule"]] if len(runs[row["schedule"]]) > 1 else []:
            ev = [e for e in r["evals"] if e["step"] > 0]
            axes[0].plot([e["wall_s"] for e in ev], [e["val_loss"] for e in ev], color=color, alpha=0.2, lw=0.8)
            axes[1].plot([e["step"] for e in ev], [e["val_loss"] for e in ev], color=color, alpha=0.2, lw=0.8)
        ev = [e for e in row["curve"] if e["step"] > 0]
        label = row["schedule"] + (" (mean of seeds)" if len(runs[row["schedule"]]) > 1 else "")
        axes[0].plot([e["wall_s"] for e in ev], [e["val_loss"] for e in ev], color=color, marker=".", label=label)
        axes[1].plot([e["step"] for e in ev], [e["val_loss"] for e in ev], color=color, marker=".", label=label)
    for ax, xl in zip(axes, ["wall-clock s (training only)", "step"]):
        ax.axhline(target, color="gray", ls="--", lw=0.8, label="DDP's final val loss")
        ax.set_xlabel(xl)
        ax.set_ylabel("val loss (world-mean parameters)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def table(rows: list[dict], steps: int, target: float, seeds: list[int]) -> str:
    def fmt(v: float | None, spec: str) -> str:
        return "not reached" if v is None else format(v, spec)

    def ci(r: dict, key: str) -> str:
        iv = r.get("interval_90")
        if not iv:
            return ""
        lo, hi = (f"{v:.2f}" if math.isfinite(v) else "not reached" for v in iv[key])
        return f" ({lo}-{hi})"

    mean = "mean of seeds " + ",".join(map(str, seeds)) if len(seeds) > 1 else f"seed {seeds[0]}"
    lines = [
        f"| schedule | s/step | val loss at step {steps} ({mean}; spread) | steps to DDP's final loss {target:.4f} "
        "| wall-clock s to it | wall-clock vs DDP (90% interval over seeds) | steps vs DDP (90% interval) "
        "| per seed: steps to its DDP's loss |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        spread = f" ({r['spread_at_ddp_steps']:.3f})" if r["spread_at_ddp_steps"] is not None and len(seeds) > 1 else ""
        per_seed = ", ".join("-" if v is None else str(v) for v in r["per_seed_steps"])
        lines.append(
            f"| {r['schedule']} | {r['s_per_step']:.3f} | {fmt(r['val_at_ddp_steps'], '.4f')}{spread} "
            f"| {fmt(r['steps_to_target'], 'd')} | {fmt(r['wall_to_target'], '.1f')} "
            f"| {fmt(r['wall_x_ddp'], '.2f')}{ci(r, 'wall')} | {fmt(r['steps_x_ddp'], '.2f')}{ci(r, 'steps')} "
            f"| {per_seed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)  # --seed is not --seeds
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--schedule", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="results/time_to_loss", help="folder for time_to_loss.json (+ png)")
    p.add_argument("--plot", default=None, help="PNG path (default OUT/time_to_loss.png)")
    p.add_argument("--steps", type=int, default=300, help="DDP's steps (the others: at least this many)")
    p.add_argument("--max-steps-factor", type=float, default=1.25, help="the others run this x steps")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="instead: the others train an lr schedule sized to BUDGET x --steps and stop there, and the "
        "report compares their final loss with DDP's (how a run is planned: a step budget, the schedule fit to it)",
    )
    p.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[0, 1, 2],
        help="comma-separated seeds (initial weights and data); every schedule runs each (default 0,1,2)",
    )
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--inter-rate", default="50mbit", help="tbf rate of each node's egress (see the docstring)")
    p.add_argument("--probe-steps", type=int, default=30, help="steps of the compute-only and DDP probes")
    p.add_argument("--plan-args", default=PLAN_ARGS, help="the real setting whose DDP exposed fraction to match")
    p.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(SCHEDULES))
    p.add_argument(
        "--peers",
        nargs="+",
        default=[],
        choices=list(PEER_SCHEDULES),
        help="add other libraries' rows: torchft (its DiLoCo and Streaming DiLoCo at k=4; "
        "pip install 'hiersync[peers]')",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="per testbed launch, seconds")
    a, rest = p.parse_known_args(argv)
    if a.worker:
        args = _lm.parser("worker").parse_args(rest, namespace=a)
        args.max_steps = args.max_steps or args.steps
        worker(args)
        return 0
    a.lm_args = rest  # any examples/_lm.py flag: --batch-size, --dim, --layers, --lr, ...
    for peer in a.peers:
        a.schedules = list(dict.fromkeys(a.schedules + PEER_SCHEDULES[peer]))
    if any(n in TORCHFT for n in a.schedules):
        from hiersync.tools.bench_torchft import require_torchft

        require_torchft()  # ImportError naming the extra, before any run
    if _lm.parser("check").parse_args(rest).seed != 0:
        p.error("pass seeds with --seeds (every schedule runs each), not --seed")

    t_start = time.perf_counter()
    plan = plan_fraction(a.plan_args)
    print(
        f"planner ({plan['command']}): DDP's best step {plan['ddp']['step_ms']:,.0f} ms, exposed communication "
        f"{plan['ddp']['exposed_ms']:,.0f} ms = {plan['exposed_fraction']:.0%} of the step",
        flush=True,
    )
    print(f"probes on the testbed at {a.inter_rate} ({a.probe_steps} steps):", flush=True)
    probe = argparse.Namespace(**{**vars(a), "steps": a.probe_steps})
    compute = _launch(probe, "compute_only", a.probe_steps, a.seeds[0])
    ddp_probe = _launch(probe, "ddp", a.probe_steps, a.seeds[0])
    c_step, d_step = compute["wall_s"] / compute["steps"], ddp_probe["wall_s"] / ddp_probe["steps"]
    measured = max(0.0, 1 - c_step / d_step)
    f = plan["exposed_fraction"]
    rate = float(re.match(r"[\d.]+", a.inter_rate).group()) if re.match(r"[\d.]+", a.inter_rate) else math.nan
    unit = re.sub(r"^[\d.]+", "", a.inter_rate)
    # exposed comm scales ~ 1/rate; want exposed = f/(1-f) x compute
    match_rate = rate * (d_step - c_step) / (f / (1 - f) * c_step) if d_step > c_step else math.nan
    print(
        f"  step without communication {c_step * 1e3:.0f} ms, DDP {d_step * 1e3:.0f} ms: exposed communication "
        f"{measured:.0%} of DDP's step (planner {f:.0%}); the rate that would match: ~{match_rate:.0f}{unit}",
        flush=True,
    )

    if a.budget is not None and not a.budget >= 1:
        p.error(f"--budget={a.budget} must be >= 1 (a multiple of DDP's --steps)")
    max_steps = int(round(a.steps * a.budget)) if a.budget else int(a.steps * a.max_steps_factor)
    sized = max_steps if a.budget else a.steps  # the others' lr schedule
    how = "with their lr schedule sized to that budget" if a.budget else "the lr held at its floor after --steps"
    print(f"training, seeds {a.seeds}: DDP {a.steps} steps, the others {max_steps} ({how}):", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in ["ddp", *(n for n in a.schedules if n != "ddp")]}
    for seed in a.seeds:
        for name in runs:
            ddp = name == "ddp"
            runs[name].append(_launch(a, name, a.steps if ddp else max_steps, seed, a.steps if ddp else sized))
    target, rows = summarize(runs, a.steps)
    md = table(rows, a.steps, target, a.seeds)
    ddp_wall = rows[0]["wall_to_target"]
    print(f"\ntarget: DDP's final val loss {target:.4f} after {a.steps} steps, {ddp_wall:.1f} s\n{md}")
    for row in rows:
        if row["schedule"].startswith("hiersync"):
            ok = row["wall_x_ddp"] is not None and row["wall_x_ddp"] <= 0.4 and row["steps_x_ddp"] <= 1.1
            verdict = "met" if ok else "NOT met"
            iv = row["interval_90"]
            if iv:  # whether the seeds pin it down: the interval's upper end must meet it too
                sure = iv["wall"][1] <= 0.4 and iv["steps"][1] <= 1.1
                verdict += f" (90% interval over seeds: steps {iv['steps'][0]:.2f}-{iv['steps'][1]:.2f}x, " + (
                    "met throughout)" if sure else "not met throughout)"
                )
            print(f"goal (<= 0.4x DDP's wall-clock at <= 1.1x its steps), {row['schedule']}: {verdict}")
    if a.budget:
        ddp_final = sum(r["final_val_loss"] for r in runs["ddp"]) / len(runs["ddp"])
        shaped = runs["ddp"][0]["link"].startswith("tbf")
        print(f"\nwith a {a.budget:g}x step budget ({max_steps} steps, the lr schedule sized to it):")
        for row in rows[1:]:
            rs = runs[row["schedule"]]
            gap = row["budget_gap"] = final_gap(runs, row["schedule"])
            wall = sum(r["wall_s"] for r in rs) / len(rs) / ddp_wall
            row["budget_wall_x_ddp"] = wall
            reached = gap["mean"] <= 0
            if shaped:
                met = reached and a.budget <= 1.1 and wall <= 0.4
                verdict = f"wall-clock {wall:.2f}x DDP's: goal {'met' if met else 'NOT met'} on the mean"
            else:  # loopback: the wall-clock says nothing about a slow network
                got = "reached" if reached else "NOT reached"
                verdict = f"DDP's loss {got} on the mean (link not shaped: no wall-clock)"
            print(
                f"  {row['schedule']}: final val loss {row['final_val_loss']:.4f} vs DDP's {ddp_final:.4f} "
                f"({gap['mean']:+.4f}, 90% interval over seeds {gap['lo']:+.4f}..{gap['hi']:+.4f}), {verdict}"
                + ("; the interval spans 0: the seeds do not decide it" if gap["lo"] < 0 < gap["hi"] else "")
            )

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    png = Path(a.plot) if a.plot else out / "time_to_loss.png"
    title = (
        f"byte-level GPT on the stdlib, 2x2 testbed, {runs['ddp'][0]['link']}, seeds {a.seeds}; "
        f"DDP exposed comm {measured:.0%} (planner, 7B on 16x8 A100 1 NIC: {f:.0%})"
    )
    plot(runs, rows, target, png, title)
    command = "python benchmarks/time_to_loss.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "time_to_loss.json").write_text(
        json.dumps(
            dict(
                command=command.strip(),
                inter_rate=a.inter_rate,
                budget=a.budget,
                link=runs["ddp"][0]["link"],
                seeds=a.seeds,
                plan=plan,
                probe=dict(compute_s_per_step=c_step, ddp_s_per_step=d_step, exposed_fraction=measured),
                matching_rate=match_rate,
                target=target,
                table=rows,
                markdown=md,
                results=runs,
                loadavg=os.getloadavg(),
                total_s=time.perf_counter() - t_start,
            ),
            indent=1,
        )
    )
    print(f"wrote {out / 'time_to_loss.json'} and {png} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
