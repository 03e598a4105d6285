"""The int8/int4 block codes and their error feedback, against a quantizer written apart.

The reference below quantizes one block at a time with Python scalars for the scale and
plain tensor ops for the values, and packs 4-bit codes with explicit arithmetic; the
library's vectorized codec must give the same bytes, bit for bit.
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hiersync.quant import RESIDUAL_DTYPE, BlockCodec, ErrorFeedback, codec_for
from hiersync.vocab import QUANT_BLOCK


def reference_encode(x: torch.Tensor, bits: int, block: int) -> bytes:
    """Codes then fp32 scales, one block at a time."""
    qmax = 127 if bits == 8 else 7
    codes, scales = [], []
    for b in range(x.numel() // block):
        v = x[b * block : (b + 1) * block]
        scale = torch.max(torch.abs(v)) / qmax  # fp32, as the library computes it
        q = torch.zeros(block) if scale == 0 else torch.clamp(torch.round(v / scale), -qmax, qmax)
        codes += [int(c) for c in q.tolist()]
        scales.append(struct.pack("<f", float(scale)))
    if bits == 8:
        body = bytes((c + 256) % 256 for c in codes)
    else:
        body = bytes((codes[i] + 8) | ((codes[i + 1] + 8) << 4) for i in range(0, len(codes), 2))
    return body + b"".join(scales)


def reference_decode(data: bytes, n: int, bits: int, block: int) -> torch.Tensor:
    ncodes = n * bits // 8
    scales = struct.unpack(f"<{n // block}f", data[ncodes:])
    if bits == 8:
        codes = [c - 256 if c > 127 else c for c in data[:ncodes]]
    else:
        codes = [v for byte in data[:ncodes] for v in ((byte & 0xF) - 8, (byte >> 4) - 8)]
    return torch.tensor([codes[i] * scales[i // block] for i in range(n)], dtype=torch.float32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [QUANT_BLOCK, 32])
def test_codec_matches_the_reference_to_the_bit(bits, block):
    torch.manual_seed(bits * block)
    x = torch.randn(block * 5) * torch.logspace(-4, 1, block * 5)
    x[block : 2 * block] = 0  # an all-zero block: scale 0
    codec = BlockCodec(bits, block)
    packed = codec.encode(x)
    assert bytes(packed.tolist()) == reference_encode(x, bits, block)
    assert packed.numel() == codec.packed_bytes(x.numel()) == x.numel() * bits // 8 + 5 * 4
    assert torch.equal(
        codec.decode(packed, x.numel()), reference_decode(bytes(packed.tolist()), x.numel(), bits, block)
    )


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([8, 4]),
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=4, max_size=4 * 6).filter(
        lambda v: len(v) % 4 == 0
    ),
)
@example(bits=8, values=[0.0, 0.0, 0.0, 1.1754943508222875e-38])  # a subnormal scale: 1 / scale overflows
def test_codec_matches_the_reference_on_any_values(bits, values):
    x = torch.tensor(values, dtype=torch.float32)
    codec = BlockCodec(bits, 4)
    assert bytes(codec.encode(x).tolist()) == reference_encode(x, bits, 4)


@pytest.mark.parametrize("bits", [8, 4])
def test_decoded_error_is_within_half_a_step(bits):
    torch.manual_seed(0)
    codec = BlockCodec(bits)
    x = torch.randn(QUANT_BLOCK * 8)
    err = (codec.decode(codec.encode(x), x.numel()) - x).abs().reshape(-1, QUANT_BLOCK)
    step = x.abs().reshape(-1, QUANT_BLOCK).amax(1, keepdim=True) / codec.qmax
    assert bool((err <= step / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_carries_what_was_not_sent(bits, pieces):
    """Over k windows, what was sent plus the residual is everything that should have been,
    but for the bf16 rounding of each window's residual, which is within 2^-9 of it."""
    codec = BlockCodec(bits)
    ef = ErrorFeedback(codec, pieces)
    g = torch.Generator().manual_seed(1)
    n = QUANT_BLOCK * 4
    residual, sent, truth, rounding, bound = None, torch.zeros(n), torch.zeros(n), torch.zeros(n), 0.0
    for _ in range(6):
        delta = 1e-3 * torch.randn(n, generator=g)
        truth += delta
        packed, left = ef.encode(delta.clone(), residual)
        sent += codec.decode_pieces(packed, n, pieces)
        residual = ErrorFeedback.keep(left, residual)
        assert residual.dtype == RESIDUAL_DTYPE
        rounding += left - residual.float()
        bound += float(left.abs().max()) * 2**-9
    assert residual is not None
    torch.testing.assert_close(sent + residual.float() + rounding, truth, rtol=0, atol=1e-9)
    assert float((sent + residual.float() - truth).abs().max()) <= bound
    without = codec.decode(codec.encode(truth / 6), truth.numel()) * 6  # no feedback: the errors stay
    assert (sent + residual - truth).abs().max() < (without - truth).abs().max() / 50


def test_a_residual_of_another_length_starts_afresh():
    left = torch.ones(QUANT_BLOCK)
    old = torch.zeros(QUANT_BLOCK * 2, dtype=RESIDUAL_DTYPE)
    kept = ErrorFeedback.keep(left, old)
    assert kept is not old and kept.numel() == QUANT_BLOCK and kept.dtype == RESIDUAL_DTYPE
    same = torch.zeros(QUANT_BLOCK, dtype=RESIDUAL_DTYPE)
    assert ErrorFeedback.keep(left, same) is same and torch.equal(same.float(), left)


def test_pieces_are_encoded_each_on_its_own():
    codec = BlockCodec(4, 8)
    x = torch.randn(8 * 6)
    packed = codec.encode_pieces(x, 3)
    b = codec.packed_bytes(16)
    for j in range(3):
        assert torch.equal(packed[j * b : (j + 1) * b], codec.encode(x[j * 16 : (j + 1) * 16]))
    assert torch.equal(codec.decode_pieces(packed, 48, 3), codec.decode(codec.encode(x), 48))


def test_codec_errors_name_the_fix():
    with pytest.raises(ValueError, match="use 8 or 4"):
        BlockCodec(3)
    with pytest.raises(ValueError, match="valid: none, bf16, fp16, int8, int4"):
        codec_for("int2")
    with pytest.raises(ValueError, match="multiple of 128"):
        BlockCodec(8).encode(torch.zeros(100))


def test_bits_per_value_the_cost_model_prices():
    from hiersync.costmodel.compression import bits_per_element

    for name in ("int8", "int4"):
        codec = codec_for(name)
        assert codec.packed_bytes(QUANT_BLOCK * 10) * 8 / (QUANT_BLOCK * 10) == bits_per_element(name)
