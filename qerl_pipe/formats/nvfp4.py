"""NVFP4: 4-bit E2M1 elements, one E4M3 scale per 16 elements, one fp32 scale per tensor.
`quantize_nvfp4` reproduces Model Optimizer's export math byte for byte (the same float32
operations in the same order), except where modelopt would write a broken checkpoint.
See docs/formats.md, sections "NVFP4" and "Verified against modelopt 0.47.0"."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from qerl_pipe.errors import QuantizationError

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Smallest E4M3 subnormal. modelopt clamps block scales to [2**-9, 448] before the cast so that a
# block far below the tensor max gets the smallest scale instead of underflowing to 0.
E4M3_MIN_SCALE = 2.0**-9

# Magnitudes of the 3 low bits of a code; bit 3 is the sign.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision bounds between neighbours of the grid. A magnitude equal to a bound is a tie: it goes
# to the neighbour with the even index (even mantissa), i.e. down at 0.25/1.25/2.5/5 and up at
# 0.75/1.75/3.5.
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_ROUNDING_UP = (0.75, 1.75, 3.5)
# Code -> value. Code 8 (negative zero) decodes to +0.0, as in modelopt.
_CODE_VALUES = E2M1_GRID + tuple(-v for v in E2M1_GRID)

# Below this global scale, scale products underflow in fp32 (2**-9 * s2 would be subnormal or 0)
# and modelopt's division produces inf/NaN codes.
_MIN_GLOBAL_SCALE = 2.0**-117

# How block scales are chosen: "rtn" max calibration (modelopt's); "mse" a per-block scale search
# on the weight's squared error; "act-mse" the same search with each input channel's error
# weighted by its mean squared activation (what the layer's output error is made of).
METHODS = ("rtn", "mse", "act-mse")


class FourBitRows:
    """`out_features` / `in_features` of a 4-bit weight from its code tensor: the field `CODES`,
    one row per output feature and `PER_ITEM` codes per element along the input."""

    CODES = "packed"
    PER_ITEM = 2

    @property
    def out_features(self) -> int:
        return getattr(self, self.CODES).shape[0]

    @property
    def in_features(self) -> int:
        return getattr(self, self.CODES).shape[1] * self.PER_ITEM


@dataclass(frozen=True)
class NVFP4Weight(FourBitRows):
    """One NVFP4 linear weight: `W ~= e2m1(code) * block_scales[n, k // 16] * global_scale`."""

    packed: Tensor  # uint8 [N, K/2]; element 2j in the low nibble, 2j+1 in the high nibble
    block_scales: Tensor  # float8_e4m3fn [N, K/16], row-major
    global_scale: Tensor  # float32 0-dim; modelopt's `weight_scale_2`

    def to(self, device: torch.device | str) -> NVFP4Weight:
        return NVFP4Weight(self.packed.to(device), self.block_scales.to(device), self.global_scale.to(device))


def global_scale_from_amax(amax: Tensor) -> Tensor:
    """`amax / (6 * 448)` as a float32 0-dim tensor, exactly as modelopt computes it (also `input_scale`
    from an activation amax)."""
    # Same expression as modelopt (fp32 tensor / Python float 2688.0), so the bits match modelopt
    # on the same device. Measured on an H200: CUDA computes this as amax * (1/2688), one ulp off
    # the CPU's correctly rounded quotient for ~23% of amaxes. For device-independent bytes,
    # compute the global scale once (e.g. on CPU) and pass it to `quantize_nvfp4`: every other
    # step is a tensor/tensor op or a cast, which agree across devices.
    return (amax.float() / (E2M1_MAX * E4M3_MAX)).reshape(())


def shared_global_scale(weights: Iterable[Tensor]) -> Tensor:
    """One global scale for layers fused at inference (q/k/v, gate/up): from the max amax."""
    amax = torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
    return global_scale_from_amax(amax)


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack 4-bit codes `[..., K]` (uint8, values 0..15) into bytes `[..., K/2]`, low nibble first."""
    if codes.shape[-1] % 2:
        raise QuantizationError(f"cannot pack {codes.shape[-1]} 4-bit codes: the count must be even")
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of `pack_fp4`: bytes `[..., K/2]` to codes `[..., K]` (uint8)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _encode_e2m1(q: Tensor) -> Tensor:
    """Nearest E2M1 code of each fp32 value; ties to even; saturates at 6; NaN-free input. The sign bit
    is `q < 0`: a small negative rounding to 0 is code 8 (negative zero), as modelopt writes it."""
    sign = (q < 0).to(torch.uint8) << 3
    mag = q.abs()
    bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=q.device)
    # bucketize (right=False) counts the bounds strictly below |q|: a tie stays on the lower index.
    idx = torch.bucketize(mag, bounds, out_int32=True).to(torch.uint8)
    for tie in _TIES_ROUNDING_UP:
        idx += (mag == tie).to(torch.uint8)
    return sign | idx


def _check_shape(weight: Tensor, name: str) -> None:
    if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE:
        raise QuantizationError(f"{name} has shape {tuple(weight.shape)}: NVFP4 needs a 2-D weight [out, in] whose "
                                f"input dimension is a multiple of {BLOCK_SIZE}")


def quantize_nvfp4(weight: Tensor, global_scale: Tensor | None = None, *, name: str = "tensor", method: str = "rtn",
                   channel_weight: Tensor | None = None) -> NVFP4Weight:
    """Quantize a `[N, K]` weight (bf16/fp16/fp32, any device) to NVFP4. `method`: "rtn" (modelopt's
    max calibration + round to nearest, byte-exact), "mse" (each block's E4M3 scale searched) or
    "act-mse" (weighted by `channel_weight`, calibration's mean squared activations). `global_scale`:
    a fused group's (`shared_global_scale`), else `amax / 2688` (docs/formats.md)."""
    if method not in METHODS:
        raise ValueError(f"unknown NVFP4 method {method!r}; expected one of {METHODS}")
    if (method == "act-mse") != (channel_weight is not None):
        raise ValueError("channel_weight goes with method='act-mse', and only with it")
    _check_shape(weight, name)
    n, k = weight.shape
    blocks = weight.detach().float().contiguous().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)  # NaN and inf propagate: one finiteness check suffices
    if not bool(torch.isfinite(block_amax).all()):
        raise QuantizationError(f"{name} has non-finite values (inf or nan); cannot quantize it")

    own_scale = global_scale_from_amax(block_amax.amax())
    if global_scale is None:
        global_scale = own_scale
    else:
        global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=weight.device).reshape(())
        # Division is monotone, so a scale from the group's max amax is never below ours.
        if not bool(torch.isfinite(global_scale)) or bool(global_scale < own_scale):
            raise QuantizationError(f"{name}: global scale {float(global_scale):.6g} is below the "
                                    f"{float(own_scale):.6g} this tensor needs; pass the scale of the max amax over "
                                    "its fused group")

    s2 = float(global_scale)
    if s2 == 0.0:
        # All-zero tensor (or group). modelopt divides 0 by 0 here and writes NaN scales and +6
        # codes; we write what decodes to exact zeros: codes 0, block scales 1.0.
        return NVFP4Weight(torch.zeros(n, k // 2, dtype=torch.uint8, device=weight.device),
                           torch.ones(n, k // BLOCK_SIZE, device=weight.device).to(torch.float8_e4m3fn), global_scale)
    if s2 < _MIN_GLOBAL_SCALE:
        raise QuantizationError(f"{name}: largest magnitude {float(block_amax.amax()):.3g} is too small for NVFP4's "
                                "fp32 scales (below ~1.6e-32); zero the tensor or keep it unquantized")

    # Step by step as modelopt: 6 * s2 is rounded to fp32 before the division.
    ratio = block_amax / (E2M1_MAX * global_scale)
    ratio[ratio == 0] = 1.0  # all-zero block
    block_scales = ratio.clamp(min=E4M3_MIN_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)
    if method != "rtn":
        if channel_weight is not None:
            channel_weight = channel_weight.float().to(weight.device).reshape(1, k // BLOCK_SIZE, BLOCK_SIZE)
        block_scales = mse_block_scales(blocks, global_scale, block_scales, channel_weight)
    # The scale product is rounded to fp32 first, then divides the weight.
    q = blocks / (block_scales.float() * global_scale).unsqueeze(-1)
    codes = _encode_e2m1(q).reshape(n, k)
    return NVFP4Weight(pack_fp4(codes), block_scales, global_scale)


# Scale search: E4M3 steps tried around the max-calibrated scale. Below it (finer codes, the
# block's largest values clipped at 6) is where the error usually falls; one or two steps above
# can round the largest value better.
MSE_SCALE_STEPS = (-8, -7, -6, -5, -4, -3, -2, -1, 1, 2)


def mse_block_scales(blocks: Tensor, global_scale: Tensor, block_scales: Tensor,
                     channel_weight: Tensor | None = None) -> Tensor:
    """Per block of 16, the E4M3 scale among the max-calibrated one and `MSE_SCALE_STEPS` steps
    from it whose round-to-nearest codes give the least squared error on the block, each element's
    error times its input channel's `channel_weight` when given (ties keep the max-calibrated
    scale). `blocks` is fp32 `[N, K/16, 16]`; scales stay positive and finite."""
    values = torch.tensor(_CODE_VALUES, dtype=torch.float32, device=blocks.device)

    def error(scales: Tensor) -> Tensor:
        step = (scales.float() * global_scale).unsqueeze(-1)
        codes = _encode_e2m1(blocks / step).long()
        err = (values[codes] * step - blocks).pow(2)
        return (err if channel_weight is None else err * channel_weight).sum(-1)

    base = block_scales.view(torch.uint8).to(torch.int16)
    best, best_err = base, error(block_scales)
    for step in MSE_SCALE_STEPS:
        candidate = (base + step).clamp(1, 0x7E)  # positive E4M3 bytes; 0x7F is NaN
        err = error(candidate.to(torch.uint8).view(torch.float8_e4m3fn))
        better = err < best_err
        best, best_err = torch.where(better, candidate, best), torch.where(better, err, best_err)
    return best.to(torch.uint8).view(torch.float8_e4m3fn)


def quantize_nvfp4_in_row_chunks(weight: Tensor, global_scale: Tensor | None = None, *, name: str = "tensor",
                                 chunk_elements: int = 1 << 22,
                                 on_chunk: Callable[[Tensor, NVFP4Weight], None] | None = None, method: str = "rtn",
                                 channel_weight: Tensor | None = None) -> NVFP4Weight:
    """`quantize_nvfp4` about `chunk_elements` at a time: the same bytes, bounded temporaries (a 32B
    gate_up whole takes ~5 GB of fp32 copies). Rows are independent once the global scale (of the
    whole tensor, unless given) is fixed; `on_chunk(rows, quantized_rows)` sees each chunk."""
    _check_shape(weight, name)
    if global_scale is None:
        # max |w| as max(max w, -min w): the same value (NaN included) without a |w| copy of the
        # whole tensor, ~1 GB for a 72B gate_up, which would be the largest temporary here.
        w = weight.detach()
        global_scale = global_scale_from_amax(torch.maximum(w.amax(), w.amin().neg()))
    rows = max(1, chunk_elements // weight.shape[1])
    parts = []
    for chunk in weight.split(rows):
        q = quantize_nvfp4(chunk, global_scale, name=name, method=method, channel_weight=channel_weight)
        if on_chunk is not None:
            on_chunk(chunk, q)
        parts.append(q)
    if len(parts) == 1:
        return parts[0]
    return NVFP4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.block_scales for p in parts]),
                       parts[0].global_scale)


@lru_cache(maxsize=None)
def device_table(values: tuple[float, ...], device: torch.device) -> Tensor:
    """`values` as float32 on `device`, made once per device: a host copy at every call would synchronize,
    which a CUDA graph capture refuses (4-bit bases without their kernels decode through `dequantize_*`)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def dequantize_nvfp4(w: NVFP4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """`[N, K]` weight in `dtype`; computed in fp32 as modelopt's `dequantize` does."""
    values = device_table(_CODE_VALUES, w.packed.device)
    codes = unpack_fp4(w.packed).long()
    n, k = codes.shape
    scale = w.block_scales.float() * w.global_scale.float()
    out = values[codes].reshape(n, k // BLOCK_SIZE, BLOCK_SIZE) * scale.unsqueeze(-1)
    return out.reshape(n, k).to(dtype)
