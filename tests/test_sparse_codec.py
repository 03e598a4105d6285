"""``compress="topk2"``: each block's largest values, 2-bit, with positions and error feedback.

The codec is checked against a reference written here in numpy (a dense top-k per block, the
ternary quantizer, the residual), in process: its payload's bytes, its decode, and its rail
average over N nodes with a fake comm that hands it the other nodes' payloads. The rail
average over real process groups is in ``tests/test_quantized_sync.py``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from hiersync.config import HierConfig
from hiersync.costmodel import compression
from hiersync.futures import completed, wait
from hiersync.quant import SparseCodec, codec_for
from hiersync.vocab import WIRE_FORMATS


def reference_sparse(x: np.ndarray, block: int, keep: int) -> np.ndarray:
    """What a payload of ``x`` decodes to: in each block the ``keep`` largest magnitudes, each sent
    as its sign times the block's mean nonzero magnitude of them, or 0 when under half that mean."""
    out = np.zeros_like(x)
    for b in range(0, x.size, block):
        v = x[b : b + block]
        top = np.argsort(-np.abs(v), kind="stable")[:keep]
        a = np.abs(v[top])
        s = a.sum(dtype=np.float64) / max(1, int((a > 0).sum()))
        out[b + top] = np.where(a * 2 > s, np.sign(v[top]) * s, 0.0)
    return out


def _codec(keep: int = 8, block: int = 64) -> SparseCodec:
    return SparseCodec(WIRE_FORMATS["topk2"], keep=keep, block=block)


def test_the_row_the_options_and_the_cost_model_agree():
    codec = codec_for("topk2", options=HierConfig(period=4, compress="topk2", topk=32))
    assert isinstance(codec, SparseCodec) and (codec.keep, codec.block) == (32, 4096)
    default = codec_for("topk2")
    n = 4096 * 3
    assert default.packed_bytes(n) == 3 * (64 // 4 + 64 * 3 // 2 + 4) == 3 * 116
    assert default.packed_bytes(n) * 8 / n == compression.bits_per_element("topk2") == (64 * 14 + 32) / 4096
    assert compression.compress_ratio("topk2") / compression.compress_ratio("bf16") < 0.015


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(compress="int4", topk=64), "applies to compress='topk2'"),
        (dict(compress="topk2", topk=6), "multiple of 4"),
        (dict(compress="topk2", topk=8192), "between 4 and 4096"),
        (dict(compress="topk2", topk=6.0), "must be an int"),
    ],
)
def test_bad_topk_is_refused_with_the_fix(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        HierConfig(period=4, **bad)


@pytest.mark.parametrize("keep, block", [(8, 64), (64, 4096), (4, 4)])
def test_payload_decodes_to_the_reference(keep, block):
    g = torch.Generator().manual_seed(keep + block)
    x = torch.randn(block * 4, generator=g) * torch.logspace(-3, 1, block * 4)
    x[block : 2 * block] = 0  # an all-zero block
    x[2 * block : 3 * block] = 0
    x[2 * block + 1 : 2 * block + 3] = torch.tensor([1.0, -3.0])  # fewer nonzeros than ``keep``
    codec = _codec(keep, block)
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.numel() == codec.packed_bytes(x.numel())
    got = codec.decode(packed, x.numel())
    want = reference_sparse(x.numpy(), block, keep)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=0)
    assert not got[block : 2 * block].any()  # zeros stay zeros
    assert int((got != 0).sum()) <= 4 * keep


class _Rail:
    """A rail of ``nodes`` in process: node 0 is the codec's, the others' payloads come from ``others``."""

    def __init__(self, nodes: int, others: list[torch.Tensor], own: list[float] | None = None) -> None:
        self.nodes, self.others = nodes, others
        self.weighting = None
        if own is not None:
            total = sum(own)
            self.weighting = types.SimpleNamespace(
                own=own[0], expected=float(nodes), rescale=lambda: nodes / total if total else 0.0
            )

    def rail_nodes(self) -> int:
        return self.nodes

    def rail_divisor(self) -> int:
        return self.nodes

    def contributes(self) -> bool:
        return True

    def gather_payloads(self, packed: torch.Tensor) -> torch.futures.Future:
        return completed(torch.cat([packed, *self.others]))


def _site(comm) -> types.SimpleNamespace:
    return types.SimpleNamespace(comm=comm, transfer=None, stored=lambda t: t, here=lambda t, device: t)


@pytest.mark.parametrize("nodes", [1, 2, 3])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "by_samples"])
def test_rail_average_and_error_feedback_against_the_reference(nodes, weighted):
    """Four syncs: the mean of every node's decoded payload (weighted by samples), and every
    sync ``sent + residual == delta + the residual before`` to fp32 rounding."""
    keep, block, n = 8, 64, 150  # padded to 192: three blocks, the last partly padding
    codec = _codec(keep, block)
    g = torch.Generator().manual_seed(nodes)
    samples = [3.0, 1.0, 2.0][:nodes] if weighted else [1.0] * nodes
    residuals = [np.zeros(n, dtype=np.float32) for _ in range(nodes)]
    kept = types.SimpleNamespace(residual=None, reduced_residual=None)
    for _sync in range(4):
        deltas = [torch.randn(n, generator=g) for _ in range(nodes)]
        # the reference: each node's payload of delta + residual, its residual what is left
        sent, ys = [], []
        for j in range(nodes):
            y = np.zeros(codec.padded(n), dtype=np.float32)
            y[:n] = deltas[j].numpy() + residuals[j]
            d = reference_sparse(y, block, keep)
            sent.append(d[:n])
            ys.append(y)
            residuals[j] = (y - d)[:n]
        total = sum(samples)
        want = sum(samples[j] / total * sent[j] for j in range(nodes))
        # the others' payloads as they send them: the same codec, their scales times their weight
        # (samples x nodes / the expected total, here one sample a node)
        others = []
        for j in range(1, nodes):
            pos, code, scale = codec.select(torch.from_numpy(ys[j]))
            others.append(codec.pack(pos, code, scale * samples[j]))
        e = torch.zeros(codec.padded(n))
        e[:n] = deltas[0]
        before = None if kept.residual is None else kept.residual.clone()
        comm = _Rail(nodes, others, samples if weighted else None)
        got = codec.result(wait(codec.average(_site(comm), e, n, kept)), comm.weighting, None)
        if nodes == 1:  # one node: its own delta and residual, nothing left over
            want = deltas[0].numpy() + (0 if before is None else before.numpy())
            residuals[0] = np.zeros(n, dtype=np.float32)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
        if nodes == 1:
            assert kept.residual is None  # nothing was ever left out
            continue
        assert kept.residual.dtype == torch.float32
        np.testing.assert_allclose(kept.residual.numpy(), residuals[0], rtol=1e-6, atol=1e-6)
        prior = torch.zeros(n) if before is None else before  # the invariant, on this node's own numbers
        mine = torch.from_numpy(sent[0])
        torch.testing.assert_close(mine + kept.residual, deltas[0] + prior, rtol=0, atol=1e-6)
