"""`qerl-pipe quantize`: an HF model to an NVFP4 checkpoint in modelopt's unified HF layout.

The model is streamed shard by shard and tensor by tensor, so host memory stays near one shard
plus one tensor. A first pass reads every tensor once to check it (finite, a norm's included; a
linear weight also K % 16 == 0) and to take the amax of each fused group (q/k/v, gate/up share
one global scale); only then does the second pass write anything. The artifact directory is
itself a loadable model directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact
from qerl_pipe.artifacts.store import check_output_dir, copy_to
from qerl_pipe.dag import CALIBRATE, QUANTIZE, register
from qerl_pipe.errors import ModelSourceError, QerlError, RecipeError
from qerl_pipe.formats.calibration import CHANNELS_FILE, read_channel_mean_square, read_input_amax
from qerl_pipe.formats.checkpoint import list_shards
from qerl_pipe.formats.modelopt_writer import (
    WritePlan, input_scales, out_dtype, plan_checkpoint, write_configs, write_shards,
)
from qerl_pipe.hf import count_parameters
from qerl_pipe.log import log
from qerl_pipe.memwatch import PeakRSS, return_freed_tensors_to_os
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.quality import layer_error_report, perplexity_report, print_quality_report, quality_key
from qerl_pipe.recipe import Recipe
from qerl_pipe.runner import StageCall
from qerl_pipe.sources import model_config_key, peek_model_key
from qerl_pipe.strict_json import write_json


STAGE = QUANTIZE


def _channel_stats(method: str, calibration: Artifact | None, plan: WritePlan) -> tuple[dict[str, torch.Tensor] | None, str]:
    """Per quantized module, its input channels' mean squares (what act-mse weighs errors by, and
    what the report's output error needs), or None and why there are none."""
    if calibration is None:
        return None, "no calibration artifact (--calibration): output error not reported"
    try:
        stats = read_channel_mean_square(calibration.path)
    except FileNotFoundError as exc:
        if method == "act-mse":
            raise QerlError(f"{exc} (an older calibrate made it): re-run `qerl-pipe calibrate --force`") from None
        return None, "the calibration has no per-channel statistics (an older calibrate made it): output error not reported"
    missing = sorted(set(plan.quantized.values()) - set(stats))
    if missing:
        raise QerlError(f"calibration {calibration.path} has no statistics for {missing[:3]}; it is of another model")
    return stats, f"from {CHANNELS_FILE} of calibration {calibration.id}"


def check_quantize_recipe(recipe: Recipe, store: ArtifactStore) -> None:
    """`run`'s check before its first stage: act-mse needs the calibration `run` makes."""
    if recipe.quantize.method == "act-mse" and CALIBRATE.name not in recipe.stages:
        raise RecipeError("quantize.method=act-mse weighs errors by calibration statistics: add calibrate to the "
                          "recipe's stages (before quantize), or use another quantize.method")


def _check_calibration(calibration: Artifact, model_key: dict) -> None:
    if calibration.manifest["config"].get("model") != model_key:
        raise QerlError(f"calibration {calibration.path.name} was made for another model (or another version of it); "
                        "run `qerl-pipe calibrate` with the same model first")


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
    early_key = peek_model_key(recipe.model) if calibration is not None else None
    if early_key is not None:
        _check_calibration(calibration, early_key)  # before a GGUF import (a hub id: after its download)
    resolved = call.model()
    DecoderConfig.from_hf(resolved.config)
    model_key = model_config_key(resolved, recipe.model)
    if calibration is not None and early_key is None:
        _check_calibration(calibration, model_key)
    quantize_key = section.model_dump(exclude={"quality"})
    if quantize_key["method"] == "rtn":
        del quantize_key["method"]  # the default: artifacts made before the setting existed keep their ids
    # The quality report is in the manifest: a setting that changes it is part of the id.
    report_key = quality_key(section.quality, count_parameters(resolved.config))
    if report_key is not None:
        quantize_key["quality"] = report_key
    config = {"model": model_key, "quantize": quantize_key, "calibrated": calibration is not None}
    parents = resolved.parents + ([calibration.id] if calibration else [])
    output_done = check_output_dir(output, call.store.artifact_id_for(STAGE.name, STAGE.version, config, parents))  # before any work

    def build(pending: PendingArtifact) -> None:
        started = time.perf_counter()
        shards = list_shards(resolved.dir)
        exclude = sorted({"lm_head", *section.exclude})
        dtype = out_dtype(section.dtype, resolved.config)
        return_freed_tensors_to_os()
        with PeakRSS() as memory:
            plan = plan_checkpoint(shards, exclude)
            if not plan.quantized:
                raise ModelSourceError(f"{resolved.dir} has no Llama-family linear weights to quantize")
            scales = input_scales(plan, read_input_amax(calibration.path) if calibration else None)
            channel_ms, output_basis = _channel_stats(section.method, calibration, plan)
            errors = write_shards(shards, pending.dir, plan, scales, dtype, section.method, channel_ms)
        quant_algo = "NVFP4" if calibration else "W4A16_NVFP4"
        write_configs(resolved.dir, pending.dir, quant_algo, sorted({"lm_head", *plan.excluded}), dtype)
        quality = layer_error_report(section.method, errors, output_basis)
        write_json(pending.dir / "quality.json", quality)
        pending.reports.add("quality.json")  # read by people, never by a stage: not in the children's ids
        ppl = perplexity_report(resolved, pending.dir, section.quality, recipe.model.trust_remote_code)
        size_in = sum(p.stat().st_size for p in shards)
        size_out = sum(p.stat().st_size for p in pending.dir.glob("*.safetensors"))
        pending.summary.update({
            "quant_algo": quant_algo,
            "method": section.method,
            "quantized_linears": len(errors),
            "mean_relative_error": quality["summary"]["mean_weight_error"],
            "max_relative_error": quality["summary"]["max_weight_error"],
            # Expected output error from the calibration's channel statistics; None without them.
            "mean_output_relative_error": quality["summary"]["mean_output_error"],
            "max_output_relative_error": quality["summary"]["max_output_error"],
            "size_mb": {"in": size_in / 2**20, "out": size_out / 2**20},
            "shards": len(shards),
            "largest_shard_mb": max(p.stat().st_size for p in shards) / 2**20,
            "peak_host_memory_mb": memory.peak_increase_bytes / 2**20,
            "perplexity": ppl,
            "seconds": round(time.perf_counter() - started, 2),
        })
        print_quality_report(quality["summary"], ppl, pending.summary, output_basis)

    artifact = call.seal(config=config, parents=parents, build=build)
    if output is not None:
        if not output_done and copy_to(artifact, output):
            log(f"quantize: the checkpoint is in {output}")
        else:
            log(f"quantize: {output} already holds this checkpoint")
    return artifact
