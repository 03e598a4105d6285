"""Reliability: dead or frozen peers never hang the job; NaN/Inf never reach parameters."""

from __future__ import annotations

import re

import pytest
import ranks
from harness import (
    TOPOLOGIES,
    nccl_mode,  # noqa: F401  (a fixture, used by name)
)

from hiersync.tools.launch import run_all

TIMEOUT_S = 4.0  # HierState(timeout=...) for these tests
# what ends a survivor's wait: the dead peer's closed socket, or the process group's timeout
CAUSES = re.compile(r"Connection (closed|reset) by peer|Timed out waiting 4000ms")


def _check_failed_at_first_contact(o, die_at: int, period: int) -> None:
    """The survivor raised at the first collective that needed the victim (its own node's next
    step, another node's next sync), and for the reason the peer gave or the timeout, not later."""
    step = int(re.search(r"\(step (\d+), ", o.error).group(1))
    first_sync = die_at + (-(die_at + 1)) % period  # steps s with (s + 1) % period == 0 sync
    assert step == (die_at if o.rank == 0 else first_sync), (o.rank, step, o.error)
    assert CAUSES.search(o.error), (o.rank, o.error)


@pytest.mark.parametrize(
    "die_at, in_hook",
    [(5, False), (7, False), (7, True)],
    ids=["local_step", "sync_step_blocking", "sync_step_in_hook"],
)
def test_killed_peer_makes_every_survivor_raise(die_at, in_hook):
    # period 4: step 7 is a sync step, step 5 a local one
    outs = run_all(
        ranks.die_mid_training,
        4,
        (1, die_at, 4, TIMEOUT_S, "kill", in_hook),
        node_ids=TOPOLOGIES["2x2"],
        timeout=90,
        pg_timeout=TIMEOUT_S,
        fail_fast=False,
    )
    assert outs[1].exitcode == -9
    for o in (outs[0], outs[2], outs[3]):
        assert o.exitcode == 1, (o.rank, o.exitcode, o.error)
        assert "hiersync" in o.error and "step " in o.error and "rank" in o.error, o.error
        _check_failed_at_first_contact(o, die_at, period=4)


def test_frozen_peer_times_out_instead_of_hanging():
    outs = run_all(
        ranks.die_mid_training,
        4,
        (1, 5, 2, TIMEOUT_S, "stop", False),
        # the frozen rank never exits by itself: the launcher kills it at this limit
        node_ids=TOPOLOGIES["2x2"],
        timeout=45,
        pg_timeout=TIMEOUT_S,
        fail_fast=False,
    )
    assert outs[1].exitcode is None  # frozen until the launcher killed it
    for o in (outs[0], outs[2], outs[3]):
        assert o.exitcode == 1, (o.rank, o.exitcode, o.error)
        assert "hiersync" in o.error, o.error
        _check_failed_at_first_contact(o, 5, period=2)


@pytest.mark.usefixtures("nccl_mode")
@pytest.mark.parametrize("mode", ["blocking", "hook", "overlap", "overlap_int4"])
def test_nan_never_reaches_parameters(mode):
    # warmup 2 (exact), period 3: steps 2, 3 local, 4 sync, 5, 6 local, 7 sync
    nan_steps = [1, 3, 4]
    outs = run_all(
        ranks.nan_check,
        4,
        (mode, 3, 2, nan_steps, 9),
        node_ids=TOPOLOGIES["2x2"],
        timeout=90,
        fail_fast=True,
    )
    res = [o.result for o in outs]
    assert all(o.exitcode == 0 for o in outs), [o.error for o in outs]
    # exact step 1: the world average is NaN, every rank skips; steps 3 and 4: only node 0 does
    assert [r["stats"]["nonfinite_skips"] for r in res] == [3, 3, 1, 1]
    assert [r["stats"]["nonfinite_sync_skips"] for r in res] == [1, 1, 0, 0]
    if mode != "hook":
        assert res[0]["unchanged_on_skip"] == [True]  # a skipped update leaves parameters as they were


@pytest.mark.usefixtures("nccl_mode")
def test_nonfinite_raise_mode():
    from hiersync.tools.launch import RankFailed, run

    with pytest.raises(RankFailed, match="non-finite gradient at step 1"):
        run(ranks.nan_raise, 2, (), node_ids=[0, 1], timeout=60)
