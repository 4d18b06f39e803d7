"""Hugging Face configs with the exact shapes of the Qwen2.5 models the benchmarks stand in for.

Random weights of these shapes measure speed and memory at scale without a model hub: what a
kernel or a decode step costs depends on the shapes, not on the values. Figures from the
published Qwen2.5 config.json files.
"""

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
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8),
}


def shape_for_source(source: str) -> str | None:
    """The shape of a Qwen2.5 model named as a recipe's model.source names it (`Qwen/Qwen2.5-7B`,
    `Qwen/Qwen2.5-72B-Instruct`, a local directory of that name), or None."""
    name = source.rstrip("/").split("/")[-1].lower().removesuffix("-instruct")
    return name if name in QWEN25_SHAPES else None
