"""compressed-tensors `nvfp4-pack-quantized` layout (llm-compressor's NVFP4, used by QeRL's checkpoints).

Per quantized linear `<m>`: `<m>.weight_packed` U8 [out, in/2] (same nibble order as modelopt),
`<m>.weight_scale` F8_E4M3 [out, in/16], `<m>.weight_global_scale` F32 [1] and, for W4A4,
`<m>.input_global_scale` F32 [1]. Its global scales are *reciprocals* of modelopt's:
`weight_global_scale = 2688 / amax`, and it dequantizes as `code * weight_scale / weight_global_scale`.
Reading converts to `NVFP4Weight` (global_scale = 1 / weight_global_scale); codes and block-scale
bytes carry over unchanged, the fp32 reciprocal may differ from the exact quotient by one ulp.

The writer exists so tests can build such checkpoints without llm-compressor.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from qerl_pipe.formats.nvfp4 import BLOCK_SIZE, NVFP4Weight

FORMAT = "nvfp4-pack-quantized"
WEIGHT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
INPUT_SUFFIX = "input_global_scale"


def _reciprocal(x: Tensor) -> Tensor:
    # In float64 then rounded once: the closest fp32 to the exact reciprocal.
    return (1.0 / x.double()).float()


def nvfp4_from_compressed(tensors: dict[str, Tensor]) -> tuple[NVFP4Weight, Tensor | None]:
    """One module's tensors, keyed by suffix (`weight_packed`, ...), to (weight, input_scale)."""
    weight = NVFP4Weight(
        packed=tensors["weight_packed"],
        block_scales=tensors["weight_scale"],
        global_scale=_reciprocal(tensors["weight_global_scale"]).reshape(()),
    )
    input_global = tensors.get(INPUT_SUFFIX)
    input_scale = None if input_global is None else _reciprocal(input_global).reshape(())
    return weight, input_scale


def compressed_nvfp4_tensors(prefix: str, w: NVFP4Weight, input_scale: Tensor | None) -> dict[str, Tensor]:
    """The safetensors entries of one quantized linear `prefix` in the compressed-tensors layout."""
    tensors = {
        f"{prefix}.weight_packed": w.packed,
        f"{prefix}.weight_scale": w.block_scales,
        f"{prefix}.weight_global_scale": _reciprocal(w.global_scale).reshape(1),
    }
    if input_scale is not None:
        tensors[f"{prefix}.{INPUT_SUFFIX}"] = _reciprocal(input_scale).reshape(1)
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
