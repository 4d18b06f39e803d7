"""4-bit weight-only matmuls (NVFP4, NF4) for Hopper: CUDA and Triton on GPUs, plain torch elsewhere.

`nvfp4_linear(x, w)` = x @ W^T, `nvfp4_linear_dx(dy, w)` = dy @ W (`nf4_*` the same); `w` is the
checkpoint container or a kernel layout (`tile_nvfp4`, `prepare_*`). See docs/kernels.md,
section "Kernels: NVFP4 / NF4 weight-only matmul on Hopper" (the opening section)."""

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
