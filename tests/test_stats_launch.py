"""Byte accounting against hand-computed values, and the launcher's failure handling."""

from __future__ import annotations

import os

import pytest
import ranks
from harness import TOPOLOGIES, launch

from hiersync.collectives import collective_bytes
from hiersync.tools.launch import RankFailed, run, run_all


def test_collective_bytes_formulas():
    assert collective_bytes("all_reduce", 4, 1000) == 1500  # 2 * 3/4 * 1000
    assert collective_bytes("reduce_scatter", 4, 1000) == 750
    assert collective_bytes("all_gather", 2, 1000) == 500
    assert collective_bytes("broadcast", 1, 1000) == 0


@pytest.mark.parametrize(
    "numel, algorithm, intra, intra_ops, inter",
    [
        # 2x2, fp32, n = 4000 B. rs_ag: RS + AG over L=2 -> 2 * n/2 intra; the rail
        # all-reduce of the n/2 shard over N=2 -> n/2 inter.
        (1000, "rs_ag", 2 * 2000, 2, 2000),
        # 1001 elements are padded to 1002 (divisible by L=2)
        (1001, "rs_ag", 2 * 2004, 2, 2004),
        # allreduce_bcast (gloo's default): all-reduce 2 * n/2, then L broadcasts of n/L, n/2 * n/L each
        (1000, "allreduce_bcast", 4000 + 2 * 1000, 3, 2000),
        (1001, "allreduce_bcast", 4008 + 2 * 1002, 3, 2004),
    ],
)
def test_stats_bytes_2x2(numel, algorithm, intra, intra_ops, inter):
    res = launch(ranks.stats_for_bucket, TOPOLOGIES["2x2"], numel, algorithm)
    for r in res:
        assert r["exact"]["bytes_sent"] == {"intra": intra, "inter": inter}
        assert r["exact"]["collectives"] == {"intra": intra_ops, "inter": 1}
        # local step: one intra all-reduce, 2 (L-1)/L n bytes, nothing across nodes
        assert r["intra"]["bytes_sent"] == {"intra": numel * 4, "inter": 0}


def test_stats_bytes_uneven():
    n = 3000 * 4
    res = launch(ranks.stats_for_bucket, TOPOLOGIES["uneven"], 3000)
    leader, member, alone = res[0], res[1], res[3]
    # node of 3: reduce + broadcast, (L-1)/L n each; leaders all-reduce n over 2 nodes
    assert leader["exact"]["bytes_sent"] == {"intra": 2 * 8000, "inter": n}
    assert member["exact"]["bytes_sent"] == {"intra": 2 * 8000, "inter": 0}
    assert alone["exact"]["bytes_sent"] == {"intra": 0, "inter": n}


def test_launcher_reraises_child_traceback_and_kills_peers():
    with pytest.raises(RankFailed, match="boom from rank 1") as info:
        run(ranks.fail_on_rank, 3, (1,), timeout=600, pg_timeout=300)
    assert info.value.rank == 1 and "ValueError" in info.value.child_traceback
    # the first failure ends the run: the peers, which would sleep an hour, are killed by the launcher
    outs = run_all(ranks.fail_while_peers_sleep, 3, (1,), timeout=3600)
    assert outs[1].exitcode == 1 and "boom from rank 1" in (outs[1].error or "")
    assert [(outs[r].exitcode, outs[r].error) for r in (0, 2)] == [(None, None)] * 2
    assert all(not os.path.exists(f"/proc/{o.pid}") for o in outs)


def test_launcher_timeout_kills_everything():
    with pytest.raises(TimeoutError, match="still running"):
        run(ranks.sleep_forever, 2, timeout=3)


def test_launcher_reports_killed_rank_and_leaves_nothing_behind():
    outs = run_all(ranks.die_on_rank, 2, (0,), timeout=60, pg_timeout=5, fail_fast=False)
    assert outs[0].exitcode == -9
    # the survivor's barrier with a dead peer fails within the process-group timeout
    assert outs[1].exitcode == 1 and outs[1].error
    for o in outs:
        assert o.exitcode is not None
    for o in outs:
        assert not os.path.exists(f"/proc/{o.pid}"), f"rank {o.rank} (pid {o.pid}) outlived the launcher"
