"""bitsandbytes' NF4 kernels, what our NF4 bases run on a GPU: the QLoRA baseline as its users run it. Its
kernels read our buffers with no copy (`PackedNF4.qweight` is a view of bitsandbytes' bytes) and run what
`bnb.nn.Linear4bit` runs; without bitsandbytes (or with `QERL_BNB=0`) the plain-torch reference serves NF4
(said once). See docs/kernels.md, section "NF4, the QLoRA baseline"."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from qerl_pipe.formats.nf4 import NF4_BLOCK
from qerl_pipe.kernels.optional_backend import availability
from qerl_pipe.kernels.packing import PackedNF4

# Activation dtypes bitsandbytes' 4-bit kernels take.
DTYPES = (torch.bfloat16, torch.float16)


def _probe(device: torch.device) -> None:
    """One tiny product through both kernels, so a library that loads but cannot run here (no
    build for this CUDA, an old driver) is found now, not inside a CUDA graph capture."""
    w = PackedNF4(torch.zeros(8, NF4_BLOCK // 8, dtype=torch.int32, device=device),
                  torch.ones(8, 1, device=device), torch.zeros(16, device=device))
    for rows in (1, 2):
        matmul(torch.zeros(rows, NF4_BLOCK, dtype=torch.bfloat16, device=device), w)
    torch.cuda.synchronize(device)


def why_unavailable(device: torch.device | str) -> str | None:
    """Why bitsandbytes cannot serve NF4 on `device` (None when it can)."""
    device = torch.device(device)
    if os.environ.get("QERL_BNB", "1") == "0":
        return "QERL_BNB=0"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    try:
        import bitsandbytes  # noqa: F401  (loads its CUDA library: only here, never at start-up)
    except Exception as exc:
        return f"bitsandbytes does not import ({type(exc).__name__}: {exc}); pip install 'qerl-pipe[qlora]'"
    try:
        _probe(device)
    except Exception as exc:
        return f"bitsandbytes' CUDA kernels do not run here ({type(exc).__name__}: {str(exc)[:200]})"
    return None


# Whether bitsandbytes' NF4 kernels run on a device (said once, in one line, when not).
available = availability(why_unavailable, "bitsandbytes (NF4)",
                         "NF4 runs the plain-torch reference (dequantize + matmul), slower than bitsandbytes")


def _bytes(w: PackedNF4) -> Tensor:
    # [N*K/2, 1] uint8: the shape bitsandbytes' Params4bit holds (its kernels read only the pointer).
    return w.qweight.view(torch.uint8).reshape(-1, 1)


def dequantize(w: PackedNF4, dtype: torch.dtype) -> Tensor:
    """bitsandbytes' `dequantize_4bit` of `w`: a new `[N, K]` tensor in `dtype`. Not its `.out`
    overload: it compares `out.shape` with the dispatcher's list, which a `torch.Size` never equals
    (every call fails on torch 2.11, docs/kernels.md); the allocator reuses the last layer's buffer."""
    return torch.ops.bitsandbytes.dequantize_4bit.default(_bytes(w), w.absmax.reshape(-1), NF4_BLOCK, "nf4",
                                                          [w.out_features, w.in_features], dtype)


def matmul(x2: Tensor, w: PackedNF4) -> Tensor:
    """`x2 [M, K] @ W^T` (in `DTYPES`) as `Linear4bit` computes it: `gemv_4bit` at one row, else dequantize + cuBLAS."""
    if x2.shape[0] == 1:
        return torch.ops.bitsandbytes.gemv_4bit.default(x2, _bytes(w), [w.out_features, w.in_features],
                                                        w.absmax.reshape(-1), w.code, NF4_BLOCK)
    return x2 @ dequantize(w, x2.dtype).T


def matmul_dx(dy2: Tensor, w: PackedNF4) -> Tensor:
    """`dy2 [M, N] @ W` (the backward's dX) as `MatMul4Bit.backward` computes it."""
    return dy2 @ dequantize(w, dy2.dtype)
