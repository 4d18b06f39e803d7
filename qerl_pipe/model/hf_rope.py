"""RoPE settings read from a Hugging Face config.json (`rope_parameters`, or `rope_theta` with an
optional `rope_scaling`; Gemma3 per layer type): the scalings our decoder computes, or a
`ModelSourceError` for any other. See docs/model.md, section "Supported configs"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from qerl_pipe.errors import ModelSourceError

@dataclass(frozen=True)
class RopeConfig:
    theta: float
    # "default" (no scaling), "llama3" (Llama 3.1+ band-wise scaling), "linear" (positions divided
    # by `factor`; Gemma3's global layers) or "longrope" (Phi3's per-frequency short / long
    # factors with an attention factor on cos and sin).
    type: str = "default"
    # llama3 and linear:
    factor: float = 1.0
    # llama3:
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, and longrope's switch from the short to the long factors:
    original_max_position_embeddings: int = 8192
    # longrope (one factor per rotated frequency) and its cos/sin multiplier:
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # The leading head dimensions that rotate (Phi-4-mini: 0.75 of head_dim); the rest pass through.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def rope_params(hf: Mapping[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE dict of `layer_type` (None: the model's only one), whichever spelling the file uses."""
    params = dict(hf.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), Mapping):
        params = dict(params[layer_type])
    elif layer_type is not None and any(isinstance(v, Mapping) for v in params.values()):
        params = {}
    if layer_type != "sliding_attention":  # rope_scaling is the global layers' (Gemma3)
        params.update(hf.get("rope_scaling") or {})
    return params


def parse_rope(hf: Mapping[str, Any], name: str, params: Mapping[str, Any], theta: float,
               max_positions: int) -> RopeConfig:
    """A RopeConfig from one RoPE dict (`rope_params`), `theta` the file's base if the dict has none."""
    theta = float(params.get("rope_theta", theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if not 0 < partial <= 1:
        raise ModelSourceError(f"{name}: partial_rotary_factor {partial} is outside (0, 1]")
    if partial != 1.0 and hf.get("model_type") != "phi3":
        raise ModelSourceError(f"{name}: partial_rotary_factor != 1 is supported for Phi3 only")
    if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # transformers reads Phi3's older names as longrope too
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "llama3":
        return RopeConfig(theta=theta, type="llama3", factor=float(params["factor"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                          partial_rotary_factor=partial)
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=float(params["factor"]), partial_rotary_factor=partial)
    if rope_type == "longrope" and hf.get("model_type") == "phi3":
        return _longrope(hf, name, params, theta, partial, max_positions)
    raise ModelSourceError(f"{name}: RoPE scaling {rope_type!r} is not supported (only default, 'llama3', 'linear', "
                           "and Phi3's 'longrope')")


def _longrope(hf: Mapping[str, Any], name: str, params: Mapping[str, Any], theta: float, partial: float,
              max_positions: int) -> RopeConfig:
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if original is None or "short_factor" not in params or "long_factor" not in params:
        raise ModelSourceError(f"{name}: longrope needs short_factor, long_factor and original_max_position_embeddings")
    original = int(original)
    # As transformers: the factor defaults to the context extension, and the attention factor
    # (a multiplier on cos and sin, so on every attention logit) to sqrt(1 + ln f / ln original).
    factor = float(params.get("factor") or max_positions / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = tuple(float(f) for f in params["short_factor"]), tuple(float(f) for f in params["long_factor"])
    return RopeConfig(theta=theta, type="longrope", factor=factor, original_max_position_embeddings=original,
                      short_factor=short, long_factor=long, attention_factor=float(attention),
                      partial_rotary_factor=partial)
