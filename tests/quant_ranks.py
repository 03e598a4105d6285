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


def sparse_average_check(syncs: int = 3) -> dict:
    """The topk2 rail average (HierComm.gather_payloads) over this job's rails, three syncs with
    error feedback, against the same maths done here in numpy from every rank's deltas: each node
    sends its block top-k of delta + residual, every rank averages the decoded payloads of its rail.
    """
    import types

    import numpy as np
    from test_sparse_codec import reference_sparse

    from hiersync.quant import SparseCodec
    from hiersync.vocab import WIRE_FORMATS

    topo = hiersync.Topology.detect()
    comm = HierComm(topo.build_groups())
    codec = SparseCodec(WIRE_FORMATS["topk2"], keep=8, block=64)
    rank, W = dist.get_rank(), dist.get_world_size()
    rail = list(topo.rail(topo.local_rank(rank)))
    n = 150
    site = types.SimpleNamespace(comm=comm, transfer=None, stored=lambda t: t, here=lambda t, device: t)
    kept = types.SimpleNamespace(residual=None, reduced_residual=None)
    residual = {r: np.zeros(n, dtype=np.float32) for r in rail}
    worst, invariant = 0.0, 0.0
    for sync in range(syncs):
        deltas = {r: torch.randn(n, generator=torch.Generator().manual_seed(100 * sync + r)) for r in range(W)}
        sent = {}
        for r in rail:  # the reference, for every node of this rank's rail
            y = np.zeros(codec.padded(n), dtype=np.float32)
            y[:n] = deltas[r].numpy() + residual[r]
            d = reference_sparse(y, 64, 8)[:n] if len(rail) > 1 else y[:n]
            sent[r], residual[r] = d, y[:n] - d
        want = sum(sent[r] for r in rail) / len(rail)
        before = torch.zeros(n) if kept.residual is None else kept.residual.clone()
        e = torch.zeros(codec.padded(n))
        e[:n] = deltas[rank]
        got = wait(codec.average(site, e, n, kept))
        worst = max(worst, float(np.abs(got.numpy() - want).max()))
        mine = kept.residual if kept.residual is not None else torch.zeros(n)
        invariant = max(invariant, float((torch.from_numpy(sent[rank]) + mine - deltas[rank] - before).abs().max()))
    everyone: list = [None] * W
    dist.all_gather_object(everyone, got)
    same_rail = all(torch.equal(everyone[r], got) for r in rail)
    sent_bytes = comm.stats.bytes_sent["inter"]
    comm.groups.destroy()
    return {
        "worst": worst,
        "invariant": invariant,
        "same_rail": same_rail,
        "bytes_sent": sent_bytes,
        "packed_bytes": codec.packed_bytes(codec.padded(n)),
        "nodes": len(rail),
    }
