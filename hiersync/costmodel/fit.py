"""Fitting ``alpha`` and ``beta`` of a :class:`~.links.Link` to measured collective times.

``python -m hiersync calibrate`` times all-reduces per level and hands them to
:func:`fit_link`; under NCCL it also fits the fabric's latency with NCCL's own model
(:func:`fit_net_latency`). :func:`fit_switch_tiers` fits the switch tiers' bandwidth loss to
all-reduces measured at several node counts (nccl-tests on 2, 4, ... 32 nodes), which one
calibration on one cluster size cannot see. Pure (numpy, imported on first use): no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .links import COLLECTIVES, DEFAULT_TREE_EFFICIENCY, Link, collective_affine

if TYPE_CHECKING:
    from .profile import Profile

__all__ = ["LinkFit", "fit_link", "fit_net_latency", "fit_nccl_profile", "fit_switch_tiers"]


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """Result of :func:`fit_link`."""

    link: Link
    """Fitted link; its beta absorbs any reduction cost (gamma is left at 0)."""
    r2: float
    """Coefficient of determination of the fitted times against the measured ones."""
    max_rel_error: float
    """Largest ``|predicted - measured| / measured`` over the points."""
    num_points: int
    """Number of (size, time) points used."""


def fit_link(
    sizes_bytes: Sequence[float],
    times_s: Sequence[float],
    *,
    ranks: int,
    collective: str = "allreduce",
    algorithm: str = "ring",
    efficiency: float = DEFAULT_TREE_EFFICIENCY,
) -> LinkFit:
    """Fit ``alpha`` and ``beta`` to times of a known collective on ``ranks`` ranks.

    The model is ``t = A(p) * alpha + B(p) * n * beta`` with ``A``, ``B`` taken from the
    same formulas as :func:`allreduce_time` (or ``collective`` = ``"reduce_scatter"``,
    ``"all_gather"``, ``"broadcast"``, ``"reduce"``). Least squares on *relative* errors
    (each row divided by its measured time), so a 4 KB point weighs as much as a 256 MB
    one and alpha is not lost in the noise of the large messages. A negative estimate is
    clamped to 0 and the other parameter refitted.
    """
    import numpy as np

    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"sizes_bytes and times_s must be 1-D and equally long, got {n.shape} and {t.shape}")
    if len(np.unique(n)) < 2:
        raise ValueError(f"need at least 2 distinct message sizes to fit alpha and beta, got {n.tolist()}")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(n >= 0)):
        raise ValueError("times_s must be finite and > 0 and sizes_bytes >= 0")
    a_coef = collective_affine(collective, algorithm, ranks, Link(1.0, 0.0), efficiency)[0]
    b_coef = collective_affine(collective, algorithm, ranks, Link(0.0, 1.0), efficiency)[1]
    if a_coef == 0 or b_coef == 0:
        raise ValueError(f"{collective} on ranks={ranks} moves nothing; fit with ranks >= 2")
    x = np.stack([np.full_like(n, a_coef), b_coef * n], axis=1) / t[:, None]
    y = np.ones_like(t)
    theta = np.linalg.lstsq(x, y, rcond=None)[0]
    if np.any(theta < 0):  # two-parameter NNLS: keep the better one-parameter fit
        keep = int(np.argmax(theta))
        theta = np.zeros(2)
        theta[keep] = max(0.0, float(x[:, keep] @ y / (x[:, keep] @ x[:, keep])))
    pred = a_coef * theta[0] + b_coef * n * theta[1]
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0)
    return LinkFit(
        link=Link(float(theta[0]), float(theta[1])),
        r2=r2,
        max_rel_error=float(np.max(np.abs(pred - t) / t)),
        num_points=len(t),
    )


def _golden(loss, lo: float, hi: float, *, steps: int = 60) -> float:
    """The minimum of a unimodal ``loss`` on ``[lo, hi]`` by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(steps):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = loss(b)
    return (lo + hi) / 2


def _relative_loss(points: Sequence[tuple[float, float]], predict) -> float:
    return sum((predict(n) / t - 1) ** 2 for n, t in points)


def _check_points(name: str, points: Sequence[tuple[float, float]]) -> None:
    if not points or any(not (n >= 0 and t > 0) for n, t in points):
        raise ValueError(f"{name}: need (bytes >= 0, seconds > 0) points, got {list(points)[:3]}...")


def fit_net_latency(points: Sequence[tuple[float, float]], profile: Profile, *, high_us: float = 2000.0) -> float:
    """The fabric latency (:attr:`Profile.net_latency_us`, microseconds) that best fits rail all-reduce times.

    ``points`` are ``(bytes, seconds)`` all-reduces on one rail of ``profile`` (one rank per
    node, every rail at once, as ``python -m hiersync calibrate`` times them);
    :func:`~.predict.predict_allreduce` of :func:`~.predict.rail_profile` is the model.
    Least squares on relative errors, by golden-section search over ``[0, high_us]``.
    """
    from .predict import predict_allreduce, rail_profile

    _check_points("fit_net_latency", points)

    def loss(us: float) -> float:
        rail = rail_profile(replace(profile, net_latency_us=us))
        return _relative_loss(points, lambda n: predict_allreduce(n, rail))

    best = _golden(loss, 0.0, float(high_us))
    return 0.0 if loss(0.0) <= loss(best) else best


def fit_nccl_profile(
    profile: Profile,
    *,
    intra: Sequence[tuple[float, float]] = (),
    reduce_scatter: Sequence[tuple[float, float]] = (),
    rail: Sequence[tuple[float, float]] = (),
) -> Profile:
    """``profile`` with NCCL's inputs fitted to measured ``(bytes, seconds)`` points.

    The node's ring bus bandwidth to its ``reduce_scatter`` (NCCL runs it as a ring), NVLS's
    to its ``intra`` all-reduces where that beats the ring (else no NVLS), and the NIC rate and
    the fabric latency to the ``rail`` all-reduces, each by least squares on relative errors
    with :func:`~.predict.predict_allreduce` (and its reduce-scatter) as the model: the fit
    follows what NCCL's tuner runs at every size, protocol changes included.
    """
    from .predict import node_profile, predict_allreduce, predict_reduce_scatter, rail_profile

    def log_fit(loss, value: float) -> float:  # a bandwidth within 100x of a first guess
        # A coarse scan first: where NCCL's tuner switches algorithm the loss jumps, so it has
        # several valleys; golden-section search then refines the deepest one.
        grid = [math.log(value / 100) + i * math.log(1e4) / 40 for i in range(41)]
        best = min(range(len(grid)), key=lambda i: loss(math.exp(grid[i])))
        lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
        return math.exp(_golden(lambda x: loss(math.exp(x)), lo, hi))

    prof = profile
    if reduce_scatter:
        _check_points("reduce_scatter", reduce_scatter)

        def rs_loss(bw: float) -> float:
            node = node_profile(replace(prof, intra=Link(prof.intra.alpha, 1 / bw)))
            return _relative_loss(reduce_scatter, lambda n: predict_reduce_scatter(n, node))

        prof = replace(prof, intra=Link(prof.intra.alpha, 1 / log_fit(rs_loss, prof.intra.bandwidth)))
    if intra:
        _check_points("intra", intra)

        def ar_loss(gbps: float | None) -> float:
            node = node_profile(replace(prof, nvls_gbps=gbps))
            return _relative_loss(intra, lambda n: predict_allreduce(n, node))

        nvls = log_fit(ar_loss, (prof.nvls_gbps or prof.intra.bandwidth / 1e9))
        prof = replace(prof, nvls_gbps=nvls if ar_loss(nvls) < ar_loss(None) else None)
    if rail and prof.nodes > 1:
        _check_points("rail", rail)
        for _ in range(3):  # the NIC rate and the latency, alternately

            def nic_loss(bw: float, base: Profile = prof) -> float:
                one = rail_profile(replace(base, inter=Link(base.inter.alpha, 1 / bw)))
                return _relative_loss(rail, lambda n: predict_allreduce(n, one))

            bw = log_fit(nic_loss, prof.inter.bandwidth)
            prof = replace(prof, inter=Link(prof.inter.alpha, 1 / bw))
            prof = replace(prof, net_latency_us=fit_net_latency(rail, prof))
    return prof


def fit_switch_tiers(
    points: Sequence[tuple[int, float, float]], profile: Profile, *, leaves: Sequence[int] = (2, 4, 8, 16, 32)
) -> Profile:
    """``profile`` with :attr:`~.profile.Profile.leaf_nodes` and :attr:`~.profile.Profile.tier_efficiency`
    fitted to ``(nodes, bytes, seconds)`` all-reduces of the whole job (nccl-tests' out-of-place
    time) at several node counts, ``profile.ranks_per_node`` ranks each.

    For every leaf size of ``leaves``, the efficiency per tier (golden-section search over
    0.5-1) with the least squared log error of :func:`~.predict.predict_allreduce`; then the
    best leaf. A flat network (``leaf_nodes=0``) where no tier improves the fit, as on a
    fabric whose measurements span one leaf. Fit the fabric latency first (calibrate).
    """
    from .predict import predict_allreduce

    if not points or any(not (int(n) >= 1 and b >= 0 and t > 0) for n, b, t in points):
        raise ValueError(f"fit_switch_tiers: need (nodes >= 1, bytes >= 0, seconds > 0) points, got {list(points)[:3]}")

    def loss(leaf: int, efficiency: float) -> float:
        shaped = replace(profile, leaf_nodes=leaf, tier_efficiency=efficiency)
        return sum(math.log(predict_allreduce(b, shaped.with_shape(nodes=int(n))) / t) ** 2 for n, b, t in points)

    fits = [(leaf, _golden(lambda e, leaf=leaf: loss(leaf, e), 0.5, 1.0, steps=25)) for leaf in leaves]
    leaf, efficiency = min(fits, key=lambda f: loss(*f))
    if loss(leaf, efficiency) >= loss(0, 1.0):
        return replace(profile, leaf_nodes=0, tier_efficiency=1.0)
    return replace(profile, leaf_nodes=leaf, tier_efficiency=round(efficiency, 3))
