"""GPU memory of a Qwen2.5-32B-shaped model built directly in NVFP4: does it fit a 24 GB-class budget?

`qerl-pipe bench memory --out FILE.json`. Random init through
`init_random_model(..., base_format="nvfp4", device="cuda")`, which draws and quantizes one linear at a time on the GPU, so the bf16 model never exists; the
bf16 figure is computed from the parameter count, not allocated. Then one forward of one token
(the decode kernels) with a finiteness check of the logits.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_lab.results import results_file, target
from qerl_pipe.model.shapes import QWEN25_SHAPES
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.load import model_memory_bytes

QWEN25_32B = QWEN25_SHAPES["qwen2.5-32b"]
GIB = 2**30
BUDGET_GIB = 20.0


def bf16_bytes(model: torch.nn.Module) -> int:
    """What the same model would hold with every 4-bit base weight in bf16 (nothing allocated)."""
    quant = sum(b.untyped_storage().nbytes() for m in model.modules() if isinstance(m, QuantLinear)
                for name, b in m.named_buffers(recurse=False) if name != "bias")
    dense = sum(2 * m.out_features * m.in_features for m in model.modules()
                if isinstance(m, QuantLinear))
    return model_memory_bytes(model) - quant + dense


def measure(config: dict[str, Any] = QWEN25_32B) -> dict[str, Any]:
    """Build the NVFP4 model on cuda:0, run one token; bytes, peaks and timings."""
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = init_random_model(config, base_format="nvfp4", device="cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    build_peak = torch.cuda.max_memory_allocated()
    with torch.inference_mode():
        logits = model.logits(torch.tensor([[151643]], device="cuda"))
        torch.cuda.synchronize()
    return {
        "model": "qwen2.5-32b (random init)", "base_format": "nvfp4", "config": config,
        "params": sum(m.out_features * m.in_features for m in model.modules()
                      if isinstance(m, QuantLinear)) + sum(p.numel() for p in model.parameters()),
        "model_memory_bytes": model_memory_bytes(model),
        "bf16_model_bytes_computed": bf16_bytes(model),
        "max_memory_allocated_build": build_peak,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "memory_allocated_after": torch.cuda.memory_allocated(),
        "build_seconds": build_s,
        "logits_shape": list(logits.shape),
        "logits_finite": bool(torch.isfinite(logits).all()),
        "logits_std": float(logits.float().std()),
    }


def _targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    resident, peak = r["model_memory_bytes"] / GIB, r["max_memory_allocated"] / GIB
    return [
        target("32B NVFP4 model resident on the GPU", f"< {BUDGET_GIB} GiB", round(resident, 2),
               "GiB", resident < BUDGET_GIB),
        target("32B NVFP4 peak allocated (build + 1-token forward)", f"< {BUDGET_GIB} GiB",
               round(peak, 2), "GiB", peak < BUDGET_GIB),
        target("1-token forward logits finite", "true", float(r["logits_finite"]), "bool",
               r["logits_finite"]),
    ]


def run_memory_bench() -> dict[str, Any]:
    """`qerl-pipe bench memory`: measure, print the figures (stderr) and return the results file."""
    r = measure()
    out = results_file([r], _targets(r))
    for k in ("model_memory_bytes", "bf16_model_bytes_computed", "max_memory_allocated_build",
              "max_memory_allocated"):
        print(f"{k:28} {r[k] / GIB:8.2f} GiB ({r[k] / 1e9:.2f} GB)", file=sys.stderr)
    print(f"build {r['build_seconds']:.1f} s, logits finite {r['logits_finite']}", file=sys.stderr)
    for t in out["targets"]:
        print(f"target {t['name']:50} {t['target']:<10} measured {t['measured']} "
              f"{'MET' if t['met'] else 'MISSED'}", file=sys.stderr)
    return out
