"""Writing llm-compressor's compressed-tensors NVFP4 layout, for test fixtures: the package only
reads it (qerl_pipe/formats/compressed_tensors.py), so the writer lives with the tests."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from qerl_pipe.formats.compressed_tensors import FORMAT, INPUT_SUFFIX, exact_reciprocal
from qerl_pipe.formats.nvfp4 import BLOCK_SIZE, NVFP4Weight


def compressed_nvfp4_tensors(prefix: str, w: NVFP4Weight, input_scale: Tensor | None) -> dict[str, Tensor]:
    """The safetensors entries of one quantized linear `prefix` in the compressed-tensors layout."""
    tensors = {
        f"{prefix}.weight_packed": w.packed,
        f"{prefix}.weight_scale": w.block_scales,
        f"{prefix}.weight_global_scale": exact_reciprocal(w.global_scale).reshape(1),
    }
    if input_scale is not None:
        tensors[f"{prefix}.{INPUT_SUFFIX}"] = exact_reciprocal(input_scale).reshape(1)
    return tensors


def _fp4_args(dynamic: bool | str) -> dict[str, Any]:
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor_group",
        "group_size": BLOCK_SIZE,
        "dynamic": dynamic,
        "observer": "minmax",
        "observer_kwargs": {},
        "actorder": None,
        "block_structure": None,
    }


def compressed_tensors_config(exclude_modules: list[str], weight_only: bool) -> dict[str, Any]:
    """The `quantization_config` block of config.json, as llm-compressor writes it for NVFP4."""
    group: dict[str, Any] = {
        "targets": ["Linear"],
        "weights": _fp4_args(dynamic=False),
        # W4A4 activations get per-block scales at run time ("local") under a static global scale.
        "input_activations": None if weight_only else _fp4_args(dynamic="local"),
        "output_activations": None,
        "format": FORMAT,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": sorted(exclude_modules),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
