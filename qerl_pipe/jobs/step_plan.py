"""A recipe's RL step planned to its memory budget: the recipe's `train` and `engine` sections turned
into the plain numbers of the step planner (`memory.plan`), for train, build-engine's KV budget and
`run`'s check before its first stage (from config.json alone, before any quantize or download).
See docs/training.md, section "Memory budget: the step planner"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.jobs.engine_artifact import read_engine_json
from qerl_pipe.engine.limits import EngineLimits
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.hf import compute_dtype, count_parameters, pick_device
from qerl_pipe.kernels import humming_backend
from qerl_pipe.kernels.base_formats import base_format as format_entry
from qerl_pipe.kernels.dispatch import DispatchTable, humming_copy_shapes, table_for
from qerl_pipe.memory.plan import MemoryPlan, StepShape, plan_step, step_budget
from qerl_pipe.memory.step import expert_copy_bytes, fp8_copy_bytes, kernel_copy_bytes
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.recipe import EngineSection, Recipe, TrainSection
from qerl_pipe.rl.algo.logprobs import DEFAULT_CHUNK

# Without engine.kv_budget_gib the KV cache is what the step planner gives train's step under
# train.memory_budget_gb (on CUDA, by default, the memory free at start); on a CPU without a
# budget, this.
CPU_KV_BUDGET_BYTES = 2 * 2**30


@dataclass(frozen=True)
class EngineBudget:
    """What build-engine sizes the KV cache by: its bytes, the plan of train's step that gave them
    (None: engine.kv_budget_gib, or a CPU without a budget), and the budget the build is capped at
    (None: not capped; only train.memory_budget_gb on CUDA caps)."""

    kv_bytes: int
    plan: MemoryPlan | None
    cap_bytes: int | None


def train_step_shape(train: TrainSection, max_seq_len: int, max_batch: int, processes: int = 1,
                     dense_base: bool = False, kv_cache: str = "bf16") -> StepShape:
    """The step `train` asks of each of `processes` ranks over an engine of `max_batch` slots of
    `max_seq_len` tokens (bounds: the recipe's micro-batch, the default LM-head chunk); `dense_base`:
    a CPU run, where a 4-bit base is also held dequantized (`model.dense_copy`)."""
    prompts = max(1, train.prompts_per_step // processes)
    return StepShape(sequences=prompts * train.group_size, prompts=prompts, seq_len=max_seq_len,
                     prompt_len=max(0, max_seq_len - train.max_new_tokens), lora_rank=train.lora.rank,
                     max_kv_slots=max_batch, max_micro_batch=train.micro_batch_size,
                     max_logprob_chunk=DEFAULT_CHUNK, adapter=train.adapter, dense_base=dense_base,
                     lora_experts=train.lora.experts, kv_cache=kv_cache)


def _plan(train: TrainSection, config: DecoderConfig, base_format: str, dtype: torch.dtype, max_seq_len: int,
          max_batch: int, processes: int, budget: int | None, budget_source: str, what: str, device: torch.device,
          kernel_copies: int = 0, kv_cache: str = "bf16") -> MemoryPlan:
    """What train and build-engine share: the plan of `train`'s step on `device` to `budget`
    (`step_budget`), with `kernel_copies` bytes of kernel copies asked for (`copy_bytes_asked`)."""
    shape = train_step_shape(train, max_seq_len, max_batch, processes, dense_base=device.type == "cpu",
                             kv_cache=kv_cache)
    return plan_step(config, base_format, shape, budget, dtype=dtype, budget_source=budget_source,
                     what=f"train's step {what}", kernel_copies=kernel_copies)


def copy_bytes_asked(config: DecoderConfig, base_format: str, device: torch.device, table: DispatchTable | None,
                     deterministic: bool, lora_experts: bool, activations: str = "bf16") -> int:
    """The bytes of the kernel copies an engine on `device` makes: the FP8 copies of the dense linears
    (FP8 activations), else humming's copies of an NVFP4 base's linears `table` sends to humming; plus
    humming's copies of an NVFP4 MoE's experts for their grouped GEMMs (unless the experts carry LoRA)."""
    nvfp4 = format_entry(base_format).hopper_dispatch
    grouped = (nvfp4 and bool(config.num_sparse_layers) and not lora_experts and device.type == "cuda"
               and humming_backend.available(device))
    experts = expert_copy_bytes(config) if grouped else 0
    if activations == "fp8":
        return fp8_copy_bytes(config) + experts
    if not nvfp4:
        return 0
    return kernel_copy_bytes(config, humming_copy_shapes(device, table, deterministic)) + experts


def plan_train(train: TrainSection, engine_dir: Path, device: torch.device,
               processes: int = 1) -> tuple[MemoryPlan, bool]:
    """The plan of `train`'s step over the engine artifact in `engine_dir` (its config.json, base
    format, dtype and limits), to `train.memory_budget_gb` (see `step_budget`), and whether the
    budget is to be enforced. Raises MemoryBudgetError before anything is loaded."""
    spec = read_engine_json(engine_dir)
    config = DecoderConfig.from_hf(read_model_config(engine_dir))
    limits = EngineLimits.from_json(spec["limits"])
    budget, source, enforced = step_budget(train.memory_budget_gb, device)
    measured = spec.get("dispatch_table")  # the engine's own table, else the one shipped for this GPU
    copies = copy_bytes_asked(config, spec["base_format"], device,
                              DispatchTable.from_json(measured) if measured else None, spec.get("deterministic", True),
                              train.lora.experts, spec.get("activations", "bf16"))
    plan = _plan(train, config, spec["base_format"], getattr(torch, spec["dtype"]), limits.max_seq_len,
                 limits.max_batch, processes, budget, source, f"over the engine {engine_dir.name}", device, copies,
                 limits.kv_cache)
    return plan, enforced


def plan_engine_step(train: TrainSection, engine: EngineSection, config: DecoderConfig, device: torch.device,
                     dtype: torch.dtype, processes: int = 1) -> tuple[MemoryPlan | None, bool]:
    """The plan of `train`'s step on each of `processes` ranks over the engine the `engine` section
    builds, and whether to enforce it; (None, False) when there is no budget (a CPU and no
    `train.memory_budget_gb`). Raises MemoryBudgetError before anything is loaded."""
    budget, source, enforced = step_budget(train.memory_budget_gb, device)
    if budget is None:
        return None, False
    # The engine's table is measured later in its build: the one shipped for this GPU stands in.
    copies = copy_bytes_asked(config, engine.base_format, device, table_for(device), engine.deterministic,
                              train.lora.experts, engine.activations)
    plan = _plan(train, config, engine.base_format, dtype, engine.max_seq_len, engine.max_batch, processes, budget,
                 source, f"({engine.base_format} base)", device, copies, engine.kv_cache)
    return plan, enforced


def engine_budget(recipe: Recipe, hf_config: dict[str, Any], device: torch.device, processes: int = 1) -> EngineBudget:
    """The KV budget of the engine the recipe builds from a model with `hf_config`: engine.kv_budget_gib,
    else the KV cache train's step gets under its plan (each of `processes` ranks runs its share of
    the step over its own copy of the engine), else on a CPU without a budget 2 GiB."""
    section = recipe.engine
    if section.kv_budget_gib is not None:
        return EngineBudget(int(section.kv_budget_gib * 2**30), None, None)
    dtype = compute_dtype(section.dtype, device, count_parameters(hf_config))
    plan, enforce = plan_engine_step(recipe.train, section, DecoderConfig.from_hf(hf_config), device, dtype, processes)
    if plan is None:
        return EngineBudget(CPU_KV_BUDGET_BYTES, None, None)
    return EngineBudget(plan.estimate["kv_cache"], plan, plan.budget_bytes if enforce else None)


def plan_recipe_step(recipe: Recipe, hf_config: dict[str, Any]) -> MemoryPlan | None:
    """The plan of the recipe's train step over the engine it builds from a model with `hf_config`
    (raises MemoryBudgetError when none fits); None when there is no budget to check (a CPU
    without train.memory_budget_gb)."""
    device = pick_device(recipe.train.device)
    dtype = compute_dtype(recipe.engine.dtype, device, count_parameters(hf_config))
    return plan_engine_step(recipe.train, recipe.engine, DecoderConfig.from_hf(hf_config), device, dtype)[0]
