"""Convergence of the example char-LM: final validation loss per schedule, seeds side by side.

``python benchmarks/convergence.py --task lm`` lands here. It trains examples/_lm.py's
byte-level GPT (2 layers x 128, about 440K parameters, the Python standard library as text;
the model of examples/lm_torchrun.py and benchmarks/time_to_loss.py) on 2 emulated nodes x
2 ranks (gloo, CPU, plain loopback: the link is not shaped, only the result matters) with
AdamW and the example's warmup + cosine lr schedule. Every schedule sees the same initial
weights and the same batches (seeded by seed, rank and step); only the synchronization
differs. The final parameters are ``state.synchronize(model)``'s world average, and the
final loss is measured on ``--eval-batches`` fixed validation batches.

The table gives, per schedule, the final validation loss of every seed and their mean, the
mean relative gap to each reference schedule (``--refs``, e.g. DDP and bf16 at the same k),
and the inter-node bytes per synchronization, scales included, from ``stats``.

    python benchmarks/convergence.py --task lm --seeds 0 1 2 --schedules ddp "k=4 stream bf16" \
        "k=4 stream int4" "k=4 stream int4 no-ef" --refs ddp "k=4 stream bf16"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hiersync._io import atomic_write_json
from hiersync._table import render
from hiersync.tools.launch import run as launch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import _lm

__all__ = ["lm_args", "train_one", "rank_main", "run", "summarize", "markdown_table", "main"]

NODE_IDS = [0, 0, 1, 1]


def lm_args(seed: int, steps: int, eval_batches: int, extra: Sequence[str] = ()) -> argparse.Namespace:
    """The example LM's arguments (its defaults, then ``extra``: any examples/_lm.py flag)."""
    argv = ["--seed", str(seed), "--steps", str(steps), "--eval-batches", str(eval_batches), *extra]
    return _lm.parser("convergence").parse_args(argv)


def train_one(name: str, options: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    """Train one schedule on this rank; return its losses, final validation loss and counters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    rank = dist.get_rank()
    device = torch.device("cpu")
    train, val = _lm.load_text(args.text_mb)
    model = _lm.GPT(args)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lm.lr_at(s, args))
    state = hiersync.register(ddp, opt, **options) if options is not None else None
    losses: list[float] = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = _lm.train_batch(train, args, rank, step, device)
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    train_s = time.perf_counter() - start
    stats = state.stats.as_dict() if state is not None else None
    if state is not None:
        state.synchronize(ddp)
    final = _lm.evaluate(model, val, args, device)
    if state is not None:
        state.close()
    dist.barrier()
    return dict(name=name, options=options, losses=losses, final_val_loss=final, train_s=train_s, stats=stats)


def rank_main(schedules: dict[str, dict[str, Any] | None], cfgs: Sequence[argparse.Namespace]) -> list[list[dict]]:
    """Runs on every rank: every seed, every schedule in turn."""
    torch.set_num_threads(1)
    return [[train_one(name, options, args) for name, options in schedules.items()] for args in cfgs]


def run(
    schedules: Mapping[str, dict[str, Any] | None], cfgs: Sequence[argparse.Namespace], timeout: float
) -> list[dict[str, dict[str, Any]]]:
    """Train every schedule for every config on 2x2 emulated nodes, in one launch; one dict per config."""
    per_rank = launch(
        rank_main, len(NODE_IDS), (dict(schedules), list(cfgs)), node_ids=NODE_IDS, timeout=timeout, pg_timeout=120.0
    )
    out = []
    for c in range(len(cfgs)):
        runs = {}
        for i, name in enumerate(schedules):
            ranks = [r[c][i] for r in per_rank]
            stats = [r["stats"] for r in ranks]
            hier = stats[0] is not None
            inter = statistics.fmean(s["bytes_sent"]["inter"] for s in stats) if hier else None
            syncs = stats[0]["sync_steps"] if hier else None
            runs[name] = dict(
                name=name,
                options=ranks[0]["options"],
                loss=[statistics.fmean(v) for v in zip(*(r["losses"] for r in ranks))],
                final_val_loss=ranks[0]["final_val_loss"],
                train_s=max(r["train_s"] for r in ranks),
                inter_bytes=inter,
                sync_steps=syncs,
                inter_bytes_per_sync=inter / syncs if hier and syncs else None,
            )
        out.append(runs)
    return out


def summarize(runs: Sequence[dict[str, dict[str, Any]]], refs: Sequence[str]) -> list[dict[str, Any]]:
    """One row per schedule: per-seed and mean final loss, mean relative gap to each reference."""
    rows = []
    for name in runs[0]:
        per_seed = [r[name]["final_val_loss"] for r in runs]
        row: dict[str, Any] = dict(schedule=name, per_seed=per_seed, mean=statistics.fmean(per_seed))
        for ref in refs:
            gaps = [r[name]["final_val_loss"] / r[ref]["final_val_loss"] - 1.0 for r in runs]
            row[f"gap:{ref}"] = dict(mean=statistics.fmean(gaps), per_seed=gaps, worst=max(gaps))
        per_sync = [r[name]["inter_bytes_per_sync"] for r in runs]
        row["inter_bytes_per_sync"] = None if per_sync[0] is None else statistics.fmean(per_sync)
        rows.append(row)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], refs: Sequence[str], seeds: Sequence[int]) -> str:
    head = ["schedule", *(f"seed {s}" for s in seeds), "mean", *(f"vs {ref} (mean / worst seed)" for ref in refs)]
    table = []
    for r in rows:
        cells = [f"{v:.4f}" for v in r["per_seed"]] + [f"{r['mean']:.4f}"]
        for ref in refs:
            g = r[f"gap:{ref}"]
            cells.append("-" if r["schedule"] == ref else f"{100 * g['mean']:+.2f}% / {100 * g['worst']:+.2f}%")
        b = r["inter_bytes_per_sync"]
        cells.append("-" if b is None else f"{b / 1e3:.1f}")
        table.append([r["schedule"], *cells])
    return render([*head, "inter KB per sync"], table, markdown=True)


def main(a: argparse.Namespace, schedules: Mapping[str, dict[str, Any] | None], extra: Sequence[str]) -> int:
    """``convergence.py --task lm``: ``a`` carries seeds, steps, eval_batches, refs, out, timeout."""
    missing = [ref for ref in a.refs if ref not in schedules]
    if missing:
        raise ValueError(f"--refs {missing} must be among --schedules {list(schedules)}")
    cfgs = [lm_args(seed, a.steps, a.eval_batches, extra) for seed in a.seeds]
    t0 = time.perf_counter()
    out = Path(a.out)
    runs: list[dict[str, dict[str, Any]]] = []
    for i, cfg in enumerate(cfgs):  # one launch per seed; the JSON is rewritten after each
        runs += run(schedules, [cfg], a.timeout)
        wall = time.perf_counter() - t0
        rows = summarize(runs, a.refs)
        atomic_write_json(
            out / "convergence_lm.json",
            dict(
                command="python benchmarks/convergence.py " + " ".join(sys.argv[1:]),
                lm_args=[vars(c) for c in cfgs[: i + 1]],
                seeds=a.seeds[: i + 1],
                node_ids=NODE_IDS,
                wall_s=wall,
                schedules=dict(schedules),
                table=rows,
                runs=runs,
            ),
        )
    table = markdown_table(rows, a.refs, a.seeds)
    c = cfgs[0]
    print(table)
    print()
    print(
        f"char-LM {c.layers}x{c.dim}, {c.steps} steps, batch {c.batch_size}x{c.block}/rank, AdamW lr {c.lr}, "
        f"{c.eval_batches} validation batches; {len(a.seeds)} seed(s), wall {wall:.1f} s; "
        f"wrote {out / 'convergence_lm.json'}"
    )
    return 0
