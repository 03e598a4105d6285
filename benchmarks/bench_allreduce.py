"""Two-level vs flat all-reduce on a 2x2 world (4 ranks, ``HIERSYNC_NODE_IDS=0,0,1,1``).

Every rank talks over loopback here, so this measures the algorithms' CPU and latency
costs on gloo, not a slow inter-node link (``python -m hiersync collbench`` does that on
the emulated cluster). Grouped by message size so both algorithms appear side by side.
Before the timing, each algorithm's result is checked against the average computed here:
ranks 1-3 hold ones, rank 0 (this process) a pattern that tells every element apart.
"""

from __future__ import annotations

import _peers
import pytest
import torch
from _peers import PeerWorld

SIZES = {"64KB": 1 << 14, "1MB": 1 << 18, "8MB": 1 << 21}  # fp32 elements


@pytest.fixture(scope="module")
def world():
    with PeerWorld(4, node_ids=[0, 0, 1, 1], timeout=30) as w:
        yield w


def _mine() -> torch.Tensor:
    """Rank 0's tensor: rank 0 is this process, and the all-reduce averages it in place."""
    return _peers._STATE["tensor"]


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("kind", ["two_level", "flat"])
def test_allreduce(benchmark, world, kind, size):
    benchmark.group = f"allreduce-2x2-{size}"
    world.call("allreduce_setup", kind, SIZES[size])  # every rank: ones, averaged once
    pattern = (torch.arange(SIZES[size]) % 8).float()  # 0..7: a shard moved or dropped shows
    _mine().copy_(pattern)
    world.call("allreduce", kind)
    # (pattern + 1 + 1 + 1) / 4; exact in fp32 (small integers over a power of two)
    expected = (pattern + 3) / 4
    torch.testing.assert_close(_mine(), expected, rtol=1e-6, atol=1e-6)
    benchmark.pedantic(world.call, args=("allreduce", kind), rounds=10, warmup_rounds=1)
    # every round averaged what every rank held: unchanged only if all four ranks got the same result
    torch.testing.assert_close(_mine(), expected, rtol=1e-6, atol=1e-6)
