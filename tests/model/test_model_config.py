"""DecoderConfig: what is accepted, and that everything else fails with a message naming it."""

from __future__ import annotations

import json
import math

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
        (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
         ["Gemma3ForConditionalGeneration", "LlamaForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"]),
        (dict(model_type="mixtral", architectures=["MixtralForCausalLM"]), ["MixtralForCausalLM", "supported"]),
        (dict(model_type="qwen2", num_experts=8), ["mixture-of-experts"]),
        (dict(model_type="llama", architectures=["LlamaForSequenceClassification"]),
         ["LlamaForSequenceClassification"]),
        (dict(model_type="qwen2", sliding_window=1024, use_sliding_window=True), ["sliding-window", "1024"]),
        (dict(model_type="qwen3", layer_types=["sliding_attention", "full_attention"]), ["sliding-window"]),
        (dict(model_type="llama", rope_scaling=dict(rope_type="yarn", factor=4.0)), ["'yarn'", "llama3"]),
        (dict(model_type="llama", hidden_act="gelu"), ["gelu"]),
        (dict(model_type="gemma2", hidden_activation="gelu"), ["'gelu'", "gelu_pytorch_tanh"]),
        (dict(model_type="llama", rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8,
                                                    long_factor=[1.0] * 8)), ["'longrope'", "Phi3"]),
        (dict(model_type="llama", partial_rotary_factor=0.5), ["partial_rotary_factor", "Phi3"]),
        (dict(model_type="phi3", rope_scaling=dict(type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 3),
              original_max_position_embeddings=1024), ["short_factor", "needs 8"]),
        (dict(model_type="gemma3_text", use_bidirectional_attention=True), ["use_bidirectional_attention"]),
        (dict(model_type="mistral", layer_types=["sliding_attention", "full_attention"], sliding_window=8),
         ["layer_types", "Gemma"]),
    ],
)
def test_unsupported_configs_raise(overrides, words):
    with pytest.raises(ModelSourceError) as err:
        DecoderConfig.from_hf(dict(BASE, **overrides))
    for word in words:
        assert word in str(err.value)


def test_load_model_refuses_unsupported_architecture_before_reading_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="falcon",
                                                         architectures=["FalconForCausalLM"])))
    with pytest.raises(ModelSourceError, match="FalconForCausalLM.*supported: LlamaForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(ModelSourceError, match="config.json"):
        load_model(tmp_path / "nowhere")


def test_sliding_windows_per_layer():
    # Mistral and Phi3: every layer, when shorter than the context; a window that holds every
    # position changes nothing and is dropped.
    mistral = DecoderConfig.from_hf(dict(BASE, model_type="mistral", sliding_window=1024))
    assert mistral.windows == (1024, 1024) and mistral.window(1) == 1024
    assert DecoderConfig.from_hf(dict(BASE, model_type="mistral", sliding_window=4096)).windows == ()
    assert DecoderConfig.from_hf(dict(BASE, model_type="phi3", sliding_window=2047)).windows == (2047, 2047)
    # Gemma2 alternates from layer 0 without layer_types; Gemma3 makes every pattern-th layer global.
    gemma2 = DecoderConfig.from_hf(dict(BASE, model_type="gemma2", num_hidden_layers=4, sliding_window=512))
    assert gemma2.windows == (512, 0, 512, 0) and gemma2.window(1) is None
    gemma3 = DecoderConfig.from_hf(dict(BASE, model_type="gemma3_text", num_hidden_layers=6, sliding_window=512,
                                        sliding_window_pattern=3))
    assert gemma3.windows == (512, 512, 0, 512, 512, 0)
    listed = DecoderConfig.from_hf(dict(BASE, model_type="gemma3_text", sliding_window=512,
                                        layer_types=["full_attention", "sliding_attention"]))
    assert listed.windows == (0, 512)


def test_gemma_specifics_in_either_config_style():
    gemma2 = DecoderConfig.from_hf(dict(BASE, model_type="gemma2", query_pre_attn_scalar=144))
    assert (gemma2.norm_offset, gemma2.sandwich_norms, gemma2.hidden_act) == (1.0, True, "gelu_pytorch_tanh")
    assert gemma2.embed_scale == 8.0 and gemma2.attn_scale == 144 ** -0.5 and gemma2.tie_word_embeddings
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0) and not gemma2.qk_norm
    # Gemma3: q/k norms, no attention cap whatever the file says, a RoPE per layer type.
    old = DecoderConfig.from_hf(dict(BASE, model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4,
                                     rope_scaling=dict(rope_type="linear", factor=8.0), attn_logit_softcapping=50.0))
    new = DecoderConfig.from_hf(dict(BASE, model_type="gemma3_text", rope_parameters={
        "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4)}))
    assert old == new and new.qk_norm and new.attn_softcap is None and new.final_softcap is None
    assert new.rope == RopeConfig(theta=1e6, type="linear", factor=8.0) and new.local_rope == RopeConfig(theta=1e4)
    # Two layers, both local under the default pattern (every sixth is global); a window as long as
    # the context still marks them local, and they rotate with their own RoPE.
    assert new.windows == (4096, 4096) and new.rope_of(1) == new.local_rope


def test_phi3_longrope_and_partial_rotary():
    factors = dict(short_factor=[1.0] * 6, long_factor=[2.0] * 6)
    phi = DecoderConfig.from_hf(dict(BASE, model_type="phi3", max_position_embeddings=131072,
                                     original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                                     rope_scaling=dict(type="longrope", **factors)))
    assert phi.fused_checkpoint and phi.rope.type == "longrope" and phi.rope.rotary_dim(phi.head_dim) == 12
    assert phi.rope.factor == 32.0 and phi.rope.original_max_position_embeddings == 4096
    assert phi.rope.attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    assert [n for _, _, _, projections in phi.layer_linears() for n, _ in projections] == [
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    su = DecoderConfig.from_hf(dict(BASE, model_type="phi3", max_position_embeddings=131072,
                                    original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                                    rope_scaling=dict(type="su", **factors)))
    assert su == phi
