"""Models with random weights in any base format: the speed and memory stand-ins for real ones.

The benchmarks build Qwen2.5-shaped models (`model/shapes.py`) this way, and the tests tiny ones:
what a kernel, a decode step or a training step costs depends on the shapes, not on the values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from qerl_pipe.kernels.base_formats import base_format as format_entry
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.lora import LoraSpec, apply_lora
from qerl_pipe.model.moe import Router


def init_random_model(config_dict: Mapping[str, Any], base_format: str = "bf16", device: torch.device | str = "cpu",
                      seed: int = 0, dtype: torch.dtype = torch.bfloat16, lora: LoraSpec | None = None) -> Decoder:
    """A model with HF's random init (N(0, 0.02), unit norms) built directly in `base_format`, one
    linear at a time on `device` (a 32B NVFP4 model builds without its 64 GB bf16 copy ever existing)."""
    fmt = format_entry(base_format)
    model = Decoder(DecoderConfig.from_hf(config_dict), fmt.name, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0.0, 0.02, generator=gen)
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.normal_(0.0, 0.02, generator=gen)
        for name, linear in model.named_modules():
            if not isinstance(linear, QuantLinear):
                continue
            w = torch.empty(linear.out_features, linear.in_features, dtype=dtype, device=device)
            linear.set_base(fmt.quantize(w.normal_(0.0, 0.02, generator=gen), name, dtype))
            del w
        for router in (m for m in model.modules() if isinstance(m, Router)):  # MoE layers' routers
            router.weight.normal_(0.0, 0.02, generator=gen)
    if lora is not None:
        apply_lora(model, lora, seed)
    return model
