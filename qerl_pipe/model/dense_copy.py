"""CPU only: run a model's 4-bit bases from copies dequantized once (`kernels.linear.dequantized_once`).

On CPU the 4-bit matmul is the plain-torch reference, which rebuilds every weight at every call;
inside `dense_base_copy(model)` the kernels' reference path uses `dequantize(W, model.dtype)` made
once per weight instead (4 bytes per weight in float32, so this is for small models), with the
same numbers. GPUs run the CUDA or Triton kernels and never make the copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from qerl_pipe.kernels.linear import dequantized_once
from qerl_pipe.model.linear import QuantLinear


@contextmanager
def dense_base_copy(model: nn.Module) -> Iterator[int]:
    """Within this scope the model's 4-bit bases on the CPU run from dequantized copies; yields
    their bytes (0 on other devices and for bf16 bases). The copies are dropped on exit."""
    weights = [m.kernel_weight for m in model.modules() if isinstance(m, QuantLinear) and m.base_format != "bf16"]
    with dequantized_once(weights, getattr(model, "dtype", torch.float32)) as nbytes:
        yield nbytes
