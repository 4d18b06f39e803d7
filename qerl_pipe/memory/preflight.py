"""`qerl-pipe run`'s memory check before its first stage: the recipe's train step against its budget,
from the model's config.json alone, so a step that cannot fit is refused before a quantize or a
download of the weights. (Unlike `memory.plan`, this reads recipes and model sources: pydantic.)"""

from __future__ import annotations

from qerl_pipe.artifacts import ArtifactStore
from qerl_pipe.hf import compute_dtype, count_parameters, pick_device
from qerl_pipe.memory.plan import MemoryPlan, plan_engine_step
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.recipe import Recipe
from qerl_pipe.sources import peek_model_config


def check_recipe_step(recipe: Recipe, store: ArtifactStore) -> MemoryPlan | None:
    """The plan of the recipe's train step (raises MemoryBudgetError when none fits); None when
    there is no budget to check (a CPU without train.memory_budget_gb) or the model's config.json
    cannot be read without work (a hub id offline): build-engine and train check it then."""
    hf_config = peek_model_config(recipe.model, store)
    if hf_config is None:
        return None
    device = pick_device(recipe.train.device)
    dtype = compute_dtype(recipe.engine.dtype, device, count_parameters(hf_config))
    return plan_engine_step(recipe.train, recipe.engine, DecoderConfig.from_hf(hf_config), device, dtype)[0]
