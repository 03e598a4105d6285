"""The manager mode (hiersync.ft) on torchft, CPU gloo: nodes die, freeze and come back.

Each test starts its own Lighthouse (port 0) and nodes (FileStore rendezvous, ports the OS
picks) and always stops all of them (hiersync.tools.ft_nodes). Every distributed check is
against a reference run in this process of the surviving nodes' local SGD on the same data
(ft_ranks.reference), with fp32 tolerances (the rail sums in another order).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchft")

import ft_ranks

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
