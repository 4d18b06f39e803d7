"""humming-kernels (the vLLM project's JIT W4A16 GEMMs) as a backend for NVFP4 weights, on a copy of the weight
in humming's layout (made only for the shapes the dispatch table sends to humming, where memory allows), in the
schedule the backend's name picks: `humming`, `humming-ordered` or `humming-fast`. docs/kernels.md, "The dispatch"."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path

import torch
from torch import Tensor

from qerl_pipe.formats.nvfp4 import NVFP4Weight
from qerl_pipe.kernels.humming_streamk import ordered_configs
from qerl_pipe.kernels.optional_backend import availability
from qerl_pipe.strict_json import dumps

SCHEDULES = ("humming", "humming-ordered", "humming-fast")
# humming's compute configs, serialized once (it parses strings per call).
_INVARIANT = '{"use_batch_invariant": true}'
_STREAM_K = '{"use_batch_invariant": false}'
_ORDERED: dict[tuple[int, int, int], str] = {}  # (N, K, device index) -> the ordered schedule's configs


def _cuda_headers() -> Path | None:
    """Where NVRTC finds cuda_runtime.h: CUDA_HOME (or CUDA_PATH), else /usr/local/cuda."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "include", "cuda_runtime.h").exists():
            return Path(root)
    return None


def why_unavailable(device: torch.device | str) -> str | None:
    """Why humming cannot serve `device` (None when it can)."""
    device = torch.device(device)
    if os.environ.get("QERL_HUMMING", "1") == "0":
        return "QERL_HUMMING=0"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "humming needs compute capability 8.0 or newer"
    root = _cuda_headers()
    if root is None:
        return "no CUDA headers for its NVRTC compiles (install the CUDA toolkit or set CUDA_HOME)"
    os.environ.setdefault("CUDA_HOME", str(root))
    try:
        import humming.layer  # noqa: F401  (4 s to import: only here, never at start-up)
    except Exception as exc:  # a missing or broken install leaves our kernels serving every row
        return f"humming-kernels does not import ({type(exc).__name__}: {exc})"
    return None


# Whether humming can run on a device (said once, in one line, when not).
available = availability(why_unavailable, "humming-kernels", "our kernels serve every row")


class HummingNVFP4:
    """One NVFP4 weight `[N, K]` in humming's layout; `matmul(x)` is `x @ W^T` in bf16."""

    def __init__(self, w: NVFP4Weight):
        from humming.layer import HummingLayer

        self.out_features, self.in_features = w.out_features, w.in_features
        with torch.device(w.packed.device):  # its parameters are made where the weight lives
            layer = HummingLayer(shape_n=w.out_features, shape_k=w.in_features,
                                 weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"},
                                 torch_dtype=torch.bfloat16)
        layer.load_from_tensors({"weight": w.packed, "weight_scale": w.block_scales,
                                 "weight_scale_2": w.global_scale.reshape(1).float()})
        layer.transform()
        self.layer = layer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layer.parameters())

    def matmul(self, x: Tensor, schedule: str = "humming") -> Tensor:
        """`x [M, K]` bf16 -> `[M, N]` under `schedule` (one of `SCHEDULES`); the first call per
        schedule compiles its kernels."""
        if schedule == "humming":
            return self.layer(x, compute_config=_INVARIANT)
        if schedule == "humming-fast":
            return self.layer(x, compute_config=_STREAM_K)
        if schedule == "humming-ordered":
            return self.layer(x, compute_config=_STREAM_K, tuning_config=self._ordered_configs())
        raise ValueError(f"humming schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")

    def _ordered_configs(self) -> str:
        """The ordered schedule's interval configs, derived at first use per layer shape and GPU
        (a 7B model has 112 linears of 4 shapes)."""
        device = self.layer.weight.device
        key = (self.out_features, self.in_features, device.index or 0)
        if key not in _ORDERED:
            from humming.tune import get_heuristics_config

            if torch.cuda.get_device_capability(device)[0] != 9:
                raise RuntimeError("humming's ordered stream-K schedule is derived for SM 9.x (Hopper) only")
            fast = get_heuristics_config(self.layer.humming_config, use_batch_invariant=False, device=device)
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            configs = ordered_configs(fast, self.out_features, self.in_features, sms)
            _ORDERED[key] = dumps(configs, default=lambda v: v.value if isinstance(v, Enum) else str(v))
        return _ORDERED[key]

    def compile(self, schedule: str) -> None:
        """Compile the schedule's kernels now (every M interval at once), not inside a graph capture."""
        x = torch.zeros(1, self.in_features, dtype=torch.bfloat16, device=self.layer.weight.device)
        self.matmul(x, schedule)
