"""The Qwen2.5 layer shapes the kernel benchmarks time (`bench kernels-cuda`, `kernels-dispatch`,
`fp8-rows` and the scripts under bench/scripts/)."""

from __future__ import annotations

# (N, K) of each linear: qkv and gate_up are fused, as our model runs them.
LAYER_SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "qwen2.5-7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584),
                   "down": (3584, 18944)},
    "qwen2.5-32b": {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (55296, 5120),
                    "down": (5120, 27648)},
}
