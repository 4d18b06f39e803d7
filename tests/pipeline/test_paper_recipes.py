"""recipes/paper/: every recipe loads, carries the paper's settings, and its header's plan is the
step planner's (so a planner change that moves a recipe's plan shows here, not on a user's GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from qerl_pipe.model.shapes import SHAPES, shape_for_source
from qerl_pipe.jobs.step_plan import train_step_shape
from qerl_pipe.memory.plan import GB, plan_step
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.recipe import load_recipe

PAPER = Path(__file__).parents[2] / "recipes" / "paper"
RECIPES = sorted(PAPER.glob("*.yaml"))
PLAN = re.compile(r"config\.json\): (\d+) KV slots \((\d+) waves of the (\d+) sequences\), micro-batch (\d+), "
                  r"LM-head chunk (\d+),\n# estimated peak ([\d.]+) GB")


def test_every_table_model_and_arm_has_a_recipe():
    names = {p.stem for p in RECIPES}
    for model in ("qwen2.5-3b", "qwen2.5-7b"):
        assert {f"gsm8k-{model}-{arm}" for arm in ("qerl", "nvfp4-lora", "bf16-lora", "qlora")} <= names
    for model in ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"):
        assert {f"bigmath-{model}-{arm}" for arm in ("qerl", "nvfp4-lora", "qlora")} <= names
    assert "gsm8k-qwen2.5-3b-full" in names and "gsm8k-qwen2.5-7b-full" not in names  # 7B full does not fit 80 GB
    assert "bigmath-qwen2.5-32b-bf16-lora" not in names  # neither does 32B bf16 LoRA
    assert "bigmath-qwen2.5-32b-qerl-fp8kv" in names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_settings_and_planned_memory(path: Path):
    recipe = load_recipe(path)
    train, engine = recipe.train, recipe.engine
    gsm8k = path.stem.startswith("gsm8k")
    assert (train.prompts_per_step, train.group_size, train.mu) == (128, 8 if gsm8k else 16, 4 if gsm8k else 1)
    assert train.max_new_tokens == (4096 if gsm8k else 8192) and train.temperature == 1.0 and train.kl_coef == 0
    assert train.loss == ("grpo" if gsm8k else "dapo") and train.eps_high == (0.2 if gsm8k else 0.28)
    assert train.memory_budget_gb == 80 and (recipe.eval.temperature, recipe.eval.top_p) == (0.6, 0.95)
    assert train.optimizer == "adamw8bit"
    assert (train.aqn.schedule == "exponential") == ("-qerl" in path.stem)
    assert train.lr == (5e-6 if "bf16" in path.stem or "-full" in path.stem else 1e-5)
    assert (engine.kv_cache == "fp8") == path.stem.endswith("-fp8kv")
    shape = train_step_shape(train, engine.max_seq_len, engine.max_batch, kv_cache=engine.kv_cache)
    config = DecoderConfig.from_hf(SHAPES[shape_for_source(recipe.model.source)])
    plan = plan_step(config, engine.base_format, shape, int(80 * GB), dtype=torch.bfloat16)
    said = PLAN.search(path.read_text())
    assert said, f"{path.name}: no plan in its header"
    slots, waves, sequences, micro, chunk, peak = said.groups()
    assert (int(slots), int(waves), int(sequences), int(micro), int(chunk)) == (
        plan.kv_slots, plan.waves, plan.shape.sequences, plan.micro_batch, plan.logprob_chunk)
    assert float(peak) == round(plan.estimate_bytes / GB, 1) <= 80


def test_adamw8bit_is_a_recipe_key_refused_where_it_cannot_run(monkeypatch):
    from qerl_pipe.errors import QerlError
    from qerl_pipe.jobs.train_config import train_config
    from qerl_pipe.jobs.train_job import check_optimizer
    from qerl_pipe.recipe import TrainSection
    from qerl_pipe.stages.train import train_key

    assert train_config(TrainSection(optimizer="adamw8bit")).optimizer == "adamw8bit"
    assert "optimizer" not in train_key(TrainSection())  # the default: runs made before keep their ids
    assert train_key(TrainSection(optimizer="adamw8bit"))["optimizer"] == "adamw8bit"
    check_optimizer("adamw", "cpu")
    with pytest.raises(QerlError, match="steps CUDA tensors only, and this train runs on the CPU: set train.optimizer=adamw"):
        check_optimizer("adamw8bit", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import builtins

    real = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(QerlError, match=r"needs bitsandbytes: pip install -e '.\[qlora\]'"):
        check_optimizer("adamw8bit", "auto")


def test_make_optimizer_builds_bitsandbytes_adamw8bit():
    bnb = pytest.importorskip("bitsandbytes")
    from dataclasses import replace

    from qerl_pipe.jobs.train_config import train_config
    from qerl_pipe.recipe import TrainSection
    from qerl_pipe.rl.loop.trainer import make_optimizer

    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    cfg = train_config(TrainSection())
    assert isinstance(make_optimizer(params, cfg), torch.optim.AdamW)
    assert isinstance(make_optimizer(params, replace(cfg, optimizer="adamw8bit")), bnb.optim.AdamW8bit)
