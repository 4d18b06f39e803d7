"""Recipes: defaults, --set overrides with YAML typing, and errors that name the key and the file."""

from pathlib import Path

import pytest

from qerl_pipe.errors import RecipeError
from qerl_pipe.recipe import STAGE_ORDER, load_recipe
from qerl_pipe.rl.task.tasks import load_problems


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_defaults_without_a_file():
    recipe = load_recipe(None)
    assert recipe.stages == list(STAGE_ORDER) and STAGE_ORDER[:4] == ("calibrate", "quantize", "build-engine", "train")
    assert STAGE_ORDER[-1] == "eval"  # eval reads what every other stage makes
    assert (recipe.eval.data, recipe.eval.k, recipe.eval.greedy) == ("gsm8k:test", 1, False)
    assert (recipe.eval.temperature, recipe.eval.top_p) == (0.6, 0.95)  # QeRL's evaluation
    assert recipe.export.format == "peft" and recipe.export.exclude == ["lm_head"]
    assert recipe.model.source == "smollm2-135m-instruct"
    assert recipe.quantize.exclude == ["lm_head"]
    assert recipe.engine.base_format == "nvfp4" and recipe.engine.kv_budget_gib is None
    assert (recipe.engine.max_seq_len, recipe.engine.max_batch) == (1024, 64)


def test_file_and_overrides_are_typed(tmp_path):
    path = write(tmp_path, "model:\n  source: ./m\ncalibrate:\n  num_samples: 4\n")
    recipe = load_recipe(path, ["calibrate.seq_len=32", "quantize.exclude=[lm_head, model.layers.0.mlp.down_proj]",
                                "quantize.quality.perplexity=never"])
    assert recipe.model.source == "./m"
    assert recipe.calibrate.num_samples == 4 and recipe.calibrate.seq_len == 32
    assert recipe.quantize.exclude == ["lm_head", "model.layers.0.mlp.down_proj"]
    assert recipe.quantize.quality.perplexity == "never"


def test_engine_switches_accept_yaml_on_and_off(tmp_path):
    # YAML 1.1 reads bare on/off as booleans.
    recipe = load_recipe(write(tmp_path, "engine:\n  cuda_graphs: on\n  tune_kernels: off\n"), ["engine.kv_budget_gib=1.5"])
    assert (recipe.engine.cuda_graphs, recipe.engine.tune_kernels, recipe.engine.kv_budget_gib) == ("on", "off", 1.5)


def test_shipped_quickstart_recipe_is_valid():
    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "quickstart.yaml")
    assert recipe.stages == ["calibrate", "quantize", "build-engine", "train", "export", "eval"]
    assert (recipe.engine.max_seq_len, recipe.engine.max_batch) == (256, 32)
    assert recipe.train.data == "addition:train" and recipe.train.loss == "dapo"
    assert recipe.export.format == "peft"
    # Train's own evaluation and the eval stage use the held-out split (never a training question),
    # the eval stage sampled as the QeRL paper evaluates.
    assert recipe.train.eval_data == recipe.eval.data == "addition:test" and not recipe.eval.greedy
    train_questions = {p.question for p in load_problems(recipe.train.data)}
    assert train_questions.isdisjoint(p.question for p in load_problems(recipe.eval.data))


@pytest.mark.parametrize("text, overrides, needle", [
    ("calibrate:\n  num_sampels: 4\n", [], "unknown key 'calibrate.num_sampels'"),
    ("calibrate:\n  num_samples: -1\n", [], "'calibrate.num_samples'"),
    ("bogus: 1\n", [], "unknown key 'bogus'"),
    ("", ["quantize.format=int8"], "'quantize.format'"),
    ("", ["calibrate.device=tpu"], "'calibrate.device'"),
    ("stages: [quantize, calibrate]\n", [], "pipeline order"),
    ("stages: [deploy]\n", [], "unknown stage"),
    ("stages: [export, train]\n", [], "pipeline order"),
    ("", ["export.format=gguf"], "'export.format'"),
    ("stages: [build-engine, quantize]\n", [], "pipeline order"),
    ("stages: [eval, train]\n", [], "pipeline order"),
    ("", ["eval.k=0"], "'eval.k'"),
    ("", ["eval.greedy=true", "eval.k=4"], "greedy decoding gives the same response 4 times"),
    ("", ["eval.top_p=1.5"], "'eval.top_p'"),
    ("engine:\n  max_batch: 0\n", [], "'engine.max_batch'"),
    ("engine:\n  bogus: 1\n", [], "unknown key 'engine.bogus'"),
    ("", ["engine.base_format=int8"], "'engine.base_format'"),
    ("", ["engine.kv_budget_gib=-1"], "'engine.kv_budget_gib'"),
    ("", ["engine.tune_kernels=maybe"], "'engine.tune_kernels'"),
])
def test_bad_values_name_the_key_and_the_file(tmp_path, text, overrides, needle):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path, overrides)
    assert needle in str(err.value)
    assert str(path) in str(err.value)


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="expected section.key=value"):
        load_recipe(None, ["calibrate.num_samples"])
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(RecipeError, match="is a value, not a section"):
        load_recipe(write(tmp_path, "model:\n  source: a\n"), ["model.source.x=1"])


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_nan_and_infinity_are_no_recipe_value(value):
    # rewards weights have no bounds, so only this refuses them; a NaN would reach ids and manifests
    with pytest.raises(RecipeError, match=r"'train\.rewards\.accuracy': .*finite"):
        load_recipe(None, [f"train.rewards.accuracy={value}"])


def test_an_unknown_key_names_the_closest_one_and_where_the_keys_are_listed(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown key 'train\.lrr' \(did you mean 'train\.lr'\?\); "
                                          r"`qerl-pipe keys train` lists the keys"):
        load_recipe(None, ["train.lrr=1e-4"])
    recipe = write(tmp_path, "trian:\n  steps: 3\nengine:\n  max_seq: 512\n")
    with pytest.raises(RecipeError) as both:
        load_recipe(recipe)
    assert "'trian' (did you mean 'train'?)" in str(both.value)
    assert "'engine.max_seq' (did you mean 'engine.max_seq_len'?)" in str(both.value)
    with pytest.raises(RecipeError, match=r"unknown key 'train\.zzzzzz'; `qerl-pipe keys train`"):  # nothing close
        load_recipe(None, ["train.zzzzzz=1"])


def test_keys_lists_every_recipe_key_with_its_type_default_and_meaning():
    from qerl_pipe.recipe import Recipe
    from tests.stage_cli import cli

    def leaves(value, prefix=""):
        for key, item in value.items():
            yield from leaves(item, f"{prefix}{key}.") if isinstance(item, dict) else [f"{prefix}{key}"]

    out = cli("keys").stdout
    listed = [line.split(":", 1)[0] for line in out.splitlines() if not line.startswith(" ")]
    assert listed == list(leaves(Recipe().model_dump()))  # every key --set takes, in recipe order
    meanings = [line for line in out.splitlines() if line.startswith("    ")]
    assert len(meanings) == len(listed) and all(m.strip() for m in meanings)  # none without its meaning
    assert "train.lr: float (> 0); default 1e-05\n    AdamW peak learning rate." in out
    assert "train.loss: one of grpo, dapo, dr_grpo; default dapo" in out
    lora = cli("keys", "train.lora").stdout
    assert lora.startswith("train.lora.rank: int (>= 1); default 32") and "train.lr:" not in lora
    wrong = cli("keys", "trian", ok=False)
    assert wrong.exit_code == 1 and "did you mean 'train'?" in wrong.stderr


@pytest.mark.parametrize(("text", "needle"), [
    ("train:\n  lr: 1.0e-4\n  steps: 2\n  lr: 0.5\n", "`train.lr` is given twice (lines 2 and 4)"),
    ("train:\n  lr: 1.0e-4\nengine:\n  max_batch: 4\ntrain:\n  steps: 3\n", "`train` is given twice (lines 1 and 5)"),
    ("train:\n  aqn:\n    sigma_start: 0.01\n    sigma_start: 0.02\n", "`train.aqn.sigma_start` is given twice (lines 3 and 4)"),
])
def test_a_duplicate_key_at_any_depth_is_refused_with_its_path_and_lines(tmp_path, text, needle):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    assert str(recipe) in str(err.value) and needle in str(err.value)
    recipe.write_text(text.replace("  lr: 0.5\n", "").replace("train:\n  steps: 3\n", "")
                      .replace("    sigma_start: 0.02\n", ""))
    load_recipe(recipe)  # without the repeat the same file loads
