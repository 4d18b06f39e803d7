"""RMSNorm with an additive noise buffer for Adaptive Quantization Noise (AQN)."""

from __future__ import annotations

import torch
from torch import nn

from qerl_pipe.model.fused import fused_on_cuda


@fused_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, noise: torch.Tensor, eps: float,
             offset: float = 0.0) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight.float()
    if offset:  # Gemma stores w for a scale of (1 + w), added in float32 as transformers does
        scale = scale + offset
    # One rounding to the activation dtype, after the (weight + noise) product in float32.
    return (normed * (scale + noise)).to(x.dtype)


class RMSNorm(nn.Module):
    """y = (offset + weight + noise) * x / rms(x); `offset` 0, or 1 for Gemma's `(1 + w)`. `noise` is
    AQN's (zero unless scheduled; the same as scaling the inputs of the linears this norm feeds): a
    non-persistent float32 buffer, since checkpoints never carry it and a bf16 weight of ~1 would
    round AQN's sigma (down to 1e-4) away (spacing 2^-7)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        # Unit scale either way: ones, or zeros under Gemma's offset of 1.
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset, dtype=dtype, device=device), requires_grad=False)
        self.register_buffer("noise", torch.zeros(dim, dtype=torch.float32, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.noise, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset}" if self.offset else "")
