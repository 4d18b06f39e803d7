"""`qerl-pipe build-engine`: the model as the rollout engine and the trainer run it.

Everything that can be done once per (model, GPU) is done here and stored, so that train and
eval start in seconds: the base is converted to the kernels' layout (`engine.weights`), the
KV-cache limits are planned from a memory budget on the target device (`engine.limits`: the KV
bytes the step planner, `memory.plan`, gives train's step under `train.memory_budget_gb`), and on
CUDA the 4-bit kernels are tuned for the model's layer shapes (`kernels.tuning`). Tuning is
per GPU, so the GPU's name is part of the artifact's identity.

The base comes from the quantize artifact (nvfp4) or from the original model (nf4, the QLoRA
baseline; bf16); choosing it and keying the artifact is this module, the build itself is
`engine.build`. Later stages open the engine with `engine.artifact.load_engine`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact
from qerl_pipe.dag import BUILD_ENGINE, check_kind, find_or_build, input_artifact
from qerl_pipe.engine.artifact import device_kind
from qerl_pipe.engine.build import plan_engine, write_engine
from qerl_pipe.errors import ModelSourceError, QerlError
from qerl_pipe.formats.checkpoint import detect_quant_format
from qerl_pipe.hf import pick_device
from qerl_pipe.log import log
from qerl_pipe.recipe import Recipe
from qerl_pipe.rl.distributed import current_dist
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.sources import model_config_key, peek_model_config, resolve_model

STAGE = BUILD_ENGINE


@dataclass(frozen=True)
class _Base:
    """Where the base weights come from, and what names them in the artifact id."""

    dir: Path
    hf_config: dict[str, Any]
    identity: dict[str, Any]
    parents: list[str]


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
    hf_config = read_model_config(artifact.path)
    return _Base(artifact.path, hf_config, {"quantized": artifact.id}, [artifact.id])


def check_engine_recipe(recipe: Recipe, store: ArtifactStore) -> None:
    """The check before any work (`run`'s, before its first stage): what `plan_engine` refuses, from
    the model's config.json alone (a GGUF file's metadata; a hub id offline is checked once
    downloaded)."""
    hf_config = peek_model_config(recipe.model, store)
    if hf_config is not None:
        plan_engine(recipe.engine, hf_config, pick_device(recipe.engine.device), recipe.train,
                    current_dist().world_size)


def run_build_engine(recipe: Recipe, store: ArtifactStore, *, quantized: Artifact | None = None,
                     force: bool = False, build_missing: bool = False, find_only: bool = False) -> Artifact:
    """Build (or reuse) the engine the recipe's `engine` section describes.

    nvfp4 builds from `quantized`, or from the quantize artifact the recipe describes (found; made
    only with `build_missing`); nf4 and bf16 build from `recipe.model`. `force` redoes this stage only.
    """
    section = recipe.engine
    device = pick_device(section.device)
    # Under `train --nproc N` (rank 0 building a missing engine) each rank runs 1/N of the step.
    processes = current_dist().world_size
    if section.base_format == "nvfp4":
        if quantized is None:
            check_engine_recipe(recipe, store)  # before quantizing (or importing) for an engine that cannot be built
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
    plan = plan_engine(section, base.hf_config, device, recipe.train, processes)
    config = {"base": base.identity, "engine": section.model_dump(), "device": device_kind(device)}
    if plan.memory_plan is not None and recipe.train.memory_budget_gb is not None:
        # The budget and train's step sized the KV cache, and engine.json holds that plan (engines
        # without a budget keep their ids).
        config["memory_budget_gb"] = recipe.train.memory_budget_gb
        config["train_step"] = asdict(plan.memory_plan.shape)

    def build(pending: PendingArtifact) -> None:
        pending.summary.update(write_engine(base.dir, base.hf_config, plan, section, device, pending.dir))

    return find_or_build(STAGE, store, config=config, parents=base.parents, build=build, force=force,
                         find_only=find_only)
