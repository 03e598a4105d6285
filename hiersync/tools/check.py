"""``python -m hiersync check``: day-one validation of a cluster, run under torchrun.

On every rank of the job it

1. detects the topology (:meth:`hiersync.Topology.detect`) and prints it: nodes, ranks per
   node, rails, how the nodes were found, and :func:`hiersync.topology.check_layout`'s
   warnings from every rank (``--period`` is the k you plan to use);
2. trains a small model a few steps with DDP's default all-reduce and with hiersync at
   ``period=1`` from the same start and data, and reports the largest parameter
   difference (PASS if <= 1e-5 relative); then runs ``period=2`` with an attached
   optimizer and checks the local-SGD invariants: after a local step the ranks of a node
   are identical (and the nodes differ), after the sync step every rank is identical;
3. times all-reduces nccl-tests style (algbw = bytes / time, busbw = algbw * 2(p-1)/p;
   slowest rank, median) inside every node (all nodes at once), on every rail at once (how
   hiersync loads the network) and on each rail alone (a slow NIC stands out), with the
   timing loop and sweep of ``python -m hiersync calibrate`` (:mod:`hiersync.tools.sweep`);
4. prints the extra memory per rank of each mode (the model of docs/local-sgd.md,
   "Memory"; in bytes for ``--params``);
5. fits the same measurements into a profile (:func:`hiersync.tools.calibrate.fit_profile`,
   the format ``calibrate`` writes) for ``python -m hiersync plan --profile``.

Rank 0 prints the report and writes it as JSON (``--out``). Exit code 0 when every check
passed, 1 otherwise. With CUDA it uses NCCL and ``cuda:LOCAL_RANK``; that path has not run
on a GPU yet (this project has none): only CPU/gloo, on the emulated testbed, is tested.

Example::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        -m hiersync check --out check.json --profile check-profile.json --params 7e9
    python -m hiersync testbed --nodes 2 --procs-per-node 2 -- -m hiersync check --quick --rails 1

    >>> [row["mode"] for row in memory_rows(8)][:2]
    ['period=1 (exact)', 'k>1, plain average']
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hiersync._table import render
from hiersync.vocab import GiB, KiB, MiB, format_size, parse_count, parse_size

from .collbench import busbw_factor
from .sweep import SweepConfig, sweep, time_ops

if TYPE_CHECKING:
    import torch

__all__ = ["QUICK", "DEFAULT_SIZES", "PARITY_RTOL", "memory_rows", "bw_rows", "format_report", "check", "run"]

DEFAULT_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 128 * MiB)
QUICK = SweepConfig(sizes=(4 * KiB, 64 * KiB, 1 * MiB), warmup=1, reps=3, min_rep_s=0.01, budget_s=0.5)
PARITY_RTOL = 1e-5


# --------------------------------------------------------------------------- pure parts
def memory_rows(L: int, params: float | None = None, *, period: int = 4, fragments: int = 4, tau: int = 1) -> list:
    """Extra memory per rank of each mode over DDP, steady state: the model of docs/local-sgd.md
    ("Memory"), :func:`hiersync.costmodel.memory.sync_memory`.

    With an attached optimizer the local-SGD state is kept for this rank's 1/L shard: fp32
    anchor (needed with ``compress`` or an outer step) and outer momentum, 1/L of the fp32
    parameter bytes P each; each fragment in flight (overlap) holds the node's fp32 buffer of
    it (P/F, whatever L) and its bf16 payload of this rank's shard. Transients (a blocking
    sync's shard, the gather's piece, one chunk of ``chunk_mb``, 25 MiB) come on top.
    """
    from hiersync.costmodel.memory import sync_memory

    P = None if params is None else 4.0 * params
    whole = 1.0 if params is None else float(params)

    def fraction(**kw: Any) -> float:
        m = sync_memory(params=whole, ranks_per_node=L, **kw)
        steady = m.anchor + m.momentum + m.residual + (m.in_flight if kw.get("overlap") else 0.0)
        return steady / (4.0 * whole)

    bf16_outer = dict(period=4, compress=True, outer=True)
    rows = [
        ("period=1 (exact)", "0", fraction(period=1)),
        ("k>1, plain average", "0 (+ transient chunk)", fraction(period=4)),
        ("k>1, compress=bf16", "anchor 1/L", fraction(period=4, compress=True)),
        ("k>1, bf16 + outer Nesterov", "anchor + momentum 2/L", fraction(**bf16_outer)),
        (
            "k>1, overlap, bf16 + outer",
            "2/L + in flight: the node's fp32 buffer 1 + bf16 payload 1/(2L)",
            fraction(**bf16_outer, overlap=1),
        ),
        (
            f"k={period} F={fragments} tau={tau}, bf16 + outer",
            f"2/L + {tau} x (1/{fragments} + 1/(2L x {fragments})) in flight",
            fraction(**dict(bf16_outer, period=period), fragments=fragments, overlap=tau),
        ),
        (
            "in the hook (no optimizer), bf16 + outer",
            "whole state: anchor + momentum 2",
            fraction(**bf16_outer, attached=False),
        ),
    ]
    return [
        {"mode": m, "formula": f, "fraction_of_P": frac, "bytes": None if P is None else frac * P}
        for m, f, frac in rows
    ]


def bw_rows(name: str, points: Sequence[tuple[int, float]], ranks: int, concurrent: int) -> list[dict]:
    """nccl-tests columns for all-reduce times ``[(bytes, seconds), ...]`` on ``ranks`` ranks."""
    return [
        {
            "op": name,
            "ranks": ranks,
            "concurrent": concurrent,
            "bytes": n,
            "time_us": t * 1e6,
            "algbw_GBps": n / t / 1e9,
            "busbw_GBps": n / t * busbw_factor(ranks) / 1e9,
        }
        for n, t in points
    ]


def _table(head: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    return render(head, body, align="llr", indent="  ").splitlines()


def format_report(rep: dict) -> str:
    """The report as text (what rank 0 prints)."""
    topo = rep["topology"]
    out = [
        f"hiersync check: world {rep['world_size']}, backend {rep['backend']}, device {rep['device']}, "
        f"torch {rep['torch']}",
        f"topology: {topo['describe']}",
        f"  nodes {topo['nodes']}, ranks per node {topo['ranks_per_node']}, rails {topo['rails']}, "
        f"detected from {topo['source']}",
    ]
    out += [f"  WARNING {w}" for w in topo["warnings"]] or ["  layout warnings: none"]
    out.append("")
    for c in rep["checks"]:
        out.append(f"{c['status']}  {c['name']}: {c['detail']}")
    if rep.get("bandwidth"):
        out += ["", "bandwidth (all-reduce, nccl-tests style: slowest rank, median; busbw = algbw * 2(p-1)/p)"]
        body = [
            [
                r["op"],
                str(r["ranks"]),
                str(r["concurrent"]),
                format_size(r["bytes"]),
                f"{r['time_us']:.1f}",
                f"{r['algbw_GBps']:.4g}",
                f"{r['busbw_GBps']:.4g}",
            ]
            for r in rep["bandwidth"]
        ]
        out += _table(["op", "p", "at once", "size", "time us", "algbw GB/s", "busbw GB/s"], body)
    elif rep.get("bandwidth_skipped"):
        out += ["", f"bandwidth: skipped ({rep['bandwidth_skipped']})"]
    mem = rep["memory"]
    params = mem["params"]
    out += [
        "",
        f"extra memory per rank over DDP (model of docs/local-sgd.md; L = {mem['L']}, P = fp32 parameter bytes"
        + (f" = {4 * params / GiB:.1f} GiB for {params:.4g} parameters)" if params else "; --params N for bytes)"),
    ]
    body = [
        [r["mode"], r["formula"], f"{r['fraction_of_P']:.3g} P"]
        + ([f"{r['bytes'] / GiB:.1f} GiB"] if r["bytes"] is not None else [])
        for r in mem["rows"]
    ]
    out += _table(["mode", "state", "extra"] + (["bytes"] if params else []), body)
    out.append(
        "  (+ transients of one chunk, chunk_mb=25 MiB; state_device='cpu' moves anchor and momentum to host "
        "memory; measured on 2x2: docs/local-sgd.md)"
    )
    if rep.get("profile_path"):
        out += ["", f"wrote profile {rep['profile_path']} (python -m hiersync plan --profile {rep['profile_path']})"]
    out.append(f"\n{'PASS' if rep['ok'] else 'FAIL'} ({rep['wall_s']:.1f} s)")
    return "\n".join(out)


# --------------------------------------------------------------------------- collective parts
def _model(device: torch.device) -> torch.nn.Module:
    import torch

    torch.manual_seed(1234)
    n = torch.nn
    return n.Sequential(n.Linear(32, 64), n.Tanh(), n.Linear(64, 64), n.Tanh(), n.Linear(64, 4)).to(device)


def _train(device: torch.device, steps: int, topo: Any, options: dict | None, after_step: Any = None) -> Any:
    """``steps`` of SGD on a small DDP model (hiersync with ``options``, else DDP's default); the flat params."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    ids = [device.index] if device.type == "cuda" else None
    model = DDP(_model(device), device_ids=ids, bucket_cap_mb=0.01)  # a few buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = hiersync.register(model, opt, topology=topo, **options) if options is not None else None
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(16, 32, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if state is not None:
        state.close()
    return flat


def _gather(flat: torch.Tensor) -> list[torch.Tensor]:
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat.contiguous())
    return out


def _parity(device: torch.device, steps: int, topo: Any) -> list[dict]:

    from .sweep import world_max

    ref = _train(device, steps, topo, None)
    got = _train(device, steps, topo, {"period": 1})
    diff, scale = world_max([float((ref - got).abs().max()), float(ref.abs().max())], device)
    rel = diff / max(scale, 1e-30)
    checks = [
        {
            "name": f"period=1 vs DDP all-reduce ({steps} steps)",
            "status": "PASS" if rel <= PARITY_RTOL else "FAIL",
            "detail": f"max |diff| {diff:.3g} = {rel:.3g} relative (limit {PARITY_RTOL:g})",
            "max_abs_diff": diff,
            "max_rel_diff": rel,
        }
    ]
    # period=2, attached optimizer: step 0 is local, step 1 syncs across nodes.
    seen: dict[int, list[torch.Tensor]] = {}
    _train(device, 2, topo, {"period": 2}, lambda s, flat: seen.__setitem__(s, _gather(flat)))
    node = [topo.nodes[topo.node_of(r)][0] for r in range(topo.world_size)]
    local = seen[0]
    in_node = max(float((local[r] - local[node[r]]).abs().max()) for r in range(topo.world_size))
    across = max(float((t - local[0]).abs().max()) for t in local)
    after = max(float((t - seen[1][0]).abs().max()) for t in seen[1])
    ok = in_node == 0.0 and after <= PARITY_RTOL * max(float(seen[1][0].abs().max()), 1e-30)
    ok = ok and (across > 0.0 or topo.num_nodes == 1)
    checks.append(
        {
            "name": "period=2 local SGD invariants",
            "status": "PASS" if ok else "FAIL",
            "detail": f"local step: max diff inside a node {in_node:.3g} (want 0), across nodes {across:.3g} "
            f"(want > 0); after the sync step: max diff across the world {after:.3g} (want 0)",
        }
    )
    return checks


def _bandwidth(groups: Any, config: SweepConfig, device: torch.device) -> tuple[dict, list[dict]]:
    """The calibrate sweep (both levels, intra collectives), then each rail alone. Collective."""
    import torch
    import torch.distributed as dist

    topo = groups.topology
    L, N = topo.ranks_per_node, topo.num_nodes
    points = sweep(groups, config, device)
    rows = bw_rows("intra", points.get("intra", []), L, N) + bw_rows("rails", points.get("inter", []), N, L)
    if N > 1:
        buf = torch.zeros(max(config.sizes) // 4, dtype=torch.float32, device=device)
        for r in range(L):
            mine = groups.local_rank == r

            def op(m: int, mine: bool = mine) -> Any:
                return (lambda: dist.all_reduce(buf[:m], group=groups.rail)) if mine else (lambda: None)

            seconds = time_ops([op(n // 4) for n in config.sizes], device, config)
            rows += bw_rows(f"rail{r} alone", [(n // 4 * 4, t) for n, t in zip(config.sizes, seconds)], N, 1)
    return points, rows


def check(args: argparse.Namespace, device: torch.device) -> dict:
    """Run every check; the report (the same on every rank). Collective."""
    import torch
    import torch.distributed as dist

    from hiersync.topology import Topology, check_layout

    start = time.perf_counter()
    rank = dist.get_rank()
    topo = Topology.detect()
    warned: list[Any] = [None] * topo.world_size
    dist.all_gather_object(warned, check_layout(topo, args.period, rank))
    L = topo.ranks_per_node if topo.even else None
    rep: dict[str, Any] = {
        "format": "hiersync.check/1",
        "world_size": topo.world_size,
        "backend": str(dist.get_backend()),
        "device": str(device),
        "torch": torch.__version__,
        "topology": {
            "describe": topo.describe(),
            "nodes": topo.num_nodes,
            "ranks_per_node": L if L is not None else [len(n) for n in topo.nodes],
            "rails": len(topo.rails),
            "source": topo.source,
            "node_ranks": [list(n) for n in topo.nodes],
            "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
            "warnings": list(dict.fromkeys(w for ws in warned for w in ws)),
        },
    }
    rep["checks"] = _parity(device, 3 if args.quick else 5, topo)
    config = _sweep_config(args)
    rep["bandwidth"], rep["points"] = [], {}
    if not topo.even:
        rep["bandwidth_skipped"] = "uneven nodes: no rails to time; calibrate needs even nodes too"
    else:
        groups = topo.build_groups()
        rep["points"], rep["bandwidth"] = _bandwidth(groups, config, device)
        groups.destroy()
    rep["memory"] = {
        "L": topo.max_ranks_per_node,
        "params": args.params,
        "rows": memory_rows(topo.max_ranks_per_node, args.params, period=max(args.period, 2)),
    }
    rep["ok"] = all(c["status"] == "PASS" for c in rep["checks"])
    rep["wall_s"] = time.perf_counter() - start
    return rep


def _write_profile(rep: dict, args: argparse.Namespace) -> None:
    from .calibrate import fit_profile

    topo = rep["topology"]
    if not rep["points"] or not args.profile:
        return
    profile, _ = fit_profile(
        rep["points"],
        nodes=topo["nodes"],
        ranks_per_node=topo["ranks_per_node"],
        rails=args.rails,
        backend=rep["backend"],
        name=args.name,
        source=f"python -m hiersync check ({time.strftime('%Y-%m-%d')}, {'quick' if args.quick else 'full'})",
        metadata={"command": "python -m hiersync check " + " ".join(sys.argv[2:]), "topology": topo["node_ranks"]},
    )
    rep["profile_path"] = str(profile.save(args.profile))


# --------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="check.json", help="report as JSON (rank 0; default check.json)")
    parser.add_argument(
        "--profile", default="check-profile.json", help="profile for `plan --profile` (default check-profile.json)"
    )
    parser.add_argument("--quick", action="store_true", help="3 sizes up to 1 MiB, 3 repetitions, 3 parity steps")
    parser.add_argument("--sizes", help="message sizes, e.g. 4K,1M,64M (default 4K,64K,1M,16M,128M)")
    parser.add_argument("--params", type=parse_count, help="your model's parameter count (e.g. 7e9): memory in bytes")
    parser.add_argument("--period", type=int, default=4, help="the k you plan to use, for the layout warnings")
    parser.add_argument("--rails", type=int, help="NICs per node for the profile (default: one per rank)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl if CUDA is available, else gloo")
    parser.add_argument("--name", default="check", help="profile name")
    parser.add_argument("--timeout", type=float, default=300.0, help="process group timeout in seconds (default 300)")


def _sweep_config(args: argparse.Namespace) -> SweepConfig:
    if args.sizes:
        sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s.strip())
        base = QUICK if args.quick else SweepConfig()
        return SweepConfig(
            sizes=sizes, warmup=base.warmup, reps=base.reps, min_rep_s=base.min_rep_s, budget_s=base.budget_s
        )
    return QUICK if args.quick else SweepConfig(sizes=DEFAULT_SIZES)


def run(args: argparse.Namespace) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from hiersync._io import atomic_write_json

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "check runs on every rank of the job: start it under torchrun (torchrun ... -m hiersync check), "
            "or on one machine: python -m hiersync testbed -- -m hiersync check --quick"
        )
    _sweep_config(args)  # bad --sizes fail here, before any rank waits for another
    if args.rails is not None and args.rails < 1:
        raise ValueError(f"--rails must be >= 1, got {args.rails}")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rep = check(args, device)
    if dist.get_rank() == 0:
        _write_profile(rep, args)
        if args.out:
            atomic_write_json(args.out, rep)
        print(format_report(rep) + (f"\nwrote {args.out}" if args.out else ""), flush=True)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch 2.13 + gloo often aborts at interpreter exit (docs/design.md): leave without teardown.
    os._exit(0 if rep["ok"] else 1)
