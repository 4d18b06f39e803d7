"""The tile-major NVFP4 layout the CUDA W4A16 kernels read: one spec for repack, kernel and tests. Chunks of 64
rows x 32 columns, codes in `mma.m16n8k16` A-fragment order, scales re-encoded as bf16 bits; the kernel's
constants header is rendered from here and the packing derived from `DECODE`. See docs/kernels.md, section
"The CUDA W4A16 kernels" (its "Layout")."""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from functools import lru_cache, reduce
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qerl_pipe.formats.nvfp4 import BLOCK_SIZE, NVFP4Weight, pack_fp4, unpack_fp4

ROWS = 64  # output rows per chunk: 4 m16 tiles
COLS = 32  # input columns per chunk: 2 MMA k16 steps
WORDS = ROWS * COLS // 8  # int32 words of codes per chunk (256)
SCALE_BYTES = ROWS * COLS // BLOCK_SIZE  # scale bytes per chunk (128)

# Bits of one decoded bf16 pair that carry a code: sign 15 / 31, magnitude 6-8 / 22-24.
MASK = 0x81C081C0
# How each of the 4 registers of a word is cut out of the word q: a list of (rotate-right
# amount, mask) terms OR-ed together. The CUDA decode is generated from this table.
DECODE: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, MASK),), ((4, MASK),), ((10, MASK),), ((30, 0x80C080C0), (22, 0x01000100)))
# bf16 scale bits = ((byte << 4) & 0x0FF0) | 0x7000; a scale s is stored as s * 2**SCALE_BIAS.
SCALE_BIAS = 119
SCALE_OR = 0x70007000
SCALE_AND = 0x0FF00FF0
# The kernel multiplies its fp32 sums by global_scale * 2**PRODUCT_SHIFT (code * scale is
# e2m1 * s * 2**(SCALE_BIAS - 126)).
PRODUCT_SHIFT = 126 - SCALE_BIAS


def _rotr(q: int, r: int) -> int:
    return ((q >> r) | (q << (32 - r))) & 0xFFFFFFFF if r else q


def decode_word(q: int) -> tuple[int, int, int, int]:
    """The four bf16-pair registers the kernel makes of word `q` (same operations)."""
    return tuple(reduce(operator.or_, (_rotr(q, rot) & mask for rot, mask in terms))  # type: ignore[return-value]
                 for terms in DECODE)


# Code bit b (0 = mantissa, 1-2 = exponent, 3 = sign) -> its bit in a bf16 half.
_TARGET_OF_CODE_BIT = (6, 7, 8, 15)


@lru_cache(maxsize=1)
def source_bits() -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`[register][half][code bit]` -> the bit of the word that the decode routes there, found by decoding
    each single-bit word (checked: a bijection onto the code bits of the 8 halves, nothing anywhere else)."""
    dest: dict[tuple[int, int], int] = {}
    for b in range(32):
        regs = decode_word(1 << b)
        hits = [(r, pos) for r, v in enumerate(regs) for pos in range(32) if v >> pos & 1]
        if len(hits) != 1:
            raise AssertionError(f"word bit {b} decodes to {hits}; the decode must route each bit once")
        dest[hits[0]] = b
    return tuple(tuple(tuple(dest[(r, 16 * h + tgt)] for tgt in _TARGET_OF_CODE_BIT) for h in range(2))
                 for r in range(4))


@dataclass(frozen=True)
class TiledNVFP4:
    """An NVFP4 weight in the CUDA kernels' chunk layout (docs/kernels.md, "The CUDA W4A16 kernels")."""

    qweight: Tensor  # int32 [ceil(N/64), ceil(K/32), 256]
    scales: Tensor  # uint8 [ceil(N/64), ceil(K/32), 128], re-encoded block scales
    global_scale: Tensor  # float32 [1]
    out_features: int
    in_features: int
    # The same weight in humming-kernels' layout, where the engine made one
    # (`model.kernel_copies.attach_humming`): the dispatch sends it the rows humming wins.
    humming: Any = field(default=None, compare=False, repr=False)
    # On the CPU, the weight dequantized once into the activations' dtype, where the model made
    # one (`model.dense_copy`): the reference matmuls run from it instead of dequantizing per call.
    dense: Tensor | None = field(default=None, compare=False, repr=False)


def tiled_shapes(n: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Shapes of `qweight` and `scales` for an `[n, k]` weight."""
    nb, kc = -(-n // ROWS), -(-k // COLS)
    return (nb, kc, WORDS), (nb, kc, SCALE_BYTES)


@lru_cache(maxsize=None)
def _scale_tables() -> tuple[tuple[int, ...], tuple[float, ...]]:
    """E4M3 magnitude byte (0..126) -> re-encoded byte, and re-encoded byte -> value / 2**119."""
    encode = [0] * 128
    for mag in range(1, 127):
        s = float(torch.tensor(mag, dtype=torch.uint8).view(torch.float8_e4m3fn).float())
        frac, exp = math.frexp(s)  # s = frac * 2**exp, frac in [0.5, 1)
        encode[mag] = ((exp - 1 + SCALE_BIAS - 97) << 3) | int((2 * frac - 1) * 8)
    decode = [0.0] + [2.0 ** (97 + (u >> 3) - SCALE_BIAS) * (1 + (u & 7) / 8) for u in range(1, 256)]
    return tuple(encode), tuple(decode)


def _encode_scales(scale_bytes: Tensor) -> tuple[Tensor, Tensor]:
    """Block-scale bytes -> (re-encoded bytes, per-block code fix: 0 keep, 8 flip sign, -1 zero)."""
    b = scale_bytes.to(torch.int64)
    mag = b & 0x7F
    if bool((mag == 0x7F).any()):
        raise ValueError("the weight has NaN block scales; re-quantize the checkpoint")
    enc_table, _ = _scale_tables()
    enc = torch.tensor(enc_table, dtype=torch.int64, device=b.device)[mag]
    fix = torch.where(b >= 0x80, 8, 0)
    fix = torch.where(mag == 0, -1, fix)
    return enc, fix


def _pad(t: Tensor, rows: int, cols: int) -> Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))  # zeros below and right


# Rows are repacked in slices of about this many elements: the int64 temporaries cost ~40 B per
# element, which for a whole 32B gate_up (283 M elements) would be ~11 GB of transient memory.
_SLICE_ELEMENTS = 1 << 22


def tile_nvfp4(w: NVFP4Weight) -> TiledNVFP4:
    """Repack a checkpoint NVFP4 weight into the kernel layout (on the weight's device)."""
    n, k = w.out_features, w.in_features
    words_shape, scales_shape = tiled_shapes(n, k)
    nb, kc = words_shape[:2]
    dev = w.packed.device
    qweight = torch.empty(words_shape, dtype=torch.int32, device=dev)
    scales = torch.empty(scales_shape, dtype=torch.uint8, device=dev)
    blocks = max(1, _SLICE_ELEMENTS // (ROWS * kc * COLS))
    scale_bytes = w.block_scales.contiguous().view(torch.uint8)
    for b0 in range(0, nb, blocks):
        b1 = min(nb, b0 + blocks)
        r0, r1 = b0 * ROWS, min(n, b1 * ROWS)
        enc, fix = _encode_scales(scale_bytes[r0:r1])
        codes = unpack_fp4(w.packed[r0:r1]).to(torch.int64).view(r1 - r0, k // BLOCK_SIZE, BLOCK_SIZE)
        codes = torch.where(fix[..., None] < 0, 0, codes ^ fix.clamp(min=0)[..., None]).view(r1 - r0, k)
        rows = (b1 - b0) * ROWS
        qweight[b0:b1] = _words(_pad(codes, rows, kc * COLS), b1 - b0, kc)
        scales[b0:b1] = _scale_chunks(_pad(enc, rows, kc * COLS // BLOCK_SIZE), b1 - b0, kc).to(torch.uint8)
    return TiledNVFP4(qweight, scales, w.global_scale.to(torch.float32).reshape(1).contiguous(), n, k)


# A code tensor [N, K] viewed as [nb, p, i, hr, g, kc, t, j, pair, h]:
# row = 64 nb + 32 p + 16 i + 8 hr + g, column = 32 kc + 8 t + 4 j + 2 pair + h.
_CODE_VIEW = (2, 2, 2, 8)
# Register r of a word holds rows hr = r % 2 and the column pair r // 2 (A-fragment order a0..a3).


def _words(codes: Tensor, nb: int, kc: int) -> Tensor:
    c = codes.view(nb, *_CODE_VIEW, kc, 4, 2, 2, 2)
    # -> [nb, kc, p, g, t, i, j, pair, hr, h]
    c = c.permute(0, 5, 1, 4, 6, 2, 7, 8, 3, 9)
    src = source_bits()
    word = torch.zeros(c.shape[:7], dtype=torch.int64, device=codes.device)
    for pair, hr, h, bit in itertools.product(range(2), range(2), range(2), range(4)):  # register 2 * pair + hr
        word |= ((c[..., pair, hr, h] >> bit) & 1) << src[2 * pair + hr][h][bit]
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.reshape(nb, kc, WORDS)


def _scale_chunks(enc: Tensor, nb: int, kc: int) -> Tensor:
    # enc [N, K/16] viewed as [nb, q, i, hr, g, kc, hb]; bytes ordered [g, hb, q, hr, i].
    e = enc.view(nb, 2, 2, 2, 8, kc, 2).permute(0, 5, 4, 6, 1, 3, 2)
    return e.reshape(nb, kc, SCALE_BYTES)


def untile_nvfp4(t: TiledNVFP4) -> NVFP4Weight:
    """Back to checkpoint form. Exact up to what the repack normalizes: a zero scale's codes are
    0, a negative scale is stored positive with its codes' signs flipped (the values are equal)."""
    n, k = t.out_features, t.in_features
    nb, kc = t.qweight.shape[:2]
    codes = _codes_of_words(t.qweight.to(torch.int64) & 0xFFFFFFFF, nb, kc)[:n, :k]
    enc = t.scales.to(torch.int64).view(nb, kc, 8, 2, 2, 2, 2).permute(0, 4, 6, 5, 2, 1, 3)
    enc = enc.reshape(nb * ROWS, kc * 2)[:n, : k // BLOCK_SIZE]
    codes = pack_fp4(codes.to(torch.uint8)).contiguous()
    return NVFP4Weight(codes, _decode_scale_bytes(enc), t.global_scale.reshape(()))


def _codes_of_words(word: Tensor, nb: int, kc: int) -> Tensor:
    w = word.view(nb, kc, 2, 8, 4, 2, 2)  # [nb, kc, p, g, t, i, j]
    src = source_bits()

    def code(reg: int, h: int) -> Tensor:  # the 4-bit code in half h of register reg (its bits are disjoint)
        return sum(((w >> src[reg][h][bit]) & 1) << bit for bit in range(4))

    regs = [torch.stack([code(reg, h) for h in range(2)], -1) for reg in range(4)]
    c = torch.stack(regs, -2).view(*w.shape, 2, 2, 2)  # [..., pair, hr, h]
    # -> [nb, p, i, hr, g, kc, t, j, pair, h]
    c = c.permute(0, 2, 5, 8, 3, 1, 4, 6, 7, 9)
    return c.reshape(nb * ROWS, kc * COLS)


def _decode_scale_bytes(enc: Tensor) -> Tensor:
    """Re-encoded scale bytes -> float8_e4m3fn block scales (0 stays 0)."""
    _, decode = _scale_tables()
    values = torch.tensor(decode, dtype=torch.float32, device=enc.device)[enc]
    return values.to(torch.float8_e4m3fn)


def fragment_order(x: Tensor, rows: int) -> Tensor:
    """`x [M, K]` as the wgmma kernel reads it: `[rows, KC * 32]` (rows past M and columns past K
    zero), in each 32-column chunk pair `4t + u` moved to position `4u + t` (a 4 x 4 transpose of
    4-byte pairs: lane t's A slot u meets wgmma's B byte 16u + 4t), so a row is one 128-byte line
    for the swizzle. Why: docs/kernels.md, "fragment order"."""
    m, k = x.shape
    kc = -(-k // COLS)
    out = torch.zeros(rows, kc * COLS, dtype=x.dtype, device=x.device)
    out[: min(m, rows), :k] = x[:rows]
    return out.view(rows, kc, 4, 4, 2).transpose(2, 3).reshape(rows, kc * COLS)


def constants_header() -> str:
    """The C++ header of layout constants that `kernels/cuda/w4a16.cu` includes."""
    lines = [
        "// Generated by qerl_pipe.kernels.tiled.constants_header(); do not edit.",
        "#pragma once", "#include <cstdint>", "namespace qerl_w4a16 {",
        f"constexpr int kRows = {ROWS};", f"constexpr int kCols = {COLS};",
        f"constexpr int kWords = {WORDS};", f"constexpr int kScaleBytes = {SCALE_BYTES};",
        f"constexpr uint32_t kScaleAnd = 0x{SCALE_AND:08X}u;", f"constexpr uint32_t kScaleOr = 0x{SCALE_OR:08X}u;",
        f"constexpr float kProductScale = {float(2 ** PRODUCT_SHIFT)!r}f;",
        "#ifdef __CUDACC__  // the decode is device code; the torch binding needs only the constants",
        "__device__ __forceinline__ uint32_t rotr32(uint32_t q, int r) { return __funnelshift_r(q, q, r); }",
        "// The four bf16-pair A registers of a code word.",
        "__device__ __forceinline__ void decode_word(uint32_t q, uint32_t (&r)[4]) {",
    ]
    for i, terms in enumerate(DECODE):
        parts = [f"(rotr32(q, {rot}) & 0x{mask:08X}u)" if rot else f"(q & 0x{mask:08X}u)" for rot, mask in terms]
        lines.append(f"  r[{i}] = {' | '.join(parts)};")
    lines += ["}", "#endif", "}  // namespace qerl_w4a16", ""]
    return "\n".join(lines)
