"""A chunk's flat layout and the state a rank keeps for its shard of it between syncs.

A *chunk* is a tuple of registry positions whose tensors, flattened and concatenated, form
one fp32 vector of ``n`` values; a node of ``split`` ranks cuts it into shards of ``s``
values (the last one zero-padded), rank ``index`` owning ``[index * s, (index + 1) * s)``
(``split = 1``: the rank's whole vector). :class:`ChunkStore` maps that flat layout to the
tensors (reading a shard out, writing a range back), keeps each chunk's state (anchor,
outer momentum, error-feedback residuals) where ``state_device`` says, backs it up for a
window that may be dropped, and checkpoints it. The maths that uses it, and the
communication, are :mod:`hiersync.averagers`'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .quant import RESIDUAL_DTYPE

if TYPE_CHECKING:
    from .localsgd import Registry

__all__ = ["ChunkState", "ChunkStore", "put"]


@dataclass
class ChunkState:
    """A chunk's flat layout and this rank's state for its shard of it."""

    indices: tuple[int, ...]
    offsets: list[int]  # flat start of each parameter, plus the total
    s: int  # shard length
    lo: int  # this rank's shard starts here (flat coordinates)
    anchor: torch.Tensor | None = None  # (s,) fp32
    momentum: torch.Tensor | None = None  # (s,) fp32
    residual: torch.Tensor | None = None  # (s,) bf16: what the codes of this shard's deltas left out
    reduced_residual: torch.Tensor | None = None  # bf16: the same for the piece this rank reduces

    @property
    def n(self) -> int:
        return self.offsets[-1]


_STATE = ("anchor", "momentum", "residual", "reduced_residual")
"""What a chunk keeps between syncs (and checkpoints)."""


def put(dst: torch.Tensor, values: torch.Tensor, add: bool) -> None:
    """``dst = values`` or ``dst += values`` (fp32 ``values``; the sum is rounded once for 16-bit ``dst``)."""
    if add and dst.dtype == torch.float32:
        dst.add_(values)
    elif add:
        dst.copy_(dst.float() + values)
    else:
        dst.copy_(values)


class ChunkStore:
    """The registered tensors seen as chunks: layout, this rank's shard of each, and its state."""

    split: int = 1
    """Ranks of the node that split a chunk between them (1: each rank averages all of it)."""
    index: int = 0
    """Which shard this rank holds: its part of a split chunk (a node of replicas), or of every
    parameter (a sharded node); checkpoints are checked against it."""

    def __init__(self, registry: Registry, state_device: str | None = None) -> None:
        self.registry = registry
        # "cpu": anchor and momentum live in host memory (pinned where CUDA is available), as
        # torchft's backup device; the maths runs on the parameters' device on transient copies.
        self.state_device = torch.device(state_device) if state_device is not None else None
        self._chunks: dict[tuple[int, ...], ChunkState] = {}
        self._loaded: list[dict[str, Any]] = []  # saved shards, bound when their chunk appears

    @property
    def params(self) -> list[torch.Tensor]:
        return self.registry.params

    def local(self, i: int) -> torch.Tensor:
        """The tensor position ``i`` holds on this rank (the parameter itself here)."""
        return self.params[i]

    def chunk_bytes(self, indices: Sequence[int]) -> list[int]:
        return [self.params[i].numel() * 4 for i in indices]

    # ------------------------------------------------------------- layout
    def chunk(self, indices: Sequence[int]) -> ChunkState:
        key = tuple(indices)
        c = self._chunks.get(key)
        if c is None:
            offsets = [0]
            for i in key:
                offsets.append(offsets[-1] + self.local(i).numel())
            s = -(-offsets[-1] // self.split)
            lo = self.index * s if self.split > 1 else 0
            c = self._chunks[key] = ChunkState(key, offsets, s, lo)
            self._bind_loaded(c)
        return c

    def shard_numel(self, indices: Sequence[int]) -> int:
        return self.chunk(indices).s

    def _device(self, c: ChunkState) -> torch.device:
        return self.local(c.indices[0]).device

    def _shard_of(
        self, c: ChunkState, source: Sequence[torch.Tensor] | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's shard of the chunk as an fp32 vector (zero padding at the end): ``out``, or new.

        ``source``: per-parameter tensors to read (default: the parameters themselves).
        """
        lo, hi = c.lo, min(c.lo + c.s, c.n)
        if out is None:
            out = torch.empty(c.s, dtype=torch.float32, device=self._device(c))
        out[max(0, hi - lo) :].zero_()
        for j, i in enumerate(c.indices):
            a, b = max(c.offsets[j], lo), min(c.offsets[j + 1], hi)
            if a < b:
                t = (source[j] if source is not None else self.local(i)).detach().reshape(-1)
                out[a - lo : b - lo].copy_(t[a - c.offsets[j] : b - c.offsets[j]])
        return out

    def own_shard(self, indices: Sequence[int], correction: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a correction of the whole chunk (or of its own vector)."""
        c = self.chunk(indices)
        if correction.numel() == c.s:
            return correction
        out = torch.zeros(c.s, dtype=torch.float32, device=correction.device)
        hi = min(c.lo + c.s, c.n)
        if hi > c.lo:
            out[: hi - c.lo].copy_(correction.reshape(-1)[c.lo : hi])
        return out

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as kept between syncs: on ``state_device`` (pinned host memory) if one is set."""
        if self.state_device is None or t.device == self.state_device:
            return t
        pin = self.state_device.type == "cpu" and torch.cuda.is_available()
        out = torch.empty(t.shape, dtype=t.dtype, device=self.state_device, pin_memory=pin)
        out.copy_(t, non_blocking=pin)
        return out

    @staticmethod
    def _here(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` on ``device`` (a transient copy when the state is offloaded)."""
        return t if t.device == device else t.to(device, non_blocking=True)

    @classmethod
    def _maybe_here(cls, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        return None if t is None else cls._here(t, device)

    def backup(self, indices: Sequence[int]) -> Callable[[], None]:
        c = self.chunk(indices)
        saved = {key: getattr(c, key).clone() for key in _STATE if getattr(c, key) is not None}

        def restore() -> None:  # into the persistent (possibly pinned) buffers where they exist
            for key in _STATE:
                now, old = getattr(c, key), saved.get(key)
                if old is None or now is None or now.shape != old.shape:
                    setattr(c, key, old)
                else:
                    now.copy_(old)

        return restore

    def _write_range(self, c: ChunkState, lo: int, values: torch.Tensor, add: bool) -> None:
        """Copy (or add) ``values`` into the chunk's flat range starting at ``lo``."""
        hi = min(lo + values.numel(), c.n)
        for j, i in enumerate(c.indices):
            a, b = max(c.offsets[j], lo), min(c.offsets[j + 1], hi)
            if a >= b:
                continue
            put(self.local(i).data.view(-1)[a - c.offsets[j] : b - c.offsets[j]], values[a - lo : b - lo], add)

    def release(self) -> None:
        """Forget the parameters and their state (the owner is closed)."""
        self.registry.clear()
        self._chunks, self._loaded = {}, []

    # ------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """This rank's shards of anchor and momentum (saved by every rank).

        Copies: both are updated in place by later syncs, and a host-resident
        (``state_device="cpu"``) copy may still be in flight from the device.
        """
        if self.state_device is not None and self.state_device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory have landed

        def saved(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to("cpu", copy=True)

        return {
            "kind": type(self).__name__,
            "split": self.split,
            "index": self.index,
            "chunks": [
                {"indices": list(c.indices)} | {key: saved(getattr(c, key)) for key in _STATE}
                for c in self._chunks.values()
                if any(getattr(c, key) is not None for key in _STATE)
            ],
        }

    def load(self, state: dict[str, Any]) -> None:
        mine = (type(self).__name__, self.split, self.index)
        theirs = (state.get("kind", mine[0]), state.get("split", self.split), state.get("index", self.index))
        if state.get("chunks") and theirs != mine:  # checked before anything changes
            raise ValueError(
                f"this hiersync state_dict holds the shards of local rank {theirs[2]} ({theirs[0]}, chunks split "
                f"{theirs[1]} ways), but this is local rank {self.index} ({mine[0]}, split {self.split} ways): every "
                "rank must save and load its own state.state_dict() (or call state.synchronize(model) and start a "
                "fresh state)"
            )
        self._chunks.clear()
        self._loaded = list(state.get("chunks") or [])

    def _bind_loaded(self, c: ChunkState) -> None:
        device = self._device(c)
        for saved in self._loaded:
            if tuple(saved["indices"]) == c.indices:
                for key in _STATE:
                    t = saved.get(key)
                    if t is not None:
                        if t.numel() != c.s and key != "reduced_residual":
                            raise ValueError(
                                f"hiersync state_dict {key} shard of parameters {list(c.indices)[:4]} has "
                                f"{t.numel()} values, this model needs {c.s}: the checkpoint is from a different model"
                            )
                        dtype = RESIDUAL_DTYPE if key.endswith("residual") else torch.float32
                        setattr(c, key, self._store(t.to(device=device, dtype=dtype, copy=True)))
                return
