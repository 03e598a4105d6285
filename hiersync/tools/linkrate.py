"""The raw TCP ceiling of the inter-node link, measured the way the rails load it.

Every rank streams bytes to its rail peer on the next node while receiving from the
previous one (every direction at once); :func:`sustained_rate` turns the receive
timestamps into bytes per second into each node. ``collbench`` reports its results
against this ceiling.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from hiersync.vocab import MiB

__all__ = ["tcp_throughput", "bytes_at", "sustained_rate"]


def tcp_throughput(topo: Any, rank: int, addr: str, nbytes: int) -> dict | None:
    """Every rank streams ``nbytes`` to its rail peer on the next node while receiving from the previous one."""
    import torch.distributed as dist

    nodes = topo.num_nodes
    if nodes < 2:
        return None
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((addr, 0))
    srv.listen(4)
    srv.settimeout(60)
    ends: list[Any] = [None] * topo.world_size
    dist.all_gather_object(ends, (addr, srv.getsockname()[1]))
    node, local = topo.node_of(rank), topo.local_rank(rank)
    nxt = topo.nodes[(node + 1) % nodes]
    peer = nxt[local] if local < len(nxt) else None
    has_prev = local < len(topo.nodes[(node - 1) % nodes])
    accepted: list[socket.socket] = []

    def accept() -> None:
        conn, _ = srv.accept()
        accepted.append(conn)

    acceptor = threading.Thread(target=accept, daemon=True) if has_prev else None
    if acceptor is not None:
        acceptor.start()
    out = socket.create_connection(ends[peer], timeout=60) if peer is not None else None
    if acceptor is not None:
        acceptor.join(60)
    chunk = memoryview(bytearray(4 * MiB))
    dist.barrier()
    t0 = time.perf_counter()

    def send() -> None:
        left = nbytes
        while left > 0 and out is not None:
            n = min(left, len(chunk))
            out.sendall(chunk[:n])
            left -= n

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    got = 0
    samples: list[tuple[float, int]] = [(t0, 0)]  # (time, bytes received so far)
    if accepted:
        buf = bytearray(4 * MiB)
        conn = accepted[0]
        while got < nbytes:
            n = conn.recv_into(buf)
            if n == 0:
                break
            got += n
            samples.append((time.perf_counter(), got))
    sender.join(120)
    for s in [out, srv] + accepted:
        if s is not None:
            s.close()
    results: list[Any] = [None] * topo.world_size
    # perf_counter is CLOCK_MONOTONIC: one clock for every process on this host.
    dist.all_gather_object(results, (node, samples if got else None))
    per_node = [rate for n in range(nodes) if (rate := sustained_rate([r[1] for r in results if r[0] == n and r[1]]))]
    return {
        "bytes_per_stream": nbytes,
        "streams_per_node": len(topo.nodes[0]),
        "node_MBps": [x / 1e6 for x in per_node],
        "MBps": min(per_node) / 1e6 if per_node else None,
    }


def bytes_at(samples: Sequence[tuple[float, int]], t: float) -> float:
    """Bytes a stream had received at time ``t`` (linear between samples)."""
    for (t0, b0), (t1, b1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return b0 + (b1 - b0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return float(samples[-1][1] if t > samples[-1][0] else 0)


def sustained_rate(streams: Sequence[Sequence[tuple[float, int]]]) -> float | None:
    """Bytes/s into a node while all its streams ran, after each had received a quarter.

    Skipping the first quarter leaves out TCP slow start and the initial burst through
    tbf's bucket; using only the window in which every stream was still running keeps a
    stream that finished early from inflating the sum of per-stream rates.
    """
    if not streams:
        return None
    starts = []
    for s in streams:
        quarter = s[-1][1] / 4
        starts.append(next(t for t, b in s if b >= quarter))
    lo, hi = max(starts), min(s[-1][0] for s in streams)
    if hi <= lo:  # the streams barely overlapped: fall back to the whole transfer
        lo, hi = min(s[0][0] for s in streams), max(s[-1][0] for s in streams)
        return sum(s[-1][1] for s in streams) / (hi - lo)
    return sum(bytes_at(s, hi) - bytes_at(s, lo) for s in streams) / (hi - lo)
