"""period=k: hierarchical local SGD against a hand-written reference (2x2 unless said).

``ranks.localsgd_check`` asserts after every step, on every rank: intra-node replicas are
bitwise identical; hiersync equals the reference (rtol 1e-5 without compression); steps
< warmup equal DDP's default; with an attached optimizer (no overlap) all ranks are
bitwise identical right after each sync step.
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

# Every test here runs twice: as is, and under emulated NCCL completion (harness.nccl_mode).
pytestmark = pytest.mark.usefixtures("nccl_mode")

CASES = {
    "hook": dict(mode="hook", period=3, warmup=2, steps=9),
    "blocking": dict(mode="blocking", period=3, warmup=2, steps=9),
    "overlap": dict(mode="overlap", period=3, warmup=1, steps=9),
    "hook_no_sync": dict(mode="hook", period=2, warmup=1, steps=6, accum=2),
    "blocking_no_sync": dict(mode="blocking", period=2, warmup=1, steps=6, accum=2),
    "outer_nesterov": dict(mode="blocking", period=2, steps=7, outer=(0.7, 0.9)),
    # outer_optimizer=: torch's SGD with Nesterov (outer_lr's maths), Adam, a user's own optimizer
    "outer_optimizer_sgd_nesterov": dict(mode="blocking", period=2, steps=7, outer_opt="sgd_nesterov"),
    "outer_optimizer_adam": dict(mode="overlap", period=2, steps=7, outer_opt="adam"),
    "outer_optimizer_mine": dict(mode="blocking", period=2, warmup=1, steps=7, outer_opt="mine"),
    "hook_outer_nesterov": dict(mode="hook", period=2, steps=7, outer=(0.7, 0.9)),
    "bucket_view_static_graph": dict(
        mode="hook", period=2, steps=6, ddp={"gradient_as_bucket_view": True, "static_graph": True}
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_2x2(case):
    cfg = CASES[case]
    res = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], cfg)
    for r in res:
        # the schedule: sync steps are exactly (s - W + 1) % k == 0 after warmup
        assert r["sync_steps"] == r["expected_sync_steps"] != []
        assert r["stats"]["steps"] == cfg["steps"]
        assert r["stats"]["exact_steps"] == min(cfg.get("warmup", 0), cfg["steps"])
        assert r["nodes_differed"], "between syncs the nodes should drift apart"
        assert r["stats"]["bytes_sent"]["inter"] > 0


@pytest.mark.parametrize("name", ["noncontiguous", "uneven", "2x1"])
@pytest.mark.parametrize("mode", ["hook", "blocking"])
def test_matches_reference_other_topologies(name, mode):
    cfg = dict(mode=mode, period=2, warmup=1, steps=5)
    res = launch(ranks.localsgd_check, TOPOLOGIES[name], cfg)
    assert res[0]["sync_steps"] == [2, 4]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(mode="blocking", period=2, steps=6, compress="bf16"),
        dict(mode="hook", period=2, steps=6, compress="fp16"),
        dict(mode="overlap", period=2, steps=7, compress="bf16", outer=(0.7, 0.9)),
    ],
    ids=["blocking_bf16", "hook_fp16", "overlap_bf16_outer"],
)
def test_compression_error_is_bounded_by_the_delta(cfg):
    res = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], cfg)
    eps = torch.finfo(torch.bfloat16 if cfg["compress"] == "bf16" else torch.float16).eps
    for r in res:
        # within a few roundings of the *delta* ...
        assert r["worst_vs_reference"] <= 4 * eps * r["max_delta"], r
        # ... and far below what rounding the parameters themselves to 16 bits would cost
        assert r["worst_vs_reference"] < 0.25 * eps * r["param_scale"], r


def test_local_steps_send_nothing_across_nodes():
    cfg = dict(mode="blocking", period=100, steps=4)
    res = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], cfg)
    assert res[0]["stats"]["bytes_sent"]["inter"] == 0
    assert res[0]["stats"]["local_steps"] == 4


CKPT_CASES = {
    "hook": dict(mode="hook", period=3, warmup=1),
    "blocking": dict(mode="blocking", period=3, warmup=1),
    "overlap": dict(mode="overlap", period=2, warmup=1),
    "overlap_outer_optimizer_adam": dict(mode="overlap", period=2, outer_opt="adam"),
    "overlap_bf16_outer": dict(mode="overlap", period=2, compress="bf16", outer=(0.7, 0.9)),
    "hook_bf16_outer": dict(mode="hook", period=2, compress="bf16", outer=(0.7, 0.9)),
    "overlap_int4_optimizer_state": dict(mode="overlap", period=2, compress="int4", avg_state=True),
}


@pytest.mark.parametrize("case", list(CKPT_CASES))
def test_checkpoint_resume_in_new_processes_is_exact(case, tmp_path):
    cfg = CKPT_CASES[case]
    n = 4  # overlap/period 2: the save lands with a correction in flight
    assert_checkpoint_resumes_exactly(cfg, str(tmp_path), n)


@pytest.mark.parametrize("name", ["2x2", "uneven"])
def test_synchronize_makes_every_rank_the_world_mean(name):
    res = launch(ranks.synchronize_check, TOPOLOGIES[name], "blocking")
    assert res[0]["differed_before"]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(mode="blocking", period=3, warmup=1, steps=8, avg_state=True),
        dict(mode="overlap", period=2, steps=7, avg_state=True, outer=(0.7, 0.9)),
        dict(mode="stream", period=4, fragments=2, tau=1, steps=9, avg_state=True),
        dict(mode="stream", period=4, fragments=4, tau=0, steps=9, avg_state=True, compress="bf16"),
    ],
    ids=["blocking", "overlap_outer", "stream_tau1", "stream_blocking_bf16"],
)
def test_optimizer_state_is_averaged_with_the_parameters(cfg):
    """SGD's momentum buffers averaged across nodes at each sync (average_optimizer_state),
    against the reference doing the same by hand."""
    res = launch(ranks.localsgd_check, TOPOLOGIES["2x2"], cfg)
    for r in res:
        assert r["sync_steps"] == r["expected_sync_steps"] != []
        if cfg.get("compress"):  # bf16 deltas (parameters) and bf16 values (state): a few roundings
            assert r["worst_vs_reference"] < 1e-2, r
