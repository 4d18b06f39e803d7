"""Programmatic dependent launch (PDL) for the decode step's Triton kernels. `launch_dependents` lets the next
kernel start; `wait_previous` must come before reading what an earlier kernel wrote. Off (the helpers compile to
nothing) under the interpreter, on a Triton without `launch_pdl` and before sm_90. See docs/kernels.md, section
"The decode step's kernels"."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def _supported() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        import triton.language.extra.cuda as cuda_lang
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda_lang, "gdc_wait")


PDL = _supported()


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Launch arguments for a kernel taking `USE_PDL`: PDL on a CUDA GPU of sm_90 or later."""
    on = PDL and device.type == "cuda" and _hopper_or_later(
        device.index if device.index is not None else torch.cuda.current_device())
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


if PDL:
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
else:  # never called: the constexpr branches below are pruned when USE_PDL is False
    _gdc_launch_dependents = _gdc_wait = None


@triton.jit
def wait_previous(USE_PDL: tl.constexpr):
    """Wait until the kernel before has completed and its writes are visible (no-op without PDL)."""
    if USE_PDL:
        _gdc_wait()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel launch now (it waits for this one before reading its outputs)."""
    if USE_PDL:
        _gdc_launch_dependents()
