"""Triton W4A16 kernels: skinny GEMV (decode), tiled GEMM (small prefill), and dX = dY @ W.

All decode W's tiles in registers (no bf16 copy of W) and accumulate in fp32; configs of kind
`dequant` go to dequant_gemm.py. See docs/kernels.md, section "The Triton kernels"."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from qerl_pipe.kernels.configs import KernelConfig
from qerl_pipe.kernels.dequant_gemm import dequant_matmul
from qerl_pipe.kernels.packing import PackedNF4
from qerl_pipe.kernels.triton_dequant import NF4, NVFP4, dequant_tile, tile_scale


# Triton decides at decoration time whether @triton.jit functions run in its interpreter.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """K-tile indices [start, end) of this program's split."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    start = tl.program_id(1) * per_split
    return start, tl.minimum(start + per_split, k_tiles)


@triton.jit
def _skinny_kernel(x_ptr, q_ptr, s_ptr, g_ptr, lut_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                   FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ACC_3D: tl.constexpr,
                   PTX: tl.constexpr):
    # Grid: (N tiles, K splits, M tiles). ACC_3D (`skinny`): products accumulate elementwise in a
    # 3-D register tile reduced once at the end, so the K loop has no cross-thread traffic.
    # Otherwise (`gemv`): each tile is reduced over K at once into a 2-D accumulator, which frees
    # BLOCK_M*BLOCK_K registers per row, so wider K tiles (more loads in flight) still fit.
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    start, end = _k_range(K, BLOCK_K, SPLIT_K)
    if ACC_3D:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(start, end):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        w = dequant_tile(q_ptr, s_ptr, lut_ptr, offs_n, k0, N, K, FMT, BLOCK_N, BLOCK_K, PTX)
        if ACC_3D:
            acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        else:
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if ACC_3D:
        y = tl.sum(acc, axis=2) * tile_scale(g_ptr, FMT, PTX)
    else:
        y = acc * tile_scale(g_ptr, FMT, PTX)
    _store_tile(y_ptr, y, offs_m, offs_n, m_ok, N, stride_ym, SPLIT_K)


@triton.jit
def _store_tile(y_ptr, y, offs_m, offs_n, m_ok, N, stride_ym, SPLIT_K: tl.constexpr):
    """Write an output tile; a split-K program adds its fp32 partial sums into the workspace."""
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    ok = m_ok[:, None] & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(y_ptrs, y, mask=ok)


@triton.jit
def _grouped_pid(pid, num_m, num_n, GROUP_M: tl.constexpr):
    # Walk output tiles in column groups of GROUP_M row tiles so that tiles running together
    # share their weight (and activation) tiles in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _tiled_kernel(x_ptr, q_ptr, s_ptr, g_ptr, lut_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                  FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PTX: tl.constexpr):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    start, end = _k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(start, end):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        w = dequant_tile(q_ptr, s_ptr, lut_ptr, offs_n, k0, N, K, FMT, BLOCK_N, BLOCK_K, PTX)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc)
    y = acc * tile_scale(g_ptr, FMT, PTX)
    _store_tile(y_ptr, y, offs_m, offs_n, m_ok, N, stride_ym, SPLIT_K)


@triton.jit
def _dx_kernel(dy_ptr, q_ptr, s_ptr, g_ptr, lut_ptr, dx_ptr, M, N, K, stride_dym, stride_dxm,
               FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr,
               PTX: tl.constexpr):
    # dX[m, k] = sum_n dY[m, n] W[n, k]: the same row-major weight tiles as the forward pass,
    # contracted over their rows. Block scales run along K, the output axis here, so a decoded
    # tile is already final: no transposed copy of W is needed.
    pid_m, pid_k = _grouped_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K),
                                GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = pid_k * BLOCK_K
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :],
                     mask=m_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        w = dequant_tile(q_ptr, s_ptr, lut_ptr, offs_n, k0, N, K, FMT, BLOCK_N, BLOCK_K, PTX)
        acc = tl.dot(dy.to(DOT_DTYPE), w.to(DOT_DTYPE), acc)
    dx = acc * tile_scale(g_ptr, FMT, PTX)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(dx_ptr + offs_m[:, None] * stride_dxm + offs_k[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_k[None, :] < K))


def _dot_dtype() -> tl.dtype:
    # Triton's interpreter (3.9) stores bf16 as uint16 and multiplies those integers in tl.dot;
    # it gets fp32 operands instead. On the GPU the decoded tile is exact in bf16 either way.
    return tl.float32 if _INTERPRETED else tl.bfloat16


def _ptx(cfg: KernelConfig) -> bool:
    # Inline PTX runs only in compiled code; the interpreter takes the pure-Triton decode, which
    # computes the same values (tests/kernels/test_kernels_gpu.py checks the PTX path against it).
    return cfg.ptx_decode and not _INTERPRETED


def _operands(w: object) -> tuple[int, Tensor, Tensor, Tensor, Tensor]:
    """(FMT, qweight, scale tensor, global-scale tensor, lookup table) of a packed weight: its
    type (`PackedNF4`, else `PackedNVFP4`) says how the kernels read it."""
    if isinstance(w, PackedNF4):
        return NF4, w.qweight, w.absmax, w.absmax, w.code
    return NVFP4, w.qweight, w.scales, w.global_scale, w.qweight  # type: ignore[attr-defined]


def _fit_block_k(w: object, block_k: int) -> int:
    # NF4's absmax covers 64 columns; a tile must hold whole absmax blocks.
    return max(block_k, 64) if isinstance(w, PackedNF4) else max(block_k, 16)


def launch_forward(x2: Tensor, w: object, cfg: KernelConfig, out: Tensor | None = None) -> Tensor:
    """y[M, N] = x2[M, K] @ W^T in x2's dtype, written into `out` when given.

    One kernel launch; with split-K also a zero-fill of the fp32 workspace and a cast.
    """
    f, q, s, g, lut = _operands(w)
    if cfg.kernel == "dequant":
        return dequant_matmul(x2, f, q, s, g, lut, cfg, True, _ptx(cfg), out)
    m, k = x2.shape
    n = q.shape[0]
    block_k = _fit_block_k(w, cfg.block_k)
    split = min(cfg.split_k, triton.cdiv(k, block_k))
    if split == 1:
        y = out if out is not None else torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    else:
        y = torch.zeros(m, n, device=x2.device, dtype=torch.float32)
    if cfg.kernel in ("skinny", "gemv"):
        grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
        _skinny_kernel[grid](x2, q, s, g, lut, y, m, n, k, x2.stride(0), y.stride(0),
                             FMT=f, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                             SPLIT_K=split, ACC_3D=cfg.kernel == "skinny", PTX=_ptx(cfg),
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
        _tiled_kernel[grid](x2, q, s, g, lut, y, m, n, k, x2.stride(0), y.stride(0),
                            FMT=f, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                            SPLIT_K=split, GROUP_M=cfg.group_m, DOT_DTYPE=_dot_dtype(),
                            PTX=_ptx(cfg), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split == 1:
        return y
    return y.to(x2.dtype) if out is None else out.copy_(y)


def launch_dx(dy2: Tensor, w: object, cfg: KernelConfig, out: Tensor | None = None) -> Tensor:
    """dx[M, K] = dy2[M, N] @ W in dy2's dtype (one launch), written into `out` when given."""
    f, q, s, g, lut = _operands(w)
    if cfg.kernel == "dequant":
        return dequant_matmul(dy2, f, q, s, g, lut, cfg, False, _ptx(cfg), out)
    m, n = dy2.shape
    k = q.shape[1] * 8
    block_k = _fit_block_k(w, cfg.block_k)
    dx = out if out is not None else torch.empty(m, k, device=dy2.device, dtype=dy2.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(k, block_k),)
    _dx_kernel[grid](dy2, q, s, g, lut, dx, m, n, k, dy2.stride(0), dx.stride(0),
                     FMT=f, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                     GROUP_M=cfg.group_m, DOT_DTYPE=_dot_dtype(), PTX=_ptx(cfg),
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dx
