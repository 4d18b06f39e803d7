"""humming-kernels' grouped GEMM over a MoE layer's experts (NVFP4): one launch per projection. The row offsets
stay on the device (no host sync); inference only, no per-expert LoRA; the schedule follows the dispatch
column. See docs/kernels.md, section "MoE experts and routing"."""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_pipe.formats.nvfp4 import NVFP4Weight
from qerl_pipe.kernels.torch_grouped import StackedExperts

_INVARIANT = '{"gemm_type": "grouped_contiguous", "use_batch_invariant": true}'
_DEFAULT = '{"gemm_type": "grouped_contiguous", "use_batch_invariant": false}'


class HummingExperts:
    """E experts' NVFP4 weights `[N, K]` of one projection in humming's layout."""

    def __init__(self, weights: list[NVFP4Weight]):
        from humming.layer import HummingLayer

        first = weights[0]
        if any((w.out_features, w.in_features) != (first.out_features, first.in_features) for w in weights):
            raise ValueError("grouped experts must share one weight shape")
        self.num_experts, self.out_features, self.in_features = len(weights), first.out_features, first.in_features
        with torch.device(first.packed.device):
            layer = HummingLayer(shape_n=self.out_features, shape_k=self.in_features, num_experts=self.num_experts,
                                 weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"},
                                 torch_dtype=torch.bfloat16)
        scale_2 = torch.stack([w.global_scale.reshape(1).float() for w in weights])
        layer.load_from_tensors({"weight": torch.stack([w.packed for w in weights]),
                                 "weight_scale": torch.stack([w.block_scales for w in weights]),
                                 "weight_scale_2": scale_2.reshape(layer.weight_scale_2.shape)})
        layer.transform()
        self.layer = layer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layer.parameters())

    def matmul(self, rows: Tensor, offsets: Tensor, deterministic: bool = True, active: Tensor | None = None,
               max_rows: int | None = None) -> Tensor:
        """`rows [R, K]` bf16, sorted by expert, expert e's rows at offsets[e]:offsets[e + 1] (`offsets` [E + 1]
        int64 on the device, offsets[E] = R) -> `[R, N]` (humming sizes its own grid: no `active`, `max_rows`)."""
        return self.layer(rows, expert_layout=offsets, compute_config=_INVARIANT if deterministic else _DEFAULT)

    def compile(self, deterministic: bool) -> None:
        """Compile the schedule's kernels now, not inside a graph capture."""
        device = self.layer.weight.device
        rows = torch.zeros(1, self.in_features, dtype=torch.bfloat16, device=device)
        offsets = torch.ones(self.num_experts + 1, dtype=torch.int64, device=device)
        offsets[0] = 0
        self.matmul(rows, offsets, deterministic)


# Rows per expert up to which our grouped W4A16 GEMM on the stack beats humming's copy (Qwen3-30B-A3B on an
# H100: faster at 1 and 8 tokens, 3x slower at 64): docs/benchmarks.md, "Qwen3-30B-A3B (issue 35)".
FEW_ROWS = 8


class HummingOrStack:
    """A projection's experts served by humming's copy, or by our grouped W4A16 GEMM on the NVFP4
    stack where each expert gets at most `FEW_ROWS` rows (a decode step of up to 8 sequences)."""

    def __init__(self, humming: HummingExperts, stack: StackedExperts):
        self.humming, self.stack = humming, stack
        self.num_experts = humming.num_experts

    @property
    def nbytes(self) -> int:
        return self.humming.nbytes  # the stack is the experts' own buffers

    def matmul(self, rows: Tensor, offsets: Tensor, deterministic: bool = True, active: Tensor | None = None,
               max_rows: int | None = None) -> Tensor:
        if active is not None and max_rows is not None and max_rows <= FEW_ROWS \
                and self.stack.runs_grouped_w4a16(rows, max_rows):  # the cheap tests first: a decode step's path
            return self.stack.matmul(rows, offsets, deterministic, active, max_rows)
        return self.humming.matmul(rows, offsets, deterministic)

    def compile(self, deterministic: bool) -> None:
        self.humming.compile(deterministic)
