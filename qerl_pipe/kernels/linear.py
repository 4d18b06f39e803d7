"""Public 4-bit linear ops: our CUDA kernels or bitsandbytes on a GPU, else the plain-torch reference (dequantize,
then one matmul: what the kernels must agree with). NVFP4 runs the dispatch table's pick on Hopper, else the
reference; NF4 runs bitsandbytes (as QLoRA does), else the reference; on the CPU a weight's dense copy gives the
reference's numbers bit for bit. See docs/kernels.md, section "Kernels: NVFP4 / NF4 weight-only matmul on Hopper"."""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from qerl_pipe.formats.nf4 import NF4Weight, dequantize_nf4
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4
from qerl_pipe.kernels import bnb_backend
from qerl_pipe.kernels.packing import PackedNF4, cached_per_tensor, prepared_nf4, unprepare_nf4
from qerl_pipe.kernels.tiled import TiledNVFP4, untile_nvfp4


def _rows(t: Tensor, width: int, what: str) -> Tensor:
    if t.shape[-1] != width:
        raise ValueError(f"{what} has last dimension {t.shape[-1]}, the weight needs {width}")
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


NVFP4Any = Union[NVFP4Weight, TiledNVFP4]


def _reference_weight(w: NVFP4Any | NF4Weight | PackedNF4, dtype: torch.dtype) -> Tensor:
    """W `[N, K]` in `dtype` for the reference: the container's own dense copy in that dtype (CPU only), else
    dequantized now from the checkpoint form. A GPU without our CUDA kernels unpacks the tiled layout once per
    weight (cached while its buffer lives: a second copy of the 4-bit weights, 0.56 B/param), not per call."""
    dense = getattr(w, "dense", None)
    if dense is not None and dense.dtype == dtype:
        return dense
    if isinstance(w, (NF4Weight, PackedNF4)):
        return dequantize_nf4(w if isinstance(w, NF4Weight) else unprepare_nf4(w), dtype)
    if isinstance(w, TiledNVFP4):
        w = cached_per_tensor(w.qweight, lambda t=w: untile_nvfp4(t)) if w.qweight.is_cuda else untile_nvfp4(w)
    return dequantize_nvfp4(w, dtype)


def _cuda_kernels(t: Tensor, w: NVFP4Any) -> bool:
    from qerl_pipe.kernels import cuda_ext

    return isinstance(w, TiledNVFP4) and t.dtype == torch.bfloat16 and cuda_ext.available(t.device)


def nvfp4_linear(x: Tensor, w: NVFP4Any, bias: Tensor | None = None,
                 lora: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`x @ W^T (+ bias) (+ u @ B^T)`: `x [..., K]` (bf16) -> `[..., N]` in x's dtype; `lora` =
    (u [rows, R], B [N, R]) is an adapter's expand (u = x @ A^T upstream). The CUDA decode GEMM adds
    bias and expand in its epilogue, other paths after the matmul. Inference only (no autograd)."""
    if x.is_cuda and _cuda_kernels(x, w):
        from qerl_pipe.kernels import cuda_ext, dispatch

        x2 = _rows(x, w.in_features, "x")
        chosen = dispatch.backend(x2.shape[0], w.out_features, w.in_features, x2.device, w.humming is not None)
        if chosen == "qerl" and (lora is None or lora[1].shape[1] % cuda_ext.LORA_RANK_MULTIPLE == 0):
            if x2.data_ptr() % 16 or x2.stride(0) % 8:
                x2 = x2.clone()  # the kernel loads 16-byte pieces of x; a fresh copy is aligned
            u = None if lora is None else lora[0].reshape(x2.shape[0], -1)
            if u is not None and (u.stride(1) != 1 or u.stride(0) % 2 or u.data_ptr() % 4):
                u = u.contiguous()
            out = cuda_ext.gemm(x2, w, bias, lora=None if lora is None else (u, lora[1]))
            return out.reshape(*x.shape[:-1], w.out_features)
        out = w.humming.matmul(x2, chosen) if chosen.startswith("humming") else x2 @ cuda_ext.dequantize(w).T
        out = out.reshape(*x.shape[:-1], w.out_features)
    else:  # the CPU, or a GPU without our CUDA kernels: dequantize + cuBLAS
        out = x @ _reference_weight(w, x.dtype).T
    if bias is not None:
        out = out + bias
    if lora is not None:
        u, b = lora
        out2 = out.reshape(-1, w.out_features)
        out2.addmm_(u.reshape(out2.shape[0], -1), b.t())  # in place: out is this call's own tensor
    return out


def nvfp4_linear_dx(dy: Tensor, w: NVFP4Any) -> Tensor:
    """`dy @ W` (the backward pass's dX): `dy [..., N]` -> `[..., K]` in dy's dtype."""
    if dy.is_cuda and _cuda_kernels(dy, w):
        from qerl_pipe.kernels import cuda_ext

        return dy @ cuda_ext.dequantize(w)
    return dy @ _reference_weight(w, dy.dtype)


def _bnb_runs(a: Tensor) -> bool:
    """Whether bitsandbytes serves this NF4 product (CUDA, bf16/fp16, installed and working; else
    the reference serves it, said once per device by `bnb_backend.available`)."""
    return a.is_cuda and a.dtype in bnb_backend.DTYPES and bnb_backend.available(a.device)


def nf4_linear(x: Tensor, w: NF4Weight | PackedNF4) -> Tensor:
    """`x @ W^T` for an NF4 weight: bitsandbytes as `Linear4bit` runs it, else the reference."""
    if _bnb_runs(x):
        p = prepared_nf4(w)
        return bnb_backend.matmul(_rows(x, p.in_features, "x"), p).reshape(*x.shape[:-1], p.out_features)
    return x @ _reference_weight(w, x.dtype).T


def nf4_linear_dx(dy: Tensor, w: NF4Weight | PackedNF4) -> Tensor:
    """`dy @ W` for an NF4 weight: bitsandbytes as `MatMul4Bit.backward` runs it, else the reference."""
    if _bnb_runs(dy):
        p = prepared_nf4(w)
        return bnb_backend.matmul_dx(_rows(dy, p.out_features, "dy"), p).reshape(*dy.shape[:-1], p.in_features)
    return dy @ _reference_weight(w, dy.dtype)
