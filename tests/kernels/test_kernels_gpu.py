"""The compiled kernels on a CUDA GPU (run on the H200: `pytest -m gpu`), vs the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.formats.nf4 import dequantize_nf4, quantize_nf4
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.kernels.configs import KernelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIGS = [
    KernelConfig("skinny", 1, 16, 256),
    KernelConfig("skinny", 4, 8, 128, split_k=4),
    KernelConfig("tiled", 16, 64, 128, num_stages=4),
    KernelConfig("tiled", 16, 64, 128, split_k=3),
    KernelConfig("tiled", 128, 128, 64, num_warps=8, num_stages=4),
    KernelConfig("gemv", 1, 8, 1024),
    KernelConfig("gemv", 2, 16, 512, split_k=3, num_stages=3),
    KernelConfig("dequant", 1, 32, 256),
    KernelConfig("dequant", 1, 64, 128, num_warps=8),
    # The inline-PTX NVFP4 decode (NF4 ignores the flag) in every kernel kind.
    KernelConfig("skinny", 1, 8, 512, ptx_decode=True),
    KernelConfig("gemv", 1, 8, 1024, split_k=4, ptx_decode=True),
    KernelConfig("tiled", 16, 64, 128, num_stages=4, ptx_decode=True),
    KernelConfig("tiled", 16, 64, 128, split_k=3, ptx_decode=True),
    KernelConfig("dequant", 1, 32, 256, ptx_decode=True),
]


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4608, 3584), (7, 333, 1088), (200, 1000, 512)])
def test_forward(fmt: str, cfg: KernelConfig, m: int, n: int, k: int) -> None:
    from qerl_pipe.kernels.packing import prepare_nf4, prepare_nvfp4
    from qerl_pipe.kernels.triton_matmul import launch_forward

    w = torch.randn(n, k, device="cuda") * torch.rand(n, 1, device="cuda") ** 4
    q = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_nf4(w)
    dense = (dequantize_nvfp4 if fmt == "nvfp4" else dequantize_nf4)(q, torch.float32)
    packed = prepare_nvfp4(q) if fmt == "nvfp4" else prepare_nf4(q)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = launch_forward(x, packed, cfg, out=out)
    ref = x.float() @ dense.T
    assert torch.isfinite(y).all()
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
@pytest.mark.parametrize("ptx", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4608, 3584), (300, 1000, 576)])
def test_dx_kernel(fmt: str, ptx: bool, m: int, n: int, k: int) -> None:
    from qerl_pipe.kernels.packing import prepare_nf4, prepare_nvfp4
    from qerl_pipe.kernels.triton_matmul import launch_dx

    w = torch.randn(n, k, device="cuda") * torch.rand(n, 1, device="cuda") ** 4
    q = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_nf4(w)
    dense = (dequantize_nvfp4 if fmt == "nvfp4" else dequantize_nf4)(q, torch.float32)
    packed = prepare_nvfp4(q) if fmt == "nvfp4" else prepare_nf4(q)
    dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    out = torch.full((m, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    dx = launch_dx(dy, packed, KernelConfig("tiled", 16, 64, 128, ptx_decode=ptx), out=out)
    ref = dy.float() @ dense
    assert float((dx.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4608, 3584), (300, 1000, 576)])
def test_dx(fmt: str, m: int, n: int, k: int) -> None:
    from qerl_pipe.kernels import nf4_linear_dx, nvfp4_linear_dx

    w = torch.randn(n, k, device="cuda")
    q = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_nf4(w)
    dense = (dequantize_nvfp4 if fmt == "nvfp4" else dequantize_nf4)(q, torch.float32)
    dy = torch.randn(2, m, n, device="cuda").to(torch.bfloat16)
    dx = (nvfp4_linear_dx if fmt == "nvfp4" else nf4_linear_dx)(dy, q)
    ref = dy.float() @ dense
    assert dx.shape == (2, m, k)
    assert float((dx.float() - ref).norm() / ref.norm()) < 1e-2


def test_dequant_scratch_is_shared_and_exact() -> None:
    """The decode pass writes the reference's weight rounded once to bf16; one buffer serves all."""
    from qerl_pipe.kernels.dequant_gemm import dequantize_into, scratch
    from qerl_pipe.kernels.packing import prepare_nvfp4
    from qerl_pipe.kernels.triton_matmul import _operands

    w = torch.randn(1000, 4096, device="cuda") * torch.rand(1000, 1, device="cuda") ** 4
    q = quantize_nvfp4(w)
    big = scratch(1000, 4096, w.device, torch.bfloat16)
    big.fill_(float("nan"))
    got = dequantize_into(*_operands(prepare_nvfp4(q)), big, KernelConfig("dequant", 1, 32, 256))
    # One bf16 rounding of the fp32 value (the reference's own rounding may differ by that ulp).
    torch.testing.assert_close(got.float(), dequantize_nvfp4(q, torch.float32), rtol=2**-8, atol=0)
    # The PTX decode computes the same exact products: bit-identical weights.
    ptx = dequantize_into(*_operands(prepare_nvfp4(q)), torch.empty_like(got),
                          KernelConfig("dequant", 1, 32, 256), ptx=True)
    assert torch.equal(ptx, got)
    small = scratch(10, 64, w.device, torch.bfloat16)
    assert small.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
