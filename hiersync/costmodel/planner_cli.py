"""The ``python -m hiersync plan`` command: flags, the profile they describe, the printed plan.

A network comes from ``--profile P.json`` (``python -m hiersync calibrate``), ``--preset``,
or flags alone (``--inter-gbps 12.5 --nics-per-node 1 --intra-gbps 235 --nodes 16
--gpus-per-node 8``); with a profile or preset the same flags override its fields. ``--fsdp``
plans a model sharded with FSDP2 inside the node instead (:mod:`.fsdp_plan`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from typing import Any

from hiersync import costmodel as cm

from .compression import COMPRESS_OPTIONS, DEFAULT_QUANT_GBPS, QUANT_BLOCK
from .failures import (
    DEFAULT_CHECKPOINT_S,
    DEFAULT_DETECT_S,
    DEFAULT_RESTART_S,
    LLAMA3_NODE_MTBF_HOURS,
    failure_plan,
    format_failures,
)
from .fsdp import ADAMW_STATE_BYTES
from .fsdp_plan import DEFAULT_UNITS, GPU_MEMORY_GB, format_fsdp_plan, make_fsdp_plan
from .planner import DEFAULT_FRAGMENTS, DEFAULT_OVERLAPS, DEFAULT_WARMUP_STEPS, DTYPE_BYTES, copy_s_per_byte, make_plan
from .planner_report import format_plan
from .planner_sweeps import StepsPenalties, read_steps_penalty

__all__ = ["add_arguments", "add_profile_arguments", "profile_from_args", "run"]

logger = logging.getLogger(__name__)

# Hop latencies of the alpha-beta model when the flags give none (NCCL's Simple-protocol figures,
# NVLink 3.4 us and network 14 us; tens of microseconds on gloo). Under NCCL the cost model
# uses NCCL's whole latency table instead (hiersync.costmodel.nccl).
DEFAULT_LATENCY_S = {"nccl": (3.4e-6, 14e-6), "other": (30e-6, 60e-6)}


def _list(kind: type, text: str) -> list:
    try:
        values = [kind(float(v)) if kind is int else kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {text!r}")
    return values


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the network comes from: a profile, a preset, or the link flags."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--profile", metavar="P.json", help="calibrated profile (python -m hiersync calibrate)")
    src.add_argument("--preset", choices=sorted(cm.PRESETS), help="published hardware numbers (docs/costmodel.md)")
    net = parser.add_argument_group("network from flags (alone, or overriding --profile/--preset)")
    net.add_argument("--inter-gbps", type=float, help="achieved bandwidth of one inter-node NIC in GB/s (bytes)")
    net.add_argument("--nics-per-node", type=int, help="inter-node NICs (rails) per node (default: one per GPU)")
    net.add_argument("--intra-gbps", type=float, help="intra-node all-reduce bus bandwidth per GPU in GB/s")
    net.add_argument("--nvls-gbps", type=float, help="NVLS all-reduce bus bandwidth per node in GB/s (NVSwitch nodes)")
    net.add_argument(
        "--net-latency-us",
        type=float,
        help="the fabric: latency the network plugin adds per inter-node step under NCCL (0 InfiniBand/RoCE, "
        "75 AWS EFA on p5; calibrate measures it)",
    )
    net.add_argument("--gpu", choices=list(cm.nccl.GPU_GENERATIONS), help="GPU generation (NCCL's per-channel caps)")
    net.add_argument(
        "--inter-latency-us", type=float, help="latency per inter-node hop, alpha-beta model (gloo; NCCL uses its own)"
    )
    net.add_argument(
        "--intra-latency-us", type=float, help="latency per intra-node hop, alpha-beta model (gloo; NCCL uses its own)"
    )
    net.add_argument("--backend", help="nccl (default: NCCL's tuning model) or gloo (rings) for a network from flags")


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def profile_from_args(args: argparse.Namespace) -> cm.Profile:
    """The profile of ``--profile``/``--preset``, with the link flags applied; or one built from the flags."""
    for name in ("inter_gbps", "intra_gbps", "inter_latency_us", "intra_latency_us", "nvls_gbps", "quant_gbps"):
        _positive("--" + name.replace("_", "-"), getattr(args, name, None))
    net_latency = getattr(args, "net_latency_us", None)
    if net_latency is not None and not net_latency >= 0:
        raise ValueError(f"--net-latency-us must be >= 0, got {net_latency!r}")
    nics = getattr(args, "nics_per_node", None)
    if nics is not None and nics < 1:
        raise ValueError(f"--nics-per-node must be >= 1, got {nics}")
    if args.profile or args.preset:
        base = cm.Profile.load(args.profile) if args.profile else cm.get_preset(args.preset)
    else:
        missing = [
            f for f, v in (("--inter-gbps", args.inter_gbps), ("--intra-gbps", args.intra_gbps)) if v is None
        ] + [f for f, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)) if v is None]
        if missing:
            raise ValueError(
                f"describe the network: --profile P.json, --preset NAME, or the flags {', '.join(missing)} "
                f"(e.g. --inter-gbps 12.5 --nics-per-node 1 --intra-gbps 235 --nodes 16 --gpus-per-node 8)"
            )
        backend = args.backend or "nccl"
        intra_s, inter_s = DEFAULT_LATENCY_S["nccl" if "nccl" in backend.lower() else "other"]
        base = cm.Profile(
            intra=cm.Link.from_bandwidth(intra_s, args.intra_gbps * 1e9),
            inter=cm.Link.from_bandwidth(inter_s, args.inter_gbps * 1e9),
            nodes=args.nodes,
            ranks_per_node=args.gpus_per_node,
            rails=nics,
            backend=backend,
            name="flags",
            source="command-line flags",
        )
    changes: dict = {}
    if args.backend and (args.profile or args.preset):
        changes["backend"] = args.backend
    for level, gbps, us in (
        ("intra", args.intra_gbps, args.intra_latency_us),
        ("inter", args.inter_gbps, args.inter_latency_us),
    ):
        link = getattr(base, level)
        if gbps is not None or us is not None:
            alpha = link.alpha if us is None else us * 1e-6
            beta = link.beta if gbps is None else 1 / (gbps * 1e9)
            changes[level] = cm.Link(alpha, beta, link.gamma)
    if nics is not None:
        changes["rails"] = nics
    for name in ("nvls_gbps", "net_latency_us", "gpu", "quant_gbps"):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    return replace(base, **changes) if changes else base


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7e9")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES),
        default="fp32",
        help="the parameters' (= gradients') dtype (default fp32: under autocast the gradients are still fp32)",
    )
    parser.add_argument("--nodes", type=int, help="nodes (default: the profile's)")
    parser.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the profile's)")
    parser.add_argument(
        "--backward-ms", type=float, help="backward compute time per step (required unless the profile has it)"
    )
    parser.add_argument(
        "--forward-ms",
        type=float,
        help="forward + optimizer compute time per step, > 0 (required unless the profile has it)",
    )
    parser.add_argument("--periods", type=lambda s: _list(int, s), default=[1, 2, 4, 8], help="default 1,2,4,8")
    parser.add_argument(
        "--bucket-mb",
        type=lambda s: _list(float, s),
        default=None,
        help="DDP bucket_cap_mb values (default 1,5,25,100; not used with --fsdp)",
    )
    parser.add_argument(
        "--compress",
        choices=list(COMPRESS_OPTIONS),
        default="none",
        help="deltas on the inter-node sync leg: bf16/fp16 (16 bits), int8/int4 (block-scaled, one fp32 scale per "
        f"{QUANT_BLOCK} elements, a quantized rail average), topk2 (64 of each 4,096 values, 2-bit, gathered: "
        "its bytes grow with the nodes); default none. The plan also says which one pays",
    )
    parser.add_argument(
        "--quant-gbps",
        type=float,
        help=f"GB/s of fp32 a quantize or dequantize pass processes (default: the profile's, else "
        f"{DEFAULT_QUANT_GBPS:g}, a conservative GPU rate, not measured)",
    )
    parser.add_argument(
        "--placement", choices=list(cm.PLACEMENTS), default="hook", help="where period-k averaging runs (default hook)"
    )
    parser.add_argument(
        "--fragments",
        type=lambda s: _list(int, s),
        default=list(DEFAULT_FRAGMENTS),
        help="streaming fragments F to search, F <= 2k (default 1,2,4,8; 0 = no streaming)",
    )
    parser.add_argument(
        "--overlap",
        type=lambda s: _list(int, s),
        default=list(DEFAULT_OVERLAPS),
        help="streaming overlaps tau to search, tau <= k-1 (default 0,1,2)",
    )
    parser.add_argument(
        "--copy-gbps",
        type=float,
        help="speed of the sync's launch copies in GB/s (default: the profile's, else 1000 under NCCL, 5 on "
        "gloo; 0 = copies free)",
    )
    parser.add_argument(
        "--steps-penalty",
        metavar="k=4:1.08,k=16:1.25 | time_to_loss.json",
        help="steps to DDP's loss per period, as x DDP's steps (>= 1; measure them with benchmarks/time_to_loss.py "
        "on your model), or the time_to_loss.json it writes: rank by predicted wall-clock to the loss (step x "
        "penalty) instead of step time; periods between given ones interpolated log-linearly in k",
    )
    fsdp = parser.add_argument_group("FSDP2 inside the node (--fsdp)")
    fsdp.add_argument(
        "--fsdp",
        action="store_true",
        help="plan a model sharded with FSDP2 over each node (hiersync.node_mesh()): memory per GPU, HSDP vs "
        "hiersync period k / streaming",
    )
    fsdp.add_argument("--fsdp-units", type=int, default=DEFAULT_UNITS, help=f"FSDP units (default {DEFAULT_UNITS})")
    fsdp.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        help="fully_shard(..., reshard_after_forward=False): no all-gather in backward, every unit kept gathered",
    )
    fsdp.add_argument(
        "--optimizer-bytes",
        type=float,
        default=ADAMW_STATE_BYTES,
        help=f"optimizer state bytes per parameter (default {ADAMW_STATE_BYTES:g}: AdamW's two fp32 tensors)",
    )
    fsdp.add_argument("--outer", action="store_true", help="an outer optimizer (outer_lr=...): its momentum in memory")
    fsdp.add_argument("--gpu-memory-gb", type=float, default=GPU_MEMORY_GB, help="GPU memory (default 80 GB)")
    fsdp.add_argument(
        "--activations-gb", type=float, default=0.0, help="activations per GPU to add (not modelled; default 0)"
    )
    fail = parser.add_argument_group("failures")
    fail.add_argument(
        "--node-mtbf-hours",
        type=float,
        default=LLAMA3_NODE_MTBF_HOURS,
        help=f"mean hours between failures of one node (default {LLAMA3_NODE_MTBF_HOURS:,.0f}: Llama 3's 419 "
        f"unexpected interruptions in 54 days on 16,384 H100s = 2,048 nodes)",
    )
    fail.add_argument(
        "--checkpoint-s",
        type=float,
        default=DEFAULT_CHECKPOINT_S,
        help=f"seconds to write one checkpoint (default {DEFAULT_CHECKPOINT_S:g}, assumed)",
    )
    fail.add_argument(
        "--restart-s",
        type=float,
        default=DEFAULT_RESTART_S,
        help=f"seconds from a failure to training again after a restart (default {DEFAULT_RESTART_S:g}, assumed)",
    )
    fail.add_argument(
        "--detect-s",
        type=float,
        default=DEFAULT_DETECT_S,
        help="seconds the survivors wait before their quorum drops a dead node: the Lighthouse's heartbeat timeout "
        f"(register(..., heartbeat_timeout=); default {DEFAULT_DETECT_S:g})",
    )
    slow = parser.add_argument_group("nodes of different speeds")
    slow.add_argument(
        "--node-speeds",
        metavar="S,S,...",
        help="each node's speed relative to the fastest, one per node (e.g. 1,1,1,0.5: node 3 at half speed): "
        "prints DDP's, fixed pace's and adaptive pace's throughput against the ideal",
    )
    racks = parser.add_argument_group("a third level: racks (node -> rack -> world)")
    racks.add_argument("--nodes-per-rack", type=int, help="price a rack level too: nodes behind one top-of-rack switch")
    racks.add_argument(
        "--oversubscription",
        type=float,
        default=1.0,
        help="a rack's NIC capacity over its uplink capacity (default 1: a non-blocking spine); also the slow-down of "
        "cross-rack bandwidth for any other reason (a shared spine, racks in other buildings)",
    )
    racks.add_argument("--spine-latency-us", type=float, default=0.0, help="extra latency per hop across racks")
    racks.add_argument("--rack-period", type=int, default=4, help="rack_period to price (default 4)")
    racks.add_argument("--world-period", type=int, help="the world's period with a rack level (default 4 x rack)")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=DEFAULT_WARMUP_STEPS,
        help=f"warmup_steps of the printed register call (default {DEFAULT_WARMUP_STEPS}; not modelled)",
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "fsdp", False):
        return _run_fsdp(args)
    try:
        profile = profile_from_args(args)
        plan = make_plan(
            profile,
            params=args.params,
            dtype=args.dtype,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            backward_s=None if args.backward_ms is None else args.backward_ms / 1e3,
            forward_s=None if args.forward_ms is None else args.forward_ms / 1e3,
            periods=args.periods,
            bucket_mb=args.bucket_mb or [1, 5, 25, 100],
            compress=args.compress,
            placement=args.placement,
            fragments=[f for f in args.fragments if f != 0],
            overlaps=args.overlap,
            copy_s_per_byte=None if args.copy_gbps is None else copy_s_per_byte(args.copy_gbps),
            warmup_steps=args.warmup_steps,
            compare_compress=True,
            steps_penalty=_steps_penalty(args),
        )
    except ValueError as err:
        raise SystemExit(f"python -m hiersync plan: error: {err}") from None
    print(format_plan(plan))
    if args.nodes_per_rack:
        _print_levels(args, plan)
    if args.node_speeds:
        _print_paced(args, plan)
    rec = plan.recommended
    state = plan.params * (DTYPE_BYTES[plan.dtype] + ADAMW_STATE_BYTES) + (plan.memory.total if plan.memory else 0.0)
    _print_failures(args, plan.profile, (rec.period or 1) * rec.step_s, state)
    return 0


def _print_paced(args: argparse.Namespace, plan: Any) -> None:
    from .pace import ddp_paced, format_paced, paced, parse_speeds

    try:
        speeds = parse_speeds(args.node_speeds)
        if len(speeds) != plan.profile.nodes:
            raise ValueError(
                f"--node-speeds has {len(speeds)} speeds for {plan.profile.nodes} nodes: give one per node "
                "(or --nodes to match)"
            )
    except ValueError as err:
        raise SystemExit(f"python -m hiersync plan: error: {err}") from None
    # the recommended period, or (where that is 1: the links hide DDP's communication) the largest
    # one priced, at its best bucket: a slow node makes windows pay where the links alone do not
    rec = plan.recommended
    k = rec.period if rec.period and rec.period > 1 else max(args.periods)
    rows = [ddp_paced(speeds, compute_s=plan.compute_s, exposed_s=plan.best_ddp.exposed_s)]
    windows = [r for r in plan.rows if r.period == k]
    if k > 1 and windows:  # the row's exposed communication per step, k of them a window
        best = rec if rec.period == k else min(windows, key=lambda r: r.step_s)
        rows += [
            paced(speeds, compute_s=plan.compute_s, period=k, sync_s=k * best.exposed_s, pace=pace)
            for pace in ("fixed", "adaptive")
        ]
    print(format_paced(rows, speeds, k))


def _print_levels(args: argparse.Namespace, plan: Any) -> None:
    from .racks import format_levels, price_levels

    top = args.world_period or 4 * args.rack_period
    try:
        rows = price_levels(
            plan.profile,
            params=plan.params,
            nodes=plan.profile.nodes,
            nodes_per_rack=args.nodes_per_rack,
            oversubscription=args.oversubscription,
            compute_s=plan.compute_s,
            rack_period=args.rack_period,
            period=top,
            bytes_per_param=DTYPE_BYTES[plan.dtype],
            spine_latency_s=args.spine_latency_us * 1e-6,
        )
    except ValueError as err:
        raise SystemExit(f"python -m hiersync plan: error: {err}") from None
    print(format_levels(rows, plan.profile.nodes, args.nodes_per_rack, args.oversubscription))


def _steps_penalty(args: argparse.Namespace) -> StepsPenalties | None:
    text = getattr(args, "steps_penalty", None)
    return None if text is None else read_steps_penalty(text)


def _print_failures(args: argparse.Namespace, profile: cm.Profile, window_s: float, state_bytes: float) -> None:
    """The failure lines; a joiner receives ``state_bytes`` per rank from its rail peer at the rail's NIC share."""
    rail = cm.rail_profile(profile).inter.bandwidth
    default = abs(args.node_mtbf_hours - LLAMA3_NODE_MTBF_HOURS) < 1e-9
    source = "Llama 3's 419 interruptions in 54 days on 2,048 nodes" if default else "--node-mtbf-hours"
    try:
        fp = failure_plan(
            nodes=profile.nodes,
            node_mtbf_hours=args.node_mtbf_hours,
            checkpoint_s=args.checkpoint_s,
            restart_s=args.restart_s,
            detect_s=args.detect_s,
            window_s=window_s,
            recovery_s=state_bytes / rail if profile.nodes > 1 else 0.0,
        )
    except ValueError as err:
        raise SystemExit(f"python -m hiersync plan: error: {err}") from None
    print("\n".join(format_failures(fp, mtbf_source=source)))


def _run_fsdp(args: argparse.Namespace) -> int:
    if args.bucket_mb is not None:
        logger.warning("plan --fsdp: --bucket-mb is DDP's and is ignored (FSDP2 communicates per unit)")
    try:
        profile = profile_from_args(args)
        plan = make_fsdp_plan(
            profile,
            params=args.params,
            dtype=args.dtype,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            backward_s=None if args.backward_ms is None else args.backward_ms / 1e3,
            forward_s=None if args.forward_ms is None else args.forward_ms / 1e3,
            units=args.fsdp_units,
            periods=args.periods,
            fragments=[f for f in args.fragments if f != 0],
            overlaps=args.overlap,
            compress=args.compress,
            reshard_after_forward=args.reshard_after_forward,
            optimizer_bytes=args.optimizer_bytes,
            outer=args.outer,
            copy_s_per_byte=None if args.copy_gbps is None else copy_s_per_byte(args.copy_gbps),
            gpu_memory_gb=args.gpu_memory_gb,
            activations_gb=args.activations_gb,
            warmup_steps=args.warmup_steps,
            steps_penalty=_steps_penalty(args),
        )
    except ValueError as err:
        raise SystemExit(f"python -m hiersync plan --fsdp: error: {err}") from None
    print(format_fsdp_plan(plan))
    rec = plan.recommended
    lpn = plan.profile.ranks_per_node
    state = plan.params * (DTYPE_BYTES[plan.dtype] + args.optimizer_bytes) / lpn + plan.memory.hiersync
    _print_failures(args, plan.profile, (rec.period or 1) * rec.st.step_s, state)
    return 0
