"""NF4 (4-bit NormalFloat, QLoRA: Dettmers et al. 2023, arXiv 2305.14314), the QLoRA baseline's base.

Each block of 64 consecutive input-dimension elements stores one fp32 absmax and 16-level codes
of `w / absmax`. The levels are bitsandbytes' table (quantiles of N(0, 1) scaled to [-1, 1], with
an exact 0). No double quantization: absmax stays fp32 (QLoRA's second-level 8-bit quantization
of absmax saves 0.37 bits/param but changes no weight value, and would only complicate kernels).

Layout: packed `[N, K/2]` uint8 with element 2j in the low nibble (our order, the same as NVFP4;
bitsandbytes puts the first element in the high nibble, so its bytes are not interchangeable).
With K a multiple of 64, our per-row blocks are exactly bitsandbytes' blocks of the flattened
tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qerl_pipe.errors import QuantizationError
from qerl_pipe.formats.nvfp4 import pack_fp4, unpack_fp4

NF4_BLOCK = 64
# bitsandbytes `functional.get_4bit_type("nf4")`, code index = position.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


@dataclass(frozen=True)
class NF4Weight:
    """One NF4 linear weight: `W ~= NF4_CODE[code] * absmax[n, k // 64]`."""

    packed: Tensor  # uint8 [N, K/2], element 2j in the low nibble
    absmax: Tensor  # float32 [N, K/64]

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    def to(self, device: torch.device | str) -> NF4Weight:
        return NF4Weight(self.packed.to(device), self.absmax.to(device))


def quantize_nf4(weight: Tensor, *, name: str = "tensor") -> NF4Weight:
    """Quantize a `[N, K]` weight (K a multiple of 64) to the nearest NF4 code of `w / absmax`."""
    if weight.dim() != 2 or weight.shape[1] % NF4_BLOCK:
        raise QuantizationError(
            f"{name} has shape {tuple(weight.shape)}: NF4 needs a 2-D weight [out, in] whose "
            f"input dimension is a multiple of {NF4_BLOCK}"
        )
    n, k = weight.shape
    blocks = weight.detach().float().contiguous().reshape(n, k // NF4_BLOCK, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=-1)
    if not bool(torch.isfinite(absmax).all()):
        raise QuantizationError(f"{name} has non-finite values (inf or nan); cannot quantize it")
    # An all-zero block keeps absmax 0 (decodes to exact zeros); divide by 1 to avoid 0/0.
    x = blocks / torch.where(absmax == 0, 1.0, absmax).unsqueeze(-1)
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=weight.device)
    # Nearest level = number of midpoints below x; a value exactly on a midpoint takes the lower
    # level, as bitsandbytes' `x > midpoint` decision tree does.
    midpoints = (code[1:] + code[:-1]) / 2
    codes = torch.bucketize(x, midpoints, out_int32=True).to(torch.uint8)
    return NF4Weight(pack_fp4(codes.reshape(n, k)), absmax)


def dequantize_nf4(w: NF4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """`[N, K]` weight in `dtype` (computed in fp32)."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=w.packed.device)
    codes = unpack_fp4(w.packed).long()
    n, k = codes.shape
    out = code[codes].reshape(n, k // NF4_BLOCK, NF4_BLOCK) * w.absmax.float().unsqueeze(-1)
    return out.reshape(n, k).to(dtype)
