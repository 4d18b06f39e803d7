"""Devices, dtypes and loading a model through transformers: what calibrate, quantize's quality
report, build-engine and the benchmarks share (none of it is a stage's own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qerl_pipe.errors import ModelSourceError, QerlError
from qerl_pipe.log import quiet_transformers


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise QerlError("device 'cuda' was asked for but no CUDA GPU is visible; use device: auto or cpu")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def count_parameters(config: dict[str, Any]) -> int:
    """Parameter count from an HF Llama-family config, without loading weights."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    vocab = config["vocab_size"]
    attn = h * head_dim * (heads + 2 * kv) + heads * head_dim * h
    mlp = 3 * h * i
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts and config.get("moe_intermediate_size"):  # Qwen3-MoE: every layer's experts (they all count)
        mlp = experts * (3 * h * config["moe_intermediate_size"] + h)
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return layers * (attn + mlp) + embeddings


def compute_dtype(choice: str, device: torch.device, n_params: int) -> torch.dtype:
    """float32 on CPU for small models (exact statistics, fast enough); bfloat16 elsewhere."""
    if choice != "auto":
        return getattr(torch, choice)
    if device.type == "cpu" and n_params < 2_000_000_000:
        return torch.float32
    return torch.bfloat16


def load_hf_causal_lm(model_dir: Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    """The unquantized model through transformers, for calibration and the perplexity reference."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, trust_remote_code=trust_remote_code,
                                                     use_safetensors=True)
    except Exception as exc:  # transformers raises many types for unreadable models
        raise ModelSourceError(f"cannot load the model in {model_dir}: {exc}") from None
    return model.to(device).eval()


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelSourceError(f"cannot load the tokenizer in {model_dir}: {exc}") from None
