"""The NF4 container a linear holds (`PackedNF4`: bitsandbytes' bytes viewed as int32 words, as
engines store them) and a cache of layouts derived once per weight. See docs/model.md, section
"Fused layout", and docs/kernels.md, section "NF4, the QLoRA baseline"."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from qerl_pipe.formats.nf4 import NF4_CODE, NF4Weight
from qerl_pipe.formats.nvfp4 import FourBitRows


@dataclass(frozen=True)
class PackedNF4(FourBitRows):
    """NF4 weight as the linears hold it (bitsandbytes' kernels read `qweight` as its bytes)."""

    CODES, PER_ITEM = "qweight", 8

    qweight: Tensor  # int32 [N, K/8]: bitsandbytes' bytes [N, K/2] viewed as words
    absmax: Tensor  # float32 [N, K/64]
    code: Tensor  # float32 [16], the NF4 levels (gemv_4bit's lookup table)
    # On the CPU, the weight dequantized once, where the model made one (as `TiledNVFP4.dense`).
    dense: Tensor | None = field(default=None, compare=False, repr=False)


def prepare_nf4(w: NF4Weight) -> PackedNF4:
    """An NF4 weight as the linears hold it (a view of its bytes as int32 words: no repack)."""
    if w.packed.shape[-1] % 4:
        raise ValueError(f"K = {w.in_features} is not a multiple of 8; NF4 linears hold whole words")
    return PackedNF4(qweight=w.packed.contiguous().view(torch.int32), absmax=w.absmax.to(torch.float32).contiguous(),
                     code=torch.tensor(NF4_CODE, dtype=torch.float32, device=w.packed.device))


def unprepare_nf4(p: PackedNF4) -> NF4Weight:
    """Back to the checkpoint container (a view: for the reference path and for tests)."""
    return NF4Weight(p.qweight.view(torch.uint8), p.absmax)


_P = TypeVar("_P")
# id(object) -> what was derived from it; an entry is dropped when its object is garbage-collected.
_CACHE: dict[int, object] = {}


def cached_per_tensor(t: object, make: Callable[[], _P]) -> _P:
    """`make()`, computed once while `t` lives (for layouts derived from a weight or its buffer)."""
    key = id(t)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = make()
        weakref.finalize(t, _CACHE.pop, key, None)
    return hit  # type: ignore[return-value]


def prepared_nf4(w: NF4Weight | PackedNF4) -> PackedNF4:
    """`w` as `PackedNF4`, made on first use and cached for the weight's lifetime."""
    return w if isinstance(w, PackedNF4) else cached_per_tensor(w, lambda: prepare_nf4(w))
