"""CPU only: run 4-bit bases from a dequantized copy instead of dequantizing on every call.

On CPU the 4-bit matmul is the plain-torch reference, `x @ dequantize(W, x.dtype)^T`, which
rebuilds every weight at every call: for SmolLM2-135M that is 0.7 s per forward pass against
0.07 s of matmuls at decode batch sizes. Inside `dense_base_copy(model)` each 4-bit QuantLinear
keeps `dequantize(W, model.dtype)` instead (4 bytes per weight in float32, so this is for small
models), and the results are the same numbers the reference computes. GPUs run the CUDA or
Triton kernels and never use this.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from qerl_pipe.formats.nf4 import dequantize_nf4, NF4Weight
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4
from qerl_pipe.model.linear import QuantLinear


def _dequantized(module: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    base = module.base_weight()
    return dequantize_nf4(base, dtype) if isinstance(base, NF4Weight) else dequantize_nvfp4(base, dtype)


@contextmanager
def dense_base_copy(model: nn.Module) -> Iterator[int]:
    """Within this scope, 4-bit bases on the CPU run from a dequantized copy; yields its bytes.

    No-op (0 bytes) on other devices and for bf16 bases. The copies are dropped on exit.
    """
    linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.base_format != "bf16"
               and m.qweight.device.type == "cpu"]
    dtype = getattr(model, "dtype", torch.float32)
    nbytes = 0
    try:
        with torch.no_grad():
            for m in linears:
                m.dense_base = _dequantized(m, dtype)
                nbytes += m.dense_base.numel() * m.dense_base.element_size()
        yield nbytes
    finally:
        for m in linears:
            m.dense_base = None
