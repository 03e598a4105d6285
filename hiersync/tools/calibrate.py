"""``python -m hiersync calibrate``: measure alpha and beta per level and write a profile.

Sweeps message sizes with all-reduce on the *intra* groups (the ranks of each node, all
nodes at once) and on the *rails* (the ranks with one local rank across nodes, all rails
at once: that is how hiersync's two-level all-reduce loads the network), times a few
repetitions of each size after a warmup (median, slowest rank), fits ``alpha`` and
``beta`` per level with :func:`hiersync.costmodel.fit_link` (least squares on relative
errors, R^2 reported) and writes a :class:`hiersync.costmodel.Profile` as JSON
atomically. The planner (``--profile``) and ``HierState(algorithm="auto", profile=...)``
read that file.

Two ways to run it:

* on a real cluster under ``torchrun`` (the process group comes from ``env://``; NCCL
  with tensors on ``cuda:LOCAL_RANK`` when CUDA is available, else gloo);
* on one machine with ``--nodes N --procs-per-node L``: ranks are forked locally and
  ``HIERSYNC_NODE_IDS`` makes them N emulated nodes (all links are loopback then).

Only rank 0 writes the file and prints the fitted table. The timing itself lives in
:mod:`hiersync.tools.sweep`; this module fits, reports and runs the command.

Example::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 \\
        -m hiersync calibrate --out profile.json
    python -m hiersync calibrate --nodes 2 --procs-per-node 2 --out profile.json
    python -m hiersync testbed --nodes 2 --procs-per-node 2 --inter-rate 800mbit -- \\
        -m hiersync calibrate --rails 1 --out profile.json

    >>> points = {"intra": [(4096, 1e-4), (2**20, 5e-4)], "inter": [(4096, 2e-4), (2**20, 9e-3)]}
    >>> profile, fits = fit_profile(points, nodes=2, ranks_per_node=2, backend="gloo")
    >>> round(fits["inter"].r2, 3)
    1.0
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from hiersync import costmodel as cm
from hiersync._table import render
from hiersync.vocab import format_size, parse_size

from .sweep import FULL_SIZES, INTRA_COLLECTIVES, LEVELS, QUICK_SIZES, SweepConfig, sweep, time_op, time_ops

if TYPE_CHECKING:
    import torch

__all__ = [
    "QUICK_SIZES",
    "FULL_SIZES",
    "LEVELS",
    "INTRA_COLLECTIVES",
    "SweepConfig",
    "time_op",
    "time_ops",
    "sweep",
    "fit_profile",
    "format_fits",
    "calibrate",
    "add_arguments",
    "run",
]

logger = logging.getLogger(__name__)

# The algorithm each intra collective is fitted with: gloo's broadcast is a binomial tree.
_INTRA_FIT_ALGORITHM = {"reduce_scatter": "ring", "all_gather": "ring", "broadcast": "binomial"}
_ALGORITHMS = cm.ALLREDUCE_ALGORITHMS  # the cost model's single-level all-reduce algorithms


# ---------------------------------------------------------------------------
# Fitting (pure).


def fit_profile(
    points: Mapping[str, Sequence[tuple[float, float]]],
    *,
    nodes: int,
    ranks_per_node: int,
    rails: int | None = None,
    backend: str = "gloo",
    algorithm: str = "ring",
    name: str = "calibrated",
    source: str = "",
    metadata: Mapping[str, Any] | None = None,
) -> tuple[cm.Profile, dict[str, cm.LinkFit]]:
    """Fit one :class:`~hiersync.costmodel.Link` per level and build the profile. Pure.

    ``points["intra"]`` are all-reduce times on ``ranks_per_node`` ranks, ``points["inter"]``
    on the ``nodes`` ranks of a rail while all rails ran at once. With ``rails`` NICs per
    node (fewer than ``ranks_per_node``) the concurrent rails shared them, so the fitted
    rail link is :func:`~hiersync.costmodel.rail_link` of the NIC: the NIC's beta is the
    rail's times ``rails / ranks_per_node``. A missing level (one node, or one rank per
    node) copies the other level's link, with a warning. Optional
    ``points["intra_reduce_scatter"]`` / ``points["intra_all_gather"]`` are fitted with
    the ring reduce-scatter / all-gather formulas into the profile's
    ``intra_reduce_scatter`` / ``intra_all_gather`` links. Optional
    ``points["intra_broadcast"]`` (n bytes moved as L broadcasts of n/L in one go) are
    fitted as L binomial broadcasts of n/L in a row (each point's size and time divided by
    L) into ``intra_broadcast``: the effective link of one shard broadcast.
    """
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(_ALGORITHMS)}")
    unknown = sorted(set(points) - set(LEVELS) - set(INTRA_COLLECTIVES))
    if unknown:
        raise ValueError(f"unknown levels {unknown}; valid: {', '.join((*LEVELS, *INTRA_COLLECTIVES))}")
    ranks = {"intra": ranks_per_node, "inter": nodes, **{k: ranks_per_node for k in INTRA_COLLECTIVES}}
    collective = {"intra": "allreduce", "inter": "allreduce", **INTRA_COLLECTIVES}
    fit_algorithm = {
        level: algorithm if c == "allreduce" else _INTRA_FIT_ALGORITHM[c] for level, c in collective.items()
    }
    fits: dict[str, cm.LinkFit] = {}
    for level, pts in points.items():
        if not pts:
            continue
        sizes, times = zip(*pts)
        if collective[level] == "broadcast":  # L broadcasts of n/L: one of them is n/L in t/L
            sizes = tuple(n / ranks[level] for n in sizes)
            times = tuple(t / ranks[level] for t in times)
        fits[level] = cm.fit_link(
            sizes, times, ranks=ranks[level], collective=collective[level], algorithm=fit_algorithm[level]
        )
    if not any(level in fits for level in LEVELS):
        raise ValueError("no all-reduce measurements to fit: the world has one rank (calibrate needs >= 2)")
    for level in LEVELS:
        if level not in fits:
            other = "inter" if level == "intra" else "intra"
            logger.warning("calibrate: no %s measurements (a group of one rank); copying the %s link", level, other)
    intra = fits.get("intra", fits.get("inter")).link  # type: ignore[union-attr]
    rail = fits.get("inter", fits.get("intra")).link  # type: ignore[union-attr]
    nics = ranks_per_node if rails is None else min(rails, ranks_per_node)
    inter = cm.Link(rail.alpha, rail.beta * nics / ranks_per_node, rail.gamma)
    meta: dict[str, Any] = dict(metadata or {})
    meta["fits"] = {
        level: {
            "ranks": ranks[level],
            "collective": collective[level],
            "algorithm": fit_algorithm[level],
            "alpha": f.link.alpha,
            "beta": f.link.beta,
            "r2": f.r2,
            "max_rel_error": f.max_rel_error,
            "num_points": f.num_points,
        }
        for level, f in fits.items()
    }
    meta["points"] = {level: [[int(n), float(t)] for n, t in pts] for level, pts in points.items()}
    extra: dict[str, Any] = {level: fits[level].link if level in fits else None for level in INTRA_COLLECTIVES}
    profile = cm.Profile(
        intra=intra,
        inter=inter,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        rails=rails,
        backend=backend,
        name=name,
        source=source,
        metadata=meta,
        **extra,
    )
    if "nccl" in backend.lower():
        profile = _nccl_profile(profile, points)
    return profile, fits


_GPU_BY_MAJOR = {7: "volta", 8: "ampere", 9: "hopper"}


def _nccl_profile(profile: cm.Profile, points: Mapping[str, Sequence[tuple[float, float]]]) -> cm.Profile:
    """A profile measured under NCCL, with NCCL's inputs fitted by NCCL's own model.

    The ring's bus bandwidth to the node's reduce-scatter, NVLS's to its all-reduce (where it
    beats the ring), the NIC rate and the fabric latency to the rail all-reduces
    (:func:`hiersync.costmodel.fit_nccl_profile`); the GPU generation is the measured compute
    capability (``metadata["cuda_capability"]``), Hopper if unknown.
    """
    major = (profile.metadata.get("cuda_capability") or [9])[0]
    gpu = _GPU_BY_MAJOR.get(major, "blackwell" if major >= 10 else "volta")
    return cm.fit_nccl_profile(
        replace(profile, gpu=gpu),
        intra=points.get("intra", ()),
        reduce_scatter=points.get("intra_reduce_scatter", ()),
        rail=points.get("inter", ()),
    )


def _shard_broadcasts_time(algorithm: str, ranks: int, nbytes: float, link: cm.Link) -> float:
    """L broadcasts of ``nbytes / L`` in a row (what ``"intra_broadcast"`` points measure)."""
    return ranks * cm.broadcast_time(algorithm, ranks, nbytes / ranks, link)


_PREDICT: dict[str, Callable[[str, int, float, cm.Link], float]] = {
    "allreduce": cm.allreduce_time,
    "reduce_scatter": cm.reduce_scatter_time,
    "all_gather": cm.all_gather_time,
    "broadcast": _shard_broadcasts_time,
}


def format_fits(profile: cm.Profile, fits: Mapping[str, cm.LinkFit]) -> str:
    """The fitted links, their R^2, and measured vs fitted time per size, as text."""
    meta = profile.metadata.get("fits", {})
    points = profile.metadata.get("points", {})
    lines = [
        f"profile {profile.name} [{profile.backend}]: {profile.nodes} nodes x {profile.ranks_per_node} ranks, "
        f"{profile.rails or profile.ranks_per_node} NIC(s) per node",
        "",
    ]
    table = [
        [
            level,
            str(meta[level]["ranks"]),
            f"{f.link.alpha * 1e6:.2f}",
            f"{f.link.bandwidth / 1e9:.4g}",
            f"{f.r2:.5f}",
            f"{f.max_rel_error:.1%}",
            str(f.num_points),
        ]
        for level, f in fits.items()
    ]
    lines.append(render(["level", "ranks", "alpha_us", "GB/s", "R^2", "max_err", "points"], table))
    lines.append(
        f"profile links: intra {profile.intra.alpha * 1e6:.2f} us, {profile.intra.bandwidth / 1e9:.4g} GB/s; "
        f"inter (per NIC) {profile.inter.alpha * 1e6:.2f} us, {profile.inter.bandwidth / 1e9:.4g} GB/s"
    )
    if "nccl" in profile.backend.lower():
        nvls = "none" if profile.nvls_gbps is None else f"{profile.nvls_gbps:.4g} GB/s"
        lines.append(
            f"NCCL model: intra ring {profile.intra.bandwidth / 1e9:.4g} GB/s busbw, NVLS {nvls}, GPU {profile.gpu}, "
            f"fabric latency {profile.net_latency_us:.1f} us (NCCL's model fitted to the measurements)"
        )
    for level in INTRA_COLLECTIVES:
        link = getattr(profile, level)
        if link is not None:
            lines.append(f"  {level}: {link.alpha * 1e6:.2f} us, {link.bandwidth / 1e9:.4g} GB/s effective")
    for level, f in fits.items():
        p = meta[level]["ranks"]
        what = meta[level].get("collective", "allreduce")
        lines += [
            "",
            f"{level}: {what} on {p} ranks",
        ]
        table = []
        for n, t in points.get(level, []):
            pred = _PREDICT[what](meta[level]["algorithm"], p, n, f.link)
            table.append([format_size(n), f"{t * 1e6:.1f}", f"{pred * 1e6:.1f}", f"{(pred - t) / t:+.1%}"])
        lines.append(render(["bytes", "measured_us", "fitted_us", "error"], table, align="r"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Running: one body for torchrun and for the local launcher.


def _environment() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": str(dist.get_backend()),
        "world_size": dist.get_world_size(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        meta["cuda_capability"] = list(torch.cuda.get_device_capability())
    if hasattr(os, "getloadavg"):
        meta["loadavg_before"] = list(os.getloadavg())
    return meta


def calibrate(config: SweepConfig, device: torch.device | None = None) -> dict[str, Any]:
    """Detect the topology, sweep both levels and return the measurements. Collective.

    Needs an initialized default process group. Returns ``{"points", "nodes",
    "ranks_per_node", "backend", "metadata"}`` on every rank (the points are the
    world-wide slowest times, so every rank holds the same numbers).
    """
    import torch
    import torch.distributed as dist

    from hiersync.topology import Topology

    if device is None:
        device = torch.device("cpu")
    meta = _environment()
    topo = Topology.detect()
    if not topo.even:
        raise ValueError(
            f"calibrate needs the same number of ranks on every node, got nodes {[list(n) for n in topo.nodes]}"
        )
    groups = topo.build_groups()
    start = time.perf_counter()
    points = sweep(groups, config, device)
    meta["sweep_s"] = round(time.perf_counter() - start, 3)
    if hasattr(os, "getloadavg"):
        meta["loadavg_after"] = list(os.getloadavg())
    meta["sweep"] = asdict(config)
    meta["topology"] = [list(n) for n in topo.nodes]
    return {
        "points": points,
        "nodes": topo.num_nodes,
        "ranks_per_node": topo.ranks_per_node,
        "backend": str(dist.get_backend()),
        "metadata": meta,
    }


def _local_rank_body(config: SweepConfig) -> dict[str, Any] | None:
    """Body of every rank under :func:`hiersync.tools.launch.run` (module level: the forkserver imports it)."""
    import torch.distributed as dist

    result = calibrate(config)
    return result if dist.get_rank() == 0 else None


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _torchrun_calibrate(config: SweepConfig, backend: str | None) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    created = False
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method="env://")
        created = True
    elif "nccl" in str(dist.get_backend()).lower():
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        result = calibrate(config, device)
        return result if dist.get_rank() == 0 else None
    finally:
        if created:
            dist.destroy_process_group()


def _finish(result: Mapping[str, Any], args: argparse.Namespace, mode: str) -> cm.Profile:
    meta = dict(result["metadata"])
    meta["mode"] = mode
    meta["command"] = "python -m hiersync calibrate " + " ".join(
        sys.argv[2:] if sys.argv[1:2] == ["calibrate"] else sys.argv[1:]
    )
    profile, fits = fit_profile(
        result["points"],
        nodes=result["nodes"],
        ranks_per_node=result["ranks_per_node"],
        rails=args.rails,
        backend=result["backend"],
        algorithm=args.algorithm,
        name=args.name,
        source=f"python -m hiersync calibrate ({mode}, {meta.get('date', '')})",
        metadata=meta,
    )
    profile.save(args.out)
    print(format_fits(profile, fits))
    print(f"\nwrote {args.out} (sweep {meta.get('sweep_s', 0):.1f} s)")
    low = [level for level, f in fits.items() if f.r2 < 0.9]
    if low:
        logger.warning(
            "calibrate: poor fit (R^2 < 0.9) for %s: re-run on a quiet machine or with --full", ", ".join(low)
        )
    return profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="profile.json", help="JSON profile to write (default profile.json)")
    parser.add_argument("--nodes", type=int, help="emulate this many nodes locally (no torchrun)")
    parser.add_argument("--procs-per-node", type=int, help="ranks per emulated node (with --nodes)")
    parser.add_argument("--full", action="store_true", help="every power of two from 4 KiB to 256 MiB")
    parser.add_argument(
        "--sizes", help="comma-separated message sizes, e.g. 4096,64K,1M (binary units; overrides --full)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size (default 2)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per size; median (default 5)")
    parser.add_argument("--budget-s", type=float, default=2.0, help="seconds per size and collective (default 2)")
    parser.add_argument("--rails", type=int, help="NICs per node (default: one per rank); 1 on the testbed")
    parser.add_argument(
        "--algorithm",
        choices=_ALGORITHMS,
        default="ring",
        help="all-reduce algorithm of the backend, for the fit (default ring: gloo, NCCL rings)",
    )
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="under torchrun (default: nccl if CUDA, else gloo)")
    parser.add_argument("--name", default="calibrated", help="profile name (default calibrated)")
    parser.add_argument("--timeout", type=float, default=900.0, help="local mode: kill the ranks after this (s)")


def _config(args: argparse.Namespace) -> SweepConfig:
    if args.sizes:
        try:
            sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s.strip())
        except ValueError:
            raise ValueError(f"--sizes must be comma-separated byte sizes, got {args.sizes!r}") from None
    else:
        sizes = FULL_SIZES if args.full else QUICK_SIZES
    return SweepConfig(sizes=sizes, warmup=args.warmup, reps=args.reps, budget_s=args.budget_s)


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.rails is not None and args.rails < 1:
        raise ValueError(f"--rails must be >= 1, got {args.rails}")
    if args.nodes is not None or args.procs_per_node is not None:
        if _under_torchrun():
            raise ValueError("--nodes/--procs-per-node emulate a cluster locally; under torchrun leave them out")
        nodes, lpn = args.nodes or 1, args.procs_per_node or 1
        if nodes < 1 or lpn < 1 or nodes * lpn < 2:
            raise ValueError(f"need --nodes >= 1 and --procs-per-node >= 1 with at least 2 ranks, got {nodes} x {lpn}")
        from hiersync.tools.launch import run as launch

        node_ids = [r // lpn for r in range(nodes * lpn)]
        results = launch(
            _local_rank_body,
            nodes * lpn,
            (config,),
            node_ids=node_ids,
            timeout=args.timeout,
            pg_timeout=min(args.timeout, 300.0),
        )
        _finish(results[0], args, f"local {nodes}x{lpn}, HIERSYNC_NODE_IDS, gloo over loopback")
        return 0
    if not _under_torchrun():
        raise ValueError(
            "calibrate needs ranks: run it under torchrun (RANK and WORLD_SIZE are not set), or emulate "
            "nodes locally with --nodes N --procs-per-node L"
        )
    result = _torchrun_calibrate(config, args.backend)
    if result is not None:
        testbed = os.environ.get("HIERSYNC_TESTBED_EMULATED") == "1"
        _finish(result, args, "testbed (netns, shaped link)" if testbed else "torchrun")
    return 0
