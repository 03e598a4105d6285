"""Emulated torchft nodes on one machine: a Lighthouse, and nodes that can be killed, frozen and restarted.

Used by the tests and the benchmarks of the manager mode (:mod:`hiersync.ft`). Each *node*
is a group of rank processes with its own world (as one torchrun job is): a ``FileStore``
rendezvous in a temporary folder (no ports), and a ``TCPStore`` for its torchft Manager
hosted by its rank 0 on a port the OS picks, exported as ``MASTER_ADDR``/``MASTER_PORT``
exactly as torchrun does, with ``TORCHFT_LIGHTHOUSE`` pointing at the Lighthouse. So the
rank function builds its Manager the way a torchrun job would (:func:`manager`).

:class:`Lighthouse` runs torchft's Lighthouse in this process on a port the OS picks;
:class:`Nodes` starts, kills (SIGKILL of every rank), freezes (SIGSTOP) and restarts nodes
and collects their results. Leaving either context always stops the Lighthouse and kills
every process started in it, also on failure.

Example::

    >>> with Lighthouse(min_replicas=2) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
    ...     for n in range(3):
    ...         nodes.start(n, train, args)
    ...     results = nodes.wait([0, 1, 2], timeout=120)
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .launch import forkserver_context

__all__ = ["Lighthouse", "Nodes", "NodeFailed", "manager", "progress", "node_index", "free_port"]

ENV_NODE = "HIERSYNC_FT_NODE"
ENV_PROGRESS = "HIERSYNC_FT_PROGRESS"
ENV_GID = "HIERSYNC_FT_GID"
GID_BASE = 47000
"""With ``Nodes(group_ids=True)`` the ranks of node ``n`` run with group id ``GID_BASE + n`` (root
only), from before their first socket: a firewall rule on that group cuts the node off."""


class NodeFailed(RuntimeError):
    """A rank of a node raised (its traceback is in the message) or was still running at the limit."""


class Lighthouse:
    """torchft's Lighthouse in this process, on a port the OS picks; always shut down on exit.

    ``heartbeat_timeout_ms`` is how long a silent node stays in the quorum; ``join_timeout_ms``
    how long a quorum waits for a node that heartbeats but has not asked to join.
    """

    def __init__(
        self,
        min_replicas: int = 1,
        *,
        join_timeout_ms: int = 2000,
        heartbeat_timeout_ms: int = 1000,
        quorum_tick_ms: int = 50,
    ) -> None:
        from ..transport import import_torchft

        import_torchft()
        self._options = dict(
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        self._server: Any = self._serve(0)
        self.port = int(self._server.address().rsplit(":", 1)[1])
        self.address = f"http://127.0.0.1:{self.port}"
        """Where the nodes reach it (``TORCHFT_LIGHTHOUSE``)."""

    def _serve(self, port: int) -> Any:
        from torchft._torchft import LighthouseServer

        return LighthouseServer(bind=f"[::]:{port}", **self._options)

    def restart(self) -> None:
        """Start it again at the same address (after :meth:`shutdown`, or a crash), with no memory of
        the quorums before: what a Lighthouse restarted by its supervisor is."""
        self.shutdown()
        deadline = time.monotonic() + 10.0
        while True:
            try:
                self._server = self._serve(self.port)
                return
            except Exception:  # the port is still held by the old server's sockets
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def free_port() -> int:
    """A TCP port the OS reports free now (bind to port 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_index() -> int:
    """The emulated node this rank belongs to."""
    return int(os.environ[ENV_NODE])


def manager(timeout_s: float = 10.0, quorum_timeout_s: float = 60.0, **kwargs: Any) -> Any:
    """A torchft Manager for this rank, built as under torchrun (``MASTER_ADDR``, ``RANK``, ...).

    ``timeout_s`` bounds a rail collective (the process group's timeout: how long a frozen
    peer can hold the others), ``should_commit`` and a recovery; ``quorum_timeout_s`` how
    long a quorum may wait. ``kwargs`` go to ``torchft.Manager`` (``load_state_dict``,
    ``state_dict``, ...).
    """
    import torchft

    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs.setdefault("min_replica_size", 1)
    return torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=quorum_timeout_s),
        connect_timeout=datetime.timedelta(seconds=10),
        replica_id=f"node{node_index()}",
        hostname="127.0.0.1",
        **kwargs,
    )


def progress(step: int, **fields: Any) -> None:
    """Append ``step`` (and ``fields``) with a wall-clock time to this node's progress file (rank 0)."""
    path = os.environ.get(ENV_PROGRESS)
    if not path or os.environ.get("RANK", "0") != "0":
        return
    line = " ".join([f"{time.time():.6f}", str(step)] + [f"{k}={v}" for k, v in fields.items()])
    with open(path, "a") as f:
        f.write(line + "\n")


def _rank_main(
    fn: Callable, node: int, rank: int, nproc: int, folder: str, env: dict, args: tuple, pg_timeout: float
) -> None:
    if env.get(ENV_GID):
        os.setgid(int(env[ENV_GID]))  # every socket of this rank is owned by its node's group
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank)})
    os.environ.update({"LOCAL_WORLD_SIZE": str(nproc), ENV_NODE: str(node), "GLOO_SOCKET_IFNAME": "lo"})
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(folder, "store"), nproc)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        tcp = None
        if rank == 0:  # the Manager's store, hosted as torchrun's agent would
            tcp = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
            store.set("manager_store_port", str(tcp.port))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = store.get("manager_store_port").decode()
        result = fn(*args)
        with open(os.path.join(folder, f"result-{rank}.tmp"), "wb") as f:
            pickle.dump(result, f)
        os.replace(os.path.join(folder, f"result-{rank}.tmp"), os.path.join(folder, f"result-{rank}"))
        dist.barrier()
        del tcp
    except BaseException:
        with open(os.path.join(folder, f"error-{rank}"), "w") as f:
            f.write(traceback.format_exc())
        code = 1
    # gloo's threads and torchft's servers can hang a graceful teardown: the results are written.
    os._exit(code)


@dataclass
class _Node:
    index: int
    folder: str
    procs: list[Any] = field(default_factory=list)
    progress: str = ""


class Nodes:
    """Emulated nodes of ``procs_per_node`` ranks each, talking to the Lighthouse at ``lighthouse``."""

    def __init__(
        self,
        lighthouse: str,
        procs_per_node: int = 1,
        *,
        pg_timeout: float = 60.0,
        env: dict | None = None,
        group_ids: bool = False,
    ) -> None:
        """``group_ids``: run node ``n``'s ranks with group id ``GID_BASE + n`` (root only)."""
        if group_ids and os.geteuid() != 0:
            raise PermissionError("Nodes(group_ids=True) needs root (it sets each node's group id)")
        self.group_ids = group_ids
        self.lighthouse = lighthouse
        self.procs_per_node = procs_per_node
        self.pg_timeout = pg_timeout
        self.env = dict(env or {})
        self.root = tempfile.mkdtemp(prefix="hiersync-ft-")
        self.nodes: dict[int, _Node] = {}
        self._count = 0
        self._all: list[Any] = []

    def start(self, node: int, fn: Callable, args: Sequence[Any] = ()) -> None:
        """Start (or restart: a fresh incarnation) node ``node`` running ``fn(*args)`` on every rank."""
        old = self.nodes.get(node)
        if old is not None and any(p.exitcode is None for p in old.procs):
            raise RuntimeError(f"node {node} is still running: kill it first")
        self._count += 1
        folder = os.path.join(self.root, f"node{node}-{self._count}")
        os.makedirs(folder)
        rec = _Node(node, folder, progress=os.path.join(self.root, f"node{node}.progress"))
        env = {"TORCHFT_LIGHTHOUSE": self.lighthouse, ENV_PROGRESS: rec.progress, "RUST_LOG": "error", **self.env}
        env.setdefault("HIERSYNC_EMULATE_NCCL", os.environ.get("HIERSYNC_EMULATE_NCCL", ""))
        if self.group_ids:
            env[ENV_GID] = str(GID_BASE + node)
        ctx = forkserver_context()
        for rank in range(self.procs_per_node):
            p = ctx.Process(
                target=_rank_main,
                args=(fn, node, rank, self.procs_per_node, folder, env, tuple(args), self.pg_timeout),
                name=f"hiersync-ft-node{node}-rank{rank}",
            )
            p.start()
            rec.procs.append(p)
            self._all.append(p)
        self.nodes[node] = rec

    def _signal(self, node: int, sig: int) -> None:
        for p in self.nodes[node].procs:
            if p.exitcode is None and p.pid is not None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self, node: int) -> float:
        """SIGKILL every rank of ``node``; the time it was sent."""
        t = time.time()
        self._signal(node, signal.SIGKILL)
        return t

    def freeze(self, node: int) -> float:
        """SIGSTOP every rank of ``node``; the time it was sent."""
        t = time.time()
        self._signal(node, signal.SIGSTOP)
        return t

    def steps(self, node: int) -> list[tuple[float, int, dict[str, str]]]:
        """``(time, step, fields)`` from the node's progress file (every incarnation), in order."""
        path = os.path.join(self.root, f"node{node}.progress")
        out = []
        try:
            with open(path) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 2:
                        fields = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
                        out.append((float(parts[0]), int(parts[1]), fields))
        except FileNotFoundError:
            pass
        return out

    def wait_step(self, node: int, step: int, timeout: float) -> None:
        """Return once ``node`` reported ``step`` (or a later one); TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(s >= step for _, s, _ in self.steps(node)):
                return
            self._raise_failed()
            time.sleep(0.02)
        raise TimeoutError(f"node {node} did not reach step {step} within {timeout:.0f} s")

    def _raise_failed(self) -> None:
        for rec in self.nodes.values():
            for rank in range(self.procs_per_node):
                path = os.path.join(rec.folder, f"error-{rank}")
                if os.path.exists(path):
                    with open(path) as f:
                        raise NodeFailed(f"node {rec.index} rank {rank} raised:\n{f.read()}")

    def wait(self, nodes: Sequence[int], timeout: float) -> dict[int, list[Any]]:
        """Wait for ``nodes`` to finish; their per-rank results. Raises the first failure."""
        deadline = time.monotonic() + timeout
        while True:
            self._raise_failed()
            if all(p.exitcode is not None for n in nodes for p in self.nodes[n].procs):
                break
            if time.monotonic() > deadline:
                raise NodeFailed(f"nodes {list(nodes)} were still running after {timeout:.0f} s (a hang?)")
            time.sleep(0.05)
        self._raise_failed()
        out: dict[int, list[Any]] = {}
        for n in nodes:
            rec = self.nodes[n]
            results = []
            for rank, p in enumerate(rec.procs):
                path = os.path.join(rec.folder, f"result-{rank}")
                if p.exitcode != 0 or not os.path.exists(path):
                    raise NodeFailed(f"node {n} rank {rank} exited with code {p.exitcode} and no result")
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            out[n] = results
        return out

    def close(self) -> None:
        """Kill every process these nodes started (frozen ones too) and remove the folder."""
        for p in self._all:
            if p.exitcode is None and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._all:
            p.join(10)
        self._all = []
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
