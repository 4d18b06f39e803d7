"""Attention over whole sequences (the training forward and the prompt prefill): masks for
padding and sliding windows, SDPA, and the exact path soft-capped scores need. The decode step's
attention is the engine's (`kernels.decode_ops.decode_attention`, same window, scale and cap).
See docs/model.md, section "Autograd and memory"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from qerl_pipe.kernels.fp8 import row_codes


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes besides softmax(q k^T) v: its sliding window (None:
    full), its score scale (None: SDPA's 1 / sqrt(head_dim)) and its score cap (Gemma2)."""

    window: int | None = None
    scale: float | None = None
    softcap: float | None = None


def visible(positions: Tensor, keep: Tensor | None, window: int | None) -> Tensor:
    """[B, 1, T, T] booleans, True where query t may attend to key s: s not after t, a real token
    (`keep` [B, T], None: all), within `window` positions of t (`positions` [B, T]: a left-padded
    row sees what it would alone, as in the engine). The diagonal stays open: pad rows attend to
    something (no NaN; their outputs are ignored)."""
    t = positions.shape[-1]
    device = positions.device
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None]
    if keep is not None:
        mask = mask & keep[:, None, :]
    if window is not None:
        mask = mask & (positions[:, :, None] - positions[:, None, :] < window)
    return (mask | torch.eye(t, dtype=torch.bool, device=device))[:, None]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: AttentionSpec = AttentionSpec()) -> Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D]; `mask` [B, 1, T, T] (True = attend) or
    None for plain causal attention (only for a spec without window or cap)."""
    if spec.softcap is not None:
        return _attend_capped(q, k, v, mask, spec)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=spec.scale)
    # With an explicit mask, enable_gqa sends CUDA SDPA to the math kernel (a [B, H, T, T] fp32
    # score matrix); repeating k/v keeps the memory-efficient kernel.
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale)


def _attend_capped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, spec: AttentionSpec) -> Tensor:
    """Scores soft-capped before the mask (cap * tanh(s / cap)), which no SDPA kernel offers: the
    scores are materialised, [B, H, T, T] in float32 as transformers' eager path does, and as the
    decode kernel computes them (float32 products)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs.to(v.dtype) @ v)


def attend_prefill(q: Tensor, k: Tensor, v: Tensor, cache: tuple[Tensor, Tensor, Tensor | None, Tensor | None],
                   slots: Tensor, mask: Tensor | None, spec: AttentionSpec) -> Tensor:
    """Write the prompt's k/v (and an FP8 cache's scales) at positions 0..T-1 of `slots`, then attend
    causally on the prompt's own k/v, as vLLM's prefill does (the cache's rounding reaches the decode
    steps only). Right padding is harmless: no real token attends to a later pad, and a pad's entry
    lies past the slot's length, masked and later overwritten."""
    t = q.shape[2]
    k_cache, v_cache, k_scale, v_scale = cache
    for x, codes, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scales is None:
            codes[slots, :, :t] = x
        else:
            q8, s8 = row_codes(x, codes.dtype)
            codes.view(torch.uint8)[slots, :, :t] = q8.view(torch.uint8)  # as bytes: no fp8 indexing on CPU
            scales[slots, :, :t] = s8[..., 0]
    return attend(q, k, v, mask, spec)
