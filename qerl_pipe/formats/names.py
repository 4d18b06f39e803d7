"""Tensor and module names, in one place: Hugging Face's, our Decoder's fused projections, PEFT's
(and Qwen3-MoE's router and experts). Pure string work, no torch: every layer (formats, model,
engine) may import it. See docs/formats.md, section "Tensor names"."""

from __future__ import annotations

import re

# What HF puts before our Decoder's names (`layers.0...`, `norm.weight`); lm_head has no prefix.
HF_PREFIX = "model."
# What PEFT puts before a Hugging Face parameter name.
PEFT_PREFIX = "base_model.model."

# LoRA targets as recipes and adapter configs name them (`q` is `q_proj`), in model order.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

# Fused group -> its HF projections, in the order their outputs are concatenated.
FUSED_GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
_GROUP_OF = {proj: group for group, projs in FUSED_GROUPS.items() for proj in projs}
# Fused groups some checkpoints store as one module (Phi3's `qkv_proj`, `gate_up_proj`): one
# tensor, one NVFP4 global scale, one PEFT target, named as the checkpoint names it.
CHECKPOINT_FUSED: dict[str, tuple[str, ...]] = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
# Every HF projection of a decoder layer: one per LoRA target, and the checkpoint-fused ones.
PROJECTIONS = tuple(f"{t}_proj" for t in LORA_TARGETS) + tuple(CHECKPOINT_FUSED)

# The linears of a decoder layer by HF weight name; embeddings, norms and lm_head are not among
# them (they stay 16-bit in an NVFP4 checkpoint).
# An expert's linears sit one level deeper (`mlp.experts.E.gate_proj`); the router `mlp.gate` is
# not a linear here (it stays 16-bit, as modelopt leaves it).
HF_LINEAR_WEIGHT = re.compile(
    r"^(.*\.layers\.\d+\.(self_attn|mlp|mlp\.experts\.\d+)\.(q|k|v|o|gate|up|down|qkv|gate_up)_proj)\.weight$")
# PEFT names of the LoRA tensors our Decoder can hold: one A/B pair per projection per layer
# (and per expert, for LoRA on the experts).
PEFT_LORA_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp|mlp\.experts\.\d+)\.(\w+)_proj\.lora_([AB])\.weight$")
# A MoE layer's router (`mlp.gate`): kept 16-bit and, as modelopt does, listed among the excluded
# modules of an NVFP4 checkpoint, so that a loader that would quantize it leaves it alone.
ROUTER_WEIGHT = re.compile(r"^(.*\.layers\.\d+\.mlp\.gate)\.weight$")
# An expert's module: `...layers.3.mlp.experts.17.gate_proj` (any prefix, any suffix after it).
EXPERT_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)\.")
# Trainable RMSNorm weights (PEFT's modules_to_save), under PEFT's names.
PEFT_NORM_KEY = re.compile(r"^base_model\.model\.model\.[\w.]*norm\.weight$")


# HF projection -> (our fused linear, index of the projection in it): `k_proj` -> (`qkv_proj`, 1).
FUSED_INDEX: dict[str, tuple[str, int]] = {
    proj: (f"{group}_proj", i) for group, projs in FUSED_GROUPS.items() for i, proj in enumerate(projs)
}


def targets_of(module: str) -> tuple[str, ...]:
    """The LoRA targets an HF projection module carries: `q_proj` -> (q,), `qkv_proj` -> (q, k, v)."""
    return CHECKPOINT_FUSED.get(module, (module.removesuffix("_proj"),))


def hf_name(name: str) -> str:
    """Our Decoder's name of a module or parameter -> HF's (`layers.0...` -> `model.layers.0...`)."""
    return f"{HF_PREFIX}{name}"


def from_hf_name(name: str) -> str:
    """HF's name -> our Decoder's (the inverse of `hf_name`; `lm_head.weight` stays as it is)."""
    return name.removeprefix(HF_PREFIX)


def peft_name(name: str) -> str:
    """Our Decoder's name -> PEFT's (`layers.0.self_attn.q_proj` -> `base_model.model.model.layers...`)."""
    return f"{PEFT_PREFIX}{hf_name(name)}"


def fused_group_key(param_name: str) -> str | None:
    """`model.layers.3.self_attn.k_proj(.weight)` -> `model.layers.3.self_attn.qkv`; else None."""
    parts = param_name.split(".")
    if parts[-1] == "weight":
        parts = parts[:-1]
    group = _GROUP_OF.get(parts[-1]) if parts else None
    return None if group is None else ".".join([*parts[:-1], group])


def is_expert(name: str) -> bool:
    """Whether a module or parameter name (ours, HF's or PEFT's) is inside a routed expert."""
    return EXPERT_MODULE.search(name) is not None


def experts_group_key(module: str) -> str | None:
    """What the input scale of an expert's projection is shared with: every expert of its layer
    (modelopt writes one gate/up and one down `input_scale` per MoE layer, the max over its
    experts, since a token may be routed to any of them).
    `model.layers.3.mlp.experts.17.up_proj` -> `model.layers.3.mlp.experts.gate_up`; else None."""
    match = EXPERT_MODULE.search(module + ".")
    if match is None:
        return None
    proj = module.rpartition(".")[2]
    group = _GROUP_OF.get(proj, proj.removesuffix("_proj"))
    return f"{module[:match.end()].rstrip('.').rpartition('.')[0]}.{group}"
