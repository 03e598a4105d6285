"""One table of inter-node payloads (``hiersync.vocab.WIRE_FORMATS``) read by the options, the
codecs and the cost model: a name accepted by one is known to all, with the same bits."""

from __future__ import annotations

import pytest

from hiersync.config import HierConfig
from hiersync.costmodel import compression
from hiersync.vocab import QUANT_BLOCK, WIRE_FORMATS, wire_format


@pytest.mark.parametrize("name", list(WIRE_FORMATS))
def test_every_payload_is_an_option_and_is_priced(name):
    f = WIRE_FORMATS[name]
    cfg = HierConfig(period=4, compress=name)
    assert cfg.compress == (None if name == "none" else name)
    bits = compression.bits_per_element(name)
    assert bits == f.bits_per_value(32)
    assert bits == (32 if f.bits is None else f.bits + (32 / QUANT_BLOCK if f.codec == "block" else 0)) or f.keep
    assert compression.is_quantized(name) == f.feedback == (f.average != "all_reduce")


def test_an_unknown_payload_is_refused_everywhere_with_the_valid_names():
    for check in (wire_format, compression.check_compress, lambda c: HierConfig(period=4, compress=c)):
        with pytest.raises(ValueError, match="int4"):
            check("int3")


def test_none_is_fp32_and_the_narrow_payloads_are_deltas():
    assert wire_format(None) is WIRE_FORMATS["none"] and not wire_format(None).delta
    assert all(f.delta for n, f in WIRE_FORMATS.items() if n != "none")


@pytest.mark.parametrize("name", list(WIRE_FORMATS))
def test_every_payload_has_its_codec(name):
    """The averagers' codec of each row: none for fp32, a cast for a float payload, block codes
    (with or without error feedback) for a block-scaled one; its bytes are what the model prices."""
    import torch

    from hiersync.quant import BlockCodec, CastCodec, codec_for

    f = WIRE_FORMATS[name]
    codec = codec_for(name)
    if f.bits is None:
        assert codec is None
        return
    assert codec is not None and codec.wire is f
    if f.codec == "sparse":
        n = 4096 * 2
        assert codec.packed_bytes(n) * 8 / n == compression.bits_per_element(name)  # type: ignore[union-attr]
    elif f.codec == "block":
        assert isinstance(codec, BlockCodec) and codec.feedback
        assert not codec_for(name, error_feedback=False).feedback  # type: ignore[union-attr]
        n = QUANT_BLOCK * 4
        assert codec.packed_bytes(n) * 8 / n == compression.bits_per_element(name)
    else:
        assert isinstance(codec, CastCodec)
        payload = codec.encode(torch.linspace(-1, 1, 64))
        assert payload.element_size() * 8 == f.bits == compression.bits_per_element(name)
