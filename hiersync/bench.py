"""``python -m hiersync bench``: schedules x bucket sizes, side by side, on an emulated cluster.

Every *schedule* trains the same model with the same data on the same cluster in one run:

============================  ==============================================================
``ddp``                       DDP's default all-reduce (no hook): the baseline
``postlocal_k<k>``            PyTorch ``post_localSGD_hook`` (intra-node all-reduce) +
                              ``PeriodicModelAverager(period=k)`` (world parameter average)
``bf16_hook``                 PyTorch ``bf16_compress_hook`` (flat all-reduce in bf16)
``hiersync_p1``               hiersync, period 1 (exact two-level all-reduce every step)
``hiersync_p<k>[_overlap][_bf16]``  hiersync, period k, optionally overlapped / bf16 deltas
``intra_only``                intra-node all-reduce only, never across nodes (reference)
``compute_only``              a hook that communicates nothing (reference: compute floor)
============================  ==============================================================

Each (model, schedule, bucket size) runs ``warmup`` steps, then ``steps`` *attributed*
steps with a barrier between phases -- data, forward, backward, communication wait,
optimizer -- and then ``steps`` *unsynchronized* steps whose wall time is the step time the
ratios use (overlap only shows there). ``steps`` is rounded up to a multiple of ``k``.
*Communication wait* is the exposed part: the time ``backward()`` keeps running after the
slowest rank's last gradient was accumulated, plus the time spent after the optimizer's own
update (hiersync's post-step sync, the model averager).

The default runs in about two minutes on a 2-core machine: the emulated 2x2 cluster
(800 Mbit/s between nodes), a 25M-parameter MLP (100 MB of fp32 gradients), 25 MB
buckets and the schedules the targets name. ``--full`` sweeps everything.

Example::

    $ sudo python -m hiersync bench                       # default comparison, ~2 min
    $ sudo python -m hiersync bench --full --results results/full
    $ python -m hiersync bench --loopback --mlp-params 1M --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ._io import atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = [
    "ScheduleSpec",
    "parse_schedule",
    "parse_size",
    "default_schedules",
    "full_schedules",
    "worker",
    "run_bench",
    "timed_steps",
    "summarize",
    "check_targets",
    "write_outputs",
    "format_table",
    "format_targets",
    "make_config",
    "command_line",
    "add_arguments",
    "run",
]

logger = logging.getLogger(__name__)

PHASES = ("data", "forward", "backward", "comm", "optimizer")
DEFAULT_BUCKETS_MB = (25.0,)
FULL_BUCKETS_MB = (1.0, 5.0, 25.0, 100.0)
FULL_PERIODS = (2, 4, 8)
NEVER = 10**9  # a period no run reaches: intra-node averaging only

_SCHEDULE_RE = re.compile(r"^hiersync_p(\d+)((?:_overlap)?)((?:_bf16)?)$")


# ---------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule name means."""

    name: str
    kind: str
    """``ddp``, ``postlocal``, ``bf16_hook``, ``hiersync``, ``intra_only`` or ``compute_only``."""
    period: int = 1
    overlap: bool = False
    compress: str | None = None


def parse_schedule(name: str) -> ScheduleSpec:
    """Parse ``"hiersync_p4_overlap_bf16"``, ``"postlocal_k4"``, ``"ddp"``, ... into a spec."""
    if name in ("ddp", "bf16_hook", "intra_only", "compute_only"):
        return ScheduleSpec(name, name, period=NEVER if name == "intra_only" else 1)
    m = re.match(r"^postlocal_k(\d+)$", name)
    if m and int(m.group(1)) >= 1:
        return ScheduleSpec(name, "postlocal", period=int(m.group(1)))
    m = _SCHEDULE_RE.match(name)
    if m and int(m.group(1)) >= 1:
        period = int(m.group(1))
        overlap = bool(m.group(2))
        if overlap and period < 2:
            raise ValueError(f"schedule {name!r}: overlap needs period >= 2")
        return ScheduleSpec(name, "hiersync", period=period, overlap=overlap, compress="bf16" if m.group(3) else None)
    raise ValueError(
        f"schedule {name!r} is not known; use ddp, bf16_hook, intra_only, compute_only, postlocal_k<k>, "
        "hiersync_p<k>[_overlap][_bf16]"
    )


def default_schedules() -> list[str]:
    """What the targets compare, at k=4, plus the two references."""
    return [
        "ddp", "postlocal_k4", "bf16_hook", "hiersync_p1",
        "hiersync_p4", "hiersync_p4_overlap", "hiersync_p4_overlap_bf16",
        "intra_only", "compute_only",
    ]


def full_schedules(periods: Sequence[int] = FULL_PERIODS) -> list[str]:
    out = ["ddp", "bf16_hook", "hiersync_p1"]
    for k in periods:
        out += [f"postlocal_k{k}", f"hiersync_p{k}", f"hiersync_p{k}_overlap", f"hiersync_p{k}_bf16",
                f"hiersync_p{k}_overlap_bf16"]
    return out + ["intra_only", "compute_only"]


def parse_size(text: str) -> float:
    """``"25M"`` -> 25e6, ``"1.5k"`` -> 1500, ``"300000"`` -> 3e5."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$", str(text))
    if not m:
        raise ValueError(f"size={text!r} is not a number like 25M, 500k or 300000")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]


def timed_steps(spec: ScheduleSpec, steps: int) -> int:
    """``steps`` rounded up to a multiple of the period, so every window holds the same syncs."""
    k = spec.period if spec.kind in ("hiersync", "postlocal") and spec.period < NEVER else 1
    return max(k, int(math.ceil(steps / k)) * k)


# ---------------------------------------------------------------------------- models
def _build_model(name: str, config: dict):
    import torch

    if name == "mlp":
        depth = int(config["mlp_depth"])
        width = max(8, int(round(math.sqrt(float(config["mlp_params"]) / depth))))
        layers: list[torch.nn.Module] = []
        for i in range(depth):
            layers.append(torch.nn.Linear(width, width))
            if i < depth - 1:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers)
        batch = int(config["batch_size"])

        def data(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(out, y)

        return model, data, loss_fn
    if name == "transformer":
        t = config["transformer"]
        vocab, dim, seq = int(t["vocab"]), int(t["dim"]), int(t["seq"])

        class TinyLM(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(vocab, dim)
                self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
                layer = torch.nn.TransformerEncoderLayer(dim, int(t["heads"]), 4 * dim, dropout=0.0, batch_first=True)
                self.blocks = torch.nn.TransformerEncoder(layer, int(t["layers"]), enable_nested_tensor=False)
                self.head = torch.nn.Linear(dim, vocab)

            def forward(self, tokens: torch.Tensor) -> torch.Tensor:
                return self.head(self.blocks(self.embed(tokens) + self.pos))

        batch = int(t["batch"])

        def data(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
            return tokens[:, :-1], tokens[:, 1:]

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

        return TinyLM(), data, loss_fn
    raise ValueError(f"model={name!r} is not known; use 'mlp' or 'transformer'")


def _noop_hook(state: object, bucket: Any):
    """Communicate nothing: what the step would cost on an infinitely fast network."""
    import torch

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _bf16_hook(state: object, bucket: Any):
    """PyTorch's own ``bf16_compress_hook``, called through a differently named function.

    DDP refuses to register a function *named* ``bf16_compress_hook`` unless CUDA and NCCL
    are present, but its body (cast to bf16, divide, all-reduce, cast back) runs on gloo.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _fix_hook_annotations() -> None:
    # DDP compares the hook's annotations with the real classes; this module uses
    # postponed (string) annotations, so spell them out once torch is imported.
    import torch
    import torch.distributed as dist

    for hook in (_noop_hook, _bf16_hook):
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


class _Probe:
    """Timestamps: the last gradient accumulated (end of backward compute) and the end of the update."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.last_grad = 0.0
        self.opt_done = 0.0
        self.handles = [p.register_post_accumulate_grad_hook(self._grad) for p in model.parameters() if p.requires_grad]
        # Registered before hiersync attaches its own step hooks, so this one runs first:
        # whatever runs after it inside optimizer.step() is hiersync's inter-node sync.
        self.handles.append(optimizer.register_step_post_hook(self._opt))

    def _grad(self, p: Any) -> None:
        self.last_grad = time.perf_counter()

    def _opt(self, *args: Any) -> None:
        self.opt_done = time.perf_counter()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------- worker
def worker(config: dict) -> dict:
    """Run every (model, schedule, bucket) of ``config`` on this rank; return its timings.

    Runs on every rank of an initialized gloo process group (under torchrun on the testbed,
    or the private launcher on loopback). Rank 0 appends one line per step to
    ``config["progress"]`` for the launcher's progress bar.
    """
    import torch
    import torch.distributed as dist

    import hiersync

    _fix_hook_annotations()
    rank = dist.get_rank()
    topo = hiersync.Topology.detect()
    # Intra-node groups for PyTorch's post-local SGD (its default assumes one GPU per rank).
    intra_group, _ = dist.new_subgroups_by_enumeration([list(n) for n in topo.nodes])
    progress = config.get("progress") if rank == 0 else None
    out: dict[str, Any] = {"rank": rank, "nodes": [list(n) for n in topo.nodes], "runs": []}
    # Repeats go round the whole sweep, so a burst of load on a shared machine hits
    # one run of every schedule rather than every run of one schedule.
    for rep in range(int(config.get("repeat", 1))):
        for model_name in config["models"]:
            for bucket_mb in config["buckets_mb"]:
                for schedule in config["schedules"]:
                    spec = parse_schedule(schedule)
                    record = _run_one(config, model_name, spec, float(bucket_mb), intra_group, progress)
                    out["runs"].append({**record, "repeat": rep})
    return out


def _run_one(config: dict, model_name: str, spec: ScheduleSpec, bucket_mb: float, intra_group: Any, progress: str | None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    rank = dist.get_rank()
    warmup = int(config["warmup"])
    steps = timed_steps(spec, int(config["steps"]))
    torch.manual_seed(int(config["seed"]))
    model, data_fn, loss_fn = _build_model(model_name, config)
    num_params = sum(p.numel() for p in model.parameters())
    # Every rank seeds identically, so the initial broadcast (100 MB over the slow link
    # per schedule) would only cost time.
    ddp = DDP(model, bucket_cap_mb=bucket_mb, init_sync=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=float(config["lr"]), momentum=0.9)
    probe = _Probe(model, opt)
    after_step: Callable[[], None] = lambda: None
    state = None
    if spec.kind == "compute_only":
        ddp.register_comm_hook(None, _noop_hook)
    elif spec.kind == "bf16_hook":
        ddp.register_comm_hook(None, _bf16_hook)
    elif spec.kind == "postlocal":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        ddp.register_comm_hook(
            PostLocalSGDState(process_group=None, subgroup=intra_group, start_localSGD_iter=warmup), post_localSGD_hook
        )
        averager = PeriodicModelAverager(period=spec.period, warmup_steps=warmup)
        params = list(ddp.parameters())
        after_step = lambda: averager.average_parameters(params)  # noqa: E731
    elif spec.kind in ("hiersync", "intra_only"):
        state = hiersync.register(
            ddp, opt, period=spec.period, overlap=spec.overlap, compress=spec.compress,
            **config.get("hiersync_options", {}),
        )
    gen = torch.Generator().manual_seed(int(config["seed"]) * 1000 + rank)
    label = f"{model_name} {spec.name} {bucket_mb:g}MB"
    done = [0]
    total_steps = warmup + 2 * steps

    def tick() -> None:
        done[0] += 1
        if progress:
            with open(progress, "a") as f:
                f.write(f"{label}\t{done[0]}\t{total_steps}\n")

    def step(barriers: bool) -> dict[str, float]:
        sync = dist.barrier if barriers else (lambda: None)
        sync()
        t0 = time.perf_counter()
        x, y = data_fn(0, gen)
        sync()
        t1 = time.perf_counter()
        loss = loss_fn(ddp(x), y)
        sync()
        t2 = time.perf_counter()
        loss.backward()
        t_bwd = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        opt.step()
        t_step = time.perf_counter()
        after_step()
        t_avg = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t_zero = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        tick()
        return {
            "data": t1 - t0,
            "forward": t2 - t1,
            "backward_interval": t3 - t2,
            "backward_compute": max(0.0, probe.last_grad - t2),
            "backward_return": t_bwd - t2,
            "optimizer_interval": t4 - t3,
            "optimizer_compute": (probe.opt_done - t3) + (t_zero - t_avg),
            "after_update": (t_step - probe.opt_done) + (t_avg - t_step),
            "total": t4 - t0,
        }

    for _ in range(warmup):
        step(False)
    stats0 = state.stats.as_dict() if state is not None else None
    attributed = [step(True) for _ in range(steps)]
    dist.barrier()
    t0 = time.perf_counter()
    ends = []
    for _ in range(steps):
        step(False)
        ends.append(time.perf_counter())
    elapsed = time.perf_counter() - t0
    stats1 = state.stats.as_dict() if state is not None else None
    if state is not None:
        state.state_dict()  # drains an overlapped sync still in flight before the next run
    dist.barrier()
    probe.remove()
    inter = None
    if stats0 is not None and stats1 is not None:
        inter = {lvl: (stats1["bytes_sent"][lvl] - stats0["bytes_sent"][lvl]) / (2 * steps) for lvl in ("intra", "inter")}
    if state is not None:
        for g in (state.groups.intra, state.groups.intra_late, state.groups.rail):
            if g is not None:
                try:
                    dist.destroy_process_group(g)
                except (RuntimeError, ValueError) as e:  # a leak of one idle group is harmless
                    logger.debug("bench: could not destroy a hiersync group: %s", e)
    del ddp, opt, model, state
    return {
        "model": model_name,
        "schedule": spec.name,
        "spec": asdict(spec),
        "bucket_mb": bucket_mb,
        "num_params": num_params,
        "warmup": warmup,
        "steps": steps,
        "attributed": attributed,
        "unsync_elapsed": elapsed,
        "unsync_step_ends": [e - t0 for e in ends],
        "bytes_sent_per_step": inter,
    }


# ---------------------------------------------------------------------------- aggregation
def summarize(rank_results: Sequence[dict]) -> list[dict]:
    """One row per (model, bucket, schedule) from every rank's :func:`worker` result.

    Phases are barrier to barrier; compute parts use the slowest rank (the critical path)
    and the rest of each interval is communication wait, so the phases add up to the
    attributed total. ``step_s`` is the unsynchronized step time of the slowest rank.
    With repeats, every number is the median over the repeats (``step_s_runs`` lists them).
    """
    rows: list[dict] = []
    for i, run0 in enumerate(rank_results[0]["runs"]):
        runs = [r["runs"][i] for r in rank_results]
        phases = {p: 0.0 for p in PHASES}
        n = len(run0["attributed"])
        for s in range(n):
            per = [r["attributed"][s] for r in runs]
            bwd_interval = statistics.fmean(p["backward_interval"] for p in per)
            opt_interval = statistics.fmean(p["optimizer_interval"] for p in per)
            bwd = min(bwd_interval, max(p["backward_compute"] for p in per))
            optc = min(opt_interval, max(p["optimizer_compute"] for p in per))
            phases["data"] += statistics.fmean(p["data"] for p in per) / n
            phases["forward"] += statistics.fmean(p["forward"] for p in per) / n
            phases["backward"] += bwd / n
            phases["optimizer"] += optc / n
            phases["comm"] += (bwd_interval - bwd + opt_interval - optc) / n
        attributed_total = statistics.fmean(
            statistics.fmean(r["attributed"][s]["total"] for r in runs) for s in range(n)
        )
        step_s = max(r["unsync_elapsed"] for r in runs) / run0["steps"]
        ends = runs[0]["unsync_step_ends"]
        per_step = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
        spec = run0["spec"]
        rows.append({
            "model": run0["model"],
            "num_params": run0["num_params"],
            "grad_mb": run0["num_params"] * 4 / 1e6,
            "bucket_mb": run0["bucket_mb"],
            "schedule": run0["schedule"],
            "kind": spec["kind"],
            "period": spec["period"] if spec["period"] < NEVER else None,
            "overlap": spec["overlap"],
            "compress": spec["compress"],
            "steps": run0["steps"],
            "step_s": step_s,
            "step_std_s": statistics.pstdev(per_step) if len(per_step) > 1 else 0.0,
            "attributed_total_s": attributed_total,
            **{f"{p}_s": phases[p] for p in PHASES},
            "inter_mb_sent_per_step": (
                run0["bytes_sent_per_step"]["inter"] / 1e6 if run0["bytes_sent_per_step"] else None
            ),
        })
    merged = _merge_repeats(rows)
    _add_ratios(merged)
    return merged


def _merge_repeats(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["bucket_mb"], r["schedule"]), []).append(r)
    out = []
    for rs in groups.values():
        row = dict(rs[0])
        for k, v in rs[0].items():
            if isinstance(v, float) and k not in ("bucket_mb", "grad_mb"):
                vals = [r[k] for r in rs if r[k] is not None]
                row[k] = statistics.median(vals) if vals else None
        row["repeats"] = len(rs)
        row["step_s_runs"] = ";".join(f"{r['step_s']:.4f}" for r in rs)
        out.append(row)
    return out


def _add_ratios(rows: list[dict]) -> None:
    by = {(r["model"], r["bucket_mb"], r["schedule"]): r for r in rows}
    for r in rows:
        ddp = by.get((r["model"], r["bucket_mb"], "ddp"))
        r["vs_ddp"] = r["step_s"] / ddp["step_s"] if ddp else None
        post = None
        if r["kind"] in ("hiersync", "postlocal") and r["period"] and r["period"] > 1:
            post = by.get((r["model"], r["bucket_mb"], f"postlocal_k{r['period']}"))
        r["vs_postlocal"] = r["step_s"] / post["step_s"] if post else None


TARGETS = (
    # (schedule, reference, bound): the targets
    ("hiersync_p4_overlap", "ddp", 0.30),
    ("hiersync_p4_overlap", "postlocal_k4", 0.55),
    ("hiersync_p1", "ddp", 0.80),
)


def check_targets(rows: Sequence[dict]) -> list[dict]:
    """The issue's step-time targets, per model and bucket size, where both schedules ran."""
    by = {(r["model"], r["bucket_mb"], r["schedule"]): r for r in rows}
    out = []
    seen = sorted({(r["model"], r["bucket_mb"]) for r in rows})
    for model, bucket in seen:
        for sched, ref, bound in TARGETS:
            a, b = by.get((model, bucket, sched)), by.get((model, bucket, ref))
            if a and b:
                ratio = a["step_s"] / b["step_s"]
                out.append({"model": model, "bucket_mb": bucket, "schedule": sched, "reference": ref,
                            "ratio": ratio, "target": bound, "met": ratio <= bound})
    return out


# ---------------------------------------------------------------------------- outputs
def _fmt(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """The comparison table: step time, ratios vs DDP and vs post-local SGD, attributed phases."""
    head = ["schedule", "step s", "vs DDP", "vs post-local", "data", "fwd", "bwd", "comm", "opt", "inter MB/step"]
    lines: list[str] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["bucket_mb"]), []).append(r)
    for (model, bucket), rs in groups.items():
        title = f"{model} ({rs[0]['num_params'] / 1e6:.1f}M params, {rs[0]['grad_mb']:.0f} MB fp32 grads), bucket {bucket:g} MB"
        body = [
            [r["schedule"], _fmt(r["step_s"]), _fmt(r["vs_ddp"], ".2f", "x"), _fmt(r["vs_postlocal"], ".2f", "x")]
            + [_fmt(r[f"{p}_s"]) for p in PHASES]
            + [_fmt(r["inter_mb_sent_per_step"], ".1f")]
            for r in rs
        ]
        if markdown:
            lines += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(b) + " |" for b in body]
            lines.append("")
        else:
            widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
            lines.append(title)
            lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
            for b in body:
                lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
            lines.append("")
    return "\n".join(lines)


def format_targets(targets: Sequence[dict]) -> str:
    lines = []
    for t in targets:
        ref = "DDP default" if t["reference"] == "ddp" else f"PyTorch post-local SGD ({t['reference']})"
        lines.append(
            f"target {t['schedule']} <= {t['target']:.2f}x {ref} [{t['model']}, {t['bucket_mb']:g} MB buckets]: "
            f"{t['ratio']:.2f}x -> {'met' if t['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def _plots(rows: Sequence[dict]) -> dict[str, bytes]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("bench: matplotlib is not installed (pip install 'hiersync[bench]'); no plots")
        return {}
    out: dict[str, bytes] = {}
    models = list(dict.fromkeys(r["model"] for r in rows))
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for sched in schedules:
            pts = sorted((r["bucket_mb"], r["step_s"]) for r in rows if r["model"] == model and r["schedule"] == sched)
            if pts:
                style = "--" if sched in ("ddp", "intra_only", "compute_only") or sched.startswith("postlocal") else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=sched)
        ax.set_xscale("log")
        ax.set_xlabel("DDP bucket size (MB)")
        ax.set_ylabel("step time (s, unsynchronized)")
        ax.set_title(f"{model}: step time vs bucket size")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out["step_time_vs_bucket.png"] = _png(fig)
    plt.close(fig)

    keys = list(dict.fromkeys((r["model"], r["bucket_mb"]) for r in rows))
    # one breakdown per model, at the bucket size closest to 25 MB
    picks = []
    for model in models:
        buckets = sorted({k[1] for k in keys if k[0] == model})
        picks.append((model, min(buckets, key=lambda b: abs(math.log(b / 25.0)))))
    fig, axes = plt.subplots(1, len(picks), figsize=(7 * len(picks), 4.5), squeeze=False)
    colors = {"data": "#bbbbbb", "forward": "#4c72b0", "backward": "#55a868", "comm": "#c44e52", "optimizer": "#8172b2"}
    for ax, (model, bucket) in zip(axes[0], picks):
        rs = [r for r in rows if r["model"] == model and r["bucket_mb"] == bucket]
        xs = range(len(rs))
        bottom = [0.0] * len(rs)
        for p in PHASES:
            vals = [r[f"{p}_s"] for r in rs]
            ax.bar(xs, vals, bottom=bottom, color=colors[p], label=p)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(xs, [r["step_s"] for r in rs], "k_", markersize=18, mew=2, label="unsynchronized step")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["schedule"] for r in rs], rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{model}, {bucket:g} MB buckets: attributed step breakdown")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    out["step_breakdown.png"] = _png(fig)
    plt.close(fig)
    return out


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write_outputs(results_dir: str | os.PathLike, raw: dict, rows: Sequence[dict], plots: bool = True) -> list[Path]:
    """Write bench.json (raw), bench.csv, bench.md and the PNG plots atomically; return the paths."""
    d = Path(results_dir)
    paths = [atomic_write_json(d / "bench.json", {**raw, "rows": list(rows)})]
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    paths.append(atomic_write_text(d / "bench.csv", buf.getvalue()))
    md = [f"# hiersync bench", "", f"`{raw['command']}`", "", raw["testbed"]["describe"], "", format_table(rows, markdown=True)]
    targets = check_targets(rows)
    if targets:
        md += ["", "```", format_targets(targets), "```", ""]
    paths.append(atomic_write_text(d / "bench.md", "\n".join(md)))
    if plots and rows:
        for name, data in _plots(rows).items():
            paths.append(atomic_write_bytes(d / name, data))
    return paths


# ---------------------------------------------------------------------------- launcher
class _ProgressFile:
    """Feeds rank 0's per-step lines into a tqdm bar (or the log when tqdm is missing)."""

    def __init__(self, path: Path, total: int) -> None:
        self.path = path
        self.pos = 0
        self.done = 0
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", desc="bench", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
        except ImportError:
            self.bar = None
        self.total = total
        self.last_log = 0.0

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        lines = chunk.split("\n")
        complete = lines[:-1]
        self.pos += sum(len(x) + 1 for x in complete)
        if not complete:
            return
        self.done += len(complete)
        label = complete[-1].split("\t")[0]
        if self.bar is not None:
            self.bar.update(len(complete))
            self.bar.set_postfix_str(label)
        elif time.monotonic() - self.last_log > 10:
            self.last_log = time.monotonic()
            logger.info("bench: %d/%d steps (%s)", self.done, self.total, label)

    def close(self) -> None:
        self.poll()
        if self.bar is not None:
            self.bar.close()


def run_bench(
    config: dict,
    *,
    nodes: int = 2,
    procs_per_node: int = 2,
    inter_rate: str | None = "800mbit",
    loopback: bool = False,
    timeout: float = 900.0,
    progress: bool = True,
) -> tuple[list[dict], dict]:
    """Run the sweep described by ``config`` on an emulated cluster; return (rows, raw)."""
    from .testbed import run_ranks

    specs = [parse_schedule(s) for s in config["schedules"]]
    total = sum(
        int(config["warmup"]) + 2 * timed_steps(s, int(config["steps"])) for s in specs
    ) * len(config["models"]) * len(config["buckets_mb"]) * int(config.get("repeat", 1))
    with tempfile.TemporaryDirectory(prefix="hiersync-bench-") as tmp:
        prog_path = Path(tmp) / "progress"
        config = {**config, "progress": str(prog_path)}
        bar = _ProgressFile(prog_path, total) if progress else None
        load_before = os.getloadavg()[0]
        start = time.monotonic()
        try:
            results, info = run_ranks(
                "hiersync.bench:worker", config, nodes=nodes, procs_per_node=procs_per_node,
                inter_rate=inter_rate, loopback=loopback, timeout=timeout, poll=bar.poll if bar else None,
            )
        finally:
            if bar is not None:
                bar.close()
        wall = time.monotonic() - start
    rows = summarize(results)
    raw = {
        "format": "hiersync.bench/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall,
        "config": {k: v for k, v in config.items() if k != "progress"},
        "testbed": info,
        # On a shared machine other jobs steal cores from the ranks: say how busy it was.
        "environment": {**_environment(), "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]},
        "ranks": results,
    }
    return rows, raw


def _environment() -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "hostname": platform.node(),
    }


def make_config(args: argparse.Namespace) -> dict:
    """The worker's configuration from the command line (validated here, not in the ranks)."""
    if args.schedules:
        schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    elif args.full:
        schedules = full_schedules(args.periods or FULL_PERIODS)
    else:
        schedules = default_schedules()
    for s in schedules:
        parse_schedule(s)
    if args.buckets:
        buckets = [float(b) for b in args.buckets.split(",")]
    else:
        buckets = list(FULL_BUCKETS_MB if args.full else DEFAULT_BUCKETS_MB)
    if any(not b > 0 for b in buckets):
        raise ValueError(f"--buckets={args.buckets!r}: bucket sizes must be > 0 MB")
    models = [m.strip() for m in (args.models or ("mlp,transformer" if args.full else "mlp")).split(",")]
    for m in models:
        if m not in ("mlp", "transformer"):
            raise ValueError(f"--models: model {m!r} is not known; use mlp and/or transformer")
    params = parse_size(args.mlp_params)
    if params < 64:
        raise ValueError(f"--mlp-params={args.mlp_params!r} is too small (>= 64 parameters)")
    for name in ("steps", "batch_size", "mlp_depth", "repeat"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 1:
        raise ValueError(f"--warmup={args.warmup} must be >= 1 (DDP rebuilds its buckets after the first step)")
    return {
        "models": models,
        "schedules": schedules,
        "buckets_mb": buckets,
        "mlp_params": params,
        "mlp_depth": args.mlp_depth,
        "batch_size": args.batch_size,
        "transformer": {"vocab": 2048, "dim": args.transformer_dim, "heads": 4, "layers": args.transformer_layers,
                        "seq": 64, "batch": 8},
        "steps": args.steps,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "lr": 1e-3,
        "seed": args.seed,
        "hiersync_options": {"nonfinite": args.nonfinite},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sweep")
    g.add_argument("--full", action="store_true",
                   help="everything: mlp+transformer, buckets 1,5,25,100 MB, k in 2,4,8 with/without overlap and bf16")
    g.add_argument("--schedules", default=None, help="comma-separated schedule names (see module doc)")
    g.add_argument("--periods", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="periods k for --full (default 2,4,8)")
    g.add_argument("--buckets", default=None, help="comma-separated DDP bucket sizes in MB (default 25)")
    g.add_argument("--models", default=None, help="mlp and/or transformer (default mlp; --full: both)")
    g.add_argument("--mlp-params", default="25M", help="MLP size in parameters (25M = 100 MB of fp32 gradients)")
    g.add_argument("--mlp-depth", type=int, default=4, help="MLP layers")
    g.add_argument("--batch-size", type=int, default=16, help="MLP batch per rank")
    g.add_argument("--transformer-dim", type=int, default=256)
    g.add_argument("--transformer-layers", type=int, default=4)
    g.add_argument("--steps", type=int, default=2,
                   help="timed steps per pass, rounded up to a multiple of k (so period-4 schedules time 4)")
    g.add_argument("--warmup", type=int, default=1,
                   help="untimed steps first (DDP rebuilds its buckets after the first)")
    g.add_argument("--repeat", type=int, default=1,
                   help="go round the whole sweep this many times and report medians (noisy machines)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--nonfinite", choices=("skip", "raise", "ignore"), default="skip",
                   help="HierState(nonfinite=...) of the hiersync schedules (default: hiersync's default, skip)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=2)
    c.add_argument("--procs-per-node", type=int, default=2)
    c.add_argument("--inter-rate", default="800mbit", help="tc rate of each node's egress")
    c.add_argument("--loopback", action="store_true", help="no namespaces: plain loopback, links not shaped")
    c.add_argument("--timeout", type=float, default=None, help="kill the run after this many seconds")
    o = parser.add_argument_group("output")
    o.add_argument("--results", default="results/bench", help="folder for bench.json/.csv/.md and the plots")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def command_line(args: argparse.Namespace) -> str:
    """``python -m hiersync bench`` plus the options that differ from their defaults."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    parts = ["python -m hiersync bench"]
    for dest, value in vars(args).items():
        if dest in defaults and value != defaults[dest]:
            if value is True:
                parts.append(flags[dest])
            elif isinstance(value, list):
                parts.append(f"{flags[dest]} {','.join(map(str, value))}")
            else:
                parts.append(f"{flags[dest]} {value}")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    config = make_config(args)
    from ._launch import RankFailed
    from .testbed import TestbedError

    timeout = args.timeout or (7200.0 if args.full else 900.0) * args.repeat
    try:
        rows, raw = run_bench(
            config, nodes=args.nodes, procs_per_node=args.procs_per_node, inter_rate=args.inter_rate,
            loopback=args.loopback, timeout=timeout, progress=not args.no_progress,
        )
    except (TestbedError, RankFailed, TimeoutError) as e:
        logger.error("bench failed: %s", e)
        return 1
    raw["command"] = command_line(args)
    paths = write_outputs(args.results, raw, rows, plots=not args.no_plots)
    targets = check_targets(rows)
    # The CLI's final output: the comparison table.
    env = raw["environment"]
    print(f"hiersync bench on {raw['testbed']['describe']} ({raw['wall_s']:.0f} s, "
          f"load average {env['loadavg_1min_before']:.1f} -> {env['loadavg_1min_after']:.1f} on {env['cpus']} cores)")
    print(f"step s: unsynchronized step time (slowest rank); data..opt: attributed with barriers between phases\n")
    print(format_table(rows))
    if targets:
        print(format_targets(targets))
        if raw["testbed"]["mode"] != "netns":
            print("(loopback: inter-node links are NOT shaped, so these ratios say nothing about a slow network)")
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return 0
