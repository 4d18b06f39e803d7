"""The step planner (qerl_pipe/memory/plan.py) on CPU: the ladder recipes' plans, monotonic
settings, the refusal naming the smallest budget, the recipe key, and train/build-engine/run
refusing a budget no plan meets before any work."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from qerl_pipe.model.shapes import QWEN25_SHAPES, SHAPES, shape_for_source
from qerl_pipe.engine.limits import EngineLimits
from qerl_pipe.errors import RecipeError
from qerl_pipe.jobs.step_plan import train_step_shape
from qerl_pipe.memory.plan import (GB, MIN_LOGPROB_CHUNK, MemoryBudgetError, StepShape, candidates, enforce_budget,
                                   plan_step)
from qerl_pipe.memory.step import estimate_step_bytes
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.recipe import load_recipe
from qerl_pipe.rl.algo.logprobs import DEFAULT_CHUNK
from tests.stage_cli import cli, named

ROOT = Path(__file__).resolve().parents[2]
LADDER = sorted((ROOT / "recipes" / "ladder").glob("*.yaml"))
# (recipe, KV slots, micro-batch, LM-head chunk) the planner chooses; None: refused.
EXPECTED = {
    "qwen2.5-7b-nvfp4-16gb.yaml": (64, 2, 128),
    "qwen2.5-14b-nvfp4-24gb.yaml": (32, 1, 128),
    "qwen2.5-32b-nvfp4-40gb.yaml": (32, 1, 128),
    "qwen2.5-72b-nvfp4-80gb.yaml": (54, 1, 128),
    "qwen2.5-72b-bf16-80gb.yaml": None,
    "qwen3-30b-a3b-nvfp4-40gb.yaml": (64, 8, 1024),
    # An FP8 KV cache (engine.kv_cache: fp8) where it changes the plan (issue 50).
    "qwen2.5-7b-nvfp4-16gb-fp8kv.yaml": (64, 4, 128),
    "qwen2.5-32b-nvfp4-40gb-fp8kv.yaml": (62, 1, 128),
    "qwen2.5-72b-nvfp4-80gb-fp8kv.yaml": (64, 4, 512),
}


def _recipe_plan(path: Path, budget_gb: float | None = None):
    recipe = load_recipe(path)
    config = DecoderConfig.from_hf(SHAPES[shape_for_source(recipe.model.source)])
    shape = train_step_shape(recipe.train, recipe.engine.max_seq_len, recipe.engine.max_batch,
                             kv_cache=recipe.engine.kv_cache)
    gb = recipe.train.memory_budget_gb if budget_gb is None else budget_gb
    return plan_step(config, recipe.engine.base_format, shape, int(gb * GB))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_rung_plans_under_its_budget_or_is_refused(name):
    path = ROOT / "recipes" / "ladder" / name
    budget = int(load_recipe(path).train.memory_budget_gb * GB)
    if EXPECTED[name] is None:
        with pytest.raises(MemoryBudgetError) as exc:
            _recipe_plan(path)
        # The bf16 weights of 72B alone are ~145 GB: far above an 80 GB card.
        assert exc.value.needed_bytes > 150 * GB and exc.value.budget_bytes == budget
        return
    plan = _recipe_plan(path)
    assert (plan.kv_slots, plan.micro_batch, plan.logprob_chunk) == EXPECTED[name]
    assert plan.estimate_bytes <= budget and plan.waves == math.ceil(64 / plan.kv_slots)
    assert plan.estimate == estimate_step_bytes(plan_config(path), "nvfp4", plan.size)
    # The largest that fits: the candidate before the chosen one does not.
    chain = candidates(plan.shape)
    index = chain.index((plan.kv_slots, plan.micro_batch, plan.logprob_chunk))
    if index:
        bigger = plan.shape.size(*chain[index - 1])
        assert estimate_step_bytes(plan_config(path), "nvfp4", bigger)["total"] > budget
    json = plan.to_json()
    assert json["budget_gb"] == load_recipe(path).train.memory_budget_gb and json["estimate_gb"] <= json["budget_gb"]
    assert "KV slots" in plan.describe() and "budget" in plan.describe()


def test_the_qwen3_moe_rung_fits_40_gb_with_its_experts_resident_and_attention_lora():
    """Qwen3-30B-A3B at 40 GB: all 128 experts of its 48 layers resident in NVFP4 (18.1 GB), LoRA r32
    on attention only, and the recipe's settings whole (64 slots, micro-batch 8) with room left; the
    same rung with adapters on every expert does not fit."""
    path = ROOT / "recipes" / "ladder" / "qwen3-30b-a3b-nvfp4-40gb.yaml"
    plan = _recipe_plan(path)
    parts = {k: v / GB for k, v in plan.estimate.items()}
    assert 18.0 < parts["weights"] < 18.2 and parts["lora_and_optimizer"] < 0.6
    assert 30 < parts["total"] < 38
    recipe = load_recipe(path)
    assert not recipe.train.lora.experts
    experts = train_step_shape(recipe.train.model_copy(update={"lora": recipe.train.lora.model_copy(
        update={"experts": True})}), recipe.engine.max_seq_len, recipe.engine.max_batch)
    with pytest.raises(MemoryBudgetError) as exc:
        plan_step(plan_config(path), "nvfp4", experts, 40 * GB)
    assert exc.value.needed_bytes > 45 * GB


def plan_config(path: Path) -> DecoderConfig:
    return DecoderConfig.from_hf(SHAPES[shape_for_source(load_recipe(path).model.source)])


def test_no_budget_keeps_the_recipe_settings():
    shape = StepShape(64, 8, 1280, 256, 32, max_kv_slots=48, max_micro_batch=4, max_logprob_chunk=DEFAULT_CHUNK)
    plan = plan_step(plan_config(LADDER[0]), "nvfp4", shape, None)
    assert (plan.kv_slots, plan.micro_batch, plan.logprob_chunk, plan.budget_bytes) == (48, 4, 1024, None)
    # Never more slots or a larger micro-batch than sequences.
    small = plan_step(plan_config(LADDER[0]), "nvfp4", StepShape(6, 3, 64, 32, 8, 64, 8, DEFAULT_CHUNK), None)
    assert (small.kv_slots, small.micro_batch) == (6, 6)


def test_candidates_only_shrink_chunk_then_micro_batch_then_slots():
    chain = candidates(StepShape(64, 8, 1280, 256, 32, 64, 8, DEFAULT_CHUNK))
    assert chain[0] == (64, 8, 1024) and chain[-1] == (1, 1, MIN_LOGPROB_CHUNK)
    for before, after in zip(chain, chain[1:]):
        assert all(a <= b for a, b in zip(after, before)) and after != before
    assert chain[:7] == [(64, 8, 1024), (64, 8, 512), (64, 8, 256), (64, 8, 128), (64, 4, 128), (64, 2, 128),
                         (64, 1, 128)]
    assert [c[0] for c in chain[6:]] == list(range(64, 0, -1))


@pytest.mark.parametrize("shape, quant", [("qwen2.5-7b", "nvfp4"), ("qwen2.5-32b", "nvfp4"), ("qwen2.5-72b", "nvfp4"),
                                          ("qwen2.5-14b", "nf4"), ("qwen2.5-7b", "bf16")])
def test_a_smaller_budget_never_gives_larger_settings(shape, quant):
    config = DecoderConfig.from_hf(QWEN25_SHAPES[shape])
    step = StepShape(64, 8, 1280, 256, 32, 64, 8, DEFAULT_CHUNK)
    smallest = estimate_step_bytes(config, quant, step.size(1, 1, MIN_LOGPROB_CHUNK))["total"]
    largest = estimate_step_bytes(config, quant, step.size(64, 8, 1024))["total"]
    previous = None
    top = int(largest * 1.05)
    for budget in (smallest + (top - smallest) * i // 399 for i in range(400)):
        plan = plan_step(config, quant, step, budget)
        assert plan.estimate_bytes <= budget
        settings = (plan.kv_slots, plan.micro_batch, plan.logprob_chunk)
        if previous is not None:  # budgets rise: every setting stays or grows, and so does the estimate
            assert all(a >= b for a, b in zip(settings, previous[0])) and plan.estimate_bytes >= previous[1]
        previous = settings, plan.estimate_bytes
    assert previous[0] == (64, 8, 1024)
    with pytest.raises(MemoryBudgetError):
        plan_step(config, quant, step, smallest - 1)


def test_the_refusal_names_the_smallest_budget_that_fits():
    config = DecoderConfig.from_hf(QWEN25_SHAPES["qwen2.5-72b"])
    step = StepShape(64, 8, 1280, 256, 32, 64, 4, DEFAULT_CHUNK)
    with pytest.raises(MemoryBudgetError) as exc:
        plan_step(config, "bf16", step, 80 * GB)
    message = str(exc.value)
    needed = math.ceil(exc.value.needed_bytes / 1e8) / 10
    assert f"The smallest budget that fits is {needed:g} GB" in message
    assert f"set train.memory_budget_gb={needed:g}" in message and "engine.base_format=nvfp4" in message
    assert "train.memory_budget_gb=80 GB" in message and "weights 145.4" in message
    # That budget does fit (the smallest plan), and 0.1 GB less does not.
    plan = plan_step(config, "bf16", step, int(needed * GB))
    assert (plan.kv_slots, plan.micro_batch, plan.logprob_chunk) == (1, 1, MIN_LOGPROB_CHUNK)
    with pytest.raises(MemoryBudgetError):
        plan_step(config, "bf16", step, int((needed - 0.1) * GB))


def test_full_fine_tuning_and_float32_are_planned_too():
    config = DecoderConfig.from_hf(QWEN25_SHAPES["qwen2.5-7b"])
    full = StepShape(64, 8, 1280, 256, 32, 64, 4, DEFAULT_CHUNK, adapter="full")
    with pytest.raises(MemoryBudgetError, match="masters \\+ AdamW"):
        plan_step(config, "bf16", full, 80 * GB)  # 7.6B weights x 16 bytes of training state
    lora = StepShape(64, 8, 1280, 256, 32, 64, 4, DEFAULT_CHUNK)
    bf16 = plan_step(config, "bf16", lora, None).estimate
    fp32 = plan_step(config, "bf16", lora, None, dtype=torch.float32).estimate
    assert fp32["kv_cache"] == 2 * bf16["kv_cache"] and fp32["weights"] > 1.9 * bf16["weights"]


def test_with_batch_shrinks_the_kv_cache():
    # train's plan may give the engine fewer slots than it was built with
    limits = EngineLimits(64, 1280, 64 * 1000, (1, 2, 4, 8, 16, 32, 64))
    assert limits.with_batch(64) is limits and limits.with_batch(100) is limits
    fewer = limits.with_batch(20)
    assert (fewer.max_batch, fewer.max_seq_len, fewer.kv_cache_bytes, fewer.graph_batch_sizes) == (
        20, 1280, 20 * 1000, (1, 2, 4, 8, 16, 20))
    assert EngineLimits(8, 16, 800).with_batch(3).graph_batch_sizes == ()  # CPU: no graphs


def test_train_step_shape_splits_prompts_over_ranks():
    recipe = load_recipe(LADDER[0])
    shape = train_step_shape(recipe.train, 1280, 64, processes=2)
    assert (shape.sequences, shape.prompts, shape.seq_len, shape.prompt_len) == (32, 4, 1280, 256)
    assert (shape.max_kv_slots, shape.max_micro_batch, shape.lora_rank) == (64, recipe.train.micro_batch_size, 32)


def test_enforce_caps_the_cuda_allocator(monkeypatch):
    assert enforce_budget(16 * GB, torch.device("cpu")) is None  # nothing to cap on a CPU
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 160 * GB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    assert enforce_budget(40 * GB, torch.device("cuda", 0)) == 0.25 and calls == [(0.25, torch.device("cuda", 0))]
    assert enforce_budget(200 * GB, torch.device("cuda", 0)) == 1.0  # a budget above the card: the card


def test_recipe_key(tmp_path):
    from qerl_pipe.stages.train import train_key

    recipe = load_recipe(None)
    assert recipe.train.memory_budget_gb is None
    assert load_recipe(None, ["train.memory_budget_gb=24"]).train.memory_budget_gb == 24.0
    for bad in ("0", "-1", "lots"):
        with pytest.raises(RecipeError, match="'train.memory_budget_gb'"):
            load_recipe(None, [f"train.memory_budget_gb={bad}"])
    # No budget (the free memory) keeps the ids runs had; a budget sets the micro-batch and the waves,
    # so it is part of the id.
    assert "memory_budget_gb" not in train_key(recipe.train)
    assert train_key(load_recipe(None, ["train.memory_budget_gb=24"]).train)["memory_budget_gb"] == 24.0


ENGINE = ["--set", "quantize.quality.perplexity=never", "--set", "engine.max_seq_len=64",
          "--set", "engine.max_batch=8", "--set", "engine.device=cpu", "--set", "train.device=cpu",
          "--set", "train.max_new_tokens=16", "--set", "train.prompts_per_step=2", "--set", "train.group_size=4"]


def _refused(result, store: Path, keep: set[str] = frozenset()) -> None:
    assert result.exit_code == 1, result.stdout
    err = result.stderr.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    assert "does not fit train.memory_budget_gb=0.001 GB" in err and "The smallest budget that fits is" in err
    assert {p for p in named(store, "") if p != ".locks"} == keep  # nothing new in the store
    assert named(store / ".runs", "") == []  # no run directory either


def test_train_build_engine_and_run_refuse_before_any_work(tiny_llama, store_dir, tmp_path):
    # No budget on a CPU: the engine is built as before (its plan is of no budget).
    engine = cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *ENGINE)
    made = {p for p in named(store_dir, "") if p != ".locks"}
    budget = ["--set", "train.memory_budget_gb=0.001"]
    result = cli("train", "--model", tiny_llama, "--artifacts", store_dir, *ENGINE, *budget,
                 "--engine", engine.stdout.strip().splitlines()[-1], ok=False)
    _refused(result, store_dir, made)
    # build-engine sizes the KV cache from the same plan, so it refuses too, before loading anything.
    result = cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *ENGINE, *budget,
                 ok=False)
    _refused(result, store_dir, made)
    # `run` refuses before its first stage: no calibration, no quantize.
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [calibrate, quantize, build-engine, train]\nmodel:\n  source: {tiny_llama}\n")
    fresh = tmp_path / "fresh"
    _refused(cli("run", recipe, "--artifacts", fresh, *ENGINE, *budget, ok=False), fresh)


def test_a_budget_that_fits_is_planned_and_stored(tiny_llama, store_dir):
    from tests.conftest import read_json

    # The tiny model's step: a few MB beside the 1 GiB of slack. Its plan lands in engine.json, the
    # run's manifest and run.json.
    args = [*ENGINE, "--set", "train.memory_budget_gb=2", "--set", "train.steps=1", "--set", "train.eval_limit=0",
            "--set", "train.micro_batch_size=4"]
    engine = Path(cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing",
                      *args).stdout.strip().splitlines()[-1])
    spec = read_json(engine / "engine.json")
    assert spec["memory_plan"]["budget_gb"] == 2.0 and spec["limits"]["max_batch"] == spec["memory_plan"]["kv_slots"] == 8
    assert read_json(engine / "manifest.json")["config"]["memory_budget_gb"] == 2.0
    # train's step sized the KV cache engine.json records: another step is another engine
    smaller = cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, *args, "--set", "train.group_size=2")
    assert Path(smaller.stdout.strip().splitlines()[-1]) != engine and "build-engine: up to date" not in smaller.stderr
    result = cli("train", "--model", tiny_llama, "--artifacts", store_dir, "--engine", engine, *args)
    run = Path(result.stdout.strip().splitlines()[-1])
    plan = read_json(run / "manifest.json")["summary"]["memory_plan"]
    assert (plan["kv_slots"], plan["micro_batch"], plan["waves"], plan["budget_gb"]) == (8, 4, 1, 2.0)
    assert plan["estimate_bytes"]["total"] <= 2e9 and plan["dtype"] == "float32"
    assert read_json(run / "run.json")["memory_plan"] == plan
    assert "train: memory plan: 8 sequences of 64 tokens in 1 wave(s) of 8 KV slots, micro-batch 4" in result.stderr
    # The plan fits as the recipe asks: the log and the report say it changed nothing.
    assert "train: memory plan: the recipe's settings, unchanged" in result.stderr
    assert read_json(run / "report.json")["memory_plan_changes"] == "the recipe's settings, unchanged"
    assert "Memory plan: 8 sequences of 64 tokens" in (run / "report.md").read_text()


def test_build_engine_under_torchrun_plans_one_rank_share_of_the_step(tiny_llama, store_dir, monkeypatch):
    """`train --nproc 2 --build-missing`: rank 0 builds the engine for each rank's half of the step
    (4 of the 8 sequences), as train then plans it, not for the whole step on one GPU."""
    import json

    from qerl_pipe.artifacts import ArtifactStore
    from qerl_pipe.dag import BUILD_ENGINE
    from qerl_pipe.pipeline import run_stage
    from qerl_pipe.rl.loop.distributed import Dist
    from qerl_pipe.stages import build_engine
    from tests.conftest import read_json

    monkeypatch.setattr(build_engine, "current_dist", lambda: Dist(0, 2))
    overrides = [a for a in ENGINE if a != "--set"] + [
        f"model.source={json.dumps(str(tiny_llama))}", "engine.base_format=bf16", "train.memory_budget_gb=2"]
    engine = run_stage(BUILD_ENGINE, load_recipe(None, overrides), ArtifactStore(store_dir))
    spec = read_json(engine.path / "engine.json")
    assert spec["memory_plan"]["step"]["sequences"] == 4 and spec["limits"]["max_batch"] == 4


def test_a_budget_above_the_gpu_is_refused_and_free_memory_counts_the_cache(monkeypatch) -> None:
    """CUDA branch of step_budget, with the device queries faked: a budget past the card is an
    error naming the card's size; without one, memory this process caches but does not use counts
    as free (an earlier stage of `run` in the same process left it there)."""
    from types import SimpleNamespace

    from qerl_pipe.errors import QerlError
    from qerl_pipe.memory import plan as plan_mod

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=24 * 10**9))
    with pytest.raises(QerlError, match=r"memory_budget_gb=40 GB is more than this GPU has \(24.0 GB\)"):
        plan_mod.step_budget(40.0, gpu)
    assert plan_mod.step_budget(16.0, gpu) == (16 * 10**9, plan_mod.BUDGET_KEY, True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (5 * 10**9, 24 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 9 * 10**9)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 2 * 10**9)
    assert plan_mod.step_budget(None, gpu) == (12 * 10**9, "free GPU memory", False)


def test_the_trainer_runs_the_plans_settings_and_the_run_says_what_the_plan_changed():
    import dataclasses

    from qerl_pipe.jobs.train_config import plan_changes, train_config

    path = ROOT / "recipes" / "ladder" / "qwen2.5-7b-nvfp4-16gb.yaml"  # micro-batch 8 -> 2, chunk 1024 -> 128
    recipe, plan = load_recipe(path), _recipe_plan(path)
    cfg = train_config(recipe.train, plan)
    assert (cfg.micro_batch, cfg.logprob_chunk) == (plan.micro_batch, plan.logprob_chunk) == (2, 128)
    assert train_config(recipe.train).micro_batch == recipe.train.micro_batch_size == 8  # no plan: the recipe's
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.micro_batch = 8  # type: ignore[misc]
    assert [(c.setting, c.asked, c.planned) for c in plan.changes()] == [("micro_batch", 8, 2),
                                                                         ("logprob_chunk", 1024, 128)]
    assert plan_changes(plan) == ("train.micro_batch_size 8 -> 2, LM-head chunk 1024 -> 128, to fit "
                                  "train.memory_budget_gb = 16.0 GB (estimated peak 15.2 GB)")
    assert plan_changes(_recipe_plan(path, budget_gb=200)) == "the recipe's settings, unchanged"


def test_a_cpu_plan_counts_the_base_it_dequantizes_once():
    """On a CPU the 4-bit linears are also held dequantized (model.dense_copy): SmolLM2-135M's
    405 MiB in float32, which the plan line left out (it said 3.2 GB; the run's peak: 3.4-3.6)."""
    from qerl_pipe.memory.step import dense_base_bytes

    smollm2 = DecoderConfig.from_hf({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                                     "max_position_embeddings": 8192, "tie_word_embeddings": True})
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    cpu, gpu = (train_step_shape(recipe.train, 256, 32, dense_base=dense) for dense in (True, False))
    on_cpu = plan_step(smollm2, "nvfp4", cpu, None, dtype=torch.float32)
    assert on_cpu.estimate["dense_base"] == dense_base_bytes(smollm2, torch.float32) == 424_673_280  # 405 MiB
    assert "base dequantized for the CPU 0.4" in on_cpu.describe() and "estimated peak 3.6 GB" in on_cpu.describe()
    assert "dense_base" not in plan_step(smollm2, "nvfp4", gpu, None).estimate  # a GPU decodes per layer
    assert "dense_base" not in plan_step(smollm2, "bf16", cpu, None, dtype=torch.float32).estimate  # nothing to dequantize


def test_a_standalone_train_hands_freed_memory_back_before_it_loads_the_engine(tiny_llama, store_dir, monkeypatch):
    """As quantize does (memwatch.return_freed_tensors_to_os): without it a standalone CPU train
    peaked at 5.2 GB where `run`, which had it from its quantize, peaked at 3.6."""
    import qerl_pipe.jobs.train_job as train_job

    order: list[str] = []
    load = train_job.load_engine
    monkeypatch.setattr(train_job, "return_freed_tensors_to_os", lambda: order.append("freed"))
    monkeypatch.setattr(train_job, "load_engine", lambda *a, **k: (order.append("engine"), load(*a, **k))[1])
    cli("train", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *ENGINE,
        "--set", "train.steps=1", "--set", "train.eval_limit=0")
    assert order == ["freed", "engine"]
