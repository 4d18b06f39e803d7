"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama), default and llama3 scaling."""

from __future__ import annotations

import math

import torch

from qerl_pipe.model.config import RopeConfig
from qerl_pipe.model.fused import fused_on_cuda


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """float32 [head_dim/2] inverse frequencies, computed exactly like transformers does."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "default":
        return inv_freq
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


@fused_on_cuda
def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*positions.shape, head_dim] in `dtype`.

    Computed from the positions on every call (no max-length table): a few flops per token, and
    the decode step keeps static shapes whatever the positions are.
    """
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@fused_on_cuda
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [B, T, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
