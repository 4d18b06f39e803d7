"""`qerl-pipe run`: the recipe's stages in order, each reusing its artifact when up to date."""

from __future__ import annotations

from qerl_pipe.artifacts import Artifact, ArtifactStore
from qerl_pipe.errors import QerlError
from qerl_pipe.recipe import Recipe
from qerl_pipe.rl.distributed import launched_by_torchrun
from qerl_pipe.stages.build_engine import run_build_engine
from qerl_pipe.stages.calibrate import run_calibrate
from qerl_pipe.stages.export import run_export
from qerl_pipe.stages.evaluate import check_eval_inputs, run_eval
from qerl_pipe.stages.quantize import run_quantize
from qerl_pipe.stages.train import check_train_inputs, run_train


def run_pipeline(recipe: Recipe, store: ArtifactStore, *, force: bool = False) -> dict[str, Artifact]:
    """Run `recipe.stages`; `force` redoes every stage. Returns each stage's artifact."""
    if launched_by_torchrun():  # every rank would run every stage against one store
        raise QerlError("`run` is one process; for several GPUs run the stages before train once, then "
                        "`qerl-pipe train --nproc N` (or torchrun ... -m qerl_pipe train), then export and eval")
    results: dict[str, Artifact] = {}
    if "train" in recipe.stages:
        check_train_inputs(recipe)  # a bad data file or reward name fails before the first stage
    full = recipe.train.adapter == "full"
    if full:
        _check_full_run_stages(recipe)
    if "eval" in recipe.stages:
        check_eval_inputs(recipe)
    if "calibrate" in recipe.stages:
        results["calibrate"] = run_calibrate(recipe, store, force=force)
    if "quantize" in recipe.stages:
        results["quantize"] = run_quantize(recipe, store, calibration=results.get("calibrate"), force=force)
    if "build-engine" in recipe.stages:
        # An nf4 or bf16 engine reads the original model, not the quantize artifact.
        quantized = results.get("quantize") if recipe.engine.base_format == "nvfp4" else None
        results["build-engine"] = run_build_engine(recipe, store, quantized=quantized, force=force)
    if "train" in recipe.stages:
        results["train"] = run_train(recipe, store, engine=results.get("build-engine"), force=force)
    if "export" in recipe.stages:
        results["export"] = run_export(recipe, store, run=results.get("train"), force=force)
    if "eval" in recipe.stages and full and "train" in recipe.stages:
        # A full run has no adapter: its merged-bf16 export is the trained model.
        results["eval"] = run_eval(recipe, store, engine=results["export"], force=force)
    elif "eval" in recipe.stages:
        # The trained adapter on the engine it was trained over (without train: the base model).
        results["eval"] = run_eval(recipe, store, engine=results.get("build-engine"), adapter=results.get("train"),
                                   force=force)
    return results


def _check_full_run_stages(recipe: Recipe) -> None:
    """A full fine-tuning run has no adapter: refuse, before the first stage, the export and eval
    settings that need one (so the error comes before training, not after)."""
    if "export" in recipe.stages and recipe.export.format == "peft":
        raise QerlError("export.format=peft with train.adapter=full: a full run has no adapter; set "
                        "export.format=merged-bf16 (the whole trained model) or merged-nvfp4")
    exported = "export" in recipe.stages and recipe.export.format == "merged-bf16"
    if "eval" in recipe.stages and "train" in recipe.stages and not exported:
        raise QerlError("eval after train.adapter=full evaluates the run's merged-bf16 export: add export to stages "
                        "with export.format=merged-bf16, or drop eval from stages")
