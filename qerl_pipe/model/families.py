"""What sets each supported family apart, read from its config.json: the fields of `DecoderConfig`
beyond the Llama block every family shares (Gemma2/3, Phi3, Mistral, Qwen3-MoE's sparse layers);
Qwen's `use_sliding_window` is refused.
See docs/model.md, sections "Supported configs" and "Mixture of experts (Qwen3-MoE)"."""

from __future__ import annotations

import math
from typing import Any, Mapping

from qerl_pipe.errors import ModelSourceError
from qerl_pipe.model.hf_rope import RopeConfig, parse_rope, rope_params

GEMMA = ("gemma2", "gemma3_text")
QWEN = ("qwen2", "qwen3", "qwen3_moe")
MOE = ("qwen3_moe",)
# The MLP activations transformers names, as our decoder computes them.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# transformers' defaults for keys a config.json may leave out.
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_GEMMA3_PATTERN = 6


def activation(hf: Mapping[str, Any], name: str) -> str:
    """The MLP activation (Gemma names it `hidden_activation`, the others `hidden_act`)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if hf.get("model_type") in GEMMA:
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ModelSourceError(f"{name}: hidden_act {act!r} is not supported (only {', '.join(map(repr, ACTIVATIONS))})")
    return act


def layer_windows(hf: Mapping[str, Any], name: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window in tokens (a query sees itself and the window - 1 before it),
    0 for full attention; () when every layer attends fully."""
    model_type = hf.get("model_type")
    window = hf.get("sliding_window", 4096 if model_type in GEMMA else None)  # transformers' Gemma default
    types = list(hf.get("layer_types") or [])
    if model_type in QWEN:
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in types):
            raise ModelSourceError(f"{name}: Qwen's sliding-window attention (use_sliding_window, sliding_window="
                                   f"{window}) is not supported; use a checkpoint with full attention (every released "
                                   "Qwen2.5 / Qwen3 one)")
        return ()
    if model_type in GEMMA:
        if hf.get("use_bidirectional_attention"):
            raise ModelSourceError(f"{name}: use_bidirectional_attention (an embedding model) is not supported")
        if not types:
            # transformers' rule for files without layer_types: Gemma2 alternates local / global from
            # layer 0; Gemma3 makes every `sliding_window_pattern`-th layer global.
            period = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern") or _GEMMA3_PATTERN)
            types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]
    elif types and any(t != "full_attention" for t in types):
        raise ModelSourceError(f"{name}: per-layer attention types (layer_types) are supported for Gemma2 / Gemma3 only")
    elif window is not None:
        types = ["sliding_attention"] * num_layers  # Mistral, Phi3: every layer, when set
    if len(types) not in (0, num_layers) or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ModelSourceError(f"{name}: layer_types {types} is not one of full_attention / sliding_attention per layer")
    if "sliding_attention" not in types:
        return ()
    if window is None or int(window) < 1:
        raise ModelSourceError(f"{name}: sliding_attention layers need a sliding_window >= 1 (got {window})")
    window = int(window)
    # A window over every layer that holds every position the model has changes nothing (Phi-3.5's
    # 262144): full attention, without a mask. Gemma keeps its local layers, whose RoPE differs.
    if model_type not in GEMMA and window >= int(hf.get("max_position_embeddings", 0)):
        return ()
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def gemma_fields(hf: Mapping[str, Any], name: str, hidden: int, head_dim: int, max_positions: int) -> dict[str, Any]:
    """Gemma2 / Gemma3's DecoderConfig fields (empty for every other family)."""
    model_type = hf.get("model_type")
    if model_type not in GEMMA:
        return {}
    gemma3 = model_type == "gemma3_text"
    fields: dict[str, Any] = dict(
        norm_offset=1.0, sandwich_norms=True, embed_scale=math.sqrt(hidden),
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        # Gemma3's attention never soft-caps, whatever its config says (transformers passes no cap).
        attn_softcap=None if gemma3 else _cap(hf.get("attn_logit_softcapping", 50.0)),
        final_softcap=_cap(hf.get("final_logit_softcapping", None if gemma3 else 30.0)),
        qk_norm=gemma3,
    )
    if gemma3:
        theta = float(hf.get("rope_theta", _GEMMA3_THETA["full_attention"]))
        local = float(hf.get("rope_local_base_freq", _GEMMA3_THETA["sliding_attention"]))
        fields["rope"] = parse_rope(hf, name, rope_params(hf, "full_attention"), theta, max_positions)
        fields["local_rope"] = parse_rope(hf, name, rope_params(hf, "sliding_attention"), local, max_positions)
    return fields


def _cap(value: Any) -> float | None:
    return None if value in (None, 0, 0.0) else float(value)


def check_rope_fits(rope: RopeConfig, head_dim: int, name: str) -> None:
    """LongRoPE gives one factor per rotated frequency; a list of another length is a broken file."""
    half = rope.rotary_dim(head_dim) // 2
    if rope.type == "longrope" and (len(rope.short_factor) != half or len(rope.long_factor) != half):
        raise ModelSourceError(f"{name}: longrope short_factor / long_factor have {len(rope.short_factor)} / "
                               f"{len(rope.long_factor)} entries; the rotary dimension needs {half}")
    if rope.rotary_dim(head_dim) % 2 or rope.rotary_dim(head_dim) < 2:
        raise ModelSourceError(f"{name}: the rotary dimension {rope.rotary_dim(head_dim)} must be even and >= 2")


def moe_fields(hf: Mapping[str, Any], name: str, num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's DecoderConfig fields: the experts' count and size, the router's top-k and
    whether it renormalises, and which layers are sparse (transformers' rule: layer i is when
    (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers). Empty for a dense family;
    any other family declaring experts is refused."""
    # config.json spells the count `num_experts` (Qwen's releases) or `num_local_experts` (what
    # transformers 5's save_pretrained writes for the same attribute).
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    model_type = hf.get("model_type")
    if model_type not in MOE:
        if experts:
            raise ModelSourceError(f"{name}: mixture-of-experts is supported for Qwen3-MoE (Qwen3MoeForCausalLM) only")
        return {}
    top_k = int(hf.get("num_experts_per_tok") or 0)
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in hf.get("mlp_only_layers") or []}
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelSourceError(f"{name}: num_experts {experts} and num_experts_per_tok {top_k} must satisfy "
                               "1 <= num_experts_per_tok <= num_experts")
    if hf.get("shared_expert_intermediate_size"):
        raise ModelSourceError(f"{name}: shared experts (shared_expert_intermediate_size) are not supported")
    if step < 1 or any(not 0 <= i < num_layers for i in dense):
        raise ModelSourceError(f"{name}: decoder_sparse_step {step} must be >= 1 and mlp_only_layers "
                               f"{sorted(dense)} within 0..{num_layers - 1}")
    return dict(
        num_experts=experts, experts_per_token=top_k,
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=tuple((i + 1) % step == 0 and i not in dense for i in range(num_layers)),
    )
