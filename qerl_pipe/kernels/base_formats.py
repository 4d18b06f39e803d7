"""The base formats: one `BaseFormat` entry per format a frozen base can be held in ("bf16", "nvfp4",
"nf4"), and everything the code decides by format. Code asks the entry, never compares the name:
a new format is one new entry, a new backend one new `Kernels` value; `base_format(name)` turns a
name into its entry and refuses an unknown one. See docs/kernels.md, section "Base formats"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qerl_pipe.errors import QerlError
from qerl_pipe.formats.nf4 import NF4_BLOCK, NF4Weight, dequantize_nf4, quantize_nf4
from qerl_pipe.formats.nvfp4 import BLOCK_SIZE, NVFP4Weight, dequantize_nvfp4, quantize_nvfp4_in_row_chunks
from qerl_pipe.kernels.linear import nf4_linear, nf4_linear_dx, nvfp4_linear, nvfp4_linear_dx
from qerl_pipe.kernels.packing import PackedNF4, prepare_nf4, unprepare_nf4
from qerl_pipe.kernels.tiled import TiledNVFP4, tile_nvfp4, tiled_shapes, untile_nvfp4


class UnknownBaseFormat(QerlError, ValueError):
    """A base format name no entry has (a ValueError too: callers of the loaders catch that)."""


@dataclass(frozen=True)
class Kernels:
    """The ops that serve a 4-bit base's linears; each picks our CUDA kernels, bitsandbytes or the
    torch reference by device (`kernels.linear`)."""

    forward: Callable[..., Tensor]  # (x [.., K], w) -> x @ W^T
    dx: Callable[[Tensor, Any], Tensor]  # (dy [.., N], w) -> dy @ W, the backward's dX
    # forward(x, w, bias, lora) adds the bias and a LoRA expand itself (in the CUDA GEMM's
    # epilogue): inference passes them in instead of adding them after.
    fused_epilogue: bool = False


@dataclass(frozen=True)
class BaseFormat:
    """One base format. `dense`: the linears hold the model's own dtype and run a plain matmul;
    otherwise `kernels` serve a quantized layout."""

    name: str
    # The linear's buffer names, in the kernel container's field order (`QuantLinear` registers
    # them; the engine artifact stores them under these names).
    buffers: tuple[str, ...]
    empty_buffers: Callable[[int, int, torch.dtype], dict[str, Tensor]]  # (N, K, dtype) -> meta buffers
    container: type  # what `QuantLinear.kernel_weight` is: the kernels' layout (Tensor when dense)
    # (buffers, N, K, humming copy, CPU dense copy) -> the container the kernels take.
    make_container: Callable[..., Any]
    # (weight [N, K] of the model, its name, the model dtype) -> the checkpoint form of this base.
    quantize: Callable[[Tensor, str, torch.dtype], Any]
    # A checkpoint form -> the container (anything else is returned as it is).
    to_container: Callable[[Any], Any]
    to_checkpoint: Callable[[Any], Any]  # the container -> the checkpoint form (unpacks: not per step)
    dequantize: Callable[[Any, torch.dtype], Tensor]  # the checkpoint form -> a dense tensor
    # Stored bytes per base weight (codes and block scales); None: the model dtype's (dense).
    bytes_per_weight: float | None
    bytes_per_linear: int  # and per linear: an NVFP4 global scale, NF4's table of 16 levels
    kernels: Kernels | None = None
    # build-engine builds it from the quantize stage's NVFP4 checkpoint, not the original model.
    from_quantize_artifact: bool = False
    # An NVFP4 checkpoint loads as this base (as it is, or dequantized); False: it needs the
    # original 16-bit model (re-rounding 4-bit codes would compound their error).
    loads_nvfp4_checkpoint: bool = True
    # On Hopper its forward goes through `kernels.dispatch` (our CUDA GEMM, humming-kernels,
    # dequantize + cuBLAS): build-engine measures a dispatch table, and the rows humming serves
    # need a copy of the base in humming's layout (`model.kernel_copies`).
    hopper_dispatch: bool = False
    # The version of the bytes `buffers` hold, stored with an engine's weights and part of the
    # engine's artifact id from 2 on: a change of layout or rounding bumps it, so an engine of the
    # old bytes is rebuilt, or refused with its fix, never misread.
    layout_version: int = 1

    @property
    def dense(self) -> bool:
        return self.kernels is None

    def weight_bytes(self, element_bytes: int) -> float:
        """Stored bytes per base weight under a model dtype of `element_bytes`."""
        return float(element_bytes) if self.bytes_per_weight is None else self.bytes_per_weight

    def tensors(self, container: Any) -> dict[str, Tensor]:
        """The container's buffers by name (what `make_container` takes)."""
        if self.dense:
            return {self.buffers[0]: container}
        return {key: getattr(container, key) for key in self.buffers}

    def dense_copy(self, container: Any, dtype: torch.dtype) -> Tensor:
        """The container's weight as a dense `dtype` tensor (the CPU copy that runs the reference
        matmuls once dequantized: `model.dense_copy`)."""
        return self.dequantize(self.to_checkpoint(container), dtype)

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple:
        # By name: a pickled or deep-copied model refers to the one registered entry.
        return base_format, (self.name,)


def _chunk_elements(w: Tensor) -> int:
    """Elements quantized at once. Each chunk costs a few host syncs (finiteness and scale checks),
    which dominate on a GPU at 4M elements (a 72B build is ~17k chunks); 16M elements keep the GPU
    busy and the fp32 temporaries near 0.5 GB. On the CPU the smaller chunk bounds host memory."""
    return 1 << 24 if w.is_cuda else 1 << 22


def _meta(shape: Any, dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


BF16 = BaseFormat(
    name="bf16", buffers=("weight",), empty_buffers=lambda n, k, dtype: {"weight": _meta((n, k), dtype)},
    container=Tensor, make_container=lambda buffers, n, k, humming=None, dense=None: buffers["weight"],
    quantize=lambda w, name, dtype: w.to(dtype), to_container=lambda base: base, to_checkpoint=lambda w: w,
    dequantize=lambda w, dtype: w.to(dtype), bytes_per_weight=None, bytes_per_linear=0)


def _nvfp4_empty(n: int, k: int, dtype: torch.dtype) -> dict[str, Tensor]:
    if k % BLOCK_SIZE:
        raise ValueError(f"NVFP4 needs in_features divisible by {BLOCK_SIZE}, got {k}")
    words, scales = tiled_shapes(n, k)
    return {"qweight": _meta(words, torch.int32), "scales": _meta(scales, torch.uint8),
            "global_scale": _meta(1, torch.float32)}


def _nvfp4_quantize(w: Tensor, name: str, dtype: torch.dtype) -> NVFP4Weight:
    # One tensor for the whole fused group: one amax, so q/k/v (gate/up) share a global scale.
    # In row chunks: a whole 32B gate_up at once would need ~5 GB of fp32 temporaries.
    return quantize_nvfp4_in_row_chunks(w, name=name, chunk_elements=_chunk_elements(w))


NVFP4 = BaseFormat(
    name="nvfp4", buffers=("qweight", "scales", "global_scale"), empty_buffers=_nvfp4_empty, container=TiledNVFP4,
    make_container=lambda b, n, k, humming=None, dense=None: TiledNVFP4(
        b["qweight"], b["scales"], b["global_scale"], n, k, humming=humming, dense=dense),
    quantize=_nvfp4_quantize, to_container=lambda base: tile_nvfp4(base) if isinstance(base, NVFP4Weight) else base,
    to_checkpoint=untile_nvfp4, dequantize=dequantize_nvfp4,
    bytes_per_weight=0.5 + 1 / BLOCK_SIZE,  # 4-bit codes and an fp8 scale per 16
    bytes_per_linear=4, kernels=Kernels(nvfp4_linear, nvfp4_linear_dx, fused_epilogue=True),
    from_quantize_artifact=True, hopper_dispatch=True)


def _nf4_empty(n: int, k: int, dtype: torch.dtype) -> dict[str, Tensor]:
    return {"qweight": _meta((n, k // 8), torch.int32), "absmax": _meta((n, k // NF4_BLOCK), torch.float32),
            "code": _meta(16, torch.float32)}


def _nf4_quantize(w: Tensor, name: str, dtype: torch.dtype) -> NF4Weight:
    rows = max(1, _chunk_elements(w) // w.shape[1])  # row chunks, as NVFP4's
    parts = [quantize_nf4(chunk, name=name) for chunk in w.split(rows)]
    return NF4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.absmax for p in parts]))


NF4 = BaseFormat(
    name="nf4", buffers=("qweight", "absmax", "code"), empty_buffers=_nf4_empty, container=PackedNF4,
    make_container=lambda b, n, k, humming=None, dense=None: PackedNF4(
        b["qweight"], b["absmax"], b["code"], dense=dense),
    quantize=_nf4_quantize, to_container=lambda base: prepare_nf4(base) if isinstance(base, NF4Weight) else base,
    to_checkpoint=unprepare_nf4, dequantize=dequantize_nf4,
    bytes_per_weight=0.5 + 4 / NF4_BLOCK,  # 4-bit codes and an fp32 absmax per 64
    bytes_per_linear=16 * 4, kernels=Kernels(nf4_linear, nf4_linear_dx), loads_nvfp4_checkpoint=False,
    layout_version=2)  # 2: bitsandbytes' bytes, nibble order and rounding (1: our own nibble order in int32 words)


FORMATS: dict[str, BaseFormat] = {f.name: f for f in (BF16, NVFP4, NF4)}
NAMES: tuple[str, ...] = tuple(FORMATS)


def base_format(name: str | BaseFormat) -> BaseFormat:
    """The entry of base format `name` (an entry is returned as it is); raises UnknownBaseFormat."""
    if isinstance(name, BaseFormat):
        return name
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise UnknownBaseFormat(f"unknown base format {name!r}; choose one of {', '.join(NAMES)}")
    return fmt
