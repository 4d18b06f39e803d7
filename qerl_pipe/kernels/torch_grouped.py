"""torch's grouped GEMM over a MoE layer's stacked experts: one launch per projection, no host sync. The
experts' buffers are views of one stack (no second copy); an NVFP4 stack is dequantized in one launch (global
scales applied after the GEMM), again for dX; the same bits every run. docs/kernels.md, "MoE experts and routing"."""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_pipe.formats.nvfp4 import dequantize_nvfp4
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import ROWS, TiledNVFP4, untile_nvfp4


def runs_here(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM serves `dtype` activations on `device`: bf16 on a CUDA GPU of
    sm_90 or later (on older GPUs and the CPU it exists only as a slow reference)."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


class StackedExperts:
    """E experts' frozen weights of one projection: `weight` [E, N, K] (a dense base), or an
    NVFP4 stack in the tiled layout (`qweight` [E, nb, kc, 256], `scales` [E, nb, kc, 128],
    `global_scale` [E, 1])."""

    def __init__(self, out_features: int, in_features: int, weight: Tensor | None = None,
                 qweight: Tensor | None = None, scales: Tensor | None = None, global_scale: Tensor | None = None):
        if (weight is None) == (qweight is None):
            raise ValueError("stacked experts hold either a dense weight or an NVFP4 stack")
        self.weight, self.qweight, self.scales, self.global_scale = weight, qweight, scales, global_scale
        stack = weight if weight is not None else qweight
        self.num_experts, self.out_features, self.in_features = stack.shape[0], out_features, in_features
        # The unit global scale the stack is dequantized with: made now, not inside a graph capture.
        self._one = torch.ones(1, dtype=torch.float32, device=stack.device)

    @property
    def nbytes(self) -> int:
        return 0  # views of the experts' own buffers

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The experts as [E, N, K] in `dtype`; an NVFP4 stack without its global scales
        (`row_scales` applies them to the outputs)."""
        if self.weight is not None:
            return self.weight.to(dtype)
        e, nb, kc, _ = self.qweight.shape
        n, k = self.out_features, self.in_features
        if dtype == torch.bfloat16 and cuda_ext.available(self.qweight.device):
            flat = TiledNVFP4(self.qweight.view(e * nb, kc, -1), self.scales.view(e * nb, kc, -1),
                              self._one, e * nb * ROWS, k)
            return cuda_ext.dequantize(flat).view(e, nb * ROWS, k)[:, :n].contiguous()
        # Elsewhere (the CPU, the tests' reference): expert by expert, from the checkpoint form.
        return torch.stack([dequantize_nvfp4(untile_nvfp4(TiledNVFP4(self.qweight[i], self.scales[i],
                                                                     self._one, n, k)), dtype)
                            for i in range(e)])

    def row_scales(self, offsets: Tensor, rows: int, dtype: torch.dtype) -> Tensor | None:
        """Each output row's global scale [R, 1] (rows sorted by expert, expert e's at
        offsets[e]:offsets[e + 1]); None for a dense stack."""
        if self.global_scale is None:
            return None
        expert = torch.searchsorted(offsets[1:], torch.arange(rows, device=offsets.device), right=True)
        return self.global_scale.reshape(-1)[expert.clamp_(max=self.num_experts - 1)].to(dtype)[:, None]

    def runs_grouped_w4a16(self, rows: Tensor, max_rows: int | None) -> bool:
        """Whether `matmul` runs our grouped W4A16 GEMM on the 4-bit stack: an NVFP4 stack, bf16 rows without
        autograd on a GPU our kernels run on, at most `cuda_ext.MAX_PASS_TOKENS` rows per expert (decode steps)."""
        return (self.qweight is not None and max_rows is not None and max_rows <= cuda_ext.MAX_PASS_TOKENS
                and not (torch.is_grad_enabled() and rows.requires_grad) and rows.dtype == torch.bfloat16
                and cuda_ext.available(rows.device))

    def matmul(self, rows: Tensor, offsets: Tensor, deterministic: bool = True, active: Tensor | None = None,
               max_rows: int | None = None) -> Tensor:
        """`rows [R, K]`, sorted by expert, expert e's rows at offsets[e]:offsets[e + 1] (`offsets` [E + 1] int64
        on the device) -> `[R, N]`, differentiable in `rows` (the experts are frozen); deterministic (no split-K).
        Where `runs_grouped_w4a16`, our grouped W4A16 GEMM: no per-call dequantize of every expert."""
        if self.runs_grouped_w4a16(rows, max_rows):
            return cuda_ext.grouped_gemm(rows, self.qweight, self.scales, self.global_scale, offsets,
                                         self.out_features, self.in_features, max_rows, active)
        ends = offsets[1:].to(torch.int32)  # torch takes each group's end offset, as int32
        return _FrozenGrouped.apply(rows, ends, self.row_scales(offsets, rows.shape[0], rows.dtype), self)


class _FrozenGrouped(torch.autograd.Function):
    """y = rows @ W_e^T per expert group (times the rows' global scales); backward: dX only,
    from the weights dequantized again (none kept between forward and backward)."""

    @staticmethod
    def forward(ctx, rows: Tensor, ends: Tensor, scale: Tensor | None, experts: StackedExperts) -> Tensor:
        ctx.experts = experts
        ctx.save_for_backward(ends, scale)
        y = torch._grouped_mm(rows, experts.dense(rows.dtype).transpose(1, 2), offs=ends)
        return y if scale is None else y * scale

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, None, None, None]:
        ends, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        dy = dy if scale is None else dy * scale
        return torch._grouped_mm(dy.contiguous(), ctx.experts.dense(dy.dtype), offs=ends), None, None, None
