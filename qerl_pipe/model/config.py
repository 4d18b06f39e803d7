"""DecoderConfig: the few numbers our decoder needs, read from a Hugging Face config.json dict.
What sets each family apart (model/families.py) is a field here; anything that would silently
compute something else is refused here, before a single weight is read.
See docs/model.md, section "Supported configs"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from qerl_pipe.errors import ModelSourceError
from qerl_pipe.formats.names import FUSED_GROUPS
from qerl_pipe.model.families import activation, check_rope_fits, gemma_fields, layer_windows, moe_fields
from qerl_pipe.model.hf_rope import RopeConfig, parse_rope, rope_params

__all__ = ["DecoderConfig", "RopeConfig", "SUPPORTED"]

# model_type -> the HF architecture class name it is published under.
SUPPORTED = {
    "llama": "LlamaForCausalLM",  # Llama 3.x, SmolLM2
    "mistral": "MistralForCausalLM",  # full attention or a sliding window
    "qwen2": "Qwen2ForCausalLM",  # Qwen2, Qwen2.5 (q/k/v bias)
    "qwen3": "Qwen3ForCausalLM",  # Qwen3 (q/k RMSNorm, explicit head_dim)
    "qwen3_moe": "Qwen3MoeForCausalLM",  # Qwen3-30B-A3B, Qwen3-235B-A22B (routed experts)
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",  # Gemma3's text model (1B, or a text-only checkpoint)
    "phi3": "Phi3ForCausalLM",  # Phi-3, Phi-3.5, Phi-4-mini
}
_SUPPORTED_TEXT = ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in SUPPORTED.items())


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
    qk_norm: bool  # Qwen3, Gemma3
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (Gemma)
    # Per layer: its sliding window in tokens, 0 for full attention; () when no layer has one.
    windows: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None  # Gemma3: the RoPE of its sliding-window layers
    norm_offset: float = 0.0  # Gemma: norms scale by (offset + w)
    sandwich_norms: bool = False  # Gemma: post-attention and pre/post-feed-forward norms
    embed_scale: float | None = None  # Gemma: sqrt(hidden), rounded to the model dtype
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma2: cap * tanh(score / cap) on attention scores
    final_softcap: float | None = None  # Gemma2: the same on the logits
    fused_checkpoint: bool = False  # Phi3: qkv_proj and gate_up_proj are single checkpoint modules
    # Qwen3-MoE: routed experts in the layers `sparse_layers` marks (per layer; () when none).
    num_experts: int = 0
    experts_per_token: int = 0  # the router's top-k
    moe_intermediate_size: int = 0  # one expert's gate/up width
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    sparse_layers: tuple[bool, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens, or None for full attention."""
        return (self.windows[layer] or None) if self.windows else None

    def rope_of(self, layer: int) -> RopeConfig:
        """The RoPE layer `layer` rotates with (Gemma3's local layers have their own)."""
        return self.local_rope if self.local_rope is not None and self.window(layer) else self.rope

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` runs routed experts instead of the dense MLP."""
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def expert_linears(self) -> tuple[tuple[str, str, int, tuple[tuple[str, int], ...]], ...]:
        """One expert's linears, as `layer_linears` lists a layer's (block `mlp.experts.E`)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return (("mlp.experts", "gate_up_proj", h, tuple(zip(FUSED_GROUPS["gate_up"], (i, i)))),
                ("mlp.experts", "down_proj", i, (("down_proj", h),)))

    @property
    def norms_per_layer(self) -> int:
        return 4 if self.sandwich_norms else 2

    def layer_linears(self) -> tuple[tuple[str, str, int, tuple[tuple[str, int], ...]], ...]:
        """One layer's linears as our Decoder builds them: (block, module, in_features, its
        projections as (HF name, out_features)). q/k/v and gate/up are one linear each; a family
        that stores them fused (Phi3) keeps them one projection, as its checkpoint and PEFT name it."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        if self.fused_checkpoint:
            qkv: tuple[tuple[str, int], ...] = (("qkv_proj", q + 2 * kv),)
            gate_up: tuple[tuple[str, int], ...] = (("gate_up_proj", 2 * i),)
        else:
            qkv = tuple(zip(FUSED_GROUPS["qkv"], (q, kv, kv)))
            gate_up = tuple(zip(FUSED_GROUPS["gate_up"], (i, i)))
        return (("self_attn", "qkv_proj", h, qkv), ("self_attn", "o_proj", q, (("o_proj", h),)),
                ("mlp", "gate_up_proj", h, gate_up), ("mlp", "down_proj", i, (("down_proj", h),)))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "DecoderConfig":
        """Parse a config.json dict; raise ModelSourceError for anything we would compute wrongly."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        name = archs[0] if archs else str(model_type)
        if model_type not in SUPPORTED or any(a != SUPPORTED[model_type] for a in archs):
            raise ModelSourceError(f"unsupported architecture {name} (model_type {model_type!r}); supported: "
                                   f"{_SUPPORTED_TEXT}")
        act = activation(hf, name)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        max_positions = int(hf.get("max_position_embeddings", 4096))
        attention_bias = bool(hf.get("attention_bias", False))
        qwen2 = model_type == "qwen2"
        fields: dict[str, Any] = dict(
            rope=parse_rope(hf, name, rope_params(hf), float(hf.get("rope_theta", 10000.0)), max_positions),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        )
        fields.update(moe_fields(hf, name, num_layers))
        fields.update(gemma_fields(hf, name, hidden, head_dim, max_positions))
        for rope in (fields["rope"], fields.get("local_rope")):
            if rope is not None:
                check_rope_fits(rope, head_dim, name)
        return cls(
            model_type=model_type, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]), num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads), head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in ("gemma2", "gemma3_text"))),
            qkv_bias=qwen2 or attention_bias, o_bias=attention_bias and not qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)), hidden_act=act, windows=layer_windows(hf, name, num_layers),
            fused_checkpoint=model_type == "phi3", **fields)
