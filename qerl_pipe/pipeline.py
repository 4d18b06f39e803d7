"""The pipeline's front door: a stage as its command runs it (`run_stage`), and `qerl-pipe run`
(`run_recipe`), which checks the whole recipe before its first stage, then makes each listed stage's
artifact in DAG order, reusing what is up to date. Importing it registers every stage's entry point.
See docs/pipeline.md, section "Chaining the stages"."""

from __future__ import annotations

from typing import Any

import qerl_pipe.stages  # noqa: F401  (registers each stage's entry point with the DAG)
from qerl_pipe.artifacts import Artifact, ArtifactStore
from qerl_pipe.dag import EVAL, EXPORT, TRAIN, Stage, entry_point, stage
from qerl_pipe.errors import QerlError
from qerl_pipe.recipe import Recipe
from qerl_pipe.rl.loop.distributed import launched_by_torchrun
from qerl_pipe.runner import StageCall, preflight, recipe_artifact


def run_stage(stage_: Stage, recipe: Recipe, store: ArtifactStore, *, force: bool = False,
              build_missing: bool = False, **given: Any) -> Artifact:
    """`stage_` as its command runs it. A keyword naming one of its inputs passes it (an artifact, a path or an id;
    a loose input's any reference the stage resolves); an input not passed is found when the stage needs it,
    built only with `build_missing`. Other keywords are the stage's own options (quantize's `output`)."""
    inputs = {inp.keyword: inp for inp in stage_.inputs}
    # A path or id passed to an input is resolved (and verified) in the store; a loose input's stays as it is.
    passed = {key: value if value is None or inputs[key].loose or isinstance(value, Artifact)
              else store.resolve(str(value)) for key, value in given.items() if key in inputs}
    options = {key: value for key, value in given.items() if key not in inputs}
    call = StageCall(stage_, recipe, store, passed, force=force, build_missing=build_missing)
    return entry_point(stage_)(call, **options)


def run_recipe(recipe: Recipe, store: ArtifactStore, *, force: bool = False) -> dict[str, Artifact]:
    """Run `recipe.stages`; `force` redoes every stage. Returns each stage's artifact."""
    if launched_by_torchrun():  # every rank would run every stage against one store
        raise QerlError("`run` is one process; for several GPUs run the stages before train once, then "
                        "`qerl-pipe train --nproc N` (or torchrun ... -m qerl_pipe train), then export and eval")
    if recipe.train.adapter == "full":
        _check_full_run_stages(recipe)
    # The check of every stage it will build runs before the first stage; a full run's eval of
    # its export is declared in the DAG (`dag.full_run_eval`).
    preflight([stage(name) for name in recipe.stages], recipe, store)
    made: dict[str, Artifact] = {}
    for name in recipe.stages:
        recipe_artifact(stage(name), recipe, store, build=True, force=force, made=made)
    return {name: made[name] for name in recipe.stages}


def _check_full_run_stages(recipe: Recipe) -> None:
    """A full fine-tuning run has no adapter: the export and eval settings that need one are refused before training."""
    listed = set(recipe.stages)
    if EXPORT.name in listed and recipe.export.format == "peft":
        raise QerlError("export.format=peft with train.adapter=full: a full run has no adapter; set "
                        "export.format=merged-bf16 (the whole trained model) or merged-nvfp4")
    exported = EXPORT.name in listed and recipe.export.format == "merged-bf16"
    if {EVAL.name, TRAIN.name} <= listed and not exported:
        raise QerlError("eval after train.adapter=full evaluates the run's merged-bf16 export: add export to stages "
                        "with export.format=merged-bf16, or drop eval from stages")
