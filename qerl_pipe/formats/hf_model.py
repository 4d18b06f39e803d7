"""Our Decoder's weights as a Hugging Face model's: names, unfused projections, safetensors shards.

The inverse of `model.load`'s assembly: `qkv_proj` / `gate_up_proj` are split back into
`q_proj`, `k_proj`, `v_proj` / `gate_proj`, `up_proj` (weights and biases), every name gets HF's
`model.` prefix, and a tied LM head is left out (HF ties it to `model.embed_tokens.weight`).
Used to save a fully fine-tuned model; `AutoModelForCausalLM.from_pretrained` reads the result.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from qerl_pipe.formats.checkpoint import INDEX_FILE, SINGLE_FILE, save_safetensors
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear

# Output shards close at this size, so the host holds one shard at a time, not the model.
SHARD_BYTES = 2 * 2**30


def hf_tensors(model: Decoder) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) for every weight of a bf16-base model, in model order, views (no copies)."""
    if model.base_format != "bf16":
        raise ValueError(f"only a bf16 base has dense weights to save as a Hugging Face model, not {model.base_format}")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    for name, t in model.state_dict(keep_vars=True).items():
        module_name, _, kind = name.rpartition(".")
        linear = linears.get(module_name)
        if linear is not None:
            parent = module_name.rpartition(".")[0]
            for proj, part in zip(linear.names, t.detach().split(linear.out_sizes)):
                yield f"model.{parent}.{proj}.{kind}", part
        elif name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                yield name, t.detach()
        else:
            yield f"model.{name}", t.detach()


def save_hf_weights(model: Decoder, out_dir: Path, dtype: torch.dtype | None = None,
                    shard_bytes: int = SHARD_BYTES) -> int:
    """Write the model's weights as `model.safetensors`, or HF-named shards plus their index when
    they exceed `shard_bytes`; in `dtype` (default: the model's). Returns the bytes written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype or model.dtype
    shards: list[tuple[Path, list[str]]] = []
    buffer: dict[str, Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = out_dir / f".part-{len(shards):05d}.safetensors"  # the shard count is known at the end
        save_safetensors(buffer, path, metadata={"format": "pt"})
        shards.append((path, list(buffer)))
        buffer.clear()

    for name, t in hf_tensors(model):
        nbytes = t.numel() * torch.empty((), dtype=dtype).element_size()
        if buffer and size + nbytes > shard_bytes:
            flush()
            size = 0
        # clone: safetensors refuses views into a shared storage (the split projections).
        buffer[name] = t.to("cpu", dtype).contiguous().clone()
        size += nbytes
        total += nbytes
    if buffer or not shards:
        flush()
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for (path, keys), final in zip(shards, names):
        path.rename(out_dir / final)
        weight_map.update({k: final for k in keys})
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return total
