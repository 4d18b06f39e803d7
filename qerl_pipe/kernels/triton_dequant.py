"""In-register decode of one [BLOCK_N, BLOCK_K] weight tile from the kernel layout (packing.py).

Exact: NVFP4 by bit operations into fp16 (no lookup table), NF4 by a 16-entry fp32 table times the
absmax, rounded once as the reference does. See docs/kernels.md, section
"Decoding 4-bit codes without a lookup table (Triton)"."""

import triton
import triton.language as tl

NVFP4: tl.constexpr = tl.constexpr(0)
NF4: tl.constexpr = tl.constexpr(1)
# The NVFP4 tile is scaled by 2**-14 (see above), or by 2**-7 on the PTX path; the accumulator
# is multiplied back.
NVFP4_TILE_SCALE: tl.constexpr = tl.constexpr(16384.0)
NVFP4_PTX_TILE_SCALE: tl.constexpr = tl.constexpr(128.0)
# E4M3 scale s -> the bf16 multiplier s * 2**119 of the PTX path (the fp16 decode gives s * 2**-8).
_PTX_SCALE_FACTOR: tl.constexpr = tl.constexpr(2.0**127)


@triton.jit
def _nvfp4_pairs_ptx(v, s2):
    """Two E2M1 codes (bits 12-15, 28-31 of v) x the bf16 pair s2 -> one bf16x2 word: magnitude bits
    to bf16 bits 6-8 and sign to 15 make `e2m1(code) * 2**-126`, and one packed FMA by s2 = scale *
    2**119 gives code * scale * 2**-7, exact for every E4M3 scale (at most 6 significant bits).
    2 instructions per element where the pure-Triton decode converts fp16 -> fp32 -> bf16."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, u;
        shr.u32 t, $1, 6;
        and.b32 t, t, 0x01C001C0;
        and.b32 u, $1, 0x80008000;
        or.b32 t, t, u;
        mov.b32 u, 0x80008000;
        fma.rn.bf16x2 $0, t, $2, u;
        }""",
        constraints="=r,r,r", args=[v, s2], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def dequant_tile(q_ptr, s_ptr, lut_ptr, offs_n, k0, N, K,
                 FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PTX: tl.constexpr = False):
    """Rows `offs_n`, columns k0..k0+BLOCK_K of W (no global scale; 0 out of range): NVFP4 fp16 x
    2**-14 (bf16 x 2**-7 with PTX: compiled code only, `_nvfp4_pairs_ptx`), NF4 fp32. k0 is a
    multiple of BLOCK_K and K of 16 (NVFP4) or 64 (NF4): the K edge never cuts a scale block."""
    WORDS: tl.constexpr = BLOCK_K // 8
    kw = K // 8
    offs_w = k0 // 8 + tl.arange(0, WORDS)
    n_ok = offs_n < N
    q = tl.load(q_ptr + offs_n[:, None] * kw + offs_w[None, :],
                mask=n_ok[:, None] & (offs_w[None, :] < kw), other=0)
    if FMT == NVFP4:
        # [BLOCK_N, WORDS, 4]: pair s of each word at the top of both 16-bit halves.
        v = q[:, :, None] << (tl.arange(0, 4) * 4)[None, None, :]
        SB: tl.constexpr = BLOCK_K // 16
        offs_s = k0 // 16 + tl.arange(0, SB)
        b = tl.load(s_ptr + offs_n[:, None] * (K // 16) + offs_s[None, :],
                    mask=n_ok[:, None] & (offs_s[None, :] < K // 16), other=0).to(tl.int16)
        # E4M3 bits -> fp16 bits is the value * 2**-8 (subnormals included); * 256 is exact.
        s = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
        if PTX:
            # Per scale, not per element: s * 2**119 in bf16 (exact), duplicated into both halves.
            sb = (s.to(tl.float32) * _PTX_SCALE_FACTOR).to(tl.bfloat16).to(tl.int16, bitcast=True)
            sb = sb.to(tl.int32) & 0xFFFF
            s2 = tl.reshape(tl.join(sb, sb), (BLOCK_N, WORDS))  # one scale per 2 words
            s2 = tl.broadcast_to((s2 | (s2 << 16))[:, :, None], (BLOCK_N, WORDS, 4))
            pairs = _nvfp4_pairs_ptx(v, s2)
            lo = pairs.to(tl.int16).to(tl.bfloat16, bitcast=True)
            hi = (pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
            w = tl.join(lo, hi)
        else:
            bits = ((v & 0x70007000) >> 3) | (v & -0x7FFF8000)  # == 0x80008000 as int32
            lo = bits.to(tl.int16).to(tl.float16, bitcast=True)
            hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True)
            s = tl.reshape(tl.join(s, s), (BLOCK_N, WORDS)) * 256.0  # one scale per 2 words
            w = tl.join(lo, hi) * s[:, :, None, None]
    else:
        # [BLOCK_N, WORDS, 4]: byte s of each word in the low 8 bits (the shift is arithmetic;
        # the masks drop the sign bits it brings in).
        v = q[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]
        lo = tl.load(lut_ptr + ((v >> 4) & 15))
        hi = tl.load(lut_ptr + (v & 15))
        AB: tl.constexpr = BLOCK_K // 64
        offs_a = k0 // 64 + tl.arange(0, AB)
        a = tl.load(s_ptr + offs_n[:, None] * (K // 64) + offs_a[None, :],
                    mask=n_ok[:, None] & (offs_a[None, :] < K // 64), other=0.0)
        a = tl.reshape(tl.broadcast_to(a[:, :, None], (BLOCK_N, AB, 8)), (BLOCK_N, WORDS))
        w = tl.join(lo, hi) * a[:, :, None, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def tile_scale(g_ptr, FMT: tl.constexpr, PTX: tl.constexpr = False):
    """Factor that turns the accumulated dot of decoded tiles into x @ W^T."""
    if FMT == NVFP4:
        if PTX:
            return tl.load(g_ptr) * NVFP4_PTX_TILE_SCALE
        return tl.load(g_ptr) * NVFP4_TILE_SCALE
    else:
        return 1.0
