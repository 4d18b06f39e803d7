"""`qerl-pipe build-engine`: the model as the rollout engine and the trainer run it.

Everything that can be done once per (model, GPU) is done here and stored, so that train and
eval start in seconds: the base is converted to the kernels' layout (`engine.weights`), the
KV-cache limits are planned from a memory budget on the target device (`engine.limits`: the KV
bytes the step planner, `memory.plan`, gives train's step under `train.memory_budget_gb`), and on
CUDA the 4-bit kernels are tuned for the model's layer shapes (`kernels.tuning`). Tuning is
per GPU, so the GPU's name is part of the artifact's identity.

The base comes from the quantize artifact (nvfp4) or from the original model (nf4, the QLoRA
baseline; bf16). Later stages open the engine with `engine.artifact.load_engine`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import qerl_pipe
from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact
from qerl_pipe.dag import BUILD_ENGINE, check_kind, find_or_build, input_artifact
from qerl_pipe.engine.artifact import ENGINE_FILE, ENGINE_FORMAT_VERSION, device_kind
from qerl_pipe.engine.limits import EngineLimits, plan_limits
from qerl_pipe.engine.weights import save_engine_model
from qerl_pipe.errors import ModelSourceError, QerlError
from qerl_pipe.formats.checkpoint import detect_quant_format
from qerl_pipe.formats.modelopt_writer import copy_model_files
from qerl_pipe.kernels.configs import M_BUCKETS, ConfigTable, table_to_json
from qerl_pipe.log import log
from qerl_pipe.memory.plan import MemoryPlan, enforce_budget, plan_engine
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.load import load_model, model_memory_bytes
from qerl_pipe.recipe import EngineSection, Recipe, TrainSection
from qerl_pipe.sources import resolve_model
from qerl_pipe.hf import compute_dtype, count_parameters, pick_device
from qerl_pipe.stages.common import model_config_key

STAGE = BUILD_ENGINE
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
class _Base:
    """Where the base weights come from, and what names them in the artifact id."""

    dir: Path
    hf_config: dict[str, Any]
    identity: dict[str, Any]
    parents: list[str]


@dataclass(frozen=True)
class _Plan:
    """What is decided before any weight is read (so a bad value fails before any work)."""

    config: DecoderConfig
    dtype: torch.dtype
    kv_budget_bytes: int
    cuda_graphs: bool
    tune: bool
    memory_plan: MemoryPlan | None = None  # train's step, when it sized the KV cache
    enforce: bool = False  # cap the process at the plan's budget (CUDA, train.memory_budget_gb)


def _switch(choice: str, auto: bool, possible: bool, key: str, why: str) -> bool:
    if choice == "on" and not possible:
        raise QerlError(f"engine.{key}: on {why}; set engine.{key}=auto or off")
    return choice == "on" or (choice == "auto" and auto)


def _plan(section: EngineSection, hf_config: dict[str, Any], device: torch.device, train: TrainSection) -> _Plan:
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
        memory_plan, enforce = plan_engine(train, section, config, device, dtype)  # refuses a step that cannot fit
        budget = memory_plan.estimate["kv_cache"] if memory_plan is not None else CPU_KV_BUDGET_BYTES
    plan = _Plan(config, dtype, budget, graphs, tune, memory_plan, enforce)
    _limits(plan, section, budget)  # raises now when not even one sequence fits
    return plan


def _limits(plan: _Plan, section: EngineSection, budget: int) -> EngineLimits:
    return plan_limits(plan.config, max_seq_len=section.max_seq_len, max_batch=section.max_batch,
                       kv_budget_bytes=budget, dtype=plan.dtype, cuda_graphs=plan.cuda_graphs)


def _check_quantized(artifact: Artifact) -> None:
    check_kind(artifact, "quantize", "--quantized")


def _unused_quantized(artifact: Artifact, model_key: dict[str, Any], recipe: Recipe, base_format: str) -> None:
    """An nf4 or bf16 engine reads the original model, not a quantize artifact. A chain of stage
    commands (the Makefile, the Airflow DAG) hands build-engine the quantize artifact whatever the
    base, so one quantized from this very model is accepted and left unused; one of another model
    is refused, as the two inputs then disagree about the base."""
    _check_quantized(artifact)
    if artifact.manifest["config"].get("model") != model_key:
        raise QerlError(f"{artifact.path} was quantized from another model than model.source "
                        f"({recipe.model.source}); an engine.base_format={base_format} engine reads model.source "
                        "itself: drop --quantized, or pass the quantize artifact of that model")
    log(f"build-engine: engine.base_format={base_format} reads the original model; {artifact.path.name} "
        "(quantized from it) is not used")


def _quantized_base(artifact: Artifact) -> _Base:
    hf_config = json.loads((artifact.path / "config.json").read_text())
    return _Base(artifact.path, hf_config, {"quantized": artifact.id}, [artifact.id])


def _linear_shapes(model: Decoder) -> list[tuple[int, int]]:
    """Distinct (N, K) of the fused linears, in model order."""
    shapes = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, QuantLinear)]
    return list(dict.fromkeys(shapes))


def _check_finite(model: torch.nn.Module) -> None:
    """A bf16 (or NF4) base is built from the source's weights as they are: NaN or inf there would
    give an engine whose every rollout is empty. (A 4-bit quantize already refuses them.)"""
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise QerlError(f"{name} has non-finite values (NaN or inf); the model's weights are damaged, "
                            "re-download or re-convert it")


def _build(base: _Base, plan: _Plan, section: EngineSection, device: torch.device, out: Path) -> dict[str, Any]:
    """Write the engine into `out`; returns the manifest summary."""
    from qerl_pipe.kernels.cuda_ext import available as cuda_kernels_available
    from qerl_pipe.kernels.tuning import tune_kernels

    started = time.perf_counter()
    if plan.enforce:
        enforce_budget(plan.memory_plan.budget_bytes, device)
    model = load_model(base.dir, section.base_format, plan.dtype, device)
    _check_finite(model)
    budget = plan.kv_budget_bytes
    limits = _limits(plan, section, budget)
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
    save_engine_model(model, out, hf_config=base.hf_config)
    copy_model_files(base.dir, out)
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
    (out / ENGINE_FILE).write_text(json.dumps(engine, indent=2) + "\n")
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


def run_build_engine(recipe: Recipe, store: ArtifactStore, *, quantized: Artifact | None = None,
                     force: bool = False, build_missing: bool = False, find_only: bool = False) -> Artifact:
    """Build (or reuse) the engine the recipe's `engine` section describes.

    nvfp4 builds from `quantized`, or from the quantize artifact the recipe describes (found; made
    only with `build_missing`); nf4 and bf16 build from `recipe.model`. `force` redoes this stage only.
    """
    section = recipe.engine
    device = pick_device(section.device)
    if section.base_format == "nvfp4":
        if quantized is None:
            _plan(section, resolve_model(recipe.model, store).config, device, recipe.train)  # fail before quantizing
            quantized = input_artifact(STAGE.name, "--quantized", recipe, store, build_missing=build_missing,
                                       find_only=find_only)
        _check_quantized(quantized)
        base = _quantized_base(quantized)
    else:
        resolved = resolve_model(recipe.model, store)
        model_key = model_config_key(resolved, recipe.model)
        if quantized is not None:
            _unused_quantized(quantized, model_key, recipe, section.base_format)
        quant = detect_quant_format(resolved.config)
        if quant is not None and section.base_format == "nf4":
            raise ModelSourceError(f"{resolved.dir} is an NVFP4 checkpoint ({quant}); an nf4 engine needs the "
                                   "original 16-bit model as model.source (re-rounding 4-bit codes would compound)")
        base = _Base(resolved.dir, resolved.config, {"model": model_key}, resolved.parents)
    plan = _plan(section, base.hf_config, device, recipe.train)
    config = {"base": base.identity, "engine": section.model_dump(), "device": device_kind(device)}
    if plan.memory_plan is not None and recipe.train.memory_budget_gb is not None:
        config["memory_budget_gb"] = recipe.train.memory_budget_gb  # sized the KV cache (engines without one keep their ids)

    def build(pending: PendingArtifact) -> None:
        pending.summary.update(_build(base, plan, section, device, pending.dir))

    return find_or_build(STAGE, store, config=config, parents=base.parents, build=build, force=force,
                         find_only=find_only)
