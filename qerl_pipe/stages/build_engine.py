"""`qerl-pipe build-engine`: the model as the rollout engine and the trainer run it, done once per
(model, GPU) and stored: the base in the kernels' layout, KV limits planned from the memory budget,
kernels tuned on CUDA (the GPU's name is in the id). This module chooses the base (the quantize
artifact for nvfp4, the original model for nf4 and bf16) and keys the artifact; `jobs.engine_build`
builds it, `jobs.engine_artifact.load_engine` opens it (docs/engine.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact
from qerl_pipe.dag import BUILD_ENGINE, register
from qerl_pipe.jobs.engine_artifact import device_kind
from qerl_pipe.jobs.engine_build import EnginePlan, EngineSpec, plan_engine, write_engine
from qerl_pipe.errors import ModelSourceError, QerlError
from qerl_pipe.formats.checkpoint import detect_quant_format
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.hf import pick_device
from qerl_pipe.jobs.step_plan import EngineBudget, engine_budget
from qerl_pipe.kernels.base_formats import BaseFormat
from qerl_pipe.kernels.base_formats import base_format as format_entry
from qerl_pipe.log import log
from qerl_pipe.memory.plan import budget_cap
from qerl_pipe.recipe import EngineSection, Recipe
from qerl_pipe.rl.loop.distributed import current_dist
from qerl_pipe.runner import StageCall
from qerl_pipe.sources import model_config_key, peek_model_config

STAGE = BUILD_ENGINE


@dataclass(frozen=True)
class _Base:
    """Where the base weights come from, and what names them in the artifact id."""

    dir: Path
    hf_config: dict[str, Any]
    identity: dict[str, Any]
    parents: list[str]


def _unused_quantized(artifact: Artifact, model_key: dict[str, Any], recipe: Recipe, base_format: str) -> None:
    """An nf4 or bf16 engine reads the original model, not a quantize artifact. A chain of stage
    commands (the Makefile, the Airflow DAG) hands build-engine the quantize artifact whatever the
    base, so one quantized from this very model is accepted and left unused; one of another model
    is refused, as the two inputs then disagree about the base."""
    if artifact.manifest["config"].get("model") != model_key:
        raise QerlError(f"{artifact.path} was quantized from another model than model.source "
                        f"({recipe.model.source}); an engine.base_format={base_format} engine reads model.source "
                        "itself: drop --quantized, or pass the quantize artifact of that model")
    log(f"build-engine: engine.base_format={base_format} reads the original model; {artifact.path.name} "
        "(quantized from it) is not used")


def engine_spec(section: EngineSection) -> EngineSpec:
    """The engine the section asks for, as the engine package takes it (the KV budget and the
    device are decided here)."""
    return EngineSpec(section.base_format, section.max_seq_len, section.max_batch, section.cuda_graphs,
                      section.tune_kernels, section.dtype, section.deterministic, section.activations,
                      section.kv_cache)


def _plan(recipe: Recipe, hf_config: dict[str, Any], device: torch.device,
          processes: int) -> tuple[EnginePlan, EngineBudget]:
    """The engine's plan and the budget that sized its KV cache; raises before any work."""
    budget = engine_budget(recipe, hf_config, device, processes)  # refuses a train step that cannot fit
    return plan_engine(engine_spec(recipe.engine), hf_config, device, budget.kv_bytes), budget


def check_engine_recipe(recipe: Recipe, store: ArtifactStore) -> None:
    """The check before any work (`run`'s and `--build-missing`'s, before their first stage): what
    `_plan` refuses (sequences past the model's positions, a train step no plan fits), from the
    model's config.json alone (a GGUF file's metadata; a hub id offline is checked once downloaded)."""
    hf_config = peek_model_config(recipe.model, store)
    if hf_config is not None:
        _plan(recipe, hf_config, pick_device(recipe.engine.device), current_dist().world_size)


def _base_of(call: StageCall, fmt: BaseFormat) -> _Base:
    """Where the base weights come from: the quantize artifact (nvfp4), else the recipe's model."""
    recipe = call.recipe
    if fmt.from_quantize_artifact:
        if call.passed("quantized") is None:  # an engine that cannot be built fails before calibrate and quantize
            check_engine_recipe(recipe, call.store)
        quantized = call.input("quantized")
        return _Base(quantized.path, read_model_config(quantized.path), {"quantized": quantized.identity}, [quantized.id])
    resolved = call.model()
    model_key = model_config_key(resolved, recipe.model)
    quantized = call.input("quantized")  # not used by this base: only the one passed, if any
    if quantized is not None:
        _unused_quantized(quantized, model_key, recipe, fmt.name)
    quant = detect_quant_format(resolved.config)
    if quant is not None and not fmt.loads_nvfp4_checkpoint:
        raise ModelSourceError(f"{resolved.dir} is an NVFP4 checkpoint ({quant}); an {fmt.name} engine needs the "
                               "original 16-bit model as model.source (re-rounding 4-bit codes would compound)")
    return _Base(resolved.dir, resolved.config, {"model": model_key}, resolved.parents)


def _engine_key(recipe: Recipe, base: _Base, fmt: BaseFormat, device: torch.device,
                budget: EngineBudget) -> dict[str, Any]:
    """What names the engine: its base, section, GPU and, where a budget sized it, that step."""
    config = {"base": base.identity, "engine": recipe.engine.model_dump(), "device": device_kind(device)}
    for key in ("activations", "kv_cache"):
        if config["engine"][key] == EngineSection.model_fields[key].default:
            del config["engine"][key]  # the default: engines made before the setting keep their ids
    if fmt.layout_version > 1:
        # A base whose stored bytes changed gets new ids, so the store rebuilds rather than
        # reuses its old engines (engines of the other formats keep their ids).
        config["base_layout_version"] = fmt.layout_version
    if budget.plan is not None and recipe.train.memory_budget_gb is not None:
        # The budget and train's step sized the KV cache, and engine.json holds that plan (engines
        # without a budget keep their ids).
        config["memory_budget_gb"] = recipe.train.memory_budget_gb
        step = asdict(budget.plan.shape)
        if step["kv_cache"] == EngineSection.model_fields["kv_cache"].default:
            del step["kv_cache"]  # likewise
        config["train_step"] = step
    return config


def _write(pending: PendingArtifact, *, base: _Base, plan: EnginePlan, budget: EngineBudget,
           section: EngineSection, device: torch.device) -> None:
    memory_plan = budget.plan.to_json() if budget.plan is not None else None
    if budget.plan is not None:
        log(f"build-engine: KV cache from train's memory plan: {budget.plan.describe()}")
    with budget_cap(budget.cap_bytes, device):  # the build proves the budget, as train will
        pending.summary.update(write_engine(base.dir, base.hf_config, plan, engine_spec(section), device,
                                            pending.dir, memory_plan))


@register(STAGE, check=check_engine_recipe)
def build_engine_stage(call: StageCall) -> Artifact:
    """Build (or reuse) the engine the recipe's `engine` section describes: nvfp4 from the quantize
    artifact, nf4 and bf16 from the recipe's model."""
    recipe, section = call.recipe, call.recipe.engine
    device = pick_device(section.device)
    fmt = format_entry(section.base_format)
    base = _base_of(call, fmt)
    # Under `train --nproc N` (rank 0 building a missing engine) each rank runs 1/N of the step.
    plan, budget = _plan(recipe, base.hf_config, device, current_dist().world_size)
    build = partial(_write, base=base, plan=plan, budget=budget, section=section, device=device)
    return call.seal(config=_engine_key(recipe, base, fmt, device, budget), parents=base.parents, build=build)
