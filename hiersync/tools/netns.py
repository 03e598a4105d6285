"""Linux plumbing of the emulated cluster: tc rates, network namespaces, process trees, signals.

What :class:`hiersync.tools.testbed.Testbed` builds on: ``ip``/``tc`` calls with a time
limit, the namespaces a testbed left behind, the descendants of a process (from /proc),
and signals turned into ``KeyboardInterrupt`` so every cleanup runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("hiersync.tools.testbed")

__all__ = [
    "NS_PREFIX",
    "IP_TIMEOUT_S",
    "parse_rate",
    "run_ip",
    "emulation_available",
    "pid_alive",
    "namespaces",
    "ns_pids",
    "stale_namespaces",
    "children_map",
    "descendants",
    "kill",
    "signals_raise",
    "tail",
    "shape_tbf",
    "shape_by_destination",
    "write_hosts",
    "remove_namespaces",
    "stop_agents",
]

DEFAULT_RATE = "800mbit"
"""The testbed's inter-node link by default (tbf rate of each node's egress): the link the cost
model's ``emulated`` preset describes."""
NS_PREFIX = "hiersync-"
"""Every namespace a testbed creates is called ``hiersync-<pid>-<n>-<node|sw>``."""
IP_TIMEOUT_S = 20.0
"""Limit of one ``ip``/``tc`` call (a wedged netlink socket must not hang the testbed)."""
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
_RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}  # tc's units: "bps" is bytes per second


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate string such as ``"800mbit"`` (tc's ``bps`` is bytes/s)."""
    m = _RATE_RE.match(str(rate).strip())
    if not m:
        raise ValueError(f"inter_rate={rate!r} is not a tc rate; use e.g. '800mbit', '10gbit' or '100mbps' (bytes/s)")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"inter_rate={rate!r} must be > 0")
    return value


def run_ip(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip``/``tc`` command with a time limit; ``RuntimeError`` with its stderr when ``check`` and it fails."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def shape_tbf(ns: str, dev: str, rate: str, burst: str, latency: str) -> None:
    """Shape ``dev``'s egress in namespace ``ns`` to ``rate`` (one tbf)."""
    tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
    run_ip(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])


def shape_by_destination(ns: str, dev: str, near_rate: str, near: Sequence[str], far_rate: str, burst: str) -> None:
    """Shape ``dev``'s egress per destination (htb): ``near_rate`` to the addresses ``near``,
    ``far_rate`` to every other one (a rack's nodes and the spine)."""
    tc = ["tc", "-n", ns]
    run_ip([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"])
    for cls, rate in (("1:10", near_rate), ("1:20", far_rate)):
        run_ip([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", rate, "ceil", rate,
                "burst", burst])  # fmt: skip
    for addr in near:
        run_ip([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
                "dst", f"{addr}/32", "flowid", "1:10"])  # fmt: skip


def emulation_available() -> tuple[bool, str]:
    """Whether namespaces can be built here, and if not, why (root and iproute2 needed)."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root (run with sudo)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return False, f"iproute2 is not installed ({', '.join(missing)} not found)"
    return True, ""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """Names of every network namespace (``ip netns list``)."""
    proc = run_ip(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    """Pids of the processes running in namespace ``ns``."""
    proc = run_ip(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def stale_namespaces() -> list[str]:
    """Testbed namespaces whose creating process is gone (left by a ``kill -9``)."""
    out = []
    for ns in namespaces():
        m = re.match(rf"^{re.escape(NS_PREFIX)}(\d+)-", ns)
        if m and not pid_alive(int(m.group(1))):
            out.append(ns)
    return out


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (from /proc; empty where there is no /proc)."""
    if not os.path.isdir("/proc"):
        return []
    children = children_map()
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill(pids: Sequence[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``, ignoring those already gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into KeyboardInterrupt so every ``finally`` cleanup runs.

    SIGINT is included explicitly: a process started from a non-interactive shell's
    background job inherits SIGINT as *ignored*, and Python then installs no handler, so
    Ctrl-C (or ``kill -INT``) would leave the job and its namespaces running.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def tail(path: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ("" when there is none)."""
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def write_hosts(ns: str, names: Sequence[tuple[str, str]]) -> Path:
    """Add ``(address, name)`` pairs to namespace ``ns``'s /etc/hosts; the folder written.

    ``ip netns exec`` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: naming the testbed
    addresses there lets c10d's reverse lookups succeed instead of warning and retrying.
    """
    try:
        base = Path("/etc/hosts").read_text()
    except OSError:
        base = "127.0.0.1 localhost\n"
    # c10d's sockets are dual-stack, so peers appear as v4-mapped IPv6 addresses too.
    lines = "".join(f"{prefix}{addr} {name}\n" for addr, name in names for prefix in ("", "::ffff:"))
    d = Path("/etc/netns") / ns
    d.mkdir(parents=True, exist_ok=True)
    (d / "hosts").write_text(base.rstrip("\n") + "\n" + lines)
    return d


def remove_namespaces(names: Sequence[str], etc_dirs: Sequence[Path] = ()) -> None:
    """Kill what still runs in each namespace of ``names``, delete them and their /etc folders."""
    for ns in names:
        try:
            pids = ns_pids(ns)
            if pids:  # only processes the testbed started can live in its namespaces
                logger.warning("testbed: killing %d leftover processes in %s", len(pids), ns)
                kill(pids, signal.SIGKILL)
                time.sleep(0.1)
            # Deleting a namespace destroys its veth end, which destroys the peer too.
            run_ip(["ip", "netns", "del", ns], check=False)
        except (OSError, subprocess.TimeoutExpired) as e:  # keep removing the others
            logger.error("testbed: could not remove namespace %s: %s (remove it with 'ip netns del %s')", ns, e, ns)
    for d in etc_dirs:
        shutil.rmtree(d, ignore_errors=True)


def stop_agents(procs: Sequence[subprocess.Popen], namespaces: Sequence[str] = ()) -> None:
    """SIGTERM each running agent (torchrun stops its ranks), then SIGKILL anything left of their
    process trees and in ``namespaces``."""
    running = [p for p in procs if p.poll() is None]
    tree = {p.pid: descendants(p.pid) for p in procs}
    if running:
        kill([p.pid for p in running], signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(p.poll() is None for p in running):
            time.sleep(0.1)
    leftovers = [pid for pids in tree.values() for pid in pids if pid_alive(pid)]
    for ns in namespaces:
        leftovers += ns_pids(ns)
    leftovers += [p.pid for p in procs if p.poll() is None]
    if leftovers:
        logger.debug("testbed: killing leftover processes %s", sorted(set(leftovers)))
        kill(sorted(set(leftovers)), signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
