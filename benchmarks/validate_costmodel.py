"""Validate the cost model against measurement: predicted vs measured collectives and steps.

With a calibrated profile (``python -m hiersync calibrate``; or calibrated here, in the
same run, when ``--profile`` is not given) this measures, on every rank at once:

1. hiersync's two-level all-reduce (``HierComm.allreduce``) for message sizes *between*
   the calibration sizes (out of sample), and the flat all-reduce over the world;
2. full training steps of a synthetic MLP under DDP: compute alone (a no-op hook), DDP's
   default all-reduce, and the hiersync hook at several DDP bucket sizes;

and compares them with :func:`hiersync.costmodel.predict_two_level`,
:func:`~hiersync.costmodel.predict_allreduce` and :func:`~hiersync.costmodel.step_time`.
It prints one table per part with the relative error ``(predicted - measured) /
measured`` and the median absolute error, and writes everything as JSON (``--out``).

Runs like ``calibrate``: under ``torchrun`` (one process per rank, ``env://``), on the
emulated testbed (``python -m hiersync testbed ... -- benchmarks/validate_costmodel.py``),
or locally with ``--nodes N --procs-per-node L`` (forked ranks, loopback).

``--published`` needs no ranks: it scores :func:`~hiersync.costmodel.predict_allreduce`
against ``benchmarks/data/published_allreduce.csv`` (:mod:`hiersync.costmodel.validation`): the
median error per regime leave-one-source-out (fabric latencies and switch tiers fitted on the
other sources) and in sample, the same on 16+ nodes with and without the tiers and scaled out
(fitted below 16 nodes), every row, the worst. ``--loso``: all but the per-row table.

Example::

    python benchmarks/validate_costmodel.py --published
    python benchmarks/validate_costmodel.py --published --loso
    python -m hiersync calibrate --nodes 2 --procs-per-node 2 --out profile.json
    python benchmarks/validate_costmodel.py --nodes 2 --procs-per-node 2 --profile profile.json
    python -m hiersync testbed --nodes 2 --procs-per-node 2 --inter-rate 800mbit -- \\
        benchmarks/validate_costmodel.py --rails 1 --out validation.json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hiersync import costmodel as cm
from hiersync._table import render
from hiersync.costmodel.validation import DEFAULT_CSV, load_rows
from hiersync.costmodel.validation import format_report as format_published
from hiersync.tools import calibrate as cal
from hiersync.tools.sweep import sync_device, world_max
from hiersync.vocab import format_size

__all__ = ["ValidationConfig", "StepCase", "measure", "predict", "format_report", "main"]

logger = logging.getLogger("validate_costmodel")

KIB, MIB = 2**10, 2**20
# Geometric midpoints of calibrate's quick sizes (4 KiB * 4^i): never a calibrated size.
DEFAULT_SIZES = tuple(8 * KIB * 4**i for i in range(8))  # 8 KiB .. 128 MiB


@dataclass(frozen=True)
class StepCase:
    """One training configuration: ``schedule`` is ``"ddp"`` (default all-reduce) or ``"hiersync"``."""

    schedule: str
    bucket_mb: float
    period: int = 1


# With 1 MiB layers DDP's buckets hold 1, 2, 4 or all 8 layers at these caps.
DEFAULT_CASES = (
    *(StepCase("ddp", mb) for mb in (1.0, 4.0, 25.0)),
    *(StepCase("hiersync", mb) for mb in (1.0, 2.0, 4.0, 25.0)),
    StepCase("hiersync", 4.0, period=4),
)


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Two-level all-reduce message sizes in bytes."""
    sweep: cal.SweepConfig = field(default_factory=cal.SweepConfig)
    """Timing of each collective (and the inline calibration's sizes)."""
    width: int = 512
    """MLP width: every layer's weight is width^2 fp32 (1 MiB at 512), so buckets hold whole layers."""
    depth: int = 8
    """Hidden layers."""
    batch: int = 64
    """Samples per rank and step."""
    cases: tuple[StepCase, ...] = DEFAULT_CASES
    warmup_steps: int = 3
    """Untimed steps per case (DDP rebuilds its buckets after the first)."""
    steps: int = 8
    """Timed steps per case; the median of the slowest rank's step time is reported (the
    mean for period > 1, whose steps differ; use a multiple of the period)."""
    calibrate: bool = False
    """Calibrate in this run (no profile given)."""
    skip_steps: bool = False


# ---------------------------------------------------------------------------
# Rank body (collective).


def _mlp(width: int, depth: int):
    import torch

    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _noop_hook(state, bucket):  # no annotations: DDP rejects any but the real (non-string) types
    """Hand the bucket back untouched: DDP's bucketing without communication (compute alone)."""
    import torch

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _time_steps(ddp, opt, data, config: ValidationConfig, device, *, phases: bool = False) -> dict[str, float]:
    """Median over steps of the slowest rank's step (and, with ``phases``, forward/backward/optimizer) time."""
    import torch

    x, y = data
    rows = []
    for i in range(config.warmup_steps + config.steps):
        sync_device(device)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        sync_device(device)
        t1 = time.perf_counter()
        loss.backward()
        sync_device(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync_device(device)
        t3 = time.perf_counter()
        if i >= config.warmup_steps:
            rows.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    names = ("step_s", "forward_s", "backward_s", "optimizer_s") if phases else ("step_s",)
    out = {}
    for j, name in enumerate(names):
        per_step = world_max([r[j] for r in rows], device)
        out[name] = statistics.median(per_step)
        if name == "step_s":
            out["mean_step_s"] = statistics.fmean(per_step)
    return out


def _bucket_sizes(ddp) -> list[int]:
    """Bytes of each of DDP's gradient buckets after its rebuild (DDP's logging data)."""
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(v) for v in str(text).split(",") if v.strip()]


def measure(config: ValidationConfig, device=None) -> dict[str, Any]:
    """Measure everything on every rank; returns the same dict on every rank. Collective."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync
    from hiersync.collectives import HierComm
    from hiersync.futures import wait
    from hiersync.topology import Topology

    device = device or torch.device("cpu")
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    if hasattr(os, "getloadavg"):
        out["loadavg_before"] = list(os.getloadavg())  # other jobs on the machine disturb timings
    if config.calibrate:
        out["calibration"] = cal.calibrate(config.sweep, device)
    topo = Topology.detect()
    groups = topo.build_groups()
    comm = HierComm(groups)
    L = topo.ranks_per_node
    numels = [max(L, nbytes // 4 // L * L) for nbytes in config.sizes]  # whole shards: no padding copies
    buf = torch.zeros(max(numels), device=device)  # zeros: the averages stay zeros
    ops = [lambda x=buf[:m]: wait(comm.allreduce(x)) for m in numels]
    ops += [lambda x=buf[:m]: wait(comm.flat_allreduce(x)) for m in numels]
    seconds = cal.time_ops(ops, device, config.sweep)
    k = len(numels)
    collectives = [
        {"bytes": m * 4, "two_level_s": two, "flat_s": flat} for m, two, flat in zip(numels, seconds[:k], seconds[k:])
    ]
    if rank == 0:
        for c in collectives:
            logger.info(
                "validate: %d B: two-level %.1f us, flat %.1f us", c["bytes"], c["two_level_s"] * 1e6, c["flat_s"] * 1e6
            )
    del buf
    out["collectives"] = collectives
    out["intra_algorithm"] = comm.intra_algorithm  # what HierComm ran: "rs_ag" or "allreduce_bcast"
    if config.skip_steps:
        return out

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + rank)
    data = (
        torch.randn(config.batch, config.width, generator=g).to(device),
        torch.randn(config.batch, config.width, generator=g).to(device),
    )
    grad_bytes = sum(p.numel() * 4 for p in _mlp(config.width, config.depth).parameters())

    def build(case: StepCase | None):
        torch.manual_seed(0)
        model = _mlp(config.width, config.depth).to(device)
        kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
        ddp = DDP(model, bucket_cap_mb=case.bucket_mb if case else 25.0, **kw)
        state = None
        if case is None:
            ddp.register_comm_hook(None, _noop_hook)
        elif case.schedule == "hiersync":
            state = hiersync.HierState(period=case.period, topology=topo)
            ddp.register_comm_hook(state, hiersync.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        return ddp, opt, state

    ddp, opt, _ = build(None)
    compute = _time_steps(ddp, opt, data, config, device, phases=True)
    del ddp, opt
    steps = []
    for case in config.cases:
        ddp, opt, state = build(case)
        measured = _time_steps(ddp, opt, data, config, device)
        steps.append({**asdict(case), **measured, "bucket_sizes": _bucket_sizes(ddp)})
        if rank == 0:
            logger.info("validate: %s: step %.1f ms", case, measured["step_s"] * 1e3)
        del ddp, opt, state
    out["compute"] = compute
    out["grad_bytes"] = grad_bytes
    out["steps"] = steps
    out["nodes"] = topo.num_nodes
    out["ranks_per_node"] = L
    out["backend"] = str(dist.get_backend())
    if hasattr(os, "getloadavg"):
        out["loadavg_after"] = list(os.getloadavg())
    return out


def _local_body(config: ValidationConfig) -> dict[str, Any] | None:
    import torch.distributed as dist

    result = measure(config)
    return result if dist.get_rank() == 0 else None


# ---------------------------------------------------------------------------
# Predictions and the report (pure).


def _rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def predict(result: Mapping[str, Any], profile: cm.Profile) -> dict[str, Any]:
    """Add predictions and relative errors to ``result``; return the report dict."""
    # The variant HierComm ran; results written before it was recorded ran "rs_ag" (HierComm had no other).
    intra_algorithm = result.get("intra_algorithm", "rs_ag")
    rows = []
    for c in result["collectives"]:
        n = c["bytes"]
        two = sum(cm.predict_two_level(n, profile, intra_algorithm))
        flat = cm.predict_allreduce(n, profile)
        rows.append(
            {
                **c,
                "two_level_pred_s": two,
                "two_level_err": _rel(two, c["two_level_s"]),
                "flat_pred_s": flat,
                "flat_err": _rel(flat, c["flat_s"]),
            }
        )
    report: dict[str, Any] = {"collectives": rows, "intra_algorithm": intra_algorithm}
    report["two_level_median_abs_err"] = statistics.median(abs(r["two_level_err"]) for r in rows)
    report["flat_median_abs_err"] = statistics.median(abs(r["flat_err"]) for r in rows)
    if "steps" in result:
        comp = result["compute"]
        compute_s = comp["step_s"]
        steps = []
        for s in result["steps"]:
            schedule = "ddp" if s["schedule"] == "ddp" else "hiersync"
            # DDP fills each bucket with whole parameters until it reaches the cap, so
            # the model gets the bucket size DDP really built (its largest bucket).
            bucket = max(s["bucket_sizes"]) if s.get("bucket_sizes") else s["bucket_mb"] * MIB
            st = cm.step_time(
                schedule,
                profile=profile,
                grad_bytes=result["grad_bytes"],
                bucket_bytes=bucket,
                backward_s=comp["backward_s"],
                compute_s=compute_s,
                period=s["period"],
                intra_algorithm=intra_algorithm,
            )
            measured = s["step_s"] if s["period"] == 1 else s["mean_step_s"]
            steps.append(
                {
                    **s,
                    "measured_s": measured,
                    "pred_s": st.step_s,
                    "pred_comm_s": st.comm_s,
                    "pred_exposed_s": st.exposed_s,
                    "num_buckets": st.num_buckets,
                    "err": _rel(st.step_s, measured),
                }
            )
        report["compute"] = comp
        report["grad_bytes"] = result["grad_bytes"]
        report["steps"] = steps
        report["steps_median_abs_err"] = statistics.median(abs(r["err"]) for r in steps)
    return report


def _us(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 1 else f"{s * 1e3:.1f}"


def format_report(report: Mapping[str, Any], profile: cm.Profile) -> str:
    lines = [
        f"profile {profile.name} [{profile.backend}] {profile.nodes}x{profile.ranks_per_node}: "
        f"intra {profile.intra.alpha * 1e6:.1f} us, {profile.intra.bandwidth / 1e9:.3g} GB/s; "
        f"inter {profile.inter.alpha * 1e6:.1f} us, {profile.inter.bandwidth / 1e9:.3g} GB/s per NIC x "
        f"{profile.rails or profile.ranks_per_node}; two-level intra algorithm {report.get('intra_algorithm', '?')}",
        "",
    ]
    head = ["bytes", "two-level measured ms", "predicted ms", "error", "flat measured ms", "predicted ms", "error"]
    table = [
        [
            format_size(r["bytes"]),
            _us(r["two_level_s"]),
            _us(r["two_level_pred_s"]),
            f"{r['two_level_err']:+.1%}",
            _us(r["flat_s"]),
            _us(r["flat_pred_s"]),
            f"{r['flat_err']:+.1%}",
        ]
        for r in report["collectives"]
    ]
    lines.append(render(head, table, align="r", markdown=True))
    lines.append(
        f"\nmedian |error|: two-level {report['two_level_median_abs_err']:.1%}, "
        f"flat {report['flat_median_abs_err']:.1%}"
    )
    if "steps" in report:
        c = report["compute"]
        lines += [
            "",
            f"MLP {report['grad_bytes'] / MIB:.2f} MiB of fp32 gradients; compute alone (no-op hook): step "
            f"{c['step_s'] * 1e3:.1f} ms = forward {c['forward_s'] * 1e3:.1f} + backward {c['backward_s'] * 1e3:.1f} "
            f"+ optimizer {c['optimizer_s'] * 1e3:.1f} ms",
            "",
        ]
        head = ["schedule", "bucket_cap_mb", "buckets", "measured step ms", "predicted ms", "(comm, exposed) ms"]
        table = [
            [
                "DDP default" if s["schedule"] == "ddp" else f"hiersync k={s['period']}",
                f"{s['bucket_mb']:g}",
                str(s["num_buckets"]),
                f"{s['measured_s'] * 1e3:.1f}",
                f"{s['pred_s'] * 1e3:.1f}",
                f"({s['pred_comm_s'] * 1e3:.1f}, {s['pred_exposed_s'] * 1e3:.1f})",
                f"{s['err']:+.1%}",
            ]
            for s in report["steps"]
        ]
        lines.append(render([*head, "error"], table, markdown=True))
        lines.append(f"\nmedian |error|: steps {report['steps_median_abs_err']:.1%}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line.


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", help="calibrated profile; without it, calibrate first in this run")
    p.add_argument("--save-profile", help="where to write the inline calibration's profile")
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--nodes", type=int, help="emulate this many nodes locally (no torchrun)")
    p.add_argument("--procs-per-node", type=int, help="ranks per emulated node")
    p.add_argument("--rails", type=int, help="NICs per node for the inline calibration (1 on the testbed)")
    p.add_argument("--sizes", help="comma-separated two-level message sizes in bytes")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per collective (default 5)")
    p.add_argument("--budget-s", type=float, default=2.0, help="seconds per collective and size (default 2)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps per case (default 8)")
    p.add_argument("--skip-steps", action="store_true", help="collectives only")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument(
        "--published",
        nargs="?",
        const=str(DEFAULT_CSV),
        metavar="CSV",
        help="no ranks: score the model against published measurements instead "
        "(default benchmarks/data/published_allreduce.csv)",
    )
    p.add_argument("--loso", action="store_true", help="with --published: the medians and worst rows, no per-row table")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.loso and not args.published:
        print("--loso scores the published table: add --published", file=sys.stderr)
        return 2
    if args.published:
        print(format_published(load_rows(args.published), table=not args.loso))
        return 0
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sizes = DEFAULT_SIZES
    if args.sizes:
        sizes = tuple(int(float(s)) for s in args.sizes.split(",") if s.strip())
    config = ValidationConfig(
        sizes=sizes,
        sweep=cal.SweepConfig(reps=args.reps, budget_s=args.budget_s),
        width=args.width,
        depth=args.depth,
        batch=args.batch,
        steps=args.steps,
        calibrate=args.profile is None,
        skip_steps=args.skip_steps,
    )
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nodes or args.procs_per_node:
        from hiersync.tools.launch import run as launch

        nodes, lpn = args.nodes or 1, args.procs_per_node or 1
        node_ids = [r // lpn for r in range(nodes * lpn)]
        result = launch(_local_body, nodes * lpn, (config,), node_ids=node_ids, timeout=args.timeout, pg_timeout=300.0)[
            0
        ]
        mode = f"local {nodes}x{lpn}, gloo over loopback"
    elif under_torchrun:
        import torch
        import torch.distributed as dist

        device = torch.device("cpu")
        backend = "gloo"
        if torch.cuda.is_available():
            backend = "nccl"
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group(backend, init_method="env://")
        try:
            result = measure(config, device)
        finally:
            rank = dist.get_rank()
            dist.barrier()
            dist.destroy_process_group()
        if rank != 0:
            return 0
        testbed = os.environ.get("HIERSYNC_TESTBED_EMULATED") == "1"
        mode = "testbed (netns, shaped link)" if testbed else "torchrun"
    else:
        print("run under torchrun, on the testbed, or with --nodes N --procs-per-node L", file=sys.stderr)
        return 2

    if args.profile:
        profile = cm.Profile.load(args.profile)
    else:
        c = result["calibration"]
        profile, fits = cal.fit_profile(
            c["points"],
            nodes=c["nodes"],
            ranks_per_node=c["ranks_per_node"],
            rails=args.rails,
            backend=c["backend"],
            source=f"benchmarks/validate_costmodel.py ({mode})",
            metadata=c["metadata"],
        )
        print(cal.format_fits(profile, fits))
        print()
        if args.save_profile:
            profile.save(args.save_profile)
    report = predict(result, profile)
    report["mode"] = mode
    report["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    report["profile"] = profile.to_json()
    report["config"] = asdict(config)
    report["loadavg_before"] = result.get("loadavg_before")
    report["loadavg_after"] = result.get("loadavg_after")
    print(f"mode: {mode}; load average before {report['loadavg_before']}, after {report['loadavg_after']}")
    print(format_report(report, profile))
    if args.out:
        from hiersync._io import atomic_write_json

        atomic_write_json(args.out, report)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
