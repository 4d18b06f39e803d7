"""NF4 bases handed to bitsandbytes and back without requantizing (formats/bnb_nf4.py), on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from qerl_pipe.errors import QuantizationError
from qerl_pipe.formats.bnb_nf4 import from_params4bit, to_linear4bit, to_params4bit
from qerl_pipe.formats.nf4 import dequantize_nf4, quantize_nf4

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # bitsandbytes' torch._check_is_size


def _weight(n: int = 48, k: int = 192) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05


def test_linear4bit_over_our_bytes_computes_our_reference() -> None:
    q = quantize_nf4(_weight())
    bias = torch.randn(48).bfloat16()
    layer = to_linear4bit(q, bias)
    assert layer.weight.data.data_ptr() == q.packed.data_ptr()  # the same bytes, not a copy
    for rows in (1, 5):
        x = torch.randn(rows, 192).bfloat16()
        ref = x.float() @ dequantize_nf4(q, torch.bfloat16).float().T + bias.float()
        torch.testing.assert_close(layer(x).float(), ref, rtol=1e-2, atol=1e-2)


def test_a_linear4bit_bitsandbytes_quantized_comes_back_as_our_bytes() -> None:
    w = _weight()
    layer = bnb.nn.Linear4bit(192, 48, bias=False, compute_dtype=torch.bfloat16, compress_statistics=False,
                              quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=False, quant_type="nf4", blocksize=64)
    layer = layer.to("cpu")  # bitsandbytes quantizes on the move to a device
    back = from_params4bit(layer.weight)
    ours = quantize_nf4(w)
    assert torch.equal(back.packed, ours.packed) and torch.equal(back.absmax, ours.absmax)
    again = from_params4bit(to_params4bit(ours))
    assert torch.equal(again.packed, ours.packed) and torch.equal(again.absmax, ours.absmax)


def test_what_our_format_is_not_is_refused() -> None:
    w = _weight()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4").to("cpu")
        fp4 = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=False, quant_type="fp4").to("cpu")
    with pytest.raises(QuantizationError, match="double-quantized"):
        from_params4bit(nested, "q_proj")
    with pytest.raises(QuantizationError, match="q_proj is fp4"):
        from_params4bit(fp4, "q_proj")
    with pytest.raises(QuantizationError, match="not quantized yet"):
        from_params4bit(bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4"))


def test_a_transformers_qlora_model_holds_our_nf4_base(tiny_qwen2) -> None:
    """QLoRA as users load it (transformers' BitsAndBytesConfig, nf4, blocksize 64, no double
    quantization) holds, in every Linear4bit, exactly the rows of our fused NF4 base: a PEFT adapter
    trained over our base runs over the same weights there."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from qerl_pipe.model.linear import QuantLinear
    from qerl_pipe.model.load import load_model

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, quantization_config=config, device_map="cpu")
    ours = load_model(tiny_qwen2, "nf4", torch.bfloat16, "cpu")
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # "layers.0.self_attn.q_proj" -> our bytes, absmax
    for name, linear in ours.named_modules():
        if isinstance(linear, QuantLinear):
            base, start = linear.base_weight(), 0
            for proj, size in zip(linear.names, linear.out_sizes):
                parent = name.rsplit(".", 1)[0]
                rows[f"{parent}.{proj}"] = base.packed[start:start + size], base.absmax[start:start + size]
                start += size
    compared = 0
    for name, module in hf.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            theirs = from_params4bit(module.weight, name)
            packed, absmax = rows[name.removeprefix("model.")]
            assert torch.equal(theirs.packed, packed) and torch.equal(theirs.absmax, absmax), name
            compared += 1
    assert compared == len(rows) > 0
