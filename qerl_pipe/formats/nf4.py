"""NF4 (4-bit NormalFloat, QLoRA: Dettmers et al. 2023, arXiv 2305.14314), the QLoRA baseline's base,
stored byte for byte as bitsandbytes stores it (`bitsandbytes.functional.quantize_4bit`, quant_type
"nf4", blocksize 64, no double quantization).

Each block of 64 consecutive elements of the row-major `[N, K]` weight stores one fp32 absmax and
16-level codes of `w * (1 / absmax)`. The levels are bitsandbytes' table (quantiles of N(0, 1)
scaled to [-1, 1], with an exact 0). With K a multiple of 64 a block never crosses a row, so
bitsandbytes' flat `absmax [N*K/64]` is our `[N, K/64]` and its flat packed bytes `[N*K/2, 1]`
are our `[N, K/2]`: element 2j sits in the HIGH nibble of byte j (bitsandbytes' order; NVFP4's
checkpoint bytes are the other way round).

Rounding, as bitsandbytes computes it (its CPU path, `backends/default` `quantize_4bit`, on fp32
input): `scaled = w * (1 / absmax)` in fp32 (a reciprocal, then a product: not `w / absmax`,
which rounds differently), then the level nearest to `scaled` by fp32 distance, the lower level
on a tie. That is a comparison with one fp32 threshold per level pair (`_THRESHOLDS`, derived
below from that very distance rule). An all-zero block has absmax 0 and `0 * inf` is NaN there,
which bitsandbytes maps to code 0 (level -1.0, so the block decodes to -0.0 x 0); we store the
same byte. A 16-bit weight is quantized from its fp32 value, as bitsandbytes' CUDA kernel does
(its CPU path on bf16 input would round `1 / absmax` and the product to bf16 instead).

bitsandbytes' CUDA kernel (`dQuantizeNF4`, built with --use_fast_math) agrees with this except on
six exact fp32 values of `scaled` (the midpoints where the distance rule and its `x > midpoint`
tree break a tie differently) and where its approximate reciprocal differs from the IEEE one by an
ulp: a handful of codes per million move to the neighbouring level (tests/test_bnb_gpu.py counts).

No double quantization: QLoRA's second level quantizes the absmax values to 8 bits per 256 blocks
(0.37 bits per parameter saved); the codes stay the same but every block's scale is rounded, so
the weights differ from the plain format's. bitsandbytes' default (`compress_statistics=False` in
`quantize_4bit`, `bnb_4bit_use_double_quant=False` in transformers) has none either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qerl_pipe.errors import QuantizationError
from qerl_pipe.formats.nvfp4 import FourBitRows

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


def _upper_wins(x: Tensor, low: Tensor, high: Tensor) -> bool:
    """bitsandbytes' nearest-level rule between two neighbours, in fp32: strictly closer to `high`."""
    return bool((x - high).abs() < (x - low).abs())


def _level_thresholds() -> tuple[float, ...]:
    """For each neighbouring pair of levels, the smallest fp32 `scaled` that takes the upper one.

    Found by stepping one ulp at a time from the fp32 midpoint (at most a couple of steps): the
    distance comparison is monotonic in `scaled`, so one threshold per pair reproduces it exactly.
    """
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
        raise QuantizationError(
            f"{name} has shape {tuple(weight.shape)}: NF4 needs a 2-D weight [out, in] whose "
            f"input dimension is a multiple of {NF4_BLOCK}"
        )
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
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=w.packed.device)
    codes = unpack_nf4(w.packed).long()
    n, k = codes.shape
    out = code[codes].reshape(n, k // NF4_BLOCK, NF4_BLOCK) * w.absmax.float().unsqueeze(-1)
    return out.reshape(n, k).to(dtype)
