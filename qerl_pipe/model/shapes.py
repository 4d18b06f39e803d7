"""Hugging Face configs with the exact shapes of the models the benchmarks stand in for: dense
Qwen2.5 (3B-72B) and Qwen3-30B-A3B, figures from their published config.json files. Random
weights of these shapes (`random_init`) measure speed and memory at scale without a model hub."""

from __future__ import annotations

from typing import Any


def _qwen25(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    }


QWEN25_SHAPES: dict[str, dict[str, Any]] = {
    # 3B ties its embeddings and has the smaller vocabulary of Qwen2.5-3B-Instruct's config.json.
    "qwen2.5-3b": {**_qwen25(2048, 11008, 36, 16, 2), "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8),
}

# Qwen3-30B-A3B: 48 layers, every one sparse (decoder_sparse_step 1, no mlp_only_layers): 128
# experts of width 768, 8 per token, renormalised; `intermediate_size` is the dense MLP width a
# layer listed in mlp_only_layers would have (none here). 30.5 B parameters, ~3.3 B active per token.
QWEN3_MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "attention_bias": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
}

# Every shape the benchmarks build by name (`bench rollout --shapes`, `bench train-step --shape`).
SHAPES: dict[str, dict[str, Any]] = {**QWEN25_SHAPES, **QWEN3_MOE_SHAPES}

# Releases of the same shapes under another name: the instruct and 2507 updates of Qwen3-30B-A3B
# differ from it in their RoPE base and context length only, not in any weight's shape.
_RELEASE_SUFFIXES = ("-instruct-2507", "-thinking-2507", "-instruct")


def shape_for_source(source: str) -> str | None:
    """The shape of a model named as a recipe's model.source names it (`Qwen/Qwen2.5-7B`,
    `Qwen/Qwen2.5-72B-Instruct`, `Qwen/Qwen3-30B-A3B`, `Qwen/Qwen3-30B-A3B-Instruct-2507`, a local
    directory of that name), or None."""
    name = source.rstrip("/").split("/")[-1].lower()
    for suffix in _RELEASE_SUFFIXES:
        if name.endswith(suffix):
            name = name.removesuffix(suffix)
            break
    return name if name in SHAPES else None
