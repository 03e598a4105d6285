"""The statistics and the report of benchmarks/time_to_loss.py: curves over seeds, intervals, table, plot.

Pure Python over the runs' JSON (no torch): each run is a dict with ``evals`` (a list of
``step``, ``wall_s``, ``val_loss``), ``final_val_loss``, ``wall_s`` and ``steps``; ``runs``
maps a schedule's name to its runs, one per seed, in the same seed order for every schedule.
The intervals over seeds are the bench's bootstrap (:func:`hiersync.tools.bench_noise.bootstrap_interval`,
scipy: ``pip install 'hiersync[bench]'``), the tables :func:`hiersync._table.render`'s.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from hiersync._table import render
from hiersync.tools.bench_noise import bootstrap_interval

__all__ = [
    "combine_steps",
    "timed_schedules",
    "warm_parts",
    "final_gap",
    "mean_interval",
    "mean_curve",
    "ratio_interval",
    "reach",
    "summarize",
    "table",
    "verdict",
    "plot",
]


def reach(evals: list[dict], target: float) -> dict | None:
    """Where ``evals`` first comes down to ``target`` after step 0, or None if it never does.

    Linear interpolation between that evaluation and the one before it (step and wall-clock
    alike): the evaluations are ``--eval-every`` steps apart, coarser than the ratios this
    benchmark compares (1.05x of 300 steps is 15 steps).
    """
    prev = None
    for e in evals:
        if e["step"] > 0 and e["val_loss"] <= target:
            if prev is None or prev["step"] == 0 or prev["val_loss"] <= e["val_loss"]:
                return dict(step=float(e["step"]), wall_s=e["wall_s"])
            f = (prev["val_loss"] - target) / (prev["val_loss"] - e["val_loss"])
            return dict(
                step=prev["step"] + f * (e["step"] - prev["step"]),
                wall_s=prev["wall_s"] + f * (e["wall_s"] - prev["wall_s"]),
            )
        prev = e
    return None


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
    final loss over the drawn seeds), DDP's mean wall-clock and where ``name``'s mean curve
    comes down to the target; a draw that never reaches it counts as ``inf``. Returns the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of both ratios (``inf`` as the upper
    end: not reached in that share of the draws), or None with fewer than 3 seeds.
    Deterministic (:func:`bootstrap_interval`: a fixed generator seed).
    """
    ddp, rs = runs["ddp"], runs[name]
    n = len(ddp)
    if n < 3 or len(rs) != n:
        return None

    def ratios(idx: np.ndarray) -> np.ndarray:  # one draw of seeds (indices, with repeats)
        target = sum(ddp[i]["final_val_loss"] for i in idx) / n
        hit = reach(mean_curve([rs[i] for i in idx]), target)
        if hit is None:
            return np.array([math.inf, math.inf])
        return np.array([hit["step"] / steps, hit["wall_s"] / (sum(ddp[i]["wall_s"] for i in idx) / n)])

    lo, hi = bootstrap_interval((np.arange(n),), ratios, level, vectorized=False, resamples=draws)
    return {k: (float(lo[i]), float(hi[i])) for i, k in enumerate(("steps", "wall"))}


def mean_interval(xs: list[float], level: float = 0.9, draws: int = 2000) -> dict[str, float]:
    """The mean of ``xs`` (one value per seed) and a bootstrap interval over seeds (one seed: a point)."""
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return {"mean": mean, "lo": mean, "hi": mean}
    lo, hi = bootstrap_interval((np.asarray(xs, dtype=float),), np.mean, level, resamples=draws)
    return {"mean": mean, "lo": float(lo), "hi": float(hi)}


def final_gap(runs: dict[str, list[dict]], name: str, level: float = 0.9, draws: int = 2000) -> dict[str, float]:
    """``name``'s final val loss minus DDP's, seed by seed: the mean and a bootstrap interval over seeds."""
    gaps = [r["final_val_loss"] - d["final_val_loss"] for r, d in zip(runs[name], runs["ddp"])]
    return mean_interval(gaps, level, draws)


def summarize(runs: dict[str, list[dict]], steps: int) -> tuple[float, list[dict]]:
    """DDP's mean final loss (the target) and one row per schedule, from every seed's run.

    Steps and wall-clock to the target are read off the schedule's mean curve over seeds
    (DDP's own: its ``steps`` and mean wall-clock); ``per_seed_steps`` is where each seed's
    curve comes down to *that seed's* DDP final loss (None: not reached); ``gap_at_steps``
    is the schedule's val loss at DDP's last step minus DDP's, seed by seed.
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
        at_seed = [next((e["val_loss"] for e in r["evals"] if e["step"] == steps), None) for r in rs]
        row: dict[str, Any] = dict(
            schedule=name,
            s_per_step=sum(r["wall_s"] / r["steps"] for r in rs) / len(rs),
            val_at_ddp_steps=at["val_loss"] if at else None,
            spread_at_ddp_steps=at["spread"] if at else None,
            gap_at_steps=[None if v is None else v - d["final_val_loss"] for v, d in zip(at_seed, ddp)],
            final_val_loss=sum(r["final_val_loss"] for r in rs) / len(rs),
            steps_run=max(r["steps"] for r in rs),
            steps_to_target=hit["step"] if hit else None,
            wall_to_target=hit["wall_s"] if hit else None,
            per_seed_steps=[steps if name == "ddp" else round(h["step"]) if h else None for h in own],
            curve=curve,
        )
        row["wall_x_ddp"] = row["wall_to_target"] / ddp_wall if hit else None
        row["steps_x_ddp"] = row["steps_to_target"] / steps if hit else None
        row["interval_90"] = None if name == "ddp" else ratio_interval(runs, name, steps)
        row["paired_gap"] = None if name == "ddp" or None in row["gap_at_steps"] else mean_interval(row["gap_at_steps"])
        rows.append(row)
    return target, rows


def verdict(row: dict, goal: float) -> str:
    """Whether ``row`` reaches DDP's loss in at most ``goal`` x its steps, as the seeds decide it.

    PASS: the 90% interval lies at or below ``goal``; FAIL: it lies above; else undecided.
    With no interval (fewer than 3 seeds) the mean curve's value only, said so.
    """
    x, iv = row["steps_x_ddp"], row.get("interval_90")
    mean = "not reached" if x is None else f"{x:.3f}x"
    if not iv:
        ok = x is not None and x <= goal
        return f"{'PASS' if ok else 'FAIL'} on the mean ({mean}; fewer than 3 seeds: no interval)"
    lo, hi = iv["steps"]
    span = f"{mean}, 90% interval {_x(lo, '.3f')}-{_x(hi, '.3f')}"
    if hi <= goal:
        return f"PASS ({span})"
    if lo > goal:
        return f"FAIL ({span})"
    return f"UNDECIDED ({span}: the interval spans {goal}x)"


_WARM = re.compile(r"_w(\d+)(?=_|$)")


def warm_parts(name: str) -> tuple[int, str] | None:
    """A warm-up row's ``(W, steady twin)``: ``hiersync_k4_stream_w150`` -> ``(150, "hiersync_k4_stream")``."""
    m = _WARM.search(name) if name.startswith("hiersync_") else None
    return (int(m.group(1)), name[: m.start()] + name[m.end() :]) if m else None


def timed_schedules(names: list[str]) -> list[str]:
    """The rows a wall-clock run times for ``names``: a warm-up row by its two phases.

    Its first W steps are exact (k=1, ``hiersync_k1``) and the rest its steady schedule
    (the twin without ``_w<W>``): a short timed run of the row itself would time its warm-up only.
    """
    out: list[str] = []
    for name in names:
        parts = warm_parts(name)
        out += ["hiersync_k1", parts[1]] if parts else [name]
    return list(dict.fromkeys(out))


def combine_steps(rows: list[dict], loss_rows: list[dict], ddp_steps: int | None = None) -> list[dict]:
    """Wall-clock to DDP's loss = steps to it (``loss_rows``, many seeds) x s/step (``rows``, this link).

    Steps to a loss do not depend on the link: a loss-only run with many seeds on the plain
    loopback gives them; this run gives each schedule's seconds per step on the shaped link.
    A warm-up row (``_w<W>``) is timed by its phases (:func:`timed_schedules`): of its N steps
    to the loss, min(W, N) at ``hiersync_k1``'s s/step and the rest at its twin's (needs
    ``ddp_steps``, DDP's steps in the loss-only run). Returns, per schedule of ``loss_rows``
    that this run timed, ``wall_x_ddp`` and its interval (the steps interval priced the same
    way); schedules it did not time are left out.
    """
    timed = {r["schedule"]: r["s_per_step"] for r in rows}
    s_ddp, s_warm, steps = timed["ddp"], timed.get("hiersync_k1"), ddp_steps or 1
    out = []
    for lr in loss_rows:
        name = lr["schedule"]
        warm, twin = warm_parts(name) or (0, name)
        if twin not in timed or (warm and (s_warm is None or ddp_steps is None)):
            continue

        def wall(x: float, warm: int = warm, s_twin: float = timed[twin]) -> float:
            n = x * steps  # steps to the loss: the first `warm` of them exact
            return (min(warm, n) * (s_warm or 0.0) + max(n - warm, 0.0) * s_twin) / (steps * s_ddp)

        per_step = None if warm else timed[name]
        iv = (lr.get("interval_90") or {}).get("steps")
        x = lr["steps_x_ddp"]
        out.append(
            dict(
                schedule=name,
                s_per_step=per_step,
                steps_x_ddp=x,
                steps_interval=iv,
                wall_x_ddp=None if x is None else wall(x),
                wall_interval=None if iv is None else (wall(iv[0]), wall(iv[1])),
                **{k: lr[k] for k in ("period", "fragments", "overlap", "warmup_steps") if k in lr},
            )
        )
    return out


def _x(v: float | None, spec: str = ".2f") -> str:
    return "not reached" if v is None or not math.isfinite(v) else format(v, spec)


def _ci(iv: tuple[float, float] | None) -> str:
    return "" if not iv else f" ({_x(iv[0])}-{_x(iv[1])})"


def _gap(g: dict | None) -> str:
    return "" if not g else f"{g['mean']:+.4f} ({g['lo']:+.4f}..{g['hi']:+.4f})"


def table(rows: list[dict], steps: int, target: float, seeds: list[int]) -> str:
    mean = "mean of seeds " + ",".join(map(str, seeds)) if len(seeds) > 1 else f"seed {seeds[0]}"
    head = [
        "schedule",
        "s/step",
        f"val loss at step {steps} ({mean}; spread)",
        "minus DDP's, seed by seed (90% interval)",
        f"steps to DDP's final loss {target:.4f}",
        "wall-clock s to it",
        "wall-clock vs DDP (90% interval over seeds)",
        "steps vs DDP (90% interval)",
        "per seed: steps to its DDP's loss",
    ]
    body = []
    for r in rows:
        spread = f" ({r['spread_at_ddp_steps']:.3f})" if r["spread_at_ddp_steps"] is not None and len(seeds) > 1 else ""
        iv = r.get("interval_90") or {}
        body.append(
            [
                r["schedule"],
                f"{r['s_per_step']:.3f}",
                f"{_x(r['val_at_ddp_steps'], '.4f')}{spread}",
                _gap(r.get("paired_gap")),
                _x(r["steps_to_target"], ".0f"),
                _x(r["wall_to_target"], ".1f"),
                f"{_x(r['wall_x_ddp'])}{_ci(iv.get('wall'))}",
                f"{_x(r['steps_x_ddp'])}{_ci(iv.get('steps'))}",
                ", ".join("-" if v is None else str(v) for v in r["per_seed_steps"]),
            ]
        )
    return render(head, body, align="lrrrrrrrl", markdown=True)


def _per_step(c: dict) -> str:
    if c["s_per_step"] is not None:
        return f"{c['s_per_step']:.3f}"
    return "warm-up at k=1, then {}".format(warm_parts(c["schedule"])[1]) if warm_parts(c["schedule"]) else "-"


def combined_table(combined: list[dict], loss_seeds: int) -> str:
    head = [
        "schedule",
        "s/step on this link",
        f"steps vs DDP ({loss_seeds} seeds, 90% interval)",
        "wall-clock to DDP's loss vs DDP (90% interval)",
    ]
    body = [
        [
            c["schedule"],
            _per_step(c),
            f"{_x(c['steps_x_ddp'])}{_ci(c['steps_interval'])}",
            f"{_x(c['wall_x_ddp'])}{_ci(c['wall_interval'])}",
        ]
        for c in combined
    ]
    return render(head, body, markdown=True)


def plot(
    runs: dict[str, list[dict]], rows: list[dict], target: float, path: Path, title: str, wall: bool = True
) -> None:
    """Mean loss over seeds vs wall-clock (``wall``: a shaped link's) and vs steps; each seed's curve faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (["wall_s"] if wall else []) + ["step"]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    for i, row in enumerate(rows):
        color = f"C{i}"
        many = len(runs[row["schedule"]]) > 1
        for ax, key in zip(axes[0], keys):
            for r in runs[row["schedule"]] if many else []:
                ev = [e for e in r["evals"] if e["step"] > 0]
                ax.plot([e[key] for e in ev], [e["val_loss"] for e in ev], color=color, alpha=0.2, lw=0.8)
            ev = [e for e in row["curve"] if e["step"] > 0]
            label = row["schedule"] + (" (mean of seeds)" if many else "")
            ax.plot([e[key] for e in ev], [e["val_loss"] for e in ev], color=color, marker=".", ms=3, label=label)
    for ax, key in zip(axes[0], keys):
        xl = "wall-clock s (training only)" if key == "wall_s" else "step"
        ax.axhline(target, color="gray", ls="--", lw=0.8, label="DDP's final val loss")
        ax.set_xlabel(xl)
        ax.set_ylabel("val loss (world-mean parameters)")
        ax.grid(alpha=0.3)
        ax.set_ylim(target - 0.15, target + 0.85)  # the end of the curves, where the target is crossed
    axes[0][0].legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 100), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
