"""Streaming sync (fragments=F, overlap=tau) against a hand-written reference (2x2 unless said).

``ranks.localsgd_check`` with ``mode="stream"`` runs hiersync next to ``ranks.Reference``,
whose ``stream_after_step`` writes the fragment schedule and the delta correction
(x += target(snapshot) - snapshot, tau steps after the launch) out by hand, and asserts
after every step: node replicas bitwise identical, hiersync == reference (rtol 1e-5
without compression). Here: what the runs return, plus the schedule's own invariants.
"""

from __future__ import annotations

import pytest
import ranks
import torch
from harness import (
    TOPOLOGIES,
    assert_checkpoint_resumes_exactly,
    launch,
    nccl_mode,  # noqa: F401  (a fixture, used by name)
)

from hiersync.schedule import Schedule, fragment_layout

pytestmark = pytest.mark.usefixtures("nccl_mode")  # as is, and under emulated NCCL

CASES = {
    "F4_tau1": dict(mode="stream", period=4, fragments=4, tau=1, warmup=1, steps=11),
    "F2_blocking_gathered_in_pieces": dict(mode="stream", period=4, fragments=2, tau=0, steps=9, gather_piece_bytes=16),
    "F4_tau3": dict(mode="stream", period=4, fragments=4, tau=3, steps=11),
    "F6_more_fragments_than_steps": dict(mode="stream", period=4, fragments=6, tau=2, steps=10),
    "F4_tau1_outer": dict(mode="stream", period=4, fragments=4, tau=1, steps=10, outer=(0.7, 0.9)),
    "F1_tau2_whole_model": dict(mode="stream", period=3, fragments=1, tau=2, steps=8),
    "F2_tau1_outer": dict(mode="stream", period=2, fragments=2, tau=1, steps=7, outer=(0.7, 0.9)),
    "F4_tau1_outer_state_on_host": dict(
        mode="stream", period=4, fragments=4, tau=1, steps=9, outer=(0.7, 0.9), state_device="cpu"
    ),
    "F2_tau1_outer_optimizer_adam_state_on_host": dict(
        mode="stream", period=4, fragments=2, tau=1, steps=9, outer_opt="adam", state_device="cpu"
    ),
}


def _check_windows(r: dict, cfg: dict) -> None:
    """Every parameter is averaged across nodes exactly once per full window of k steps."""
    k, warm, steps = cfg["period"], cfg.get("warmup", 0), cfg["steps"]
    for w in range((steps - warm) // k):
        lo, hi = warm + w * k, warm + (w + 1) * k
        seen = sorted(i for step, idx in r["launches"] if lo <= step < hi for i in idx)
        assert seen == list(range(r["num_params"])), f"window {w} (steps {lo}..{hi - 1}) averaged {seen}"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_2x2(case):
    cfg = CASES[case]
    res = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], cfg)
    for r in res:
        _check_windows(r, cfg)
        assert r["nodes_differed"], "between syncs the nodes should drift apart"
        sched = Schedule(cfg["period"], cfg.get("warmup", 0), cfg["fragments"])
        assert r["sync_steps"] == [s for s in range(cfg["steps"]) if sched.is_sync(s)]
        if cfg["tau"]:  # L = 2: the node gathers each correction when its rail leg is done, not at apply time
            assert r["gathered_early"] and all(r["gathered_early"]), r["gathered_early"]
    assert all(r["launches"] == res[0]["launches"] for r in res), "launch order differs between ranks"


@pytest.mark.parametrize("name", ["noncontiguous", "uneven", "2x1"])
def test_matches_reference_other_topologies(name):
    cfg = dict(mode="stream", period=2, fragments=2, tau=1, steps=7)
    for r in launch(ranks.localsgd_check, TOPOLOGIES[name], cfg):
        _check_windows(r, cfg)
        # 2x1: nothing to gather in a node of one rank; uneven nodes keep whole vectors
        assert r["gathered_early"] and all(r["gathered_early"]) == (name == "noncontiguous"), r["gathered_early"]


def test_bf16_deltas_error_is_bounded():
    cfg = dict(mode="stream", period=4, fragments=4, tau=1, steps=10, compress="bf16", outer=(0.7, 0.9))
    res = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], cfg)
    eps = torch.finfo(torch.bfloat16).eps
    for r in res:
        _check_windows(r, cfg)
        # a 16-bit *delta* (never a raw parameter) is rounded: the error scales with the delta
        assert r["worst_vs_reference"] <= 8 * eps * max(r["max_delta"], 1e-6) + 1e-6, r


@pytest.mark.parametrize(
    "cfg",
    [
        dict(mode="stream", period=4, fragments=4, tau=1, warmup=1),
        dict(mode="stream", period=4, fragments=4, tau=3, compress="bf16", outer=(0.7, 0.9)),
    ],
    ids=["tau1", "tau3_bf16_outer"],
)
def test_checkpoint_with_corrections_in_flight_resumes_exactly(cfg, tmp_path):
    n = 6  # with tau >= 1 the save lands with fragments in flight
    assert_checkpoint_resumes_exactly(cfg, str(tmp_path), n)


# ------------------------------------------------------------------ pure schedule
def test_each_fragment_syncs_once_per_window_and_staggered():
    for k in range(2, 9):
        for F in range(1, 2 * k + 1):
            s = Schedule(period=k, warmup_steps=3, fragments=F)
            window = [s.fragments_due(3 + t) for t in range(k)]
            assert sorted(f for due in window for f in due) == list(range(F)), (k, F, window)
            if k >= F:
                assert max(len(d) for d in window) == 1, "no step carries two fragments when F <= k"
            assert [s.fragments_due(3 + k + t) for t in range(k)] == window, "every window is the same"
            assert all(s.fragments_due(i) == () for i in range(3)), "warmup steps are exact"


def test_one_fragment_is_the_plain_schedule():
    for k in range(2, 7):
        a, b = Schedule(k, 2), Schedule(k, 2, fragments=1)
        assert [a.kind(i) for i in range(30)] == [b.kind(i) for i in range(30)]
        assert [b.fragments_due(i) for i in range(30)] == [(0,) if a.is_sync(i) else () for i in range(30)]
        assert a.inter_syncs(30) == b.inter_syncs(30)


def test_inter_syncs_counts_sync_steps():
    for k, F, warm in [(4, 4, 0), (4, 2, 3), (4, 6, 1), (3, 1, 2)]:
        s = Schedule(k, warm, F)
        for n in range(0, 20):
            expected = sum(1 for i in range(n) if s.is_exact(i) or s.is_sync(i))
            assert s.inter_syncs(n) == expected, (k, F, warm, n)


def test_layout_balances_bytes_and_never_cuts_a_tensor():
    sizes = [4096, 64, 4096, 64, 4096, 64, 4096, 64, 1024, 16]
    for F in range(1, len(sizes) + 1):
        layout = fragment_layout(sizes, F)
        assert sorted(i for f in layout for i in f) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in f) for f in layout]
        assert max(loads) - min(loads) <= max(sizes), (F, loads)
    assert fragment_layout(sizes, 2) == [[0, 3, 4, 7, 8], [1, 2, 5, 6, 9]], "strided, not contiguous"
    with pytest.raises(ValueError, match="fragments=11 but the model has only 10 parameter tensors"):
        fragment_layout(sizes, 11)


# ------------------------------------------------------------------ guard and GradScaler
def test_nan_never_reaches_parameters():
    # warmup 2 (exact), period 3, 3 fragments: one fragment syncs after every later step
    res = launch(ranks.nan_check, TOPOLOGIES["2x2"], "stream", 3, 2, [1, 3, 4], 9)
    assert [r["stats"]["nonfinite_skips"] for r in res] == [3, 3, 1, 1]


def test_grad_scaler_overflow_on_one_node_defers_its_fragments():
    # every post-warmup step launches a fragment; node 0 skips optimizer.step() at steps 1 and 3,
    # so its launches there are deferred to the next forward, in the same order as node 1's
    res = launch(ranks.scaler_overflow, TOPOLOGIES["2x2"], "stream", 4, [1, 3], 10, timeout=120)
    for r in res[:2]:
        assert r["scales"][1] == 512.0 and r["scales"][3] == 256.0, r["scales"]
    for r in res[2:]:
        assert r["scales"] == [1024.0] * 10, r["scales"]
    for r in res:
        assert r["identical"], "ranks differ after synchronize()"
        assert r["last_loss"] == r["last_loss"]


def test_each_rank_must_load_its_own_shards():
    # with an attached optimizer a rank's state_dict holds its 1/L shard of the local-SGD state
    for r, msg in enumerate(launch(ranks.load_another_ranks_state, TOPOLOGIES["2x2"])):
        assert f"holds the shards of local rank {(r ^ 1) % 2}" in msg and "every rank must save and load its own" in msg
