"""A third level (node -> rack -> world): the pure hierarchy, and the engine against a
hand-written three-level local SGD (tests/levels_ranks.py) on several emulated layouts."""

from __future__ import annotations

import fsdp_ranks
import levels_ranks
import pytest
from harness import assert_checkpoint_resumes_exactly, launch

from hiersync.config import HierConfig
from hiersync.levels import due, hierarchy
from hiersync.topology import Topology

# (node ids, rack ids) per global rank
LAYOUTS = {
    "2 racks x 2 nodes x 1": ([0, 1, 2, 3], [0, 0, 1, 1]),
    "2 racks x 1 node x 2": ([0, 0, 1, 1], [0, 0, 1, 1]),
    "racks of non-contiguous nodes": ([0, 1, 2, 3], [0, 1, 0, 1]),
    "uneven racks (3 + 1 nodes)": ([0, 1, 2, 3], [0, 0, 0, 1]),
}


def test_hierarchy_is_node_rack_world_with_their_periods():
    levels = hierarchy(16, warmup_steps=2, rack_period=4)
    assert [(lv.name, lv.schedule.period) for lv in levels] == [("node", 1), ("rack", 4), ("world", 16)]
    steps = {s: due(levels, s) for s in range(2, 34) if due(levels, s)}
    assert [s for s, d in steps.items() if d == ("world",)] == [17, 33]
    assert [s for s, d in steps.items() if d == ("rack",)] == [5, 9, 13, 21, 25, 29]
    assert [lv.name for lv in hierarchy(4)] == ["node", "world"]  # today's two levels


def test_a_streaming_world_leaves_the_rack_its_steps():
    levels = hierarchy(8, fragments=2, rack_period=4)
    assert due(levels, 3) == ("rack", "world") and due(levels, 7) == ("rack", "world")


@pytest.mark.parametrize(
    "options, fix",
    [
        (dict(period=4, rack_period=4), "below period=4"),
        (dict(period=4, rack_period=1), ">= 2"),
        (dict(period=8, rack_period="4"), "an int"),
    ],
)
def test_bad_rack_periods_name_the_fix(options, fix):
    with pytest.raises((ValueError, TypeError), match=fix):
        HierConfig(**options)


def test_racks_from_rack_ids():
    topo = Topology.from_node_ids([0, 0, 1, 1, 2, 2, 3, 3], [7, 7, 7, 7, 9, 9, 9, 9])
    assert topo.racks == ((0, 1), (2, 3))
    assert topo.rack_rail(5) == (5, 7) and topo.rack_of(5) == 1
    assert topo.rack_rails == ((0, 2), (1, 3), (4, 6), (5, 7))
    with pytest.raises(ValueError, match="same rack"):
        Topology.from_node_ids([0, 0, 1, 1], [0, 1, 1, 1])


CASES = {
    "blocking": dict(mode="blocking", period=8, rack_period=2, warmup=1, steps=10),
    "overlap + outer": dict(mode="overlap", period=6, rack_period=2, steps=9, outer=(0.7, 0.9)),
    "streaming + outer": dict(mode="stream", period=8, rack_period=3, fragments=2, tau=2, steps=12, outer=(0.7, 0.9)),
}
CODED = {  # the world's average coded, the rack's fp32 (topk2: a numpy reference; int4: within a code's step)
    "blocking + topk2": dict(mode="blocking", period=6, rack_period=2, steps=13, compress="topk2"),
    "streaming + int4 + outer": dict(
        mode="stream", period=8, rack_period=3, fragments=2, tau=1, steps=12, outer=(0.7, 0.9), compress="int4"
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_three_levels_match_the_reference(case, layout):
    nodes, racks = LAYOUTS[layout]
    cfg = dict(CASES[case], racks=racks)
    res = launch(levels_ranks.three_level_check, nodes, cfg)
    r = res[0]
    assert r["rack_steps"] and r["world_steps"], r
    assert all(x["synchronized"] for x in res)
    assert r["racks_differed"], "between world syncs the racks should drift apart"
    multi_node_racks = len(set(racks)) < len(set(nodes))
    if multi_node_racks:
        assert r["bytes"].get("rack", 0) > 0, r["bytes"]
        assert r["nodes_in_rack_differed"], "between rack syncs the nodes of a rack should drift apart"
    else:  # a rack of one node: its level sends nothing
        assert r["bytes"].get("rack", 0) == 0, r["bytes"]


@pytest.mark.parametrize("layout", ["2 racks x 2 nodes x 1", "2 racks x 1 node x 2"])
def test_fsdp2_three_levels_equal_the_ddp_front_end(layout):
    nodes, racks = LAYOUTS[layout]
    cfg = dict(reference="ddp", period=6, rack_period=2, fragments=2, tau=1, steps=8, outer=(0.7, 0.9), racks=racks)
    res = launch(fsdp_ranks.fsdp_check, nodes, cfg)
    assert all(r["synchronized"] for r in res)
    assert res[0]["nodes_differed"]


def test_checkpoint_between_rack_and_world_syncs_resumes_bitwise(tmp_path):
    cfg = dict(mode="stream", period=8, rack_period=3, fragments=2, tau=2, outer=(0.7, 0.9), racks=[0, 0, 1, 1])
    assert_checkpoint_resumes_exactly(cfg, str(tmp_path), 5, node_ids=[0, 1, 2, 3])  # a correction in flight


def test_rack_period_without_racks_names_the_variables():
    res = launch(levels_ranks.without_racks, [0, 1])
    assert all("HIERSYNC_RACK_IDS" in r and "HIERSYNC_RACK_KEY" in r for r in res)


def test_rack_period_without_an_optimizer_is_refused_where_the_user_can_act():
    """At ``register(model, None, ...)``, before any group is built; with ``HierState`` and the hook
    alone, at the first step (no optimizer can be attached later than that). Both a ValueError
    naming the fix, as docs/levels.md says."""
    for register, first_step in launch(levels_ranks.rack_without_optimizer, [0, 1]):
        assert register.startswith("register: ValueError: rack_period=2 needs an optimizer"), register
        assert "hiersync.register(model, optimizer, ...)" in register
        assert first_step.startswith("first step: ValueError: rack_period=2 needs an optimizer"), first_step
        assert "state.attach_optimizer(optimizer)" in first_step


def test_rack_period_with_a_manager_is_refused():
    import torch

    from hiersync.ft import register_with_manager

    model = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    with pytest.raises(ValueError, match="rack_period=2 does not combine with manager="):
        register_with_manager(model, object(), object(), period=4, rack_period=2)


# ---------------------------------------------------------------- the cost model of three levels
def test_the_spine_slows_a_rack_ordered_ring_only_beyond_nodes_per_rack():
    from hiersync.costmodel import Link
    from hiersync.costmodel.racks import cross_rack_link

    nic = Link(5e-6, 1 / 50e9)
    assert cross_rack_link(nic, 16, 4.0) == nic  # 16 nodes' NICs behind 4:1 uplinks: L flows fit
    assert cross_rack_link(nic, 16, 64.0).beta == pytest.approx(4 * nic.beta)
    assert cross_rack_link(nic, 16, 1.0, spine_latency_s=2e-6).alpha == pytest.approx(7e-6)


def test_a_rack_level_pays_behind_a_slow_spine_and_not_behind_a_full_one():
    from hiersync.costmodel import get_preset
    from hiersync.costmodel.racks import price_levels, rack_verdict

    def rows(o):
        return price_levels(
            get_preset("a100-1nic"),
            params=1e9,
            nodes=128,
            nodes_per_rack=8,
            oversubscription=o,
            compute_s=0.3,
            rack_period=4,
            period=16,
        )

    slow, full = rows(32.0), rows(1.0)
    two, three = slow[0], slow[2]
    # hand-computed amortization: the world every 16 steps, the rack on the other 3 of every 4 sync steps
    assert three.step_s == pytest.approx(0.3 + three.world_s / 16 + three.rack_s * (1 / 4 - 1 / 16))
    assert two.step_s == pytest.approx(0.3 + two.world_s / 4)
    assert three.rack_s < three.world_s / 3  # 8 nodes at the NIC's rate against 128 behind a 4x slower spine
    assert "pays" in rack_verdict(slow, 8, 32.0)
    assert "buys little" in rack_verdict(full, 8, 1.0)
    assert three.spine_bytes == pytest.approx(two.spine_bytes / 4)


def test_plan_prints_the_three_levels(capsys):
    from hiersync.tools.cli import main

    argv = "plan --preset a100-1nic --nodes 128 --params 1e9 --backward-ms 200 --forward-ms 100"
    main([*argv.split(), "--nodes-per-rack", "8", "--oversubscription", "32"])
    out = capsys.readouterr().out
    assert "Three levels: node -> rack (8 nodes) -> world (128 nodes)" in out
    assert "a rack level pays" in out and "rack_period=4" in out


@pytest.mark.parametrize("layout", ["2 racks x 2 nodes x 1", "racks of non-contiguous nodes"])
@pytest.mark.parametrize("case", list(CODED))
def test_a_coded_world_over_fp32_racks_stays_near_the_reference(case, layout):
    nodes, racks = LAYOUTS[layout]
    res = launch(levels_ranks.three_level_check, nodes, dict(CODED[case], racks=racks))
    r = res[0]
    assert r["rack_steps"] and r["world_steps"] and all(x["synchronized"] for x in res)
    assert r["bytes"].get("rack", 0) > 0 and r["racks_differed"] and r["nodes_in_rack_differed"]
