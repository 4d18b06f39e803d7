"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama): default, llama3,
linear and LongRoPE scaling, over all of head_dim or its leading rotary part (partial rotary)."""

from __future__ import annotations

import math

import torch

from qerl_pipe.model.config import RopeConfig
from qerl_pipe.model.fused import fused_on_cuda


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """float32 [rotary_dim/2] inverse frequencies, computed exactly like transformers does
    (LongRoPE: the short factors'; `long_inv_frequencies` has the others)."""
    if rope.type == "longrope":
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * _base_powers(rope, head_dim))
    inv_freq = 1.0 / _base_powers(rope, head_dim)
    if rope.type == "default":
        return inv_freq
    if rope.type == "linear":
        return inv_freq / rope.factor
    # llama3: leave high frequencies alone, divide low ones by `factor`, interpolate in between.
    old_ctx = rope.original_max_position_embeddings
    low_freq_wavelen = old_ctx / rope.low_freq_factor
    high_freq_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _base_powers(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # theta ** (2i / rotary_dim); LongRoPE multiplies it by its factors before the reciprocal,
    # in that order (as transformers does).
    dim = rope.rotary_dim(head_dim)
    return rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def long_inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor | None:
    """LongRoPE's long-context inverse frequencies; None for every other type."""
    if rope.type != "longrope":
        return None
    return 1.0 / (torch.tensor(rope.long_factor, dtype=torch.float32) * _base_powers(rope, head_dim))


@fused_on_cuda
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 long_inv_freq: torch.Tensor | None = None, switch: int = 0,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, rotary_dim] in `dtype`, from the positions on every call (static
    shapes for the decode step). LongRoPE (`long_inv_freq`): long factors from position `switch` on,
    per position (a cached key is rotated once), where transformers picks one set per forward;
    `scaling` multiplies cos and sin in float32. docs/model.md."""
    freqs = positions[..., None].float()
    if long_inv_freq is None:
        freqs = freqs * inv_freq
    else:
        freqs = freqs * torch.where(positions[..., None] >= switch, long_inv_freq, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


@fused_on_cuda
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [B, T, rotary_dim]. Dimensions past rotary_dim (partial
    rotary) pass through unchanged."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    rot, rest = x[..., :rotary], x[..., rotary:]
    r1, r2 = rot.chunk(2, dim=-1)
    return torch.cat((rot * cos + torch.cat((-r2, r1), dim=-1) * sin, rest), dim=-1)
