"""DecoderConfig: the few numbers our decoder needs, read from a Hugging Face config.json dict.

Only the Llama family is supported (one attention + SiLU-gated MLP block, RMSNorm, RoPE); anything
that would silently compute something else (sliding windows, MoE, other RoPE scalings) is refused
here, before a single weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from qerl_pipe.errors import ModelSourceError

# model_type -> the HF architecture class name it is published under.
SUPPORTED = {
    "llama": "LlamaForCausalLM",  # Llama 3.x, SmolLM2
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",  # Qwen2, Qwen2.5 (q/k/v bias)
    "qwen3": "Qwen3ForCausalLM",  # Qwen3 (q/k RMSNorm, explicit head_dim)
}
_SUPPORTED_TEXT = ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in SUPPORTED.items())


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # "default" or "llama3"
    # llama3 scaling only:
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama attention_bias covers o_proj too; Qwen2 has no o_proj bias
    mlp_bias: bool
    qk_norm: bool  # Qwen3

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "DecoderConfig":
        """Parse a config.json dict; raise ModelSourceError for anything we would compute wrongly."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        name = archs[0] if archs else str(model_type)
        if model_type not in SUPPORTED or any(a != SUPPORTED[model_type] for a in archs):
            raise ModelSourceError(
                f"unsupported architecture {name} (model_type {model_type!r}); supported: {_SUPPORTED_TEXT}"
            )
        if hf.get("num_experts") or hf.get("num_local_experts"):
            raise ModelSourceError(
                f"{name}: mixture-of-experts models are not supported; supported: {_SUPPORTED_TEXT}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelSourceError(f"{name}: hidden_act {act!r} is not supported (only 'silu')")
        _check_no_sliding_window(hf, name)

        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        attention_bias = bool(hf.get("attention_bias", False))
        qwen2 = model_type == "qwen2"
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(hf, name),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )


def _check_no_sliding_window(hf: Mapping[str, Any], name: str) -> None:
    # Qwen configs carry a sliding_window value but only use it when use_sliding_window is true;
    # Mistral uses it whenever it is set and shorter than the context (Mistral-7B-v0.1: 4096).
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        used = True
    elif "use_sliding_window" in hf:
        used = bool(hf["use_sliding_window"])
    else:
        window = hf.get("sliding_window")
        used = window is not None and int(window) < int(hf.get("max_position_embeddings", 0))
    if used:
        raise ModelSourceError(
            f"{name}: sliding-window attention (sliding_window={hf.get('sliding_window')}) is not supported; "
            f"use a checkpoint with full attention; supported: {_SUPPORTED_TEXT}"
        )


def _parse_rope(hf: Mapping[str, Any], name: str) -> RopeConfig:
    # transformers >= 5 writes one dict `rope_parameters` (with rope_theta inside); older configs
    # (and most hub files) have top-level `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelSourceError(f"{name}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ModelSourceError(f"{name}: RoPE scaling {rope_type!r} is not supported (only default and 'llama3')")
