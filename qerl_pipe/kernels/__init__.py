"""4-bit weight-only matmuls (NVFP4, NF4): our CUDA kernels and bitsandbytes on GPUs, plain torch elsewhere.
`nvfp4_linear(x, w)` = x @ W^T, `nvfp4_linear_dx(dy, w)` = dy @ W (`nf4_*` the same); `w` is the checkpoint
container or the layout a linear holds (`tile_nvfp4`, `prepare_nf4`). docs/kernels.md, the opening section."""

from qerl_pipe.kernels.linear import nf4_linear, nf4_linear_dx, nvfp4_linear, nvfp4_linear_dx

__all__ = ["nf4_linear", "nf4_linear_dx", "nvfp4_linear", "nvfp4_linear_dx"]
