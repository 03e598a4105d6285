"""``python -m hiersync chaos``: many emulated nodes, a fault every few seconds, goodput and invariants.

Runs the manager mode (:mod:`hiersync.ft`) on ``--nodes`` emulated torchft nodes on this
machine (:mod:`hiersync.tools.ft_nodes`: one world per node, a Lighthouse in this
process), each training :mod:`hiersync.tools.chaos_worker` with accelerator-like compute,
twice: once without faults (the reference), once with a fault every ``--fault-every``
seconds, its kind and victim drawn from ``--seed``:

* ``kill``: SIGKILL every rank of a node; it is started again ``--restart-after`` s later
  (a fresh process with its own fresh model, as its torchrun would);
* ``kill-rank``: SIGKILL one rank of a node of several ranks; the node's other ranks are
  killed a moment later, as torchrun's agent does, and the node restarted;
* ``freeze``: SIGSTOP every rank of a node for three heartbeat timeouts, then SIGCONT: the
  Lighthouse drops it, and the thawed node is healed at its next quorum (never syncs
  its stale state);
* ``kill-source``: a node is killed and restarted as above, and the live node that sends
  it its state (torchft asks it for its state) is killed as soon as it starts sending;
* ``two``: two nodes killed at once, both restarted;
* ``partition``: every packet a node sends is dropped (a firewall rule on its ranks' group
  id, so root and ``iptables`` only) for three heartbeat timeouts, then the rule is removed:
  the others drop it, and it is healed at its next quorum;
* ``slow`` (only when named in ``--faults``): a node's accelerator-like compute runs 2, 3 or 4
  times as long for 60 s, then at full speed again (a throttled GPU, a noisy neighbour); with
  ``--pace adaptive`` it takes the steps that fit in its peers' windows. Goodput is then
  against the ideal: the run without faults' rate at each node's own speed.
  ``--lighthouse-restart-at S``
  also kills the Lighthouse S seconds into the run and starts it again at the same address a
  few seconds later.

Every timeout is docs/cluster.md's unless given (``--heartbeat-timeout-ms``,
``--join-timeout-ms``, ``--rail-timeout``), and the report prints them beside the figures.

After the run :mod:`hiersync.tools.chaos_analysis` checks the invariants on every node's
per-step records and prints goodput, stall per fault, restart to first contributing sync,
heals, windows dropped, and the final validation loss against the run without faults at the
same steps and at the same useful work (the goal "nothing lost" is judged on the latter);
``--out`` gets ``chaos.json`` and a plot of each node's state. No process outlives it. Example::

    $ python -m hiersync chaos --nodes 8 --minutes 10 --fault-every 30 --seed 1,2,3 --out chaos
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .chaos_analysis import (
    FAULTS,
    KINDS,
    SLOW_S,
    Event,
    RunRecord,
    _incarnations,
    _steps,
    analyze,
    reference_curve,
    report,
    settings,
    table,
)
from .netns import signals_raise

os.environ.setdefault("RUST_LOG", "error")

__all__ = ["ChaosConfig", "Event", "RunRecord", "run_chaos", "analyze", "report", "settings", "table"]
__all__ += ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def can_partition() -> bool:
    """Whether ``partition`` can run here: root, and ``iptables`` with the owner match."""
    import shutil

    return os.geteuid() == 0 and shutil.which("iptables") is not None


def _iptables(action: str, gid: int) -> None:
    import subprocess

    subprocess.run(
        ["iptables", action, "OUTPUT", "-m", "owner", "--gid-owner", str(gid), "-j", "DROP"],
        check=action == "-I",
        capture_output=True,
    )


@dataclass
class ChaosConfig:
    nodes: int = 8
    procs_per_node: int = 1
    frontend: str = "ddp"
    period: int = 4
    fwd_ms: float = 100.0
    bwd_ms: float = 200.0
    seconds: float = 120.0
    """Length of the run without faults (its step count is fixed from it)."""
    fault_every: float = 30.0
    restart_after: float = 3.0
    heartbeat_timeout_ms: int = 1000
    """The Lighthouse's ``--heartbeat_timeout_ms`` (docs/cluster.md's), also hiersync's
    ``heartbeat_timeout`` (the contact bound of a window)."""
    join_timeout_ms: int = 60000
    """The Lighthouse's ``--join_timeout_ms`` (docs/cluster.md's)."""
    timeout_s: float = 60.0
    """The Manager's and its process group's timeout (docs/cluster.md's): a rail collective's data,
    a commit, a recovery."""
    quorum_timeout_s: float = 900.0
    """The Manager's ``quorum_timeout`` (docs/cluster.md's 15 minutes): how long a node waits for a
    quorum before it stops with an error."""
    faults: tuple[str, ...] = FAULTS
    pace: str = "fixed"
    """hiersync's ``pace`` (``"adaptive"``: each node takes the steps its speed fits in a window)."""
    seed: int = 0
    lighthouse_restart_at: float | None = None
    """Seconds into the run with faults at which the Lighthouse is killed (restarted 3 s later)."""
    steps: int = 0
    """0: from ``seconds`` and the step time measured in the run without faults."""


def _worker_cfg(cfg: ChaosConfig, folder: str, steps: int, eval_syncs: bool = False) -> dict[str, Any]:
    return {
        "eval_syncs": eval_syncs,
        "steps": steps,
        "dir": folder,
        "fwd_ms": cfg.fwd_ms,
        "bwd_ms": cfg.bwd_ms,
        "frontend": cfg.frontend,
        "timeout_s": cfg.timeout_s,
        "quorum_timeout_s": cfg.quorum_timeout_s,
        "options": {"period": cfg.period, "heartbeat_timeout": cfg.heartbeat_timeout_ms / 1000, "pace": cfg.pace},
    }


class _Driver:
    """Starts the nodes, injects the faults, restarts the dead, and collects the records."""

    def __init__(self, cfg: ChaosConfig, steps: int, inject: bool, bar: Any = None, logs: Path | None = None) -> None:
        self.cfg, self.steps, self.inject, self.bar, self.logs = cfg, steps, inject, bar, logs
        self.rng = random.Random(cfg.seed)
        self.events: list[Event] = []
        self.faults: list[dict[str, Any]] = []
        self.restarts: list[tuple[float, int]] = []
        self.thaws: list[tuple[float, int]] = []
        self.source_hunt: tuple[float, int] | None = None  # (until, fault) waiting for a heal's source
        self.down: set[int] = set()  # killed or frozen, not yet back
        self.partitioned: dict[int, float] = {}  # node -> when its rule comes off
        self.slowed: dict[int, float] = {}  # node -> when it runs at full speed again
        self._read_to: dict[int, int] = {}  # bytes of each node's progress file read so far
        self._reached: dict[int, int] = {}  # the highest step each node reported
        step_s = (cfg.fwd_ms + cfg.bwd_ms) / 1000
        self.quiet_steps = int((cfg.restart_after + 15.0) / step_s)
        """No fault in the last steps of the run: a node killed then would find its peers finished."""

    def run(self) -> RunRecord:
        from .ft_nodes import GID_BASE, Lighthouse, Nodes

        cfg = self.cfg
        self.lighthouse = Lighthouse(
            min_replicas=1, heartbeat_timeout_ms=cfg.heartbeat_timeout_ms, join_timeout_ms=cfg.join_timeout_ms
        )
        partition = "partition" in cfg.faults and self.inject and can_partition()
        timeout = max(30.0, 3 * cfg.timeout_s)
        try:
            with (
                self.lighthouse,
                Nodes(self.lighthouse.address, cfg.procs_per_node, pg_timeout=timeout, group_ids=partition) as nodes,
            ):
                return self._run(nodes)
        finally:
            for n in list(self.partitioned):  # never leave a rule behind
                _iptables("-D", GID_BASE + n)

    def _run(self, nodes: Any) -> RunRecord:
        from . import chaos_worker

        cfg = self.cfg
        self.nodes = nodes
        self.work = _worker_cfg(cfg, nodes.root, self.steps, eval_syncs=not self.inject)
        self.fn = chaos_worker.train
        for n in range(cfg.nodes):
            nodes.start(n, self.fn, (dict(self.work, start_nodes=cfg.nodes),))
        started = self.started = time.time()
        next_fault = started + cfg.fault_every
        lighthouse_down = started + cfg.lighthouse_restart_at if cfg.lighthouse_restart_at and self.inject else None
        lighthouse_back: float | None = None
        while not self._finished():
            now = time.time()
            reached = self._progress()
            if self.inject and now >= next_fault:
                if reached < self.steps - self.quiet_steps:
                    self._inject(len(self.faults))
                else:  # a node killed now would come back after the others finished: nobody to heal from
                    self.events.append(Event(now, "note", -1, len(self.faults), "no fault near the end of the run"))
                next_fault += cfg.fault_every
            if lighthouse_down is not None and now >= lighthouse_down:
                self.lighthouse.shutdown()
                self.events.append(Event(now, "lighthouse-down", -1))
                lighthouse_down, lighthouse_back = None, now + 3.0
            if lighthouse_back is not None and now >= lighthouse_back:
                self.lighthouse.restart()
                self.events.append(Event(time.time(), "lighthouse-up", -1))
                lighthouse_back = None
            self._housekeeping(now)
            if self.bar is not None:
                self.bar(reached)
            if now - started > 20 * max(cfg.seconds, 60.0):
                raise TimeoutError(f"the chaos run was still going after {now - started:.0f} s")
            time.sleep(0.05)
        ended = time.time()
        if self.logs is not None:  # every rank's own log (torchft's and hiersync's lines)
            import shutil

            self.logs.mkdir(parents=True, exist_ok=True)
            for f in Path(nodes.root).glob("node*-rank*.log"):
                shutil.copy(f, self.logs / f.name)
        records = {n: nodes.steps(n) for n in range(cfg.nodes)}
        results = {n: self._result(n) for n in range(cfg.nodes)}
        return RunRecord(self.steps, started, ended, cfg.seed, records, self.events, results, self.faults)

    # ------------------------------------------------------------------ faults
    def _alive(self) -> list[int]:
        return [n for n in range(self.cfg.nodes) if n not in self.down and self._running(n)]

    def _running(self, n: int) -> bool:
        rec = self.nodes.nodes.get(n)
        return rec is not None and any(p.exitcode is None for p in rec.procs)

    def _inject(self, index: int) -> None:
        cfg = self.cfg
        kinds = [k for k in cfg.faults if k != "kill-rank" or cfg.procs_per_node > 1]
        if not can_partition():
            kinds = [k for k in kinds if k != "partition"] or ["kill"]
        alive = self._alive()
        if len(alive) < max(2, cfg.nodes // 2) + 1:  # keep most of the run up: skip this slot
            self.events.append(Event(time.time(), "note", -1, index, "skipped: too few nodes up"))
            return
        kind = self.rng.choice(kinds)
        if kind == "slow":
            alive = [n for n in alive if n not in self.slowed] or alive
        victims = self.rng.sample(alive, 2 if kind == "two" else 1)
        t = time.time()
        self.faults.append({"index": index, "t": t, "kind": kind, "nodes": victims})
        logger.info("chaos: fault %d at %.1f s: %s %s", index, t - self.started, kind, victims)
        if kind == "slow":
            from .chaos_worker import SLOW

            (n,) = victims
            factor = self.rng.choice((2, 3, 4))
            (Path(self.nodes.root) / SLOW.format(node=n)).write_text(str(factor))
            self.slowed[n] = t + SLOW_S
            self.events.append(Event(t, "slow", n, index, str(factor)))
            return
        if kind == "freeze":
            (n,) = victims
            self.nodes.freeze(n)
            self.down.add(n)
            self.events.append(Event(t, "freeze", n, index))
            self.thaws.append((t + 3 * cfg.heartbeat_timeout_ms / 1000, n))
            return
        if kind == "partition":
            from .ft_nodes import GID_BASE

            (n,) = victims
            _iptables("-I", GID_BASE + n)
            self.down.add(n)
            self.partitioned[n] = t + 3 * cfg.heartbeat_timeout_ms / 1000
            self.events.append(Event(t, "partition", n, index))
            return
        if kind == "kill-rank":
            (n,) = victims
            proc = self.rng.choice(self.nodes.nodes[n].procs)
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
            time.sleep(0.5)  # torchrun's agent sees the rank die and stops the others
        for n in victims:
            self._kill(n, index, kind)
        if kind == "kill-source":
            from .chaos_worker import SENDING, SLOW_SEND  # the worker's flags (it imports torch)

            for f in Path(self.nodes.root).glob(SENDING.format(node="*")):
                f.unlink()
            (Path(self.nodes.root) / SLOW_SEND).touch()
            self.source_hunt = (t + cfg.restart_after + 30.0, index)

    def _kill(self, n: int, index: int, why: str) -> None:
        t = self.nodes.kill(n)
        self.down.add(n)
        self.events.append(Event(t, "kill", n, index, why))
        self.restarts.append((t + self.cfg.restart_after, n))

    def _housekeeping(self, now: float) -> None:
        from .ft_nodes import GID_BASE

        for n, when in list(self.partitioned.items()):
            if now >= when:
                _iptables("-D", GID_BASE + n)
                del self.partitioned[n]
                self.down.discard(n)
                self.events.append(Event(now, "heal-partition", n))
        for n, when in list(self.slowed.items()):
            if now >= when:
                from .chaos_worker import SLOW

                (Path(self.nodes.root) / SLOW.format(node=n)).unlink(missing_ok=True)
                del self.slowed[n]
                self.events.append(Event(now, "unslow", n))
        for when, n in list(self.thaws):
            if now >= when:
                self.nodes._signal(n, signal.SIGCONT)
                self.thaws.remove((when, n))
                self.down.discard(n)
                self.events.append(Event(now, "thaw", n))
        for when, n in list(self.restarts):
            if now >= when and not self._running(n):
                self.restarts.remove((when, n))
                self.down.discard(n)
                self.nodes.start(n, self.fn, (dict(self.work, start_nodes=1),))
                self.events.append(Event(time.time(), "restart", n))
        if self.source_hunt is not None:
            from .chaos_worker import SENDING, SLOW_SEND

            until, index = self.source_hunt
            sources = [int(f.name.split("-")[1]) for f in Path(self.nodes.root).glob(SENDING.format(node="*"))]
            live = [n for n in sources if n not in self.down and self._running(n)]
            if live or now > until:
                if live:
                    self._kill(live[0], index, "heal source")
                else:
                    self.events.append(Event(now, "note", -1, index, "no heal source seen"))
                self.source_hunt = None
                (Path(self.nodes.root) / SLOW_SEND).unlink(missing_ok=True)
        for n in range(self.cfg.nodes):  # a node that raised: print it, start it again (torchrun would)
            rec = self.nodes.nodes.get(n)
            if rec is None or self._running(n) or n in self.down or self._done(n):
                continue
            errors = sorted(Path(rec.folder).glob("error-*"))
            text = errors[0].read_text().strip().splitlines()[-1] if errors else "exited without a result"
            self.events.append(Event(now, "error", n, detail=text))
            logger.warning("chaos: node %d ended with: %s", n, text)
            self.down.add(n)
            self.restarts.append((now + self.cfg.restart_after, n))

    # ------------------------------------------------------------------ the end
    def _done(self, n: int) -> bool:
        rec = self.nodes.nodes[n]
        return all(os.path.exists(os.path.join(rec.folder, f"result-{r}")) for r in range(self.cfg.procs_per_node))

    def _finished(self) -> bool:
        if self.restarts or self.thaws or self.down or self.partitioned:
            return False
        return all(n in self.nodes.nodes and self._done(n) and not self._running(n) for n in range(self.cfg.nodes))

    def _result(self, n: int) -> Any:
        import pickle

        with open(os.path.join(self.nodes.nodes[n].folder, "result-0"), "rb") as f:
            return pickle.load(f)

    def _progress(self) -> int:
        """The step every node has reached: the new lines of each progress file only (this runs
        every 50 ms on the cores the nodes train on; the whole files are read once, at the end)."""
        for n in range(self.cfg.nodes):
            path = os.path.join(self.nodes.root, f"node{n}.progress")
            try:
                with open(path) as f:
                    f.seek(self._read_to.get(n, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            done = chunk.rfind("\n") + 1  # a line still being written is read next time
            self._read_to[n] = self._read_to.get(n, 0) + len(chunk[:done].encode())
            for line in chunk[:done].splitlines():
                parts = line.split()
                if len(parts) >= 2:
                    self._reached[n] = max(self._reached.get(n, 0), int(parts[1]))
        return min((self._reached.get(n, 0) for n in range(self.cfg.nodes)), default=0)


_SPANS = (("freeze", "thaw", "frozen"), ("partition", "heal-partition", "partitioned"), ("slow", "unslow", "slow"))
"""The events that open and close a node's state in the plot, and its colour's name."""


def plot(faulted: RunRecord, cfg: ChaosConfig, path: Path) -> None:
    """Each node's state over time: dead, starting/healing, contributing, frozen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = faulted.started
    fig, ax = plt.subplots(figsize=(10, 0.4 * cfg.nodes + 1.5))
    colors = {
        "contributing": "tab:green",
        "starting/healing": "tab:orange",
        "frozen": "tab:blue",
        "partitioned": "tab:purple",
        "slow": "tab:olive",
        "dead": "tab:red",
    }
    for n, recs in faulted.records.items():
        for inc in _incarnations(recs):
            steps = _steps(inc)
            start = inc[0][0]
            first = steps[0][0] if steps else faulted.ended
            ax.broken_barh([(start - t0, first - start)], (n - 0.4, 0.8), color=colors["starting/healing"])
            if steps:
                ax.broken_barh([(first - t0, steps[-1][0] - first)], (n - 0.4, 0.8), color=colors["contributing"])
    for e in faulted.events:
        if e.kind == "kill":
            back = next((x.t for x in faulted.events if x.kind == "restart" and x.node == e.node and x.t > e.t), None)
            ax.broken_barh([(e.t - t0, (back or faulted.ended) - e.t)], (e.node - 0.4, 0.8), color=colors["dead"])
        for opened, closed, color in _SPANS:
            if e.kind == opened:
                back = next((x.t for x in faulted.events if x.kind == closed and x.node == e.node and x.t > e.t), None)
                ax.broken_barh([(e.t - t0, (back or faulted.ended) - e.t)], (e.node - 0.4, 0.8), color=colors[color])
        if e.kind == "lighthouse-down":
            ax.axvline(e.t - t0, color="black", linestyle="--")
    ax.set_yticks(range(cfg.nodes))
    ax.set_ylabel("node")
    ax.set_xlabel("seconds")
    ax.set_title(f"chaos run: a fault every {cfg.fault_every:.0f} s (seed {cfg.seed})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles=handles, labels=list(colors), ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bar(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None, None
    bar = tqdm(total=total, desc=desc, unit="step", mininterval=1.0)

    def update(done: int) -> None:
        done = min(total, max(0, done))
        if done > bar.n:
            bar.update(done - bar.n)

    return bar, update


def _timed_run(cfg: ChaosConfig, steps: int, inject: bool, name: str, progress: bool, logs: Path | None) -> RunRecord:
    bar, update = _bar(steps, name) if progress else (None, None)
    try:
        return _Driver(cfg, steps, inject, update, logs).run()
    finally:
        if bar is not None:
            bar.close()


def run_chaos(
    cfg: ChaosConfig, progress: bool = True, logs: Path | None = None, seeds: list[int] | None = None
) -> list[tuple[dict[str, Any], RunRecord, RunRecord]]:
    """The run without faults, then one run with faults per seed (default: ``cfg.seed``);
    (analysis, faulted run, reference run) for each. ``logs``: copy every rank's log there."""
    steps = cfg.steps or max(2 * cfg.period, round(cfg.seconds / ((cfg.fwd_ms + cfg.bwd_ms) / 1000 * 1.1)))
    folder = (lambda name: None) if logs is None else (lambda name: logs / name)
    reference = _timed_run(cfg, steps, False, "without faults", progress, folder("reference"))
    out = []
    for seed in seeds if seeds is not None else [cfg.seed]:
        seeded = ChaosConfig(**{**asdict(cfg), "seed": seed, "faults": tuple(cfg.faults)})
        name = f"faults, seed {seed}"
        faulted = _timed_run(seeded, steps, True, name, progress, folder(f"faults-seed{seed}"))
        out.append((analyze(faulted, reference, cfg.period, cfg.nodes), faulted, reference))
    return out


# ---------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ChaosConfig()
    parser.add_argument("--nodes", type=int, default=d.nodes, help="emulated nodes")
    parser.add_argument("--procs-per-node", type=int, default=d.procs_per_node, help="ranks per node (FSDP2 if > 1)")
    parser.add_argument("--minutes", type=float, default=2.0, help="length of the run without faults")
    parser.add_argument("--fault-every", type=float, default=d.fault_every, help="seconds between two faults")
    parser.add_argument("--restart-after", type=float, default=d.restart_after, help="a killed node restarts this late")
    kinds = f"kinds to draw from: {','.join(KINDS)} (slow: only when named)"
    parser.add_argument("--faults", default=",".join(FAULTS), help=kinds)
    pace = "hiersync's pace: adaptive has each node take the steps its speed fits in a window (with the slow fault)"
    parser.add_argument("--pace", choices=("fixed", "adaptive"), default=d.pace, help=pace)
    parser.add_argument("--period", type=int, default=d.period, help="hiersync period k")
    parser.add_argument("--step-ms", type=float, default=d.fwd_ms + d.bwd_ms, help="accelerator-like compute per step")
    hb = "the Lighthouse's heartbeat timeout, also hiersync's heartbeat_timeout (the bound of a window's contact)"
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=d.heartbeat_timeout_ms, help=hb)
    join = "the Lighthouse's join timeout (how long a quorum waits for a node that heartbeats but has not asked)"
    parser.add_argument("--join-timeout-ms", type=int, default=d.join_timeout_ms, help=join)
    rail = "seconds: the timeout of the Manager and its process group (a rail collective's data, a commit, a recovery)"
    parser.add_argument("--rail-timeout", type=float, default=d.timeout_s, help=rail)
    quorum = "seconds: the Manager's quorum_timeout (a node that waits longer for a quorum stops with an error)"
    parser.add_argument("--quorum-timeout", type=float, default=d.quorum_timeout_s, help=quorum)
    parser.add_argument(
        "--seed", default="0", help="draws the faults' kinds and victims; several (1,2,3): one run with faults each"
    )
    parser.add_argument(
        "--lighthouse-restart-at",
        type=float,
        default=None,
        help="kill the Lighthouse this many seconds in, restart it 3 s later",
    )
    parser.add_argument("--out", default=None, help="write chaos.json and chaos.png there")


def run(args: argparse.Namespace) -> int:
    faults = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    bad = [k for k in faults if k not in KINDS]
    if bad or not faults:
        raise ValueError(f"--faults {args.faults!r}: use some of {','.join(KINDS)}")
    seeds = [int(x) for x in str(args.seed).split(",") if x.strip()]
    if not seeds:
        raise ValueError(f"--seed {args.seed!r}: give an int, or several separated by commas")
    if args.nodes < 3:
        raise ValueError(f"--nodes {args.nodes}: a chaos run needs at least 3 nodes (survivors to heal from)")
    cfg = ChaosConfig(
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        frontend="fsdp" if args.procs_per_node > 1 else "ddp",
        period=args.period,
        fwd_ms=args.step_ms / 3,
        bwd_ms=2 * args.step_ms / 3,
        seconds=60 * args.minutes,
        fault_every=args.fault_every,
        restart_after=args.restart_after,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        join_timeout_ms=args.join_timeout_ms,
        timeout_s=args.rail_timeout,
        quorum_timeout_s=args.quorum_timeout,
        faults=faults,
        pace=args.pace,
        seed=seeds[0],
        lighthouse_restart_at=args.lighthouse_restart_at,
    )
    if "partition" in faults and not can_partition():
        logger.warning("chaos: 'partition' needs root and iptables (apt-get install iptables): left out of this run")
    out = Path(args.out) if args.out else None
    with signals_raise():
        runs = run_chaos(cfg, logs=out / "logs" if out else None, seeds=seeds)
    for analysis, faulted, _ in runs:
        print(report(analysis, ChaosConfig(**{**asdict(cfg), "seed": faulted.seed, "faults": cfg.faults})))
    if len(runs) > 1:
        print(f"{settings(cfg)}:")
        print(table([a for a, _, _ in runs], seeds))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        blob = {
            "config": asdict(cfg),
            "reference_curve": reference_curve(runs[0][2], cfg.period)[0],
            "runs": [
                {"seed": seed, "analysis": a, "faults": f.faults, "events": [asdict(e) for e in f.events]}
                for seed, (a, f, _) in zip(seeds, runs)
            ],
        }
        (out / "chaos.json").write_text(json.dumps(blob, indent=1))
        for seed, (_, f, _) in zip(seeds, runs):
            plot(f, ChaosConfig(**{**asdict(cfg), "seed": seed, "faults": cfg.faults}), out / f"chaos-seed{seed}.png")
        print(f"wrote {out / 'chaos.json'} and a plot per seed there")
    return 0 if not any(a["violations"] or a["errors"] for a, _, _ in runs) else 1
