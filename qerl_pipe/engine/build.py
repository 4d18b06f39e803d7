"""Building an engine directory: what build-engine stores so that train and eval start in seconds.

`plan_engine` decides, before any weight is read, the compute dtype, the KV budget and the KV-cache
limits it gives, CUDA graphs and kernel tuning, so a bad setting fails before any work. Without
`engine.kv_budget_gib` the KV budget is the KV cache the step planner (`memory.plan`) gives train's
step under `train.memory_budget_gb` (on CUDA, by default, the memory free at start), so a step that
cannot fit is refused here too. `write_engine` then (capped to an explicit budget on CUDA) loads the
base in the kernels' layout, tunes the 4-bit kernels for the model's layer shapes on CUDA, and
writes the weights (`engine.weights`), the model's files and `engine.json` (with the memory plan),
which `engine.artifact.load_engine` reads. The stage (`stages/build_engine.py`) only chooses the
base and keys the artifact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import qerl_pipe
from qerl_pipe.engine.artifact import ENGINE_FILE, ENGINE_FORMAT_VERSION, device_kind
from qerl_pipe.engine.limits import EngineLimits, plan_limits
from qerl_pipe.engine.weights import save_engine_model
from qerl_pipe.errors import QerlError
from qerl_pipe.formats.checkpoint import refuse_non_finite
from qerl_pipe.formats.modelopt_writer import copy_model_files
from qerl_pipe.hf import compute_dtype, count_parameters
from qerl_pipe.kernels.configs import M_BUCKETS, ConfigTable, table_to_json
from qerl_pipe.log import log
from qerl_pipe.memory.plan import MemoryPlan, enforce_budget, plan_engine_step, release_budget
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.load import load_model, model_memory_bytes
from qerl_pipe.recipe import EngineSection, TrainSection
from qerl_pipe.strict_json import write_json

# Without engine.kv_budget_gib the KV cache is what the step planner (memory.plan) gives train's
# step under train.memory_budget_gb (on CUDA, by default, the memory free at start); on a CPU
# without a budget, this.
CPU_KV_BUDGET_BYTES = 2 * 2**30
# Tuning covers the M buckets the engine decodes at (up to its max batch) and a training-sized M
# (the M >= 1024 bucket: prefill and the training forward); dX runs only in training, so only
# there. Tuning every bucket for both ops would take minutes on a 7B model for no use.
PREFILL_TUNING_M = 4096
TUNING_MS = (*M_BUCKETS[:-1], PREFILL_TUNING_M)


@dataclass(frozen=True)
class EnginePlan:
    """What is decided before any weight is read (so a bad value fails before any work)."""

    config: DecoderConfig
    dtype: torch.dtype
    kv_budget_bytes: int
    limits: EngineLimits  # the KV cache and graphs that budget gives
    cuda_graphs: bool
    tune: bool
    memory_plan: MemoryPlan | None = None  # train's step, when it sized the KV cache
    enforce: bool = False  # cap the process at the plan's budget (CUDA, train.memory_budget_gb)


def _switch(choice: str, auto: bool, possible: bool, key: str, why: str) -> bool:
    if choice == "on" and not possible:
        raise QerlError(f"engine.{key}: on {why}; set engine.{key}=auto or off")
    return choice == "on" or (choice == "auto" and auto)


def plan_engine(section: EngineSection, hf_config: dict[str, Any], device: torch.device,
                train: TrainSection, processes: int = 1) -> EnginePlan:
    """What the engine section, train's step (its memory budget; each of `processes` ranks runs its
    share of the step over its own copy of the engine) and the model's config.json decide. Raises,
    before any weight is read, on a setting that cannot work: sequences longer than the model's
    positions, CUDA graphs or tuning forced on where they cannot run, a KV budget that holds not one
    sequence, a train step that no plan fits into train.memory_budget_gb."""
    config = DecoderConfig.from_hf(hf_config)
    if section.max_seq_len > config.max_position_embeddings:
        raise QerlError(
            f"engine.max_seq_len={section.max_seq_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings}); lower engine.max_seq_len"
        )
    cuda = device.type == "cuda"
    four_bit = section.base_format != "bf16"
    graphs = _switch(section.cuda_graphs, cuda, cuda, "cuda_graphs", "needs a CUDA device")
    tune = _switch(section.tune_kernels, cuda and four_bit, cuda and four_bit, "tune_kernels",
                   "needs a CUDA device and a 4-bit base (nvfp4 or nf4)")
    dtype = compute_dtype(section.dtype, device, count_parameters(hf_config))
    memory_plan, enforce = None, False
    if section.kv_budget_gib is not None:
        budget = int(section.kv_budget_gib * 2**30)
    else:
        # Refuses a step that cannot fit.
        memory_plan, enforce = plan_engine_step(train, section, config, device, dtype, processes)
        budget = memory_plan.estimate["kv_cache"] if memory_plan is not None else CPU_KV_BUDGET_BYTES
    # Raises now when not even one sequence fits.
    limits = plan_limits(config, max_seq_len=section.max_seq_len, max_batch=section.max_batch,
                         kv_budget_bytes=budget, dtype=dtype, cuda_graphs=graphs)
    return EnginePlan(config, dtype, budget, limits, graphs, tune, memory_plan, enforce)


def _linear_shapes(model: Decoder) -> list[tuple[int, int]]:
    """Distinct (N, K) of the fused linears, in model order."""
    shapes = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, QuantLinear)]
    return list(dict.fromkeys(shapes))


def _check_finite(model: torch.nn.Module) -> None:
    """A bf16 (or NF4) base is built from the source's weights as they are: NaN or inf there would
    give an engine whose every rollout is empty. (A 4-bit quantize already refuses them.)"""
    for name, t in model.state_dict().items():
        refuse_non_finite(name, t)


def write_engine(base_dir: Path, hf_config: dict[str, Any], plan: EnginePlan, section: EngineSection, device: torch.device, out: Path) -> dict[str, Any]:
    """Write the engine of the base in `base_dir` (its config.json as `hf_config`) into `out`;
    returns the manifest summary. Under an enforced budget the process is capped while it builds."""
    started = time.perf_counter()
    capped = plan.enforce  # only set when a step plan was made
    if capped:
        enforce_budget(plan.memory_plan.budget_bytes, device)
    try:
        return _write_engine(base_dir, hf_config, plan, section, device, out, started)
    finally:
        if capped:  # later stages of `run` in this process set their own cap
            release_budget(device)


def _write_engine(base_dir: Path, hf_config: dict[str, Any], plan: EnginePlan, section: EngineSection,
                  device: torch.device, out: Path, started: float) -> dict[str, Any]:
    from qerl_pipe.kernels.cuda_ext import available as cuda_kernels_available
    from qerl_pipe.kernels.tuning import tune_kernels

    model = load_model(base_dir, section.base_format, plan.dtype, device)
    _check_finite(model)
    budget, limits = plan.kv_budget_bytes, plan.limits
    table: ConfigTable | None = None
    if plan.tune and section.base_format == "nvfp4" and cuda_kernels_available(device):
        # The table holds Triton configs; on this GPU NVFP4 runs the CUDA kernels instead, whose
        # configs ship with the package (kernels/cuda/configs-h200.json).
        log(f"build-engine: NVFP4 runs the CUDA kernels on {device_kind(device)}; no Triton tuning")
    elif plan.tune:
        log(f"build-engine: tuning {section.base_format} kernels on {device_kind(device)}")
        decode_ms = [m for m in TUNING_MS if m <= limits.max_batch]
        table = tune_kernels(_linear_shapes(model), decode_ms + [PREFILL_TUNING_M], section.base_format, device,
                             dx_ms=[PREFILL_TUNING_M])
    save_engine_model(model, out, hf_config=hf_config)
    copy_model_files(base_dir, out)
    seconds = round(time.perf_counter() - started, 2)
    engine = {
        "format_version": ENGINE_FORMAT_VERSION,
        "base_format": section.base_format,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "limits": limits.to_json(),
        "kv_budget_bytes": budget,
        "memory_plan": plan.memory_plan.to_json() if plan.memory_plan is not None else None,
        "kernel_table": table_to_json(table) if table is not None else None,
        "device": {"type": device.type, "name": device_kind(device)},
        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": seconds,
        "qerl_pipe_version": qerl_pipe.__version__,
    }
    write_json(out / ENGINE_FILE, engine)
    summary = {
        "base_format": section.base_format,
        "dtype": engine["dtype"],
        "device": engine["device"]["name"],
        "max_batch": limits.max_batch,
        "max_seq_len": limits.max_seq_len,
        "kv_cache_mib": round(limits.kv_cache_bytes / 2**20, 1),
        "kv_budget_mib": round(budget / 2**20, 1),
        "model_mib": round(model_memory_bytes(model) / 2**20, 1),
        "cuda_graph_sizes": list(limits.graph_batch_sizes),
        "tuned_kernel_entries": len(table) if table is not None else 0,
        "seconds": seconds,
        **({"memory_plan": engine["memory_plan"]} if plan.memory_plan is not None else {}),
    }
    if plan.memory_plan is not None:
        log(f"build-engine: KV cache from train's memory plan: {plan.memory_plan.describe()}")
    log(f"build-engine: {section.base_format} base in {summary['dtype']} on {summary['device']}, "
        f"{summary['model_mib']} MiB; max_batch {limits.max_batch} x max_seq_len {limits.max_seq_len} "
        f"(KV cache {summary['kv_cache_mib']} of {summary['kv_budget_mib']} MiB); "
        f"{summary['tuned_kernel_entries'] or 'default'} kernel configs; {seconds} s")
    return summary
