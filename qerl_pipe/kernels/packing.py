"""Kernel layout of 4-bit weights for Triton: a one-time repack of the standard checkpoint bytes.

NVFP4 codes go into int32 words of 8 in `WORD_SLOTS` order (a shift puts two adjacent elements in
place); NF4 is not repacked (its bytes read as words); `prepared_*` cache per weight. See
docs/kernels.md, section "Decoding 4-bit codes without a lookup table (Triton)"."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from qerl_pipe.formats.nf4 import NF4_CODE, NF4Weight
from qerl_pipe.formats.nvfp4 import FourBitRows, NVFP4Weight, pack_fp4, unpack_fp4

# WORD_SLOTS[slot] = which of the word's 8 elements sits in nibble `slot` (bits 4*slot..4*slot+3).
WORD_SLOTS = (6, 4, 2, 0, 7, 5, 3, 1)
_SLOT_OF_ELEMENT = tuple(WORD_SLOTS.index(e) for e in range(8))


@dataclass(frozen=True)
class PackedNVFP4(FourBitRows):
    """NVFP4 weight in kernel layout."""

    CODES, PER_ITEM = "qweight", 8

    qweight: Tensor  # int32 [N, K/8], 8 codes per word in WORD_SLOTS order
    scales: Tensor  # uint8 [N, K/16], the E4M3 block-scale bytes
    global_scale: Tensor  # float32 [1]; a tensor, not a float, so no host sync per call


@dataclass(frozen=True)
class PackedNF4(FourBitRows):
    """NF4 weight in kernel layout."""

    CODES, PER_ITEM = "qweight", 8

    qweight: Tensor  # int32 [N, K/8]: bitsandbytes' bytes [N, K/2] viewed as words (not WORD_SLOTS)
    absmax: Tensor  # float32 [N, K/64]
    code: Tensor  # float32 [16], the NF4 levels (the kernel's lookup table)
    # On the CPU, the weight dequantized once, where the model made one (as `TiledNVFP4.dense`).
    dense: Tensor | None = field(default=None, compare=False, repr=False)


# Rows are packed in chunks of about this many elements: the int64 temporaries cost 8-16 B per
# element, which for a whole 32B gate_up (283 M elements) would be ~2.3 GB of transient GPU memory.
_PACK_CHUNK = 1 << 24


def pack_words(packed: Tensor) -> Tensor:
    """Standard nibble bytes `[N, K/2]` -> int32 words `[N, K/8]` in WORD_SLOTS order."""
    n, half_k = packed.shape
    if half_k % 4:
        raise ValueError(f"K = {2 * half_k} is not a multiple of 8; the kernels need whole words")
    out = torch.empty(n, half_k // 4, dtype=torch.int32, device=packed.device)
    rows = max(1, _PACK_CHUNK // (2 * half_k))
    for r0 in range(0, n, rows):
        out[r0 : r0 + rows] = _pack_rows(packed[r0 : r0 + rows])
    return out


def _pack_rows(packed: Tensor) -> Tensor:
    n, half_k = packed.shape
    codes = unpack_fp4(packed).to(torch.int64).reshape(n, half_k // 4, 8)
    word = torch.zeros(n, half_k // 4, dtype=torch.int64, device=packed.device)
    for slot, element in enumerate(WORD_SLOTS):
        word |= codes[..., element] << (4 * slot)
    # Two's complement into int32: a code with its top bit set in slot 7 makes the word negative.
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_words(qweight: Tensor) -> Tensor:
    """Inverse of `pack_words`: int32 words `[N, K/8]` -> standard bytes `[N, K/2]`."""
    n, words = qweight.shape
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(w >> (4 * _SLOT_OF_ELEMENT[e])) & 0xF for e in range(8)], dim=-1)
    return pack_fp4(codes.reshape(n, words * 8).to(torch.uint8))


def prepare_nvfp4(w: NVFP4Weight) -> PackedNVFP4:
    """Repack an NVFP4 weight for the kernels (on the weight's device)."""
    return PackedNVFP4(
        qweight=pack_words(w.packed),
        scales=w.block_scales.contiguous().view(torch.uint8),
        global_scale=w.global_scale.to(torch.float32).reshape(1).contiguous(),
    )


def prepare_nf4(w: NF4Weight) -> PackedNF4:
    """An NF4 weight as the kernels take it (a view of its bytes as int32 words: no repack)."""
    if w.packed.shape[-1] % 4:
        raise ValueError(f"K = {w.in_features} is not a multiple of 8; the kernels need whole words")
    return PackedNF4(
        qweight=w.packed.contiguous().view(torch.int32),
        absmax=w.absmax.to(torch.float32).contiguous(),
        code=torch.tensor(NF4_CODE, dtype=torch.float32, device=w.packed.device),
    )


def unprepare_nvfp4(p: PackedNVFP4) -> NVFP4Weight:
    """Back to the checkpoint container (for the CPU path and for tests)."""
    return NVFP4Weight(
        unpack_words(p.qweight), p.scales.view(torch.float8_e4m3fn), p.global_scale.reshape(())
    )


def unprepare_nf4(p: PackedNF4) -> NF4Weight:
    """Back to the checkpoint container (for the CPU path and for tests)."""
    return NF4Weight(p.qweight.view(torch.uint8), p.absmax)


_W = TypeVar("_W")
_P = TypeVar("_P")
# id(weight) -> packed copy; an entry is dropped when its weight object is garbage-collected.
_CACHE: dict[int, object] = {}


def _cached(w: _W, prepare: Callable[[_W], _P]) -> _P:
    key = id(w)
    hit = _CACHE.get(key)
    if hit is None:
        hit = prepare(w)
        _CACHE[key] = hit
        weakref.finalize(w, _CACHE.pop, key, None)
    return hit  # type: ignore[return-value]


def cached_per_tensor(t: Tensor, make: Callable[[], _P]) -> _P:
    """`make()`, computed once while tensor `t` lives (for layouts derived from a weight buffer)."""
    return _cached(t, lambda _: make())


def prepared_nvfp4(w: NVFP4Weight | PackedNVFP4) -> PackedNVFP4:
    """Kernel layout of `w`, repacked on first use and cached for the weight's lifetime."""
    return w if isinstance(w, PackedNVFP4) else _cached(w, prepare_nvfp4)


def prepared_nf4(w: NF4Weight | PackedNF4) -> PackedNF4:
    """Kernel layout of `w`, repacked on first use and cached for the weight's lifetime."""
    return w if isinstance(w, PackedNF4) else _cached(w, prepare_nf4)
