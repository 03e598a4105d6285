"""``python -m hiersync bench``: schedules x bucket sizes, side by side, on an emulated cluster.

Every *schedule* trains the same model with the same data on the same cluster in one run:

============================  ==============================================================
``ddp``                       DDP's default all-reduce (no hook): the baseline
``postlocal_k<k>``            PyTorch ``post_localSGD_hook`` (intra-node all-reduce) +
                              ``PeriodicModelAverager(period=k)`` (world parameter average)
``bf16_hook``                 PyTorch ``bf16_compress_hook`` (flat all-reduce in bf16)
``hiersync_p1``               hiersync, period 1 (exact two-level all-reduce every step)
``hiersync_p<k>[_overlap][_bf16]``  hiersync, period k, optionally overlapped / bf16 deltas
``hiersync_p<k>_stream[<F>][_tau<t>][_bf16]``  streaming: F fragments (default k) staggered over the
                              period, each applied t steps after launch (default 1)
``torchft_*``                 torchft's LocalSGD, DiLoCo, Streaming DiLoCo (``--peers torchft``)
``fsdp_*``                    FSDP2 rows (``--fsdp``): FSDP2 HSDP, hiersync over FSDP2, FSDP2 in the
                              node only (:mod:`.bench_spec`)
``intra_only``                intra-node all-reduce only, never across nodes (reference)
``compute_only``              a hook that communicates nothing (reference: compute floor)
============================  ==============================================================

Every schedule runs under two *compute models* (``--compute``, default both), and every
ratio compares rows of one compute model:

* ``cpu``: the MLP computes on the CPU, as training on CPUs does; here the 4 ranks'
  compute shares 2 cores with gloo's sockets, so communication cannot hide behind it;
* ``accel``: accelerator-like; each layer has ``torch.nn.Linear``'s parameters but its
  forward sleeps ``--accel-layer-ms`` (default 25 ms) and its backward twice that, with the
  CPU idle as a host is while its GPU computes, then produces real gradients of the
  same shapes with O(width^2) memory-bound work. Default: 4 layers x 75 ms = 0.3 s per
  step, the CPU model's compute time on this 2-core testbed, so both models move the
  same bytes behind the same compute time.

Each (model, compute model, schedule, bucket size) runs ``warmup`` steps, then ``steps``
*attributed* steps with a barrier between phases -- data, forward, backward, communication
wait, optimizer -- then one untimed free-running step, and then ``steps`` *unsynchronized*
steps whose wall time is the step time the ratios use (overlap only shows there). ``steps``
is rounded up to a multiple of ``k``. *Communication wait* is the exposed part: the time
``backward()`` keeps running after the slowest rank's last gradient was accumulated, plus the
time spent after the optimizer's own update (hiersync's or torchft's post-step sync, the
model averager). Per row the table gives the mean step time and the p50/p99 of the job's
per-step durations (a step ends when its last rank ends it: :func:`.bench_rows.step_durations`),
the mean and peak inter-node MB a node sent per step (on the testbed counted on each node's
link, the same way for every row; on loopback hiersync's counters or a ring model), and the
extra peak memory per rank over DDP's. The claims hiersync makes are checked, each ratio with
the 95% interval its rows' per-step times give it (:mod:`.bench_noise`): PASS or FAIL only where
the interval is clear of the bound, inconclusive where it holds it (reports, never a failed
command), and with ``--peers torchft`` the ratios of hiersync's
streaming rows to each torchft row. Then the cost model's prediction of each row's exposed
time, given the run's own measured compute, beside the measurement (:mod:`.bench_model`;
``--profile`` picks the link profile).

The default runs in about four minutes on a 2-core machine: the emulated 2x2 cluster
(800 Mbit/s between nodes), a 25M-parameter MLP (100 MB of fp32 gradients), 25 MB
buckets, both compute models and the schedules the claims name. ``--peers torchft`` adds
torchft's rows (pip install 'hiersync[peers]'); ``--full`` sweeps everything.

Example::

    $ sudo python -m hiersync bench                       # default comparison, ~4 min
    $ sudo python -m hiersync bench --peers torchft       # with torchft's rows beside hiersync's
    $ sudo python -m hiersync bench --fsdp --results results/fsdp  # FSDP2 HSDP vs hiersync over FSDP2
    $ sudo python -m hiersync bench --full --results results/full
    $ python -m hiersync bench --loopback --mlp-params 1M --steps 2 --warmup 1

Modules: :mod:`.bench_spec` (schedule names), :mod:`.bench_worker` (what each rank runs, with
:mod:`.bench_steps`, :mod:`.bench_compute`, :mod:`.bench_probes`, :mod:`.bench_torchft` and
:mod:`.bench_fsdp`), :mod:`.bench_rows`
(rows), :mod:`.bench_table`, :mod:`.bench_claims`, :mod:`.bench_plots` and :mod:`.report`
(what is printed and written), :mod:`.bench_model` (the cost model beside it), this one
(the sweep and the command), :mod:`.bench_progress` (its progress bar).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hiersync.vocab import NONFINITE_MODES, parse_count

from .bench_claims import check_claims, format_claims, format_peer_ratios, peer_ratios, rounds
from .bench_compute import build_model
from .bench_model import compare, format_comparison, format_model_targets, model_targets, resolve_profile
from .bench_noise import loaded
from .bench_progress import ProgressFile, environment
from .bench_rows import summarize
from .bench_spec import (
    COMPUTE_MODELS,
    FSDP_GRAMMAR,
    FULL_PERIODS,
    GRAMMAR,
    PEERS,
    STEADY_ROUNDS,
    TORCHFT_GRAMMAR,
    ScheduleSpec,
    default_schedules,
    fsdp_schedules,
    full_schedules,
    memory_steps,
    parse_compute,
    parse_schedule,
    run_steps,
    timed_steps,
    with_peers,
)
from .bench_table import format_table
from .netns import DEFAULT_RATE
from .report import write_outputs

__all__ = [
    "ScheduleSpec",
    "parse_schedule",
    "default_schedules",
    "full_schedules",
    "run_bench",
    "timed_steps",
    "make_config",
    "command_line",
    "add_arguments",
    "run",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS_MB = (25.0,)
FULL_BUCKETS_MB = (1.0, 5.0, 25.0, 100.0)


def run_bench(
    config: dict,
    *,
    nodes: int = 2,
    procs_per_node: int = 2,
    inter_rate: str | None = DEFAULT_RATE,
    loopback: bool = False,
    timeout: float = 900.0,
    progress: bool = True,
) -> tuple[list[dict], dict]:
    """Run the sweep described by ``config`` on an emulated cluster; return (rows, raw)."""
    from .cluster import run_ranks

    specs = [parse_schedule(s) for s in config["schedules"]]
    computes = config.get("compute", ["cpu"])
    warmup, steps = int(config["warmup"]), int(config["steps"])
    per_compute = {
        c: sum(run_steps(parse_schedule(s), warmup, steps) for s in rounds(config["schedules"], c)) for c in computes
    }
    total = (
        sum(per_compute[c] for m in config["models"] for c in computes if c == "cpu" or m == "mlp")
        * len(config["buckets_mb"])
        * int(config.get("repeat", 1))
    )
    if config.get("memory"):
        total += sum(memory_steps(s, int(config["warmup"])) for s in specs)
    with tempfile.TemporaryDirectory(prefix="hiersync-bench-") as tmp:
        prog_path = Path(tmp) / "progress"
        config = {**config, "progress": str(prog_path)}
        bar = ProgressFile(prog_path, total) if progress else None
        load_before = os.getloadavg()[0]
        start = time.monotonic()
        cluster = dict(
            nodes=nodes,
            procs_per_node=procs_per_node,
            inter_rate=inter_rate,
            loopback=loopback,
            timeout=timeout,
            poll=bar.poll if bar else None,
        )
        try:
            results, info = run_ranks("hiersync.tools.bench_worker:worker", config, **cluster)  # type: ignore[arg-type]
            if config.get("memory"):
                # In fresh ranks: after a timed sweep the allocator's state moved peaks by 50-100 MB per rank.
                memory, _ = run_ranks("hiersync.tools.bench_worker:memory_worker", config, **cluster)  # type: ignore[arg-type]
                for mine, mem in zip(results, memory):
                    mine["memory"] = mem
        finally:
            if bar is not None:
                bar.close()
        wall = time.monotonic() - start
    rows = summarize(results)
    probes = [r["copy_probe"] for r in results if r.get("copy_probe")]
    raw = {
        "format": "hiersync.bench/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall,
        "config": {k: v for k, v in config.items() if k != "progress"},
        "testbed": info,
        # On a shared machine other jobs steal cores from the ranks: say how busy it was.
        "environment": {**environment(), "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]},
        "ranks": results,
    }
    if probes:  # the slowest rank's copy speed
        slow = max(probes, key=lambda p: p["seconds"] / p["bytes"])
        raw["copy_probe"] = {**slow, "gbps": slow["bytes"] / slow["seconds"] / 1e9}
    return rows, raw


def check_fragments(specs: Sequence[ScheduleSpec], config: dict) -> None:
    """``ValueError`` before any rank starts when a streaming row has more fragments than a model
    has parameter tensors (a fragment holds whole tensors); the models are built on the meta device,
    with real CPU layers (the accel model's layers hold the same tensors, and it builds the mlp only)."""
    import torch

    streaming = [sp for sp in specs if sp.fragments > 1]
    for name in config["models"] if streaming else ():
        with torch.device("meta"):
            tensors = len(list(build_model(name, config, "cpu")[0].parameters()))
        for sp in streaming:
            if sp.fragments > tensors:
                raise ValueError(
                    f"schedule {sp.name!r}: {sp.fragments} fragments but the {name} has {tensors} parameter tensors "
                    f"(a fragment holds whole tensors): name at most {tensors} fragments, e.g. _stream{tensors}"
                )


def make_config(args: argparse.Namespace) -> dict:
    """The worker's configuration from the command line (validated here, not in the ranks)."""
    if args.schedules:
        schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    elif args.fsdp:
        schedules = fsdp_schedules(period=4)
    elif args.full:
        schedules = full_schedules(args.periods or FULL_PERIODS)
    else:
        schedules = default_schedules()
    peers = [x.strip() for x in (args.peers or "").split(",") if x.strip()]
    schedules = with_peers(schedules, peers, period=4)
    specs = [parse_schedule(s) for s in schedules]  # ValueError naming a bad name, before any rank starts
    fsdp = [sp.name for sp in specs if sp.kind.startswith("fsdp_")]
    if fsdp and "fsdp_hsdp" not in schedules:
        schedules.insert(0, "fsdp_hsdp")  # every FSDP2 row is compared with HSDP (step and memory)
    for s in schedules:
        if parse_schedule(s).kind == "torchft":
            from .bench_torchft import require_torchft

            require_torchft()  # ImportError naming the extra, before any rank starts
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
    try:
        params = parse_count(args.mlp_params)
    except ValueError:
        raise ValueError(f"--mlp-params={args.mlp_params!r} is not a number like 25M, 500k or 300000") from None
    if params < 64:
        raise ValueError(f"--mlp-params={args.mlp_params!r} is too small (>= 64 parameters)")
    if fsdp and models != ["mlp"]:
        rows = ", ".join(fsdp)
        raise ValueError(f"--models={','.join(models)}: the FSDP2 rows ({rows}) shard the mlp; use --models mlp")
    compute = parse_compute(args.compute)
    if not args.accel_layer_ms >= 0:
        raise ValueError(f"--accel-layer-ms={args.accel_layer_ms} must be >= 0")
    for name in ("steps", "batch_size", "mlp_depth", "repeat"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.min_seconds >= 0:
        raise ValueError(f"--min-seconds={args.min_seconds} must be >= 0")
    if args.warmup < 1:
        raise ValueError(f"--warmup={args.warmup} must be >= 1 (DDP rebuilds its buckets after the first step)")
    config = {
        "models": models,
        "compute": compute,
        "accel_layer_ms": args.accel_layer_ms,
        "schedules": schedules,
        "buckets_mb": buckets,
        "mlp_params": params,
        "mlp_depth": args.mlp_depth,
        "batch_size": args.batch_size,
        "transformer": {
            "vocab": 2048,
            "dim": args.transformer_dim,
            "heads": 4,
            "layers": args.transformer_layers,
            "seq": 64,
            "batch": 8,
        },
        "steps": args.steps,
        "min_seconds": args.min_seconds,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "lr": 1e-3,
        "seed": args.seed,
        "hiersync_options": {"nonfinite": args.nonfinite},
        "pg_timeout": 120.0,
        # the memory pass: on with --memory, and with --peers or FSDP2 rows (the comparison is about memory too)
        "memory": bool(args.memory or peers or fsdp),
    }
    check_fragments(specs, config)
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sweep")
    g.add_argument(
        "--full",
        action="store_true",
        help="everything: mlp+transformer, buckets 1,5,25,100 MB, k in 2,4,8 with/without overlap and bf16",
    )
    g.add_argument(
        "--schedules",
        default=None,
        help="comma-separated schedule names: ddp, postlocal_k<k>, bf16_hook, intra_only, compute_only, "
        f"{GRAMMAR}, {TORCHFT_GRAMMAR}, {FSDP_GRAMMAR} (default: the claims' k=4 set)",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="the FSDP2 rows instead of the default set: FSDP2 HSDP every step, hiersync FSDP k=4 blocking and "
        "streaming (period=4, fragments=4, overlap=1), FSDP2 inside the node only; with the memory pass",
    )
    g.add_argument(
        "--peers",
        default=None,
        help=f"add other libraries' rows at k=4: {', '.join(PEERS)} (torchft's LocalSGD, DiLoCo and Streaming "
        "DiLoCo, plus hiersync streaming with DiLoCo's outer optimizer; torchft-all: every configuration torchft "
        "accepts). Needs pip install 'hiersync[peers]'",
    )
    g.add_argument(
        "--compute",
        default=",".join(COMPUTE_MODELS),
        help="compute models, one table each: cpu (real CPU compute) and/or accel (layers sleep with the "
        "CPU idle, like a host whose GPU computes; mlp only). Default: both",
    )
    g.add_argument(
        "--accel-layer-ms",
        type=float,
        default=25.0,
        help="accel compute model: forward sleep per layer in ms, backward twice that (default 25: "
        "4 layers x 75 ms = 0.3 s per step, the CPU model's compute time here)",
    )
    g.add_argument(
        "--periods",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="periods k for --full (default 2,4,8)",
    )
    g.add_argument("--buckets", default=None, help="comma-separated DDP bucket sizes in MB (default 25)")
    g.add_argument("--models", default=None, help="mlp and/or transformer (default mlp; --full: both)")
    g.add_argument("--mlp-params", default="25M", help="MLP size in parameters (25M = 100 MB of fp32 gradients)")
    g.add_argument("--mlp-depth", type=int, default=4, help="MLP layers")
    g.add_argument("--batch-size", type=int, default=16, help="MLP batch per rank")
    g.add_argument("--transformer-dim", type=int, default=256)
    g.add_argument("--transformer-layers", type=int, default=4)
    g.add_argument(
        "--steps",
        type=int,
        default=4,
        help="timed steps per pass at least, rounded up to a multiple of k (see --min-seconds)",
    )
    g.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (DDP rebuilds its buckets after the first)"
    )
    g.add_argument(
        "--min-seconds",
        type=float,
        default=4.0,
        help="time whole windows of a row's steps for at least this long (fast rows: a steady mean); the rows "
        "whose means a claim compares with a bound within 6%% of 1x, the k-step rows whose means a claim compares "
        "and those the cost model's check judges run this long in each of 3 interleaved rounds",
    )
    g.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="go round the whole sweep this many times (noisy machines): the runs' mean step, medians of the rest",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--memory",
        action="store_true",
        help="after the timed sweep, run each schedule again in fresh ranks to measure its peak memory per rank "
        "over compute_only's (extra MB; on with --peers)",
    )
    g.add_argument(
        "--nonfinite",
        choices=NONFINITE_MODES,
        default="skip",
        help="HierState(nonfinite=...) of the hiersync schedules (default: hiersync's default, skip)",
    )
    c = parser.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=2)
    c.add_argument("--procs-per-node", type=int, default=2)
    c.add_argument("--inter-rate", default=DEFAULT_RATE, help="tc rate of each node's egress")
    c.add_argument("--loopback", action="store_true", help="no namespaces: plain loopback, links not shaped")
    c.add_argument("--timeout", type=float, default=None, help="kill the run after this many seconds")
    c.add_argument(
        "--profile",
        default=None,
        help="link profile for the cost-model-vs-bench table: a preset name or a calibrated P.json "
        "(default: the emulated preset on the default shaped 800mbit link; 'none' to skip)",
    )
    p = parser.add_argument_group("slow nodes (--slow: the rows of bench_pace instead of the sweep)")
    p.add_argument(
        "--slow",
        action="append",
        default=None,
        metavar="NODE=FACTOR",
        help="a node whose accel compute runs at FACTOR of full speed (e.g. 1=0.5; repeat or comma-separate): "
        "measure DDP, fixed and adaptive pace against the ideal (the sum of the nodes' own rates)",
    )
    p.add_argument("--pace-period", type=int, default=8, help="--slow: the period k (default 8)")
    p.add_argument("--pace-fragments", type=int, default=8, help="--slow: streaming fragments (default 8, overlap 1)")
    p.add_argument("--pace-windows", type=int, default=4, help="--slow: timed windows per row (default 4)")
    o = parser.add_argument_group("output")
    o.add_argument("--results", default="results/bench", help="folder for bench.json/.csv/.md and the plots")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def command_line(args: argparse.Namespace) -> str:
    """``python -m hiersync bench`` plus the options that differ from their defaults."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    parts = ["python -m hiersync bench"]
    for dest, value in vars(args).items():
        if dest in defaults and value != defaults[dest]:
            flag = "--" + dest.replace("_", "-")  # every option is spelled after its dest
            if value is True:
                parts.append(flag)
            elif isinstance(value, list):
                parts.append(f"{flag} {','.join(map(str, value))}")
            else:
                parts.append(f"{flag} {value}")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    if args.slow:
        from . import bench_pace

        try:
            return bench_pace.run(args)
        except ValueError as e:
            logger.error("bench: %s", e)
            return 2
    try:
        config = make_config(args)
    except ImportError as e:
        logger.error("bench: %s", e)
        return 2
    from hiersync.tools.launch import RankFailed

    from .cluster import cluster_args
    from .testbed import TestbedError

    timeout = args.timeout or (7200.0 if args.full else 900.0) * args.repeat
    try:
        rows, raw = run_bench(
            config,
            **cluster_args(args),
            timeout=timeout,
            progress=not args.no_progress,
        )
    except (TestbedError, RankFailed, TimeoutError) as e:
        logger.error("bench failed: %s", e)
        return 1
    raw["command"] = command_line(args)
    profile, source = resolve_profile(args.profile, raw["testbed"])
    probe = raw.get("copy_probe")
    copy_beta = probe["seconds"] / probe["bytes"] if probe else None
    entries = (
        compare(rows, profile, nodes=args.nodes, ranks_per_node=args.procs_per_node, copy_s_per_byte=copy_beta)
        if profile
        else []
    )
    if profile and probe:
        source += (
            f"; launch copies at {probe['gbps']:.2f} GB/s, measured in this run (a copy of "
            f"{probe['bytes'] / 2**20:.1f} MiB, every rank at once)"
        )
    model_checks = model_targets(entries, environment=raw["environment"])
    raw["model"] = {"source": source, "entries": entries, "targets": model_checks}
    if any(parse_schedule(s).kind == "torchft" for s in config["schedules"]):
        from .bench_torchft import describe

        specs = [parse_schedule(s) for s in config["schedules"]]
        raw["torchft_options"] = describe(specs, args.nodes, args.procs_per_node)
    claims = check_claims(rows, environment=raw["environment"])
    raw["claims"] = claims
    ratios = peer_ratios(rows)
    raw["peer_ratios"] = ratios
    paths = write_outputs(args.results, raw, rows, plots=not args.no_plots)
    # The CLI's final output: the comparison table.
    env = raw["environment"]
    print(
        f"hiersync bench on {raw['testbed']['describe']} ({raw['wall_s']:.0f} s, "
        f"load average {env['loadavg_1min_before']:.1f} -> {env['loadavg_1min_after']:.1f} on {env['cpus']} cores)"
    )
    print(
        "step s: mean unsynchronized step time (slowest rank), p50/p99 of the job's per-step times "
        "(a step ends when its last rank ends it); "
        "data..opt: attributed with barriers between phases;\ninter MB/step, peak MB: mean and largest "
        "inter-node MB one node sent per step; extra MB: a rank's extra peak memory (worst rank, --memory); "
        "ratios compare rows of one compute model\n"
    )
    print(format_table(rows))
    for line in raw.get("torchft_options", []):
        print(line)
    if ratios:
        print("\n" + format_peer_ratios(ratios) + "\n")
    if claims:
        print(
            "hiersync's claims on this testbed, checked in this run (reports, not assertions): each ratio with its "
            f"95% interval from this run's per-step times, or from its {STEADY_ROUNDS} rounds where both rows ran in "
            "them;\nPASS or "
            "FAIL only where the interval is clear of the bound, inconclusive where it holds it (--repeat narrows it)"
        )
        if loaded(env):  # the rule the claims apply, said once above them
            print(
                f"(load average {env['loadavg_1min_before']:.1f} on {env['cpus']} cores before the run: other work "
                "took the cores the ranks need, and its load changes between rows by more than any interval holds, "
                "so no step time is judged; rerun on a quiet machine)"
            )
        print(format_claims(claims))
        if raw["testbed"]["mode"] != "netns":
            print("(loopback: inter-node links are NOT shaped, so these ratios say nothing about a slow network)")
    print()
    print(format_comparison(entries, source) if entries else source)
    if model_checks:
        print(format_model_targets(model_checks))
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return 0
