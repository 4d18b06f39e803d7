"""4-bit weight-only matmuls (NVFP4, NF4) for Hopper: CUDA and Triton on GPUs, plain torch elsewhere.

- `nvfp4_linear(x, w)` = x @ W^T, `nvfp4_linear_dx(dy, w)` = dy @ W; same pair for NF4.
  `w` is the checkpoint container or a kernel layout: `tile_nvfp4` (the CUDA kernels' chunk
  layout, what models hold) or `prepare_*` (the Triton words, cached per weight).
- Launch configs come from a table keyed by (op, format, M bucket[, N, K]); see `configs`.
- docs/kernels.md has the design, the roofline and the measured H200 numbers.
"""

from qerl_pipe.kernels.configs import (
    ConfigTable,
    KernelConfig,
    default_table,
    get_config,
    set_table,
)
from qerl_pipe.kernels.linear import nf4_linear, nf4_linear_dx, nvfp4_linear, nvfp4_linear_dx
from qerl_pipe.kernels.packing import (
    PackedNF4,
    PackedNVFP4,
    prepare_nf4,
    prepare_nvfp4,
    prepared_nf4,
    prepared_nvfp4,
)
from qerl_pipe.kernels.tiled import TiledNVFP4, tile_nvfp4, untile_nvfp4

__all__ = [
    "ConfigTable",
    "KernelConfig",
    "PackedNF4",
    "PackedNVFP4",
    "default_table",
    "get_config",
    "nf4_linear",
    "nf4_linear_dx",
    "nvfp4_linear",
    "nvfp4_linear_dx",
    "prepare_nf4",
    "prepare_nvfp4",
    "prepared_nf4",
    "prepared_nvfp4",
    "set_table",
    "TiledNVFP4",
    "tile_nvfp4",
    "untile_nvfp4",
]
