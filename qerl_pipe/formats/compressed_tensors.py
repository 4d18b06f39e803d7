"""compressed-tensors `nvfp4-pack-quantized` layout (llm-compressor's NVFP4, used by QeRL's
checkpoints), read into `NVFP4Weight`: codes and block scales carry over, the global scale is
the reciprocal of its `weight_global_scale`. Only the reader is here.
See docs/formats.md, section 'Layout 2: compressed-tensors `nvfp4-pack-quantized` (what we read)'."""

from __future__ import annotations

from torch import Tensor

from qerl_pipe.formats.nvfp4 import NVFP4Weight

FORMAT = "nvfp4-pack-quantized"
WEIGHT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
INPUT_SUFFIX = "input_global_scale"


def exact_reciprocal(x: Tensor) -> Tensor:
    # In float64 then rounded once: the closest fp32 to the exact reciprocal.
    return (1.0 / x.double()).float()


def nvfp4_from_compressed(tensors: dict[str, Tensor]) -> tuple[NVFP4Weight, Tensor | None]:
    """One module's tensors, keyed by suffix (`weight_packed`, ...), to (weight, input_scale)."""
    weight = NVFP4Weight(tensors["weight_packed"], tensors["weight_scale"],
                         exact_reciprocal(tensors["weight_global_scale"]).reshape(()))
    input_global = tensors.get(INPUT_SUFFIX)
    input_scale = None if input_global is None else exact_reciprocal(input_global).reshape(())
    return weight, input_scale
