"""Elementwise glue (RMSNorm, RoPE, SiLU-gate) fused by torch.compile on CUDA: rollout and training.
The CPU and `QERL_COMPILE=0` run the same functions eagerly; a fused kernel may round once where
eager rounds twice, so GPU logprobs may differ from a CPU run's by about one bf16 step.
See docs/model.md, section "Fused glue"."""

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


def fused_on_cuda(fn: F) -> F:
    """`fn` itself, or its torch.compile'd twin when called on CUDA tensors. If Dynamo gives up on
    it (e.g. its recompile limit, in a test session of many dtypes), it stays eager from then on,
    with a warning: slower, never wrong."""
    state: dict[str, Callable[..., torch.Tensor] | None] = {}

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not (x.is_cuda and os.environ.get("QERL_COMPILE", "1") != "0"):
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
