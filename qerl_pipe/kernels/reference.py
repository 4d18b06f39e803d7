"""Plain-torch references: dequantize to the activation dtype, then one matmul.

This is what the kernels must agree with (tests compare to it) and what runs on a CPU. It is also
exactly the QeRL training path the kernels replace: a full bf16 copy of W on every call.
"""

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
