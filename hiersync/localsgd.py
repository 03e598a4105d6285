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

:class:`HookAverager` is the average a sync step runs *inside* DDP's hook (no optimizer
attached): whole vectors per bucket, state per parameter. The engine after
``optimizer.step()`` uses the sharded averagers of :mod:`hiersync.averagers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .chunks import put
from .collectives import HierComm
from .futures import wait
from .quant import CastCodec, codec_for

__all__ = [
    "Registry",
    "chunk_by_bytes",
    "outer_step",
    "options_of",
    "HookAverager",
    "HookLaunch",
    "missing_anchor",
]


def options_of(cfg: Any) -> dict[str, Any]:
    """The averager options of a :class:`~hiersync.config.HierConfig`: the payload's codec
    (:func:`hiersync.quant.codec_for`) and the outer step."""
    codec = codec_for(cfg.compress, cfg.error_feedback)
    return {"codec": codec, "outer_lr": cfg.outer_lr, "outer_momentum": cfg.outer_momentum}


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
        self.on_register: list = []  # callbacks (position, parameter) for state loaded before the model

    def register(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Return the positions of ``params``, adding unseen ones at the end."""
        out = []
        for p in params:
            i = self._index.get(id(p))
            if i is None:
                i = len(self.params)
                self._index[id(p)] = i
                self.params.append(p)
                for bind in self.on_register:
                    bind(i, p)
            out.append(i)
        return out

    def clear(self) -> None:
        self.params, self._index = [], {}


@dataclass
class HookLaunch:
    """A bucket's parameter average in flight inside the hook; read it with :meth:`HookAverager.complete`."""

    indices: list[int]
    future: torch.futures.Future
    anchor: torch.Tensor | None


class HookAverager:
    """The sync step's parameter average inside DDP's hook: whole vectors, state per parameter.

    Example::

        >>> avg = HookAverager(comm, Registry(), codec=codec_for("bf16"))
        >>> avg.capture_anchor(params)
        >>> launched = avg.launch(params)
        >>> avg.write(launched.indices, avg.complete(launched))   # every rank: the same parameters
    """

    def __init__(
        self,
        comm: HierComm,
        registry: Registry,
        codec: CastCodec | None = None,
        outer_lr: float | None = None,
        outer_momentum: float = 0.0,
    ) -> None:
        self.comm = comm
        self.registry = registry
        self.codec = codec
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.anchor: dict[int, torch.Tensor] = {}
        self.momentum: dict[int, torch.Tensor] = {}
        self._loaded: dict[str, list] = {}
        registry.on_register.append(self._bind_loaded)

    @property
    def params(self) -> list[torch.Tensor]:
        return self.registry.params

    @property
    def needs_anchor(self) -> bool:
        return self.codec is not None or self.outer_lr is not None

    def register(self, params: Sequence[torch.Tensor]) -> list[int]:
        return self.registry.register(params)

    def capture_anchor(self, params: Sequence[torch.Tensor]) -> None:
        """Remember the current values as the anchor, for parameters that have none yet."""
        if not self.needs_anchor:
            return
        for i in self.register(params):
            if i not in self.anchor:
                self.anchor[i] = self.params[i].detach().float().clone()

    def launch(self, params: Sequence[torch.Tensor]) -> HookLaunch:
        """Start averaging ``params`` across nodes; :meth:`complete` gives the fp32 target.

        The target is the new value every rank will hold: the plain average, or the outer
        step from the anchor. Nothing is written to the parameters: see :meth:`write`.
        """
        indices = self.register(params)
        x = torch.cat([self.params[i].detach().reshape(-1).float() for i in indices])
        anchor = None
        if self.needs_anchor:
            missing = [i for i in indices if i not in self.anchor]
            if missing:
                raise missing_anchor(missing)
            anchor = torch.cat([self.anchor[i].reshape(-1) for i in indices])
        payload = x if self.codec is None or anchor is None else self.codec.encode(x - anchor)
        return HookLaunch(indices, self.comm.average_across_nodes(payload), anchor)

    def complete(self, launched: HookLaunch) -> torch.Tensor:
        """Wait for ``launched`` and return its fp32 target; update anchor and momentum.

        Runs on the caller's thread and stream (never in a future's callback), so the
        anchor and momentum it keeps are allocated on the stream that later reads them.
        """
        avg = wait(launched.future)
        indices, anchor = launched.indices, launched.anchor
        if self.codec is not None:
            assert anchor is not None
            avg = avg.float().add_(anchor)
        if self.outer_lr is not None:
            assert anchor is not None
            mu = self.outer_momentum
            momentum = self._flat_momentum(indices) if mu and any(i in self.momentum for i in indices) else None
            avg, momentum = outer_step(avg, anchor, momentum, self.outer_lr, mu)
            if momentum is not None:
                self._scatter(self.momentum, indices, momentum)
        if self.needs_anchor:
            self._scatter(self.anchor, indices, avg)
        return avg

    def _flat_momentum(self, indices: list[int]) -> torch.Tensor:
        """The momentum of ``indices`` (zeros where a parameter has none: DDP rebuilds its buckets)."""
        return torch.cat(
            [
                self.momentum[i].reshape(-1) if i in self.momentum else self.params[i].new_zeros(self.params[i].numel())
                for i in indices
            ]
        ).float()

    def _scatter(self, store: dict[int, torch.Tensor], indices: list[int], flat: torch.Tensor) -> None:
        offset = 0
        for i in indices:
            p = self.params[i]
            store[i] = flat[offset : offset + p.numel()].view(p.shape).clone()
            offset += p.numel()

    @torch.no_grad()
    def write(self, indices: list[int], flat: torch.Tensor) -> None:
        """Copy a flat fp32 target into the parameters at ``indices``."""
        offset = 0
        for i in indices:
            p = self.params[i]
            put(p, flat[offset : offset + p.numel()].view(p.shape), add=False)
            offset += p.numel()

    def release(self) -> None:
        """Forget the state (the owner is closed)."""
        self.anchor, self.momentum, self._loaded = {}, {}, {}

    # ------------------------------------------------------------- checkpoint
    def state(self) -> dict:
        n = len(self.params)
        return {
            key: [store[i].cpu() if i in store else None for i in range(n)] if store else None
            for key, store in (("anchor", self.anchor), ("momentum", self.momentum))
        }

    def load(self, state: dict) -> None:
        self.anchor.clear()
        self.momentum.clear()
        self._loaded = {k: v for k, v in state.items() if v is not None}
        for i, p in enumerate(self.params):
            self._bind_loaded(i, p)

    def _bind_loaded(self, i: int, p: torch.Tensor) -> None:
        for key, store in (("anchor", self.anchor), ("momentum", self.momentum)):
            saved = self._loaded.get(key)
            if saved is None or i >= len(saved) or saved[i] is None:
                continue
            t = saved[i]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"hiersync state_dict {key}[{i}] has shape {tuple(t.shape)} but the model's parameter "
                    f"{i} (in DDP's initial bucket order) has shape {tuple(p.shape)}: the checkpoint is "
                    "from a different model"
                )
            store[i] = t.to(device=p.device, dtype=torch.float32)
