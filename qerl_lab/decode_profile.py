"""Where a decode step's time goes: kernels per step and per layer, and GPU time per kernel kind.

`qerl-pipe bench decode-profile --shape qwen2.5-7b --formats bf16,nvfp4 --batch 8 --out FILE.json`
builds a random model of the shape with LoRA r32 on all seven projections (the adapter's fused
inference copy, as the engine decodes) and the engine's kernel copies (humming's, or the FP8 copies
of a `+fp8` label; `+fp8kv` / `+int8kv`: a coded cache, as `bench rollout` labels them), fills a KV cache to `--context` positions and runs the
engine's decode step eagerly under torch.profiler, so the profiler sees every kernel that a
captured CUDA graph would replay. Per format: kernels per step, per layer ((step - 3) / layers:
the embedding, the RoPE tables and the LM head are the step's own), GPU busy time per step, and the
kernel kinds by GPU time with their count per step. The `targets` block holds the lean-step
target: at most 12 kernels per layer, and issue 50's coded-cache rows.

Kernels launched with programmatic dependent launch start before the kernel ahead of them has
finished and wait inside, so their profiled durations overlap and include that wait: the kinds'
times then add up to more than the step takes. `graph_step_ms` is the step's own time, the
median of 20 replays of the step captured as one CUDA graph (as the engine runs it).

A mixture-of-experts shape (qwen3-30b-a3b) runs its experts as the engine does: grouped
(`model.kernel_copies.attach_grouped_experts`: humming's copies for NVFP4, torch's grouped GEMM
for bf16), so its step is captured and timed as a graph too. For every shape the row also holds
`eager_step_ms` (wall time per eager step, the GPU synchronised at the end) and `python_top`, the
Python functions with the most own time per step under cProfile (where a host-bound step spends
it: dispatch, wrappers).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from qerl_pipe.model.random_init import init_random_model
from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe.strict_json import write_json
from qerl_pipe.model.shapes import SHAPES
from qerl_pipe.engine.decode_step import decode_step
from qerl_pipe.engine.fused_lora import FusedLora
from qerl_pipe.kernels.tuning import time_graph
from qerl_pipe.engine.fp8 import Fp8Linears
from qerl_pipe.kernels.fp8 import CODE_MAX
from qerl_pipe.model.kernel_copies import all_experts_grouped, attach_grouped_experts, attach_humming
from qerl_lab.attention import random_codes
from qerl_lab.rollout import kv_targets as kv_rows_targets, parse_label
from qerl_pipe.model.lora import LoraSpec

KERNELS_PER_LAYER_TARGET = 12
PYTHON_TOP = 25


def _python_top(stats: pstats.Stats, steps: int) -> list[dict[str, Any]]:
    """The functions with the most own time, per step (file paths from the package root on)."""
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        parts = Path(file).parts
        where = next((str(Path(*parts[i:])) for i, part in enumerate(parts) if part in ("qerl_pipe", "torch", "qerl_lab")),
                     Path(file).name)
        rows.append({"function": f"{where}:{line}({name})", "calls_per_step": round(calls / steps, 1),
                     "own_ms_per_step": round(own * 1e3 / steps, 3), "cumulative_ms_per_step": round(cumulative * 1e3 / steps, 3)})
    return sorted(rows, key=lambda r: -r["own_ms_per_step"])[:PYTHON_TOP]


def _host_profile(step, steps: int) -> tuple[float, list[dict[str, Any]]]:
    """Wall ms per eager step (the GPU synchronised at the end), and the top Python functions."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - start) * 1e3 / steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    return eager_ms, _python_top(pstats.Stats(profiler), steps)


def _fill(cache: Any, gen: torch.Generator) -> None:
    """Random keys and values (codes over the whole range, scales near 1 / CODE_MAX, when coded)."""
    top = CODE_MAX.get(cache.k.dtype, 1.0)
    for stored in (cache.k, cache.v):
        for layer in stored:  # one layer at a time: no fp32 copy of the whole cache
            if layer.dtype in CODE_MAX:
                layer.copy_(random_codes(layer.shape, layer.dtype, gen, layer.device))
            else:
                layer.normal_(generator=gen)
    for scales in (cache.k_scale, cache.v_scale):
        if scales is not None:
            scales.uniform_(0.5 / top, 2 / top, generator=gen)


def profile_format(shape: str, label: str, batch: int, context: int, steps: int,
                   lora_rank: int = 32) -> dict[str, Any]:
    """One format label's decode step under the profiler (see the module doc)."""
    base_format, activations, kv_cache = parse_label(label)
    model = init_random_model(SHAPES[shape], base_format=base_format, device="cuda",
                              lora=LoraSpec(rank=lora_rank, alpha=2 * lora_rank))
    fp8 = Fp8Linears(model) if activations == "fp8" else None
    if fp8 is None:
        attach_humming(model)  # as the engine: humming's copies where the dispatch sends rows to them
    attach_grouped_experts(model)  # a MoE's experts as the engine runs them (no-op for a dense model)
    cache = model.make_cache(batch, context + steps, kv_format=kv_cache)
    gen = torch.Generator(device="cuda").manual_seed(0)
    _fill(cache, gen)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=gen, device="cuda")
    positions = torch.full((batch,), context, device="cuda")
    lora = FusedLora(model, model.dtype, fp8)
    lora.refresh()
    for _ in range(2):  # compile and autotune outside the profile
        decode_step(model, lora, tokens, positions, cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decode_step(model, lora, tokens, positions, cache)
        torch.cuda.synchronize()
    def step() -> None:
        decode_step(model, lora, tokens, positions, cache)

    eager_ms, python_top = _host_profile(step, steps)
    # A MoE step whose experts loop syncs with the host inside (the row counts): no graph to time.
    graph_step_ms = round(time_graph([step], reps=20) * 1e3, 3) if all_experts_grouped(model) else None
    kinds = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count > 0]
    kernels = sum(e.count for e in kinds) / steps
    layers = model.config.num_layers
    row = {"shape": shape, "format": label, "batch": batch, "context": context, "lora_rank": lora_rank,
           "kernels_per_step": kernels, "kernels_per_layer": round((kernels - 3) / layers, 2),
           "gpu_busy_ms_per_step": round(sum(e.self_device_time_total for e in kinds) / steps / 1e3, 3),
           "graph_step_ms": graph_step_ms, "eager_step_ms": round(eager_ms, 3), "python_top": python_top,
           "kinds": [{"kernel": e.key[:120], "per_step": round(e.count / steps, 2),
                      "us_per_step": round(e.self_device_time_total / steps, 2)}
                     for e in sorted(kinds, key=lambda e: -e.self_device_time_total)]}
    return row


def run(shape: str, formats: Sequence[str], batches: Sequence[int], context: int, steps: int,
        partial: Path | None = None) -> dict[str, Any]:
    """Every (batch, format) row, then the targets; `partial` is rewritten after each row, so a run
    cut short keeps the rows it measured."""
    rows = []
    # A format `label@B` runs at batch B alone (each cache at its plan's slots); others at every batch.
    runs = [(int(f.split("@")[1]), f.split("@")[0]) if "@" in f else (b, f) for b in batches for f in formats]
    for batch, fmt in dict.fromkeys(runs):
        rows.append(profile_format(shape, fmt, batch, context, steps))
        torch.cuda.empty_cache()  # the model and cache went with profile_format's frame
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            write_json(partial, nulls_for_non_finite(_result(rows)), indent=1)
        r = rows[-1]
        print(f"{shape} {fmt} batch {batch}: {r['kernels_per_step']:.0f} kernels per decode step "
              f"({r['kernels_per_layer']} per layer), GPU busy {r['gpu_busy_ms_per_step']} ms per step, "
              f"graph replay {r['graph_step_ms']} ms, eager {r['eager_step_ms']} ms", file=sys.stderr, flush=True)
        for kind in r["kinds"][:12]:
            print(f"  {kind['us_per_step']:9.1f} us  x{kind['per_step']:<6} {kind['kernel'][:90]}", file=sys.stderr, flush=True)
        for fn in r["python_top"][:12]:
            print(f"  {fn['own_ms_per_step']:9.3f} ms own  x{fn['calls_per_step']:<7} {fn['function'][:90]}",
                  file=sys.stderr, flush=True)
    return _result(rows)


def _result(rows: list[dict[str, Any]]) -> dict[str, Any]:
    targets = [target(f"{r['shape']} {r['format']} batch {r['batch']}: kernels per layer in the decode step",
                      f"<= {KERNELS_PER_LAYER_TARGET}", r["kernels_per_layer"], "kernels",
                      r["kernels_per_layer"] <= KERNELS_PER_LAYER_TARGET) for r in rows]
    return results_file(rows, targets + kv_targets(rows), torch=torch.__version__)


def kv_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 50's targets from graph-replayed decode steps (no prefill): decode tokens/s at each
    cache's plan slots leave the wave's prefill out, and the names say so."""
    return kv_rows_targets(lambda shape, label, batch: next((r for r in rows if (r["shape"], r["format"], r["batch"]) == (
                               shape, label, batch) and r["graph_step_ms"]), None),
                           lambda r: r["graph_step_ms"], lambda r: r["batch"] / r["graph_step_ms"],
                           lambda r: f"context {r['context']}",
                           (" (graph replay)", f", context {rows[0]['context']}",
                            ", decode tokens/s (graph-replayed steps, prefill left out)"))
