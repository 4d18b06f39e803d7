"""A LoRA adapter merged into a Hugging Face checkpoint as it streams (LoRA added in float32,
trained norms swapped in), written dense or through the NVFP4 writer (`write_merged`: export's
merged-bf16 and merged-nvfp4); host memory stays near one output shard plus one fused group.
See docs/export.md, sections "merged-bf16", "merged-nvfp4" and "Memory"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qerl_pipe.errors import ArtifactError
from qerl_pipe.formats.checkpoint import ShardWriter, cast_floating, iter_quantized_checkpoint, list_shards, open_shard
from qerl_pipe.formats.modelopt_writer import NVFP4StreamWriter, write_configs, write_dense_config
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4
from qerl_pipe.model.load import IGNORED_SUFFIXES  # recomputed by every loader
from qerl_pipe.model.lora import merge_lora
from qerl_pipe.log import progress
from qerl_pipe.model.peft import LoraTensors


def _base_names(base_dir: Path) -> set[str]:
    """The parameter names a dense stream of `base_dir` yields (headers only, no tensor is read)."""
    names = set()
    for shard in list_shards(base_dir):
        with open_shard(shard) as fh:
            for key in fh.keys():
                module, _, suffix = key.rpartition(".")
                if suffix == "weight_packed":  # compressed-tensors NVFP4
                    names.add(f"{module}.weight")
                elif suffix not in ("weight_scale", "weight_scale_2", "input_scale", "weight_global_scale",
                                    "input_global_scale"):
                    names.add(key)
    return names


def check_adapter_fits_checkpoint(adapter: LoraTensors, base_dir: Path) -> None:
    """Refuse, before anything is written, an adapter naming tensors the checkpoint lacks."""
    names = _base_names(base_dir)
    missing = sorted((adapter.lora.keys() | adapter.norms.keys()) - names)
    if missing:
        raise ArtifactError(f"the run's adapter has {missing[0]} (and {len(missing) - 1} more) that the base in "
                            f"{base_dir} lacks: the adapter was trained over another model")


def merged_tensors(base_dir: Path, adapter: LoraTensors) -> Iterator[tuple[str, Tensor, bool]]:
    """(HF name, tensor, changed) over the base, LoRA merged (float32) and trained norms swapped in."""
    for name, item, _input_scale in iter_quantized_checkpoint(base_dir):
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if isinstance(item, NVFP4Weight):
            # The values our NVFP4 model computes with (x @ dequantize(W)^T), in float32.
            name, item = f"{name}.weight", dequantize_nvfp4(item)
        if name in adapter.lora:
            a, b = adapter.lora[name]
            if b.shape[0] != item.shape[0] or a.shape[1] != item.shape[1]:
                raise ArtifactError(f"{name}: LoRA B {tuple(b.shape)} / A {tuple(a.shape)} do not fit the base weight "
                                    f"{tuple(item.shape)}; the adapter was trained over another model")
            yield name, merge_lora(item, a, b, adapter.scaling), True
        elif name in adapter.norms:
            yield name, adapter.norms[name].float(), True
        else:
            yield name, item, False


def write_merged(base_dir: Path, adapter: LoraTensors, out: Path, dtype: torch.dtype,
                 nvfp4_exclude: list[str] | None = None, input_scales: dict[str, Tensor] | None = None,
                 full: bool = False) -> dict[str, Any]:
    """Merge `adapter` into the checkpoint in `base_dir` and write it into `out`: dense in `dtype`,
    or NVFP4 (modelopt's layout) when `nvfp4_exclude` lists the modules to keep 16-bit, with
    `input_scales` for W4A4 (none: W4A16). With `full`, the base is a fully trained model and the
    adapter empty: every tensor counts as changed. Returns the figures of the export's summary."""
    input_scales = input_scales or {}
    writer = ShardWriter(out)
    sink = NVFP4StreamWriter(writer, nvfp4_exclude, dtype, input_scales) if nvfp4_exclude is not None else None
    changed = 0
    for name, tensor, was_changed in progress(merged_tensors(base_dir, adapter), "merge"):
        changed += was_changed or full
        if sink is not None:
            sink.add(name, tensor)
        else:
            writer.add(name, cast_floating(tensor, dtype))
    summary: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."), "merged_linears": len(adapter.lora),
        "trained_norms": len(adapter.norms), "changed_tensors": changed,
    }
    if sink is None:
        writer.finish()
        write_dense_config(base_dir, out, dtype)
        return summary
    sink.finish()
    quant_algo = "NVFP4" if input_scales else "W4A16_NVFP4"
    write_configs(base_dir, out, quant_algo, sorted({"lm_head", *sink.excluded}), dtype)
    errors = sink.errors
    summary.update({"quant_algo": quant_algo, "quantized_linears": len(errors),
                    "mean_relative_error": sum(errors.values()) / max(1, len(errors)),
                    "max_relative_error": max(errors.values(), default=0.0)})
    return summary
