"""Elementwise glue (RMSNorm, RoPE, SiLU-gate) fused by torch.compile, for generation on CUDA.

A decode step of a 7B model is ~70 kernels per layer in eager PyTorch, most of them tiny
elementwise ops (an RMSNorm alone is nine: cast, square, mean, add, rsqrt, two multiplies, the
noise add, the cast back). Measured on the H200 (bench/decode_profile.py, batch 8): ~1950
kernels per forward pass, and at ~2 us each in a CUDA graph they cost more than the weights'
memory traffic. torch.compile turns each such function into one or two generated kernels.

Only for no-grad CUDA calls (the rollout engine, scoring): the training forward keeps the eager
ops and their plain autograd, and CPU runs (tests, CI) never compile. `QERL_COMPILE=0` turns it
off everywhere. A fused kernel may round once where eager rounds twice (RoPE's x*cos + rot*sin:
at most one bf16 step apart, seen on CPU), so engine logprobs and the training forward can differ
by that much on top of the matmul kernels' own rounding.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable[..., torch.Tensor])


def compile_enabled() -> bool:
    return os.environ.get("QERL_COMPILE", "1") != "0"


def fused_for_inference(fn: F) -> F:
    """`fn` itself, or its torch.compile'd twin when called without grad on CUDA tensors."""
    compiled: list[Callable[..., torch.Tensor]] = []

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.is_cuda and not torch.is_grad_enabled() and compile_enabled():
            if not compiled:
                # dynamic=True: one kernel for every shape. With static-then-dynamic kernels
                # (dynamic=None) the first batch size got its own kernel whose RMSNorm reduction
                # rounded differently from the others', so a rollout's tokens depended on the
                # batch it ran in (an H200 GPU test caught it); one kernel keeps every row's
                # arithmetic the same, and prompt lengths never trigger a recompile.
                compiled.append(torch.compile(fn, fullgraph=True, dynamic=True))
            return compiled[0](x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
