"""LoRA over a frozen bf16/NVFP4/NF4 base: outputs, gradients against plain torch and PEFT, names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.formats.nf4 import dequantize_nf4, quantize_nf4
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.lora import (
    LoraSpec, apply_lora, lora_disabled, lora_parameters, lora_state_dict,
)
from qerl_pipe.model.norm import RMSNorm

CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def _model(base_format: str, lora: LoraSpec | None = None, seed: int = 0):
    model = init_random_model(CONFIG, base_format, seed=seed, dtype=torch.float32, lora=lora)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.normal_(1.0, 0.2)
    return model


def _randomize_b(model, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, QuantLinear):
                for b in m.lora_B.values():
                    b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def _ids(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("base_format", ["bf16", "nvfp4"])
def test_fresh_lora_changes_nothing_and_trained_lora_does(base_format):
    model = _model(base_format)
    ids = _ids()
    with torch.no_grad():
        before = model.logits(ids)
        apply_lora(model, LoraSpec(rank=4, alpha=8))
        assert torch.equal(model.logits(ids), before)
        _randomize_b(model)
        after = model.logits(ids)
        assert (after - before).abs().max() > 1e-3
        with lora_disabled(model):
            assert torch.equal(model.logits(ids), before)
        assert torch.equal(model.logits(ids), after)


@pytest.mark.parametrize("base_format", ["bf16", "nvfp4", "nf4"])
def test_fused_linear_gradients_match_plain_torch(base_format):
    torch.manual_seed(0)
    sizes, names, k = (64, 32, 32), ("q_proj", "k_proj", "v_proj"), 128
    w = 0.1 * torch.randn(sum(sizes), k)
    base = {"bf16": w, "nvfp4": quantize_nvfp4(w), "nf4": quantize_nf4(w)}[base_format]
    w_ref = {"bf16": w, "nvfp4": dequantize_nvfp4(base) if base_format == "nvfp4" else None,
             "nf4": dequantize_nf4(base) if base_format == "nf4" else None}[base_format]
    layer = QuantLinear(k, sizes, names, base_format, torch.float32, "cpu", bias=True)
    layer.set_base(base)
    layer.bias.normal_()
    layer.add_lora(["q_proj", "v_proj"], rank=4, alpha=16)  # k_proj deliberately untargeted
    with torch.no_grad():
        for b in layer.lora_B.values():
            b.normal_()
    x = torch.randn(3, 5, k, requires_grad=True)
    grad_out = torch.randn(3, 5, sum(sizes))
    (layer(x) * grad_out).sum().backward()

    # Reference: dense dequantized weight, each projection's LoRA written out, plain autograd.
    a = {n: p.detach().clone().requires_grad_() for n, p in layer.lora_A.items()}
    b = {n: p.detach().clone().requires_grad_() for n, p in layer.lora_B.items()}
    x_ref = x.detach().clone().requires_grad_()
    outs = list((x_ref @ w_ref.t() + layer.bias).split(sizes, dim=-1))
    for i, n in enumerate(names):
        if n in a:
            outs[i] = outs[i] + (x_ref @ a[n].t() @ b[n].t()) * (16 / 4)
    (torch.cat(outs, -1) * grad_out).sum().backward()

    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    for n in a:
        torch.testing.assert_close(layer.lora_A[n].grad, a[n].grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.lora_B[n].grad, b[n].grad, atol=1e-4, rtol=1e-4)
    assert "k_proj" not in layer.lora_A
    assert all(t.grad is None and not t.requires_grad for t in layer.buffers())


def test_quantized_base_saves_no_activation_for_backward():
    # The frozen NVFP4 matmul keeps nothing for backward (dX reads the packed weight again); only
    # the LoRA branch saves its small inputs.
    layer = QuantLinear(128, (256,), ("down_proj",), "nvfp4", torch.float32, "cpu")
    layer.set_base(quantize_nvfp4(torch.randn(256, 128)))
    saved = []
    x = torch.randn(8, 128, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert saved == []


def test_model_gradients_match_peft_on_dequantized_weights():
    """LoRA A/B gradients of the NVFP4 model equal PEFT's on an HF Llama holding the dequantized
    weights, with the adapter moved over by its PEFT names: gradients and export names at once."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = LoraSpec(rank=4, alpha=8)
    model = _model("nvfp4", spec)
    _randomize_b(model)
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")}))
    hf_state = {"model.embed_tokens.weight": model.embed_tokens.weight, "lm_head.weight": model.lm_head.weight,
                "model.norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        for fused, parent in ((layer.self_attn.qkv_proj, "self_attn"), (layer.self_attn.o_proj, "self_attn"),
                              (layer.mlp.gate_up_proj, "mlp"), (layer.mlp.down_proj, "mlp")):
            for name, w in zip(fused.names, dequantize_nvfp4(fused.base_weight()).split(fused.out_sizes)):
                hf_state[f"model.layers.{i}.{parent}.{name}.weight"] = w
        for norm in ("input_layernorm", "post_attention_layernorm"):
            hf_state[f"model.layers.{i}.{norm}.weight"] = getattr(layer, norm).weight
    hf.load_state_dict({k: v.detach() for k, v in hf_state.items()})
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    ours = lora_state_dict(model)
    result = set_peft_model_state_dict(peft_model, ours)
    assert not result.unexpected_keys and len(ours) == 2 * 7 * 2

    ids = _ids()
    labels = torch.roll(ids, -1, dims=1)
    F.cross_entropy(model.logits(ids).flatten(0, 1), labels.flatten()).backward()
    ref_logits = peft_model(input_ids=ids).logits
    F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten()).backward()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), ref_logits, atol=1e-4, rtol=1e-4)
    ref_grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    ours_grads = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            for proj in m.lora_A:
                prefix = f"base_model.model.model.{name.rsplit('.', 1)[0]}.{proj}"
                ours_grads[f"{prefix}.lora_A.weight"] = m.lora_A[proj].grad
                ours_grads[f"{prefix}.lora_B.weight"] = m.lora_B[proj].grad
    assert ours_grads.keys() == ref_grads.keys() == ours.keys()
    for key, g in ours_grads.items():
        torch.testing.assert_close(g, ref_grads[key], atol=1e-5, rtol=1e-4, msg=key)
    # Only adapters learn: nothing else holds a gradient or asks for one.
    assert {id(p) for p in lora_parameters(model)} == {id(p) for p in model.parameters() if p.grad is not None}
    assert all(b.grad is None for b in model.buffers())


def test_targets_norms_and_checkpointing():
    spec = LoraSpec(rank=2, alpha=2, targets=("q", "v", "down"), train_norms=True)
    model = _model("nvfp4", spec)
    _randomize_b(model)
    names = lora_state_dict(model).keys()
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in names
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight" in names
    assert not any("k_proj" in n or "gate_proj" in n for n in names)
    assert "base_model.model.model.norm.weight" in names
    assert "base_model.model.model.layers.0.input_layernorm.weight" in names
    params = lora_parameters(model)
    assert len(params) == 2 * 3 * 2 + 2 * 2 + 1

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        model.logits(_ids()).float().pow(2).mean().backward()
        return [p.grad.clone() for p in params]

    for plain, ckpt in zip(grads(False), grads(True)):
        torch.testing.assert_close(plain, ckpt, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="targets"):
        LoraSpec(rank=2, alpha=2, targets=("qkv",))


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("k", "up")])
def test_the_engines_fused_lora_equals_per_projection_lora(targets):
    from qerl_pipe.engine.fused_lora import FusedLora

    model = _model("nvfp4", LoraSpec(rank=4, alpha=8, targets=targets))
    _randomize_b(model)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    gen = torch.Generator().manual_seed(3)
    xs = {m: torch.randn(5, m.in_features, generator=gen) for m in linears}
    lora = FusedLora(model, torch.float32)
    with torch.no_grad():
        lora.refresh()
        for m in linears:
            torch.testing.assert_close(lora.project(m, xs[m]), m(xs[m]), rtol=1e-5, atol=1e-5)
        # Refreshed in place: an optimizer step is seen, and the buffers keep their addresses.
        addresses = lora.addresses()
        linear = model.layers[0].mlp.gate_up_proj
        for b in linear.lora_B.values():
            b.mul_(2)
        stale = lora.project(linear, xs[linear])
        lora.refresh()
        assert lora.addresses() == addresses
        fresh = lora.project(linear, xs[linear])
        torch.testing.assert_close(fresh, linear(xs[linear]), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(stale, fresh)
        # With the adapters switched off, the base alone, as the model's own forward.
        with lora_disabled(model):
            for m in linears:
                torch.testing.assert_close(lora.project(m, xs[m]), m(xs[m]), rtol=0, atol=0)
