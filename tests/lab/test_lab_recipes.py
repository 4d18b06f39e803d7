"""The lab runs the recipes as `qerl-pipe run` reads them: the ladder's and the paper's."""

from __future__ import annotations

from qerl_pipe.model.shapes import shape_for_source
from qerl_pipe.recipe import load_recipe
from tests.memory.test_memory_plan import EXPECTED, LADDER
from tests.pipeline.test_paper_recipes import PAPER


def test_the_ladder_recipes_are_valid_and_complete_for_the_bench():
    from qerl_lab.train_step import read_recipe

    assert [p.name for p in LADDER] == sorted(EXPECTED)
    for path in LADDER:
        recipe = load_recipe(path)  # every key valid
        step = read_recipe(path)  # and the step the bench runs is the one the recipe describes
        assert (step.shape, step.quant, step.budget_gb) == (shape_for_source(recipe.model.source),
                                                             recipe.engine.base_format, recipe.train.memory_budget_gb)
        assert step.settings.prompt_len + step.settings.response_len == recipe.engine.max_seq_len == 1280
        assert step.settings.sequences == 64 and step.settings.lora_rank == 32


def test_the_train_step_bench_runs_a_recipe_with_its_fp8_kv_cache():
    """`qerl-pipe bench train-step --recipe` reads engine.kv_cache and engine.activations, so the
    paper recipes' steps run (and are planned) with them."""
    from qerl_lab.train_step import read_recipe

    step = read_recipe(PAPER / "bigmath-qwen2.5-32b-qerl-fp8kv.yaml")
    assert (step.settings.kv_cache, step.settings.activations) == ("fp8", "bf16")
    assert step.settings.shape(step.shape).kv_cache == "fp8" and step.budget_gb == 80
