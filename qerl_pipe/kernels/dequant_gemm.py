"""Large-M path: decode the whole 4-bit weight once into a bf16 scratch buffer, then cuBLAS.

The decoded values are exactly the reference's (`dequantize_*`); one scratch buffer per (device,
dtype) serves every layer, forward and dX, stream-ordered (one stream at a time). See
docs/kernels.md, section "Decoding 4-bit codes without a lookup table (Triton)"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from qerl_pipe.kernels.configs import KernelConfig
from qerl_pipe.kernels.triton_dequant import dequant_tile, tile_scale

_SCRATCH: dict[tuple[torch.device, torch.dtype], Tensor] = {}


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, g_ptr, lut_ptr, w_ptr, N, K,
                    FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PTX: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = dequant_tile(q_ptr, s_ptr, lut_ptr, offs_n, k0, N, K, FMT, BLOCK_N, BLOCK_K, PTX)
    w = w.to(tl.float32) * tile_scale(g_ptr, FMT, PTX)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_n[:, None] * K + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


def scratch(n: int, k: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """An [n, k] view of the shared decode buffer for (device, dtype), grown if too small."""
    key = (device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n * k:
        _SCRATCH.pop(key, None)  # drop the old buffer first, so growing never holds both
        buf = torch.empty(n * k, device=device, dtype=dtype)
        _SCRATCH[key] = buf
    return buf[: n * k].view(n, k)


def release_scratch() -> None:
    """Drop every decode buffer (a process that moves on to another model, such as a benchmark
    running several in turn, would otherwise keep the last one's largest layer allocated)."""
    _SCRATCH.clear()


def dequantize_into(fmt_id: int, q: Tensor, s: Tensor, g: Tensor, lut: Tensor, out: Tensor,
                    cfg: KernelConfig, ptx: bool = False) -> Tensor:
    """Decode the packed weight (operands as `triton_matmul._operands` gives them) into `out`.

    `ptx`: the inline-PTX NVFP4 decode (compiled code only; the caller decides).
    """
    n, k = out.shape
    block_k = max(cfg.block_k, 64)  # whole NF4 absmax blocks (and NVFP4 scale blocks) per tile
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](q, s, g, lut, out, n, k, FMT=fmt_id, BLOCK_N=cfg.block_n,
                          BLOCK_K=block_k, PTX=ptx, num_warps=cfg.num_warps)
    return out


def dequant_matmul(a: Tensor, fmt_id: int, q: Tensor, s: Tensor, g: Tensor, lut: Tensor,
                   cfg: KernelConfig, transpose_w: bool, ptx: bool = False,
                   out: Tensor | None = None) -> Tensor:
    """`a @ W^T` (forward, transpose_w) or `a @ W` (dX) through the scratch buffer and cuBLAS."""
    n, k = q.shape[0], q.shape[1] * 8
    w = dequantize_into(fmt_id, q, s, g, lut, scratch(n, k, a.device, a.dtype), cfg, ptx)
    return torch.matmul(a, w.T if transpose_w else w, out=out)
