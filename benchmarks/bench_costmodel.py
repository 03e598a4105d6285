"""Cost-model evaluation speed, and the values it evaluates: the planner runs these formulas thousands of times.

Each benchmarked call's result is checked against the alpha-beta formula of docs/costmodel-formulas.md
(the design brief's), written out by hand here for the benchmark's own inputs, so the run that
times a formula also proves it is the right one.
"""

from __future__ import annotations

import math

import pytest

from hiersync import costmodel

LINK = costmodel.Link(alpha=1e-5, beta=1e-9)
INTRA = costmodel.Link(alpha=5e-6, beta=1 / 300e9)
ETA = 0.92  # the pipelined tree's share of line rate (NCCL's "busBw * .92")

# p ranks, n bytes, one link (alpha a, beta b), lg = ceil(log2 p)
P, NBYTES = 64, 100e6
A, B = LINK.alpha, LINK.beta
ALGORITHMS = ("ring", "tree", "binomial", "recursive_doubling", "rabenseifner")


def by_hand(algorithm: str, p: int, n: float, a: float, b: float) -> float:
    """docs/costmodel-formulas.md's all-reduce on ``p`` ranks, ``n`` bytes, latency ``a``, ``b`` seconds a byte."""
    lg = math.ceil(math.log2(p))
    return {
        "ring": 2 * (p - 1) * a + 2 * (p - 1) / p * n * b,
        "tree": 2 * lg * a + 2 * n * b / ETA,
        "binomial": 2 * lg * (a + n * b),
        "recursive_doubling": lg * (a + n * b),
        "rabenseifner": 2 * lg * a + 2 * (p - 1) / p * n * b,
    }[algorithm]


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_allreduce_time(benchmark, algorithm):
    benchmark.group = "costmodel-allreduce"
    t = benchmark(costmodel.allreduce_time, algorithm, P, NBYTES, LINK)
    assert t == pytest.approx(by_hand(algorithm, P, NBYTES, A, B), rel=1e-12)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("ranks", [2, 64, 100])  # a pair, a power of two, and lg rounded up
def test_allreduce_time_by_hand(algorithm, ranks):
    n, a, b = 8e6, 2e-5, 1 / 25e9
    expected = by_hand(algorithm, ranks, n, a, b)
    assert costmodel.allreduce_time(algorithm, ranks, n, costmodel.Link(a, b)) == pytest.approx(expected, rel=1e-12)
    assert costmodel.allreduce_time(algorithm, 1, n, costmodel.Link(a, b)) == 0.0  # one rank sends nothing


# N = 16 nodes of L = 8 ranks, one NIC per rank (R = L), 100 MB per rank
N, L, R = 16, 8, 8
CLUSTER = {
    # DDP's flat ring over p = N L ranks: the critical path walks 2(p-1) hops, 2N of them across
    # nodes; a node pushes 2(p-1)/p n through its R NICs, so a byte costs max(b_i, b_e / R).
    "flat": (2 * N) * LINK.alpha
    + (2 * (N * L - 1) - 2 * N) * INTRA.alpha
    + 2 * (N * L - 1) / (N * L) * NBYTES * max(INTRA.beta, LINK.beta / R),
    # hiersync's exact path: intra reduce-scatter, ring all-reduce of n/L on each rail of N ranks
    # (its own NIC: beta_rail = b_e L / R = b_e), intra all-gather.
    "two_level": ((L - 1) * INTRA.alpha + (L - 1) / L * NBYTES * INTRA.beta)
    + (2 * (N - 1) * LINK.alpha + 2 * (N - 1) / N * (NBYTES / L) * LINK.beta)
    + ((L - 1) * INTRA.alpha + (L - 1) / L * NBYTES * INTRA.beta),
}


@pytest.mark.parametrize("kind", ["flat", "two_level"])
def test_cluster_allreduce_time(benchmark, kind):
    benchmark.group = "costmodel-cluster"
    fn = costmodel.flat_allreduce_time if kind == "flat" else costmodel.hierarchical_allreduce_time
    t = benchmark(fn, NBYTES, N, L, INTRA, LINK)
    assert t == pytest.approx(CLUSTER[kind], rel=1e-12)


def test_two_level_on_gloo_and_with_shared_nics_by_hand():
    """gloo's variant (intra all-reduce, rail leg, L binomial broadcasts of n/L) and R < L NICs."""
    n, nodes, lpn, rails = 40e6, 4, 4, 1
    rail_beta = LINK.beta * lpn / rails  # the 4 rails share one NIC
    rail = 2 * (nodes - 1) * LINK.alpha + 2 * (nodes - 1) / nodes * (n / lpn) * rail_beta
    intra_ar = 2 * (lpn - 1) * INTRA.alpha + 2 * (lpn - 1) / lpn * n * INTRA.beta
    bcasts = lpn * math.ceil(math.log2(lpn)) * (INTRA.alpha + n / lpn * INTRA.beta)
    t = costmodel.hierarchical_allreduce_time(n, nodes, lpn, INTRA, LINK, rails, backend="gloo")
    assert t == pytest.approx(intra_ar + rail + bcasts, rel=1e-12)
    # the period-k parameter average skips the intra reduction: the rail leg and the gather of n
    gather = (lpn - 1) * INTRA.alpha + (lpn - 1) / lpn * n * INTRA.beta
    assert costmodel.param_sync_time(n, nodes, lpn, INTRA, LINK, rails) == pytest.approx(rail + gather, rel=1e-12)
