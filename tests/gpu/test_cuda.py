"""The CUDA/NCCL path: skipped without a GPU, run with ``pytest -m cuda tests/gpu``.

CUDA_LAUNCH_BLOCKING must be off (it would hide every missing stream wait). Worlds:
NCCL with one rank per GPU (world = number of GPUs, at least 1), and gloo with several
ranks sharing one GPU (gloo all-reduces CUDA tensors through the host, through futures
that complete like NCCL's do not: both paths are checked).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import cuda_ranks

from hiersync.tools.launch import run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ENV = {"CUDA_LAUNCH_BLOCKING": "0"}


def _worlds():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl_ids = [0] * max(1, n // 2) + [1] * (n - max(1, n // 2)) if n >= 2 else [0]
    return [("nccl", nccl_ids), ("gloo", [0, 0, 1, 1])]


@pytest.mark.parametrize("backend, node_ids", _worlds(), ids=lambda v: str(v))
def test_two_level_allreduce_on_cuda(backend, node_ids):
    worst = run(
        cuda_ranks.two_level_sizes,
        len(node_ids),
        ([1, 7, 1000, 65_537, 1 << 20],),
        node_ids=node_ids,
        backend=backend,
        env=ENV,
        timeout=300,
    )
    assert max(worst) <= 1e-5, worst


@pytest.mark.parametrize("backend, node_ids", _worlds(), ids=lambda v: str(v))
@pytest.mark.parametrize(
    "period, options",
    [
        (1, {}),
        (1, {"_nan_step": 2}),
        (3, {"overlap": True, "compress": "bf16"}),
        (3, {"outer_lr": 0.7, "outer_momentum": 0.9}),
        (4, {"fragments": 4, "overlap": 2, "compress": "bf16", "outer_lr": 0.7, "outer_momentum": 0.9}),
        (4, {"fragments": 2, "overlap": 1, "outer_lr": 0.7, "outer_momentum": 0.9, "state_device": "cpu"}),
    ],
    ids=["parity", "nan_guard", "overlap_bf16", "outer", "stream_bf16", "stream_state_on_host"],
)
def test_hook_on_cuda(backend, node_ids, period, options):
    res = run(
        cuda_ranks.hook_parity,
        len(node_ids),
        (period, 8, dict(options)),
        node_ids=node_ids,
        backend=backend,
        env=ENV,
        timeout=300,
    )
    for r in res:
        assert r["identical"], r
        if period == 1 and "_nan_step" not in options:
            assert r["max_diff_vs_ddp"] <= 1e-5, r
    if "_nan_step" in options:
        assert all(r["skips"] == 1 for r in res), res
