"""`qerl-pipe run`: the recipe's stages in order, each reusing its artifact when up to date."""

from __future__ import annotations

from qerl_pipe.artifacts import Artifact, ArtifactStore
from qerl_pipe.recipe import Recipe
from qerl_pipe.stages.calibrate import run_calibrate
from qerl_pipe.stages.quantize import run_quantize


def run_pipeline(recipe: Recipe, store: ArtifactStore, *, force: bool = False) -> dict[str, Artifact]:
    """Run `recipe.stages`; `force` redoes every stage. Returns each stage's artifact."""
    results: dict[str, Artifact] = {}
    if "calibrate" in recipe.stages:
        results["calibrate"] = run_calibrate(recipe, store, force=force)
    if "quantize" in recipe.stages:
        results["quantize"] = run_quantize(recipe, store, calibration=results.get("calibrate"), force=force)
    return results
