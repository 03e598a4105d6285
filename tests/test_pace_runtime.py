"""Adaptive pace and sample-weighted averages at run time, against a reference written here
(tests/pace_ranks.py: each node's local SGD by hand, the average weighted by its samples).

Each node's speed is a sleep per step (node 0 fast, node 1 four times slower), far above the
2-core box's noise, so the pace decisions are the same on every run: the fastest takes
``period``, the slow node ``floor(8 * 0.02 / 0.08 * 1.05) = 2``, from the third window on
(the first two run ``period`` on every node: the third is paced by the first's step times).
"""

from __future__ import annotations

import pace_ranks
import pytest
import torch
from harness import TOPOLOGIES, launch

from hiersync.config import HierConfig

FAST, SLOW = 0.02, 0.08


def _check(res, node_ids, count=False, atol=1e-6, zero=None, outer=None):
    by_node = {}
    for r in res:
        by_node.setdefault(r["node"], r["lengths"])
        assert r["lengths"] == by_node[r["node"]], "the ranks of a node took different steps"
    first = torch.tensor(res[0]["params"])
    for r in res[1:]:
        torch.testing.assert_close(torch.tensor(r["params"]), first, rtol=0, atol=0)  # equal after each sync
    ref = pace_ranks.reference(node_ids, by_node, count=count, zero=zero, outer=outer)
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=atol)
    plain = pace_ranks.reference(node_ids, by_node, count=count, weighted=False, outer=outer)
    assert (plain - ref).abs().max() > 10 * atol, "the weights do not change the reference: the test cannot tell"
    return by_node


@pytest.mark.parametrize("name", ["2x1", "2x2", "uneven", "noncontiguous", "3x1"])
def test_a_slow_node_takes_the_steps_that_fit_and_the_average_weighs_its_samples(name):
    node_ids = {"uneven": [0, 0, 1], "3x1": [0, 1, 2]}.get(name) or TOPOLOGIES[name]
    # 3x1: a third node at half speed takes floor(8 * 0.02 / 0.04 * 1.05) = 4
    cfg = {"options": {"period": 8, "pace": "adaptive"}, "windows": 4, "step_s": [FAST, SLOW, 2 * FAST]}
    res = launch(pace_ranks.run, node_ids, cfg, timeout=120)
    lengths = _check(res, node_ids)
    expected = {0: [8, 8, 8, 8], 1: [8, 8, 2, 2], 2: [8, 8, 4, 4]}
    assert lengths == {n: expected[n] for n in set(node_ids)}
    assert all(r["tally"] == 4 for r in res)  # one tally a sync


def test_a_node_that_counted_no_samples_adds_nothing_to_its_window():
    """Node 1 counts 0 samples through the third window (a joiner's, or a batch of padding): that
    window's average is node 0's parameters; the windows around it weigh both nodes."""
    node_ids = TOPOLOGIES["2x2"]
    cfg = {"options": {"period": 4, "pace": "adaptive"}, "windows": 4, "step_s": [FAST, SLOW], "count": True}
    cfg["zero"] = [1, 2]
    res = launch(pace_ranks.run, node_ids, cfg, timeout=120)
    lengths = _check(res, node_ids, count=True, zero=[1, 2])
    assert lengths[1] == [4, 4, 1, 1]


@pytest.mark.parametrize("pace", ["fixed", "adaptive"])
def test_counted_samples_weigh_each_nodes_average(pace):
    node_ids = TOPOLOGIES["2x2"]
    cfg = {"options": {"period": 4, "pace": pace}, "windows": 4, "step_s": [FAST, SLOW], "count": True}
    res = launch(pace_ranks.run, node_ids, cfg, timeout=120)
    lengths = _check(res, node_ids, count=True)
    assert lengths[1] == ([4] * 4 if pace == "fixed" else [4, 4, 1, 1])


def test_the_quantized_average_weighs_the_samples_too():
    """int8 deltas with error feedback: within the codes' error of the weighted reference, and
    much closer to it than to the unweighted average of the same nodes."""
    node_ids = TOPOLOGIES["2x2"]
    cfg = {"options": {"period": 8, "pace": "adaptive", "compress": "int8"}, "windows": 4, "step_s": [FAST, SLOW]}
    res = launch(pace_ranks.run, node_ids, cfg, timeout=120)
    _check(res, node_ids, atol=2e-3)


def test_the_outer_step_moves_from_the_weighted_average():
    """DiLoCo's outer Nesterov step (lr 0.7, momentum 0.9) on the samples-weighted average."""
    node_ids = TOPOLOGIES["2x2"]
    options = {"period": 8, "pace": "adaptive", "outer_lr": 0.7, "outer_momentum": 0.9}
    cfg = {"options": options, "windows": 4, "step_s": [FAST, SLOW]}
    res = launch(pace_ranks.run, node_ids, cfg, timeout=120)
    lengths = _check(res, node_ids, outer=(0.7, 0.9))
    assert lengths == {0: [8, 8, 8, 8], 1: [8, 8, 2, 2]}


def test_streaming_overlapped_under_adaptive_pace_stays_consistent():
    """Fragments at offsets of each node's own window, applied a step later (the slow node's two
    steps a window sync two fragments each); after ``synchronize()`` every rank holds the same
    parameters."""
    node_ids = TOPOLOGIES["2x2"]
    cfg = {
        "options": {"period": 8, "pace": "adaptive", "fragments": 4, "overlap": 1},
        "windows": 4,
        "step_s": [FAST, SLOW],
        "synchronize": True,
    }
    res = launch(pace_ranks.run, node_ids, cfg, timeout=120)
    lengths = {r["node"]: r["lengths"] for r in res}
    assert lengths == {0: [8, 8, 8, 8], 1: [8, 8, 2, 2]}
    first = torch.tensor(res[0]["params"])
    for r in res[1:]:
        torch.testing.assert_close(torch.tensor(r["params"]), first, rtol=0, atol=0)
    assert all(r["tally"] == 16 + 1 for r in res)  # one a fragment's sync, and synchronize()'s


@pytest.mark.parametrize("mode", ["blocking", "streaming"])
def test_a_checkpoint_taken_inside_a_window_resumes_bit_for_bit(mode, tmp_path):
    """Blocking: saved one step into the third window (each node at its own step, the pace decided
    and the samples counted so far in the checkpoint); streaming: as the third window opens, its
    syncs in flight (a node's fragments in flight need every node's launch of them: mid-window a
    save is refused). Loaded by a fresh job: the same parameters as the run without the restart,
    bit for bit."""
    node_ids = TOPOLOGIES["2x2"]
    options = {"period": 8, "pace": "adaptive"}
    if mode == "streaming":
        options.update(fragments=4, overlap=1)
    mid = mode == "blocking"
    cfg = {"options": options, "windows": 4, "save_at": 2, "step_s": [FAST, SLOW], "mid": mid}
    whole = launch(pace_ranks.run, node_ids, cfg, timeout=120)
    saved = launch(pace_ranks.resumed, node_ids, cfg, "save", str(tmp_path), timeout=120)
    assert sorted({(r["node"], r["step"]) for r in saved}) == [(0, 16 + mid), (1, 16 + mid)]
    again = launch(pace_ranks.resumed, node_ids, cfg, "load", str(tmp_path), timeout=120)
    assert {r["node"]: r["step"] for r in again} == {0: 32, 1: 20}
    for a, b in zip(whole, again):
        torch.testing.assert_close(torch.tensor(b["params"]), torch.tensor(a["params"]), rtol=0, atol=0)


def test_adaptive_pace_refuses_what_it_cannot_pace():
    with pytest.raises(ValueError, match="rack_period"):
        HierConfig(period=8, rack_period=2, pace="adaptive")
    with pytest.raises(ValueError, match="period >= 2"):
        HierConfig(period=1, pace="adaptive")
    with pytest.raises(ValueError, match="pace must be one of"):
        HierConfig(period=4, pace="fast")


@pytest.mark.parametrize(
    "name, options",
    [
        ("2x1", {}),
        ("2x2", {"count": True}),
        ("2x1", {"compress": "int8"}),
        ("2x2", {"fsdp": True, "count": True}),
        ("2x1", {"fragments": 4, "overlap": 1, "outer_lr": 0.7, "outer_momentum": 0.9}),
    ],
)
def test_adaptive_pace_on_torchft_weighs_the_samples_its_barrier_carried(name, options):
    """manager=: each window's barrier carries every node's samples and step time, so the slow node
    takes the steps that fit from the second window on (the first window's times pace it) and the
    average weighs the samples, against the same reference as the process-group rail."""
    pytest.importorskip("torchft")
    from hiersync.tools.ft_nodes import Lighthouse, Nodes

    node_ids = TOPOLOGIES[name]
    L = node_ids.count(0)
    opts = {"period": 8, "pace": "adaptive", **{k: v for k, v in options.items() if k not in ("count", "fsdp")}}
    cfg = {"options": opts, "windows": 4, "step_s": [FAST, SLOW], "nodes": 2, "count": options.get("count")}
    cfg.update(fsdp=options.get("fsdp"), synchronize="fragments" in options)
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=L) as nodes:
        for n in range(2):
            nodes.start(n, pace_ranks.run_manager, (cfg,))
        out = nodes.wait([0, 1], timeout=120)
    res = [r for n in range(2) for r in out[n]]
    assert all(r["failed"] == 0 for r in res)
    if "fragments" in options:  # streaming with the outer step: no hand reference; equal after synchronize()
        first = torch.tensor(res[0]["params"])
        assert torch.isfinite(first).all()
        for r in res[1:]:
            torch.testing.assert_close(torch.tensor(r["params"]), first, rtol=0, atol=0)
        _paced_from_the_second_window({r["node"]: r["lengths"] for r in res})
        return
    outer = (0.7, 0.9) if "outer_lr" in options else None
    atol = 2e-3 if "compress" in options else 1e-6
    lengths = _check(res, node_ids, count=bool(options.get("count")), atol=atol, outer=outer)
    _paced_from_the_second_window(lengths)


def _paced_from_the_second_window(lengths: dict[int, list[int]]) -> None:
    """Node 0 takes 8 a window; node 1 8 in the first, then what fits: 2 by the sleeps alone, up to 4
    where the steps' own work (4 ranks sharing the box's 2 cores) adds to both nodes' sleeps. The
    reference is computed from the lengths taken, so the weights are checked whatever they are."""
    assert lengths[0] == [8, 8, 8, 8] and lengths[1][0] == 8, lengths
    assert all(2 <= n <= 4 for n in lengths[1][1:]), lengths


def test_adaptive_pace_on_torchft_a_slow_node_killed_and_restarted_is_healed_and_paced_again():
    """3 nodes of one rank, node 1 four times slower, killed in its third window and started again:
    the survivors go on paced among themselves, the restarted node is healed from a live peer at
    their window, is paced again from its own step times, and every node ends equal."""
    pytest.importorskip("torchft")
    from hiersync.tools.ft_nodes import Lighthouse, Nodes

    step_s = [0.03, 0.12, 0.03]
    cfg = {"options": {"period": 8, "pace": "adaptive"}, "windows": 24, "step_s": step_s, "nodes": 3}
    cfg.update(synchronize=True, kill={"node": 1, "window": 2})
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=1) as nodes:
        for n in range(3):
            nodes.start(n, pace_ranks.run_manager, (cfg,))
        nodes.wait_step(0, 6, timeout=90)
        nodes.start(1, pace_ranks.run_manager, (dict(cfg, kill={}, nodes=1),))
        out = nodes.wait([0, 1, 2], timeout=180)
    joiner = out[1][0]
    assert joiner["heals"] >= 1 and joiner["first"] > 0
    final = torch.tensor(out[0][0]["params"])
    assert torch.isfinite(final).all()
    for n in (1, 2):
        torch.testing.assert_close(torch.tensor(out[n][0]["params"]), final, rtol=0, atol=0, msg=f"node {n}")
    survivors = [out[n][0]["lengths"] for n in (0, 2)]
    assert all(max(w) == 8 for w in survivors), survivors
    assert joiner["lengths"][-3:] == [2, 2, 2], joiner["lengths"]  # paced again from its own step times


@pytest.mark.parametrize("name", ["2x2", "3x1", "uneven"])
def test_streaming_fragments_sync_on_the_slowest_nodes_grid_against_a_reference(name):
    """Blocking streaming (2 fragments): each fragment averaged at its own sync, weighted by the steps
    each node took since that fragment last synced, every node syncing it at the same fraction of
    its window; against the hand reference of that schedule."""
    node_ids = {"uneven": [0, 0, 1], "3x1": [0, 1, 2]}.get(name) or TOPOLOGIES[name]
    cfg = {"options": {"period": 8, "pace": "adaptive", "fragments": 2}, "windows": 4, "step_s": [FAST, SLOW, 2 * FAST]}
    res = launch(pace_ranks.run, node_ids, cfg, timeout=120)
    by_node = {r["node"]: r["lengths"] for r in res}
    assert by_node[1][2:] == [2, 2], by_node
    layout = res[0]["layout"]
    assert len(layout) == 2 and all(layout), layout
    ref = pace_ranks.reference_streaming(node_ids, by_node, layout)
    for r in res:  # fragment 0 synced mid-window: each node's own parameters since
        torch.testing.assert_close(torch.tensor(r["params"]), ref[r["node"]], rtol=1e-5, atol=1e-6)
    whole = pace_ranks.reference(node_ids, by_node)  # the same windows with one fragment
    assert (whole - ref[0]).abs().max() > 1e-4, "streaming and one fragment agree: the test cannot tell"
