"""``python -m hiersync collbench``: an nccl-tests-like all-reduce microbenchmark per level.

For each message size it times, on the emulated cluster of :mod:`hiersync.tools.testbed`:

* ``intra``: all-reduce inside every node (all nodes at once), p = ranks per node;
* ``rail``: all-reduce on every rail at once (local rank r of every node), p = nodes;
* ``two_level``: hiersync's exact path as ``HierComm`` runs it on this backend, p = world:
  on gloo its ``"allreduce_bcast"`` variant (intra all-reduce, rail all-reduce of this
  rank's 1/L shard, one intra broadcast per shard), on NCCL ``"rs_ag"`` (reduce-scatter,
  rail all-reduce, all-gather);
* ``flat``: one all-reduce over the world (what DDP does by default), p = world;
* ``two_level_bcast``: the ``"allreduce_bcast"`` variant written out with plain
  ``torch.distributed`` calls, each broadcast waited for before the next (compare with
  ``two_level`` on gloo to see what ``HierComm`` adds or saves). Same inter-node bytes as
  ``two_level``.

Like nccl-tests, ``algbw = bytes / time`` and ``busbw = algbw * 2 (p - 1) / p``; the time is
the slowest rank's mean over ``iters`` after ``warmup`` untimed iterations. In the same
run the raw TCP throughput of the inter-node link is measured (one stream per rail, every
direction at once, as the rails load it) as the ceiling. ``link MB/s`` is what each node
pushes through its link per direction under the bandwidth-optimal algorithm, and
``% link`` compares it with that ceiling.

Example::

    $ sudo python -m hiersync collbench                     # 4 KiB..64 MiB, ~30 s
    $ sudo python -m hiersync collbench --full              # 4 KiB..256 MiB
    $ python -m hiersync collbench --loopback --sizes 4K,1M
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hiersync._io import atomic_write_bytes, atomic_write_json, atomic_write_text
from hiersync._table import render
from hiersync.vocab import GiB, KiB, MiB, parse_size

from .linkrate import tcp_throughput
from .netns import DEFAULT_RATE

__all__ = [
    "OPS",
    "DEFAULT_SIZES",
    "FULL_SIZES",
    "parse_sizes",
    "worker",
    "busbw_factor",
    "format_table",
    "add_arguments",
    "run",
]

logger = logging.getLogger(__name__)

OPS = ("intra", "rail", "two_level", "flat", "two_level_bcast")
DEFAULT_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB)
FULL_SIZES = tuple(4 * KiB * 4**i for i in range(10))  # 4 KiB .. 1 GB -> trimmed below
FULL_SIZES = tuple(s for s in FULL_SIZES if s <= 256 * MiB)


def parse_sizes(text: str) -> list[int]:
    """``"4K,64K,1M"`` or a range ``"4K:256M"`` (factor 4) into byte counts (multiples of 4; K = 1024)."""

    def one(tok: str) -> int:
        tok = tok.strip()
        try:
            value = parse_size(tok)
        except ValueError:
            raise ValueError(f"size {tok!r} is not a byte count like 4K, 64M or 1048576") from None
        if value < 4 or value % 4:
            raise ValueError(f"size {tok!r} must be a positive multiple of 4 bytes (fp32 elements)")
        return value

    if ":" in text:
        lo, hi = (one(t) for t in text.split(":", 1))
        if hi < lo:
            raise ValueError(f"sizes={text!r}: the range ends below its start")
        out = []
        s = lo
        while s <= hi:
            out.append(s)
            s *= 4
        return out
    return [one(t) for t in text.split(",") if t.strip()]


def busbw_factor(op_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2 (p - 1) / p."""
    return 2.0 * (op_size - 1) / op_size if op_size > 1 else 0.0


def _link_bytes(op: str, nbytes: int, nodes: int, per_node: int) -> float:
    """Bytes each node sends through its inter-node link (per direction), bandwidth-optimal."""
    if nodes < 2:
        return 0.0
    if op == "rail":
        return per_node * busbw_factor(nodes) * nbytes
    if op in ("two_level", "two_level_bcast"):
        return busbw_factor(nodes) * nbytes
    if op == "flat":
        return busbw_factor(nodes * per_node) * nbytes  # one ring edge leaves each node
    return 0.0


# ---------------------------------------------------------------------------- worker
def worker(config: dict) -> dict:
    """Time every op at every size on this rank; rank 0's result is the report."""
    import torch
    import torch.distributed as dist

    import hiersync
    from hiersync.collectives import HierComm
    from hiersync.futures import wait

    rank = dist.get_rank()
    world = dist.get_world_size()
    topo = hiersync.Topology.detect()
    groups = topo.build_groups()
    comm = HierComm(groups)
    addr = os.environ.get("HIERSYNC_TESTBED_ADDR", "127.0.0.1")
    tcp = [tcp_throughput(topo, rank, addr, int(config["tcp_bytes"]))]
    L = len(topo.node_ranks(rank))
    N = topo.num_nodes
    sizes_of = {"intra": L, "rail": N, "two_level": world, "flat": world, "two_level_bcast": world}
    groups_of = {"intra": groups.intra, "rail": groups.rail, "two_level": None, "flat": None}
    node = topo.node_ranks(rank)
    rows = []
    for nbytes in config["sizes"]:
        numel = nbytes // 4
        iters = max(1, min(int(config["max_iters"]), int(config["budget_bytes"]) // nbytes))
        for op in config["ops"]:
            p = sizes_of[op]
            if p < 2 or (op in ("intra", "rail", "two_level_bcast") and not topo.even):
                continue
            if op == "two_level_bcast" and (numel % L or L < 2 or N < 2):
                continue
            x = torch.ones(numel)

            def once(op: str = op, x: Any = x) -> None:  # bound now: called in this iteration only
                if op == "two_level":
                    wait(comm.allreduce(x))
                elif op == "two_level_bcast":
                    shards = x.view(L, -1)
                    dist.all_reduce(x, group=groups.intra)
                    dist.all_reduce(shards[topo.local_rank(rank)], group=groups.rail)
                    for i, src in enumerate(node):
                        dist.broadcast(shards[i], src=src, group=groups.intra)
                else:
                    dist.all_reduce(x, group=groups_of[op])

            for _ in range(int(config["warmup"])):
                once()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                once()
            t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            sec = float(t)
            algbw = nbytes / sec
            link = _link_bytes(op, nbytes, N, L) / sec if topo.even else None
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "ranks": p,
                    "concurrent": {"intra": N, "rail": L}.get(op, 1),
                    "iters": iters,
                    "time_us": sec * 1e6,
                    "algbw_GBps": algbw / 1e9,
                    "busbw_GBps": algbw * busbw_factor(p) / 1e9,
                    "link_MBps": link / 1e6 if link else None,
                }
            )
            if rank == 0 and config.get("progress"):
                with open(config["progress"], "a") as f:
                    f.write(f"{op} {nbytes}\n")
    tcp.append(tcp_throughput(topo, rank, addr, int(config["tcp_bytes"])))
    return {"rank": rank, "nodes": [list(n) for n in topo.nodes], "tcp": tcp, "rows": rows}


# ---------------------------------------------------------------------------- report
def _human(n: int) -> str:
    for unit, div in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def ceiling_MBps(tcp: Sequence[dict | None]) -> float | None:
    vals = [t["MBps"] for t in tcp if t and t.get("MBps")]
    return max(vals) if vals else None


def format_table(rows: Sequence[dict], tcp_MBps: float | None, markdown: bool = False) -> str:
    head = ["size", "op", "p", "time us", "algbw GB/s", "busbw GB/s", "link MB/s", "% link"]
    body = []
    for r in rows:
        link = r["link_MBps"]
        pct = f"{100 * link / tcp_MBps:.0f}%" if link and tcp_MBps else "-"
        body.append(
            [
                _human(r["bytes"]),
                r["op"],
                str(r["ranks"]),
                f"{r['time_us']:.0f}",
                f"{r['algbw_GBps']:.4f}",
                f"{r['busbw_GBps']:.4f}",
                f"{link:.1f}" if link else "-",
                pct,
            ]
        )
    return render(head, body, align="r", markdown=markdown)


def _plot(rows: Sequence[dict], tcp_MBps: float | None, title: str) -> bytes | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("collbench: matplotlib is not installed (pip install 'hiersync[bench]'); no plot")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, op in enumerate(OPS):
        pts = [(r["bytes"], r["busbw_GBps"] * 1e3, r["link_MBps"]) for r in rows if r["op"] == op]
        if not pts:
            continue
        style = dict(marker="o", label=op, color=f"C{i}", ls="--" if op == "two_level_bcast" else "-")
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], **style)
        if any(p[2] for p in pts):
            axes[1].plot([p[0] for p in pts if p[2]], [p[2] for p in pts if p[2]], **style)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("busbw (MB/s)")
    axes[0].set_title("busbw = algbw * 2(p-1)/p")
    axes[1].set_ylabel("MB/s through each node's link (per direction)")
    axes[1].set_title("inter-node link use")
    if tcp_MBps:
        axes[1].axhline(tcp_MBps, color="k", ls="--", label=f"raw TCP {tcp_MBps:.0f} MB/s")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None, help="e.g. 4K,64K,1M or a range 4K:256M (x4 steps)")
    parser.add_argument("--full", action="store_true", help="4K..256M in x4 steps")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-iters", type=int, default=20)
    parser.add_argument("--budget-mb", type=float, default=64.0, help="iterations per size = budget / size (1..max)")
    parser.add_argument("--tcp-mb", type=float, default=32.0, help="MB per stream for the raw TCP ceiling")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--procs-per-node", type=int, default=2)
    parser.add_argument("--inter-rate", default=DEFAULT_RATE)
    parser.add_argument("--loopback", action="store_true", help="no namespaces: plain loopback, links not shaped")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--results", default="results/collbench")
    parser.add_argument("--no-plots", action="store_true")


def make_config(args: argparse.Namespace) -> dict:
    sizes = parse_sizes(args.sizes) if args.sizes else list(FULL_SIZES if args.full else DEFAULT_SIZES)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise ValueError(f"--ops={args.ops!r}: unknown ops {bad}; use a subset of {list(OPS)}")
    for name in ("max_iters",):
        if getattr(args, name) < 1:
            raise ValueError(f"--max-iters={args.max_iters} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if not args.budget_mb > 0 or not args.tcp_mb > 0:
        raise ValueError(f"--budget-mb={args.budget_mb} and --tcp-mb={args.tcp_mb} must be > 0")
    return {
        "sizes": sizes,
        "ops": ops,
        "warmup": args.warmup,
        "max_iters": args.max_iters,
        "budget_bytes": int(args.budget_mb * MiB),
        "tcp_bytes": int(args.tcp_mb * MiB),
    }


def run(args: argparse.Namespace) -> int:
    import tempfile

    from hiersync.tools.launch import RankFailed

    from .cluster import cluster_args, run_ranks
    from .testbed import TestbedError

    config = make_config(args)
    bar = None
    with tempfile.TemporaryDirectory(prefix="hiersync-collbench-") as tmp:
        prog = Path(tmp) / "progress"
        config["progress"] = str(prog)
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(config["sizes"]) * len(config["ops"]), desc="collbench", unit="op", file=sys.stderr)
        except ImportError:
            pass
        seen = [0]

        def poll() -> None:
            if bar is None or not prog.exists():
                return
            n = len(prog.read_text().splitlines())
            if n > seen[0]:
                bar.update(n - seen[0])
                seen[0] = n

        load_before = os.getloadavg()[0]
        start = time.monotonic()
        try:
            results, info = run_ranks(
                "hiersync.tools.collbench:worker",
                config,
                **cluster_args(args),
                timeout=args.timeout,
                poll=poll,
            )
        except (TestbedError, RankFailed, TimeoutError) as e:
            logger.error("collbench failed: %s", e)
            return 1
        finally:
            if bar is not None:
                bar.close()
        wall = time.monotonic() - start
    config.pop("progress")
    rep = results[0]
    tcp = ceiling_MBps(rep["tcp"])
    d = Path(args.results)
    raw = {
        "format": "hiersync.collbench/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall,
        "config": config,
        "testbed": info,
        "loadavg_1min": [load_before, os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "tcp": rep["tcp"],
        "tcp_ceiling_MBps": tcp,
        "rows": rep["rows"],
    }
    paths = [atomic_write_json(d / "collbench.json", raw)]
    buf = io.StringIO()
    if rep["rows"]:
        w = csv.DictWriter(buf, fieldnames=list(rep["rows"][0].keys()), lineterminator="\n")
        w.writeheader()
        w.writerows(rep["rows"])
    paths.append(atomic_write_text(d / "collbench.csv", buf.getvalue()))
    summary = _summary(rep["rows"], tcp, info)
    md = [
        "# hiersync collbench",
        "",
        info["describe"],
        "",
        format_table(rep["rows"], tcp, markdown=True),
        "",
        summary,
        "",
    ]
    paths.append(atomic_write_text(d / "collbench.md", "\n".join(md)))
    if not args.no_plots:
        png = _plot(rep["rows"], tcp, info["describe"])
        if png:
            paths.append(atomic_write_bytes(d / "busbw_vs_size.png", png))
    # The CLI's final output: the table.
    print(f"hiersync collbench on {info['describe']} ({wall:.0f} s)")
    print(format_table(rep["rows"], tcp))
    print(summary)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _summary(rows: Sequence[dict], tcp: float | None, info: dict) -> str:
    if tcp is None:
        return "raw TCP: not measured (a single node has no inter-node link)"
    line = f"raw TCP throughput of the inter-node link (per direction, all rails at once): {tcp:.1f} MB/s"
    if info.get("mode") != "netns":
        line += " (loopback: links are NOT shaped)"
    rail = [r for r in rows if r["op"] == "rail" and r["link_MBps"]]
    if rail:
        best = max(rail, key=lambda r: r["bytes"])
        line += (
            f"\nrail all-reduce at {_human(best['bytes'])}: {best['link_MBps']:.1f} MB/s through each link "
            f"= {100 * best['link_MBps'] / tcp:.0f}% of raw TCP (target >= 90%)"
        )
    return line
