from __future__ import annotations

import pytest
import torch

from qerl_pipe.errors import QuantizationError
from qerl_pipe.formats.nf4 import NF4_BLOCK, NF4_CODE, NF4Weight, dequantize_nf4, pack_nf4, quantize_nf4, unpack_nf4


def test_code_table_is_bitsandbytes_nf4():
    assert NF4_BLOCK == 64 and len(NF4_CODE) == 16
    assert NF4_CODE[0] == -1.0 and NF4_CODE[7] == 0.0 and NF4_CODE[15] == 1.0
    assert list(NF4_CODE) == sorted(NF4_CODE)
    # Spot values from bitsandbytes' get_4bit_type("nf4").
    assert NF4_CODE[1] == -0.6961928009986877 and NF4_CODE[8] == 0.07958029955625534
    assert NF4_CODE[14] == 0.7229568362236023


def test_round_trip_error_is_bounded():
    w = torch.randn(128, 512, generator=torch.Generator().manual_seed(0))
    q = quantize_nf4(w)
    assert q.packed.shape == (128, 256) and q.packed.dtype == torch.uint8
    assert q.absmax.shape == (128, 8) and q.absmax.dtype == torch.float32
    err = (dequantize_nf4(q) - w).norm() / w.norm()
    assert 0.02 < float(err) < 0.12


def test_exact_codes_reproduce_exactly():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 128), generator=gen, dtype=torch.uint8)
    codes[:, ::NF4_BLOCK] = 15  # each block reaches 1.0, so absmax = the block's scale exactly
    scales = torch.tensor([0.5, 2.0, 0.125, 1.0]).repeat_interleave(2).reshape(8, 1)
    w = torch.tensor(NF4_CODE)[codes.long()] * scales
    q = quantize_nf4(w)
    assert torch.equal(unpack_nf4(q.packed), codes)
    assert torch.equal(dequantize_nf4(q), w)


def test_blocks_are_independent():
    w = torch.zeros(2, 192)
    w[0, :64] = torch.linspace(-1, 1, 64)
    w[0, 64:128] = torch.linspace(-100, 100, 64)  # a large block does not coarsen its neighbours
    q = quantize_nf4(w)
    assert torch.equal(q.absmax, torch.tensor([[1.0, 100.0, 0.0], [0.0, 0.0, 0.0]]))
    out = dequantize_nf4(q)
    assert torch.equal(out[:, 128:], torch.zeros(2, 64)) and torch.equal(out[1], torch.zeros(192))
    widest_gap = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:]))
    assert float((out[0, :64] - w[0, :64]).abs().max()) <= widest_gap / 2


def test_nibble_order_is_bitsandbytes():
    """Element 2j in the high nibble of byte j, as bitsandbytes packs (`quantized[::2] << 4 | quantized[1::2]`)."""
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_nf4(codes).tolist() == [[0x12, 0xF0]]
    assert torch.equal(unpack_nf4(pack_nf4(codes)), codes)


def test_all_zero_block_stores_code_0_as_bitsandbytes_does():
    """absmax 0: bitsandbytes' `0 * (1 / 0)` is NaN, which it maps to code 0; the block still decodes to zeros."""
    q = quantize_nf4(torch.zeros(1, 64))
    assert q.packed.eq(0).all() and q.absmax.eq(0).all()
    assert dequantize_nf4(q).abs().max() == 0


def test_dtype_and_device_helpers():
    q = quantize_nf4(torch.randn(4, 64).half())
    assert dequantize_nf4(q, torch.bfloat16).dtype == torch.bfloat16
    moved = q.to("cpu")
    assert isinstance(moved, NF4Weight) and (moved.out_features, moved.in_features) == (4, 64)


def test_errors():
    with pytest.raises(QuantizationError, match=r"\(4, 96\).*multiple of 64"):
        quantize_nf4(torch.randn(4, 96), name="layer")
    w = torch.randn(2, 64)
    w[1, 3] = float("nan")
    with pytest.raises(QuantizationError, match="gate_proj.*non-finite"):
        quantize_nf4(w, name="gate_proj")
