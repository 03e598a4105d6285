"""Two-level vs flat all-reduce on a 2x2 world (4 ranks, ``HIERSYNC_NODE_IDS=0,0,1,1``).

Every rank talks over loopback here, so this measures the algorithms' CPU and latency
costs on gloo, not a slow inter-node link (``python -m hiersync collbench`` does that on
the emulated cluster). Grouped by message size so both algorithms appear side by side.
"""

from __future__ import annotations

import pytest
from _peers import PeerWorld

SIZES = {"64KB": 1 << 14, "1MB": 1 << 18, "8MB": 1 << 21}  # fp32 elements


@pytest.fixture(scope="module")
def world():
    with PeerWorld(4, node_ids=[0, 0, 1, 1], timeout=30) as w:
        yield w


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("kind", ["two_level", "flat"])
def test_allreduce(benchmark, world, kind, size):
    benchmark.group = f"allreduce-2x2-{size}"
    world.call("allreduce_setup", kind, SIZES[size])
    benchmark.pedantic(world.call, args=("allreduce", kind), rounds=10, warmup_rounds=1)
