"""NF4 weights to and from bitsandbytes' objects (`Params4bit`, `Linear4bit`), without requantizing:
our NF4 bytes are bitsandbytes', handed to a `QuantState` as they are. Needs the `qlora` extra;
imported only by whoever calls these. See docs/formats.md, section "NF4 (QLoRA baseline)"."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qerl_pipe.errors import QuantizationError
from qerl_pipe.formats.nf4 import NF4_BLOCK, NF4Weight


def _bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError as exc:
        raise QuantizationError(
            f"bitsandbytes is not installed ({exc}); install the extra: pip install 'qerl-pipe[qlora]'") from None
    return bitsandbytes


def quant_state(w: NF4Weight, dtype: torch.dtype = torch.bfloat16) -> Any:
    """bitsandbytes' `QuantState` of `w` (flat absmax, its nf4 table, blocksize 64, no nesting);
    `dtype` is what `dequantize_4bit` returns and `Linear4bit` computes in."""
    F = _bnb().functional
    return F.QuantState(absmax=w.absmax.reshape(-1), shape=torch.Size((w.out_features, w.in_features)),
                        code=F.get_4bit_type("nf4", device=w.packed.device), blocksize=NF4_BLOCK,
                        quant_type="nf4", dtype=dtype)


def to_params4bit(w: NF4Weight, dtype: torch.dtype = torch.bfloat16) -> Any:
    """`w` as a quantized `bnb.nn.Params4bit` over the same bytes (shape `[N*K/2, 1]`, as bitsandbytes holds it)."""
    bnb = _bnb()
    return bnb.nn.Params4bit(w.packed.reshape(-1, 1), requires_grad=False, quant_state=quant_state(w, dtype),
                             blocksize=NF4_BLOCK, compress_statistics=False, quant_type="nf4", bnb_quantized=True)


def to_linear4bit(w: NF4Weight, bias: Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A `bnb.nn.Linear4bit` computing `x @ W^T (+ bias)` in `dtype` over `w`'s bytes."""
    bnb = _bnb()
    layer = bnb.nn.Linear4bit(w.in_features, w.out_features, bias=bias is not None, compute_dtype=dtype,
                              compress_statistics=False, quant_type="nf4", device=w.packed.device)
    layer.weight = to_params4bit(w, dtype)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return layer


def from_params4bit(p: Any, name: str = "weight") -> NF4Weight:
    """The `NF4Weight` a quantized `Params4bit` holds (the same bytes); refuses what our format is not."""
    state = getattr(p, "quant_state", None)
    if state is None or not getattr(p, "bnb_quantized", False):
        raise QuantizationError(f"{name} is not quantized yet (move its Linear4bit to a device first)")
    if state.quant_type != "nf4" or state.blocksize != NF4_BLOCK or state.nested:
        raise QuantizationError(
            f"{name} is {state.quant_type}, blocksize {state.blocksize}{', double-quantized' if state.nested else ''}; "
            f"an NF4 base is nf4 with blocksize {NF4_BLOCK} and no double quantization")
    n, k = state.shape
    if k % NF4_BLOCK:
        raise QuantizationError(f"{name} has {k} input features; an NF4 base needs a multiple of {NF4_BLOCK}")
    packed = p.data.view(torch.uint8).reshape(n, k // 2)
    return NF4Weight(packed, state.absmax.float().reshape(n, k // NF4_BLOCK))
