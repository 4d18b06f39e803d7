"""RMSNorm with an additive noise buffer for Adaptive Quantization Noise (AQN)."""

from __future__ import annotations

import torch
from torch import nn

from qerl_pipe.model.fused import fused_on_cuda


@fused_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, noise: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # One rounding to the activation dtype, after the (weight + noise) product in float32.
    return (normed * (weight.float() + noise)).to(x.dtype)


class RMSNorm(nn.Module):
    """y = (weight + noise) * x / rms(x).

    `noise` is the AQN perturbation (zero unless a schedule sets it): scaling the norm weight by
    (1 + z/w) row-wise is the same as multiplying the inputs of the linears this norm feeds. It is
    a non-persistent float32 buffer: checkpoints never carry it, and AQN's sigma (down to 1e-4)
    would be rounded away if it were added to a bf16 weight of ~1 (bf16 spacing there is 2^-7).
    """

    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.register_buffer("noise", torch.zeros(dim, dtype=torch.float32, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.noise, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
