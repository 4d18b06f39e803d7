"""The engine's inference copy of the model's LoRA adapters, fused per linear: A of every adapted
projection stacked [R, K], B block-diagonal [N, R] with the scaling folded in, R padded to the GEMM
epilogue's multiple. `refresh()` copies the parameters in place at every `generate` (graphs stay
valid); `project` runs a linear's base (or its FP8 copy) and the adapter's expand. Never
differentiated. docs/engine.md#lora-aqn-noise-and-cuda-graphs and docs/model.md."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qerl_pipe.engine.fp8 import Fp8Linears
from qerl_pipe.kernels.cuda_ext import LORA_RANK_MULTIPLE
from qerl_pipe.kernels.fp8 import Fp8Rows
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.moe import inference_modules


class FusedLora:
    """`fp8`: the FP8 copies of the bases (`engine.fp8`) where the rollout runs FP8 activations;
    `project` sends them the rows they serve, and the adapter stays bf16 on top."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, fp8: Fp8Linears | None = None):
        self.model, self.dtype, self.fp8 = model, dtype, fp8
        self._copies: dict[QuantLinear, tuple[Tensor, Tensor]] = {}

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy every adapter's current A/B into the fused buffers: in place where the adapter's
        shape is unchanged, new buffers where it is new (a fresh adapter, another rank). Experts
        that run grouped carry no adapter (`model.kernel_copies`) and are not visited."""
        seen = set()
        for m in inference_modules(self.model):
            if not isinstance(m, QuantLinear) or len(m.lora_A) == 0:
                continue
            seen.add(m)
            names = [n for n in m.names if n in m.lora_A]
            width = m.lora_rank * len(names)
            stacked = -(-width // LORA_RANK_MULTIPLE) * LORA_RANK_MULTIPLE
            a_shape, b_shape = (stacked, m.in_features), (m.out_features, stacked)
            pair = self._copies.get(m)
            if pair is None or pair[0].shape != a_shape or pair[1].shape != b_shape:
                device = m.lora_A[names[0]].device
                pair = self._copies[m] = (torch.zeros(a_shape, dtype=self.dtype, device=device),
                                          torch.zeros(b_shape, dtype=self.dtype, device=device))
            a, b = pair  # the scaling folded into B in float32, then rounded once
            a[:width].copy_(torch.cat([m.lora_A[n] for n in names]))
            b[:, :width].copy_(m.block_diagonal_b(names, torch.float32) * m.lora_scaling)
        self._copies = {m: pair for m, pair in self._copies.items() if m in seen}

    def _active(self, linear: QuantLinear) -> tuple[Tensor, Tensor] | None:
        """The linear's fused (A, B), or None: no adapter, or adapters switched off."""
        return self._copies.get(linear) if linear.lora_enabled else None

    def shrink_of(self, linear: QuantLinear) -> Tensor | None:
        """The stacked A [R, in_features] of the linear's active adapters, or None: what a kernel
        upstream may multiply in already (`project`'s u)."""
        pair = self._active(linear)
        return None if pair is None else pair[0]

    def runs_fp8(self, linear: QuantLinear, rows: int) -> bool:
        """Whether `project` runs `rows` rows of `linear` on its FP8 copy (so a kernel upstream
        should write their E4M3 codes)."""
        return self.fp8 is not None and self.fp8.serves(linear, rows)

    def project(self, linear: QuantLinear, x: Tensor, u: Tensor | None = None, q: Fp8Rows | None = None) -> Tensor:
        """x [..., in_features] through the linear: its base (+ bias), then its adapter fused.
        `u`, if given, is x @ shrink_of(linear)^T computed upstream (rows as x's); `q`, x's E4M3
        rows computed upstream (used where the FP8 copy serves these rows)."""
        x2 = x.reshape(-1, linear.in_features)
        pair = self._active(linear)
        lora = None
        if pair is not None:
            a, b = pair
            lora = (x2 @ a.t() if u is None else u.reshape(-1, a.shape[0]), b)
        if self.runs_fp8(linear, x2.shape[0]):
            y = self.fp8.forward(linear, x2, q, lora)
        else:
            y = linear.inference_forward(x2, lora)
        return y.reshape(*x.shape[:-1], linear.out_features)

    def addresses(self) -> tuple[int, ...]:
        """Where the copies live: a captured CUDA graph is valid only while these are unchanged."""
        return tuple(t.data_ptr() for pair in self._copies.values() for t in pair)
