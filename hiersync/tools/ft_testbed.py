"""``python -m hiersync ft-testbed``: kill a node of a torchft job (and restart it) and watch the others go on.

Starts a torchft Lighthouse (in this process, on a port the OS picks) and one ``torchrun
--standalone`` per emulated node on this machine (loopback: links are not shaped), each a
torchft replica group running the given script (``examples/lm_torchft.py``) with
``REPLICA_GROUP_ID`` and ``TORCHFT_LIGHTHOUSE`` set. ``--kill N@S`` sends SIGKILL to every
process of node N (its torchrun and all its ranks) once it reported step S;
``--restart-after T`` starts it again T seconds later (a fresh torchrun, as a scheduler
would). The script's local rank 0 prints ``hiersync-ft node N step S loss L time T`` per
step; at the end this prints every node's loss curve, when the kill happened and how long
the survivors' next step took, where the restarted node joined, and each node's final
validation loss. No process outlives the command.

Example::

    $ python -m hiersync ft-testbed --nodes 3 --kill 2@60 --restart-after 5 -- examples/lm_torchft.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hiersync._table import render

from .netns import descendants, kill, pid_alive, signals_raise

# torchft's Rust side logs every quorum at INFO to stderr unless told otherwise (read at its import).
os.environ.setdefault("RUST_LOG", "error")

__all__ = ["FTTestbed", "NodeRun", "parse_kill", "add_arguments", "run"]

logger = logging.getLogger(__name__)

_STEP = re.compile(r"hiersync-ft node (\d+) step (\d+) loss (\S+) time (\S+)")
_FINAL = re.compile(r"^final val loss (\S+)", re.M)
_HEALS = re.compile(r"\bheals (\d+)")


def parse_kill(text: str) -> tuple[int, int]:
    """``"2@60"`` -> (node 2, step 60)."""
    m = re.fullmatch(r"\s*(\d+)\s*@\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"--kill {text!r}: use NODE@STEP, e.g. 2@60 (node 2 once it reported step 60)")
    return int(m.group(1)), int(m.group(2))


@dataclass
class NodeRun:
    """One incarnation of one node: its torchrun, its output, the steps it reported."""

    node: int
    incarnation: int
    proc: subprocess.Popen
    log: list[str] = field(default_factory=list)
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, loss, wall time) as reported."""
    killed_at: float | None = None
    started_at: float = 0.0

    @property
    def final_val_loss(self) -> float | None:
        m = _FINAL.search("".join(self.log))
        return float(m.group(1)) if m else None

    @property
    def heals(self) -> int | None:
        """Times the node was recovered from a live peer, as its script reported at the end."""
        m = _HEALS.search("".join(self.log))
        return int(m.group(1)) if m else None


class FTTestbed:
    """A Lighthouse and ``nodes`` torchrun jobs of ``procs_per_node`` ranks on loopback."""

    __test__ = False

    def __init__(
        self,
        nodes: int,
        procs_per_node: int,
        command: list[str],
        *,
        heartbeat_timeout_ms: int = 2000,
        join_timeout_ms: int = 5000,
        log_dir: str | None = None,
    ) -> None:
        if nodes < 1 or procs_per_node < 1:
            raise ValueError(f"nodes={nodes} and procs_per_node={procs_per_node} must be >= 1")
        self.nodes = nodes
        self.procs_per_node = procs_per_node
        self.command = command
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.join_timeout_ms = join_timeout_ms
        self.log_dir = Path(log_dir) if log_dir else None
        self.runs: list[NodeRun] = []
        self._lighthouse: Any = None
        self._lock = threading.Lock()

    def __enter__(self) -> FTTestbed:
        from .ft_nodes import Lighthouse

        self._lighthouse = Lighthouse(
            min_replicas=1, join_timeout_ms=self.join_timeout_ms, heartbeat_timeout_ms=self.heartbeat_timeout_ms
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None

    def start(self, node: int) -> NodeRun:
        """Start (or restart) node ``node``: a fresh ``torchrun --standalone`` of its ranks.

        The first incarnations wait for each other in their first quorum
        (``HIERSYNC_FT_START_NODES``, read by ``examples/lm_torchft.py``); a restarted node
        does not: with a live peer it is healed in its first quorum whatever that says, and
        without one it would hold quorums alone for the whole quorum timeout.
        """
        incarnation = sum(1 for r in self.runs if r.node == node) + 1
        env = dict(os.environ)
        env["HIERSYNC_FT_START_NODES"] = str(self.nodes if incarnation == 1 else 1)
        env.pop("HIERSYNC_NODE_IDS", None)
        env.update(
            {
                "TORCHFT_LIGHTHOUSE": self._lighthouse.address,
                "REPLICA_GROUP_ID": str(node),
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "PYTHONUNBUFFERED": "1",
                "GLOO_SOCKET_IFNAME": "lo",
                "RUST_LOG": env.get("RUST_LOG", "error"),
            }
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(self.procs_per_node),
            "--max-restarts",
            "0",
        ] + self.command
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        rec = NodeRun(node, incarnation, proc, started_at=time.time())
        with self._lock:
            self.runs.append(rec)
        threading.Thread(target=self._read, args=(rec,), daemon=True).start()
        logger.info("ft-testbed: node %d started (incarnation %d)", node, incarnation)
        return rec

    def _read(self, rec: NodeRun) -> None:
        assert rec.proc.stdout is not None
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"node{rec.node}-{rec.incarnation}.log", "w")  # noqa: SIM115
        try:
            for line in rec.proc.stdout:
                rec.log.append(line)
                if out is not None:
                    out.write(line)
                m = _STEP.search(line)
                if m and int(m.group(1)) == rec.node:
                    rec.steps.append((int(m.group(2)), float(m.group(3)), float(m.group(4))))
        finally:
            if out is not None:
                out.close()

    def kill(self, rec: NodeRun) -> float:
        """SIGKILL the node's torchrun and every rank it started; the time it was sent."""
        tree = [rec.proc.pid] + descendants(rec.proc.pid)
        t = time.time()
        kill(tree, signal.SIGKILL)
        rec.killed_at = t
        logger.warning("ft-testbed: killed node %d (%d processes)", rec.node, len(tree))
        return t

    def stop_all(self) -> None:
        for rec in self.runs:
            if rec.proc.poll() is None:
                kill([rec.proc.pid] + descendants(rec.proc.pid), signal.SIGKILL)
        for rec in self.runs:
            try:
                rec.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for rec in self.runs:
            for pid in descendants(rec.proc.pid):
                if pid_alive(pid):
                    kill([pid], signal.SIGKILL)

    def latest(self, node: int) -> NodeRun:
        return [r for r in self.runs if r.node == node][-1]


def run_job(
    tb: FTTestbed,
    kills: list[tuple[int, int]],
    restart_after: float | None,
    timeout: float,
) -> None:
    """Start every node, apply the kills and restarts, return when every live node has exited."""
    for n in range(tb.nodes):
        tb.start(n)
    pending = list(kills)
    restarts: list[tuple[float, int]] = []
    start = time.monotonic()
    while True:
        for node, step in list(pending):
            rec = tb.latest(node)
            if rec.steps and rec.steps[-1][0] >= step and rec.proc.poll() is None:
                t = tb.kill(rec)
                pending.remove((node, step))
                if restart_after is not None:
                    restarts.append((t + restart_after, node))
        for when, node in list(restarts):
            if time.time() >= when:
                tb.start(node)
                restarts.remove((when, node))
        live = [r for r in tb.runs if r.killed_at is None]
        failed = [r for r in live if r.proc.poll() not in (None, 0)]
        if failed:
            r = failed[0]
            raise RuntimeError(
                f"node {r.node}'s torchrun exited with code {r.proc.returncode}; last lines:\n{''.join(r.log[-30:])}"
            )
        if all(r.proc.poll() == 0 for r in live) and not restarts and not pending:
            return
        if all(r.proc.poll() == 0 for r in live) and pending:
            raise RuntimeError(f"the job ended before the kills {pending} could happen (fewer steps?)")
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"the job was still running after {timeout:.0f} s and was killed")
        time.sleep(0.05)


def summarize(tb: FTTestbed, print_every: int) -> dict[str, Any]:
    """The loss curves, the kill's effect on the survivors, where a restarted node joined, final losses."""
    nodes: dict[str, Any] = {}
    for rec in tb.runs:
        nodes[f"{rec.node}.{rec.incarnation}"] = {
            "node": rec.node,
            "incarnation": rec.incarnation,
            "first_step": rec.steps[0][0] if rec.steps else None,
            "last_step": rec.steps[-1][0] if rec.steps else None,
            "started_at": rec.started_at,
            "first_step_at": rec.steps[0][2] if rec.steps else None,
            "killed_at": rec.killed_at,
            "final_val_loss": rec.final_val_loss,
            "heals": rec.heals,
            "curve": [(s, loss) for s, loss, _ in rec.steps if s % print_every == 0],
        }
    events = []
    for rec in tb.runs:
        if rec.killed_at is None:
            continue
        died = rec.killed_at
        gaps = {}
        for other in tb.runs:
            if other.node == rec.node or other.killed_at is not None:
                continue
            before = [t for _, _, t in other.steps if t <= died]
            after = [(s, t) for s, _, t in other.steps if t > died]
            if not after or not before:
                continue
            typical = (before[-1] - before[0]) / max(1, len(before) - 1)
            # the step that waited for the dead node (its sync's quorum or collective), in the next 20
            times = [before[-1]] + [t for _, t in after[:20]]
            longest = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1])
            gaps[other.node] = {
                "next_step": after[0][0],
                "s_to_next_step": after[0][1] - died,
                "longest_step": after[longest - 1][0],
                "longest_step_s": times[longest] - times[longest - 1],
                "typical_step_s": typical,
            }
        events.append({"killed": rec.node, "at_step": rec.steps[-1][0] if rec.steps else None, "survivors": gaps})
    return {"nodes": nodes, "events": events}


def report(summary: dict[str, Any]) -> str:
    lines = []
    runs = summary["nodes"]
    steps = sorted({s for r in runs.values() for s, _ in r["curve"]})
    names = list(runs)
    lines.append("loss per node (node.incarnation):")
    curves = [dict(runs[n]["curve"]) for n in names]
    table = [[str(s), *(f"{d[s]:.4f}" if s in d else "" for d in curves)] for s in steps]
    lines.append(render(["step", *names], table, align="r", indent="  "))
    for ev in summary["events"]:
        lines.append(f"node {ev['killed']} killed after step {ev['at_step']}:")
        for node, g in ev["survivors"].items():
            lines.append(
                f"  node {node}: next step {g['next_step']} done {g['s_to_next_step']:.2f} s after the kill; "
                f"step {g['longest_step']} took {g['longest_step_s']:.2f} s (before: {g['typical_step_s']:.3f} s each)"
            )
    for r in runs.values():
        if r["incarnation"] > 1:
            lines.append(
                f"node {r['node']} restarted: first step {r['first_step']} "
                f"({r['first_step_at'] - r['started_at']:.1f} s after its start), {_healed(r)}"
                if r["first_step_at"]
                else f"node {r['node']} restarted: no step reported"
            )
    for name, r in runs.items():
        if r["final_val_loss"] is not None:
            lines.append(f"node {name}: final val loss {r['final_val_loss']:.4f} (last step {r['last_step']})")
    return "\n".join(lines)


def _healed(run: dict[str, Any]) -> str:
    if run["heals"] or (run["heals"] is None and run["first_step"]):
        return "healed from a live peer"
    # A fresh node that starts at step 0 found no node of the run in its first quorum.
    return "NOT healed: no live peer in its first quorum (had the others finished?), it trained from its own state"


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=3, help="emulated nodes (one torchrun each)")
    parser.add_argument("--procs-per-node", type=int, default=1, help="ranks per node")
    parser.add_argument("--kill", action="append", default=[], help="NODE@STEP: SIGKILL node NODE after step STEP")
    parser.add_argument(
        "--restart-after", type=float, default=None, help="restart a killed node this many seconds after its death"
    )
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="Lighthouse: a silent node is dead")
    parser.add_argument("--join-timeout-ms", type=int, default=5000, help="Lighthouse: wait this long for stragglers")
    parser.add_argument("--print-every", type=int, default=10, help="loss curve: one line every this many steps")
    parser.add_argument("--timeout", type=float, default=3600.0, help="kill everything after this many seconds")
    parser.add_argument("--log-dir", default=None, help="write node<N>-<incarnation>.log there")
    parser.add_argument("--json", default=None, help="write the summary as JSON there")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [args]")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("give the script to run after '--', e.g. -- examples/lm_torchft.py --steps 300")
    kills = [parse_kill(k) for k in args.kill]
    for node, _ in kills:
        if not 0 <= node < args.nodes:
            raise ValueError(f"--kill {node}@...: node {node} is not one of the {args.nodes} nodes")
    tb = FTTestbed(
        args.nodes,
        args.procs_per_node,
        command,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        join_timeout_ms=args.join_timeout_ms,
        log_dir=args.log_dir,
    )
    with signals_raise(), tb:
        logger.info("ft-testbed: %d nodes x %d ranks on loopback (links not shaped)", args.nodes, args.procs_per_node)
        try:
            run_job(tb, kills, args.restart_after, args.timeout)
        except RuntimeError as e:
            logger.error("%s", e)
            return 1
        time.sleep(0.2)  # the readers have the last lines
        summary = summarize(tb, args.print_every)
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0
