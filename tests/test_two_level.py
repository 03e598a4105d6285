"""The two-level all-reduce equals a flat all-reduce divided by the world size."""

from __future__ import annotations

import pytest
import ranks
from harness import (
    TOPOLOGIES,
    launch,
    nccl_mode,  # noqa: F401  (a fixture, used by name)
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Every test here runs twice: as is, and under emulated NCCL completion (harness.nccl_mode).
pytestmark = pytest.mark.usefixtures("nccl_mode")

EDGE_SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 1000, 1001, 9999, 10_000]


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_edge_sizes_equal_flat(name):
    res = launch(ranks.allreduce_sizes, TOPOLOGIES[name], EDGE_SIZES)
    assert all(r["count"] == len(EDGE_SIZES) for r in res)


@pytest.mark.parametrize("name", ["2x2", "noncontiguous"])
def test_edge_sizes_equal_flat_reduce_scatter_all_gather(name):
    # the NCCL default (reduce-scatter + all-gather), exercised here on gloo
    launch(ranks.allreduce_sizes, TOPOLOGIES[name], EDGE_SIZES, "float32", "rs_ag")


# Each example is one multi-process launch with many sizes in flight at once, so a few
# examples cover hundreds of sizes; hypothesis shrinks a failing list to the bad size.
@pytest.mark.parametrize("name", ["2x2", "uneven"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=40))
def test_property_random_sizes_equal_flat(name, sizes):
    launch(ranks.allreduce_sizes, TOPOLOGIES[name], sizes)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_buckets_2x2(dtype):
    # Summation order differs from gloo's ring, so compare at the dtype's resolution.
    launch(ranks.allreduce_sizes_lowp, TOPOLOGIES["2x2"], [1, 5, 100, 1001], dtype)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    node_ids=st.lists(st.integers(min_value=0, max_value=2), min_size=2, max_size=4),
    sizes=st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=12),
)
def test_property_random_layouts_and_sizes(node_ids, sizes):
    launch(ranks.allreduce_sizes, node_ids, sizes)
