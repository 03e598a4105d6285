"""An emulated multi-node cluster on one machine: network namespaces joined by a shaped link.

Each emulated *node* is a Linux network namespace holding one veth interface
(``hsnet0``, an address in 198.18.0.0/15, the range reserved for network benchmarks). The
other ends of the veths sit on a bridge in a separate "switch" namespace, so nothing in
the host's own namespace changes. Each node's egress is shaped with ``tc qdisc ... tbf``
(netem is not available on every kernel; tbf is). Ranks of one node reach each other over
the kernel's local route (unshaped, like NVLink inside a node); ranks of different nodes
cross the shaped link (like the NICs between nodes).

:class:`Testbed` builds and always removes that network (also on failure, SIGTERM or
Ctrl-C) and starts one ``torchrun`` agent per node: real c10d rendezvous hosted on node 0's
testbed address (on a port the OS picked), gloo over ``GLOO_SOCKET_IFNAME=hsnet0``, one
``GROUP_RANK`` per agent so :meth:`hiersync.Topology.detect` sees the emulated nodes.
Without root or iproute2 it falls back to plain loopback and says so: links are then not
shaped. :func:`hiersync.tools.cluster.run_ranks` runs a function on every rank of such a cluster
(bench and collbench use it). The Linux plumbing lives in :mod:`hiersync.tools.netns`.

Example::

    $ sudo python -m hiersync testbed --nodes 2 --procs-per-node 2 --inter-rate 800mbit -- train.py --epochs 1

    >>> with Testbed(nodes=2, procs_per_node=2, inter_rate="800mbit") as tb:
    ...     tb.launch(["train.py", "--epochs", "1"], timeout=600)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .netns import (
    DEFAULT_RATE,
    IP_TIMEOUT_S,
    NS_PREFIX,
    emulation_available,
    ns_pids,
    parse_rate,
    remove_namespaces,
    run_ip,
    shape_by_destination,
    shape_tbf,
    signals_raise,
    stale_namespaces,
    stop_agents,
    tail,
    write_hosts,
)

__all__ = [
    "Testbed",
    "TestbedError",
    "parse_rate",
    "emulation_available",
    "stale_namespaces",
    "IFNAME",
    "NS_PREFIX",
    "add_arguments",
    "run",
]

logger = logging.getLogger(__name__)

IFNAME = "hsnet0"
"""Name of each node's interface inside its namespace (what ``GLOO_SOCKET_IFNAME`` names)."""
_SUBNET = (198, 18)  # 198.18.0.0/15 is reserved for network benchmarks (RFC 2544)
_MAX_NODES = 250
_SIZE_RE = re.compile(r"^\d+(?:\.\d+)?(b|k|kb|kbit|m|mb|mbit|g|gb|gbit)?$", re.IGNORECASE)
_TIME_RE = re.compile(r"^\d+(?:\.\d+)?(s|sec|secs|ms|msec|msecs|us|usec|usecs)?$", re.IGNORECASE)
_counter = itertools.count()


class TestbedError(RuntimeError):
    """An emulated node's torchrun failed or hung; the message carries the tail of its log."""

    __test__ = False  # not a pytest test class despite the name


class Testbed:
    """``nodes`` emulated nodes of ``procs_per_node`` ranks joined by a link shaped to ``inter_rate``.

    Args:
        nodes: number of emulated nodes (namespaces), 1..250.
        procs_per_node: ranks per node (torchrun's ``--nproc-per-node``).
        inter_rate: tc rate of each node's egress, e.g. ``"800mbit"``; ``None`` = unshaped veths.
        burst, latency: tbf's bucket size and queueing limit (defaults 256kb, 100ms).
        loopback: skip the namespaces even where they are available (plain 127.0.0.1).
        nodes_per_rack: group consecutive nodes into racks of this many (a third level): each node's
            ranks get ``HIERSYNC_RACK_KEY`` naming its rack, and with ``world_rate`` its egress is
            shaped per destination (htb): ``inter_rate`` to the nodes of its rack, ``world_rate``
            to every other node (the spine).
        world_rate: tc rate of a node's traffic to other racks (needs ``nodes_per_rack``).
        slow: ``{node: factor}`` (0 < factor <= 1): that node's ranks see ``HIERSYNC_TESTBED_SPEED``
            = factor (the project's accelerator-like compute model runs its layers 1 / factor as
            long) and, where this machine's cgroups allow it (root; cgroup v1 ``cpu`` or v2
            ``cpu.max``), its processes are capped at factor x its share of the CPUs (cores /
            nodes), so real CPU compute slows too; else a warning says the cap is missing.

    Use it as a context manager: the network exists inside the ``with`` block only. Without
    root or iproute2 (or when building the namespaces fails) it logs a warning and runs on
    loopback; :attr:`emulated` says which.
    """

    __test__ = False

    def __init__(
        self,
        nodes: int = 2,
        procs_per_node: int = 2,
        inter_rate: str | None = DEFAULT_RATE,
        *,
        burst: str = "256kb",
        latency: str = "100ms",
        loopback: bool = False,
        nodes_per_rack: int | None = None,
        world_rate: str | None = None,
        slow: dict[int, float] | None = None,
    ) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= _MAX_NODES:
            raise ValueError(f"nodes={nodes!r} must be an int in 1..{_MAX_NODES}")
        if isinstance(procs_per_node, bool) or not isinstance(procs_per_node, int) or procs_per_node < 1:
            raise ValueError(f"procs_per_node={procs_per_node!r} must be an int >= 1")
        if inter_rate is not None and str(inter_rate).lower() not in ("none", "0"):
            parse_rate(inter_rate)
        else:
            inter_rate = None
        if not _SIZE_RE.match(str(burst)):
            raise ValueError(f"burst={burst!r} is not a tc size; use e.g. '256kb'")
        if not _TIME_RE.match(str(latency)):
            raise ValueError(f"latency={latency!r} is not a tc time; use e.g. '100ms'")
        if nodes_per_rack is not None and (
            isinstance(nodes_per_rack, bool) or not isinstance(nodes_per_rack, int) or not 1 <= nodes_per_rack <= nodes
        ):
            raise ValueError(f"nodes_per_rack={nodes_per_rack!r} must be an int in 1..nodes={nodes}")
        if world_rate is not None:
            if nodes_per_rack is None:
                raise ValueError(f"world_rate={world_rate!r} shapes the links between racks: give nodes_per_rack too")
            if inter_rate is None:
                raise ValueError(f"world_rate={world_rate!r} needs inter_rate (the rate inside a rack)")
            parse_rate(world_rate)
        for node, factor in (slow or {}).items():
            known = isinstance(node, int) and 0 <= node < nodes and isinstance(factor, (int, float))
            if not (known and 0 < factor <= 1):
                raise ValueError(
                    f"slow={slow!r}: give {{node: factor}} with node in 0..{nodes - 1} and 0 < factor <= 1 "
                    "(e.g. {1: 0.5}: node 1 at half speed)"
                )
        self.slow = dict(slow or {})
        self._cgroups: list[Path] = []
        self.nodes_per_rack = nodes_per_rack
        self.world_rate = world_rate
        self.nodes = nodes
        self.procs_per_node = procs_per_node
        self.inter_rate = inter_rate
        self.burst = burst
        self.latency = latency
        self.loopback = loopback
        self.emulated = False
        """True while the namespaces exist; False on loopback (links not shaped)."""
        self.fallback_reason = ""
        self.tag = f"{NS_PREFIX}{os.getpid()}-{next(_counter)}"
        self.namespaces: list[str] = []
        """Node namespaces, in node order (empty on loopback)."""
        self._switch: str | None = None
        self._etc_dirs: list[Path] = []
        self._up = False

    # ------------------------------------------------------------------ network
    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def switch_namespace(self) -> str | None:
        """The namespace holding the bridge that joins the nodes (None on loopback)."""
        return self._switch

    @property
    def ifname(self) -> str:
        return IFNAME if self.emulated else "lo"

    def node_addr(self, node: int) -> str:
        """The address of ``node`` (198.18.x.y inside its namespace; 127.0.0.1 on loopback)."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node={node} out of range 0..{self.nodes - 1}")
        if not self.emulated:
            return "127.0.0.1"
        return f"{_SUBNET[0]}.{_SUBNET[1]}.0.{node + 1}"

    def describe(self) -> str:
        shape = f"{self.nodes} nodes x {self.procs_per_node} ranks"
        if self.slow:
            shape += " (" + ", ".join(f"node {n} at {f:g}x speed" for n, f in sorted(self.slow.items())) + ")"
        if not self.emulated:
            return f"{shape} on loopback (links NOT shaped: {self.fallback_reason or 'loopback requested'})"
        link = (
            f"tbf {self.inter_rate} burst {self.burst} latency {self.latency}" if self.inter_rate else "unshaped veth"
        )
        if self.nodes_per_rack is None:
            return f"{shape} in network namespaces, inter-node link {link}"
        racks = f"racks of {self.nodes_per_rack} nodes"
        if self.world_rate:
            rates = f"htb {self.inter_rate} inside a rack, {self.world_rate} across"
            return f"{shape} in network namespaces, {racks}: {rates}"
        return f"{shape} in network namespaces, {racks}, inter-node link {link}"

    def rack_of(self, node: int) -> int | None:
        """The rack of ``node`` (consecutive nodes, ``nodes_per_rack`` of them); None without racks."""
        return None if self.nodes_per_rack is None else node // self.nodes_per_rack

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self) -> None:
        """Build the namespaces, veths, bridge and shaping; fall back to loopback if impossible."""
        if self._up:
            return
        self._up = True
        atexit.register(self.down)
        if self.loopback:
            self.fallback_reason = "loopback requested"
            return
        ok, why = emulation_available()
        if not ok:
            self._fall_back(why)
            return
        for ns in stale_namespaces():
            if ns_pids(ns):
                logger.warning(
                    "testbed: stale namespace %s still has processes; remove it with 'ip netns del %s'", ns, ns
                )
            else:
                logger.info("testbed: removing stale namespace %s", ns)
                run_ip(["ip", "netns", "del", ns], check=False)
                shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        try:
            self._build()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            self._remove_namespaces()
            self._fall_back(f"building the namespaces failed: {e}")
            return
        self.emulated = True
        logger.info("testbed: %s", self.describe())

    def _fall_back(self, why: str) -> None:
        self.fallback_reason = why
        logger.warning(
            "testbed: %s; falling back to plain loopback: the %d 'nodes' share 127.0.0.1 and inter-node "
            "links are NOT shaped, so step times will not show the cost of a slow network",
            why,
            self.nodes,
        )

    def _build(self) -> None:
        sw = f"{self.tag}-sw"
        run_ip(["ip", "netns", "add", sw])
        self._switch = sw
        run_ip(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        run_ip(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i in range(self.nodes):
            ns = f"{self.tag}-n{i}"
            run_ip(["ip", "netns", "add", ns])
            self.namespaces.append(ns)
            port = f"p{i}"
            # Both ends are created directly in their namespaces: the host's namespace never sees them.
            run_ip(["ip", "-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", port, "netns", sw])
            run_ip(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            run_ip(["ip", "-n", sw, "link", "set", port, "up"])
            run_ip(["ip", "-n", ns, "addr", "add", f"{_SUBNET[0]}.{_SUBNET[1]}.0.{i + 1}/16", "dev", IFNAME])
            run_ip(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            run_ip(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._write_hosts(ns)
            if self.world_rate:
                self._shape_by_rack(ns, i)
            elif self.inter_rate:
                shape_tbf(ns, IFNAME, self.inter_rate, self.burst, self.latency)

    def _write_hosts(self, ns: str) -> None:
        names = [(f"{_SUBNET[0]}.{_SUBNET[1]}.0.{i + 1}", f"{self.tag}-node{i}") for i in range(self.nodes)]
        self._etc_dirs.append(write_hosts(ns, names))

    def down(self) -> None:
        """Kill whatever still runs in the namespaces, then delete them. Idempotent."""
        if not self._up:
            return
        self._up = False
        with contextlib.suppress(Exception):
            atexit.unregister(self.down)
        self._remove_namespaces()
        self.emulated = False

    def _remove_namespaces(self) -> None:
        remove_namespaces(list(self.namespaces) + ([self._switch] if self._switch else []), self._etc_dirs)
        self._etc_dirs = []
        self.namespaces = []
        self._switch = None

    # ------------------------------------------------------------------ processes
    def free_port(self) -> int:
        """A port free on node 0's address, picked by the OS (bind port 0) inside node 0's namespace."""
        code = (
            "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(({self.node_addr(0)!r}, 0)); print(s.getsockname()[1])"
        )
        cmd = [sys.executable, "-c", code]
        if self.emulated:
            cmd = ["ip", "netns", "exec", self.namespaces[0]] + cmd
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=True)
        return int(out.stdout.strip())

    def _shape_by_rack(self, ns: str, node: int) -> None:
        """The node's egress: ``inter_rate`` to its rack's nodes, ``world_rate`` to the rest."""
        assert self.inter_rate is not None and self.world_rate is not None
        rack = [
            f"{_SUBNET[0]}.{_SUBNET[1]}.0.{j + 1}"
            for j in range(self.nodes)
            if j != node and self.rack_of(j) == self.rack_of(node)
        ]
        shape_by_destination(ns, IFNAME, self.inter_rate, rack, self.world_rate, self.burst)

    def node_env(self, node: int) -> dict[str, str]:
        """Environment of node ``node``'s torchrun (and so of its ranks)."""
        env = dict(os.environ)
        if env.pop("HIERSYNC_NODE_IDS", None) is not None:
            logger.warning("testbed: ignoring HIERSYNC_NODE_IDS; ranks find their node from torchrun's GROUP_RANK")
        env.update(
            {
                "GLOO_SOCKET_IFNAME": self.ifname,
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "PYTHONUNBUFFERED": "1",
                "HIERSYNC_TESTBED_NODE": str(node),
                "HIERSYNC_TESTBED_ADDR": self.node_addr(node),
                "HIERSYNC_TESTBED_EMULATED": "1" if self.emulated else "0",
            }
        )
        if node in self.slow:
            env["HIERSYNC_TESTBED_SPEED"] = str(self.slow[node])
        if self.nodes_per_rack is not None:  # Topology.detect groups the nodes into racks from it
            env.update({"HIERSYNC_TESTBED_RACK": str(self.rack_of(node)), "HIERSYNC_RACK_KEY": "HIERSYNC_TESTBED_RACK"})
        return env

    def torchrun_command(
        self, node: int, port: int, command: Sequence[str], run_id: str, join_timeout: int = 60
    ) -> list[str]:
        """The command line of node ``node``'s torchrun agent (wrapped in ``ip netns exec``)."""
        addr0 = self.node_addr(0)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(self.nodes),
            "--nproc-per-node",
            str(self.procs_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{addr0}:{port}",
            "--rdzv-id",
            run_id,
            # Who hosts the rendezvous store is explicit: hostname matching cannot tell
            # namespaces apart (they share the hostname).
            "--rdzv-conf",
            f"is_host={1 if node == 0 else 0},join_timeout={join_timeout}",
            "--local-addr",
            self.node_addr(node),
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.5",
        ] + list(command)
        if self.emulated:
            cmd = ["ip", "netns", "exec", self.namespaces[node]] + cmd
        return cmd

    def launch(
        self,
        command: Sequence[str],
        *,
        timeout: float = 600.0,
        log_dir: str | os.PathLike | None = None,
        poll: Callable[[], None] | None = None,
        join_timeout: int = 60,
    ) -> None:
        """Start one torchrun per node running ``command`` (``script.py args`` or ``-m module args``).

        Returns when every node exits 0. Raises :class:`TestbedError` as soon as one node
        fails (the others are killed) and ``TimeoutError`` after ``timeout`` seconds. With
        ``log_dir`` each node's output goes to ``node<i>.log`` there (else to this terminal).
        ``poll`` is called every ~0.2 s while waiting (progress bars). No process survives.
        """
        if not self._up:
            raise RuntimeError("Testbed.launch() needs the testbed up: use 'with Testbed(...) as tb:'")
        if not command:
            raise ValueError("command is empty: give a script (and its arguments) or '-m module'")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        port = self.free_port()
        run_id = f"{self.tag}-{port}"
        logs: list[Path | None] = []
        files: list[Any] = []
        procs: list[subprocess.Popen] = []
        start = time.monotonic()
        with signals_raise():
            try:
                for node in range(self.nodes):
                    log = Path(log_dir) / f"node{node}.log" if log_dir is not None else None
                    out = None
                    if log is not None:
                        log.parent.mkdir(parents=True, exist_ok=True)
                        out = open(log, "wb")  # noqa: SIM115 - closed in the finally below
                        files.append(out)
                    logs.append(log)
                    cmd = self.torchrun_command(node, port, command, run_id, join_timeout)
                    logger.debug("testbed: node %d: %s", node, " ".join(cmd))
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            env=self.node_env(node),
                            stdout=out,
                            stderr=subprocess.STDOUT if out else None,
                            stdin=subprocess.DEVNULL,
                            start_new_session=True,
                        )
                    )
                    if node in self.slow:
                        self._cap_cpu(node, procs[-1].pid)
                while True:
                    codes = [p.poll() for p in procs]
                    bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                    if bad:
                        node, code = bad[0]
                        raise TestbedError(
                            f"node {node}'s torchrun exited with code {code}"
                            + (f"; last lines of {logs[node]}:\n{tail(logs[node])}" if logs[node] else "")
                        )
                    if all(c == 0 for c in codes):
                        return
                    if time.monotonic() - start > timeout:
                        raise TimeoutError(
                            f"the testbed job was still running after {timeout:.0f} s and was killed "
                            "(a hang, or raise the timeout)"
                        )
                    if poll is not None:
                        poll()
                    time.sleep(0.2)
            finally:
                self._terminate(procs)
                for f in files:
                    f.close()
                self._uncap_cpu()

    def _cap_cpu(self, node: int, pid: int) -> None:
        """Cap node ``node``'s agent (and the ranks it starts) at its factor of a node's CPUs."""
        cpus = self.slow[node] * (os.cpu_count() or 1) / self.nodes
        period = 100_000
        quota = max(1000, int(cpus * period))
        v2 = Path("/sys/fs/cgroup")
        try:
            if "cpu" in (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else ():
                group = v2 / f"{self.tag}-node{node}"
                group.mkdir()
                self._cgroups.append(group)
                (group / "cpu.max").write_text(f"{quota} {period}")
                (group / "cgroup.procs").write_text(str(pid))
            else:
                group = Path("/sys/fs/cgroup/cpu") / f"{self.tag}-node{node}"
                group.mkdir()
                self._cgroups.append(group)
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
                (group / "tasks").write_text(str(pid))
            logger.info("testbed: node %d capped at %.2f CPUs (%s)", node, cpus, group)
        except OSError as e:
            logger.warning(
                "testbed: could not cap node %d's CPU at %.2f (%s): its real compute runs at full speed; only "
                "HIERSYNC_TESTBED_SPEED (the accelerator-like compute model) slows it",
                node,
                cpus,
                e,
            )

    def _uncap_cpu(self) -> None:
        for group in self._cgroups:
            with contextlib.suppress(OSError):
                group.rmdir()
        self._cgroups = []

    def _terminate(self, procs: Sequence[subprocess.Popen]) -> None:
        stop_agents(procs, self.namespaces)


# ---------------------------------------------------------------------------- CLI
def parse_slow(items: list[str] | str | None, nodes: int) -> dict[int, float]:
    """``["1=0.5"]`` or ``"1=0.5,3=0.25"`` -> ``{1: 0.5}``: a node's speed relative to full speed (0 < FACTOR <= 1)."""
    if not items:
        return {}
    if isinstance(items, str):
        items = [items]
    out: dict[int, float] = {}
    for part in (p for item in items for p in item.split(",") if p.strip()):
        node, sep, factor = part.partition("=")
        try:
            n, f = int(node), float(factor)
        except ValueError:
            n, f = -1, float("nan")
        if not sep or not 0 <= n < nodes or not 0 < f <= 1:
            raise ValueError(
                f"--slow {part!r}: give NODE=FACTOR with NODE in 0..{nodes - 1} and 0 < FACTOR <= 1 (e.g. 1=0.5: "
                "node 1 computes at half speed)"
            )
        out[n] = f
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (network namespaces)")
    parser.add_argument("--procs-per-node", type=int, default=2, help="ranks per node")
    parser.add_argument("--inter-rate", default=DEFAULT_RATE, help="tc rate of each node's egress, or 'none'")
    parser.add_argument("--burst", default="256kb", help="tbf burst")
    parser.add_argument("--latency", default="100ms", help="tbf latency (queue limit)")
    parser.add_argument("--loopback", action="store_true", help="do not build namespaces; plain loopback")
    parser.add_argument(
        "--nodes-per-rack", type=int, default=None, help="group consecutive nodes into racks (a third level)"
    )
    parser.add_argument(
        "--world-rate", default=None, help="tc rate of a node's traffic to other racks (--inter-rate: inside its rack)"
    )
    parser.add_argument(
        "--slow",
        action="append",
        metavar="NODE=FACTOR",
        help="node NODE at FACTOR x speed (e.g. 1=0.5): its CPU capped, HIERSYNC_TESTBED_SPEED set; repeatable",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="kill everything after this many seconds")
    parser.add_argument("--log-dir", default=None, help="write node<i>.log there instead of this terminal")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [args] (or -- -m module [args])")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("give the script to run after '--', e.g. -- train.py --epochs 1")
    with Testbed(
        args.nodes,
        args.procs_per_node,
        args.inter_rate,
        burst=args.burst,
        latency=args.latency,
        loopback=args.loopback,
        nodes_per_rack=args.nodes_per_rack,
        world_rate=args.world_rate,
        slow=parse_slow(args.slow, args.nodes),
    ) as tb:
        logger.info("testbed: running %s on %s", " ".join(command), tb.describe())
        try:
            tb.launch(command, timeout=args.timeout, log_dir=args.log_dir)
        except TestbedError as e:
            logger.error("%s", e)
            return 1
    return 0
