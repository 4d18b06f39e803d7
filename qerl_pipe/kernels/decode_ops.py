"""The decode step's fused operations: residual add + RMSNorm (with the next LoRA shrink), o_proj's LoRA
shrink, and decode attention: Triton kernels on CUDA (`triton_decode`), plain-torch references elsewhere (the
tests' oracle). A row's results depend on that row alone. Contracts: docs/kernels.md, "The decode step's kernels"."""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_pipe.kernels.fp8 import Fp8Rows, quantize_rows, row_codes


def add_rms_norm_reference(x: Tensor, residual: Tensor | None, weight: Tensor, noise: Tensor,
                           eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    h = x if residual is None else residual + x
    h32 = h.float()
    scale = weight.float() + offset if offset else weight.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * (scale + noise)).to(x.dtype)
    return normed, h


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of the leading R dims of x [B, H, D] by cos/sin [B, R], computed in fp32 and
    rounded once; dims R..D-1 pass through."""
    r = cos.shape[-1]
    x32, half = x.float(), r // 2
    rot = torch.cat((-x32[..., half:r], x32[..., :half]), dim=-1)
    rotated = x32[..., :r] * cos.float()[:, None] + rot * sin.float()[:, None]
    return torch.cat((rotated, x32[..., r:]), dim=-1).to(x.dtype)


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                               v_cache: Tensor, positions: Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                               k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """The same in plain torch (CPU, and the test oracle): scores and softmax in fp32. A coded cache (`k_scale`,
    `v_scale` given) stores the new k and v as `row_codes` of each head and attends over the dequantized cache,
    the new token included; over INT8 keys, with q as two INT8 row codes."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    q_read = q.float()
    index = positions.view(b, 1, 1, 1).expand(b, hkv, 1, d)
    if k_scale is None:
        k_cache.scatter_(2, index, k[:, :, None])
        v_cache.scatter_(2, index, v[:, :, None].to(v_cache.dtype))
        keys, vals = k_cache.float(), v_cache.float()
    else:
        token = positions.view(b, 1, 1).expand(b, hkv, 1)
        for x, codes, scales in ((k, k_cache, k_scale), (v.to(q.dtype), v_cache, v_scale)):
            q8, s8 = row_codes(x, codes.dtype)
            codes.view(torch.uint8).scatter_(2, index, q8[:, :, None].view(torch.uint8))  # no fp8 scatter on CPU
            scales.scatter_(2, token, s8)
        keys, vals = k_cache.float() * k_scale[..., None], v_cache.float() * v_scale[..., None]
        if k_cache.dtype == torch.int8:  # q meets INT8 keys as two INT8 row codes, hi + lo (the kernel's INT8 dots)
            hi, hi_scale = row_codes(q, torch.int8)
            lo, lo_scale = row_codes(q.float() - hi.float() * hi_scale, torch.int8)
            q_read = hi.float() * hi_scale + lo.float() * lo_scale
    scores = q_read.view(b, hkv, hq // hkv, d) @ keys.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    cached = torch.arange(k_cache.shape[2], device=q.device)
    position = positions.view(b, 1, 1, 1)
    visible = cached <= position
    if window:
        visible = visible & (cached > position - window)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ vals).to(q.dtype).reshape(b, hq * d)


# Up to this many rows the shrink runs inside the norm kernel. Each row's programs read all of A
# (R x H: 96 x 3584 bf16 for r32 q/k/v is 688 KB), from L2 after the first row, so from some batch
# one matmul that reads A once is cheaper than the launches it saves.
FUSED_SHRINK_MAX_ROWS = 16


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, noise: Tensor, eps: float,
                 shrink: Tensor | None = None, offset: float = 0.0,
                 quantize: bool = False) -> tuple[Tensor, Tensor, Tensor | None, Fp8Rows | None]:
    """The Triton kernel on CUDA, else the torch reference (which leaves u to the caller, as the kernel does above
    FUSED_SHRINK_MAX_ROWS). `quantize`: the normed rows' E4M3 codes and scales too (from the rounded values)."""
    if x.is_cuda:
        from qerl_pipe.kernels.triton_decode import launch_add_rms_norm

        fused = shrink is not None and x.shape[0] <= FUSED_SHRINK_MAX_ROWS
        return launch_add_rms_norm(x, residual, weight, noise, eps, shrink if fused else None, offset, quantize)
    normed, h = add_rms_norm_reference(x, residual, weight, noise, eps, offset)
    return normed, h, None, quantize_rows(normed) if quantize else None


def lora_shrink(x: Tensor, shrink: Tensor | None) -> Tensor | None:
    """u = x @ shrink^T in one Triton kernel on CUDA at decode batches; None elsewhere, or without a shrink
    (the caller then multiplies, as `FusedLora.project` does)."""
    if shrink is None or not x.is_cuda or x.shape[0] > FUSED_SHRINK_MAX_ROWS:
        return None
    from qerl_pipe.kernels.triton_decode import launch_lora_shrink

    return launch_lora_shrink(x, shrink)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                     v_cache: Tensor, positions: Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """The Triton kernels on CUDA where they apply, else the torch reference."""
    if q.is_cuda:
        from qerl_pipe.kernels.triton_decode import launch_decode_attention, supports

        if supports(q, k_cache):
            return launch_decode_attention(q, k, v, cos, sin, k_cache, v_cache, positions, scale, window, softcap,
                                           k_scale, v_scale)
    return decode_attention_reference(q, k, v, cos, sin, k_cache, v_cache, positions, scale, window, softcap,
                                      k_scale, v_scale)
