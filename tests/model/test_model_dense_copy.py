"""The CPU dense copy (`model.dense_copy.dense_base_copy`) gives the numbers of the plain-torch
reference bit for bit, as docs/training.md says: the forward, the gradients of the LoRA factors
and of the input, for NVFP4 and NF4 bases; each copy belongs to its linear and is gone after the
scope (or with the base it was made from)."""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.model.dense_copy import dense_base_copy
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.lora import LoraSpec, apply_lora, lora_parameters
from tests.conftest import TINY_DIMS

CONFIG = {"model_type": "llama", "vocab_size": 320, **TINY_DIMS}


def _forward_backward(model, ids):
    for p in lora_parameters(model):
        p.grad = None
    logits = model.logits(ids)
    logits.float().pow(2).mean().backward()
    return logits.detach(), [p.grad.clone() for p in lora_parameters(model)]


@pytest.mark.parametrize("base_format", ["nvfp4", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dense_copy_gives_the_reference_numbers_bit_for_bit(base_format, dtype, monkeypatch):
    model = init_random_model(CONFIG, base_format, dtype=dtype, seed=5)
    apply_lora(model, LoraSpec(rank=4, alpha=8.0), seed=1)
    with torch.no_grad():  # nonzero B, so LoRA's gradients reach A through the base's output
        for p in lora_parameters(model):
            p.add_(0.01)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    reference = _forward_backward(model, ids)
    from qerl_pipe.kernels import linear as linear_ops

    with dense_base_copy(model) as nbytes, monkeypatch.context() as patch:
        assert nbytes > 0
        for name in ("dequantize_nvfp4", "dequantize_nf4"):
            # The copies serve every matmul of the scope: the per-call dequantizing path never runs.
            patch.setattr(linear_ops, name, lambda *a, name=name: pytest.fail(f"{name} ran inside the scope"))
        copied = _forward_backward(model, ids)
    assert torch.equal(reference[0], copied[0])
    assert all(torch.equal(a, b) for a, b in zip(reference[1], copied[1]))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.dense_copy is None for m in linears)  # the copies are gone after the scope


def test_the_copy_belongs_to_its_linear_and_goes_with_its_base():
    model = init_random_model(CONFIG, "nf4", dtype=torch.float32, seed=5)
    linear = next(m for m in model.modules() if isinstance(m, QuantLinear))
    with dense_base_copy(model) as outer:
        copy = linear.dense_copy
        assert copy is not None and linear.kernel_weight.dense is copy
        with dense_base_copy(model) as inner:  # an inner scope uses the copies it finds
            assert inner == 0 and linear.dense_copy is copy
        assert linear.dense_copy is copy  # and leaves them to the scope that made them
        linear.set_base(linear.base_weight())  # a new base: the old copy would be wrong
        assert linear.dense_copy is None and outer > 0
    assert all(m.dense_copy is None for m in model.modules() if isinstance(m, QuantLinear))
