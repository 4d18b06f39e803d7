"""In-register decode of one [BLOCK_N, BLOCK_K] weight tile from the kernel layout (packing.py).

NVFP4, exact and without a lookup table: after `word << 4*s`, the two codes of pair s sit at bits
12-15 and 28-31. `(v & 0x70007000) >> 3` moves each code's 3 magnitude bits into an fp16's low two
exponent bits and top mantissa bit, and `v & 0x80008000` keeps both signs, so each 16-bit half is
the fp16 `e2m1(code) * 2**-14` (E2M1's zero exponent lands on fp16 subnormals, which hardware
handles exactly). The E4M3 scale byte becomes an fp16 the same way. The product code*scale has at
most 6 significant bits and lies in [2**-24, 0.17], so fp16 and then bf16 hold it exactly; the
2**14 and the global scale go on the fp32 accumulator once per output tile.

NF4 levels are arbitrary floats: a 16-entry fp32 table (one 64-byte line, L1-resident) times the
fp32 absmax, rounded once to bf16 as the reference does.
"""

import triton
import triton.language as tl

NVFP4: tl.constexpr = tl.constexpr(0)
NF4: tl.constexpr = tl.constexpr(1)
# The NVFP4 tile is scaled by 2**-14 (see above); the accumulator is multiplied back.
NVFP4_TILE_SCALE: tl.constexpr = tl.constexpr(16384.0)


@triton.jit
def dequant_tile(q_ptr, s_ptr, lut_ptr, offs_n, k0, N, K,
                 FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `offs_n`, columns k0..k0+BLOCK_K of W (no global scale): NVFP4 fp16 x 2**-14, NF4 fp32.

    Out-of-range rows and columns come back as 0. k0 is a multiple of BLOCK_K; K of 16 (NVFP4)
    or 64 (NF4), so scale blocks are never cut by the K edge.
    """
    WORDS: tl.constexpr = BLOCK_K // 8
    kw = K // 8
    offs_w = k0 // 8 + tl.arange(0, WORDS)
    n_ok = offs_n < N
    q = tl.load(q_ptr + offs_n[:, None] * kw + offs_w[None, :],
                mask=n_ok[:, None] & (offs_w[None, :] < kw), other=0)
    # [BLOCK_N, WORDS, 4]: pair s of each word at the top of both 16-bit halves.
    v = q[:, :, None] << (tl.arange(0, 4) * 4)[None, None, :]
    if FMT == NVFP4:
        bits = ((v & 0x70007000) >> 3) | (v & -0x7FFF8000)  # -0x7FFF8000 == 0x80008000 as int32
        lo = bits.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        SB: tl.constexpr = BLOCK_K // 16
        offs_s = k0 // 16 + tl.arange(0, SB)
        b = tl.load(s_ptr + offs_n[:, None] * (K // 16) + offs_s[None, :],
                    mask=n_ok[:, None] & (offs_s[None, :] < K // 16), other=0).to(tl.int16)
        # E4M3 bits -> fp16 bits is the value * 2**-8 (subnormals included); * 256 is exact.
        s = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
        s = tl.reshape(tl.join(s, s), (BLOCK_N, WORDS))  # one scale per 2 words
        w = tl.join(lo, hi) * s[:, :, None, None]
    else:
        lo = tl.load(lut_ptr + ((v >> 12) & 15))
        hi = tl.load(lut_ptr + ((v >> 28) & 15))
        AB: tl.constexpr = BLOCK_K // 64
        offs_a = k0 // 64 + tl.arange(0, AB)
        a = tl.load(s_ptr + offs_n[:, None] * (K // 64) + offs_a[None, :],
                    mask=n_ok[:, None] & (offs_a[None, :] < K // 64), other=0.0)
        a = tl.reshape(tl.broadcast_to(a[:, :, None], (BLOCK_N, AB, 8)), (BLOCK_N, WORDS))
        w = tl.join(lo, hi) * a[:, :, None, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def tile_scale(g_ptr, FMT: tl.constexpr):
    """Factor that turns the accumulated dot of decoded tiles into x @ W^T."""
    if FMT == NVFP4:
        return tl.load(g_ptr) * NVFP4_TILE_SCALE
    else:
        return 1.0
