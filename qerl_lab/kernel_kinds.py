"""GPU kernel time grouped by kind (cuBLAS GEMMs, humming, our W4A16 kernels, attention, ...).

Used by the training profiles (`bench train-step --profile-train`, bench/scripts/train_profile.py)
so that NVFP4 and bf16 compare kind by kind, and so the sum of kernel time can be set against the
wall time of the same work: a large difference is the GPU waiting on the host.
"""
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS = (  # first match wins; lower-case substrings of the kernel name
    ("humming", ("humming",)),
    ("w4a16 (ours)", ("w4a16", "qerl")),
    # Before the GEMMs: cuDNN's attention kernels are named "cudnn_..._sdpa_sm90_flash_..._wgmma".
    ("attention", ("flash", "attention", "fmha", "sdpa", "efficient")),
    ("gemm (cuBLAS/CUTLASS)", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "sm90_", "cublas")),
    ("copy / cat / index", ("copy", "cat", "index", "gather", "scatter", "fill")),
    ("elementwise / reduce / norm", ("elementwise", "reduce", "norm", "softmax", "vectorized", "triton")),
)


def kind(name: str) -> str:
    """The kind of the kernel named `name` ("other" when no rule matches)."""
    low = name.lower()
    return next((k for k, words in KINDS if any(w in low for w in words)), "other")


def profile_kinds(fn: Callable[[], Any], top: int = 25, cpu_top: int = 0) -> tuple[Any, dict[str, Any]]:
    """Run `fn` once under torch.profiler (CUDA kernels; host ops too with `cpu_top`); returns its
    result and the summary: milliseconds by kind, the `top` kernels by time, the kernel-time total
    and the wall time, and with `cpu_top` the host operators with the most self time (where the
    host spends a wall time the kernels do not fill)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu_top else [])
    with profile(activities=activities) as prof:
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0)
        # Kernels only: with host activity on, an operator (aten::mm) also carries its kernels' time.
        if us <= 0 or e.device_type != DeviceType.CUDA:
            continue
        by_kind[kind(e.key)] = by_kind.get(kind(e.key), 0.0) + us / 1e3
        kernels.append((us / 1e3, e.count, e.key[:120]))
    kernels.sort(reverse=True)
    kernel_ms = sum(by_kind.values())
    wall_ms = start.elapsed_time(end)
    host = sorted(((e.self_cpu_time_total / 1e3, e.count, e.key[:120]) for e in prof.key_averages()
                   if e.self_cpu_time_total > 0), reverse=True)[:cpu_top]
    return result, {
        **({"host_top_ops": [{"self_ms": ms, "calls": n, "name": k} for ms, n, k in host]} if cpu_top else {}),
        "wall_ms": wall_ms, "kernel_ms": kernel_ms,
        # Kernel time over wall time on one stream: below 1, the GPU waited for the host (launches, syncs).
        "gpu_busy_fraction": kernel_ms / wall_ms if wall_ms > 0 else None,
        "ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"ms": ms, "calls": n, "name": k} for ms, n, k in kernels[:top]],
    }
