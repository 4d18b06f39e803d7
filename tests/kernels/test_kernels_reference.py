"""Plain-torch parts of qerl_pipe.kernels: references, CPU dispatch, the NF4 container, the
per-weight cache, bitsandbytes' switches."""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.formats.nf4 import dequantize_nf4, quantize_nf4
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.kernels import bnb_backend, nf4_linear, nf4_linear_dx, nvfp4_linear, nvfp4_linear_dx
from qerl_pipe.kernels.packing import cached_per_tensor, prepare_nf4, prepared_nf4, unprepare_nf4
from qerl_pipe.kernels.tiled import tile_nvfp4


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 128)])
def test_linear_cpu_matches_dequantized_matmul(shape: tuple[int, ...]) -> None:
    gen = _gen()
    k, n = shape[-1], 48
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    dy = torch.randn(*shape[:-1], n, generator=gen).to(torch.bfloat16)
    q4, nf = quantize_nvfp4(w), quantize_nf4(w)
    for fwd, bwd, wq, dense in ((nvfp4_linear, nvfp4_linear_dx, q4, dequantize_nvfp4(q4)),
                                (nf4_linear, nf4_linear_dx, nf, dequantize_nf4(nf))):
        y = fwd(x, wq)
        assert y.shape == (*shape[:-1], n) and y.dtype == torch.bfloat16
        assert _rel(y, x.float() @ dense.T) < 1e-2
        dx = bwd(dy, wq)
        assert dx.shape == shape and dx.dtype == torch.bfloat16
        assert _rel(dx, dy.float() @ dense) < 1e-2


def test_linear_accepts_the_layouts_linears_hold_on_cpu() -> None:
    gen = _gen()
    w = torch.randn(24, 64, generator=gen)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    q4, nf = quantize_nvfp4(w), quantize_nf4(w)
    assert torch.equal(nvfp4_linear(x, tile_nvfp4(q4)), nvfp4_linear(x, q4))
    assert torch.equal(nf4_linear(x, prepare_nf4(nf)), nf4_linear(x, nf))


def test_the_nf4_container_is_a_view_that_round_trips() -> None:
    nf = quantize_nf4(torch.randn(16, 128, generator=_gen()))
    packed = prepare_nf4(nf)
    assert packed.qweight.dtype == torch.int32 and packed.qweight.shape == (16, 128 // 8)
    assert packed.qweight.data_ptr() == nf.packed.data_ptr()  # bitsandbytes' bytes, not a copy
    back = unprepare_nf4(packed)
    assert torch.equal(back.packed, nf.packed) and torch.equal(back.absmax, nf.absmax)


def test_derived_layouts_are_cached_per_weight_object() -> None:
    nf = quantize_nf4(torch.randn(16, 64, generator=_gen()))
    assert prepared_nf4(nf) is prepared_nf4(nf)
    packed = prepare_nf4(nf)
    assert prepared_nf4(packed) is packed
    t, made = torch.zeros(3), []
    assert cached_per_tensor(t, lambda: made.append(1) or "derived") == "derived"
    assert cached_per_tensor(t, lambda: made.append(1) or "again") == "derived" and made == [1]


def test_bitsandbytes_is_off_the_gpu_and_when_turned_off(monkeypatch) -> None:
    assert bnb_backend.why_unavailable("cpu") == "not a CUDA device"
    monkeypatch.setenv("QERL_BNB", "0")
    assert bnb_backend.why_unavailable("cuda") == "QERL_BNB=0"
