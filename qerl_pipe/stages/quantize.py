"""`qerl-pipe quantize`: an HF model to an NVFP4 checkpoint in modelopt's unified HF layout.

Streamed shard by shard (host memory near one shard plus one tensor); every tensor is checked before
anything is written; the artifact is itself a loadable model directory. See docs/pipeline.md,
section "What calibrate and quantize compute"."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any


from qerl_pipe.artifacts import Artifact, ArtifactStore
from qerl_pipe.artifacts.store import check_output_dir, copy_to
from qerl_pipe.dag import CALIBRATE, QUANTIZE, register
from qerl_pipe.errors import QerlError, RecipeError
from qerl_pipe.hf import count_parameters
from qerl_pipe.jobs.quantize_job import write_checkpoint
from qerl_pipe.log import log
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.quality import quality_key
from qerl_pipe.recipe import QuantizeSection, Recipe
from qerl_pipe.runner import StageCall
from qerl_pipe.sources import model_config_key, peek_model_key


STAGE = QUANTIZE


def check_quantize_recipe(recipe: Recipe, store: ArtifactStore) -> None:
    """`run`'s check before its first stage: act-mse needs the calibration `run` makes."""
    if recipe.quantize.method == "act-mse" and CALIBRATE.name not in recipe.stages:
        raise RecipeError("quantize.method=act-mse weighs errors by calibration statistics: add calibrate to the "
                          "recipe's stages (before quantize), or use another quantize.method")


def _check_calibration(calibration: Artifact, model_key: dict) -> None:
    if calibration.manifest["config"].get("model") != model_key:
        raise QerlError(f"calibration {calibration.path.name} was made for another model (or another version of it); "
                        "run `qerl-pipe calibrate` with the same model first")


def _checked_model(call: StageCall, calibration: Artifact | None) -> tuple[Any, dict]:
    """The recipe's model (resolved, a GGUF imported) and its key, the calibration checked against
    it as early as it can be (before a GGUF import; a hub id: after its download)."""
    recipe = call.recipe
    early_key = peek_model_key(recipe.model) if calibration is not None else None
    if early_key is not None:
        _check_calibration(calibration, early_key)
    resolved = call.model()
    DecoderConfig.from_hf(resolved.config)
    model_key = model_config_key(resolved, recipe.model)
    if calibration is not None and early_key is None:
        _check_calibration(calibration, model_key)
    return resolved, model_key


def _quantize_key(section: QuantizeSection, resolved: Any) -> dict[str, Any]:
    """The quantize section as the artifact's id sees it."""
    key = section.model_dump(exclude={"quality"})
    if key["method"] == "rtn":
        del key["method"]  # the default: artifacts made before the setting existed keep their ids
    # The quality report is in the manifest: a setting that changes it is part of the id.
    report_key = quality_key(section.quality, count_parameters(resolved.config))
    if report_key is not None:
        key["quality"] = report_key
    return key


@register(STAGE, check=check_quantize_recipe)
def quantize_stage(call: StageCall, *, output: Path | None = None) -> Artifact:
    """Quantize the recipe's model: NVFP4 with input scales from the calibration passed, else
    weight-only (W4A16_NVFP4); the calibration is an optional input, so none is looked for or built
    here. `output`: a new directory to copy the checkpoint to."""
    recipe, calibration = call.recipe, call.input("calibration")
    section = recipe.quantize
    if calibration is None and section.method == "act-mse":
        raise RecipeError("quantize.method=act-mse weighs errors by calibration statistics: run "
                          "`qerl-pipe calibrate` and pass --calibration ART, or use `qerl-pipe run`, which chains them")
    resolved, model_key = _checked_model(call, calibration)
    config = {"model": model_key, "quantize": _quantize_key(section, resolved), "calibrated": calibration is not None}
    parents = resolved.parents + ([calibration.id] if calibration else [])
    output_done = check_output_dir(output, call.store.artifact_id_for(STAGE.name, STAGE.version, config, parents))
    build = partial(write_checkpoint, resolved=resolved, section=section, calibration=calibration,
                    trust_remote_code=recipe.model.trust_remote_code)
    artifact = call.seal(config=config, parents=parents, build=build)
    if output is not None:
        if not output_done and copy_to(artifact, output):
            log(f"quantize: the checkpoint is in {output}")
        else:
            log(f"quantize: {output} already holds this checkpoint")
    return artifact
