"""Fitting ``alpha`` and ``beta`` of a :class:`~.links.Link` to measured collective times.

``python -m hiersync calibrate`` times all-reduces per level and hands them to
:func:`fit_link`. Pure (numpy, imported on first use): no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .links import COLLECTIVES, DEFAULT_TREE_EFFICIENCY, Link, collective_affine

__all__ = ["LinkFit", "fit_link"]


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
