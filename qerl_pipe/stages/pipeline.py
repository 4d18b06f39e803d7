"""`qerl-pipe run`: the recipe's stages in DAG order (`dag.run_pipeline`), each reusing its artifact
when up to date. The one command that builds upstream artifacts without being asked to; it is not
a stage, so it may check every stage's inputs before the first one starts."""

from __future__ import annotations

from qerl_pipe import dag
from qerl_pipe.artifacts import Artifact, ArtifactStore
from qerl_pipe.errors import QerlError
from qerl_pipe.recipe import Recipe
from qerl_pipe.rl.distributed import launched_by_torchrun


def run_pipeline(recipe: Recipe, store: ArtifactStore, *, force: bool = False) -> dict[str, Artifact]:
    """Run `recipe.stages`; `force` redoes every stage. Returns each stage's artifact."""
    if launched_by_torchrun():  # every rank would run every stage against one store
        raise QerlError("`run` is one process; for several GPUs run the stages before train once, then "
                        "`qerl-pipe train --nproc N` (or torchrun ... -m qerl_pipe train), then export and eval")
    # A bad data file or reward name fails before the first stage, not hours into the chain.
    if "train" in recipe.stages:
        from qerl_pipe.stages.train import check_train_inputs

        check_train_inputs(recipe)
        from qerl_pipe.memory.preflight import check_recipe_step

        check_recipe_step(recipe)  # a step no plan fits its memory budget: refused before the first stage
    full = recipe.train.adapter == "full"
    if full:
        _check_full_run_stages(recipe)
    if "eval" in recipe.stages:
        from qerl_pipe.stages.evaluate import check_eval_inputs

        check_eval_inputs(recipe)
    if full and "train" in recipe.stages and "eval" in recipe.stages:
        # A full run has no adapter: eval evaluates its merged-bf16 export (the trained model), with
        # an engine built from it, instead of an adapter over the recipe's engine.
        from qerl_pipe.stages.evaluate import run_eval

        before_eval = recipe.model_copy(update={"stages": [s for s in recipe.stages if s != "eval"]})
        made = dag.run_pipeline(before_eval, store, force=force)
        made["eval"] = run_eval(recipe, store, model=made["export"], force=force, build_missing=True)
        return made
    return dag.run_pipeline(recipe, store, force=force)


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
