"""The two kinds of node the sync engine averages across: replicas (DDP) and shards (FSDP2).

The cross-node average is rail-sharded either way: local rank ``l`` of every node averages
the same *shard* of each *chunk* (a tuple of registry positions, its tensors one flat fp32
vector of ``n`` values, cut into shards of ``s``, the last zero-padded) on its rail
(docs/design.md), and keeps the local-SGD state (fp32 anchor, outer momentum, error-feedback
residuals) of that shard only: :class:`ChunkStore` maps the layout to the tensors and keeps
that state where ``state_device`` says (its checkpoint: :mod:`hiersync.state_io`).

* :class:`ReplicatedNodeAverager` (DDP): every rank of a node holds the same parameters;
  rank ``l`` owns ``[l * s, (l + 1) * s)`` of a chunk. The node gathers the averaged shards
  over its fast links, piece by piece for a blocking sync, as soon as the rail leg is done
  for an overlapped one (so applying the correction is a local add). Nodes of different
  sizes, or of one rank, average whole chunks instead (``split = 1``).
* :class:`ShardedNodeAverager` (FSDP2): a rank holds its own shard of every parameter; the
  shards of local rank ``l`` line up across nodes when every node has L ranks, so the rank
  averages its own shards on its rail and writes them back locally: nothing to gather.

Per rank that is ``2/L`` of the fp32 parameter bytes in steady state (anchor + momentum,
only with ``compress`` or an outer step) plus, per chunk in flight, the node's fp32 buffer of
it (the snapshot and the payload in it; a compressed payload beside it) (docs/local-sgd.md,
"Memory"). Both implement :class:`hiersync.sync.Averager`; the maths is written once, in
:class:`RailAverager`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import state_io
from .futures import completed, then, wait
from .localsgd import follows_shard, missing_anchor, optimizer_step, outer_step
from .quant import Codec
from .sync import AveragerComm, Launched
from .vocab import GATHER_PIECE_BYTES

if TYPE_CHECKING:
    from .localsgd import Registry

__all__ = ["RailAverager", "ReplicatedNodeAverager", "ShardedNodeAverager", "ChunkState", "ChunkStore", "BufferPool"]


class BufferPool:
    """fp32 host vectors of the overlapped syncs (snapshots, gathered corrections), reused across
    steps: glibc gives a freed buffer of tens of MB back to the OS and faults it in again at the
    next allocation (~10 ms of CPU per step and rank at 25 MB). A request takes the smallest free
    buffer that holds it (streaming's fragments differ by a few parameters: one buffer serves
    each in turn); :meth:`trim` frees what is idle. Thread-safe. On CUDA the caching allocator
    reuses memory already: a buffer given back records the stream that last read it."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """An fp32 vector of ``numel`` values, contents undefined."""
        if device.type == "cpu":
            with self._lock:
                fits = [j for j, t in enumerate(self._free) if t.numel() >= numel]
                if fits:
                    buf = self._free.pop(min(fits, key=lambda j: self._free[j].numel()))
                    return buf if buf.numel() == numel else buf[:numel]
                self._free = []  # all smaller than what is asked now: superseded
        return torch.empty(numel, dtype=torch.float32, device=device)

    def give(self, t: torch.Tensor) -> None:
        """Return a vector from :meth:`take` (the work queued on the current stream reads it last)."""
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(t.device))
            return
        base = t if t._base is None else t._base  # a view of a larger buffer: keep the buffer
        with self._lock:
            self._free.append(base)

    def trim(self) -> None:
        """Free the buffers nobody holds (no sync runs after this step to take them)."""
        with self._lock:
            self._free = []


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
    outer: dict[str, Any] | None = None  # outer_optimizer's state of this shard (its tensors of s values fp32)

    @property
    def n(self) -> int:
        return self.offsets[-1]


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
        self.by_key: dict[tuple[int, ...], ChunkState] = {}
        self.loaded: list[dict[str, Any]] = []  # saved shards, bound when their chunk appears

    def local(self, i: int) -> torch.Tensor:
        """The tensor position ``i`` holds on this rank (the parameter itself here)."""
        return self.registry.params[i]

    def chunk_bytes(self, indices: Sequence[int]) -> list[int]:
        return [self.registry.params[i].numel() * 4 for i in indices]

    # ------------------------------------------------------------- layout
    def chunk(self, indices: Sequence[int]) -> ChunkState:
        key = tuple(indices)
        c = self.by_key.get(key)
        if c is None:
            offsets = [0, *itertools.accumulate(self.local(i).numel() for i in key)]
            s = -(-offsets[-1] // self.split)
            lo = self.index * s if self.split > 1 else 0
            c = self.by_key[key] = ChunkState(key, offsets, s, lo)
            state_io.bind_loaded(self, c)
        return c

    def shard_numel(self, indices: Sequence[int]) -> int:
        return self.chunk(indices).s

    def device_of(self, c: ChunkState) -> torch.device:
        return self.local(c.indices[0]).device

    def shard_of(self, c: ChunkState, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of the chunk's parameters as an fp32 vector (zero padding at the end): ``out``, or new."""
        lo, hi = c.lo, min(c.lo + c.s, c.n)
        if out is None:
            out = torch.empty(c.s, dtype=torch.float32, device=self.device_of(c))
        out[max(0, hi - lo) :].zero_()
        for j, i in enumerate(c.indices):
            a, b = max(c.offsets[j], lo), min(c.offsets[j + 1], hi)
            if a < b:
                t = self.local(i).detach().reshape(-1)
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

    def stored(self, t: torch.Tensor) -> torch.Tensor:
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
        return state_io.backup(self.chunk(indices))

    def _write_range(self, c: ChunkState, lo: int, values: torch.Tensor, add: bool) -> None:
        """Copy (or add) ``values`` into the chunk's flat range starting at ``lo``."""
        hi = min(lo + values.numel(), c.n)
        for j, i in enumerate(c.indices):
            a, b = max(c.offsets[j], lo), min(c.offsets[j + 1], hi)
            if a < b:  # fp32 ``values``: a 16-bit parameter's sum is rounded once
                dst, v = self.local(i).data.view(-1)[a - c.offsets[j] : b - c.offsets[j]], values[a - lo : b - lo]
                if add and dst.dtype == torch.float32:
                    dst.add_(v)
                else:
                    dst.copy_(dst.float() + v if add else v)

    def release(self) -> None:
        """Forget the parameters and their state (the owner is closed)."""
        self.registry.clear()
        self.by_key, self.loaded = {}, []

    def state(self) -> dict[str, Any]:  # a checkpoint: hiersync.state_io
        return state_io.shard_state(self)

    def load(self, state: dict[str, Any]) -> None:
        state_io.load_shards(self, state)


class RailAverager(ChunkStore):
    """Cross-node averages of this rank's shard of each chunk on its rail, and that shard's state.

    The base case: the rank averages its whole vector of each chunk (``split = 1``) with
    ``transfer`` and writes the result back locally. Subclasses say which tensors a
    position holds here (:meth:`local`) and how a node splits and gathers a chunk.
    """

    def __init__(
        self,
        comm: AveragerComm,
        registry: Registry,
        *,
        codec: Codec | None = None,
        outer_lr: float | None = None,
        outer_momentum: float = 0.0,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        state_device: str | None = None,
        transfer: Callable[[torch.Tensor], torch.futures.Future] | None = None,
        raw_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(registry, state_device)
        self.comm = comm
        self.raw_dtype = raw_dtype
        """Send the values themselves in this dtype (no anchor; the optimizer state's average)."""
        self.codec = codec
        """What the inter-node leg sends (:func:`hiersync.quant.codec_for`); ``None``: the fp32 values."""
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.outer_optimizer = outer_optimizer
        """The outer step by a ``torch.optim`` optimizer (:func:`hiersync.localsgd.optimizer_step`)."""
        self.transfer = transfer if transfer is not None else comm.average_shard
        """The rail average of a summed payload (the codec's :class:`~hiersync.quant.Site`)."""
        self._pool = BufferPool()

    @property
    def needs_anchor(self) -> bool:
        return self.codec is not None or self.outer_lr is not None or self.outer_optimizer is not None

    def capture(self, chunks: Callable[[], Sequence[Sequence[int]]]) -> None:
        if not self.needs_anchor:
            return
        for idx in chunks():
            c = self.chunk(idx)
            if c.anchor is None:
                c.anchor = self.stored(self.shard_of(c))

    # ------------------------------------------------------------- averaging
    def launch(self, indices: Sequence[int]) -> Launched:
        return self._launch(self.chunk(indices))

    def _launch(self, c: ChunkState, keep: torch.Tensor | None = None, work: torch.Tensor | None = None) -> Launched:
        """Start this rank's shard of ``c``. ``keep``: where the shard is read into and stays (a
        correction's snapshot; else a new vector the payload may be made in); ``work``: ``c.s``
        values the payload is made in (a plain fp32 payload is averaged there, in place)."""
        x = self.shard_of(c, out=keep)
        if self.needs_anchor and c.anchor is None:
            raise missing_anchor(c.indices)
        if self.codec is not None:  # the codec's wire path, on the delta against the anchor
            assert c.anchor is not None
            padded = self.codec.padded(c.s, self.comm.rail_nodes())
            if padded != c.s:
                e = torch.zeros(padded, dtype=torch.float32, device=x.device)
            else:  # the shard read here, or ``work``: the codec's to overwrite
                e = x if keep is None else work if work is not None else torch.empty_like(x)
            torch.sub(x, self._here(c.anchor, x.device), out=e[: c.s])
            future = self.codec.average(self, e, c.s, c)
            del e
        elif self.raw_dtype is not None:
            future = self.transfer(x.to(self.raw_dtype))
        elif keep is not None:  # the transfer overwrites its payload
            future = self.transfer(work.copy_(x) if work is not None else x.clone())
        else:
            future = self.transfer(x)
        return Launched(c.indices, future, snapshot=keep, weighting=self.comm.weighting)

    def here(self, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        return self._maybe_here(t, device)

    def complete(self, launched: Launched) -> torch.Tensor:
        return self._complete(self.chunk(launched.indices), launched)

    def _complete(self, c: ChunkState, launched: Launched, out: torch.Tensor | None = None) -> torch.Tensor:
        """The target, in ``out`` (default: in the payload when it is fp32, else in a new vector)."""
        got = wait(launched.future)
        w = launched.weighting
        if w is not None and w.total() == 0:  # no node trained a sample: the sync changes nothing
            mine = launched.snapshot if launched.snapshot is not None else self.shard_of(c)
            return mine.clone() if out is None else out.copy_(mine)
        if self.codec is not None:
            avg = self.codec.result(got, w, out)
        else:  # into ``out`` by a copy: an add of 16 bits to fp32 makes an fp32 temporary
            avg = got.float() if out is None else out.copy_(got) if out.data_ptr() != got.data_ptr() else out
            if w is not None and (r := w.rescale()) != 1.0:  # the sum's weights to the samples' total
                avg.mul_(r)
        if self.raw_dtype is not None:
            return avg
        anchor = self._here(c.anchor, avg.device) if c.anchor is not None else None
        # In place on one shard-sized buffer: no temporaries beyond it (and the offload copies).
        if self.codec is not None:  # a delta came back
            assert anchor is not None
            avg.add_(anchor)
        if self.outer_lr is not None:
            assert anchor is not None
            here = self._here(c.momentum, avg.device) if c.momentum is not None else None
            avg, m = outer_step(avg, anchor, here, self.outer_lr, self.outer_momentum)
            if m is not None and c.momentum is None:
                c.momentum = self.stored(m)
            elif m is not None and m is not c.momentum:
                c.momentum.copy_(m, non_blocking=True)  # type: ignore[union-attr]
        if self.outer_optimizer is not None:
            assert anchor is not None
            held = None if c.outer is None else {k: self._outer_here(v, avg.device) for k, v in c.outer.items()}
            avg, kept = optimizer_step(self.outer_optimizer, avg, anchor, held)
            c.outer = {k: self.stored(v) if follows_shard(v) else v for k, v in kept.items()}
        if self.needs_anchor:
            if c.anchor is None:
                c.anchor = self.stored(avg.clone())
            else:
                c.anchor.copy_(avg, non_blocking=True)  # the persistent buffer, reused
        return avg

    def _outer_here(self, v: Any, device: torch.device) -> Any:
        """An outer optimizer's state value on the maths' device (a buffer; a count stays where it is)."""
        return self._here(v, device) if follows_shard(v) else v

    def launch_correction(self, indices: Sequence[int]) -> torch.futures.Future:
        c = self.chunk(indices)
        launched = self._launch(c, keep=self._pool.take(c.s, self.device_of(c)))

        def correction(_: torch.futures.Future) -> torch.Tensor:
            # The snapshot and the transfer's payload are dropped as soon as they are used.
            snapshot, launched.snapshot = launched.snapshot, None
            assert snapshot is not None
            out = self._complete(c, launched).sub_(snapshot)
            self._pool.give(snapshot)
            return out

        return then(launched.future, correction, self.device_of(c), "the cross-node correction")

    def add_correction(self, indices: Sequence[int], correction: torch.Tensor) -> None:
        c = self.chunk(indices)
        if correction.is_cuda:  # made on a callback's or the side stream, read here on the current one
            correction.record_stream(torch.cuda.current_stream(correction.device))
        self._write_range(c, 0, correction, add=True)  # the whole chunk's (or the rank's whole vector)

    @torch.no_grad()
    def write(self, indices: Sequence[int], shard: torch.Tensor, add: bool = False) -> None:
        c = self.chunk(indices)
        self._write_range(c, c.lo, shard[: max(0, min(c.s, c.n - c.lo))], add)

    def trim(self) -> None:
        self._pool.trim()

    def release(self) -> None:
        super().release()
        self._pool.trim()


class ReplicatedNodeAverager(RailAverager):
    """Every rank of a node holds the same parameters (DDP): split each chunk by local rank."""

    def __init__(self, comm: AveragerComm, registry: Registry, **options: Any) -> None:
        topo = comm.topology
        even = topo.even and comm.rail.across_nodes
        transfer = None if even else comm.average_across_nodes  # uneven: leaders' all-reduce, node broadcast
        super().__init__(comm, registry, transfer=transfer, **options)
        if self.codec is not None and self.codec.wire.feedback and not topo.even:
            raise ValueError(
                f"compress={self.codec.wire.name!r} needs nodes with equal numbers of ranks (its rail average is an "
                f"{self.codec.wire.average.replace('_', '-')} on every rail); this job's nodes hold "
                f"{[len(n) for n in topo.nodes]} ranks: use compress='bf16' here"
            )
        if even:
            self.split, self.index = comm.groups.node_size, comm.groups.local_rank
        self._scratch: torch.Tensor | None = None  # one gathered piece, reused

    @torch.no_grad()
    def write(self, indices: Sequence[int], shard: torch.Tensor, add: bool = False) -> None:
        """``shard`` is this rank's; the node gathers the shards over its intra links, piece by piece."""
        c = self.chunk(indices)
        if self.split == 1:
            super().write(indices, shard, add)
            return
        L = self.split
        shard = shard.to(torch.float32)
        q = max(GATHER_PIECE_BYTES // 4, -(-c.s // 4))  # values per piece
        for a in range(0, c.s, q):  # piece by piece: the gathered buffer stays small
            b = min(a + q, c.s)
            need = (b - a) * L
            if self._scratch is None or self._scratch.numel() < need or self._scratch.device != shard.device:
                self._scratch = torch.empty(need, dtype=torch.float32, device=shard.device)
            got = wait(self.comm.gather_node(self._scratch[:need], shard[a:b]))
            for r in range(L):  # rank r's piece is flat [r * s + a, r * s + b)
                lo = r * c.s + a
                hi = min(r * c.s + b, c.n)
                if lo < hi:
                    self._write_range(c, lo, got[r * (b - a) : r * (b - a) + hi - lo], add)

    def launch_correction(self, indices: Sequence[int]) -> torch.futures.Future:
        """The node's whole correction, gathered as soon as the rail leg is done.

        As soon as the rail leg is done, this rank turns its shard into its shard of the
        correction (the maths of :meth:`complete`, which updates anchor and momentum) and
        the node all-gathers them into one fp32 buffer of the chunk, so that applying it
        later is a local add, not a blocking gather. The gathers are issued in the order of
        these calls (the launch order, identical on every rank). The buffer, the chunk's
        size in fp32 (from the pool), is the sync's only one: until the gather fills it, the
        snapshot sits in the next rank's slot and this rank's slot holds the payload (fp32:
        averaged there in place) or the delta it is made of, then the target, then the
        correction. It lives until the correction is applied.
        """
        if self.split == 1:
            return super().launch_correction(indices)
        c = self.chunk(indices)
        gathered = self._pool.take(self.split * c.s, self.device_of(c))
        mine = gathered[c.lo : c.lo + c.s]
        spare = (self.index + 1) % self.split * c.s
        launched = self._launch(c, keep=gathered[spare : spare + c.s], work=mine)

        def shard() -> torch.Tensor:
            # ``c`` is held here: closing the averager meanwhile does not change what is issued.
            snapshot, launched.snapshot = launched.snapshot, None
            assert snapshot is not None
            self._complete(c, launched, out=mine).sub_(snapshot)
            launched.future = completed(None)  # the payload
            return mine

        return self.comm.gather_node_after(launched.future, shard, mine, out=gathered)

    def add_correction(self, indices: Sequence[int], correction: torch.Tensor) -> None:
        super().add_correction(indices, correction)
        if self.split > 1:  # the gathered buffer of launch_correction: nothing reads it any more
            self._pool.give(correction)

    def release(self) -> None:
        super().release()
        self._scratch = None


class ShardedNodeAverager(RailAverager):
    """Every rank holds its own shard of each parameter (FSDP2 ``fully_shard`` over the node).

    The registry holds the sharded parameters (DTensors); a position's tensor here is its
    local shard, which lines up with the same local rank's on every node when all nodes
    have L ranks. A position's unit is its whole parameter (``numel`` of a DTensor is the
    full tensor's), so a model has the same fragments here as on a node of replicas.
    """

    def __init__(self, comm: AveragerComm, registry: Registry, **options: Any) -> None:
        super().__init__(comm, registry, **options)
        self.index = comm.groups.local_rank

    def local(self, i: int) -> torch.Tensor:
        p = self.registry.params[i]
        return p.to_local() if hasattr(p, "to_local") else p

    def chunk_bytes(self, indices: Sequence[int]) -> list[int]:
        return [self.local(i).numel() * 4 for i in indices]
