"""Host cost of the coded payloads' encode and decode, against the cost model's passes.

One rank's shard of the 25 MB model (6.5M fp32 parameters, 2 ranks a node: 3.25M values) is
encoded and decoded as a sync does it: int8's quantize pass gives this machine's
``quant_gbps`` (the rate the cost model prices every pass at), then ``compress="topk2"``'s
encode with error feedback and the decode of N payloads into the dense sum are timed, and
:func:`hiersync.costmodel.compression.quantize_seconds` at that rate is printed beside them.

    python benchmarks/codec_cost.py [--values 3250000] [--nodes 2,4] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from hiersync.costmodel.compression import quantize_seconds
from hiersync.futures import completed, wait
from hiersync.quant import BlockCodec, codec_for


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=3_250_000)
    parser.add_argument("--nodes", default="2,4")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    codec = codec_for("topk2")
    n = codec.padded(args.values)
    x = torch.randn(n)
    int8 = BlockCodec(8)
    print(f"{n:,} values; each repeat times int8's quantize pass (this host's quant_gbps) and then topk2's average")
    for N in (int(v) for v in args.nodes.split(",")):
        others = [codec.encode(torch.randn(n)) for _ in range(N - 1)]
        comm = types.SimpleNamespace(
            weighting=None,
            rail_nodes=lambda N=N: N,
            rail_divisor=lambda N=N: N,
            contributes=lambda: True,
            gather_payloads=lambda p, o=others: completed(torch.cat([p, *o])),
        )
        site = types.SimpleNamespace(comm=comm, stored=lambda t: t, here=lambda t, device: t)
        kept = types.SimpleNamespace(residual=torch.randn(n), reduced_residual=None)
        ratios, measured = [], []
        for _ in range(args.repeats):  # paired: the rate and the cost measured back to back
            gbps = n * 4 / timed(lambda: int8.encode(x)) / 1e9
            took = timed(lambda s=site, k=kept: wait(codec.average(s, x.clone(), n, k)))
            ratios.append(quantize_seconds(n, N, _profile(gbps), "topk2") / took)  # type: ignore[arg-type]
            measured.append(took)
        r = statistics.quantiles(ratios, n=4)
        print(
            f"topk2, {N} nodes: measured {statistics.median(measured) * 1e3:.1f} ms (median of {args.repeats}); "
            f"priced / measured, paired: median {statistics.median(ratios):.2f}x (quartiles {r[0]:.2f}-{r[2]:.2f}x)"
        )


def _profile(gbps: float) -> types.SimpleNamespace:
    return types.SimpleNamespace(quant_gbps=gbps)


if __name__ == "__main__":
    main()
