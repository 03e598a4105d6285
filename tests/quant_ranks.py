"""Functions every rank runs for the int8/int4 rail average's tests (module level, so importable)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import hiersync
from hiersync.collectives import HierComm
from hiersync.futures import wait
from hiersync.quant import BlockCodec


def quantized_average_check(bits: int) -> dict:
    """HierComm.average_quantized against the same average done by hand from every rank's codes:
    rank j of a rail decodes piece j of every node, averages in fp32, re-encodes; everyone
    decodes the gathered pieces."""
    topo = hiersync.Topology.detect()
    comm = HierComm(topo.build_groups())
    codec = BlockCodec(bits, block=8)
    N, rank = comm.rail_nodes(), dist.get_rank()
    n = 8 * 3  # values per piece: three blocks
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(N * n, generator=g) * (1 + rank)
    packed = codec.encode_pieces(x, N)
    nbytes = codec.packed_bytes(n)

    def mean_of(pieces: list[torch.Tensor]) -> torch.Tensor:
        return sum(codec.decode(p, n) for p in pieces) / len(pieces)  # type: ignore[return-value]

    def reduce(received: torch.Tensor) -> torch.Tensor:
        return codec.encode(mean_of([received[j * nbytes : (j + 1) * nbytes] for j in range(N)]))

    gathered = wait(comm.average_quantized(packed, reduce))
    got = torch.cat([codec.decode(gathered[j * nbytes : (j + 1) * nbytes], n) for j in range(N)])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, packed)
    rail = topo.rail(topo.local_rank(rank))
    by_hand = []
    for j in range(N):  # piece j: reduced by the j-th rank of the rail
        mean = mean_of([everyone[r][j * nbytes : (j + 1) * nbytes] for r in rail])
        by_hand.append(codec.decode(codec.encode(mean), n))
    sent = comm.stats.bytes_sent["inter"]
    comm.groups.destroy()
    return {"equal": torch.equal(got, torch.cat(by_hand)), "bytes_sent": sent, "packed_bytes": packed.numel()}
