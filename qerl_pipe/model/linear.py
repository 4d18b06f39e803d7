"""QuantLinear: a frozen base weight (bf16, NVFP4 or NF4) plus unmerged LoRA, one per projection.

One QuantLinear may hold several projections fused along the output dimension (q/k/v, gate/up):
one base matmul reads the input once. LoRA stays per projection (its own A and B), so q, k and v
are separate LoRA targets and the adapter exports to PEFT as is.

4-bit bases are stored only in the kernels' layout (NVFP4: the chunk layout of `kernels.tiled`
that the CUDA kernels read; NF4: `kernels.packing`'s int32 words), converted once when the base
is set: keeping the checkpoint bytes too would double the weight memory, and converting per call
would cost a repack every forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, Union

import torch
from torch import Tensor, nn

from qerl_pipe.formats.nf4 import NF4_BLOCK, NF4Weight
from qerl_pipe.formats.nvfp4 import BLOCK_SIZE, NVFP4Weight
from qerl_pipe.kernels import (
    PackedNF4,
    PackedNVFP4,
    nf4_linear,
    nf4_linear_dx,
    nvfp4_linear,
    nvfp4_linear_dx,
    prepare_nf4,
)
from qerl_pipe.kernels.packing import unprepare_nf4, unprepare_nvfp4
from qerl_pipe.kernels.tiled import TiledNVFP4, tile_nvfp4, tiled_shapes, untile_nvfp4

BaseFormat = Literal["bf16", "nvfp4", "nf4"]
BASE_FORMATS: tuple[str, ...] = ("bf16", "nvfp4", "nf4")
BaseWeight = Union[Tensor, NVFP4Weight, NF4Weight]
KernelWeight = Union[TiledNVFP4, PackedNF4]

_KERNELS: dict[str, tuple[Callable, Callable]] = {
    "nvfp4": (nvfp4_linear, nvfp4_linear_dx),
    "nf4": (nf4_linear, nf4_linear_dx),
}


class _FrozenQuantMatmul(torch.autograd.Function):
    """y = x @ W^T for a frozen quantized W; backward returns dX = dY @ W and nothing for W.

    Only the reference to the packed weight is kept for backward (it lives in the module anyway):
    no activation and no dequantized weight is saved, so the training forward costs no more memory
    than the bf16 one and dX reads 4-bit weights again.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: KernelWeight, matmul: Callable, matmul_dx: Callable) -> Tensor:
        ctx.w, ctx.matmul_dx = w, matmul_dx
        return matmul(x, w)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, None, None, None]:
        dx = ctx.matmul_dx(dy.contiguous(), ctx.w) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


# Buffer names of each base format, in the field order of its kernel container.
_BASE_BUFFERS = {
    "bf16": ("weight",),
    "nvfp4": ("qweight", "scales", "global_scale"),
    "nf4": ("qweight", "absmax", "code"),
}


def _empty_base(fmt: str, n: int, k: int, dtype: torch.dtype) -> dict[str, Tensor]:
    """Base buffers on the meta device, with the shapes `fmt` stores for an [n, k] weight."""
    meta = torch.device("meta")
    if fmt == "bf16":
        return {"weight": torch.empty(n, k, dtype=dtype, device=meta)}
    if fmt == "nvfp4":
        if k % BLOCK_SIZE:
            raise ValueError(f"NVFP4 needs in_features divisible by {BLOCK_SIZE}, got {k}")
        words, scales = tiled_shapes(n, k)
        return {
            "qweight": torch.empty(words, dtype=torch.int32, device=meta),
            "scales": torch.empty(scales, dtype=torch.uint8, device=meta),
            "global_scale": torch.empty(1, dtype=torch.float32, device=meta),
        }
    if fmt == "nf4":
        return {
            "qweight": torch.empty(n, k // 8, dtype=torch.int32, device=meta),
            "absmax": torch.empty(n, k // NF4_BLOCK, dtype=torch.float32, device=meta),
            "code": torch.empty(16, dtype=torch.float32, device=meta),
        }
    raise ValueError(f"unknown base format {fmt!r}; expected one of {BASE_FORMATS}")


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) + per-projection LoRA, W frozen in `base_format`.

    The base starts on the meta device: a loader fills it with `set_base`, so building a model
    never allocates a weight that is about to be replaced (a 32B bf16 model would not fit).
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        names: Sequence[str],
        base_format: BaseFormat,
        dtype: torch.dtype,
        device: torch.device | str,
        bias: bool = False,
    ):
        super().__init__()
        if len(out_sizes) != len(names):
            raise ValueError(f"{len(out_sizes)} output sizes for {len(names)} projection names")
        self.in_features = in_features
        self.out_sizes = tuple(out_sizes)
        self.out_features = sum(self.out_sizes)
        self.names = tuple(names)
        self.base_format = base_format
        for key, t in _empty_base(base_format, self.out_features, in_features, dtype).items():
            self.register_buffer(key, t)
        bias_tensor = torch.zeros(self.out_features, dtype=dtype, device=device) if bias else None
        self.register_buffer("bias", bias_tensor)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.lora_rank = 0
        self.lora_scaling = 0.0
        self.lora_enabled = True
        # NVFP4 only: the base again in humming-kernels' layout, where the engine made one
        # (`model.kernel_copies`); not a buffer: never saved, made from the base on each load.
        self.humming = None

    @property
    def kernel_weight(self) -> Tensor | KernelWeight:
        """The base as the matmul takes it: a dense tensor or a kernel-layout container."""
        if self.base_format == "bf16":
            return self.weight
        if self.base_format == "nvfp4":
            return TiledNVFP4(self.qweight, self.scales, self.global_scale, self.out_features, self.in_features,
                              humming=self.humming)
        return PackedNF4(self.qweight, self.absmax, self.code)

    def base_weight(self) -> BaseWeight:
        """The base in checkpoint form (dense, NVFP4Weight or NF4Weight); unpacks, so not per step."""
        w = self.kernel_weight
        if isinstance(w, TiledNVFP4):
            return untile_nvfp4(w)
        return unprepare_nf4(w) if isinstance(w, PackedNF4) else w

    def set_base(self, base: BaseWeight | KernelWeight) -> None:
        """Install the frozen weight of all fused projections, concatenated along the output dim.

        4-bit weights are repacked to the kernel layout here, once, on their own device.
        """
        if isinstance(base, PackedNVFP4) and self.base_format == "nvfp4":
            base = unprepare_nvfp4(base)
        if isinstance(base, NVFP4Weight) and self.base_format == "nvfp4":
            base = tile_nvfp4(base)
        elif isinstance(base, NF4Weight) and self.base_format == "nf4":
            base = prepare_nf4(base)
        expected = {"bf16": Tensor, "nvfp4": TiledNVFP4, "nf4": PackedNF4}[self.base_format]
        if not isinstance(base, expected):
            raise ValueError(
                f"{'/'.join(self.names)}: a {self.base_format} base cannot be set from {type(base).__name__}"
            )
        self.humming = None  # a copy of the old base would be wrong now
        for key in _BASE_BUFFERS[self.base_format]:
            # The buffers are named like the kernel container's fields.
            t = base if self.base_format == "bf16" else getattr(base, key)
            old = getattr(self, key)
            if t.shape != old.shape or t.dtype != old.dtype:
                raise ValueError(
                    f"{'/'.join(self.names)} {self.base_format} base `{key}`: expected "
                    f"{tuple(old.shape)} {old.dtype}, got {tuple(t.shape)} {t.dtype}"
                )
            setattr(self, key, t.detach().requires_grad_(False))

    def add_lora(
        self, names: Sequence[str], rank: int, alpha: float, generator: torch.Generator | None = None
    ) -> None:
        """Add fresh float32 LoRA A/B for each of `names` (a subset of this layer's projections).

        A is kaiming-uniform and B zero, as PEFT initialises them, so a new adapter changes nothing.
        The parameters stay float32 (the optimizer's precision, as PEFT's default autocast does);
        the forward casts them to the activation dtype.
        """
        device = self._base_device()
        for name in names:
            if name not in self.names:
                raise ValueError(f"{name!r} is not one of this layer's projections {self.names}")
            n = self.out_sizes[self.names.index(name)]
            a = torch.empty(rank, self.in_features, dtype=torch.float32, device=device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            self.lora_A[name] = nn.Parameter(a)
            self.lora_B[name] = nn.Parameter(torch.zeros(n, rank, dtype=torch.float32, device=device))
        self.lora_rank = rank
        self.lora_scaling = alpha / rank

    def _base_device(self) -> torch.device:
        return getattr(self, _BASE_BUFFERS[self.base_format][0]).device

    def base_forward(self, x: Tensor) -> Tensor:
        """x [M, in_features] @ W^T (+ bias): the frozen part, without any adapter."""
        if self.base_format == "bf16":
            y = x @ self.weight.t()
        else:
            matmul, matmul_dx = _KERNELS[self.base_format]
            y = _FrozenQuantMatmul.apply(x, self.kernel_weight, matmul, matmul_dx)
        return y if self.bias is None else y + self.bias

    def inference_forward(self, x: Tensor, lora: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """No autograd: x [M, in_features] @ W^T (+ bias) (+ u @ B^T for `lora` = (u [M, R], B
        [out_features, R]), an adapter's expand with u = x @ A^T computed by the caller). An NVFP4
        base on the CUDA kernels adds bias and expand in the GEMM's epilogue; bf16 folds the bias
        into the matmul."""
        if self.base_format == "nvfp4":
            return nvfp4_linear(x, self.kernel_weight, self.bias, lora)
        if self.base_format == "bf16":
            y = x @ self.weight.t() if self.bias is None else torch.addmm(self.bias, x, self.weight.t())
        else:
            y = self.base_forward(x)
        return y if lora is None else y.addmm_(lora[0], lora[1].t())  # in place: y is this call's own

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self.base_forward(x2)
        if self.lora_enabled and len(self.lora_A) > 0:
            y = self._add_lora(x2, y)
        return y.reshape(*lead, self.out_features)

    def _add_lora(self, x: Tensor, y: Tensor) -> Tensor:
        # All A's in one matmul (x is read once), then each B on its own slice of the rank dim.
        names = [n for n in self.names if n in self.lora_A]
        a = torch.cat([self.lora_A[n] for n in names]).to(x.dtype)
        hs = (x @ a.t()).split(self.lora_rank, dim=-1)
        outs = list(y.split(self.out_sizes, dim=-1))
        for name, h in zip(names, hs):
            i = self.names.index(name)
            outs[i] = outs[i] + (h @ self.lora_B[name].to(x.dtype).t()) * self.lora_scaling
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]

    def extra_repr(self) -> str:
        lora = f", lora={list(self.lora_A)} r={self.lora_rank}" if len(self.lora_A) else ""
        shape = f"{self.in_features} -> {list(self.out_sizes)}"
        return f"{'+'.join(self.names)}: {shape}, {self.base_format}{lora}"
