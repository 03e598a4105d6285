"""What a bench rank measures besides its step times: phases, copies, the link, memory.

* :class:`PhaseProbe`: when the last gradient was accumulated and when the optimizer's own
  update ended, so a step's time splits into compute and exposed communication;
* :func:`copy_probe`: the speed of a fresh copy, every rank at once (a sync launch's copies);
* :class:`LinkCounter`: the bytes a node's interface sent, read from ``/proc/net/dev`` of
  the rank's network namespace. On the emulated cluster every node is a namespace whose
  one interface is its link to the other nodes, so its transmit counter counts whatever
  any method sends between nodes, the same way for every row (Ethernet frames: payload
  plus TCP/IP headers);
* :func:`cached_host_memory` / :func:`exact_rss`: the host allocator of the timing and of the
  memory pass;
* :class:`MemoryProbe`: a rank's peak resident memory over one run (Linux's high-water
  mark, reset at the run's start), so rows can be compared with DDP's.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
import statistics
import time
from typing import Any

__all__ = [
    "PhaseProbe",
    "cached_host_memory",
    "host_reserve_mb",
    "copy_probe",
    "LinkCounter",
    "read_tx_bytes",
    "MemoryProbe",
    "exact_rss",
    "rss_mb",
]

logger = logging.getLogger(__name__)


class PhaseProbe:
    """Timestamps: the last gradient accumulated (end of backward compute) and the end of the update."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.last_grad = 0.0
        self.opt_done = 0.0
        self.handles = [p.register_post_accumulate_grad_hook(self._grad) for p in model.parameters() if p.requires_grad]
        # Registered before hiersync or torchft attach their own step hooks, so this one runs
        # first: whatever runs after it inside optimizer.step() is the method's inter-node sync.
        self.handles.append(optimizer.register_step_post_hook(self._opt))

    def _grad(self, p: Any) -> None:
        self.last_grad = time.perf_counter()

    def _opt(self, *args: Any) -> None:
        self.opt_done = time.perf_counter()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def copy_probe(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds of a copy into a new tensor of ``nbytes``, every rank at once.

    That is what a sync's launch does per rank (snapshot and payload of its shard): the cost
    model charges these copies at a device's copy speed. The timing pass keeps freed memory
    (:func:`cached_host_memory`), as hiersync's buffer pool reuses its buffers, so this is a
    copy into reused memory, slowed by whatever the other ranks take of the cores (into fresh
    memory it was 5-30x slower here, page faults included). Collective.
    """
    import torch
    import torch.distributed as dist

    src = torch.ones(max(1, nbytes // 4))
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dst = src.clone()
        times.append(time.perf_counter() - t0)
        del dst
    return {"bytes": float(src.numel() * 4), "seconds": statistics.median(times)}


def read_tx_bytes(ifname: str, text: str | None = None) -> int:
    """Bytes interface ``ifname`` has sent, from ``/proc/net/dev`` (or its ``text``).

    ``/proc/net/dev`` shows the reading process's network namespace: inside an emulated node,
    its own interface.
    """
    if text is None:
        with open("/proc/net/dev") as f:
            text = f.read()
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == ifname:
            fields = rest.split()
            return int(fields[8])  # receive: bytes packets errs drop fifo frame compressed multicast; then transmit
    raise ValueError(f"interface {ifname!r} is not in /proc/net/dev")


class LinkCounter:
    """The transmit counter of the node's link (None-like where there is no link to count)."""

    def __init__(self, ifname: str) -> None:
        self.ifname = ifname
        read_tx_bytes(ifname)  # fail here, not in a timed step

    @classmethod
    def for_testbed(cls) -> LinkCounter | None:
        """The counter of this rank's emulated node, or None off the testbed (loopback carries every rank's
        traffic, inside a node and between nodes alike: nothing to count there)."""
        if os.environ.get("HIERSYNC_TESTBED_EMULATED") != "1":
            return None
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
        try:
            return cls(ifname)
        except (OSError, ValueError) as e:
            logger.warning("bench: cannot count the link's bytes (%s); bytes per step come from the methods", e)
            return None

    def read(self) -> int:
        return read_tx_bytes(self.ifname)


def _status_kb(field: str, path: str = "/proc/self/status") -> int | None:
    """A ``field:`` line's kB in a /proc file (None off Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_mb() -> float | None:
    """This process's resident memory now (Linux), to see that runs free what they built."""
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024 / 1e6


def cached_host_memory(reserve_mb: int = 2048) -> bool:
    """Keep freed host memory in the process, as a device's caching allocator keeps device memory.

    The timing pass's setting (:func:`exact_rss` is the memory pass's). With glibc's defaults a
    freed block of tens of MB may go back to the kernel and be faulted in again when the next
    gradient or buffer is allocated. Here (a VM) such a fault costs 1-40 us per 4 KiB page: one
    25 MB gradient took 7-260 ms of the backward instead of 0.4 ms, at random, more often in rows
    that allocate more, a noise that a GPU's gradients (caching allocator) do not have. Blocks up
    to 32 MiB (glibc's largest mmap threshold) come from the heap, the heap is never trimmed (-1;
    glibc's largest positive threshold, 2^31 - 1 bytes, is less than the heap here, which was then
    handed back whole), and ``reserve_mb`` of it is faulted in at the start: the heap a whole
    sweep grows to, so that no timed step touches a fresh page (the default MLP's rows grew a
    rank's heap to 1.4-1.8 GB as rows fragment it; a 1 GiB reserve still left 25 MB gradients
    faulting in the streaming rows). False where glibc's mallopt is missing.
    """
    if not _mallopt(mmap_threshold=32 * 2**20, trim_threshold=-1):  # -1: never trim
        return False
    import torch

    # Touch the heap the run will allocate from, once, as a device allocator reserves its pool.
    blocks = [torch.zeros(30 * 2**18) for _ in range(reserve_mb // 30)]  # 30 MiB each
    del blocks
    return True


def host_reserve_mb(ranks_here: int, model_mb: float, most_mb: int = 2048) -> int:
    """The heap each of ``ranks_here`` timing ranks faults in (:func:`cached_host_memory`):
    24x the model's fp32 megabytes (a rank's heap grew to ~15x over the default sweep), at most
    ``most_mb``, and at most a fair share of half the machine's available memory."""
    want = min(most_mb, math.ceil(24 * model_mb))
    kb = _status_kb("MemAvailable", "/proc/meminfo")
    return want if kb is None else max(0, min(want, kb // 1024 // 2 // max(1, ranks_here)))


def exact_rss() -> bool:
    """Make freed tensors leave the resident set: every allocation of 64 KiB or more its own mmap.

    glibc's default raises its mmap threshold as large blocks are freed, after which freed
    tensors stay in the heap and peak RSS measures the allocator, not the program. Slower
    allocations from then on (fresh pages each time). False where glibc's mallopt is missing.
    """
    return _mallopt(mmap_threshold=64 * 1024, trim_threshold=128 * 1024) is not None


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool | None:
    """Set glibc's mmap threshold (fixed: no dynamic adjustment) and trim threshold: whether
    glibc took both values, None where glibc is missing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    ok = libc.mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD
    return bool(libc.mallopt(-1, trim_threshold) and ok)  # M_TRIM_THRESHOLD


class MemoryProbe:
    """A rank's peak resident memory over one run, above its memory at the run's start.

    :meth:`start` collects garbage, hands the allocator's free memory back to the kernel
    (``malloc_trim``, so memory that earlier runs freed is not counted as in use) and resets
    the kernel's high-water mark (``/proc/self/clear_refs``); :meth:`peak_mb` is the high-water
    mark since then minus the memory at the start. Exact after :func:`exact_rss`. Rows are
    compared with DDP's, whose model, gradients, buckets and optimizer state are the same:
    the difference is what the method keeps (anchors, backups, snapshots, outer momentum) and
    its temporaries. Unavailable (None) off Linux.
    """

    def __init__(self) -> None:
        self.start_kb: int | None = None

    def start(self) -> None:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError as e:
            logger.debug("bench: no peak memory (%s)", e)
            self.start_kb = None
            return
        self.start_kb = _status_kb("VmRSS")

    def peak_mb(self) -> float | None:
        peak = _status_kb("VmHWM")
        if self.start_kb is None or peak is None:
            return None
        return (peak - self.start_kb) * 1024 / 1e6
