"""FP8 (E4M3) linears y = (x8 * sx) @ (w8 * sw)^T, scales per token and per output channel (amax / 448):
our Triton GEMM (triton_fp8.py) or cuBLASLt's on FP8 tensor cores, else the reference (the tests' oracle). `row_codes`
is what every fused kernel reproduces exactly (the KV cache's too). docs/kernels.md#fp8-rollouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
# The KV cache's code formats (engine.kv_cache) by dtype, and each one's largest code.
KV_CODES = {"fp8": FP8, "int8": torch.int8}
CODE_MAX = {FP8: FP8_MAX, torch.int8: 127.0}
# A zero row (an idle engine slot) gets this amax: its codes are all 0, and no division by zero.
MIN_AMAX = 1e-12


@dataclass(frozen=True)
class Fp8Rows:
    """Activations [M, K] as E4M3 codes and their per-row scale [M, 1] (fp32)."""

    codes: Tensor
    scale: Tensor


@dataclass(frozen=True)
class Fp8Weight:
    """A frozen base [N, K] as E4M3 codes (row-major, so `codes.t()` is the column-major [K, N]
    operand the FP8 GEMM takes) and its per-output-channel scale [1, N] (fp32)."""

    codes: Tensor
    scale: Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4


@dataclass(frozen=True)
class W4A8Weight:
    """An NVFP4 base read as it is by the W4A8 GEMM: its packed E2M1 codes [N, K/2] and E4M3 block
    scales [N, K/16], and per row the power of two `shift` [N] = 2**j that lifts the row's largest
    |code x block scale| into (224, 448]. The E4M3 weight e2m1 x block scale x 2**j is then exact
    before its one rounding (`w4a8_codes`); `scale` [1, N] = global scale x 2**-j undoes it in the
    epilogue, as `Fp8Weight.scale` does."""

    packed: Tensor
    block_scales: Tensor
    shift: Tensor
    scale: Tensor

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.block_scales.numel() + self.shift.numel() * 4 + self.scale.numel() * 4


def runs_fp8(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores (CUDA compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def row_codes(x: Tensor, codes: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    """Per-row E4M3 or INT8 codes of x [..., K] and their scale [..., 1] = amax x (1 / CODE_MAX); INT8
    rounds x / scale half up, within +-127."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) * (1.0 / CODE_MAX[codes])
    if codes == torch.int8:
        return torch.floor(x32 / scale + 0.5).clamp(-127, 127).to(torch.int8), scale
    return (x32 / scale).to(FP8), scale


def quantize_rows(x: Tensor) -> Fp8Rows:
    """`row_codes` of x [M, K] as an `Fp8Rows`."""
    return Fp8Rows(*row_codes(x))


def quantize_weight(w: Tensor, rows_per_chunk: int = 4096) -> Fp8Weight:
    """Per-output-channel E4M3 copy of a dense weight [N, K], quantized in row chunks so that no
    fp32 copy of the whole weight exists (a 7B model's gate/up is 136 M weights)."""
    n = w.shape[0]
    codes = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(1, n, dtype=torch.float32, device=w.device)
    for lo in range(0, n, rows_per_chunk):
        q = quantize_rows(w[lo:lo + rows_per_chunk])
        codes[lo:lo + rows_per_chunk] = q.codes
        scale[0, lo:lo + rows_per_chunk] = q.scale[:, 0]
    return Fp8Weight(codes, scale)


def w4a8_weight(w: NVFP4Weight, rows_per_chunk: int = 4096) -> W4A8Weight:
    """`W4A8Weight` of an NVFP4 weight (its tensors shared), the row exponents from row chunks (no
    fp32 copy of the whole weight)."""
    n = w.out_features
    amax = torch.empty(n, dtype=torch.float32, device=w.packed.device)
    one = torch.ones((), dtype=torch.float32, device=w.packed.device)
    for lo in range(0, n, rows_per_chunk):
        rows = NVFP4Weight(w.packed[lo:lo + rows_per_chunk], w.block_scales[lo:lo + rows_per_chunk], one)
        amax[lo:lo + rows_per_chunk] = dequantize_nvfp4(rows).abs().amax(dim=1)
    # amax = m 2**e, m in [0.5, 1); 448 = 0.875 2**9: the largest j with amax 2**j <= 448.
    m, e = torch.frexp(amax.clamp(min=MIN_AMAX))
    j = torch.where(m <= 0.875, 9 - e, 8 - e).float()
    scale = (w.global_scale.float() * torch.exp2(-j)).reshape(1, n)
    return W4A8Weight(w.packed, w.block_scales, torch.exp2(j), scale)


def w4a8_codes(w: W4A8Weight) -> Tensor:
    """The E4M3 weight [N, K] the W4A8 GEMM multiplies: e2m1 x block scale x 2**j, each rounded once
    (the products are exact in fp32); with `w.scale` it is an `Fp8Weight` (the reference's input)."""
    one = torch.ones((), dtype=torch.float32, device=w.packed.device)
    values = dequantize_nvfp4(NVFP4Weight(w.packed, w.block_scales, one))
    return (values * w.shift[:, None]).to(FP8)


def fp8_linear_reference(x: Fp8Rows, w: Fp8Weight, out_dtype: torch.dtype) -> Tensor:
    """(x8 * sx) @ (w8 * sw)^T in fp32, rounded once to `out_dtype`."""
    a = x.codes.float() * x.scale
    b = w.codes.float() * w.scale.t()
    return (a @ b.t()).to(out_dtype)


# Our Triton GEMM up to this many rows, cuBLASLt's row-wise scaled GEMM above: measured on an H100
# (bench/results/fp8/fp8-rows-triton-h100.json, 7B layers), ours is faster on every layer at 16 and
# 64 rows, cuBLASLt on every layer at 256. docs/kernels.md, "FP8 rollouts".
OURS_MAX_ROWS = 64


def fp8_linear(x: Fp8Rows, w: Fp8Weight | W4A8Weight, out_dtype: torch.dtype = torch.bfloat16,
               bias: Tensor | None = None, lora: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """x [M, K] @ W^T (+ bias [N]) (+ u @ B^T for lora = (u [M, R], B [N, R])) -> [M, N] in `out_dtype`:
    on FP8 tensor cores with a bf16 output our Triton GEMM (bias and adapter before its one rounding;
    the only one that reads a W4A8 weight) or cuBLASLt (`OURS_MAX_ROWS`), else the reference."""
    if runs_fp8(x.codes.device) and out_dtype == torch.bfloat16:
        if isinstance(w, W4A8Weight) or x.codes.shape[0] <= OURS_MAX_ROWS:
            from qerl_pipe.kernels.triton_fp8 import fp8_gemm  # imports this module: loaded late

            return fp8_gemm(x, w, bias, lora)
        y = torch._scaled_mm(x.codes, w.codes.t(), scale_a=x.scale, scale_b=w.scale, out_dtype=out_dtype)
    else:
        y = fp8_linear_reference(x, w if isinstance(w, Fp8Weight) else Fp8Weight(w4a8_codes(w), w.scale), torch.float32)
    if bias is not None:
        y += bias.to(y.dtype)
    if lora is not None:
        y.addmm_(lora[0].to(y.dtype), lora[1].to(y.dtype).t())
    return y.to(out_dtype)
