"""int8/int4 deltas across nodes: the rail average, the sync, its bytes and its checkpoints.

The rail average is checked against the same dequantize-sum-requantize done by hand from
every rank's codes (2x2, 2x1, 3x1); the sync against the fp32 reference of
``ranks.localsgd_check``, within a bound set by the codes' step; the bytes from ``stats``.
"""

from __future__ import annotations

import pytest
import quant_ranks
import ranks
from harness import (
    TOPOLOGIES,
    assert_checkpoint_resumes_exactly,
    launch,
    nccl_mode,  # noqa: F401  (a fixture, used by name)
)

pytestmark = pytest.mark.usefixtures("nccl_mode")  # as is, and under emulated NCCL

QMAX = {"int8": 127, "int4": 7}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["2x2", "2x1", "3x1"])
def test_rail_average_equals_the_same_maths_by_hand(name, bits):
    node_ids = {"3x1": [0, 1, 2]}.get(name) or TOPOLOGIES[name]
    N = len(set(node_ids))
    for r in launch(quant_ranks.quantized_average_check, node_ids, bits):
        assert r["equal"]
        # all-to-all of N pieces, then all-gather of one averaged piece: (N - 1)/N of it each way
        assert r["bytes_sent"] == 2 * round((N - 1) / N * r["packed_bytes"])


@pytest.mark.parametrize("name", ["1x2", "2x1", "2x2", "noncontiguous", "3x1"])
def test_sparse_rail_average_against_numpy_with_its_invariant_every_sync(name):
    """topk2: every rank's average equals the numpy reference's over its rail, to fp32 rounding;
    what each node sent plus its residual is its delta plus the residual before, every sync; the
    bytes are the gathered payloads', (N - 1) of them a sync (one node: none, nothing sent)."""
    node_ids = {"3x1": [0, 1, 2]}.get(name) or TOPOLOGIES[name]
    for r in launch(quant_ranks.sparse_average_check, node_ids):
        assert r["worst"] <= 1e-5 and r["invariant"] <= 1e-5 and r["same_rail"], r
        assert r["bytes_sent"] == 3 * (r["nodes"] - 1) * r["packed_bytes"], r


@pytest.mark.parametrize(
    "cfg",
    [
        dict(mode="blocking", period=2, steps=6, compress="int8"),
        dict(mode="overlap", period=2, steps=7, compress="int4", outer=(0.7, 0.9)),
        dict(mode="stream", period=4, fragments=2, tau=1, steps=9, compress="int4"),
        dict(mode="hook", period=2, steps=6, compress="int8", outer=(0.7, 0.9)),
    ],
    ids=["blocking_int8", "overlap_int4_outer", "stream_int4", "hook_int8_outer"],
)
def test_sync_error_is_bounded_by_the_codes_step(cfg):
    res = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], cfg)
    for r in res:
        # two roundings per sync (the sent delta, the re-encoded average), at most half a step
        # each, plus what error feedback still carries: a few steps of the largest delta
        assert r["worst_vs_reference"] <= 4 * r["max_delta"] / QMAX[cfg["compress"]], r
        assert r["nodes_differed"]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(mode="blocking", period=2, steps=6),
        dict(mode="stream", period=4, fragments=2, tau=1, steps=9),
        dict(mode="hook", period=2, steps=6, outer=(0.7, 0.9)),
    ],
    ids=["blocking", "stream", "hook_outer"],
)
def test_sparse_deltas_train_next_to_the_reference(cfg):
    """topk2 on 2x2: the nodes agree after each blocking sync (asserted inside), differ between
    syncs, and stay within a few local deltas of the fp32 reference (the residual holds what
    the sparse codes have not sent yet)."""
    res = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], dict(cfg, compress="topk2"))
    for r in res:
        assert r["nodes_differed"]
        assert 0 < r["worst_vs_reference"] <= 3 * r["max_delta"], r


def test_bytes_per_sync_against_bf16():
    """Inter-node bytes from stats, scales and positions included: int8 <= 0.55x, int4 <= 0.30x
    and topk2 <= 0.035x of bf16."""
    sent = {}
    for compress in ("bf16", "int8", "int4", "topk2"):
        cfg = dict(mode="blocking", period=2, steps=4, compress=compress, width=96)
        sent[compress] = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], cfg)[0]["stats"]["bytes_sent"]["inter"]
    assert sent["int8"] <= 0.55 * sent["bf16"], sent
    assert sent["int4"] <= 0.30 * sent["bf16"], sent
    assert sent["topk2"] <= 0.035 * sent["bf16"], sent


@pytest.mark.parametrize("compress", ["int8", "int4", "topk2"])
def test_checkpoint_with_residuals_and_corrections_in_flight_resumes_exactly(compress, tmp_path):
    cfg = dict(mode="overlap", period=2, compress=compress, outer=(0.7, 0.9))
    assert_checkpoint_resumes_exactly(cfg, str(tmp_path), 4)


@pytest.mark.parametrize("compress", ["int8", "topk2"])
def test_uneven_nodes_refuse_codes(nccl_mode, compress):
    if nccl_mode == "emulated_nccl":
        pytest.skip("no collective result is read")
    cfg = dict(mode="blocking", period=2, steps=2, compress=compress)
    with pytest.raises(Exception, match="needs nodes with equal numbers of ranks"):
        launch(ranks.localsgd_check, TOPOLOGIES["uneven"], cfg)
