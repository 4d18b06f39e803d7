"""FP8 (E4M3) linears y = (x8 * sx) @ (w8 * sw)^T, scales per token and per output channel (amax / 448):
our Triton GEMM (triton_fp8.py) or cuBLASLt's on FP8 tensor cores, else the reference (the tests' oracle). `row_codes`
is what every fused kernel reproduces exactly (the KV cache's too). docs/kernels.md#fp8-rollouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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


def fp8_linear_reference(x: Fp8Rows, w: Fp8Weight, out_dtype: torch.dtype) -> Tensor:
    """(x8 * sx) @ (w8 * sw)^T in fp32, rounded once to `out_dtype`."""
    a = x.codes.float() * x.scale
    b = w.codes.float() * w.scale.t()
    return (a @ b.t()).to(out_dtype)


# Our Triton GEMM up to this many rows, cuBLASLt's row-wise scaled GEMM above: measured on an H100
# (bench/results/fp8/fp8-rows-triton-h100.json, 7B layers), ours is faster on every layer at 16 and
# 64 rows, cuBLASLt on every layer at 256. docs/kernels.md, "FP8 rollouts".
OURS_MAX_ROWS = 64


def fp8_linear(x: Fp8Rows, w: Fp8Weight, out_dtype: torch.dtype = torch.bfloat16, bias: Tensor | None = None,
               lora: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """x [M, K] @ W^T (+ bias [N]) (+ u @ B^T for lora = (u [M, R], B [N, R])) -> [M, N] in `out_dtype`:
    on FP8 tensor cores with a bf16 output our Triton GEMM (bias and adapter before its one rounding)
    or cuBLASLt (`OURS_MAX_ROWS`), else the reference."""
    if runs_fp8(x.codes.device) and out_dtype == torch.bfloat16:
        if x.codes.shape[0] <= OURS_MAX_ROWS:
            from qerl_pipe.kernels.triton_fp8 import fp8_gemm  # imports this module: loaded late

            return fp8_gemm(x, w, bias, lora)
        y = torch._scaled_mm(x.codes, w.codes.t(), scale_a=x.scale, scale_b=w.scale, out_dtype=out_dtype)
    else:
        y = fp8_linear_reference(x, w, torch.float32)
    if bias is not None:
        y += bias.to(y.dtype)
    if lora is not None:
        y.addmm_(lora[0].to(y.dtype), lora[1].to(y.dtype).t())
    return y.to(out_dtype)
