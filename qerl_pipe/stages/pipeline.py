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
    if "eval" in recipe.stages:
        from qerl_pipe.stages.evaluate import check_eval_inputs

        check_eval_inputs(recipe)
    return dag.run_pipeline(recipe, store, force=force)
