"""Cross-node parameter averaging for hierarchical local SGD: anchor, compression, outer step.

Between inter-node syncs every node trains on its own (gradients averaged inside the node
only), so the nodes' replicas drift apart. Averaging *gradients* once every k steps cannot
reconcile replicas that have already drifted; averaging *parameters* can (Lin et al.,
"Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020; torchft's LocalSGD). This module
does that averaging for a list of parameters, on top of
:meth:`hiersync.collectives.HierComm.average_across_nodes` (rail-sharded: each NIC carries
1/L of the model).

Options, all off by default (plain averaging):

* ``compress=torch.bfloat16|torch.float16``: the inter-node leg carries the *delta*
  ``x - anchor`` in 16 bits, where the fp32 *anchor* is the result of the previous sync
  (identical on every rank). Raw parameters are never rounded to 16 bits: the error is
  bounded by the rounding of the (small) delta, not of the parameter.
* ``outer_lr``/``outer_momentum``: DiLoCo's outer Nesterov step (Douillard et al. 2023) on
  the averaged pseudo-gradient ``g = anchor - average``: ``m = mu*m + g``,
  ``x = anchor - lr*(g + mu*m)``. ``outer_lr=1, outer_momentum=0`` is plain averaging.

The averager keeps fp32 state keyed by parameter *position* in a registry filled in the
order the hook first sees parameters (DDP's initial bucket order, which is deterministic
for a given model and DDP options), never by ``bucket.index()``.

Example::

    >>> avg = ParamAverager(comm, compress=torch.bfloat16)
    >>> avg.register(list(model.parameters())); avg.capture_anchor(avg.params)
    >>> launched = avg.launch(avg.params)
    >>> avg.write(launched.indices, avg.complete(launched))   # every rank: the same parameters
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .collectives import HierComm
from .futures import wait

__all__ = ["ParamAverager", "Launched", "Pending", "chunk_by_bytes", "put"]

logger = logging.getLogger(__name__)


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


def put(dst: torch.Tensor, values: torch.Tensor, add: bool) -> None:
    """``dst = values`` or ``dst += values`` (fp32 ``values``; the sum is rounded once for 16-bit ``dst``)."""
    if add and dst.dtype == torch.float32:
        dst.add_(values)
    elif add:
        dst.copy_(dst.float() + values)
    else:
        dst.copy_(values)


@dataclass
class Launched:
    """A cross-node average in flight: ``future`` holds the averaged payload.

    Read it only with :meth:`ParamAverager.complete`, on the stream that uses the result.
    """

    indices: list[int]
    future: torch.futures.Future
    anchor: torch.Tensor | None
    snapshot: torch.Tensor | None = None
    """The values sent (fp32, before compression), kept when a correction will need them."""


class Completes(Protocol):
    """What :class:`Pending` needs: :class:`ParamAverager` or :class:`~hiersync.shards.ShardedAverager`."""

    def complete(self, launched: Launched) -> torch.Tensor: ...

    def part_of(self, indices: Sequence[int], whole: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Pending:
    """An overlapped (or deferred) sync: the parameters get ``target - snapshot`` added later."""

    indices: list[int]
    snapshot: torch.Tensor | None
    launched: Launched | None
    correction: torch.Tensor | None = None
    apply_at: int = 0
    """Applied by the first ``after_step`` whose step count is at least this."""
    fragment: int = 0
    gathered: torch.futures.Future | None = None
    """Sharded averagers: the node's whole correction, gathered as soon as the rail leg is
    done (:meth:`~hiersync.shards.ShardedAverager.gather_correction`); then ``snapshot``
    and ``launched`` are ``None``."""

    def whole(self) -> torch.Tensor | None:
        """The node's gathered correction (waited for), or ``None`` if there is none."""
        return None if self.gathered is None else wait(self.gathered)

    def resolve(self, averager: Completes) -> torch.Tensor:
        """Wait for the transfer and return this rank's fp32 correction (its part of it)."""
        if self.correction is None:
            if self.gathered is not None:
                self.correction = averager.part_of(self.indices, wait(self.gathered))
                return self.correction
            assert self.launched is not None and self.snapshot is not None
            target = averager.complete(self.launched)
            self.correction = target.sub_(self.snapshot)
            self.snapshot = None
            self.launched = None
        return self.correction


class ParamAverager:
    """Average parameters across nodes, with optional delta compression and outer Nesterov."""

    def __init__(
        self,
        comm: HierComm,
        compress: torch.dtype | None = None,
        outer_lr: float | None = None,
        outer_momentum: float = 0.0,
    ) -> None:
        self.comm = comm
        self.compress = compress
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self.anchor: dict[int, torch.Tensor] = {}
        self.momentum: dict[int, torch.Tensor] = {}
        self._pending_load: dict[str, list] = {}

    @property
    def needs_anchor(self) -> bool:
        return self.compress is not None or self.outer_lr is not None

    # ------------------------------------------------------------- registry
    def register(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Return the registry positions of ``params``, adding unseen ones at the end."""
        out = []
        for p in params:
            i = self._index.get(id(p))
            if i is None:
                i = len(self.params)
                self._index[id(p)] = i
                self.params.append(p)
                self._bind_loaded(i, p)
            out.append(i)
        return out

    def _bind_loaded(self, i: int, p: torch.Tensor) -> None:
        for key, store in (("anchor", self.anchor), ("momentum", self.momentum)):
            saved = self._pending_load.get(key)
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

    def capture_anchor(self, params: Sequence[torch.Tensor]) -> None:
        """Remember the current values as the anchor, for parameters that have none yet."""
        if not self.needs_anchor:
            return
        for i in self.register(params):
            if i not in self.anchor:
                self.anchor[i] = self.params[i].detach().float().clone()

    def capture_chunks(self, chunks: Sequence[Sequence[int]]) -> None:
        """:meth:`capture_anchor` for the parameters at the registry positions in ``chunks``."""
        self.capture_anchor([self.params[i] for idx in chunks for i in idx])

    # ------------------------------------------------------------- averaging
    def flat(self, indices: list[int]) -> torch.Tensor:
        """A new fp32 vector of the parameters at registry positions ``indices``."""
        return torch.cat([self.params[i].detach().reshape(-1).float() for i in indices])

    def _flat_anchor(self, indices: list[int]) -> torch.Tensor:
        missing = [i for i in indices if i not in self.anchor]
        if missing:
            raise RuntimeError(
                f"hiersync has no anchor for parameters {missing[:5]}: the anchor is captured on the first "
                "post-warmup step; was a checkpoint loaded without its hiersync state_dict?"
            )
        return torch.cat([self.anchor[i].reshape(-1) for i in indices])

    def launch(self, params: Sequence[torch.Tensor], keep_snapshot: bool = False) -> Launched:
        """Start averaging ``params`` across nodes; :meth:`complete` gives the fp32 target.

        The target is the new value every rank will hold: the plain average, or the outer
        optimizer's step from the anchor. Nothing is written to the parameters: see
        :meth:`write`. ``keep_snapshot``: keep the values sent (fp32) in the result, for a
        delta correction applied later.
        """
        indices = self.register(params)
        x = self.flat(indices)
        if self.compress is None:
            payload = x.clone() if keep_snapshot else x  # the transfer overwrites its payload
            anchor = self._flat_anchor(indices) if self.outer_lr is not None else None
        else:
            anchor = self._flat_anchor(indices)
            payload = (x - anchor).to(self.compress)
        snapshot = x if keep_snapshot else None
        return Launched(indices, self.comm.average_across_nodes(payload), anchor, snapshot)

    def part_numel(self, indices: Sequence[int]) -> int:
        """Values in a target or correction for ``indices`` (this averager keeps them whole)."""
        return sum(self.params[i].numel() for i in indices)

    def part_of(self, indices: Sequence[int], whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole-vector correction (the whole vector here)."""
        return whole

    def gather_correction(self, launched: Launched) -> None:
        """Always ``None``: a whole-vector average already ends with the node's gather
        (:meth:`HierComm.average_across_nodes`); the correction comes from :meth:`complete`."""
        return None

    def complete(self, launched: Launched) -> torch.Tensor:
        """Wait for ``launched`` and return its fp32 target; update anchor and momentum.

        Runs on the caller's thread and stream (never in a future's callback), so the
        anchor and momentum it keeps are allocated on the stream that later reads them.
        """
        avg = wait(launched.future)
        indices, anchor = launched.indices, launched.anchor
        if self.compress is not None:
            assert anchor is not None
            avg = anchor + avg.float()
        if self.outer_lr is not None:
            assert anchor is not None
            g = anchor - avg
            if self.outer_momentum:
                m = self._flat_momentum(indices)
                m.mul_(self.outer_momentum).add_(g)
                self._scatter(self.momentum, indices, m)
                g = g + self.outer_momentum * m
            target = anchor - self.outer_lr * g
        else:
            target = avg
        if self.needs_anchor:
            self._scatter(self.anchor, indices, target)
        return target

    def _flat_momentum(self, indices: list[int]) -> torch.Tensor:
        parts = []
        for i in indices:
            m = self.momentum.get(i)
            parts.append(
                m.reshape(-1) if m is not None else torch.zeros(self.params[i].numel(), device=self.params[i].device)
            )
        return torch.cat(parts)

    def _scatter(self, store: dict[int, torch.Tensor], indices: list[int], flat: torch.Tensor) -> None:
        offset = 0
        for i in indices:
            p = self.params[i]
            store[i] = flat[offset : offset + p.numel()].view(p.shape).clone()
            offset += p.numel()

    @torch.no_grad()
    def write(self, indices: list[int], flat: torch.Tensor, add: bool = False) -> None:
        """Copy (or add, for overlap corrections) a flat fp32 vector into the parameters."""
        offset = 0
        for i in indices:
            p = self.params[i]
            put(p, flat[offset : offset + p.numel()].view(p.shape), add)
            offset += p.numel()

    def chunks(self, max_bytes: int) -> list[list[int]]:
        """Registry positions grouped into chunks of at most ``max_bytes`` of fp32 (>= 1 param)."""
        return chunk_by_bytes([p.numel() * 4 for p in self.params], max_bytes)

    def release(self) -> None:
        """Forget the parameters and their state (the owner is closed)."""
        self.params, self._index = [], {}
        self.anchor, self.momentum, self._pending_load = {}, {}, {}

    # ------------------------------------------------------------- checkpoint
    def state(self) -> dict:
        n = len(self.params)
        return {
            "anchor": [self.anchor[i].cpu() if i in self.anchor else None for i in range(n)] if self.anchor else None,
            "momentum": [self.momentum[i].cpu() if i in self.momentum else None for i in range(n)]
            if self.momentum
            else None,
        }

    def load(self, state: dict) -> None:
        self.anchor.clear()
        self.momentum.clear()
        self._pending_load = {k: v for k, v in state.items() if v is not None}
        for i, p in enumerate(self.params):
            self._bind_loaded(i, p)
