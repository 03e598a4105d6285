"""The local-SGD state of one rank, kept for its 1/L shard of each chunk only.

The cross-node average is rail-sharded: in a node of L ranks, local rank ``l`` all-reduces
shard ``l`` of each chunk across nodes, and the node assembles the result over its fast
intra-node links. So a rank needs the fp32 anchor, the outer momentum, the snapshot of a
sync in flight and the transfer payload for *its* shard only. The full vector of a chunk
exists only transiently: a blocking sync's target is gathered into the parameters piece by
piece; an overlapped sync's correction is gathered as soon as its rail leg is done
(:meth:`ShardedAverager.gather_correction`) and kept until it is added. Per rank that is
``2/L`` of the fp32 parameter bytes in steady state (anchor + momentum, only with
``compress`` or an outer step) plus ``2/L`` of the chunks in flight and their gathered
corrections, instead of several full copies (docs/local-sgd.md, "Memory").

A chunk is a tuple of registry positions (the sync engine's chunks: deterministic,
identical on every rank). Its flat fp32 layout is the concatenation of those parameters;
it is padded to ``L * s`` and rank ``l`` owns ``[l * s, (l + 1) * s)``.

:class:`ShardedAverager` has the interface :class:`~hiersync.sync.CrossNodeSync` uses
(``launch``, ``complete``, ``write``, ``part_numel``, ``state``, ``load``) and shares the
parameter registry of a :class:`~hiersync.localsgd.ParamAverager`, whose per-parameter
state the pure-hook path keeps using. Needs even nodes (uneven ones use the
``ParamAverager`` itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .futures import completed, wait
from .localsgd import Launched, ParamAverager, put

__all__ = ["ShardedAverager", "GATHER_PIECE_BYTES"]

GATHER_PIECE_BYTES = 2**20
"""The node gathers a finished shard in pieces of at least this many bytes per rank, and at
most 4 pieces per chunk: the reused gather buffer holds at most 1/4 of a chunk, and a big
fragment costs 4 collectives per rank instead of one per MiB."""


@dataclass
class _Chunk:
    indices: tuple[int, ...]
    offsets: list[int]  # flat start of each parameter, plus the total
    s: int  # shard length
    lo: int  # this rank's shard starts here (flat coordinates)
    anchor: torch.Tensor | None = None  # (s,) fp32
    momentum: torch.Tensor | None = None  # (s,) fp32

    @property
    def n(self) -> int:
        return self.offsets[-1]


class ShardedAverager:
    """Cross-node parameter averages whose state is this rank's shard of each chunk."""

    def __init__(self, base: ParamAverager, state_device: str | None = None) -> None:
        self.base = base
        # "cpu": anchor and momentum live in host memory (pinned where CUDA is available), as
        # torchft's backup device; the maths runs on the parameters' device on transient copies.
        self.state_device = torch.device(state_device) if state_device is not None else None
        self.comm = base.comm
        self.compress = base.compress
        self.outer_lr = base.outer_lr
        self.outer_momentum = base.outer_momentum
        groups = base.comm.groups
        self.L, self.local_rank = groups.node_size, groups.local_rank
        self._chunks: dict[tuple[int, ...], _Chunk] = {}
        self._loaded: list[dict[str, Any]] = []  # saved shards, bound when their chunk appears
        self._scratch: torch.Tensor | None = None  # one gathered chunk, reused

    @property
    def params(self) -> list[torch.Tensor]:
        return self.base.params

    @property
    def needs_anchor(self) -> bool:
        return self.base.needs_anchor

    # ------------------------------------------------------------- layout
    def chunk(self, indices: Sequence[int]) -> _Chunk:
        key = tuple(indices)
        c = self._chunks.get(key)
        if c is None:
            offsets = [0]
            for i in key:
                offsets.append(offsets[-1] + self.params[i].numel())
            s = -(-offsets[-1] // self.L)
            c = self._chunks[key] = _Chunk(key, offsets, s, self.local_rank * s)
            self._bind_loaded(c)
        return c

    def part_numel(self, indices: Sequence[int]) -> int:
        """Values in this rank's part of a target or correction for ``indices``."""
        return self.chunk(indices).s

    def _shard_of(self, c: _Chunk, source: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """This rank's shard of the chunk, as a new fp32 vector (zero padding at the end).

        ``source``: per-parameter tensors to read (default: the parameters themselves).
        """
        out = torch.zeros(c.s, dtype=torch.float32, device=self.params[c.indices[0]].device)
        lo, hi = c.lo, min(c.lo + c.s, c.n)
        for j, i in enumerate(c.indices):
            a, b = max(c.offsets[j], lo), min(c.offsets[j + 1], hi)
            if a < b:
                t = (source[j] if source is not None else self.params[i]).detach().reshape(-1)
                out[a - lo : b - lo].copy_(t[a - c.offsets[j] : b - c.offsets[j]])
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

    def part_of(self, indices: Sequence[int], whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole-vector target or correction for ``indices``."""
        c = self.chunk(indices)
        out = torch.zeros(c.s, dtype=torch.float32, device=whole.device)
        hi = min(c.lo + c.s, c.n)
        if hi > c.lo:
            out[: hi - c.lo].copy_(whole.reshape(-1)[c.lo : hi])
        return out

    # ------------------------------------------------------------- anchors
    def capture_chunks(self, chunks: Sequence[Sequence[int]]) -> None:
        """Remember the current values as the anchor of every chunk that has none yet."""
        if not self.needs_anchor:
            return
        for idx in chunks:
            c = self.chunk(idx)
            if c.anchor is None:
                c.anchor = self._store(self._shard_of(c))

    # ------------------------------------------------------------- averaging
    def launch(self, params: Sequence[torch.Tensor], keep_snapshot: bool = False) -> Launched:
        """Start averaging this rank's shard of ``params`` across nodes (on its rail)."""
        c = self.chunk(self.base.register(params))
        x = self._shard_of(c)
        if self.needs_anchor and c.anchor is None:
            raise RuntimeError(
                f"hiersync has no anchor for the chunk of parameters {list(c.indices)[:5]}: the anchor is "
                "captured on the first post-warmup step; was a checkpoint loaded without its hiersync state_dict?"
            )
        if self.compress is not None:
            assert c.anchor is not None
            anchor = self._here(c.anchor, x.device)
            delta = torch.sub(x, anchor) if keep_snapshot else x.sub_(anchor)
            payload = delta.to(self.compress)
            del delta
        else:
            payload = x.clone() if keep_snapshot else x
        future = self.comm.average_shard(payload)
        return Launched(list(c.indices), future, c.anchor, snapshot=x if keep_snapshot else None)

    def complete(self, launched: Launched) -> torch.Tensor:
        """Wait for ``launched``; return this rank's shard of the fp32 target; update the state."""
        return self._complete(self.chunk(launched.indices), launched)

    def gather_correction(self, launched: Launched) -> torch.futures.Future | None:
        """The node's whole correction ``target - snapshot`` for ``launched``, gathered early.

        As soon as the rail leg is done, this rank turns its shard into its part of the
        correction (the maths of :meth:`complete`, which updates anchor and momentum) and
        the node all-gathers the parts into one fp32 buffer of the chunk, so that
        applying it later is a local add, not a blocking gather. The gathers are issued in
        the order of these calls (the launch order, identical on every rank). The buffer,
        the chunk's size in fp32, lives until the correction is applied. ``None`` when the
        node has one rank (nothing to gather): use :meth:`complete` then.
        """
        if self.L == 1:
            return None
        c = self.chunk(launched.indices)
        assert launched.snapshot is not None, "gather_correction needs launch(..., keep_snapshot=True)"
        like = launched.snapshot

        def part() -> torch.Tensor:
            # ``c`` is held here: closing the averager meanwhile does not change what is issued.
            # The snapshot and the transfer's payload are dropped as soon as they are used.
            snapshot, launched.snapshot = launched.snapshot, None
            assert snapshot is not None
            out = self._complete(c, launched).sub_(snapshot)
            launched.future = completed(None)
            return out

        return self.comm.gather_node_after(launched.future, part, like)

    def _complete(self, c: _Chunk, launched: Launched) -> torch.Tensor:
        avg = wait(launched.future)
        anchor = self._here(c.anchor, avg.device) if c.anchor is not None else None
        # In place on one shard-sized buffer: no temporaries beyond it (and the offload copies).
        if self.compress is not None:
            assert anchor is not None
            avg = avg.float().add_(anchor)
        if self.outer_lr is not None:
            assert anchor is not None
            g = avg.sub_(anchor).neg_()  # pseudo-gradient anchor - average
            if self.outer_momentum:
                m = self._here(c.momentum, g.device) if c.momentum is not None else torch.zeros_like(g)
                m.mul_(self.outer_momentum).add_(g)
                g.add_(m, alpha=self.outer_momentum)
                if c.momentum is None:
                    c.momentum = self._store(m)
                elif m is not c.momentum:
                    c.momentum.copy_(m, non_blocking=True)
            avg = g.mul_(-self.outer_lr).add_(anchor)  # anchor - lr * g
        if self.needs_anchor:
            if c.anchor is None:
                c.anchor = self._store(avg.clone())
            else:
                c.anchor.copy_(avg, non_blocking=True)  # the persistent buffer, reused
        return avg

    @torch.no_grad()
    def write(self, indices: list[int], flat: torch.Tensor, add: bool = False) -> None:
        """Copy (or add) a target or correction into the parameters; collective in the node.

        ``flat`` is this rank's shard; the node gathers the shards over its intra links.
        """
        c = self.chunk(indices)
        if self.L == 1:
            self._write_range(c, 0, flat[: c.n], add)
            return
        shard = flat.to(torch.float32)
        q = max(GATHER_PIECE_BYTES // 4, -(-c.s // 4))  # values per piece
        for a in range(0, c.s, q):  # piece by piece: the gathered buffer stays small
            b = min(a + q, c.s)
            need = (b - a) * self.L
            if self._scratch is None or self._scratch.numel() < need or self._scratch.device != shard.device:
                self._scratch = torch.empty(need, dtype=torch.float32, device=shard.device)
            got = wait(self.comm.gather_node(self._scratch[:need], shard[a:b]))
            for r in range(self.L):  # rank r's piece is flat [r * s + a, r * s + b)
                lo = r * c.s + a
                hi = min(r * c.s + b, c.n)
                if lo < hi:
                    self._write_range(c, lo, got[r * (b - a) : r * (b - a) + hi - lo], add)

    @torch.no_grad()
    def add_gathered(self, indices: list[int], gathered: torch.Tensor) -> None:
        """Add a correction from :meth:`gather_correction` to the parameters (local, no collective)."""
        c = self.chunk(indices)
        if gathered.is_cuda:  # allocated on hiersync's side stream, read here on the current one
            gathered.record_stream(torch.cuda.current_stream(gathered.device))
        self._write_range(c, 0, gathered[: c.n], add=True)

    def _write_range(self, c: _Chunk, lo: int, values: torch.Tensor, add: bool) -> None:
        """Copy (or add) ``values`` into the chunk's flat range starting at ``lo``."""
        hi = lo + values.numel()
        for j, i in enumerate(c.indices):
            a, b = max(c.offsets[j], lo), min(c.offsets[j + 1], hi)
            if a >= b:
                continue
            put(self.params[i].data.view(-1)[a - c.offsets[j] : b - c.offsets[j]], values[a - lo : b - lo], add)

    def release(self) -> None:
        """Forget the parameters and their state (the owner is closed)."""
        self.base.release()
        self._chunks, self._loaded, self._scratch = {}, [], None

    # ------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """The pure-hook per-parameter state plus this rank's shards (saved by every rank).

        Copies: anchor and momentum are updated in place by later syncs, and a host-resident
        (``state_device="cpu"``) copy may still be in flight from the device.
        """
        if self.state_device is not None and self.state_device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory have landed

        def saved(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to("cpu", copy=True)

        out = self.base.state()
        out["shards"] = {
            "local_rank": self.local_rank,
            "node_size": self.L,
            "chunks": [
                {"indices": list(c.indices), "anchor": saved(c.anchor), "momentum": saved(c.momentum)}
                for c in self._chunks.values()
                if c.anchor is not None or c.momentum is not None
            ],
        }
        return out

    def load(self, state: dict[str, Any]) -> None:
        saved = state.get("shards")
        if saved and (saved["local_rank"], saved["node_size"]) != (self.local_rank, self.L):  # before any change
            raise ValueError(
                f"this hiersync state_dict holds the shards of local rank {saved['local_rank']} of a "
                f"{saved['node_size']}-rank node, but this is local rank {self.local_rank} of {self.L}: every "
                "rank must save and load its own state.state_dict() (or call state.synchronize(model) and "
                "start a fresh HierState)"
            )
        self.base.load({k: v for k, v in state.items() if k != "shards"})
        self._chunks.clear()
        self._loaded = list(saved["chunks"]) if saved else []

    def _bind_loaded(self, c: _Chunk) -> None:
        device = self.params[c.indices[0]].device
        for saved in self._loaded:
            if tuple(saved["indices"]) == c.indices:
                for key in ("anchor", "momentum"):
                    t = saved.get(key)
                    if t is not None:
                        if t.numel() != c.s:
                            raise ValueError(
                                f"hiersync state_dict {key} shard of parameters {list(c.indices)[:4]} has "
                                f"{t.numel()} values, this model needs {c.s}: the checkpoint is from a different model"
                            )
                        setattr(c, key, self._store(t.to(device=device, dtype=torch.float32, copy=True)))
                return
        # per-parameter state (a pure-hook or older checkpoint): take this rank's shard of it
        for key, store in (("anchor", self.base.anchor), ("momentum", self.base.momentum)):
            if all(i in store for i in c.indices):
                setattr(c, key, self._store(self._shard_of(c, [store[i] for i in c.indices]).float()))
