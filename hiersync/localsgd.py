"""The local-SGD maths every averager shares: the parameter registry, deltas, the outer step.

Between inter-node syncs every node trains on its own (gradients averaged inside the node
only), so the nodes' replicas drift apart. Averaging *gradients* once every k steps cannot
reconcile replicas that have already drifted; averaging *parameters* can (Lin et al.,
"Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020; torchft's LocalSGD).

Options, all off by default (plain averaging):

* ``codec`` (a :class:`~hiersync.quant.CastCodec`, ``compress="bf16"|"fp16"``): the
  inter-node leg carries the *delta* ``x - anchor`` in 16 bits, where the fp32 *anchor*
  is the result of the previous sync (identical on every rank). Raw parameters are never
  rounded to 16 bits: the error is bounded by the rounding of the (small) delta, not of
  the parameter.
* ``outer_lr``/``outer_momentum``: DiLoCo's outer Nesterov step (Douillard et al. 2023) on
  the averaged pseudo-gradient ``g = anchor - average``: ``m = mu*m + g``,
  ``x = anchor - lr*(g + mu*m)`` (:func:`outer_step`, the one implementation).
  ``outer_lr=1, outer_momentum=0`` is plain averaging.

Local-SGD state is keyed by parameter *position* in a :class:`Registry` filled in the order
the front-end first sees parameters (DDP's initial bucket order, deterministic for a given
model and DDP options; FSDP2's ``model.parameters()`` order), never by ``bucket.index()``.

Every cross-node average, after ``optimizer.step()`` or inside DDP's hook, is the engine's
(:mod:`hiersync.sync`) over the sharded averagers of :mod:`hiersync.averagers`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .quant import codec_for

__all__ = [
    "Registry",
    "chunk_by_bytes",
    "outer_step",
    "options_of",
    "missing_anchor",
]


def options_of(cfg: Any) -> dict[str, Any]:
    """The averager options of a :class:`~hiersync.config.HierConfig`: the payload's codec
    (:func:`hiersync.quant.codec_for`) and the outer step."""
    codec = codec_for(cfg.compress, cfg.error_feedback, cfg)
    check_outer_optimizer(cfg.outer_optimizer)
    return {
        "codec": codec,
        "outer_lr": cfg.outer_lr,
        "outer_momentum": cfg.outer_momentum,
        "outer_optimizer": cfg.outer_optimizer,
    }


def check_outer_optimizer(factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None) -> None:
    """Build ``factory``'s optimizer once on a tensor of one value: a ``TypeError`` now, not at the first sync."""
    if factory is None:
        return
    probe = factory([torch.zeros(1)])
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(
            f"outer_optimizer must return a torch.optim.Optimizer, got {type(probe).__name__}: e.g. "
            "outer_optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3)"
        )


def follows_shard(v: Any) -> bool:
    """Whether a value of an outer optimizer's state is a buffer of the shard (Adam's moments, kept
    where the anchor is kept), not a count (Adam's ``step``, a scalar tensor left where torch put it)."""
    return isinstance(v, torch.Tensor) and v.numel() > 1


def optimizer_step(
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    avg: torch.Tensor,
    anchor: torch.Tensor,
    state: dict[str, Any] | None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The outer step by a ``torch.optim`` optimizer, in place on ``avg`` (fp32): ``(target, state)``.

    The optimizer is built by ``factory`` over a copy of the anchor whose gradient is the
    pseudo-gradient ``anchor - avg`` (the sign :func:`outer_step` takes: SGD with Nesterov
    momentum there is :func:`outer_step`'s maths), given ``state`` (its state of the last step,
    None at the first) and stepped once; the target is the parameter it leaves.
    """
    p = anchor.detach().clone()
    p.grad = avg.sub_(anchor).neg_()  # the pseudo-gradient, in avg's buffer
    opt = factory([p])
    if state is not None:
        opt.state[p] = dict(state)
    opt.step()
    new = dict(opt.state[p])
    avg.copy_(p)
    return avg, new


def chunk_by_bytes(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Group consecutive indices of ``sizes`` so each group holds at most ``max_bytes``.

    A single item larger than ``max_bytes`` gets a group of its own.
    """
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if cur and total + size > max_bytes:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += size
    if cur:
        out.append(cur)
    return out


def outer_step(
    avg: torch.Tensor, anchor: torch.Tensor, momentum: torch.Tensor | None, lr: float, mu: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DiLoCo's outer Nesterov step, in place on ``avg`` (fp32): returns ``(target, momentum)``.

    ``g = anchor - avg``; ``m = mu * m + g``; ``target = anchor - lr * (g + mu * m)``.
    ``momentum`` is updated in place (a new one when it is ``None`` and ``mu > 0``).
    """
    g = avg.sub_(anchor).neg_()  # the pseudo-gradient
    if mu:
        momentum = torch.zeros_like(g) if momentum is None else momentum
        momentum.mul_(mu).add_(g)
        g.add_(momentum, alpha=mu)
    return g.mul_(-lr).add_(anchor), momentum


def missing_anchor(positions: Sequence[int]) -> RuntimeError:
    """The error of a sync that finds no anchor (a checkpoint loaded without hiersync's state)."""
    return RuntimeError(
        f"hiersync has no anchor for parameters {list(positions)[:5]}: the anchor is captured on the first "
        "post-warmup step; was a checkpoint loaded without its hiersync state_dict?"
    )


class Registry:
    """The parameters hiersync averages, by position (the order they were first registered)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def register(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Return the positions of ``params``, adding unseen ones at the end."""
        out = []
        for p in params:
            i = self._index.get(id(p))
            if i is None:
                i = len(self.params)
                self._index[id(p)] = i
                self.params.append(p)
            out.append(i)
        return out

    def clear(self) -> None:
        self.params, self._index = [], {}
