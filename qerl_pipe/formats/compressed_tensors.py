"""compressed-tensors `nvfp4-pack-quantized` layout (llm-compressor's NVFP4, used by QeRL's checkpoints).

Per quantized linear `<m>`: `<m>.weight_packed` U8 [out, in/2] (same nibble order as modelopt),
`<m>.weight_scale` F8_E4M3 [out, in/16], `<m>.weight_global_scale` F32 [1] and, for W4A4,
`<m>.input_global_scale` F32 [1]. Its global scales are *reciprocals* of modelopt's:
`weight_global_scale = 2688 / amax`, and it dequantizes as `code * weight_scale / weight_global_scale`.
Reading converts to `NVFP4Weight` (global_scale = 1 / weight_global_scale); codes and block-scale
bytes carry over unchanged, the fp32 reciprocal may differ from the exact quotient by one ulp.

Only the reader is here; tests build such checkpoints with tests/compressed_tensors_writer.py.
"""

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
    weight = NVFP4Weight(
        packed=tensors["weight_packed"],
        block_scales=tensors["weight_scale"],
        global_scale=exact_reciprocal(tensors["weight_global_scale"]).reshape(()),
    )
    input_global = tensors.get(INPUT_SUFFIX)
    input_scale = None if input_global is None else exact_reciprocal(input_global).reshape(())
    return weight, input_scale
