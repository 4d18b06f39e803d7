"""QuantLinear: a frozen base weight (bf16, NVFP4 or NF4) plus unmerged LoRA, one A/B per projection,
several projections fused along the output dimension (q/k/v, gate/up). 4-bit bases are held only in
the kernels' layout, converted once when the base is set; `kernels.base_formats` says what each
format holds. See docs/model.md, sections "Fused layout" and "LoRA"."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl_pipe.formats.nf4 import NF4Weight
from qerl_pipe.formats.nvfp4 import NVFP4Weight
from qerl_pipe.kernels.base_formats import base_format as format_entry
from qerl_pipe.kernels.packing import PackedNF4
from qerl_pipe.kernels.tiled import TiledNVFP4

BaseWeight = Union[Tensor, NVFP4Weight, NF4Weight]
KernelWeight = Union[TiledNVFP4, PackedNF4]
# project(linear, x [..., in]) -> [..., out]: how a projection runs. The model calls the module
# (its base and per-projection LoRA); the rollout engine passes its fused LoRA copy's `project`.
Project = Callable[["QuantLinear", Tensor], Tensor]


def call_module(linear: "QuantLinear", x: Tensor) -> Tensor:
    """The default `Project`: the module itself."""
    return linear(x)


class _FrozenQuantMatmul(torch.autograd.Function):
    """y = x @ W^T for a frozen quantized W; backward returns dX = dY @ W and nothing for W. Only
    the packed weight's reference is kept (no activation, no dequantized weight): the training
    forward costs no more memory than bf16's, and dX reads the 4-bit weights again."""

    @staticmethod
    def forward(ctx, x: Tensor, w: KernelWeight, matmul: Callable, matmul_dx: Callable) -> Tensor:
        ctx.w, ctx.matmul_dx = w, matmul_dx
        return matmul(x, w)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, None, None, None]:
        dx = ctx.matmul_dx(dy.contiguous(), ctx.w) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) + per-projection LoRA, W frozen in `base_format`. The base starts on the
    meta device until `set_base` fills it (a 32B bf16 weight about to be replaced is never allocated)."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], names: Sequence[str], base_format: str,
                 dtype: torch.dtype, device: torch.device | str, bias: bool = False):
        super().__init__()
        if len(out_sizes) != len(names):
            raise ValueError(f"{len(out_sizes)} output sizes for {len(names)} projection names")
        self.in_features = in_features
        self.out_sizes = tuple(out_sizes)
        self.out_features = sum(self.out_sizes)
        self.names = tuple(names)
        self.base_format = base_format  # the name, as configs and files spell it
        self.fmt = format_entry(base_format)  # what it means: buffers, kernels, bytes
        for key, t in self.fmt.empty_buffers(self.out_features, in_features, dtype).items():
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
        # 4-bit bases on the CPU: the base dequantized once into the model dtype, where
        # `model.dense_copy` made one (the reference matmuls then skip their per-call dequantize);
        # not a buffer either, and dropped with the base it was made from.
        self.dense_copy: Tensor | None = None

    @property
    def kernel_weight(self) -> Tensor | KernelWeight:
        """The base as the matmul takes it: a dense tensor or a kernel-layout container."""
        buffers = {key: getattr(self, key) for key in self.fmt.buffers}
        return self.fmt.make_container(buffers, self.out_features, self.in_features, self.humming, self.dense_copy)

    def base_weight(self) -> BaseWeight:
        """The base in checkpoint form (dense, NVFP4Weight or NF4Weight); unpacks, so not per step."""
        return self.fmt.to_checkpoint(self.kernel_weight)

    def set_base(self, base: BaseWeight | KernelWeight) -> None:
        """Install the frozen weight of all fused projections, concatenated along the output dim (4-bit
        weights repacked to the kernel layout here, once, on their own device)."""
        base = self.fmt.to_container(base)
        if not isinstance(base, self.fmt.container):
            raise ValueError(f"{'/'.join(self.names)}: a {self.base_format} base cannot be set from "
                             f"{type(base).__name__}")
        self.humming = None  # copies of the old base would be wrong now
        self.dense_copy = None
        for key, t in self.fmt.tensors(base).items():
            old = getattr(self, key)
            if t.shape != old.shape or t.dtype != old.dtype:
                raise ValueError(f"{'/'.join(self.names)} {self.base_format} base `{key}`: expected "
                                 f"{tuple(old.shape)} {old.dtype}, got {tuple(t.shape)} {t.dtype}")
            setattr(self, key, t.detach().requires_grad_(False))

    def add_lora(self, names: Sequence[str], rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        """Add fresh float32 LoRA A/B for each of `names` (some of this layer's projections): A
        kaiming-uniform, B zero, as PEFT does (a new adapter changes nothing); float32 as PEFT's
        default autocast keeps them, cast to the activation dtype in the forward."""
        device = self.base_device()
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

    def base_device(self) -> torch.device:
        return getattr(self, self.fmt.buffers[0]).device

    def base_forward(self, x: Tensor) -> Tensor:
        """x [M, in_features] @ W^T (+ bias): the frozen part, without any adapter."""
        kernels = self.fmt.kernels
        if kernels is None:  # the bias in the matmul's epilogue: no pass of its own over y
            return x @ self.weight.t() if self.bias is None else torch.addmm(self.bias, x, self.weight.t())
        y = _FrozenQuantMatmul.apply(x, self.kernel_weight, kernels.forward, kernels.dx)
        return y if self.bias is None else y + self.bias

    def inference_forward(self, x: Tensor, lora: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """No autograd: x [M, in_features] @ W^T (+ bias) (+ u @ B^T for `lora` = (u [M, R], B
        [out_features, R]), an adapter's expand with u = x @ A^T computed by the caller). An NVFP4
        base on the CUDA kernels adds bias and expand in the GEMM's epilogue; bf16 folds the bias
        into the matmul."""
        kernels = self.fmt.kernels
        if kernels is not None and kernels.fused_epilogue:
            return kernels.forward(x, self.kernel_weight, self.bias, lora)
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
        """y + scaling * (x @ A^T) @ B^T for every adapted projection in two matmuls: A's stacked (x
        read once), then B block-diagonal in one `addmm` (y the addend, scaling its alpha). Per
        projection, elementwise and copy kernels took 5.1 s of a 7B training phase of 11.3 s
        (bench/results/profiles/train-step-profile-7b-h100.json)."""
        names = [n for n in self.names if n in self.lora_A]
        a = torch.cat([self.lora_A[n] for n in names]).to(x.dtype)
        b = self.block_diagonal_b(names, x.dtype)
        return torch.addmm(y, x @ a.t(), b.t(), alpha=self.lora_scaling)

    def block_diagonal_b(self, names: list[str], dtype: torch.dtype) -> Tensor:
        """[out_features, R * len(names)]: projection `names[j]`'s B in its output rows and the
        j-th block of R columns, zeros elsewhere (projections without an adapter get zero rows)."""
        r, width = self.lora_rank, self.lora_rank * len(names)
        if len(self.names) == 1:  # o_proj, down_proj: B itself
            return self.lora_B[names[0]].to(dtype)
        blocks = []
        for name, size in zip(self.names, self.out_sizes):
            if name in names:
                j = names.index(name)
                blocks.append(F.pad(self.lora_B[name].to(dtype), (j * r, width - (j + 1) * r)))
            else:
                blocks.append(torch.zeros(size, width, dtype=dtype, device=self.lora_B[names[0]].device))
        return torch.cat(blocks)

    def extra_repr(self) -> str:
        lora = f", lora={list(self.lora_A)} r={self.lora_rank}" if len(self.lora_A) else ""
        shape = f"{self.in_features} -> {list(self.out_sizes)}"
        return f"{'+'.join(self.names)}: {shape}, {self.base_format}{lora}"
