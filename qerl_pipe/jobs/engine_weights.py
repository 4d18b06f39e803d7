"""Engine weights: the model stored exactly as the kernels consume it, and loaded without work (no
repacking, no quantization, one copy of each weight). See docs/engine.md, section "The engine artifact"."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from qerl_pipe.errors import ArtifactError
from qerl_pipe.formats.checkpoint import save_safetensors
from qerl_pipe.kernels.base_formats import FORMATS, base_format
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.lora import LoraSpec, apply_lora
from qerl_pipe.strict_json import write_json

# 2: NVFP4 bases in the tiled chunk layout of the CUDA kernels (1 held the Triton kernels' int32 words).
WEIGHTS_FORMAT_VERSION = 2
INDEX_NAME = "engine.safetensors.index.json"
CONFIG_NAME = "config.json"
# Big enough to keep the file count low, small enough that one shard's host copy is cheap.
SHARD_BYTES = 2 * 2**30


def _stored_tensors(model: Decoder) -> dict[str, Tensor]:
    """What the engine stores, by our module names: every persistent tensor but LoRA and a tied head
    (from `state_dict`, on both sides: save and load cannot disagree)."""
    tied = model.config.tie_word_embeddings  # a tied head is the embedding itself
    # Adapters are trained later: the engine is the frozen base.
    return {name: t for name, t in model.state_dict(keep_vars=True).items()
            if ".lora_A." not in name and ".lora_B." not in name and not (tied and name == "lm_head.weight")}


def _host_copy(t: Tensor) -> Tensor:
    """A CPU tensor owning exactly its bytes (safetensors refuses tensors that share storage)."""
    t = t.detach().to("cpu").contiguous()
    owns = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if owns else t.clone()


def save_engine_model(model: Decoder, out_dir: Path, *, hf_config: Mapping[str, Any]) -> None:
    """Write `model`'s base (no LoRA) to `out_dir`: shards, an index and config.json (`hf_config`, the
    model's own, minus `quantization_config`: token ids and the like travel with the engine)."""
    out_dir = Path(out_dir)
    if DecoderConfig.from_hf(hf_config) != model.config:
        raise ValueError("hf_config describes another model than the one being saved")
    # The tensors here are not in that checkpoint layout; a reader must not think they are.
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    tensors = _stored_tensors(model)
    meta = [name for name, t in tensors.items() if t.device.type == "meta"]
    if meta:
        raise ValueError(f"cannot save an engine with unset weights ({meta[0]} is on the meta device)")
    shards = _plan_shards(tensors)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file = f"engine-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors({n: _host_copy(tensors[n]) for n in names}, out_dir / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    index = {"metadata": {"format_version": WEIGHTS_FORMAT_VERSION, "base_format": model.base_format,
                          "base_layout_version": base_format(model.base_format).layout_version,
                          "dtype": str(model.dtype).removeprefix("torch."),
                          "total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    write_json(out_dir / INDEX_NAME, index, indent=1)
    write_json(out_dir / CONFIG_NAME, config)


def _plan_shards(tensors: Mapping[str, Tensor]) -> list[list[str]]:
    """Names per shard, in model order, each shard up to SHARD_BYTES (one bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: cannot read the engine's {what} ({exc}); rebuild it with --force") from None


def load_engine_model(engine_dir: Path, device: torch.device | str, lora: LoraSpec | None = None) -> Decoder:
    """The Decoder stored in `engine_dir`, its tensors placed on `device` as stored; `lora` adds fresh
    adapters (B = 0), as `load_model` does."""
    engine_dir = Path(engine_dir)
    index = _read_json(engine_dir / INDEX_NAME, "weight index")
    meta = index.get("metadata", {})
    if meta.get("format_version") != WEIGHTS_FORMAT_VERSION or meta.get("base_format") not in FORMATS:
        raise ArtifactError(f"{engine_dir}: engine weights format {meta.get('format_version')!r} / base "
                            f"{meta.get('base_format')!r} is not one this version reads; rebuild the engine with "
                            "--force")
    layout, stored = base_format(meta["base_format"]).layout_version, meta.get("base_layout_version", 1)
    if stored != layout:
        raise ArtifactError(f"{engine_dir}: its {meta['base_format']} weights are in layout {stored!r}, this version "
                            f"reads layout {layout} (the bytes changed); rebuild the engine with --force")
    config = DecoderConfig.from_hf(_read_json(engine_dir / CONFIG_NAME, "config.json"))
    device = torch.device(device)
    model = Decoder(config, meta["base_format"], getattr(torch, meta["dtype"]), device)
    _install(model, engine_dir, index["weight_map"], device)
    if lora is not None:
        apply_lora(model, lora)
    return model


def _install(model: Decoder, engine_dir: Path, weight_map: Mapping[str, str], device: torch.device) -> None:
    expected = _stored_tensors(model)
    unknown = sorted(set(weight_map) - set(expected))
    missing = sorted(set(expected) - set(weight_map))
    if unknown or missing:
        raise ArtifactError(f"{engine_dir}: the stored tensors do not match the model (missing {missing[:3]}, "
                            f"unexpected {unknown[:3]}); rebuild the engine with --force")
    fields = base_format(model.base_format).buffers  # a QuantLinear's base buffers
    pending: dict[str, dict[str, Tensor]] = {}  # QuantLinear name -> base buffers read so far
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(engine_dir / file), framework="pt", device="cpu") as fh:
                for name in names:
                    _place(model, name, fh.get_tensor(name), expected[name], fields, pending, device)
    if pending:  # cannot happen after the name check above, unless a base has a new field
        module_name, parts = next(iter(pending.items()))
        raise ArtifactError(f"{engine_dir}: {module_name} lacks {sorted(set(fields) - set(parts))}")


def _place(model: Decoder, name: str, t: Tensor, target: Tensor, fields: tuple[str, ...],
           pending: dict[str, dict[str, Tensor]], device: torch.device) -> None:
    if t.shape != target.shape or t.dtype != target.dtype:
        raise ArtifactError(f"engine tensor {name} is {tuple(t.shape)} {t.dtype}, the model needs "
                            f"{tuple(target.shape)} {target.dtype}; rebuild the engine with --force")
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, QuantLinear) and attr in fields:
        # Bases are on the meta device until set: the tensor goes straight to its device.
        parts = pending.setdefault(module_name, {})
        parts[attr] = t.to(device)
        if len(parts) == len(fields):
            del pending[module_name]
            module.set_base(module.fmt.make_container(parts, module.out_features, module.in_features))
        return
    target.copy_(t)  # embedding, norms, biases, lm_head: allocated by the Decoder on `device`
