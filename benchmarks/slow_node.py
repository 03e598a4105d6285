"""A slow node in a language-model run: wall-clock and samples to DDP's loss, fixed pace against adaptive.

Trains the time-to-loss task's model (examples/_lm.py: a byte-level GPT on the Python standard
library, AdamW, peak lr 1e-3) on the testbed's 2 nodes x 1 rank, with node 1 slowed to
``--factor`` of its speed: after each of its steps it sleeps ``(1 / factor - 1)`` x the step's
compute time, measured before training (forward and backward of the bare model, the fastest
rank's median), so it trains at about ``factor`` x the speed of node 0. Each rank computes on
one thread (2 nodes, one core each on the 2-core box), so a nap idles the slow node's core
without speeding the other: an accelerator at a lower clock, not a busier CPU. Rows (``--rows``):

* ``ddp``: DDP's all-reduce every step, both nodes at full speed: the target loss (its mean
  final validation loss over the seeds).
* ``fixed``: ``hiersync.register(ddp, opt, period=4, fragments=4, overlap=1)`` at full speed.
* ``fixed_slow``, ``adaptive_slow``, ``ddp_slow``: the same (``pace="adaptive"`` for the
  second) with node 1 at ``--factor``.

Every row is clocked by samples: its lr schedule (the example's warm-up and cosine over
``--steps``) and its evaluations follow the samples every node has trained, divided by the
nodes (DDP's step), so a row whose slow node trains fewer steps sees the same lr at the same
total samples. The hiersync rows read it from the windows: each window's steps on every node
(``state.tally.lengths`` under adaptive pace, ``period`` on each node under fixed) and this
node's place in the open one. The clock stops for evaluations (the world-mean model, at a
window's end, every ``--eval-every`` samples per node) and runs through the final
``synchronize()``. DDP runs ``--steps``; the others ``--max-steps-factor`` x those samples.

Printed per row, mean over ``--seeds`` with a 90% bootstrap interval: wall-clock and samples
to DDP's loss, node 0's own steps to it, and the val loss at DDP's total samples (``--steps``
per node) against the equal-speed ``fixed`` row's; then the goals: ``adaptive_slow``'s
wall-clock to DDP's loss against ``fixed_slow``'s (paired by seed), and its loss at equal
samples against ``fixed``'s.

    python benchmarks/slow_node.py --seeds 0,1,2 --factor 0.5 --out results/slow_node
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import _lm  # noqa: E402
from _ttl_stats import mean_interval, reach  # noqa: E402

from hiersync._table import render  # noqa: E402

ROWS = ("ddp", "fixed", "fixed_slow", "adaptive_slow", "ddp_slow")
SYNC = dict(period=4, fragments=4, overlap=1)
LR = 1e-3
SLOW_NODE = 1


# ---------------------------------------------------------------- every rank
def _compute_s(model: Any, train: Any, args: argparse.Namespace, rank: int, device: Any) -> float:
    """The fastest rank's median forward + backward of the bare model (no collectives): the nap's
    unit, the same on every rank (the minimum: a rank still starting up inflates the other's)."""
    import torch
    import torch.distributed as dist

    bare = copy.deepcopy(model)
    times = []
    dist.barrier()
    for i in range(12):
        x, y = _lm.train_batch(train, args, rank, 10**6 + i, device)
        t0 = time.perf_counter()
        _, loss = bare(x, y)
        loss.backward()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times[3:])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


class SampleClock:
    """Samples trained by every node, per node (DDP's step), from the windows of a hiersync row."""

    def __init__(self, state: Any, nodes: int, node: int) -> None:
        self.state, self.nodes, self.node = state, nodes, node
        self.done, self.window, self.steps_in = 0.0, state.window, 0
        self.lengths = self._lengths()

    def _lengths(self) -> list[int]:
        if self.state.tally is not None and self.state.windows is not None:
            return list(self.state.tally.lengths)
        return [self.state.period] * self.nodes

    def stepped(self) -> bool:
        """One step of this node taken; True when it closed a window."""
        self.steps_in += 1
        if self.state.window == self.window:
            return False
        self.done += sum(self.lengths) / self.nodes
        self.window, self.steps_in, self.lengths = self.state.window, 0, self._lengths()
        return True

    @property
    def samples(self) -> float:
        own = self.lengths[self.node]
        return self.done + sum(self.lengths) / self.nodes * min(1.0, self.steps_in / max(1, own))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    rank, _, device = _lm.setup()
    # one thread a rank: each node computes on a core of its own, and a slow node's nap does not
    # lend its core to the other (which would make the fast node faster than it is alone)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train, val = _lm.load_text(args.text_mb)
    model = _lm.GPT(args).to(device)
    probe = copy.deepcopy(model)
    topo = hiersync.Topology.detect()
    node, nodes = topo.node_of(rank), topo.num_nodes
    slow = args.row.endswith("_slow") and node == SLOW_NODE
    compute_s = _compute_s(model, train, args, rank, device)
    nap = (1 / args.factor - 1) * compute_s if slow else 0.0
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    state = None
    if not args.row.startswith("ddp"):
        state = hiersync.register(ddp, opt, **SYNC, pace="adaptive" if args.row.startswith("adaptive") else "fixed")
    clock = SampleClock(state, nodes, node) if state is not None else None
    evals: list[dict[str, float]] = []
    wall, steps, next_eval = 0.0, 0, args.eval_every

    @torch.no_grad()
    def evaluate(samples: float) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        torch.nn.utils.vector_to_parameters(flat / dist.get_world_size(), probe.parameters())
        own = torch.tensor([float(steps)])
        dist.all_reduce(own, op=dist.ReduceOp.MAX)  # node 0 is never the slow one: its steps
        evals.append(
            dict(step=samples, wall_s=wall, val_loss=_lm.evaluate(probe, val, args, device), steps0=own.item())
        )

    evaluate(0.0)
    dist.barrier()
    while True:
        samples = clock.samples if clock is not None else float(steps)
        for g in opt.param_groups:
            g["lr"] = args.lr * _lm.lr_at(int(samples), args)
        t0 = time.perf_counter()
        x, y = _lm.train_batch(train, args, rank, steps, device)
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if nap:
            time.sleep(nap)
        steps += 1
        closed = clock.stepped() if clock is not None else True
        samples = clock.samples if clock is not None else float(steps)
        wall += time.perf_counter() - t0
        last = samples >= args.max_steps
        if closed and (samples >= next_eval or last):
            dist.barrier()
            evaluate(samples)
            next_eval = (math.floor(samples / args.eval_every) + 1) * args.eval_every
            if last:
                break
            dist.barrier()
    t0 = time.perf_counter()
    if state is not None:
        state.synchronize(ddp)
    dist.barrier()
    wall += time.perf_counter() - t0
    final = _lm.evaluate(model, val, args, device)
    if rank == 0:
        out = dict(row=args.row, seed=args.seed, steps=steps, wall_s=wall, final_val_loss=final, evals=evals)
        out.update(compute_s=compute_s, factor=args.factor)
        Path(args.out).write_text(json.dumps(out))
    if state is not None:
        state.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver
def launch(a: argparse.Namespace, row: str, seed: int) -> dict:
    from time_to_loss import _run_testbed

    max_steps = a.steps if row.startswith("ddp") else round(a.steps * a.max_steps_factor)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "hiersync", "testbed", "--nodes", "2", "--procs-per-node", "1"]
        cmd += ["--inter-rate", a.inter_rate, "--timeout", str(a.timeout), "--log-dir", tmp, "--"]
        cmd += [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--row", row, "--seed", str(seed)]
        cmd += ["--steps", str(a.steps), "--max-steps", str(max_steps), "--eval-every", str(a.eval_every)]
        cmd += ["--factor", str(a.factor), "--lr", str(a.lr)]
        proc = _run_testbed(cmd)
        if proc.returncode != 0 or not out.exists():
            logs = "".join(p.read_text()[-4000:] for p in sorted(Path(tmp).glob("*.log")))
            raise SystemExit(f"{row} seed {seed} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}\n{logs}")
        result = json.loads(out.read_text())
    print(
        f"  seed {seed} {row:14s} {result['steps']:4d} steps (node 0) {result['wall_s']:6.1f} s"
        f"  final val {result['final_val_loss']:.4f}",
        flush=True,
    )
    return result


def loss_at(evals: list[dict], samples: float) -> float:
    """Val loss at ``samples`` per node, linear between evaluations."""
    xs = [e["step"] for e in evals]
    return float(np.interp(samples, xs, [e["val_loss"] for e in evals]))


def summarize(runs: dict[str, list[dict]], steps: int) -> tuple[float, list[dict], dict[str, Any]]:
    """DDP's mean final loss and one row per schedule; each seed's run is read against the final
    loss of DDP's run on the same seed (the same weights and batches), its target."""
    targets = [r["final_val_loss"] for r in runs["ddp"]]
    rows, hits = [], {}
    for name, rs in runs.items():
        hit = [reach(r["evals"], t) for r, t in zip(rs, targets)]
        hits[name] = hit
        got = [h for h in hit if h is not None]
        at = [loss_at(r["evals"], steps) for r in rs]
        steps0 = [
            float(np.interp(h["step"], [e["step"] for e in r["evals"]], [e["steps0"] for e in r["evals"]]))
            for h, r in zip(hit, rs)
            if h is not None
        ]
        rows.append(
            dict(
                row=name,
                reached=f"{len(got)}/{len(rs)}",
                wall=mean_interval([h["wall_s"] for h in got]) if got else None,
                samples=mean_interval([h["step"] for h in got]) if got else None,
                steps0=mean_interval(steps0) if steps0 else None,
                loss_at=mean_interval(at),
            )
        )
    goals: dict[str, Any] = {}
    if "adaptive_slow" in runs and "fixed_slow" in runs:
        pairs = [
            (a["wall_s"], f["wall_s"])
            for a, f in zip(hits["adaptive_slow"], hits["fixed_slow"])
            if a is not None and f is not None
        ]
        if pairs:
            goals["wall_adaptive_over_fixed_slow"] = mean_interval([a / f for a, f in pairs])
    if "adaptive_slow" in runs and "fixed" in runs:
        rel = [
            loss_at(a["evals"], steps) / loss_at(f["evals"], steps) - 1
            for a, f in zip(runs["adaptive_slow"], runs["fixed"])
        ]
        goals["loss_at_equal_samples_vs_fixed"] = mean_interval(rel)
    return statistics.fmean(targets), rows, goals


def _iv(iv: dict | None, spec: str = ".1f") -> str:
    if iv is None:
        return "not reached"
    return f"{iv['mean']:{spec}} [{iv['lo']:{spec}}, {iv['hi']:{spec}}]"


def report(target: float, rows: list[dict], goals: dict[str, Any], a: argparse.Namespace) -> str:
    head = [
        "row",
        "reached",
        "wall s to DDP's loss",
        "samples/node to it",
        "node 0 steps to it",
        f"val loss at {a.steps} samples/node",
    ]
    body = [
        [
            r["row"],
            r["reached"],
            _iv(r["wall"]),
            _iv(r["samples"], ".0f"),
            _iv(r["steps0"], ".0f"),
            _iv(r["loss_at"], ".4f"),
        ]
        for r in rows
    ]
    lines = [
        f"2 nodes x 1 rank, testbed link {a.inter_rate}, node {SLOW_NODE} at {a.factor}x in the *_slow rows; "
        f"k=4 streaming (F=4, overlap 1); seeds {a.seeds}; DDP's mean final val loss {target:.4f} (each seed's "
        "target: DDP's final loss on that seed); mean over seeds [90% bootstrap interval]",
        render(head, body),
    ]
    w = goals.get("wall_adaptive_over_fixed_slow")
    if w is not None:
        lines.append(f"adaptive_slow / fixed_slow wall-clock to DDP's loss: {_iv(w, '.3f')} (goal <= 0.75)")
    g = goals.get("loss_at_equal_samples_vs_fixed")
    if g is not None:
        lines.append(
            f"adaptive_slow's val loss at {a.steps} samples/node vs fixed's (equal speeds): "
            f"{g['mean']:+.2%} [{g['lo']:+.2%}, {g['hi']:+.2%}] (goal within 1%)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = _lm.parser(__doc__.split("\n\n")[0])
    p.set_defaults(lr=LR)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="results/slow_node", help="folder for slow_node.json")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--factor", type=float, default=0.5, help="node 1's speed in the *_slow rows")
    p.add_argument("--max-steps-factor", type=float, default=1.5, help="hiersync rows train this x DDP's samples")
    p.add_argument("--eval-every", type=int, default=20, help="samples per node between evaluations")
    p.add_argument("--inter-rate", default="800mbit", help="tbf rate of each node's egress")
    p.add_argument("--timeout", type=float, default=900.0, help="per testbed launch, seconds")
    p.add_argument("--from", dest="source", default=None, help="report the runs of a slow_node.json instead")
    a = p.parse_args(argv)
    if a.worker:
        a.max_steps = a.max_steps or a.steps
        worker(a)
        return 0
    if not 0 < a.factor <= 1:
        raise SystemExit(f"--factor {a.factor}: give a speed in (0, 1], e.g. 0.5")
    rows = [r for r in a.rows.split(",") if r]
    if "ddp" not in rows or any(r not in ROWS for r in rows):
        raise SystemExit(f"--rows {a.rows!r}: give rows of {', '.join(ROWS)}, ddp among them (the target)")
    seeds = [int(s) for s in a.seeds.split(",")]
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    if a.source is not None:
        saved = json.loads(Path(a.source).read_text())
        runs = saved["runs"]
        for k in ("seeds", "factor", "steps", "inter_rate"):
            setattr(a, k, saved["args"][k])
    for seed in seeds if a.source is None else ():
        for row in rows:
            runs[row].append(launch(a, row, seed))
    target, table, goals = summarize(runs, a.steps)
    text = report(target, table, goals, a)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slow_node.json").write_text(json.dumps(dict(args=vars(a), runs=runs, goals=goals), indent=1))
    (out / "slow_node.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
