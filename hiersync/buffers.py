"""Host buffers of the overlapped syncs (snapshots, gathered corrections), reused across steps.

glibc hands a freed buffer of tens of MB back to the OS and faults it in again at the next
allocation: ~10 ms of CPU per step and rank for 25 MB fragments. A :class:`BufferPool`
keeps the buffers a sync gives back for the next one, and never more than were in use at
once: a request reuses the smallest free buffer that holds it (a view of its start), and a
request that none holds frees the smaller ones before allocating. Streaming's fragments
differ by a few parameters, so one buffer of the largest serves each in turn; a pool keyed
by exact size kept one per size (a whole extra copy of the fragments' snapshots and
corrections per rank). :meth:`BufferPool.trim` frees what is idle (the engine calls it when
the next step launches nothing), so steps without a sync hold none of it.

CUDA's caching allocator already reuses device memory: there a buffer is a plain
allocation, and giving it back records the current stream, the one that last read it, so
its memory is not handed out again before that stream is done with it.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """fp32 host vectors, reused; thread-safe (a snapshot comes back on the thread that
    completes its average)."""

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
        """Return a vector from :meth:`take` once the work queued on the current stream is
        the last to read it."""
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(t.device))
            return
        base = t if t._base is None else t._base  # a view of a larger buffer: keep the buffer
        with self._lock:
            self._free.append(base)

    def trim(self) -> None:
        """Free the buffers nobody holds (the next step starts no sync that would take them)."""
        with self._lock:
            self._free = []

    @property
    def idle_bytes(self) -> int:
        """Bytes held for reuse right now."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._free)
