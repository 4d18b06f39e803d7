"""The CUDA kernels' NVFP4 chunk layout on CPU: repack round trips, and an emulator that replays the
kernel's loads, bit operations and mma.m16n8k16 fragments on what `tile_nvfp4` writes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from qerl_pipe.formats.nvfp4 import E2M1_GRID, NVFP4Weight, dequantize_nvfp4, quantize_nvfp4, unpack_fp4
from qerl_pipe.kernels import cuda_ext, tiled
from qerl_pipe.kernels.tiled import TiledNVFP4, tile_nvfp4, untile_nvfp4

CODE_VALUES = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float64)
SHAPES = [(64, 32), (100, 48), (130, 96), (7, 16), (300, 1088), (64, 4096)]


def _random_weight(n: int, k: int, seed: int, odd_scales: bool = False) -> NVFP4Weight:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(1, 127, (n, k // 16), dtype=torch.uint8, generator=gen)
    if odd_scales:  # negative and zero scales too (never NaN: 0x7F / 0xFF)
        scales = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=gen)
        scales[(scales & 0x7F) == 0x7F] = 0x80
    return NVFP4Weight(packed, scales.view(torch.float8_e4m3fn), torch.tensor(0.0123, dtype=torch.float32))


def _exact(w: NVFP4Weight) -> torch.Tensor:
    """W in fp64 with no rounding: e2m1 x E4M3 x fp32 global scale has at most 29 significant bits."""
    codes = unpack_fp4(w.packed).long()
    scale = w.block_scales.double().repeat_interleave(16, dim=1) * w.global_scale.double()
    return CODE_VALUES[codes] * scale


# ---- the emulator: the kernel's index arithmetic and bit operations, in int64 torch ----------


def _rotr(q: torch.Tensor, r: int) -> torch.Tensor:
    return ((q >> r) | (q << (32 - r))) & 0xFFFFFFFF if r else q


def _bf16_value(bits: torch.Tensor) -> torch.Tensor:
    b = bits.to(torch.int64)
    return (b - ((b >> 15) << 16)).to(torch.int16).view(torch.bfloat16).double()


def _fragments(t: TiledNVFP4) -> torch.Tensor:
    """A fragments as the kernel makes them: `[nb, kc, lane, tile, step, register, half]` fp64
    values (code x scale x 2**-7), checking that each product is exact in bf16."""
    nb, kc = t.qweight.shape[:2]
    # Lane l's code vector of pair p is uint4 number p * 32 + l of the chunk; word i * 2 + j of it.
    words = (t.qweight.to(torch.int64) & 0xFFFFFFFF).view(nb, kc, 2, 32, 2, 2)
    regs = []
    for terms in tiled.DECODE:
        v = torch.zeros_like(words)
        for rot, mask in terms:
            v |= _rotr(words, rot) & mask
        regs.append(v)
    regs = torch.stack(regs, -1)  # [nb, kc, p, lane, i, j, r]
    codes = torch.stack([_bf16_value(regs & 0xFFFF), _bf16_value(regs >> 16)], -1)
    # Lane (g, t) reads the 8 scale bytes at (2g + t // 2) * 8; word q covers tiles 2q, 2q + 1.
    lane = torch.arange(32)
    offsets = ((lane // 4) * 2 + (lane % 4) // 2) * 8
    sb = t.scales.to(torch.int64)[:, :, offsets[:, None] + torch.arange(8)]  # [nb, kc, lane, 8]
    sw = sb.view(nb, kc, 32, 2, 4)
    word = sw[..., 0] | sw[..., 1] << 8 | sw[..., 2] << 16 | sw[..., 3] << 24  # [nb, kc, lane, q]
    pairs = torch.stack([((word << 4) & tiled.SCALE_AND) | tiled.SCALE_OR,
                         ((word >> 4) & tiled.SCALE_AND) | tiled.SCALE_OR], -1)  # [.., q, i]
    scale_g, scale_g8 = _bf16_value(pairs & 0xFFFF), _bf16_value(pairs >> 16)
    # registers 0 and 2 hold row g (the pair's low half), 1 and 3 row g + 8 (the high half)
    scale = torch.stack([scale_g, scale_g8, scale_g, scale_g8], -1)  # [nb, kc, lane, q, i, r]
    codes = codes.permute(0, 1, 3, 2, 4, 5, 6, 7)  # [nb, kc, lane, p, i, j, r, half]
    frag = codes * scale[:, :, :, :, :, None, :, None]
    exact = frag.to(torch.bfloat16).double()
    assert torch.equal(torch.where(frag.isfinite(), exact, frag), frag), "a code x scale product is not exact in bf16"
    return frag.reshape(nb, kc, 32, 4, 2, 4, 2)  # tile = 2p + i


def emulate_weight(t: TiledNVFP4) -> torch.Tensor:
    """W as the kernel's MMAs see it, fp64 `[N, K]`: each chunk, tile and step is one
    mma.m16n8k16 whose A fragment is the decoded registers (a0: row g, k 2t..2t+1; a1: row g+8;
    a2: row g, k 2t+8..2t+9; a3: row g+8) and whose B fragment is the lane's 16-byte load of x at
    column 8t of the chunk (b0 = its elements 4j, 4j+1; b1 = 4j+2, 4j+3). The product A x B puts
    A's element (row, kappa) against x's column col(kappa), so W[row, col(kappa)] = A[row, kappa];
    the result is scaled by global x 2**7 as the kernel's epilogue does."""
    frag = _fragments(t)
    nb, kc = frag.shape[:2]
    g, tt = torch.arange(32) // 4, torch.arange(32) % 4
    w = torch.zeros(nb, 4, 16, kc, tiled.COLS, dtype=torch.float64)  # [nb, tile, row, kc, col]
    for tile in range(4):
        for j in range(2):
            f = frag[:, :, :, tile, j]  # [nb, kc, lane, r, half]
            for r, (row_off, kappa_off) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                for half in range(2):
                    kappa = 2 * tt + kappa_off + half
                    b_reg, b_half = kappa_off // 8, kappa % 2  # which B register, which element
                    col = 8 * tt + 4 * j + 2 * b_reg + b_half
                    w[:, tile, g + row_off, :, col] = f[:, :, :, r, half].permute(2, 0, 1)
    w = w.reshape(nb * tiled.ROWS, kc * tiled.COLS) * float(t.global_scale) * 2.0**tiled.PRODUCT_SHIFT
    return w[: t.out_features, : t.in_features]


def _mma(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mma.m16n8k16 (.row.col) over one warp's fragments, by PTX's fragment layout: a `[32, 4, 2]`
    (a0/a2 row g, a1/a3 row g + 8; a0/a1 k 2t + h, a2/a3 k 2t + 8 + h), b `[32, 2, 2]` (b0 k 2t + h,
    b1 k 2t + 8 + h; column g) -> c `[32, 4]` (c0/c1 row g, c2/c3 row g + 8; columns 2t, 2t + 1)."""
    g, t = torch.arange(32) // 4, torch.arange(32) % 4
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    for h in range(2):
        for r, (row, k) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            A[g + row, 2 * t + k + h] = a[:, r, h]
        B[2 * t + h, g] = b[:, 0, h]
        B[2 * t + 8 + h, g] = b[:, 1, h]
    C = A @ B
    return torch.stack([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]], -1)


def emulate_gemm(t: TiledNVFP4, x: torch.Tensor, mt: int, nb: int, wk: int) -> torch.Tensor:
    """out = x @ W^T as one CTA column of the kernels computes it, lane by lane: the A fragments
    of `_fragments` for the warp tile's m16 tiles (MT = 2: tiles 2 * pair0 + i), B fragments from
    the lane's 16-byte piece of x (token m0 + 8b + g, columns 8t..8t + 7 of the chunk; b0 = its
    elements 4j, 4j + 1, b1 = 4j + 2, 4j + 3) loaded directly, MMAs by `_mma`, K-warps summed, and
    the C fragments scattered as `for_each_output` does."""
    frag = _fragments(t)
    n_blocks, kc = t.qweight.shape[:2]
    m, k = x.shape
    g, tt = torch.arange(32) // 4, torch.arange(32) % 4
    out = torch.zeros(m, n_blocks * tiled.ROWS, dtype=torch.float64)
    xs = torch.zeros(-(-m // (8 * nb)) * 8 * nb, kc * tiled.COLS + tiled.COLS * wk, dtype=torch.float64)
    xs[:m, :k] = x

    def piece(token: torch.Tensor, chunk: int, part: torch.Tensor) -> torch.Tensor:  # [.., 8]
        cols = chunk * tiled.COLS + part[..., None] * 8 + torch.arange(8)
        return xs[token[..., None], cols]

    for m0 in range(0, m, 8 * nb):
        for warp_tile in range(n_blocks * 4 // mt):
            nblock, pair0 = divmod(warp_tile, 4 // mt)
            acc = torch.zeros(mt, nb, 32, 4, dtype=torch.float64)
            for c in range(-(-kc // wk)):  # chunk groups; K-warp w takes chunk c * wk + w
                for w in range(wk):
                    chunk = c * wk + w
                    if chunk >= kc:
                        continue  # the warp has no such chunk
                    for b in range(nb):
                        xv = piece(m0 + b * 8 + g, chunk, tt)
                        for j in range(2):
                            bfrag = xv[:, 4 * j:4 * j + 4].reshape(32, 2, 2)
                            for tile in range(mt):
                                afrag = frag[nblock, chunk, :, 2 * pair0 * (mt == 2) + tile, j]  # [32, 4, 2]
                                acc[tile, b] += _mma(afrag, bfrag)
            row_base = nblock * tiled.ROWS + pair0 * 32 * (mt == 2)
            for tile in range(mt):
                for b in range(nb):
                    for e in range(4):
                        row = row_base + tile * 16 + g + (e >> 1) * 8
                        token = m0 + b * 8 + 2 * tt + (e & 1)
                        ok = token < m
                        out[token[ok], row[ok]] = acc[tile, b, ok, e]
    scale = float(t.global_scale) * 2.0**tiled.PRODUCT_SHIFT
    return out[:, : t.out_features] * scale


def emulate_wgmma(t: TiledNVFP4, x: torch.Tensor, blocks: int) -> torch.Tensor:
    """out = x @ W^T as the wgmma kernel computes it: x in `tiled.fragment_order` (rows padded to
    whole passes of 64 * `blocks` tokens); per pass and group of two chunks, thread piece v (16
    bytes) of each token row lands at 16-byte unit v ^ (row % 8) of the row's 128 bytes (pieces of
    a chunk past K zero-filled); wgmma reads B[k, token] at byte 32 * step + 2k of the token's
    swizzled row (K-major, 128-byte swizzle), and warp wq of the block's warpgroup supplies the A
    fragment of m16 tile wq (`_fragments`' tile 2p + i, as the kernel's shared-memory read at
    ((wq >> 1) * 32 + lane) * 16 + (wq & 1) * 8 takes it) for step 2h + j."""
    frag = _fragments(t)
    n_blocks, kc = t.qweight.shape[:2]
    m, k = x.shape
    tokens = 64 * blocks
    xf = tiled.fragment_order(x, -(-m // tokens) * tokens)
    g, tt = torch.arange(32) // 4, torch.arange(32) % 4
    out = torch.zeros(m, n_blocks * tiled.ROWS, dtype=torch.float64)
    for m0 in range(0, m, tokens):
        for nblock in range(n_blocks):
            acc = torch.zeros(tiled.ROWS, tokens, dtype=torch.float64)
            for c in range(-(-kc // 2)):
                tile = torch.zeros(tokens * 64, dtype=torch.float64)  # bf16 elements of the stage
                for row in range(tokens):
                    for v in range(8):
                        if 2 * c + (v >> 2) < kc:
                            e = (row * 128 + ((v ^ (row & 7)) << 4)) // 2
                            col = 2 * c * tiled.COLS + 8 * v
                            tile[e:e + 8] = xf[m0 + row, col:col + 8]
                for step in range(4):
                    h, j = divmod(step, 2)
                    if 2 * c + h >= kc:
                        continue  # zero-filled weights
                    b = torch.zeros(16, tokens, dtype=torch.float64)
                    for n in range(tokens):
                        for kappa in range(16):
                            byte = 32 * step + 2 * kappa
                            phys = n * 128 + ((((byte >> 4) ^ (n & 7)) << 4) | (byte & 15))
                            b[kappa, n] = tile[phys // 2]
                    for wq in range(4):
                        a = torch.zeros(16, 16, dtype=torch.float64)
                        f = frag[nblock, 2 * c + h, :, wq, j]  # [32, 4, 2]
                        for half in range(2):
                            for r, (row_off, k_off) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                                a[g + row_off, 2 * tt + k_off + half] = f[:, r, half]
                        acc[16 * wq:16 * wq + 16] += a @ b
            valid = min(tokens, m - m0)
            out[m0:m0 + valid, nblock * tiled.ROWS:(nblock + 1) * tiled.ROWS] = acc[:, :valid].T
    return out[:, : t.out_features] * float(t.global_scale) * 2.0**tiled.PRODUCT_SHIFT


def _popcount(t: torch.Tensor, bits: int) -> int:
    v = t.to(torch.int64) & ((1 << bits) - 1)
    return int(sum(((v >> b) & 1).sum() for b in range(bits)))


# ---- tests -------------------------------------------------------------------------------------


def test_decode_routes_every_word_bit_once() -> None:
    table = tiled.source_bits()  # raises if the decode is not a bijection onto the code bits
    assert sorted(b for reg in table for half in reg for b in half) == list(range(32))


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_round_trip(n: int, k: int) -> None:
    w = _random_weight(n, k, n * k)
    t = tile_nvfp4(w)
    assert t.qweight.shape == tiled.tiled_shapes(n, k)[0] and t.scales.shape == tiled.tiled_shapes(n, k)[1]
    back = untile_nvfp4(t)
    assert torch.equal(back.packed, w.packed)
    assert torch.equal(back.block_scales.view(torch.uint8), w.block_scales.view(torch.uint8))
    # Nothing lost or doubled: the padding holds zero codes, so the set bits are the same.
    assert _popcount(t.qweight, 32) == _popcount(w.packed, 8)


def test_slices_give_the_same_bytes(monkeypatch) -> None:
    w = _random_weight(300, 1088, 3)
    whole = tile_nvfp4(w)
    monkeypatch.setattr(tiled, "_SLICE_ELEMENTS", 1 << 12)
    sliced = tile_nvfp4(w)
    assert torch.equal(whole.qweight, sliced.qweight) and torch.equal(whole.scales, sliced.scales)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_emulated_kernel_sees_the_exact_weight(n: int, k: int) -> None:
    """Zero, negative and subnormal scales included: the repack normalizes them, the values stay."""
    w = _random_weight(n, k, 7 * n + k, odd_scales=True)
    assert torch.equal(emulate_weight(tile_nvfp4(w)), _exact(w))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 100, 48), (5, 333, 1088), (8, 64, 4096)])
def test_emulated_gemm_matches_the_reference(m: int, n: int, k: int) -> None:
    w = quantize_nvfp4(torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16).double()
    got = x @ emulate_weight(tile_nvfp4(w)).T
    ref = x @ dequantize_nvfp4(w, torch.float64).T  # computed in fp32, as modelopt does
    assert float((got - ref).norm() / ref.norm()) < 1e-6
    assert torch.equal(got, x @ _exact(w).T)


@pytest.mark.parametrize(("mt", "nb", "wk"), [(4, 1, 1), (2, 2, 4), (4, 1, 8), (4, 2, 2), (2, 8, 4)])
def test_emulated_lanes_compute_the_product(mt: int, nb: int, wk: int) -> None:
    """The activation side too: B fragments and the C scatter, with an M tail, N padded to 64 and
    K % 32 == 16."""
    w = _random_weight(100, 112, 11, odd_scales=True)
    x = torch.randn(8 * nb + 3, 112, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).double()
    got = emulate_gemm(tile_nvfp4(w), x, mt, nb, wk)
    ref = x @ _exact(w).T
    assert float((got - ref).abs().max()) <= 1e-9 * float(ref.abs().max())


@pytest.mark.parametrize(("m", "k", "blocks"), [(3, 112, 1), (67, 80, 1), (130, 48, 2), (40, 48, 4)])
def test_emulated_wgmma_computes_the_product(m: int, k: int, blocks: int) -> None:
    """x in fragment order, the kernel's 16-byte piece copies and swizzled B reads agree with its A
    fragments' k order: with an M tail (zero rows), N padded to 64, K % 32 == 16 and an odd chunk
    count (a half-empty last group)."""
    w = _random_weight(100, k, 13, odd_scales=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).double()
    got = emulate_wgmma(tile_nvfp4(w), x, blocks)
    ref = x @ _exact(w).T
    assert float((got - ref).abs().max()) <= 1e-9 * float(ref.abs().max())


def test_fragment_order_is_a_permutation_of_each_chunk() -> None:
    """Each 32-column chunk row keeps its own values (only their order changes); padding is zero."""
    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(4))
    xf = tiled.fragment_order(x, 8)
    assert xf.shape == (8, 96) and not xf[5:].any()
    for c in range(3):
        got = xf[:5, 32 * c:32 * c + 32].sort(dim=1).values
        want = torch.nn.functional.pad(x[:, 32 * c:32 * c + 32], (0, max(0, 32 * c + 32 - 80))).sort(dim=1).values
        assert torch.equal(got, want)
    # pair 4t + u of a chunk sits at position 4u + t
    assert torch.equal(xf[0, 2 * (4 * 2 + 1):2 * (4 * 2 + 1) + 2], x[0, 2 * (4 * 1 + 2):2 * (4 * 1 + 2) + 2])


def test_every_code_times_every_scale_byte() -> None:
    """All 16 codes x all 254 non-NaN scale bytes (subnormals, 448, zero, negative): each decoded
    product is exact in bf16 (checked inside) and equals e2m1 x E4M3 x 2**-7."""
    rows = [b for b in range(256) if b & 0x7F != 0x7F]
    codes = torch.arange(16, dtype=torch.uint8).repeat(len(rows), 1)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.tensor(rows, dtype=torch.uint8)[:, None].view(torch.float8_e4m3fn)
    w = NVFP4Weight(packed, scales, torch.tensor(1.0))
    assert torch.equal(emulate_weight(tile_nvfp4(w)), _exact(w))


def test_nan_scales_are_refused() -> None:
    w = _random_weight(64, 32, 1)
    bad = w.block_scales.view(torch.uint8).clone()
    bad[3, 1] = 0x7F
    with pytest.raises(ValueError, match="NaN block scales"):
        tile_nvfp4(NVFP4Weight(w.packed, bad.view(torch.float8_e4m3fn), w.global_scale))


def test_header_follows_the_spec() -> None:
    header = tiled.constants_header()
    for rot, mask in (term for terms in tiled.DECODE for term in terms):
        assert f"0x{mask:08X}u" in header
        if rot:
            assert f"rotr32(q, {rot})" in header
    assert f"kProductScale = {float(2 ** tiled.PRODUCT_SHIFT)!r}f" in header


def test_compiled_configs_match_the_sources() -> None:
    src = (cuda_ext.SOURCE_DIR / "w4a16.cu").read_text()

    def listed(macro: str, end: str) -> tuple[tuple[int, ...], ...]:
        block = src[src.index(f"#define {macro}(X)"):src.index(end)]
        return tuple(tuple(int(v) for v in m.split(",")) for m in re.findall(r"X\(([\d, ]+)\)", block))

    assert listed("QERL_W4A16_CONFIGS", "#define QERL_W4A16_WGMMA") == cuda_ext.COMPILED
    assert listed("QERL_W4A16_WGMMA", "#define QERL_W4A16_GROUPED") == cuda_ext.WGMMA
    assert listed("QERL_W4A16_GROUPED", "int gemm_blocks_per_sm") == cuda_ext.GROUPED
    # The default grouped launch of every pass size is compiled.
    assert all(cuda_ext.grouped_config(rows) in cuda_ext.grouped_configs() for rows in (1, 8, 9, 16, 32, 64, 65))


def test_table_configs_are_compiled() -> None:
    compiled = {(c.mt, c.nb, c.warps, c.wk, c.depth, c.stages) for c in cuda_ext.compiled_configs()}
    sms, configs = cuda_ext._table()
    assert sms > 0 and configs
    for key, c in configs.items():
        assert (c["mt"], c["nb"], c["warps"], c["wk"], c["depth"], c.get("stages", 0)) in compiled, key
        assert c["splits"] >= 1


def test_every_compiled_variant_is_launched() -> None:
    """No dead variants: each compiled config is a shipped table row's or a pass size's default."""
    _, configs = cuda_ext._table()
    launched = [cuda_ext.GemmConfig(**c) for c in configs.values()]
    launched += [cuda_ext.default_config(m, 5, 5, 1, per_sm=1) for m in (1, 16, 32, 64)]  # shapes with no row
    assert set(cuda_ext.compiled_configs()) == {replace(c, splits=1, pdl=True) for c in launched}


def test_table_override(tmp_path: Path, monkeypatch) -> None:
    """QERL_W4A16_TABLE replaces the shipped table; an unreadable one is refused by name."""
    key = cuda_ext.table_key(8, 4608, 3584)
    config = {"mt": 4, "nb": 1, "warps": 4, "wk": 4, "depth": 4, "splits": 5, "pdl": True, "stages": 0}
    table = tmp_path / "configs.json"
    table.write_text(json.dumps({"sms": 132, "configs": {key: config}}))
    monkeypatch.setenv("QERL_W4A16_TABLE", str(table))
    cuda_ext._table.cache_clear()
    try:
        assert cuda_ext.default_config(8, 4608, 3584, 132) == cuda_ext.GemmConfig(**config)
        assert cuda_ext.default_config(8, 4608, 3584, 114, per_sm=2) != cuda_ext.GemmConfig(**config)  # another GPU
        monkeypatch.setenv("QERL_W4A16_TABLE", str(tmp_path / "missing.json"))
        cuda_ext._table.cache_clear()
        with pytest.raises(RuntimeError, match="missing.json.*QERL_W4A16_TABLE"):
            cuda_ext.default_config(8, 4608, 3584, 132)
        # A row naming a variant that is not compiled is refused with its key, not launched.
        table.write_text(json.dumps({"sms": 132, "configs": {key: {**config, "depth": 3}}}))
        monkeypatch.setenv("QERL_W4A16_TABLE", str(table))
        cuda_ext._table.cache_clear()
        with pytest.raises(RuntimeError, match=f"row {key}.*not a compiled"):
            cuda_ext.default_config(8, 4608, 3584, 132)
    finally:
        monkeypatch.delenv("QERL_W4A16_TABLE")
        cuda_ext._table.cache_clear()


def test_split_choice_shrinks_as_tokens_grow() -> None:
    c1 = cuda_ext.GemmConfig(4, 1, 4, 4, 4, 1)
    c8 = cuda_ext.GemmConfig(2, 8, 4, 4, 2, 1)
    s1 = cuda_ext.choose_splits(1, 3584, 18944, c1, 132, 4)
    s64 = cuda_ext.choose_splits(64, 3584, 18944, c8, 132, 2)
    assert s1 > s64 >= 1
    # a layer big enough to fill the GPU is not split at all
    assert cuda_ext.choose_splits(64, 55296, 5120, c8, 132, 2) == 1


def test_fake_op_gives_shapes_without_a_gpu() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = tile_nvfp4(_random_weight(100, 48, 2))
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 48).to(torch.bfloat16))
        q, s, g = (mode.from_tensor(v) for v in (t.qweight, t.scales, t.global_scale))
        out = torch.ops.qerl.w4a16_gemm(x, q, s, g, None, 100, 48, 4, 1, 4, 4, 4, 1, True, 0)
        deq = torch.ops.qerl.w4a16_dequant(q, s, g, 100, 48)
    assert out.shape == (3, 100) and out.dtype == torch.bfloat16
    assert deq.shape == (100, 48) and deq.dtype == torch.bfloat16


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed here")
def test_sources_compile_for_sm90a_without_spills(tmp_path: Path) -> None:
    src = cuda_ext.write_build_tree(tmp_path)
    proc = subprocess.run(
        ["nvcc", "-cubin", "-o", str(tmp_path / "w4a16.cubin"), str(src / "w4a16.cu"), f"-I{src}",
         *cuda_ext.CUDA_FLAGS],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = proc.stdout + proc.stderr
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    # every variant, the dequantize pass and the wgmma kernel's fragment-order copy of x
    assert len(kernels) == len(cuda_ext.COMPILED) + len(cuda_ext.WGMMA) + len(cuda_ext.GROUPED) + 2
    assert "C7513" not in report, "ptxas serialized the wgmma kernel's MMAs: " + report[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report[-2000:]
    assert all(int(r) <= 255 for r in re.findall(r"Used (\d+) registers", report))
