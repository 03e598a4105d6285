"""Convergence on real data: DDP's default all-reduce vs hiersync's schedules, same everything else.

Trains a small MLP (64-128-10) on scikit-learn's digits dataset (1797 8x8 images; it ships
inside the package, nothing is downloaded) on 2 emulated nodes x 2 ranks (gloo, CPU). Every
schedule sees the same initial weights, the same per-rank data shards in the same order and
the same learning-rate schedule; only the gradient/parameter synchronization differs:

* ``ddp``: DDP's default all-reduce every step (no hook), the reference.
* ``k=1``: hiersync, exact two-level all-reduce every step (equals DDP to fp32 rounding).
* ``k=4``, ``k=8``: hierarchical local SGD (intra-node every step, parameters averaged across
  nodes every k steps), optionally with ``compress="bf16"`` deltas, ``overlap=True``, a
  DiLoCo outer Nesterov step, or streaming (``fragments=4, overlap=1``).

All hiersync schedules attach the optimizer (``hiersync.register(ddp, opt, ...)`` calls
``state.attach_optimizer(opt)``), so every rank is identical after each sync step. Intermediate
test accuracy is measured on the world-average of the parameters *without* writing it back
(so evaluating does not perturb training); the final numbers are measured after
``state.synchronize(model)``, which is what a user does before evaluating or saving.

Run it (3 seeds x 10 schedules x 600 steps, about 3 minutes on two cores)::

    python benchmarks/convergence.py --plot docs/img/convergence.png

It prints a Markdown table (means over seeds, and the worst seed's difference to DDP) and
writes ``convergence.json`` (raw curves and the table; default folder results/convergence)
and a PNG of the loss and accuracy curves. ``--schedules`` also offers k=16, k=32, two more
outer-optimizer settings, streaming with bf16 / int8 / int4 deltas (int4 also without error
feedback) and with AdamW's ``exp_avg`` averaged; ``--steps``, ``--seeds``, ``--lr``,
``--warmup-steps`` change the run. ``--task lm`` trains the example char-LM instead and
reports final validation losses (:mod:`convergence_lm`). The reusable pieces
(:func:`rank_main`, :func:`run`, :func:`summarize`) are imported by ``tests/test_convergence.py``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hiersync._io import atomic_save, atomic_write_json
from hiersync._table import render
from hiersync.tools.launch import run as launch

__all__ = ["SCHEDULES", "make_config", "rank_main", "run", "summarize", "markdown_table", "plot", "main"]

NODE_IDS = [0, 0, 1, 1]
"""2 emulated nodes x 2 ranks: ranks 0, 1 on node 0 and ranks 2, 3 on node 1."""

# name -> hiersync options (None = DDP's default all-reduce, no hook)
SCHEDULES: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "k=1": dict(period=1),
    "k=4": dict(period=4),
    "k=8": dict(period=8),
    "k=4 bf16": dict(period=4, compress="bf16"),
    "k=8 bf16": dict(period=8, compress="bf16"),
    "k=4 overlap": dict(period=4, overlap=True),
    "k=8 outer": dict(period=8, outer_lr=0.7, outer_momentum=0.9),
    # streaming: 4 fragments (the MLP's 4 tensors) on staggered steps, each applied one step late
    "k=4 stream": dict(period=4, fragments=4, overlap=1),
    "k=8 stream": dict(period=8, fragments=4, overlap=1),
    # not run by default: larger k; the outer step with less momentum, as plain averaging
    # (lr 1, momentum 0: must reproduce "k=8"), and at a more DiLoCo-like k
    "k=16": dict(period=16),
    "k=32": dict(period=32),
    "k=8 outer m=0.5": dict(period=8, outer_lr=0.7, outer_momentum=0.5),
    "k=8 outer lr=1 m=0": dict(period=8, outer_lr=1.0, outer_momentum=0.0),
    "k=32 outer": dict(period=32, outer_lr=0.7, outer_momentum=0.9),
    # fewer bits on the streaming rail; int8/int4: block-quantized, error feedback unless no-ef
    "k=4 stream bf16": dict(period=4, fragments=4, overlap=1, compress="bf16"),
    "k=4 stream int8": dict(period=4, fragments=4, overlap=1, compress="int8"),
    "k=4 stream int4": dict(period=4, fragments=4, overlap=1, compress="int4"),
    "k=4 stream int4 no-ef": dict(period=4, fragments=4, overlap=1, compress="int4", error_feedback=False),
    # AdamW's first moment averaged across nodes with the parameters (--task lm; digits uses SGD)
    "k=4 stream exp_avg": dict(period=4, fragments=4, overlap=1, average_optimizer_state=("exp_avg",)),
}
DEFAULT_SCHEDULES = list(SCHEDULES)[: list(SCHEDULES).index("k=16")]


def make_config(
    steps: int = 600,
    batch_size: int = 32,
    lr: float = 0.1,
    momentum: float = 0.9,
    warmup_steps: int = 0,
    eval_every: int = 25,
    test_fraction: float = 0.3,
    hidden: int = 128,
    seed: int = 0,
) -> dict[str, Any]:
    """The training configuration shared by every schedule (a plain dict: it crosses processes).

    ``batch_size`` is per rank (global batch = 4x). ``lr`` is the peak of a cosine decay to 0
    over ``steps``; ``warmup_steps`` is hiersync's exact-sync warmup (not an lr warmup).
    """
    if steps < 1 or batch_size < 1 or eval_every < 1 or warmup_steps < 0:
        raise ValueError(
            f"need steps >= 1, batch_size >= 1, eval_every >= 1, warmup_steps >= 0; got steps={steps} "
            f"batch_size={batch_size} eval_every={eval_every} warmup_steps={warmup_steps}"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    return dict(
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        momentum=momentum,
        warmup_steps=warmup_steps,
        eval_every=eval_every,
        test_fraction=test_fraction,
        hidden=hidden,
        seed=seed,
    )


# ---------------------------------------------------------------- data and model
def load_data(cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits, split into a fixed train / test split (stratified, seeded), scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    # The split depends on the seed only, never on the schedule: every schedule sees the same data.
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=cfg["test_fraction"], random_state=cfg["seed"], stratify=y
    )
    as_x = lambda a: torch.tensor(a, dtype=torch.float32) / 16.0  # pixel values are 0..16
    as_y = lambda a: torch.tensor(a, dtype=torch.long)
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def batch_order(num_samples: int, rank: int, world_size: int, cfg: dict[str, Any]) -> torch.Tensor:
    """Indices into the train split of every batch this rank trains on, ``[steps, batch_size]``.

    Rank r owns shard ``perm[r::world_size]`` of a seeded permutation and walks it in a fresh
    seeded shuffle each epoch. Deterministic in (seed, rank): identical for every schedule.
    """
    g = torch.Generator().manual_seed(cfg["seed"])
    shard = torch.randperm(num_samples, generator=g)[rank::world_size]
    g = torch.Generator().manual_seed(1_000_003 * (cfg["seed"] + 1) + rank)
    need = cfg["steps"] * cfg["batch_size"]
    epochs = [shard[torch.randperm(len(shard), generator=g)] for _ in range(math.ceil(need / len(shard)))]
    return torch.cat(epochs)[:need].view(cfg["steps"], cfg["batch_size"])


def make_model(cfg: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(cfg["seed"])  # same initial weights for every schedule (and every rank)
    return torch.nn.Sequential(torch.nn.Linear(64, cfg["hidden"]), torch.nn.ReLU(), torch.nn.Linear(cfg["hidden"], 10))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, params: dict[str, torch.Tensor] | None, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy in %) of ``model`` (with ``params`` swapped in, if given)."""
    out = torch.func.functional_call(model, params, (x,)) if params is not None else model(x)
    loss = torch.nn.functional.cross_entropy(out, y).item()
    acc = 100.0 * (out.argmax(dim=1) == y).float().mean().item()
    return loss, acc


@torch.no_grad()
def world_mean_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The world-average of the parameters, computed aside (the model is not modified).

    A plain all-reduce on the default group, outside hiersync: measuring must neither
    perturb the training trajectory nor show up in hiersync's byte counters.
    """
    names = [n for n, _ in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    out, offset = {}, 0
    for name, p in zip(names, model.parameters()):
        out[name] = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    return out


# ---------------------------------------------------------------- one rank
def train_one(name: str, options: dict[str, Any] | None, cfg: dict[str, Any], data: tuple) -> dict[str, Any]:
    """Train one schedule on this rank; return its curves and counters (rank 0 adds test metrics)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    rank, world = dist.get_rank(), dist.get_world_size()
    x_tr, y_tr, x_te, y_te = data
    order = batch_order(len(x_tr), rank, world, cfg)
    module = make_model(cfg)
    ddp = DDP(module)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["steps"])
    state = None
    if options is not None:
        options = dict(options)
        options.setdefault("warmup_steps", cfg["warmup_steps"])
        state = hiersync.register(ddp, opt, **options)

    losses: list[float] = []
    evals: list[dict[str, float]] = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(cfg["steps"]):
        idx = order[step]
        loss = torch.nn.functional.cross_entropy(ddp(x_tr[idx]), y_tr[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        if (step + 1) % cfg["eval_every"] == 0 and step + 1 < cfg["steps"]:
            avg = world_mean_params(module)
            if rank == 0:
                test_loss, test_acc = evaluate(module, avg, x_te, y_te)
                evals.append(dict(step=step + 1, test_loss=test_loss, test_acc=test_acc))
    train_s = time.perf_counter() - start

    # Counters before the final synchronize(): they describe training, not the final average.
    stats = state.stats.as_dict() if state is not None else None
    if state is not None:
        state.synchronize(ddp)  # every rank now holds the world-average parameters
    result: dict[str, Any] = dict(name=name, options=options, rank=rank, losses=losses, train_s=train_s, stats=stats)
    if rank == 0:
        test_loss, test_acc = evaluate(module, None, x_te, y_te)
        train_loss, train_acc = evaluate(module, None, x_tr, y_tr)
        evals.append(dict(step=cfg["steps"], test_loss=test_loss, test_acc=test_acc))
        result.update(
            evals=evals,
            final_test_acc=test_acc,
            final_test_loss=test_loss,
            final_train_loss=train_loss,
            final_train_acc=train_acc,
        )
    dist.barrier()
    return result


def rank_main(
    schedules: dict[str, dict[str, Any] | None], cfgs: Sequence[dict[str, Any]], datasets: Sequence[tuple]
) -> list[list[dict[str, Any]]]:
    """Runs on every rank (under ``hiersync.tools.launch``): every config (seed), every schedule in turn."""
    torch.set_num_threads(1)
    return [
        [train_one(name, options, cfg, data) for name, options in schedules.items()]
        for cfg, data in zip(cfgs, datasets)
    ]


# ---------------------------------------------------------------- driver
def run(
    schedules: Sequence[str] | Mapping[str, dict[str, Any] | None],
    cfgs: Sequence[dict[str, Any]],
    timeout: float = 900.0,
) -> list[dict[str, dict[str, Any]]]:
    """Train ``schedules`` for each config on 2x2 emulated nodes, in one launch.

    ``schedules`` are names from :data:`SCHEDULES`, or a mapping name -> hiersync options
    (``None`` = DDP's default) for experiments. Returns one dict per config: schedule name ->
    results merged over the ranks.
    """
    if not isinstance(schedules, Mapping):
        unknown = [s for s in schedules if s not in SCHEDULES]
        if unknown:
            raise ValueError(f"unknown schedules {unknown}; choose from {list(SCHEDULES)}")
        schedules = {name: SCHEDULES[name] for name in schedules}
    schedules = dict(schedules)
    # Load (and split) once here rather than importing scikit-learn in every rank.
    datasets = [load_data(cfg) for cfg in cfgs]
    per_rank = launch(
        rank_main,
        len(NODE_IDS),
        (schedules, list(cfgs), datasets),
        node_ids=NODE_IDS,
        timeout=timeout,
        pg_timeout=120.0,
    )
    return [
        {name: _merge(name, [r[c][i] for r in per_rank]) for i, name in enumerate(schedules)} for c in range(len(cfgs))
    ]


def _merge(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    head = ranks[0]
    stats = [r["stats"] for r in ranks]
    hier = stats[0] is not None
    return dict(
        name=name,
        options=head["options"],
        # per-step training loss, averaged over the 4 ranks' minibatches
        loss=[statistics.fmean(v) for v in zip(*(r["losses"] for r in ranks))],
        evals=head["evals"],
        final_test_acc=head["final_test_acc"],
        final_test_loss=head["final_test_loss"],
        final_train_loss=head["final_train_loss"],
        final_train_acc=head["final_train_acc"],
        train_s=max(r["train_s"] for r in ranks),
        # bytes each rank sent over the inter-node links during training, averaged over ranks
        inter_bytes=statistics.fmean(s["bytes_sent"]["inter"] for s in stats) if hier else None,
        intra_bytes=statistics.fmean(s["bytes_sent"]["intra"] for s in stats) if hier else None,
        sync_steps=stats[0]["sync_steps"] if hier else None,
        exact_steps=stats[0]["exact_steps"] if hier else None,
    )


def summarize(runs: Sequence[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One table row per schedule; with several seeds, metrics are means over seeds."""
    names = list(runs[0])
    ref_bytes = statistics.fmean(r["k=1"]["inter_bytes"] for r in runs) if "k=1" in names else None
    ddp_acc = statistics.fmean(r["ddp"]["final_test_acc"] for r in runs) if "ddp" in names else None
    rows = []
    for name in names:
        acc = [r[name]["final_test_acc"] for r in runs]
        inter = [r[name]["inter_bytes"] for r in runs]
        mean_acc = statistics.fmean(acc)
        deltas = None if ddp_acc is None else [a - r["ddp"]["final_test_acc"] for a, r in zip(acc, runs)]
        row = dict(
            schedule=name,
            test_acc=mean_acc,
            test_acc_per_seed=acc,
            delta_vs_ddp=None if ddp_acc is None else mean_acc - ddp_acc,
            delta_per_seed=deltas,
            worst_delta=None if deltas is None else max(deltas, key=abs),
            train_loss=statistics.fmean(r[name]["final_train_loss"] for r in runs),
            inter_bytes=None if inter[0] is None else statistics.fmean(inter),
            train_s=statistics.fmean(r[name]["train_s"] for r in runs),
        )
        if name == "ddp":
            row["inter_rel"] = 1.0 if ref_bytes is not None else None  # by definition: the k=1 volume
        elif row["inter_bytes"] is not None and ref_bytes:
            row["inter_rel"] = row["inter_bytes"] / ref_bytes
        else:
            row["inter_rel"] = None
        rows.append(row)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], num_seeds: int) -> str:
    """The table the script prints; with several seeds every metric is a mean over seeds."""
    many = num_seeds > 1
    acc_head = f"final test acc (%, mean of {num_seeds} seeds)" if many else "final test acc (%)"
    delta_head = "delta vs DDP (points, mean / worst seed)" if many else "delta vs DDP (points)"
    table = []
    for r in rows:
        if r["schedule"] == "ddp" or r["delta_vs_ddp"] is None:
            delta = "-"
        else:
            delta = f"{r['delta_vs_ddp']:+.2f}" + (f" / {r['worst_delta']:+.2f}" if many else "")
        rel = "-" if r["inter_rel"] is None else f"{r['inter_rel']:.3f}"
        if r["schedule"] == "ddp" and r["inter_rel"] is not None:
            rel += " (= k=1)"
        table.append([r["schedule"], f"{r['test_acc']:.2f}", delta, f"{r['train_loss']:.4f}", rel])
    head = ["schedule", acc_head, delta_head, "final train loss", "inter-node bytes vs DDP"]
    return render(head, table, markdown=True)


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(runs: Sequence[dict[str, dict[str, Any]]], path: str | Path, title: str) -> Path:
    """Train loss (moving average) and test accuracy vs step for every schedule, mean over seeds."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImportError("the convergence plot needs matplotlib: pip install matplotlib") from e

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in runs[0]:
        style = dict(lw=1.6 if name in ("ddp", "k=1") else 1.1, ls="--" if name == "ddp" else "-")
        loss = [statistics.fmean(v) for v in zip(*(r[name]["loss"] for r in runs))]
        ax_loss.plot(range(1, len(loss) + 1), _smooth(loss, 20), label=name, **style)
        steps = [e["step"] for e in runs[0][name]["evals"]]
        acc = [statistics.fmean(v) for v in zip(*([e["test_acc"] for e in r[name]["evals"]] for r in runs))]
        ax_acc.plot(steps, acc, label=name, **style)
    ax_loss.set(xlabel="step", ylabel="train loss (moving avg of 20 steps)", yscale="log", title="training loss")
    ax_acc.set(xlabel="step", ylabel="test accuracy (%)", title="test accuracy (world-average model)")
    ax_acc.set_ylim(85, 100)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        return atomic_save(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    d = make_config()
    p.add_argument("--out", default="results/convergence", help="folder for convergence.json and convergence.png")
    p.add_argument("--plot", default=None, help="PNG path (default OUT/convergence.png)")
    p.add_argument(
        "--schedules",
        nargs="+",
        default=DEFAULT_SCHEDULES,
        choices=list(SCHEDULES),
        metavar="NAME",
        help=f"schedules to run, from {list(SCHEDULES)}",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the table: means over seeds, worst seed")
    p.add_argument("--steps", type=int, default=None, help=f"default {d['steps']}; --task lm: 300")
    # Shared with --task lm (passed on to examples/_lm.py, whose defaults apply when unset):
    p.add_argument("--batch-size", type=int, default=None, help=f"per rank (default {d['batch_size']}; lm: 16)")
    p.add_argument(
        "--lr", type=float, default=None, help=f"peak lr of the cosine schedule (default {d['lr']}; lm: 3e-3)"
    )
    p.add_argument("--warmup-steps", type=int, default=None, help="hiersync exact-sync warmup (default 0)")
    # The digits task only:
    p.add_argument("--momentum", type=float, default=None, help=f"SGD momentum (default {d['momentum']})")
    p.add_argument("--eval-every", type=int, default=None, help=f"steps (default {d['eval_every']})")
    p.add_argument("--hidden", type=int, default=None, help=f"MLP width (default {d['hidden']})")
    p.add_argument("--timeout", type=float, default=900.0, help="wall-clock limit of the whole run, seconds")
    p.add_argument("--task", choices=("digits", "lm"), default="digits", help="lm: convergence_lm.py's char-LM")
    p.add_argument("--eval-batches", type=int, default=64, help="lm: validation batches of the final loss")
    p.add_argument("--refs", nargs="*", default=["ddp"], metavar="NAME", help="lm: schedules the gaps are to")
    a, extra = p.parse_known_args(argv)  # --task lm: any other examples/_lm.py flag passes through
    if a.task == "lm":
        import convergence_lm

        digits_only = [
            f"--{k.replace('_', '-')}" for k in ("momentum", "eval_every", "hidden") if getattr(a, k) is not None
        ]
        if digits_only:
            verb = "applies" if len(digits_only) == 1 else "apply"
            p.error(f"{', '.join(digits_only)} {verb} to --task digits only (the LM's flags are examples/_lm.py's)")
        for k in ("batch_size", "lr", "warmup_steps"):  # before ``extra``: the same flag given twice, the last wins
            if getattr(a, k) is not None:
                extra = [f"--{k.replace('_', '-')}", str(getattr(a, k)), *extra]
        a.steps = a.steps or 300
        return convergence_lm.main(a, {n: SCHEDULES[n] for n in a.schedules}, extra)
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    a.steps = a.steps or d["steps"]
    for k in ("batch_size", "lr", "momentum", "warmup_steps", "eval_every", "hidden"):
        if getattr(a, k) is None:
            setattr(a, k, d[k])

    configs = [
        make_config(
            steps=a.steps,
            batch_size=a.batch_size,
            lr=a.lr,
            momentum=a.momentum,
            warmup_steps=a.warmup_steps,
            eval_every=a.eval_every,
            hidden=a.hidden,
            seed=seed,
        )
        for seed in a.seeds
    ]
    t0 = time.perf_counter()
    runs = run(a.schedules, configs, timeout=a.timeout)
    wall = time.perf_counter() - t0
    rows = summarize(runs)
    table = markdown_table(rows, len(a.seeds))
    cfg = configs[0]
    command = "python benchmarks/convergence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(a.out)
    atomic_write_json(
        out / "convergence.json",
        dict(command=command.strip(), config=configs, seeds=a.seeds, node_ids=NODE_IDS, wall_s=wall)
        | dict(schedules={n: SCHEDULES[n] for n in a.schedules}, table=rows, runs=runs),
    )
    title = (
        f"digits, MLP 64-{cfg['hidden']}-10, 2 nodes x 2 ranks, {cfg['steps']} steps, batch {cfg['batch_size']}/rank, "
        f"SGD lr {cfg['lr']} cosine, momentum {cfg['momentum']}, warmup {cfg['warmup_steps']}; "
        f"mean of seeds {', '.join(map(str, a.seeds))}"
    )
    png = plot(runs, a.plot or out / "convergence.png", title)

    print(table)
    print()
    print(
        f"{len(a.seeds)} seed(s), {cfg['steps']} steps, wall {wall:.1f} s; wrote {out / 'convergence.json'} and {png}"
    )
    if "ddp" in a.schedules:
        rated = [r for r in rows if r["schedule"] != "ddp" and r["worst_delta"] is not None]
        near = [r["schedule"] for r in rated if abs(r["worst_delta"]) <= 1.0]
        far = [r["schedule"] for r in rated if abs(r["worst_delta"]) > 1.0]
        every = " on every seed" if len(a.seeds) > 1 else ""
        print(f"within 1 point of DDP{every}: {', '.join(near) or 'none'}")
        print(f"more than 1 point from DDP{' on some seed' if every else ''}: {', '.join(far) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
