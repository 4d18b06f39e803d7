"""CPU only: run a model's 4-bit bases from copies dequantized once (`dense_base_copy`), with the
same numbers as the reference path. Each copy belongs to its `QuantLinear`: a new base drops it,
and so does the linear's end. GPUs never make the copies.
See docs/model.md, section "The model (`qerl_pipe/model/`)" (the table of files)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from qerl_pipe.model.linear import QuantLinear


@contextmanager
def dense_base_copy(model: nn.Module) -> Iterator[int]:
    """Within this scope the model's 4-bit bases on the CPU run from dequantized copies; yields
    their bytes (0 on other devices and for bf16 bases). The copies this scope made are dropped
    on exit (those of an enclosing scope are used and kept)."""
    dtype = getattr(model, "dtype", torch.float32)
    made: list[QuantLinear] = []
    nbytes = 0
    try:
        with torch.no_grad():
            for m in model.modules():
                if (not isinstance(m, QuantLinear) or m.fmt.dense or m.dense_copy is not None
                        or m.base_device().type != "cpu"):
                    continue
                m.dense_copy = m.fmt.dense_copy(m.kernel_weight, dtype)
                made.append(m)
                nbytes += m.dense_copy.numel() * m.dense_copy.element_size()
        yield nbytes
    finally:
        for m in made:
            m.dense_copy = None
