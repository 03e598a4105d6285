"""period=1: DDP + hiersync.hook trains exactly like DDP's default all-reduce."""

from __future__ import annotations

import pytest
import ranks
from harness import (
    TOPOLOGIES,
    launch,
    nccl_mode,  # noqa: F401  (a fixture, used by name)
)

# Every test here runs twice: as is, and under emulated NCCL completion (harness.nccl_mode).
pytestmark = pytest.mark.usefixtures("nccl_mode")

ALL_VARIANTS = list(ranks.DDP_VARIANTS)


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_parity_with_ddp_default(name):
    """>= 5 optimizer steps, every parameter to rtol 1e-5 / atol 1e-6, every DDP option."""
    ids = TOPOLOGIES[name]
    # bf16 sums over 3+ ranks round in a different order than gloo's ring (see ranks.ddp_parity)
    low_precision_tol = len(ids) > 2
    res = launch(ranks.ddp_parity, ids, ALL_VARIANTS, 6, None, low_precision_tol)
    for rank_res in res:
        for variant, r in rank_res.items():
            assert r["steps"] == 6 and r["exact"] == 6, (variant, r)
            if variant != "bf16_mixed" or not low_precision_tol:
                assert r["max_diff"] <= 1e-5, (variant, r)


@pytest.mark.parametrize(
    "options",
    [{"algorithm": "flat"}, {"algorithm": "auto"}, {"intra_algorithm": "rs_ag"}],
    ids=["flat", "auto", "reduce_scatter_all_gather"],
)
def test_parity_other_exact_algorithms(options):
    launch(ranks.ddp_parity, TOPOLOGIES["2x2"], ["plain", "tiny_buckets", "bucket_view"], 5, options)


def test_register_one_liner():
    res = launch(ranks.register_one_liner, TOPOLOGIES["2x2"])
    assert res[0]["steps"] == 5


def test_profiler_shows_each_phase():
    exact = launch(ranks.profiled_step, TOPOLOGIES["2x2"], 1)[0]
    # gloo's default intra algorithm: all-reduce in the node, broadcast the shards
    assert {
        "hiersync/hook_exact",
        "hiersync/intra_allreduce",
        "hiersync/inter_allreduce",
        "hiersync/intra_broadcast_shards",
    } <= set(exact), exact
    local = launch(ranks.profiled_step, TOPOLOGIES["2x2"], 2)[0]
    assert {
        "hiersync/hook_sync",
        "hiersync/hook_local",
        "hiersync/intra_allreduce",
        "hiersync/sync_after_step",
        "hiersync/inter_param_allreduce",
    } <= set(local), local
