"""Elementwise glue (RMSNorm, RoPE, SiLU-gate) fused by torch.compile on CUDA: rollout and training.

A decode step of a 7B model is ~70 kernels per layer in eager PyTorch, most of them tiny
elementwise ops (an RMSNorm alone is nine: cast, square, mean, add, rsqrt, two multiplies, the
noise add, the cast back). Measured on the H200 (bench/decode_profile.py, batch 8): ~1950
kernels per forward pass, and at ~2 us each in a CUDA graph they cost more than the weights'
memory traffic. torch.compile turns each such function into one or two generated kernels.

The training forward uses the same functions with autograd: torch.compile (AOTAutograd) then
generates a fused forward and a fused backward, where eager autograd ran every op's backward on
its own [tokens, hidden] tensors; elementwise, reduction and copy kernels were 5.1 s of an 11.3 s
7B training phase before (bench/results/profiles/train-step-profile-7b-h100.json). Dynamo guards
on grad mode, so the no-grad (engine) and grad (training) versions are two compiled graphs of one
function. CPU runs (tests, CI) never compile. `QERL_COMPILE=0` turns it off everywhere. A fused
kernel may round once where eager rounds twice (RoPE's x*cos + rot*sin: at most one bf16 step
apart, seen on CPU), so engine and training logprobs on a GPU may differ from a CPU run's by that
much on top of the matmul kernels' own rounding.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch._dynamo

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., torch.Tensor])


def compile_enabled() -> bool:
    return os.environ.get("QERL_COMPILE", "1") != "0"


def fused_on_cuda(fn: F) -> F:
    """`fn` itself, or its torch.compile'd twin when called on CUDA tensors.

    If Dynamo gives up on it (e.g. its recompile limit, hit when one process runs many models of
    different dtypes, as a test session does), the function stays eager from then on, with a
    warning: slower, never wrong.
    """
    state: dict[str, Callable[..., torch.Tensor] | None] = {}

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not (x.is_cuda and compile_enabled()):
            return fn(x, *args, **kwargs)
        if "compiled" not in state:
            # dynamic=True: one kernel for every shape. With static-then-dynamic kernels
            # (dynamic=None) the first batch size got its own kernel whose RMSNorm reduction
            # rounded differently from the others', so a rollout's tokens depended on the
            # batch it ran in (an H200 GPU test caught it); one kernel keeps every row's
            # arithmetic the same, and prompt lengths never trigger a recompile.
            state["compiled"] = torch.compile(fn, fullgraph=True, dynamic=True)
        compiled = state["compiled"]
        if compiled is None:
            return fn(x, *args, **kwargs)
        try:
            return compiled(x, *args, **kwargs)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
            log.warning("%s: torch.compile gave up (%s); running it eagerly from now on",
                        fn.__name__, type(exc).__name__)
            state["compiled"] = None
            return fn(x, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
