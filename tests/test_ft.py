"""The manager mode (hiersync.ft) on torchft, CPU gloo: nodes die, freeze and come back.

Each test starts its own Lighthouse (port 0) and nodes (FileStore rendezvous, ports the OS
picks) and always stops all of them (hiersync.tools.ft_nodes). Every distributed check is
against a reference run in this process of the surviving nodes' local SGD on the same data
(ft_ranks.reference), with fp32 tolerances (the rail sums in another order).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust side reads it once, at import
pytest.importorskip("torchft")

import ft_ranks
from harness import nccl_mode  # noqa: F401  (a fixture, used by name)

from hiersync.tools.ft_nodes import Lighthouse, Nodes

TOL = dict(rtol=1e-5, atol=1e-6)


def _cfg(tmp_path, nodes: int, **kw):
    cfg = {"steps": 12, "nodes": nodes, "start_barrier": str(tmp_path / "start"), "timeout_s": 10.0}
    cfg.update(kw)
    return cfg


def _by_step(result) -> dict[int, torch.Tensor]:
    return {s: p for s, p, _ in result["records"]}


def test_no_failure_equals_reference(tmp_path):
    """Nothing fails: three nodes of one rank train exactly like three-node local SGD (period 2)."""
    cfg = _cfg(tmp_path, 3, options={"period": 2})
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        out = nodes.wait([0, 1, 2], timeout=120)
    ref = ft_ranks.reference(cfg, 3, 1, lambda s: [0, 1, 2])
    for n in range(3):
        got = _by_step(out[n][0])
        for s in range(cfg["steps"]):
            torch.testing.assert_close(got[s], ref[n][s], **TOL, msg=f"node {n} step {s}")
        assert out[n][0]["stats"]["failed_syncs"] == 0
        assert not out[n][0]["warnings"], out[n][0]["warnings"]  # a job's first nodes have nothing to warn about


def _first_sync_of_joiner(result, schedule) -> tuple[int, torch.Tensor]:
    """(step, parameters) right after the restarted node's first sync."""
    first = result["first"]
    if first > 0 and schedule.kind(first - 1) == "sync":
        return first - 1, result["joined"]  # healed into that sync's quorum: it ran inside register()
    for s, p, _ in result["records"]:
        if schedule.kind(s) == "sync":
            return s, p
    raise AssertionError("the restarted node never synced")


def test_node_killed_at_local_step_survivors_go_on_and_it_rejoins(tmp_path):
    """Node 2 dies at a local step: nodes 0 and 1 finish with 2-node local SGD; node 2, restarted,
    equals them after its first sync."""
    from hiersync.schedule import Schedule

    kill_at = 4  # a local step (syncs after steps 1, 3, 5, ...)
    cfg = _cfg(
        tmp_path, 3, steps=40, step_sleep=0.05, options={"period": 2}, kill={"node": 2, "step": kill_at, "how": "local"}
    )
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        nodes.wait_step(0, kill_at + 2, timeout=60)
        nodes.wait_step(1, kill_at + 2, timeout=60)
        restart = dict(cfg, start_barrier=None, kill={})
        nodes.start(2, ft_ranks.train, (restart,))
        out = nodes.wait([0, 1, 2], timeout=120)
    joiner = out[2][0]
    assert joiner["first"] > kill_at + 2 and joiner["stats"]["heals"] == 1
    rejoined = joiner["first"] - 1
    ref = ft_ranks.reference(cfg, 3, 1, lambda s: [0, 1, 2] if s < kill_at else [0, 1])
    for n in (0, 1):
        got = _by_step(out[n][0])
        for s in range(rejoined):
            torch.testing.assert_close(got[s], ref[n][s], **TOL, msg=f"survivor {n} step {s}")
        assert out[n][0]["stats"]["failed_syncs"] == 0
    step, params = _first_sync_of_joiner(joiner, Schedule(period=2))
    for n in (0, 1):
        torch.testing.assert_close(params, _by_step(out[n][0])[step], **TOL, msg=f"joiner vs node {n}")


def test_node_killed_with_sync_in_flight(tmp_path):
    """Node 2 dies right after joining the quorum of an overlapped sync (outer Nesterov step): the
    survivors drop that sync (correction never applied, anchor and momentum restored) and go on."""
    opts = {"period": 4, "overlap": 1, "outer_lr": 0.7, "outer_momentum": 0.9}
    kill = {"node": 2, "step": 4, "how": "in_flight"}  # dies in the sync after step 7
    cfg = _cfg(tmp_path, 3, steps=16, options=opts, kill=kill)
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        out = nodes.wait([0, 1], timeout=120)
    ref = ft_ranks.reference(cfg, 3, 1, lambda s: [0, 1, 2] if s <= 7 else [0, 1], dropped={7})
    for n in (0, 1):
        got = _by_step(out[n][0])
        for s in range(cfg["steps"]):
            torch.testing.assert_close(got[s], ref[n][s], **TOL, msg=f"survivor {n} step {s}")
        stats = out[n][0]["stats"]
        assert stats["failed_syncs"] == 1 and stats["sync_participants"] == 2


@pytest.mark.parametrize("victim", [1, 3])
def test_a_death_inside_a_window_reaches_every_survivor_at_once(tmp_path, victim):
    """Four nodes; one dies inside a sync's data, after the barrier. The survivors whose connection
    to it breaks fail at once; without more, a survivor waiting on one of them (a live peer that
    left the collective) would wait the rail's timeout (120 s) while the Lighthouse held the others'
    next quorum for it. Each survivor that fails drops the window's group, which closes its
    connections: every survivor drops that sync on a closed connection, none on a timeout, and
    they go on as 3-node local SGD."""
    rail_s = 120.0
    kill = {"node": victim, "step": 4, "how": "in_flight"}  # dies in the sync after step 5
    cfg = _cfg(tmp_path, 4, steps=12, options={"period": 2, "heartbeat_timeout": 2.0}, kill=kill, timeout_s=rail_s)
    survivors = [n for n in range(4) if n != victim]
    with (
        Lighthouse(min_replicas=1, heartbeat_timeout_ms=2000, join_timeout_ms=60000) as lh,
        Nodes(lh.address, procs_per_node=1) as nodes,
    ):
        for n in range(4):
            nodes.start(n, ft_ranks.train, (cfg,))
        out = nodes.wait(survivors, timeout=rail_s / 2)  # waiting out the rail's timeout would not finish
    ref = ft_ranks.reference(cfg, 4, 1, lambda s: [0, 1, 2, 3] if s <= 5 else survivors, dropped={5})
    for n in survivors:
        got = _by_step(out[n][0])
        for s in range(cfg["steps"]):
            torch.testing.assert_close(got[s], ref[n][s], **TOL, msg=f"survivor {n} step {s}")
        assert out[n][0]["stats"]["failed_syncs"] == 1, out[n][0]["stats"]
        dropped = [w for w in out[n][0]["warnings"] if "after step 5 did not commit" in w]
        assert len(dropped) == 1 and "Connection" in dropped[0] and "Timed out" not in dropped[0], dropped


def test_frozen_node_is_dropped_after_the_timeout(tmp_path):
    """Node 2 freezes (SIGSTOP) inside a sync: the survivors wait for the rail's timeout, drop that
    sync and finish without it; their parameters follow 2-node local SGD."""
    timeout_s = 3.0
    kill = {"node": 2, "step": 4, "how": "freeze_in_flight"}  # freezes in the sync after step 5
    cfg = _cfg(tmp_path, 3, steps=12, options={"period": 2}, kill=kill, timeout_s=timeout_s)
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        out = nodes.wait([0, 1], timeout=120)
    ref = ft_ranks.reference(cfg, 3, 1, lambda s: [0, 1, 2] if s <= 5 else [0, 1], dropped={5})
    for n in (0, 1):
        got = _by_step(out[n][0])
        for s in range(cfg["steps"]):
            torch.testing.assert_close(got[s], ref[n][s], **TOL, msg=f"survivor {n} step {s}")
        assert out[n][0]["stats"]["failed_syncs"] == 1, out[n][0]["stats"]
        # the sync was given up on the rail's timeout: the one warning names it
        dropped = [w for w in out[n][0]["warnings"] if "after step 5 did not commit" in w]
        assert len(dropped) == 1 and f"{timeout_s * 1000:.0f}ms" in dropped[0], out[n][0]["warnings"]


@pytest.mark.parametrize("victim", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_a_quorum_holding_a_dead_member_costs_the_heartbeat_not_the_rail_timeout(tmp_path, victim):
    """A node dies at step 2 and its restart dies 0.5 s after asking for its first quorum; its peers,
    held until it asked, ask 1.5 s after it, before its heartbeat (3 s) expires. So torchft's new quorum
    holds a dead member, and configuring its group (node 0 dead: the group's store; node 2 dead: the
    rendezvous) fails after the contact bound (``heartbeat_timeout``, 3 s), not after the Manager's
    120 s: the survivors drop that one sync and go on as 2-node local SGD."""
    rail_s, heartbeat_s, kill_at, hold_at = 120.0, 3.0, 2, 9
    asked = str(tmp_path / "restart-asked")
    opts = {"period": 2, "heartbeat_timeout": heartbeat_s}
    cfg = _cfg(tmp_path, 3, steps=14, step_sleep=0.05, options=opts, timeout_s=rail_s)
    cfg.update(
        kill={"node": victim, "step": kill_at, "how": "local"}, hold={"step": hold_at, "path": asked, "then": 1.5}
    )
    survivors = [n for n in range(3) if n != victim]
    with (
        Lighthouse(min_replicas=1, heartbeat_timeout_ms=int(heartbeat_s * 1000), join_timeout_ms=60000) as lh,
        Nodes(lh.address, procs_per_node=1) as nodes,
    ):
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        for n in survivors:
            nodes.wait_step(n, kill_at + 2, timeout=60)
        doomed = dict(cfg, start_barrier=None, hold=None, announce=asked, kill={"node": victim, "how": "first_quorum"})
        nodes.start(victim, ft_ranks.train, (doomed,))
        out = nodes.wait(survivors, timeout=rail_s / 2)  # waiting out the rail's timeout would not finish
    dropped_at = hold_at if hold_at % 2 else hold_at + 1  # the sync after the step the survivors were held at
    ref = ft_ranks.reference(cfg, 3, 1, lambda s: [0, 1, 2] if s < kill_at else survivors, dropped={dropped_at})
    for n in survivors:
        got = _by_step(out[n][0])
        for s in range(cfg["steps"]):
            torch.testing.assert_close(got[s], ref[n][s], **TOL, msg=f"survivor {n} step {s}")
        stats = out[n][0]["stats"]
        assert stats["failed_syncs"] == 1 and stats["sync_participants"] == 2, stats
        dropped = [w for w in out[n][0]["warnings"] if f"after step {dropped_at} did not commit" in w]
        # the contact bound (3000ms), or a peer that hit it first and dropped the group; not 120 s
        assert len(dropped) == 1 and ("3000ms" in dropped[0] or "Connection closed" in dropped[0]), dropped
        assert "120000ms" not in dropped[0], dropped


@pytest.mark.parametrize("frontend", ["ddp", "fsdp"])
def test_two_nodes_of_two_ranks_lose_one_and_get_it_back(tmp_path, frontend):
    """2 nodes x 2 ranks: node 1 dies at a local step, node 0 trains on alone (its own local steps),
    node 1 restarted joins, is healed rank by rank (FSDP2: each rank its own shard, from the peer
    rank that holds it) and equals node 0 after its first sync."""
    from hiersync.schedule import Schedule

    kill_at = 6
    cfg = _cfg(
        tmp_path, 2, steps=36, step_sleep=0.05, options={"period": 4}, kill={"node": 1, "step": kill_at, "how": "local"}
    )
    cfg.update(frontend=frontend, final_synchronize=True, dcp_dir=str(tmp_path / "dcp") if frontend == "fsdp" else None)
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=2) as nodes:
        for n in range(2):
            nodes.start(n, ft_ranks.train, (cfg,))
        nodes.wait_step(0, kill_at + 2, timeout=60)
        nodes.start(1, ft_ranks.train, (dict(cfg, start_barrier=None, kill={}),))
        out = nodes.wait([0, 1], timeout=120)
    joiner = out[1]
    assert joiner[0]["first"] > kill_at and joiner[0]["stats"]["heals"] >= 1
    ref = ft_ranks.reference(cfg, 2, 2, lambda s: [0, 1] if s < kill_at else [0])
    got = [_by_step(r) for r in out[0]]
    for s in range(joiner[0]["first"] - 1):
        for r in range(2):
            torch.testing.assert_close(got[r][s], ref[0][s], **TOL, msg=f"node 0 rank {r} step {s}")
    step, params = _first_sync_of_joiner(joiner[0], Schedule(period=4))
    _, params1 = _first_sync_of_joiner(joiner[1], Schedule(period=4))
    torch.testing.assert_close(params, params1, rtol=0, atol=0)  # the node's ranks agree bit for bit
    torch.testing.assert_close(params, got[0][step], **TOL)
    finals = [r["final"] for r in out[0] + joiner]  # synchronize() in a window: every rank of both nodes
    assert all(torch.equal(f, finals[0]) for f in finals)
    if frontend == "fsdp":  # each node's portable copy (torch.distributed.checkpoint) loads back equal
        assert all(r["portable"] for r in out[0] + joiner)


def _restart_after_death(nodes: Nodes, node: int, delay: float, fn, cfg) -> None:
    """Start ``node`` again ``delay`` s after every rank of its first incarnation is gone."""
    while any(p.exitcode is None for p in nodes.nodes[node].procs):
        nodes._raise_failed()
        time.sleep(0.02)
    time.sleep(delay)
    nodes.start(node, fn, (cfg,))


def _check_joiner_equals_survivors(out, joiner_first: int, steps: int, exact_syncs: bool) -> None:
    """From its first sync on the joiner is one of them: equal after every blocking sync, the same
    final step, and after the final synchronize() every node holds the same parameters."""
    from hiersync.schedule import Schedule

    joiner = out[2][0]
    if exact_syncs:
        step, params = _first_sync_of_joiner(joiner, Schedule(period=2))
        assert step == joiner_first - 1, (step, joiner_first)  # healed into that sync (or synchronize) in register()
        for n in (0, 1):
            torch.testing.assert_close(params, _by_step(out[n][0])[step], **TOL, msg=f"first sync: joiner vs node {n}")
            for s, p, _ in joiner["records"]:
                if Schedule(period=2).kind(s) == "sync":
                    torch.testing.assert_close(p, _by_step(out[n][0])[s], **TOL, msg=f"step {s}: joiner vs node {n}")
    for n in (0, 1, 2):
        assert out[n][0]["last_step"] == steps, (n, out[n][0]["last_step"])
        torch.testing.assert_close(out[n][0]["final"], out[0][0]["final"], rtol=0, atol=0, msg=f"node {n} final")


def _heal_reference(cfg, out, kill_at: int, joined_at: int):
    """The in-process local SGD of the nodes that bring their own state: 3 nodes until ``kill_at``,
    nodes 0 and 1 up to the sync after ``joined_at - 1`` (node 2, healed in its quorum, adds nothing
    to it and leaves it a copy of its source), all three after it."""
    joiner = out[2][0]
    src = next(n for n in (0, 1) if torch.equal(_by_step(out[n][0])[joined_at - 1], joiner["joined"]))
    members = lambda s: [0, 1, 2] if s < kill_at or s >= joined_at else [0, 1]
    return ft_ranks.reference(cfg, 3, 1, members, heals={2: (joined_at - 1, src)})


HEALS = {
    # DDP, blocking syncs of the whole model (period 2)
    "ddp-blocking": ("ddp", {"period": 2}, {}, TOL),
    # DDP, streaming: a fragment syncs after every step, overlapped, with DiLoCo's outer step
    "ddp-streaming-outer": (
        "ddp",
        {"period": 4, "fragments": 4, "overlap": 1, "outer_lr": 0.7, "outer_momentum": 0.9},
        {},
        TOL,
    ),
    # FSDP2 over each node, int4 deltas with error feedback, against the fp32 reference within the
    # codes' error (at most 0.02 here at any step); nodes 0 and 1 drift apart (shifted targets), so
    # that counting the healed copy twice moves the survivors by 0.056 at the heal
    "fsdp-int4": ("fsdp", {"period": 2, "compress": "int4"}, {"shift": 1.0}, dict(rtol=0, atol=0.03)),
    # FSDP2, streaming int4 deltas, overlapped, with the outer step
    "fsdp-streaming-int4-outer": (
        "fsdp",
        {"period": 4, "fragments": 4, "overlap": 1, "compress": "int4", "outer_lr": 0.7, "outer_momentum": 0.9},
        {"shift": 1.0},
        dict(rtol=0, atol=0.03),
    ),
}


@pytest.mark.parametrize(
    "case, hold_at",
    [
        ("ddp-blocking", 10),
        pytest.param("ddp-streaming-outer", 10, marks=pytest.mark.slow),
        pytest.param("fsdp-int4", 10, marks=pytest.mark.slow),
        pytest.param("fsdp-streaming-int4-outer", 10, marks=pytest.mark.slow),
        pytest.param("ddp-blocking", 15, marks=pytest.mark.slow),
    ],
    ids=["ddp-blocking", "ddp-streaming-outer", "fsdp-int4", "fsdp-streaming-int4-outer", "ddp-blocking-last-step"],
)
def test_restarted_node_heals_at_its_first_quorum(tmp_path, case, hold_at):
    """A user's kill and restart: 3 nodes x 1 rank, 16 steps, node 2 SIGKILLed after step 5 and started
    again 3 s later as a fresh process (its own initial model) while the survivors still train (they
    wait at step ``hold_at`` until it is up, so a slow start cannot make them finish first). At its first
    quorum, inside ``register``, it takes a live peer's parameters and step. The window it was healed
    in is the survivors' own: every node, at every step, follows the local SGD of the nodes that brought
    their own state (the healed copy counted once, not twice), and the joiner finishes at their step."""
    frontend, options, extra, tol = HEALS[case]
    kill_at = 6  # dies before step 6: after step 5 and its sync
    up = str(tmp_path / "restarted-node-is-up")
    cfg = _cfg(
        tmp_path,
        3,
        steps=16,
        step_sleep=0.2,
        options=options,
        frontend=frontend,
        kill={"node": 2, "step": kill_at, "how": "local"},
        hold={"step": hold_at, "path": up},
        final_synchronize=True,
        **extra,
    )
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        restart = dict(cfg, start_barrier=None, kill={}, hold=None, announce=up)
        _restart_after_death(nodes, 2, 3.0, ft_ranks.train, restart)
        out = nodes.wait([0, 1, 2], timeout=120)
    joiner = out[2][0]
    joined_at = joiner["first"]  # healed into the survivors' sync after the step before it
    assert joiner["stats"]["heals"] == 1 and kill_at < joined_at <= 16, joined_at
    ref = _heal_reference(cfg, out, kill_at, joined_at)
    for n in (0, 1, 2):
        got = _by_step(out[n][0])
        for s in sorted(got):
            torch.testing.assert_close(got[s], ref[n][s], **tol, msg=f"node {n} step {s} (joined at {joined_at})")
    for n in (0, 1, 2):
        assert out[n][0]["last_step"] == 16, (n, out[n][0]["last_step"])
        torch.testing.assert_close(out[n][0]["final"], out[0][0]["final"], rtol=0, atol=0, msg=f"node {n} final")
    assert any(f"state.step = {joined_at}" in w for w in joiner["warnings"]), joiner["warnings"]
    assert not any("no live peer" in w for n in range(3) for w in out[n][0]["warnings"])


@pytest.mark.parametrize("case", ["ddp-blocking", pytest.param("fsdp-int4", marks=pytest.mark.slow)])
def test_node_frozen_past_the_timeout_heals_at_a_later_quorum(tmp_path, case):
    """Node 2 is frozen (SIGSTOP) at a local step, past the Lighthouse's heartbeat timeout: the survivors
    drop it and sync on. Thawed (SIGCONT), it finishes its local steps and asks for its next quorum with
    a stale state; torchft heals it there from a live peer, in the survivors' sync. That window is the
    survivors' own (the stale node and the healed copy bring nothing), and every node follows the local
    SGD of the nodes that brought their own state; the thawed node never syncs its stale parameters."""
    frontend, options, extra, tol = HEALS[case]
    freeze_after = 5  # after step 5 and its sync: a local step
    cfg = _cfg(tmp_path, 3, steps=24, step_sleep=0.2, options=options, frontend=frontend, **extra)
    with Lighthouse(min_replicas=1, heartbeat_timeout_ms=1000) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        nodes.wait_step(2, freeze_after, timeout=60)
        nodes.freeze(2)
        nodes.wait_step(0, freeze_after + 6, timeout=60)  # >= 1.2 s frozen: dropped, the survivors sync on
        nodes._signal(2, signal.SIGCONT)
        out = nodes.wait([0, 1, 2], timeout=120)
    thawed = out[2][0]
    steps = [s for s, _, _ in thawed["records"]]
    # its last own step (the quorum of its next sync healed it), then its peers' steps from the heal on
    stale = next(s for s in steps if s > freeze_after and s + 1 not in steps)
    healed_at = steps[steps.index(stale) + 1]
    assert any(f"it resumes at the sync after step {healed_at - 1}" in w for w in thawed["warnings"]), thawed
    assert healed_at > freeze_after + 6, steps
    src = next(n for n in (0, 1) if torch.equal(_by_step(out[n][0])[healed_at - 1], _by_step(thawed)[stale]))
    members = lambda s: [0, 1, 2] if s <= freeze_after or s >= healed_at else [0, 1]
    ref = ft_ranks.reference(cfg, 3, 1, members, heals={2: (healed_at - 1, src)})
    for n in (0, 1, 2):
        got = _by_step(out[n][0])
        for s in sorted(got):
            if n == 2 and freeze_after < s < healed_at:  # its own steps while the others had moved on
                continue
            torch.testing.assert_close(got[s], ref[n][s], **tol, msg=f"node {n} step {s} (healed at {healed_at})")
        assert out[n][0]["last_step"] == 24


@pytest.mark.parametrize(
    "options",
    [{"period": 2}, pytest.param({"period": 4, "fragments": 4, "overlap": 1}, marks=pytest.mark.slow)],
    ids=["period2", "streaming-overlapped"],
)
def test_node_restarted_while_survivors_are_mid_sync_joins_that_sync(tmp_path, options):
    """torchft's default Lighthouse (a node is dead after 5 s without a heartbeat): node 2 dies after
    step 5; the survivors' next sync waits in its quorum for the Lighthouse to declare it dead, and node
    2, restarted 1 s after its death, asks for its first quorum inside that wait. It joins that very sync
    (healed from a live peer; with streaming, an overlapped sync of one fragment), resumes at the step
    after it, and finishes at the survivors' step with their parameters."""
    from hiersync.schedule import Schedule

    kill_at = 6
    cfg = _cfg(
        tmp_path,
        3,
        steps=16,
        step_sleep=0.05,
        options=options,
        kill={"node": 2, "step": kill_at, "how": "local"},
        final_synchronize=True,
    )
    with (
        Lighthouse(min_replicas=1, heartbeat_timeout_ms=5000, join_timeout_ms=60000) as lh,
        Nodes(lh.address, procs_per_node=1) as nodes,
    ):
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        _restart_after_death(nodes, 2, 1.0, ft_ranks.train, dict(cfg, start_barrier=None, kill={}))
        out = nodes.wait([0, 1, 2], timeout=120)
    # Every sync the survivors committed had the three nodes: the one after the death waited for
    # node 2 instead of going on without it, and node 2 resumes at the step after that sync.
    joiner = out[2][0]
    for n in (0, 1):
        assert out[n][0]["stats"]["failed_syncs"] == 0, out[n][0]["stats"]
        assert {p for s, _, p in out[n][0]["records"] if s >= kill_at} == {3}, out[n][0]["records"]
    assert joiner["stats"]["heals"] == 1 and joiner["first"] > kill_at, joiner["first"]
    schedule = Schedule(period=options["period"], fragments=options.get("fragments", 1))
    first_sync = next(s for s in range(kill_at, cfg["steps"]) if schedule.is_sync(s))
    assert joiner["first"] == first_sync + 1, (joiner["first"], first_sync)
    _check_joiner_equals_survivors(out, joiner["first"], 16, exact_syncs=not options.get("overlap"))
    assert not any("no live peer" in w for n in range(3) for w in out[n][0]["warnings"])


def test_restarted_node_with_no_live_peer_says_so(tmp_path):
    """Node 2 is restarted only after the survivors finished: there is nobody to heal from. It forms a
    quorum alone and trains from its own state; it must say so, not pass for a member of the run."""
    cfg = _cfg(tmp_path, 3, steps=6, options={"period": 2}, kill={"node": 2, "step": 2, "how": "local"})
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        survivors = nodes.wait([0, 1], timeout=120)
        nodes.start(2, ft_ranks.train, (dict(cfg, start_barrier=None, kill={}),))
        out = nodes.wait([2], timeout=120)
    joiner = out[2][0]
    assert joiner["stats"]["heals"] == 0 and joiner["first"] == 0
    assert any("no live peer to heal from" in w for w in joiner["warnings"]), joiner["warnings"]
    assert not any("no live peer" in w for n in (0, 1) for w in survivors[n][0]["warnings"])


def test_unreachable_lighthouse_is_a_clear_error(tmp_path):
    """The Lighthouse is gone when a node asks for its first quorum: hiersync says what to check."""
    flag = tmp_path / "lighthouse-down"
    cfg = _cfg(tmp_path, 1, register_after=str(flag), start_barrier=None, quorum_timeout_s=3.0)
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        nodes.start(0, ft_ranks.train, (cfg,))
        nodes.wait_step(0, -1, timeout=60)
        lh.shutdown()
        flag.touch()
        out = nodes.wait([0], timeout=60)
    err = out[0][0]["error"]
    assert err is not None and "could not form a quorum" in err and "Lighthouse" in err, err


OPTIONS = {
    # warmup (exact steps over the quorum), streaming, overlap, 16-bit deltas, outer Nesterov, a checkpoint
    # round trip with a sync in flight, Adam; 2 nodes x 2 ranks
    "2x2-warmup-fragments-bf16-outer": (
        2,
        {
            "period": 4,
            "warmup_steps": 2,
            "fragments": 2,
            "overlap": 1,
            "compress": "bf16",
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
        },
        {"adam": True, "checkpoint_at": 7},
    ),
    # several fragments in flight at once (overlap 3 > period / fragments), fp16; 2 nodes x 1 rank
    "2x1-overlap3-fragments4-fp16": (1, {"period": 4, "fragments": 4, "overlap": 3, "compress": "fp16"}, {}),
    # the outer step by torch's Adam (outer_optimizer=), its state through a checkpoint with a sync in flight
    "2x1-outer-optimizer-adam": (
        1,
        {"period": 4, "fragments": 2, "overlap": 1, "outer_optimizer": "adam"},
        {"checkpoint_at": 7},
    ),
}


@pytest.mark.usefixtures("nccl_mode")
@pytest.mark.parametrize("case", list(OPTIONS))
def test_options_match_the_plain_mode(tmp_path, case):
    """With nothing failing, the manager mode trains exactly as hiersync's plain mode on the same
    nodes, whatever the options (period, warmup, fragments, overlap, compress, outer step, checkpoints)."""
    from harness import launch

    ranks, options, extra = OPTIONS[case]
    cfg = _cfg(tmp_path, 2, steps=14, options=options, **extra)
    plain = launch(ft_ranks.train_plain, [0] * ranks + [1] * ranks, cfg, timeout=120)
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=ranks) as nodes:
        for n in range(2):
            nodes.start(n, ft_ranks.train, (cfg,))
        out = nodes.wait([0, 1], timeout=120)
    for n in range(2):
        for r in range(ranks):
            got = _by_step(out[n][r])
            for s in range(cfg["steps"]):
                torch.testing.assert_close(got[s], plain[n * ranks + r][s], **TOL, msg=f"node {n} rank {r} step {s}")


def test_joiner_healed_from_two_peers_is_one_node(tmp_path):
    """3 nodes x 2 ranks, Adam: torchft heals the joiner's rank 0 from one live node and rank 1 from
    the other; hiersync makes the node one copy (parameters and Adam state) before it trains on."""
    from hiersync.schedule import Schedule

    kill_at = 6
    kill = {"node": 2, "step": kill_at, "how": "local"}
    cfg = _cfg(tmp_path, 3, steps=32, step_sleep=0.05, adam=True, options={"period": 4}, kill=kill)
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=2) as nodes:
        for n in range(3):
            nodes.start(n, ft_ranks.train, (cfg,))
        nodes.wait_step(0, kill_at + 2, timeout=90)
        nodes.start(2, ft_ranks.train, (dict(cfg, start_barrier=None, kill={}),))
        out = nodes.wait([0, 1, 2], timeout=180)
    joiner = out[2]
    assert joiner[0]["first"] > kill_at and joiner[0]["stats"]["heals"] >= 1
    r0, r1 = _by_step(joiner[0]), _by_step(joiner[1])
    assert r0.keys() == r1.keys() and r0
    for s in r0:  # Adam states that differed would split the node's ranks at the next step
        torch.testing.assert_close(r0[s], r1[s], rtol=0, atol=0, msg=f"joiner's ranks at step {s}")
    step, params = _first_sync_of_joiner(joiner[0], Schedule(period=4))
    for n in (0, 1):
        torch.testing.assert_close(params, _by_step(out[n][0])[step], **TOL, msg=f"joiner vs node {n}")


@pytest.mark.slow
def test_ft_testbed_kills_and_restarts_a_node_of_the_example(tmp_path):
    """python -m hiersync ft-testbed on examples/lm_torchft.py: 3 torchruns, node 2 killed at step 6 and
    restarted; the survivors finish, node 2 rejoins at a later step, every node ends at the same loss."""
    from pathlib import Path

    from hiersync.tools.ft_testbed import FTTestbed, report, run_job, summarize

    root = Path(__file__).resolve().parents[1]
    script = [str(root / "examples" / "lm_torchft.py")]
    args = ["--steps", "40", "--text-mb", "0.2", "--batch-size", "4", "--dim", "32", "--layers", "1"]
    args += ["--eval-batches", "2", "--period", "4", "--step-sleep", "0.3", "--timeout", "10"]
    with FTTestbed(3, 1, script + args, heartbeat_timeout_ms=1000, log_dir=str(tmp_path)) as tb:
        run_job(tb, [(2, 6)], restart_after=0.5, timeout=400)
        summary = summarize(tb, 5)
    text = report(summary)
    runs = summary["nodes"]
    assert runs["2.1"]["killed_at"] is not None and runs["2.2"]["first_step"] > 6, text
    assert summary["events"][0]["survivors"].keys() == {0, 1}, text
    finals = {name: r["final_val_loss"] for name, r in runs.items() if name != "2.1"}
    assert all(v is not None for v in finals.values()) and len(set(finals.values())) == 1, text
    assert "healed from a live peer" in text, text


@pytest.mark.parametrize(
    "frontend, nodes, ranks",
    [("ddp", 3, 1), pytest.param("fsdp", 2, 2, marks=pytest.mark.slow)],
    ids=["ddp-3x1", "fsdp-2x2"],
)
def test_a_dropped_int4_window_leaves_state_as_if_never_launched(tmp_path, frontend, nodes, ranks):
    """int4 deltas with error feedback, AdamW's exp_avg averaged, overlapped: the last node dies
    inside the sync after step 7 and the survivors drop that window. Their parameters, exp_avg
    and both error-feedback residuals at the end equal a run in which no node launched that
    sync (and the last node left after step 7)."""
    options = {"period": 2, "overlap": 1, "compress": "int4", "average_optimizer_state": ("exp_avg",)}
    cfg = {"frontend": frontend, "nodes": nodes, "steps": 12, "at": 7, "options": options}
    out = {}
    for how in ("kill", "skip"):
        with Lighthouse(min_replicas=1, heartbeat_timeout_ms=500) as lh, Nodes(lh.address, ranks) as group:
            for n in range(nodes):
                group.start(n, ft_ranks.train_window_dropped, (dict(cfg, how=how),))
            out[how] = group.wait(list(range(nodes - 1)), timeout=120)
    for n in range(nodes - 1):
        for r in range(ranks):
            dropped, never = out["kill"][n][r], out["skip"][n][r]
            assert dropped["stats"]["failed_syncs"] == 1 and never["stats"]["failed_syncs"] == 0
            for key in ("params", "exp_avg"):
                torch.testing.assert_close(dropped[key], never[key], **TOL, msg=f"node {n} rank {r} {key}")
            assert len(dropped["residuals"]) == len(never["residuals"]) > 0
            for a, b in zip(dropped["residuals"], never["residuals"]):
                torch.testing.assert_close(a, b, **TOL)
