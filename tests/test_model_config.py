"""DecoderConfig: what is accepted, and that everything else fails with a message naming it."""

from __future__ import annotations

import json

import pytest

from qerl_pipe.errors import ModelSourceError
from qerl_pipe.model.config import DecoderConfig, RopeConfig
from qerl_pipe.model.load import load_model

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
)
LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_llama3_rope_in_either_config_style():
    # transformers 5 writes rope_parameters; hub files written by transformers 4 use rope_theta + rope_scaling.
    new = DecoderConfig.from_hf(
        dict(BASE, model_type="llama", rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0, rope_type="llama3"))
    )
    old = DecoderConfig.from_hf(
        dict(BASE, model_type="llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, rope_type="llama3"))
    )
    legacy_key = DecoderConfig.from_hf(
        dict(BASE, model_type="llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, type="llama3"))
    )
    assert new == old == legacy_key
    assert new.rope == RopeConfig(theta=500000.0, type="llama3", **LLAMA3_ROPE)
    assert new.head_dim == 16 and new.num_kv_heads == 2 and not new.tie_word_embeddings


def test_family_specifics():
    qwen2 = DecoderConfig.from_hf(
        dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=32768,
             use_sliding_window=False, tie_word_embeddings=True, rope_theta=1e6)
    )
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings and qwen2.rope.theta == 1e6
    qwen3 = DecoderConfig.from_hf(dict(BASE, model_type="qwen3", head_dim=32, layer_types=["full_attention"] * 2))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128 and not qwen3.qkv_bias
    llama_bias = DecoderConfig.from_hf(dict(BASE, model_type="llama", attention_bias=True))
    assert llama_bias.qkv_bias and llama_bias.o_bias
    mistral = DecoderConfig.from_hf(dict(BASE, model_type="mistral", sliding_window=None))
    assert mistral.model_type == "mistral" and mistral.num_kv_heads == 2


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"]),
         ["Gemma2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"]),
        (dict(model_type="mixtral", architectures=["MixtralForCausalLM"]), ["MixtralForCausalLM", "supported"]),
        (dict(model_type="qwen2", num_experts=8), ["mixture-of-experts"]),
        (dict(model_type="llama", architectures=["LlamaForSequenceClassification"]),
         ["LlamaForSequenceClassification"]),
        (dict(model_type="mistral", sliding_window=1024), ["sliding-window", "1024"]),
        (dict(model_type="qwen2", sliding_window=1024, use_sliding_window=True), ["sliding-window"]),
        (dict(model_type="qwen3", layer_types=["sliding_attention", "full_attention"]), ["sliding-window"]),
        (dict(model_type="llama", rope_scaling=dict(rope_type="yarn", factor=4.0)), ["'yarn'", "llama3"]),
        (dict(model_type="llama", hidden_act="gelu"), ["gelu"]),
    ],
)
def test_unsupported_configs_raise(overrides, words):
    with pytest.raises(ModelSourceError) as err:
        DecoderConfig.from_hf(dict(BASE, **overrides))
    for word in words:
        assert word in str(err.value)


def test_load_model_refuses_unsupported_architecture_before_reading_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="phi3", architectures=["Phi3ForCausalLM"])))
    with pytest.raises(ModelSourceError, match="Phi3ForCausalLM.*supported: LlamaForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(ModelSourceError, match="config.json"):
        load_model(tmp_path / "nowhere")
