"""Run a function on every rank of an emulated cluster (what ``bench`` and ``collbench`` use).

On the testbed (:class:`~hiersync.tools.testbed.Testbed`, network namespaces) every node
runs a torchrun agent whose ranks execute ``python -m hiersync.tools.cluster --call ...``;
on loopback the ranks are forked by :func:`hiersync.tools.launch.run` with
``HIERSYNC_NODE_IDS`` describing the emulated nodes. Either way the target is named
``"package.module:function"`` and called with one picklable ``config``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import os
import pickle
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hiersync._io import atomic_write_bytes
from hiersync.tools.launch import run as launch_ranks

from .netns import DEFAULT_RATE
from .testbed import Testbed, TestbedError

__all__ = ["run_ranks", "resolve", "call", "cluster_args"]

logger = logging.getLogger(__name__)


def cluster_args(args: Any) -> dict[str, Any]:
    """:func:`run_ranks`'s cluster from a command's parsed ``--nodes``, ``--procs-per-node``,
    ``--inter-rate`` and ``--loopback``."""
    return dict(
        nodes=args.nodes, procs_per_node=args.procs_per_node, inter_rate=args.inter_rate, loopback=args.loopback
    )


def resolve(target: str) -> Callable[[dict], Any]:
    """The function ``"package.module:function"`` names (imported now)."""
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"target={target!r} must be 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def call(target: str, config: dict) -> Any:
    """Body of every rank under the loopback launcher (module level: the forkserver pickles it)."""
    return resolve(target)(config)


def run_ranks(
    target: str,
    config: dict,
    *,
    nodes: int = 2,
    procs_per_node: int = 2,
    inter_rate: str | None = DEFAULT_RATE,
    loopback: bool = False,
    timeout: float = 600.0,
    pg_timeout: float = 120.0,
    log_dir: str | os.PathLike | None = None,
    poll: Callable[[], None] | None = None,
    nodes_per_rack: int | None = None,
    world_rate: str | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """Run ``target(config)`` (``"module:function"``) on every rank of an emulated cluster.

    Returns the per-rank return values (picklable) and a description of where they ran
    (``mode`` is ``"netns"`` or ``"loopback"``). On the testbed every node runs a torchrun
    agent; on loopback the ranks are forked by :func:`hiersync.tools.launch.run` with
    ``HIERSYNC_NODE_IDS`` describing the emulated nodes. ``nodes_per_rack``: consecutive nodes
    form racks (``HIERSYNC_RACK_KEY`` on the testbed, ``HIERSYNC_RACK_IDS`` on loopback);
    ``world_rate``: the testbed's rate between racks.
    """
    resolve(target)  # fail here, not in every rank
    bed = Testbed(
        nodes, procs_per_node, inter_rate, loopback=loopback, nodes_per_rack=nodes_per_rack, world_rate=world_rate
    )
    with bed as tb:
        info = {
            "mode": "netns" if tb.emulated else "loopback",
            "nodes": nodes,
            "procs_per_node": procs_per_node,
            "inter_rate": tb.inter_rate if tb.emulated else None,
            "burst": tb.burst if tb.emulated else None,
            "latency": tb.latency if tb.emulated else None,
            "describe": tb.describe(),
            "nodes_per_rack": nodes_per_rack,
            "world_rate": tb.world_rate if tb.emulated else None,
            "fallback_reason": tb.fallback_reason,
        }
        if not tb.emulated:
            node_ids = [r // procs_per_node for r in range(tb.world_size)]
            stop = threading.Event()
            ticker = None
            if poll is not None:

                def tick() -> None:
                    while not stop.wait(0.2):
                        poll()

                ticker = threading.Thread(target=tick, name="hiersync-poll", daemon=True)
                ticker.start()
            env = (
                {}
                if nodes_per_rack is None
                else {"HIERSYNC_RACK_IDS": ",".join(str(n // nodes_per_rack) for n in node_ids)}
            )
            try:
                results = launch_ranks(
                    call,
                    tb.world_size,
                    (target, config),
                    node_ids=node_ids,
                    env=env,
                    timeout=timeout,
                    pg_timeout=pg_timeout,
                )
            finally:
                stop.set()
                if ticker is not None:
                    ticker.join(5)
            return results, info
        with tempfile.TemporaryDirectory(prefix="hiersync-testbed-") as tmp:
            cfg = Path(tmp) / "config.pkl"
            cfg.write_bytes(pickle.dumps({"target": target, "config": config, "pg_timeout": pg_timeout}))
            tb.launch(
                ["-m", "hiersync.tools.cluster", "--call", str(cfg), "--out-dir", tmp],
                timeout=timeout,
                log_dir=log_dir or tmp,
                poll=poll,
            )
            results = []
            for r in range(tb.world_size):
                path = Path(tmp) / f"result-{r}.pkl"
                if not path.exists():
                    raise TestbedError(f"rank {r} exited 0 but wrote no result ({path})")
                results.append(pickle.loads(path.read_bytes()))
            return results, info


def _worker_main(argv: Sequence[str]) -> int:
    """Entry point of every rank under torchrun: ``python -m hiersync.tools.cluster --call CFG --out-dir DIR``."""
    parser = argparse.ArgumentParser(prog="python -m hiersync.tools.cluster")
    parser.add_argument("--call", required=True, help="pickled {'target', 'config', 'pg_timeout'}")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s rank%(process)d %(name)s: %(message)s")
    with open(args.call, "rb") as f:
        spec = pickle.load(f)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["pg_timeout"]))
    rank = dist.get_rank()
    result = resolve(spec["target"])(spec["config"])
    atomic_write_bytes(Path(args.out_dir) / f"result-{rank}.pkl", pickle.dumps(result))
    # Leave together (gloo connects lazily) and skip interpreter teardown, whose gloo
    # shutdown can hang when a peer is already gone: the result is on disk.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
