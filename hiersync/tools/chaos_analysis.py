"""The analysis of a chaos run (:mod:`hiersync.tools.chaos`): every node's records in, figures and violations out.

Pure: no process, no torch. :func:`analyze` checks the invariants of a run with faults and
measures it against the run without faults (the reference): goodput, stall per fault,
restart to first contributing sync, heals, dropped windows, and the final validation loss
twice: against the reference's final loss (the same step count), and against the
reference's loss at the faulted run's useful work (:func:`reference_curve`,
:func:`loss_at`): the reference records the validation loss of its synchronized model
after every committed sync, so its loss after as many useful node-steps per node as the
faulted run trained is read off that curve, at no extra run. "Nothing lost" (the faulted
run's final loss at most :data:`NOTHING_LOST` above the reference's) is judged on the latter:
the work a fault takes away is charged by goodput, the state a fault could corrupt by this. It
is one-sided: a run with faults can end below the reference at its useful work, since a dead
node's lost steps cost its peers no optimizer step, while a reference stopped that early
stopped every node early (the comparison at the same steps is the strict bound, this the
lenient one; lost state shows above both).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hiersync._table import render

if TYPE_CHECKING:
    from .chaos import ChaosConfig

__all__ = [
    "FAULTS",
    "NOTHING_LOST",
    "Event",
    "RunRecord",
    "analyze",
    "reference_curve",
    "loss_at",
    "report",
    "settings",
    "table",
]

FAULTS = ("kill", "kill-rank", "freeze", "kill-source", "two", "partition")
"""The kinds a run draws from by default."""
KINDS = (*FAULTS, "slow")
"""Every kind: ``slow`` (a node's compute 2-4x slower for :data:`SLOW_S`) is asked for by name."""
SLOW_S = 60.0
NOTHING_LOST = 0.01
"""The goal: a run with faults ends at most 1% above the run without faults at the same useful work."""


@dataclass
class Event:
    t: float
    kind: str
    """``kill``, ``restart``, ``freeze``, ``thaw``, ``error`` or ``note``."""
    node: int
    fault: int = -1
    """Which injected fault it belongs to."""
    detail: str = ""


@dataclass
class RunRecord:
    """What one run left behind: every node's records and the driver's events."""

    steps: int
    started: float
    ended: float
    seed: int = 0
    records: dict[int, list[tuple[float, int, dict[str, str]]]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)


def _incarnations(records: list[tuple[float, int, dict[str, str]]]) -> list[list[tuple[float, int, dict[str, str]]]]:
    """A node's records split by incarnation (each starts with its ``event=up`` record)."""
    out: list[list[tuple[float, int, dict[str, str]]]] = []
    for r in records:
        if r[2].get("event") == "up" or not out:
            out.append([])
        out[-1].append(r)
    return out


def _steps(inc: list[tuple[float, int, dict[str, str]]]) -> list[tuple[float, int, dict[str, str]]]:
    return [r for r in inc if "event" not in r[2]]


def _is_sync(s: int, f: dict[str, str], period: int) -> bool:
    """Whether a step's record ends a window: as the record says (``sync=1``; every node's own
    windows under adaptive pace), else by the fixed schedule."""
    return f["sync"] == "1" if "sync" in f else (s + 1) % period == 0


def _window(s: int, f: dict[str, str]) -> tuple[str, int]:
    """The sync a record's step ended, named alike on every node: its window under adaptive pace
    (each node's steps differ), else its step."""
    return ("window", int(f["w"])) if "w" in f else ("step", s)


def ideal_node_seconds(faulted: RunRecord, nodes: int) -> float:
    """Node-seconds of the run at full speed: a node slowed by ``x`` for ``d`` s could do ``d / x`` s of it."""
    total = nodes * (faulted.ended - faulted.started)
    opened: dict[int, tuple[float, float]] = {}
    for e in sorted(faulted.events, key=lambda e: e.t):
        if e.kind == "slow":
            opened[e.node] = (e.t, float(e.detail))
        elif e.kind == "unslow" and e.node in opened:
            t0, x = opened.pop(e.node)
            total -= (e.t - t0) * (1 - 1 / x)
    for t0, x in opened.values():
        total -= (faulted.ended - t0) * (1 - 1 / x)
    return total


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def reference_curve(reference: RunRecord, period: int) -> tuple[list[tuple[float, float]], float]:
    """The run without faults' validation loss against its work: ``[(steps per node, loss)]`` in
    order, and the largest relative spread between the nodes' values at one sync.

    Each node records ``val=`` (the loss of its model right after the sync) on its sync steps;
    a sync step ``s`` is ``s + 1`` steps per node; a point is the nodes' mean (they hold the
    same model after a committed sync: the spread says how far from that they were). The last
    point is the final loss, after ``synchronize()``, at ``reference.steps``."""
    at: dict[tuple[str, int], list[tuple[int, float]]] = {}  # a sync: (steps, loss) of each node
    for records in reference.records.values():
        for inc in _incarnations(records):
            last_failed = 0
            for _, s, f in _steps(inc):
                failed = int(f.get("failed", 0))
                if _is_sync(s, f, period) and failed == last_failed and "val" in f:
                    at.setdefault(_window(s, f), []).append((s + 1, float(f["val"])))
                last_failed = failed
    final = [r["val_loss"] for r in reference.results.values() if r]
    losses = [[v for _, v in m] for m in at.values()] + ([final] if final else [])
    spread = max((max(v) - min(v)) / max(abs(statistics.mean(v)), 1e-12) for v in losses) if losses else 0.0
    points = sorted((statistics.mean(n for n, _ in m), statistics.mean(v for _, v in m)) for m in at.values())
    if final:  # the last point: after synchronize(), at the steps each node trained (it replaces a sync there)
        end = reference_node_steps(reference) / max(1, len(reference.records))
        points = [p for p in points if p[0] < end] + [(end, statistics.mean(final))]
    return [(float(n), v) for n, v in points], spread


def reference_node_steps(reference: RunRecord) -> int:
    """The steps every node of the run without faults trained (each its own under adaptive pace)."""
    done = [r.get("steps") for r in reference.results.values() if r]
    if done and all(isinstance(n, int) for n in done):
        return int(sum(done))
    return len(reference.records) * reference.steps


def loss_at(curve: list[tuple[float, float]], work: float) -> float | None:
    """The curve's loss at ``work`` steps per node, linear between its points; None outside it."""
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x0 <= work <= x1:
            return y0 + (y1 - y0) * (work - x0) / (x1 - x0)
    if curve and work == curve[-1][0]:
        return curve[-1][1]
    return None


def _relative(value: float | None, reference: float | None) -> float | None:
    return value / reference - 1 if value is not None and reference else None


def analyze(faulted: RunRecord, reference: RunRecord, period: int, nodes: int) -> dict[str, Any]:
    """Invariants and figures of a chaos run against its run without faults (pure: records in, dict out)."""
    violations: list[str] = []
    # (node, sum, participants, t) of each sync, by (the sync, its quorum)
    sync_groups: dict[tuple[tuple[str, int], str], list[tuple[int, float, int, float]]] = {}
    useful = 0
    firsts: list[dict[str, Any]] = []
    windows_dropped = 0
    heal_s: list[float] = []
    heal_bytes: list[float] = []
    for n, records in faulted.records.items():
        for k, inc in enumerate(_incarnations(records)):
            steps = _steps(inc)
            joined = next((r for r in inc if r[2].get("event") == "joined"), None)
            if k > 0 and joined is not None:
                heal_s.append(float(joined[2].get("heal_s", "nan")))
                heal_bytes.append(float(joined[2].get("heal_bytes", "nan")))
                h, f = joined[1], joined[2]
                if h >= 0 and _is_sync(h, f, period) and f.get("failed", "0") == "0" and "sum" in f:
                    # healed into that sync: a member of its window, with nothing of its own in it
                    group = sync_groups.setdefault((_window(h, f), f.get("q", "?")), [])
                    group.append((n, float(f["sum"]), int(f.get("n", 0)), joined[0]))
            last_failed = 0
            committed_sync_steps = []
            for t, s, f in steps:
                if f.get("nan") == "1":
                    violations.append(f"node {n} step {s}: NaN in the parameters")
                if f.get("canary", "0") != "0":
                    violations.append(f"node {n} step {s}: canary off by {f['canary']} steps")
                failed = int(f.get("failed", 0))
                if _is_sync(s, f, period):
                    if failed == last_failed:
                        group = sync_groups.setdefault((_window(s, f), f.get("q", "?")), [])
                        group.append((n, float(f["sum"]), int(f.get("n", 0)), t))
                        committed_sync_steps.append(s)
                    else:
                        windows_dropped += failed - last_failed
                last_failed = failed
            done = any(r[2].get("event") == "done" for r in inc)
            last_sync = max(committed_sync_steps, default=-1)
            for _, s, _ in steps:
                # a step is useful once a committed sync (or the final synchronize) carried it
                if done or s <= last_sync:
                    useful += 1
            if k > 0 and steps:
                contributing = [r for r in steps if r[1] in committed_sync_steps]
                # from the process start (the driver's restart), not from the rank's first line
                begun = max(
                    (e.t for e in faulted.events if e.kind == "restart" and e.node == n and e.t <= inc[0][0]),
                    default=inc[0][0],
                )
                firsts.append(
                    {
                        "node": n,
                        "incarnation": k + 1,
                        "started": begun,
                        "first_step": steps[0][1],
                        "healed_into": (
                            _window(joined[1], joined[2]),
                            joined[2].get("q", "?"),
                            float(joined[2].get("sum", "nan")),
                        )
                        if joined is not None
                        else None,
                        "first_contributing_sync_s": contributing[0][0] - begun if contributing else None,
                    }
                )
    faults_at = [e.t for e in faulted.events if e.kind in ("kill", "freeze", "partition", "error")]
    for ((unit, s), q), members in sorted(sync_groups.items()):
        sums = [v for _, v, _, _ in members]
        if max(sums) - min(sums) > 1e-6 * max(1.0, max(abs(v) for v in sums)):
            violations.append(f"{unit} {s} quorum {q}: nodes {[m[0] for m in members]} differ after the sync: {sums}")
        expected = max(m[2] for m in members)
        t = members[0][3]
        # every node of a committed sync recorded it, unless a fault took one away right then
        if len(members) < expected and not any(t - 3.0 <= x <= t + 3.0 for x in faults_at):
            who = [m[0] for m in members]
            violations.append(f"{unit} {s} quorum {q}: {expected} nodes synced, only nodes {who} recorded it")
    # a joiner healed in its first quorum holds its peers' step and parameters from its first step on
    healed_at_once = 0
    for fr in firsts:
        if fr["healed_into"] is None:
            continue
        h, q, total = fr["healed_into"]
        if any(m != fr["node"] and v == total for m, v, _, _ in sync_groups.get((h, q), [])):
            healed_at_once += 1
    ref_time = reference.ended - reference.started
    run_time = faulted.ended - faulted.started
    ref_rate = reference_node_steps(reference) / ref_time  # node-steps per second
    ideal = ideal_node_seconds(faulted, nodes)  # the run's node-seconds, less what slow nodes could not do
    goodput = useful / (ideal * ref_rate / nodes)
    typical = statistics.median(
        b[0] - a[0] for recs in reference.records.values() for a, b in zip(_steps(recs), _steps(recs)[1:])
    )
    stalls = []
    per_fault: list[dict[str, Any]] = []
    # A survivor's stall: its longest step from the fault until the next one (20 s at most), within
    # one incarnation (a node killed by a later fault is down, not stalled).
    ends = [f["t"] for f in faulted.faults[1:]] + [math.inf]
    for fault, end in zip(faulted.faults, ends):
        t0, victims = fault["t"], set(fault["nodes"])
        worst = 0.0
        for n, recs in faulted.records.items():
            if n in victims:
                continue
            for inc in _incarnations(recs):
                times = [t for t, _, _ in _steps(inc) if t0 - 5 <= t <= min(t0 + 20, end)]
                gaps = [b - a for a, b in itertools.pairwise(times) if b > t0]
                if gaps:
                    worst = max(worst, max(gaps) - typical)
        stalls.append(worst)
        per_fault.append({"t": t0 - faulted.started, "kind": fault["kind"], "stall_s": worst})
    restart_s = [f["first_contributing_sync_s"] for f in firsts if f["first_contributing_sync_s"] is not None]
    val = [r["val_loss"] for r in faulted.results.values() if r]
    ref_val = [r["val_loss"] for r in reference.results.values() if r]
    errors = [f"node {e.node}: {e.detail}" for e in faulted.events if e.kind == "error"]
    curve, spread = reference_curve(reference, period)
    val_loss = statistics.mean(val) if val else None
    reference_val_loss = statistics.mean(ref_val) if ref_val else None
    matched = loss_at(curve, useful / nodes) if len(curve) > 1 else None
    vs_matched = _relative(val_loss, matched)
    return {
        "goodput": goodput,
        "ideal_node_seconds": ideal,
        "useful_node_steps": useful,
        "seconds": run_time,
        "reference_seconds": ref_time,
        "typical_step_s": typical,
        "faults": len(faulted.faults),
        "fault_kinds": {k: sum(f["kind"] == k for f in faulted.faults) for k in KINDS},
        "stall_s": {"p50": _pct(stalls, 0.5), "p95": _pct(stalls, 0.95)},
        "stall_per_fault": per_fault,
        "restart_to_contributing_sync_s": {
            "p50": _pct(restart_s, 0.5),
            "p95": _pct(restart_s, 0.95),
            "n": len(restart_s),
        },
        "restarts_never_contributing": sum(f["first_contributing_sync_s"] is None for f in firsts),
        "restarts": len(firsts),
        "healed_at_once": healed_at_once,
        "heal_s": {"p50": _pct(heal_s, 0.5), "p95": _pct(heal_s, 0.95)},
        "heal_bytes": _pct(heal_bytes, 0.5),
        "windows_dropped": windows_dropped,
        "syncs_checked": len(sync_groups),
        "val_loss": val_loss,
        "reference_val_loss": reference_val_loss,
        "val_loss_vs_reference": _relative(val_loss, reference_val_loss),
        "useful_steps_per_node": useful / nodes,
        "slowed": sum(f["kind"] == "slow" for f in faulted.faults),
        "reference_steps": reference.steps,
        "reference_curve_points": len(curve),
        "reference_sync_spread": spread,
        "work_matched_val_loss": matched,
        "val_loss_vs_work_matched": vs_matched,
        "nothing_lost": None if vs_matched is None else vs_matched <= NOTHING_LOST,
        "errors": errors,
        "violations": violations,
    }


def report(a: dict[str, Any], cfg: ChaosConfig) -> str:
    def s(v: Any, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    kinds = ", ".join(f"{k} {v}" for k, v in a["fault_kinds"].items() if v)
    lines = [
        f"chaos: {cfg.nodes} nodes x {cfg.procs_per_node} ranks ({cfg.frontend}), period {cfg.period}, "
        f"{cfg.pace} pace, accelerator-"
        f"like steps of {cfg.fwd_ms + cfg.bwd_ms:.0f} ms, a fault every {cfg.fault_every:.0f} s, seed {cfg.seed}",
        f"  settings            {settings(cfg)}",
        f"  faults              {a['faults']} ({kinds or 'none'})",
        f"  goodput             {a['goodput']:.3f} of the run without faults ({a['useful_node_steps']} useful "
        f"node-steps in {a['seconds']:.0f} s; without faults {a['reference_seconds']:.0f} s"
        + (
            f"; its rate taken at each node's speed: {a['ideal_node_seconds']:.0f} node-seconds at full speed of "
            f"{cfg.nodes * a['seconds']:.0f})"
            if a.get("slowed")
            else ")"
        ),
        f"  stall per fault     p50 {s(a['stall_s']['p50'])} s, p95 {s(a['stall_s']['p95'])} s "
        f"(longest step of a survivor, less the typical {a['typical_step_s']:.2f} s)",
        f"  restart -> first contributing sync  p50 {s(a['restart_to_contributing_sync_s']['p50'])} s, "
        f"p95 {s(a['restart_to_contributing_sync_s']['p95'])} s ({a['restart_to_contributing_sync_s']['n']} restarts"
        + (f", {a['restarts_never_contributing']} killed before one" if a["restarts_never_contributing"] else "")
        + f"; {a['healed_at_once']} of {a['restarts']} healed in their first quorum, the others at a later one)",
        f"  heal                p50 {s(a['heal_s']['p50'])} s, p95 {s(a['heal_s']['p95'])} s from the process start, "
        f"{s(a['heal_bytes'], '.0f')} bytes of model and optimizer state",
        f"  windows dropped     {a['windows_dropped']}; {a['syncs_checked']} committed syncs checked",
        f"  final val loss      {s(a['val_loss'], '.5f')}",
        f"    vs no faults (same steps)             {s(a['reference_val_loss'], '.5f')}: "
        f"{s(a['val_loss_vs_reference'], '+.2%')} (the faulted run trained {s(a['useful_steps_per_node'], '.0f')} "
        f"useful steps per node of {a['reference_steps']}: its lost work, charged by goodput)",
        f"    vs no faults at the same useful work  {s(a['work_matched_val_loss'], '.5f')}: "
        f"{s(a['val_loss_vs_work_matched'], '+.2%')} (the run without faults after "
        f"{s(a['useful_steps_per_node'], '.0f')} steps per node, read off its loss after each of its "
        f"{a['reference_curve_points']} syncs; nodes' spread at a sync {a['reference_sync_spread']:.1e})",
        f"  nothing lost        {_verdict(a)}",
        "  invariants          " + ("all held" if not a["violations"] else f"{len(a['violations'])} VIOLATED"),
    ]
    lines += [f"    {v}" for v in a["violations"][:20]]
    lines += [f"  error: {e}" for e in a["errors"][:20]]
    return "\n".join(lines)


def settings(cfg: ChaosConfig) -> str:
    """Every timeout the figures depend on, as the run set them (printed beside each figure)."""
    return (
        f"Lighthouse heartbeat timeout {cfg.heartbeat_timeout_ms} ms and join timeout {cfg.join_timeout_ms} ms; "
        f"Manager and process-group timeout {cfg.timeout_s:g} s; Manager quorum_timeout {cfg.quorum_timeout_s:g} s; "
        "hiersync heartbeat_timeout "
        f"{cfg.heartbeat_timeout_ms / 1000:g} s"
    )


def _verdict(a: dict[str, Any]) -> str:
    """The goal "nothing lost", judged on the loss at the same useful work."""
    if a["nothing_lost"] is None:
        return "not judged: the run without faults recorded no loss after its syncs"
    word = "yes" if a["nothing_lost"] else "NO"
    return (
        f"{word}: the final loss is {a['val_loss_vs_work_matched']:+.2%} from the run without faults at the "
        f"same useful work (the goal: at most {NOTHING_LOST:.0%} above it; below it is no loss)"
    )


def table(analyses: list[dict[str, Any]], seeds: list[int]) -> str:
    """One line per seed: the figures the goals are about (markdown)."""

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    head = [
        "seed",
        "faults",
        "goodput",
        "stall p50 / p95 s",
        "restart -> contributing p50 / p95 s",
        "heal p50 s",
        "windows dropped",
        "val loss vs no faults (same steps)",
        "vs no faults at the same useful work (nothing lost: at most +1%)",
        "invariants",
    ]
    rows = []
    for seed, a in zip(seeds, analyses):
        r = a["restart_to_contributing_sync_s"]
        judged = "" if a["nothing_lost"] is None else " (yes)" if a["nothing_lost"] else " (NO)"
        invariants = "all held" if not a["violations"] else f"{len(a['violations'])} violated"
        rows.append(
            [
                str(seed),
                str(a["faults"]),
                f"{a['goodput']:.3f}",
                f"{f(a['stall_s']['p50'], '.2f')} / {f(a['stall_s']['p95'], '.2f')}",
                f"{f(r['p50'], '.2f')} / {f(r['p95'], '.2f')}",
                f(a["heal_s"]["p50"], ".2f"),
                str(a["windows_dropped"]),
                f(a["val_loss_vs_reference"], "+.2%"),
                f(a["val_loss_vs_work_matched"], "+.2%") + judged,
                invariants + (f", {len(a['errors'])} errors" if a["errors"] else ""),
            ]
        )
    return render(head, rows, align="rrrrrrrrrl", markdown=True)
