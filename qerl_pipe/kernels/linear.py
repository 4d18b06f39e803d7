"""Public 4-bit linear ops: CUDA or Triton kernels on a GPU, the plain-torch references elsewhere.

NVFP4 runs what the dispatch table picks on Hopper, else Triton on a copy repacked once; NF4 what
the table's NF4 rows pick; on the CPU a weight's dense copy gives the reference's numbers bit for
bit. See docs/kernels.md, section "Kernels: NVFP4 / NF4 weight-only matmul on Hopper"."""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from qerl_pipe.formats.nf4 import NF4Weight
from qerl_pipe.formats.nvfp4 import NVFP4Weight
from qerl_pipe.kernels import reference
from qerl_pipe.kernels.configs import KernelConfig, get_config
from qerl_pipe.kernels.packing import (
    PackedNF4,
    PackedNVFP4,
    cached_per_tensor,
    prepare_nvfp4,
    prepared_nf4,
    prepared_nvfp4,
    unprepare_nf4,
    unprepare_nvfp4,
)
from qerl_pipe.kernels.tiled import TiledNVFP4, untile_nvfp4

def _rows(t: Tensor, width: int, what: str) -> Tensor:
    if t.shape[-1] != width:
        raise ValueError(f"{what} has last dimension {t.shape[-1]}, the weight needs {width}")
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _run(op: str, fmt: str, a: Tensor, packed: PackedNVFP4 | PackedNF4) -> Tensor:
    # Imported here so that CPU-only installs never need Triton.
    from qerl_pipe.kernels.triton_matmul import launch_dx, launch_forward

    n, k = packed.out_features, packed.in_features
    if op == "fwd":
        a2 = _rows(a, k, "x")
        out = launch_forward(a2, packed, get_config(op, fmt, a2.shape[0], n, k))
        return out.reshape(*a.shape[:-1], n)
    a2 = _rows(a, n, "dy")
    out = launch_dx(a2, packed, get_config(op, fmt, a2.shape[0], n, k))
    return out.reshape(*a.shape[:-1], k)


NVFP4Any = Union[NVFP4Weight, PackedNVFP4, TiledNVFP4]


def _checkpoint_form(w: NVFP4Any) -> NVFP4Weight:
    if isinstance(w, TiledNVFP4):
        return untile_nvfp4(w)
    return w if isinstance(w, NVFP4Weight) else unprepare_nvfp4(w)


def _triton_layout(w: NVFP4Weight | PackedNVFP4 | TiledNVFP4) -> PackedNVFP4:
    if isinstance(w, TiledNVFP4):
        return cached_per_tensor(w.qweight, lambda: prepare_nvfp4(untile_nvfp4(w)))
    return prepared_nvfp4(w)


def _dense_copy(w: NVFP4Any | NF4Weight | PackedNF4, dtype: torch.dtype) -> Tensor | None:
    """The weight's own dense copy in `dtype`, if its container carries one (CPU only)."""
    dense = getattr(w, "dense", None)
    return dense if dense is not None and dense.dtype == dtype else None


def _cuda_kernels(t: Tensor, w: NVFP4Any) -> bool:
    from qerl_pipe.kernels import cuda_ext

    return isinstance(w, TiledNVFP4) and t.dtype == torch.bfloat16 and cuda_ext.available(t.device)


def nvfp4_linear(x: Tensor, w: NVFP4Any, bias: Tensor | None = None,
                 lora: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`x @ W^T (+ bias) (+ u @ B^T)`: `x [..., K]` (bf16) -> `[..., N]` in x's dtype; `lora` =
    (u [rows, R], B [N, R]) is an adapter's expand (u = x @ A^T upstream). The CUDA decode GEMM adds
    bias and expand in its epilogue, other paths after the matmul. Inference only (no autograd)."""
    if not x.is_cuda:
        dense = _dense_copy(w, x.dtype)
        out = x @ dense.T if dense is not None else reference.nvfp4_linear_ref(x, _checkpoint_form(w))
    elif _cuda_kernels(x, w):
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
        if chosen.startswith("humming"):
            out = w.humming.matmul(x2, chosen)
        else:
            out = x2 @ cuda_ext.dequantize(w).T
        out = out.reshape(*x.shape[:-1], w.out_features)
    else:
        out = _run("fwd", "nvfp4", x, _triton_layout(w))
    if bias is not None:
        out = out + bias
    if lora is not None:
        u, b = lora
        out2 = out.reshape(-1, w.out_features)
        out2.addmm_(u.reshape(out2.shape[0], -1), b.t())  # in place: out is this call's own tensor
    return out


def nvfp4_linear_dx(dy: Tensor, w: NVFP4Any) -> Tensor:
    """`dy @ W` (the backward pass's dX): `dy [..., N]` -> `[..., K]` in dy's dtype."""
    if not dy.is_cuda:
        dense = _dense_copy(w, dy.dtype)
        return dy @ dense if dense is not None else reference.nvfp4_linear_dx_ref(dy, _checkpoint_form(w))
    if _cuda_kernels(dy, w):
        from qerl_pipe.kernels import cuda_ext

        return dy @ cuda_ext.dequantize(w)
    return _run("dx", "nvfp4", dy, _triton_layout(w))


# Our decode pass into bf16, then cuBLAS: the NF4 `dequant` backend (the Triton table's own
# `dequant` config at large M; the block sizes only shape the decode pass).
NF4_DEQUANT_CONFIG = KernelConfig("dequant", 1, 32, 256, 1, 4, 1)


def _nf4_cuda(op: str, a: Tensor, w: PackedNF4) -> Tensor:
    """`a @ W^T` (op `fwd`) or `a @ W` (`dx`) on the GPU, by the dispatch's NF4 row."""
    from qerl_pipe.kernels import bnb_backend, dispatch
    from qerl_pipe.kernels.triton_matmul import launch_dx, launch_forward

    n, k = w.out_features, w.in_features
    width, out_width = (k, n) if op == "fwd" else (n, k)
    a2 = _rows(a, width, "x" if op == "fwd" else "dy")
    has_bnb = a2.dtype in bnb_backend.DTYPES and bnb_backend.available(a2.device)
    chosen = dispatch.nf4_backend("nf4" if op == "fwd" else "nf4-dx", a2.shape[0], n, k, a2.device, has_bnb)
    if chosen == "bnb":
        out = bnb_backend.matmul(a2, w) if op == "fwd" else bnb_backend.matmul_dx(a2, w)
    elif chosen == "dequant":
        out = (launch_forward if op == "fwd" else launch_dx)(a2, w, NF4_DEQUANT_CONFIG)
    else:
        return _run(op, "nf4", a, w)
    return out.reshape(*a.shape[:-1], out_width)


def nf4_linear(x: Tensor, w: NF4Weight | PackedNF4) -> Tensor:
    """`x @ W^T` for an NF4 weight."""
    if x.is_cuda:
        return _nf4_cuda("fwd", x, prepared_nf4(w))
    dense = _dense_copy(w, x.dtype)
    if dense is not None:
        return x @ dense.T
    return reference.nf4_linear_ref(x, w if isinstance(w, NF4Weight) else unprepare_nf4(w))


def nf4_linear_dx(dy: Tensor, w: NF4Weight | PackedNF4) -> Tensor:
    """`dy @ W` for an NF4 weight."""
    if dy.is_cuda:
        return _nf4_cuda("dx", dy, prepared_nf4(w))
    dense = _dense_copy(w, dy.dtype)
    if dense is not None:
        return dy @ dense
    return reference.nf4_linear_dx_ref(dy, w if isinstance(w, NF4Weight) else unprepare_nf4(w))
