"""Public 4-bit linear ops: Triton kernels on CUDA, the plain-torch references elsewhere."""

from __future__ import annotations

from torch import Tensor

from qerl_pipe.formats.nf4 import NF4Weight
from qerl_pipe.formats.nvfp4 import NVFP4Weight
from qerl_pipe.kernels import reference
from qerl_pipe.kernels.configs import get_config
from qerl_pipe.kernels.packing import (
    PackedNF4,
    PackedNVFP4,
    prepared_nf4,
    prepared_nvfp4,
    unprepare_nf4,
    unprepare_nvfp4,
)


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
        out = launch_forward(a2, fmt, packed, get_config(op, fmt, a2.shape[0], n, k))
        return out.reshape(*a.shape[:-1], n)
    a2 = _rows(a, n, "dy")
    out = launch_dx(a2, fmt, packed, get_config(op, fmt, a2.shape[0], n, k))
    return out.reshape(*a.shape[:-1], k)


def nvfp4_linear(x: Tensor, w: NVFP4Weight | PackedNVFP4) -> Tensor:
    """`x @ W^T`: `x [..., K]` (bf16) -> `[..., N]` in x's dtype."""
    if x.is_cuda:
        return _run("fwd", "nvfp4", x, prepared_nvfp4(w))
    return reference.nvfp4_linear_ref(x, w if isinstance(w, NVFP4Weight) else unprepare_nvfp4(w))


def nvfp4_linear_dx(dy: Tensor, w: NVFP4Weight | PackedNVFP4) -> Tensor:
    """`dy @ W` (the backward pass's dX): `dy [..., N]` -> `[..., K]` in dy's dtype."""
    if dy.is_cuda:
        return _run("dx", "nvfp4", dy, prepared_nvfp4(w))
    return reference.nvfp4_linear_dx_ref(dy, w if isinstance(w, NVFP4Weight) else unprepare_nvfp4(w))


def nf4_linear(x: Tensor, w: NF4Weight | PackedNF4) -> Tensor:
    """`x @ W^T` for an NF4 weight."""
    if x.is_cuda:
        return _run("fwd", "nf4", x, prepared_nf4(w))
    return reference.nf4_linear_ref(x, w if isinstance(w, NF4Weight) else unprepare_nf4(w))


def nf4_linear_dx(dy: Tensor, w: NF4Weight | PackedNF4) -> Tensor:
    """`dy @ W` for an NF4 weight."""
    if dy.is_cuda:
        return _run("dx", "nf4", dy, prepared_nf4(w))
    return reference.nf4_linear_dx_ref(dy, w if isinstance(w, NF4Weight) else unprepare_nf4(w))
