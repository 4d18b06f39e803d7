"""Plain-torch references: dequantize to the activation dtype, then one matmul. What the kernels must agree
with (the tests), what runs on a CPU, and the QeRL training path the kernels replace (a bf16 W every call)."""

from __future__ import annotations

from torch import Tensor

from qerl_pipe.formats.nf4 import NF4Weight, dequantize_nf4
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4


def nvfp4_linear_ref(x: Tensor, w: NVFP4Weight) -> Tensor:
    """`x @ W^T` for `x [..., K]`: `[..., N]` in x's dtype."""
    return x @ dequantize_nvfp4(w, x.dtype).T


def nvfp4_linear_dx_ref(dy: Tensor, w: NVFP4Weight) -> Tensor:
    """`dy @ W` for `dy [..., N]` (the backward pass's dX): `[..., K]` in dy's dtype."""
    return dy @ dequantize_nvfp4(w, dy.dtype)


def nf4_linear_ref(x: Tensor, w: NF4Weight) -> Tensor:
    """`x @ W^T` for an NF4 weight."""
    return x @ dequantize_nf4(w, x.dtype).T


def nf4_linear_dx_ref(dy: Tensor, w: NF4Weight) -> Tensor:
    """`dy @ W` for an NF4 weight."""
    return dy @ dequantize_nf4(w, dy.dtype)
