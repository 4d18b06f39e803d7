"""`qerl-pipe run`: the recipe's stages in DAG order (`dag.run_pipeline`), each reusing its artifact
when up to date. The one command that builds upstream artifacts without being asked to; it is not
a stage, so it checks the recipe as a whole (the stage settings a full fine-tuning run cannot
have) before the first stage starts. It imports no stage: the DAG names them."""

from __future__ import annotations

from qerl_pipe import dag
from qerl_pipe.artifacts import Artifact, ArtifactStore
from qerl_pipe.errors import QerlError
from qerl_pipe.recipe import Recipe
from qerl_pipe.rl.loop.distributed import launched_by_torchrun


def run_pipeline(recipe: Recipe, store: ArtifactStore, *, force: bool = False) -> dict[str, Artifact]:
    """Run `recipe.stages`; `force` redoes every stage. Returns each stage's artifact."""
    if launched_by_torchrun():  # every rank would run every stage against one store
        raise QerlError("`run` is one process; for several GPUs run the stages before train once, then "
                        "`qerl-pipe train --nproc N` (or torchrun ... -m qerl_pipe train), then export and eval")
    if recipe.train.adapter == "full":
        _check_full_run_stages(recipe)
    # Each stage's declared check (data files, reward names, train's step against its memory
    # budget) runs before the first stage, and a full run's eval of its export is declared in the
    # DAG (`dag.full_run_eval`).
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
