"""Python overhead of the DDP comm hook per bucket, next to DDP's default and PyTorch's hooks.

A model of 16 tiny Linear layers with 100-byte buckets gives DDP 32 buckets per backward,
so a backward is dominated by per-bucket overhead, not by arithmetic or bytes. Competitors
in one group per world size: ``ddp_default`` (no hook, C++ all-reduce), ``noop_hook``
(Python hook that communicates nothing), ``torch_allreduce_hook``, ``hiersync_p1`` and
``hiersync_p4``. For hiersync the time spent inside ``hiersync.hook`` itself is recorded
per bucket in ``extra_info['hook_us_per_bucket']`` (median); the target is <= 30 us, a
number to read, not an assertion (timings on a shared 2-core box are not a test).
World 1 runs in this process; world 2 adds one helper process (see ``_peers.py``).

Every variant's gradients after the timed backward are checked against the average of
every rank's own gradient, computed here without DDP (``noop_hook``: rank 0's own): that
holds in the default run too, where ``--benchmark-disable`` runs the backward once.
"""

from __future__ import annotations

import copy
import statistics

import _peers
import pytest
import torch
from _peers import PeerWorld

LAYERS = 16
VARIANTS = ["ddp_default", "noop_hook", "torch_allreduce_hook", "hiersync_p1", "hiersync_p4"]


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def world(request):
    with PeerWorld(request.param, timeout=30) as w:
        yield w


def _expected_grads(world_size: int, averaged: bool) -> list[torch.Tensor]:
    """The gradients the hook should leave on rank 0: the mean over ranks of each rank's own
    (``averaged``), or rank 0's own. Every rank holds rank 0's parameters (DDP broadcast them,
    and no step changed them); rank r's input is ``_peers``' ``randn`` seeded with r."""
    ddp = _peers._STATE["ddp"]
    model = copy.deepcopy(ddp.module)
    inputs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    assert torch.equal(inputs[0], _peers._STATE["x"])  # the rule that built rank 0's input
    grads = [torch.autograd.grad(model(x).square().mean(), list(model.parameters())) for x in inputs]
    if not averaged:
        return list(grads[0])
    return [torch.stack(per_rank).mean(0) for per_rank in zip(*grads)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_backward_32_buckets(benchmark, world, variant):
    benchmark.group = f"hook-overhead-world{world.world_size}"
    benchmark.extra_info["buckets"] = 2 * LAYERS
    world.call("ddp_setup", variant, LAYERS)
    try:
        benchmark.pedantic(
            world.call, args=("backward",), setup=lambda: world.call("forward"), rounds=20, warmup_rounds=2
        )
        # the last backward's gradients (forward() cleared the ones before it)
        got = [p.grad for p in _peers._STATE["ddp"].parameters()]
        want = _expected_grads(world.world_size, averaged=variant != "noop_hook")
        assert len(got) == len(want) == 2 * LAYERS
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        ns = world.call("hook_ns")
        if variant.startswith("hiersync"):
            assert len(ns) >= 2 * LAYERS  # the hook saw every bucket
            benchmark.extra_info["hook_us_per_bucket"] = statistics.median(ns) / 1e3
    finally:
        world.call("teardown")
