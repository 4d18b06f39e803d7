"""Our NF4 bytes are bitsandbytes' own: codes, nibble order, absmax and rounding, checked against
`bitsandbytes.functional` on the CPU (the `qlora` extra; the test extra installs it for CI)."""

from __future__ import annotations

import warnings

import pytest
import torch

from qerl_pipe.formats.nf4 import _THRESHOLDS, NF4_BLOCK, NF4_CODE, dequantize_nf4, quantize_nf4

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")


def _bnb_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
    """bitsandbytes' packed bytes (as [N, K/2]), absmax (as [N, K/64]) and state of fp32 `w`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its own FutureWarning about torch._check_is_size
        packed, state = F.quantize_4bit(w.float(), blocksize=NF4_BLOCK, quant_type="nf4", compress_statistics=False)
    n, k = w.shape
    return packed.reshape(n, k // 2), state.absmax.reshape(n, k // NF4_BLOCK), state


def _weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 320, generator=gen) * torch.logspace(-4, 1, 96).unsqueeze(1)  # scales over 5 decades
    w[3, :64] = 0  # an all-zero block
    w[5, 64:128] = torch.linspace(-1, 1, 64)
    w[6, :] = torch.randn(320, generator=gen).abs()  # one sign only
    # Every decision threshold, and the fp32 values on either side of it, in blocks reaching 1.0.
    t = torch.tensor(_THRESHOLDS)
    edges = torch.cat([t, torch.nextafter(t, torch.tensor(-2.0)), torch.nextafter(t, torch.tensor(2.0))])
    w[7, : edges.numel()] = edges
    w[7, edges.numel()] = 1.0
    w[8, :64] = -torch.tensor(NF4_CODE).repeat(4)  # the levels themselves, negated
    return [w, w.bfloat16(), w.half(), torch.randn(4608, 64, generator=gen) * 0.02]


@pytest.mark.parametrize("case", range(4))
def test_codes_and_absmax_are_bitsandbytes(case):
    w = _weights()[case]
    packed, absmax, _ = _bnb_quantize(w)
    q = quantize_nf4(w)
    assert torch.equal(q.absmax, absmax)
    mismatched = (q.packed != packed).nonzero()
    assert mismatched.numel() == 0, f"{len(mismatched)} bytes differ, first at {mismatched[:3].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantized_values_are_bitsandbytes(dtype):
    w = _weights()[0]
    packed, _, state = _bnb_quantize(w)
    state.dtype = dtype  # what bitsandbytes' dequantize_4bit returns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = F.dequantize_4bit(packed.reshape(-1, 1), state)
    assert theirs.dtype == dtype and torch.equal(theirs, dequantize_nf4(quantize_nf4(w), dtype))


def test_the_code_table_is_bitsandbytes():
    assert torch.equal(F.get_4bit_type("nf4", device="cpu"), torch.tensor(NF4_CODE, dtype=torch.float32))
