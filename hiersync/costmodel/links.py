"""Alpha-beta(-gamma) cost of one collective on one link.

A :class:`Link` holds ``alpha`` (seconds per message or ring hop), ``beta`` (seconds per
byte on the wire) and ``gamma`` (seconds per byte of reduction compute). A collective on
``p`` ranks moving ``n`` bytes costs ``A(p) * alpha + B(p) * n * beta (+ C(p) * n * gamma)``;
docs/costmodel-formulas.md derives every ``A`` and ``B``. Every formula is affine in ``n``, so
:func:`collective_affine` returns the pair ``(latency_s, seconds_per_byte)`` that the
fitting (:mod:`.fit`) and the crossovers use. Pure: no torch.

Example::

    >>> link = Link(alpha=1e-5, beta=1e-9)
    >>> round(allreduce_time("ring", 8, 1e6, link), 6)
    0.00189
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_TREE_EFFICIENCY",
    "ALLREDUCE_ALGORITHMS",
    "COLLECTIVES",
    "Link",
    "check_number",
    "check_count",
    "check_efficiency",
    "ceil_log2",
    "collective_affine",
    "affine_crossover",
    "allreduce_time",
    "reduce_scatter_time",
    "all_gather_time",
    "broadcast_time",
    "reduce_time",
    "crossover_bytes",
]

# NCCL's tuning model multiplies the Tree all-reduce bus bandwidth by 0.92
# (src/graph/tuning.cc, "busBw*.92"): a pipelined tree never quite reaches line rate.
DEFAULT_TREE_EFFICIENCY = 0.92

ALLREDUCE_ALGORITHMS = ("ring", "tree", "binomial", "recursive_doubling", "rabenseifner")


def check_number(name: str, value: Any, *, low: float = 0.0, strict: bool = False) -> float:
    """``value`` as a finite float ``>= low`` (``> low`` when ``strict``); ``TypeError``/``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value < low or (strict and value == low):
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {op} {low:g}, got {value!r}")
    return value


def check_count(name: str, value: Any) -> int:
    """``value`` as an int ``>= 1``; ``TypeError``/``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class Link:
    """Cost of one level of the network in the alpha-beta(-gamma) model.

    Positional arguments are allowed (``Link(1e-5, 1e-9)``) because the order is the
    textbook one. Use :meth:`from_bandwidth` to build one from a latency and a bandwidth.
    """

    alpha: float
    """Latency in seconds per message (per ring step / tree level)."""
    beta: float
    """Transfer time in seconds per byte (1 / bandwidth of one GPU's or one NIC's link)."""
    gamma: float = 0.0
    """Reduction compute in seconds per byte (0 on GPUs, where it hides behind the wire)."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            object.__setattr__(self, name, check_number(f"Link.{name}", getattr(self, name)))

    @classmethod
    def from_bandwidth(cls, latency_s: float, bytes_per_s: float, *, gamma: float = 0.0) -> Link:
        """Build a link from a latency (s) and a bandwidth (bytes/s, not bits: 400 Gb/s = 50e9)."""
        bw = check_number("bytes_per_s", bytes_per_s, strict=True)
        return cls(latency_s, 1.0 / bw, gamma)

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``inf`` when ``beta`` is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def to_json(self) -> dict[str, float]:
        return {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Link:
        try:
            return cls(obj["alpha"], obj["beta"], obj.get("gamma", 0.0))
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"a link needs numeric 'alpha' and 'beta' (and optional 'gamma'), got {obj!r}") from err


# ---------------------------------------------------------------------------
# Single-level collectives. Each entry maps (p, lg, link, eta) to (latency_s,
# seconds_per_byte); time = latency + n * seconds_per_byte. lg = ceil(log2 p).

_Affine = Callable[[int, int, Link, float], "tuple[float, float]"]

_ALLREDUCE: dict[str, _Affine] = {
    "ring": lambda p, lg, l, eta: (2 * (p - 1) * l.alpha, (p - 1) / p * (2 * l.beta + l.gamma)),
    "tree": lambda p, lg, l, eta: (2 * lg * l.alpha, 2 * l.beta / eta + l.gamma),
    "binomial": lambda p, lg, l, eta: (2 * lg * l.alpha, lg * (2 * l.beta + l.gamma)),
    "recursive_doubling": lambda p, lg, l, eta: (lg * l.alpha, lg * (l.beta + l.gamma)),
    "rabenseifner": lambda p, lg, l, eta: (2 * lg * l.alpha, (p - 1) / p * (2 * l.beta + l.gamma)),
}
# reduce-scatter: n is the whole input of one rank (each rank ends with n / p).
_REDUCE_SCATTER: dict[str, _Affine] = {
    "ring": lambda p, lg, l, eta: ((p - 1) * l.alpha, (p - 1) / p * (l.beta + l.gamma)),
    "recursive_halving": lambda p, lg, l, eta: (lg * l.alpha, (p - 1) / p * (l.beta + l.gamma)),
}
# all-gather: n is the whole output (each rank contributes n / p), as in nccl-tests.
_ALL_GATHER: dict[str, _Affine] = {
    "ring": lambda p, lg, l, eta: ((p - 1) * l.alpha, (p - 1) / p * l.beta),
    "recursive_doubling": lambda p, lg, l, eta: (lg * l.alpha, (p - 1) / p * l.beta),
}
_BROADCAST: dict[str, _Affine] = {
    "binomial": lambda p, lg, l, eta: (lg * l.alpha, lg * l.beta),
    "ring": lambda p, lg, l, eta: ((p - 1) * l.alpha, l.beta),  # pipelined chain
    "scatter_allgather": lambda p, lg, l, eta: ((lg + p - 1) * l.alpha, 2 * (p - 1) / p * l.beta),
}
_REDUCE: dict[str, _Affine] = {
    "binomial": lambda p, lg, l, eta: (lg * l.alpha, lg * (l.beta + l.gamma)),
    "ring": lambda p, lg, l, eta: ((p - 1) * l.alpha, l.beta + l.gamma),  # pipelined chain
    "rabenseifner": lambda p, lg, l, eta: (2 * lg * l.alpha, (p - 1) / p * (2 * l.beta + l.gamma)),
}
COLLECTIVES: dict[str, dict[str, _Affine]] = {
    "allreduce": _ALLREDUCE,
    "reduce_scatter": _REDUCE_SCATTER,
    "all_gather": _ALL_GATHER,
    "broadcast": _BROADCAST,
    "reduce": _REDUCE,
}
"""Collective name -> algorithm name -> ``(p, ceil_log2(p), link, eta) -> (latency_s, seconds_per_byte)``."""


def ceil_log2(p: int) -> int:
    """``ceil(log2 p)`` for ``p >= 1``: the rounds of a binomial tree or recursive doubling."""
    return (p - 1).bit_length()


def check_efficiency(efficiency: float) -> float:
    """``efficiency`` (eta) as a fraction of line rate in ``(0, 1]``; ``ValueError`` otherwise."""
    eta = check_number("efficiency", efficiency, strict=True)
    if eta > 1.0:
        raise ValueError(f"efficiency is a fraction of line rate in (0, 1], got {eta!r}")
    return eta


def collective_affine(
    collective: str, algorithm: str, ranks: int, link: Link, efficiency: float = DEFAULT_TREE_EFFICIENCY
) -> tuple[float, float]:
    """``(latency_s, seconds_per_byte)`` of ``collective`` by ``algorithm`` on ``ranks`` ranks of ``link``.

    The time of ``n`` bytes is ``latency_s + n * seconds_per_byte``; one rank costs nothing.
    """
    table = COLLECTIVES[collective]
    if algorithm not in table:
        raise ValueError(f"unknown {collective} algorithm {algorithm!r}; valid: {', '.join(table)}")
    p = check_count("ranks", ranks)
    if not isinstance(link, Link):
        raise TypeError(f"link must be a hiersync.costmodel.Link, got {type(link).__name__}")
    eta = check_efficiency(efficiency)
    if p == 1:
        return 0.0, 0.0  # nothing to communicate
    return table[algorithm](p, ceil_log2(p), link, eta)


def _time(collective: str, algorithm: str, ranks: int, nbytes: float, link: Link, efficiency: float) -> float:
    n = check_number("nbytes", nbytes)
    a, b = collective_affine(collective, algorithm, ranks, link, efficiency)
    return a + b * n


def allreduce_time(
    algorithm: str, ranks: int, nbytes: float, link: Link, *, efficiency: float = DEFAULT_TREE_EFFICIENCY
) -> float:
    """Seconds to all-reduce ``nbytes`` per rank over ``ranks`` ranks on one ``link``.

    ``algorithm`` is one of :data:`ALLREDUCE_ALGORITHMS`; ``efficiency`` (eta) is the
    fraction of line rate a pipelined ``"tree"`` reaches (NCCL models 0.92).
    """
    return _time("allreduce", algorithm, ranks, nbytes, link, efficiency)


def reduce_scatter_time(algorithm: str, ranks: int, nbytes: float, link: Link) -> float:
    """Seconds to reduce-scatter an ``nbytes`` input (each rank keeps ``nbytes / ranks``)."""
    return _time("reduce_scatter", algorithm, ranks, nbytes, link, DEFAULT_TREE_EFFICIENCY)


def all_gather_time(algorithm: str, ranks: int, nbytes: float, link: Link) -> float:
    """Seconds to all-gather into an ``nbytes`` output (each rank brings ``nbytes / ranks``)."""
    return _time("all_gather", algorithm, ranks, nbytes, link, DEFAULT_TREE_EFFICIENCY)


def broadcast_time(algorithm: str, ranks: int, nbytes: float, link: Link) -> float:
    """Seconds to broadcast ``nbytes`` from one rank: ``"binomial"``, ``"ring"``, ``"scatter_allgather"``."""
    return _time("broadcast", algorithm, ranks, nbytes, link, DEFAULT_TREE_EFFICIENCY)


def reduce_time(algorithm: str, ranks: int, nbytes: float, link: Link) -> float:
    """Seconds to reduce ``nbytes`` onto one rank: ``"binomial"``, ``"ring"``, ``"rabenseifner"``."""
    return _time("reduce", algorithm, ranks, nbytes, link, DEFAULT_TREE_EFFICIENCY)


def affine_crossover(first: tuple[float, float], second: tuple[float, float]) -> float:
    """Bytes at which two affine costs ``(latency_s, seconds_per_byte)`` are equal; ``inf`` if never for n > 0."""
    (a1, b1), (a2, b2) = first, second
    if b1 == b2:
        return math.inf
    n = (a2 - a1) / (b1 - b2)
    return n if n > 0 else math.inf


def crossover_bytes(
    ranks: int,
    link: Link,
    first: str = "ring",
    second: str = "tree",
    *,
    efficiency: float = DEFAULT_TREE_EFFICIENCY,
) -> float:
    """Message size (bytes) at which two all-reduce algorithms take equal time on one link.

    Every formula is affine in n, so ``n* = (A2 - A1) / (B1 - B2)``. Below n* the
    algorithm with less latency wins, above it the one with less time per byte. Returns
    ``math.inf`` when they never trade places for n > 0 (one is never slower).
    """
    return affine_crossover(
        collective_affine("allreduce", first, ranks, link, efficiency),
        collective_affine("allreduce", second, ranks, link, efficiency),
    )
