"""Building an engine directory: `plan_engine` decides everything before any weight is read (a bad
setting fails before any work), `write_engine` writes the weights and `engine.json` that
`jobs.engine_artifact.load_engine` reads. See docs/engine.md, section "The engine artifact"."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import qerl_pipe
from qerl_pipe.jobs.engine_artifact import ENGINE_FILE, ENGINE_FORMAT_VERSION, device_kind
from qerl_pipe.engine.fp8 import check_activations, check_kv_cache
from qerl_pipe.engine.limits import EngineLimits, plan_limits
from qerl_pipe.jobs.engine_weights import save_engine_model
from qerl_pipe.errors import QerlError
from qerl_pipe.formats.checkpoint import refuse_non_finite
from qerl_pipe.formats.names import hf_name
from qerl_pipe.formats.modelopt_writer import copy_model_files
from qerl_pipe.hf import compute_dtype, count_parameters
from qerl_pipe.kernels.base_formats import FORMATS, base_format
from qerl_pipe.log import log
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.load import load_model, model_memory_bytes
from qerl_pipe.strict_json import write_json


@dataclass(frozen=True)
class EngineSpec:
    """The engine asked for (a recipe's `engine` section, less what the caller decides: the KV
    budget and the device)."""

    base_format: str  # a name of kernels.base_formats (NAMES)
    max_seq_len: int
    max_batch: int
    cuda_graphs: str  # "auto", "on" or "off"
    tune_kernels: str  # "auto", "on" or "off": measure the NVFP4 dispatch table
    dtype: str  # "auto" or a torch dtype's name
    deterministic: bool = True  # NVFP4: the dispatch's deterministic column (kernels.dispatch)
    activations: str = "bf16"  # the rollout's: "bf16" or "fp8" (engine.fp8)
    kv_cache: str = "bf16"  # the KV cache's format (engine.limits.KV_FORMATS)


@dataclass(frozen=True)
class EnginePlan:
    """What is decided before any weight is read (so a bad value fails before any work)."""

    config: DecoderConfig
    dtype: torch.dtype
    kv_budget_bytes: int
    limits: EngineLimits  # the KV cache and graphs that budget gives
    cuda_graphs: bool
    tune: bool


def _switch(choice: str, auto: bool, possible: bool, key: str, why: str) -> bool:
    if choice == "on" and not possible:
        raise QerlError(f"engine.{key}: on {why}; set engine.{key}=auto or off")
    return choice == "on" or (choice == "auto" and auto)


def plan_engine(section: EngineSpec, hf_config: dict[str, Any], device: torch.device,
                kv_budget_bytes: int) -> EnginePlan:
    """What the engine asked for, its KV budget and the model's config.json decide. Raises, before
    any weight is read, on a setting that cannot work: sequences longer than the model's positions,
    CUDA graphs or tuning forced on where they cannot run, a KV budget that holds not one sequence."""
    config = DecoderConfig.from_hf(hf_config)
    if section.max_seq_len > config.max_position_embeddings:
        raise QerlError(f"engine.max_seq_len={section.max_seq_len} exceeds the model's max_position_embeddings "
                        f"({config.max_position_embeddings}); lower engine.max_seq_len")
    cuda = device.type == "cuda"
    dtype = compute_dtype(section.dtype, device, count_parameters(hf_config))
    check_activations(section.activations, section.base_format, device, dtype)
    check_kv_cache(section.kv_cache, device)
    dispatched = base_format(section.base_format).hopper_dispatch
    graphs = _switch(section.cuda_graphs, cuda, cuda, "cuda_graphs", "needs a CUDA device")
    tunable = " or ".join(name for name, f in FORMATS.items() if f.hopper_dispatch)
    tune = _switch(section.tune_kernels, cuda and dispatched, cuda and dispatched, "tune_kernels",
                   f"needs a CUDA device and a base with a kernel dispatch to measure ({tunable})")
    # Raises now when not even one sequence fits.
    limits = plan_limits(config, max_seq_len=section.max_seq_len, max_batch=section.max_batch,
                         kv_budget_bytes=kv_budget_bytes, dtype=dtype, cuda_graphs=graphs, kv_cache=section.kv_cache)
    return EnginePlan(config, dtype, kv_budget_bytes, limits, graphs, tune)


def _check_finite(model: torch.nn.Module) -> None:
    """Refuse NaN or inf in a bf16 (or NF4) base built from the source's weights as they are (every
    rollout would be empty), naming the tensor as the model's files do (a fused base by its fused name)."""
    for name, t in model.state_dict().items():
        refuse_non_finite(name if name.startswith("lm_head") else hf_name(name), t)


def write_engine(base_dir: Path, hf_config: dict[str, Any], plan: EnginePlan, section: EngineSpec,
                 device: torch.device, out: Path, memory_plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the engine of the base in `base_dir` (its config.json as `hf_config`) into `out`;
    returns the manifest summary. `memory_plan` (the plan of train's step that sized the KV cache,
    as JSON) is recorded in engine.json and the summary."""
    from qerl_pipe.kernels.cuda_ext import available as cuda_kernels_available
    from qerl_pipe.kernels.dispatch import ROWS_M
    from qerl_pipe.kernels.dispatch_measure import measure_table

    started = time.perf_counter()
    fmt = base_format(section.base_format)
    model = load_model(base_dir, fmt.name, plan.dtype, device)
    _check_finite(model)
    budget, limits = plan.kv_budget_bytes, plan.limits
    dispatch_table = None
    if plan.tune and cuda_kernels_available(device):
        log(f"build-engine: measuring the NVFP4 kernel dispatch (ours / humming / dequantize + cuBLAS) on "
            f"{device_kind(device)}")
        # The distinct (N, K) of the fused linears, in model order.
        shapes = dict.fromkeys((m.out_features, m.in_features) for m in model.modules() if isinstance(m, QuantLinear))
        dispatch_table, _ = measure_table(list(shapes), ROWS_M, device, log)
    elif plan.tune:  # without our CUDA kernels (said once, with why) NVFP4 runs dequantize + cuBLAS
        log(f"build-engine: no NVFP4 dispatch to measure on {device_kind(device)}")
    save_engine_model(model, out, hf_config=hf_config)
    copy_model_files(base_dir, out)
    seconds = round(time.perf_counter() - started, 2)
    engine = {
        "format_version": ENGINE_FORMAT_VERSION, "base_format": section.base_format,
        "dtype": str(plan.dtype).removeprefix("torch."), "limits": limits.to_json(), "kv_budget_bytes": budget,
        "memory_plan": memory_plan, "dispatch_table": dispatch_table.to_json() if dispatch_table is not None else None,
        "deterministic": section.deterministic, "activations": section.activations,
        "device": {"type": device.type, "name": device_kind(device)},
        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"), "build_seconds": seconds,
        "qerl_pipe_version": qerl_pipe.__version__,
    }
    write_json(out / ENGINE_FILE, engine)
    summary = {
        "base_format": section.base_format, "dtype": engine["dtype"], "device": engine["device"]["name"],
        "max_batch": limits.max_batch, "max_seq_len": limits.max_seq_len,
        "kv_cache_mib": round(limits.kv_cache_bytes / 2**20, 1), "kv_budget_mib": round(budget / 2**20, 1),
        "model_mib": round(model_memory_bytes(model) / 2**20, 1), "cuda_graph_sizes": list(limits.graph_batch_sizes),
        "dispatch_rows": len(dispatch_table.deterministic) if dispatch_table is not None else 0, "seconds": seconds,
        **({"memory_plan": memory_plan} if memory_plan is not None else {}),
    }
    log(f"build-engine: {section.base_format} base in {summary['dtype']} on {summary['device']}, "
        f"{summary['model_mib']} MiB; max_batch {limits.max_batch} x max_seq_len {limits.max_seq_len} "
        f"(KV cache {summary['kv_cache_mib']} of {summary['kv_budget_mib']} MiB); "
        f"{summary['dispatch_rows'] or 'no'} measured dispatch rows; {seconds} s")
    return summary
