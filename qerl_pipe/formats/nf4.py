"""NF4 (4-bit NormalFloat, QLoRA: arXiv 2305.14314), the QLoRA baseline's base, stored byte for
byte as bitsandbytes stores it (`quantize_4bit`, nf4, blocksize 64, no double quantization): one
fp32 absmax per 64 elements of a row, element 2j in the HIGH nibble of byte j, its rounding.
See docs/formats.md, section "NF4 (QLoRA baseline)"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qerl_pipe.errors import QuantizationError
from qerl_pipe.formats.nvfp4 import FourBitRows, device_table

NF4_BLOCK = 64
# bitsandbytes `functional.get_4bit_type("nf4")`, code index = position.
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
            1.0)


def _upper_wins(x: Tensor, low: Tensor, high: Tensor) -> bool:
    """bitsandbytes' nearest-level rule between two neighbours, in fp32: strictly closer to `high`."""
    return bool((x - high).abs() < (x - low).abs())


def _level_thresholds() -> tuple[float, ...]:
    """For each neighbouring pair of levels, the smallest fp32 `scaled` that takes the upper one: stepped
    an ulp at a time from the midpoint (the comparison is monotonic, so this reproduces it exactly)."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    down, up = torch.tensor(-2.0), torch.tensor(2.0)
    out = []
    for lo, hi in zip(code[:-1], code[1:]):
        x = (lo + hi) / 2
        while _upper_wins(torch.nextafter(x, down), lo, hi):
            x = torch.nextafter(x, down)
        while not _upper_wins(x, lo, hi):
            x = torch.nextafter(x, up)
        out.append(float(x))
    return tuple(out)


_THRESHOLDS = _level_thresholds()


@dataclass(frozen=True)
class NF4Weight(FourBitRows):
    """One NF4 linear weight: `W ~= NF4_CODE[code] * absmax[n, k // 64]`, in bitsandbytes' bytes."""

    packed: Tensor  # uint8 [N, K/2]: element 2j in the high nibble of byte j (bitsandbytes' order)
    absmax: Tensor  # float32 [N, K/64]

    def to(self, device: torch.device | str) -> NF4Weight:
        return NF4Weight(self.packed.to(device), self.absmax.to(device))


def pack_nf4(codes: Tensor) -> Tensor:
    """Codes `[..., K]` (uint8, 0..15) -> bytes `[..., K/2]`, element 2j in the high nibble."""
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def unpack_nf4(packed: Tensor) -> Tensor:
    """Inverse of `pack_nf4`: bytes `[..., K/2]` -> codes `[..., K]` (uint8)."""
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).flatten(-2)


def quantize_nf4(weight: Tensor, *, name: str = "tensor") -> NF4Weight:
    """Quantize a `[N, K]` weight (K a multiple of 64) as bitsandbytes' `quantize_4bit` does (above)."""
    if weight.dim() != 2 or weight.shape[1] % NF4_BLOCK:
        raise QuantizationError(f"{name} has shape {tuple(weight.shape)}: NF4 needs a 2-D weight [out, in] whose "
                                f"input dimension is a multiple of {NF4_BLOCK}")
    n, k = weight.shape
    blocks = weight.detach().float().contiguous().reshape(n, k // NF4_BLOCK, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=-1)
    if not bool(torch.isfinite(absmax).all()):
        raise QuantizationError(f"{name} has non-finite values (inf or nan); cannot quantize it")
    scaled = blocks * (1.0 / absmax).unsqueeze(-1)  # all-zero blocks: 0 * inf = NaN, as in bitsandbytes
    thresholds = torch.tensor(_THRESHOLDS, dtype=torch.float32, device=weight.device)
    # Level = how many thresholds lie at or below `scaled`; NaN compares below all: code 0.
    codes = torch.bucketize(scaled, thresholds, right=True, out_int32=True)
    codes = torch.where(torch.isnan(scaled), 0, codes).to(torch.uint8)
    return NF4Weight(pack_nf4(codes.reshape(n, k)), absmax)


def dequantize_nf4(w: NF4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """`[N, K]` weight in `dtype` (level x absmax in fp32, rounded once, as bitsandbytes does)."""
    code = device_table(NF4_CODE, w.packed.device)
    codes = unpack_nf4(w.packed).long()
    n, k = codes.shape
    out = code[codes].reshape(n, k // NF4_BLOCK, NF4_BLOCK) * w.absmax.float().unsqueeze(-1)
    return out.reshape(n, k).to(dtype)
