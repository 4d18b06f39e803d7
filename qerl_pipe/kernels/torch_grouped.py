"""torch's grouped GEMM over a MoE layer's bf16 experts: one launch per projection, no host sync.

The bf16 counterpart of `kernels.humming_experts` (the NVFP4 engine's), so the bf16 baseline's
MoE rollout runs the way a bf16 MoE is served (one grouped GEMM over the routed rows, as vLLM's
fused MoE does), not a per-expert loop: the NVFP4 / bf16 ratios compare grouped with grouped.

`torch._grouped_mm(rows [R, K], w [E, K, N], offs [E])` runs expert e on rows offs[e - 1]:offs[e]
(CUTLASS on sm_90, no split-K: the same bits every run). It reads the experts as one [E, N, K]
tensor, so the layer's expert weights are stacked once and each expert's weight becomes a view of
its slice: no second copy of the bf16 experts (a 30B-A3B's are 57 GB).
"""

from __future__ import annotations

import torch
from torch import Tensor


def runs_here(device: torch.device) -> bool:
    """Whether torch's grouped GEMM serves bf16 on `device`: a CUDA GPU of sm_90 or later (on
    older GPUs and the CPU it exists only as a slow reference)."""
    return (device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


class TorchGroupedExperts:
    """E experts' dense weights of one projection, stacked `[E, N, K]`."""

    def __init__(self, stacked: Tensor):
        if stacked.dim() != 3:
            raise ValueError(f"grouped experts need a stacked [experts, out, in] weight; got {tuple(stacked.shape)}")
        self.stacked = stacked
        self.num_experts, self.out_features, self.in_features = stacked.shape

    @property
    def nbytes(self) -> int:
        return 0  # views of the experts' own weights

    def matmul(self, rows: Tensor, offsets: Tensor, deterministic: bool = True) -> Tensor:
        """`rows [R, K]`, sorted by expert, expert e's rows at offsets[e]:offsets[e + 1] (`offsets`
        [E + 1] int64 on the device) -> `[R, N]`. Deterministic either way (no split-K)."""
        ends = offsets[1:].to(torch.int32)  # torch takes each group's end offset, as int32
        return torch._grouped_mm(rows, self.stacked.transpose(1, 2), offs=ends)
