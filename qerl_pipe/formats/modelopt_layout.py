"""NVIDIA Model Optimizer's "unified HF" NVFP4 checkpoint layout (what vLLM and TensorRT-LLM load):
the tensors of a quantized linear and the config blocks, key for key as modelopt writes them.
See docs/formats.md, section 'Layout 1: modelopt "unified HF" (what we write)'."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from qerl_pipe.errors import QuantizationError
from qerl_pipe.formats.nvfp4 import BLOCK_SIZE, NVFP4Weight

PRODUCER_NAME = "qerl-pipe"
# W4A4 (Blackwell) and weight-only W4A16 (what Hopper runs).
QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")

def nvfp4_tensors(prefix: str, w: NVFP4Weight, input_scale: Tensor | None) -> dict[str, Tensor]:
    """The safetensors entries of one quantized linear `prefix` (a module name, no `.weight`)."""
    tensors = {f"{prefix}.weight": w.packed, f"{prefix}.weight_scale": w.block_scales,
               f"{prefix}.weight_scale_2": w.global_scale.float().reshape(())}
    if input_scale is not None:
        tensors[f"{prefix}.input_scale"] = input_scale.float().reshape(())
    return tensors


def _check_algo(quant_algo: str) -> None:
    if quant_algo not in QUANT_ALGOS:
        raise QuantizationError(f"unknown NVFP4 quant_algo {quant_algo!r}; use one of {', '.join(QUANT_ALGOS)}")


def _producer(producer_version: str) -> dict[str, str]:
    return {"name": PRODUCER_NAME, "version": producer_version}


def hf_quant_config(quant_algo: str, exclude_modules: list[str], producer_version: str) -> dict[str, Any]:
    """Contents of `hf_quant_config.json` (TensorRT-LLM reads it; vLLM needs all four keys)."""
    _check_algo(quant_algo)
    return {"producer": _producer(producer_version),
            "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "group_size": BLOCK_SIZE,
                             "exclude_modules": sorted(exclude_modules)}}  # modelopt sorts them too


def config_quantization_config(quant_algo: str, exclude_modules: list[str], producer_version: str) -> dict[str, Any]:
    """The `quantization_config` block of config.json (vLLM reads it first)."""
    _check_algo(quant_algo)
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}
    group: dict[str, Any] = {}
    if quant_algo == "NVFP4":
        group["input_activations"] = dict(fp4)
    group["weights"] = dict(fp4)
    group["targets"] = ["Linear"]
    return {"config_groups": {"group_0": group}, "ignore": sorted(exclude_modules), "quant_algo": quant_algo,
            "producer": _producer(producer_version), "quant_method": "modelopt"}
