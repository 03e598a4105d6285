"""Cost-model evaluation speed: the planner evaluates these formulas thousands of times.

Skipped when ``hiersync.costmodel`` (or its ``allreduce_time``) is not there.
"""

from __future__ import annotations

import pytest

costmodel = pytest.importorskip("hiersync.costmodel")
if not hasattr(costmodel, "allreduce_time"):
    pytest.skip("hiersync.costmodel has no allreduce_time", allow_module_level=True)

LINK = costmodel.Link(alpha=1e-5, beta=1e-9)
INTRA = costmodel.Link(alpha=5e-6, beta=1 / 300e9)


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_allreduce_time(benchmark, algorithm):
    benchmark.group = "costmodel-allreduce"
    t = benchmark(costmodel.allreduce_time, algorithm, 64, 100e6, LINK)
    assert t > 0


@pytest.mark.skipif(not hasattr(costmodel, "hierarchical_allreduce_time"), reason="no two-level formula")
@pytest.mark.parametrize("kind", ["flat", "two_level"])
def test_cluster_allreduce_time(benchmark, kind):
    benchmark.group = "costmodel-cluster"
    fn = costmodel.flat_allreduce_time if kind == "flat" else costmodel.hierarchical_allreduce_time
    t = benchmark(fn, 100e6, 16, 8, INTRA, LINK)
    assert t > 0
