"""Topology: pure construction, validation, and detection on real process groups."""

from __future__ import annotations

import pytest
import ranks
from harness import launch
from hypothesis import given, settings
from hypothesis import strategies as st

from hiersync import Topology
from hiersync.topology import parse_node_ids


def test_contiguous_2x2():
    t = Topology.from_node_ids([0, 0, 1, 1])
    assert t.nodes == ((0, 1), (2, 3))
    assert t.num_nodes == 2 and t.ranks_per_node == 2 and t.even
    assert [t.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert t.rails == ((0, 2), (1, 3))
    assert t.leaders == (0, 2)


def test_noncontiguous_and_arbitrary_ids():
    t = Topology.from_node_ids([7, 3, 7, 3])
    assert t.nodes == ((0, 2), (1, 3))
    assert t.node_of(3) == 1 and t.local_rank(3) == 1
    assert t.rail(0) == (0, 1) and t.rail(1) == (2, 3)


def test_uneven():
    t = Topology.from_node_ids([0, 0, 0, 1])
    assert not t.even
    assert t.nodes == ((0, 1, 2), (3,))
    assert t.rails == ((0, 3), (1,), (2,))
    with pytest.raises(ValueError, match="uneven"):
        _ = t.ranks_per_node


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "empty"),
        ([0, "a"], r"node_ids\[1\]='a'"),
        ([0, 1.5], r"node_ids\[1\]=1.5"),
        ([0, True], r"node_ids\[1\]=True"),
    ],
)
def test_from_node_ids_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_node_ids(bad)


def test_from_node_ids_rejects_string():
    with pytest.raises(TypeError, match="sequence of ints"):
        Topology.from_node_ids("0,0,1,1")


def test_rank_in_no_node():
    with pytest.raises(ValueError, match=r"cover global ranks 0\.\.2 exactly once"):
        Topology(nodes=((0, 1), (3,)))
    with pytest.raises(ValueError, match="at least one rank"):
        Topology(nodes=((0, 1), ()))


@pytest.mark.parametrize(
    "text, world, match",
    [
        ("0,0,x,1", 4, r"entry 2 \('x'\) is not an integer"),
        ("0,0,1", 4, "has 3 entries but the world has 4 ranks"),
        ("0,,1,1", 4, r"entry 1 \(''\)"),
    ],
)
def test_parse_node_ids_rejects(text, world, match):
    with pytest.raises(ValueError, match=match):
        parse_node_ids(text, world)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-3, max_value=5), min_size=1, max_size=24))
def test_property_random_layouts(ids):
    t = Topology.from_node_ids(ids)
    assert t.world_size == len(ids)
    # ranks with equal ids share a node, and only those
    for a in range(len(ids)):
        for b in range(len(ids)):
            assert (t.node_of(a) == t.node_of(b)) == (ids[a] == ids[b])
    # local ranks are 0..L-1 in global-rank order inside each node
    for node in t.nodes:
        assert list(node) == sorted(node)
        assert [t.local_rank(r) for r in node] == list(range(len(node)))
    # rails partition the world, one rank per node that has that local rank
    flat = sorted(r for rail in t.rails for r in rail)
    assert flat == list(range(len(ids)))
    for lr, rail in enumerate(t.rails):
        assert all(t.local_rank(r) == lr for r in rail)
        assert len({t.node_of(r) for r in rail}) == len(rail)
    assert t.even == (len({len(n) for n in t.nodes}) == 1)


def test_detect_from_env_override():
    assert launch(ranks.detect_topology, [0, 1, 0, 1])[0] == [[0, 2], [1, 3]]


def test_detect_from_hostname_same_host_is_one_node():
    # no HIERSYNC_NODE_IDS: every rank reports this host's name -> one node
    from hiersync.tools.launch import run

    assert run(ranks.detect_topology, 3, timeout=60)[0] == [[0, 1, 2]]


def test_detect_from_group_rank():
    # torchrun sets GROUP_RANK per agent: one agent per emulated node makes distinct nodes
    from hiersync.tools.launch import run

    assert run(ranks.detect_by_group_rank, 4, timeout=60)[0] == [[0, 1], [2, 3]]


def test_detect_rejects_malformed_env():
    from hiersync.tools.launch import RankFailed, run

    with pytest.raises(RankFailed, match="has 3 entries but the world has 2 ranks"):
        run(ranks.detect_topology, 2, env={"HIERSYNC_NODE_IDS": "0,0,1"}, timeout=60)


def test_detect_needs_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Topology.detect()


# ------------------------------------------------------------------ real-cluster safety
def test_node_key_names_an_env_var_read_on_each_rank():
    # e.g. HIERSYNC_NODE_KEY=SLURM_NODEID, or a Kubernetes node name via the downward API
    from hiersync.tools.launch import run

    res = run(ranks.detect_by_node_key, 4, env={"HIERSYNC_NODE_KEY": "FAKE_NODE"}, timeout=60)
    assert all(r == ([[0, 1], [2, 3]], "HIERSYNC_NODE_KEY=FAKE_NODE") for r in res), res


def test_node_key_unset_on_one_rank_fails_on_every_rank():
    from hiersync.tools.launch import run_all

    outs = run_all(ranks.detect_by_node_key, 4, (3,), env={"HIERSYNC_NODE_KEY": "FAKE_NODE"}, timeout=60)
    for o in outs:  # every rank raises (none hangs), naming the variable and the ranks
        assert o.exitcode != 0 and "FAKE_NODE is not set on ranks [3]" in (o.error or ""), o


def test_subgroups_carry_a_group_desc_for_nccl_traces():
    res = launch(ranks.group_descriptions, [0, 0, 1, 1])
    assert res[0] == ["hiersync/intra0", "hiersync/intra0_late", "hiersync/rail0"], res[0]
    assert res[3] == ["hiersync/intra1", "hiersync/intra1_late", "hiersync/rail1"], res[3]


@pytest.mark.parametrize(
    "node_ids, period, rank, env, expect",
    [
        ([0, 1, 2, 3], 4, 0, {}, "every node holds one rank"),  # one container per GPU
        ([0, 0, 0, 0], 4, 0, {}, "all 4 ranks are on one node"),  # one shared hostname, no GROUP_RANK
        ([0, 0, 1, 1], 4, 2, {"LOCAL_WORLD_SIZE": "1"}, "holds 2 ranks but torchrun's LOCAL_WORLD_SIZE is 1"),
        ([0, 1, 2, 3], 1, 0, {}, None),  # period 1 is exact: nothing to warn about
        ([0, 0, 1, 1], 4, 0, {"LOCAL_WORLD_SIZE": "2"}, None),
        ([0, 1, 2, 3], 4, 1, {}, None),  # layout-wide warnings come from rank 0 only
    ],
)
def test_layout_warnings(monkeypatch, node_ids, period, rank, env, expect):
    from hiersync.topology import check_layout

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    topo = Topology.from_node_ids(node_ids)
    if expect is None:
        assert check_layout(topo, period, rank) == []
        return
    with pytest.warns(UserWarning, match=expect):
        msgs = check_layout(topo, period, rank)
    assert len(msgs) == 1 and "HIERSYNC_NODE_KEY" in msgs[0], msgs
