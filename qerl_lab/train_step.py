"""One full RL step (rollouts + training) at Qwen2.5 and Qwen3-30B-A3B shapes (`qerl_pipe.model.shapes`), with a
bf16, NF4 or NVFP4 base under LoRA.

`qerl-pipe bench train-step --shape qwen2.5-7b --quant bf16,nvfp4 --out FILE.json`. Every (shape,
quant) pair runs in this process, one after another, with the GPU memory freed in between.

Each configuration: random weights of the exact shape built directly in the base format, LoRA on
all seven projections (in Qwen3-30B-A3B attention's four: its routed experts get none, as in a
recipe without train.lora.experts), the rollout engine over that same model (KV cache for every
sequence of the step at once), and the real `Trainer` with a synthetic reward, so the step is what `train` runs:
8 prompts x G = 8 samples, 256-token prompts, 1024 sampled tokens at temperature 1 with no stop
token (every response runs to the end), DAPO loss, logprobs through the LM head in chunks,
backward with gradient checkpointing, AdamW on the adapter. One small warm-up step and the capture
of every decode CUDA graph come first, so compilation and capture stay out of the timed steps.
`--timed-steps` steps (default 3) are timed one after another; a row's rollout, training and step
times are the median over those after the first, as a run of many steps sees them. The first
step's are reported beside them (`first_step`): on the 7B NVFP4 model its training phase paid a
one-time 1.8-2.3 s more in its first micro-batch (H100, bench/results/profiles/
step-by-step-fused-7b-h100.json) that no later step pays.

Before building, the step planner (`memory.plan`) chooses the KV slots, micro-batch and LM-head
chunk: the given ones (`--kv-slots`, `--micro-batch`), or under a memory budget
(`--memory-budget-gb`, or a recipe's `train.memory_budget_gb`) the largest that fit it, with the
process capped to the budget (`torch.cuda.set_per_process_memory_fraction`), so the step proves the
budget on a larger GPU; a budget no plan meets is a `refused` row naming the budget it needs. A
configuration whose estimate exceeds the free memory is reported with `fits: false` and what it
asked for. A CUDA out-of-memory error, or any other failure, is recorded in its row and the next
configuration runs. Each row is printed as one JSON line and the output file is rewritten after
it, so a run cut short still leaves data.

`--recipe FILE` (repeatable) runs a recipe's step instead of a shape: the shape its model.source
names (`qerl_pipe.model.shapes.shape_for_source`), its base format, prompts x samples, lengths, LoRA rank
(and train.lora.experts), micro-batch and slot bounds and budget (read and validated as
`qerl-pipe run` reads it, defaults included). The ladder (recipes/ladder/) is run this way; `--unconstrained` runs the same recipes without their
budgets, for the time a step costs with the whole GPU, and `--append` adds rows to the `--out` file
(keeping the settings that describe the rows already there).
"""

from __future__ import annotations

import gc
import json
import statistics
import string
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from qerl_lab.kernel_kinds import profile_kinds
from qerl_pipe.model.random_init import init_random_model
from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_lab.rollout import parse_label
from qerl_pipe.model.shapes import SHAPES, shape_for_source
from qerl_pipe.engine import Engine, plan_limits
from qerl_pipe.engine.sampling import SamplingParams
from qerl_pipe.memory.plan import GB, MemoryBudgetError, StepShape, enforce_budget, plan_step, release_budget
from qerl_pipe.memory.step import StepSize
from qerl_pipe.errors import QerlError
from qerl_pipe.jobs.step_plan import copy_bytes_asked
from qerl_pipe.jobs.train_config import fp8_rollout
from qerl_pipe.jobs.train_config import train_config as trainer_config
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.kernels import dispatch
from qerl_pipe.kernels.base_formats import base_format
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.load import model_memory_bytes
from qerl_pipe.model.lora import LoraSpec, lora_parameters
from qerl_pipe.recipe import TrainSection, load_recipe
from qerl_pipe.rl.algo.logprobs import DEFAULT_CHUNK
from qerl_pipe.rl.task.tasks import Problem
from qerl_pipe.rl.loop.trainer import Trainer
from qerl_pipe.strict_json import dumps, write_json

GIB = 2**30
QUANTS = ("bf16", "nf4", "nvfp4")
# Sequences per forward/backward: activations of 8 x 1280 tokens fit easily at 7B/14B and at
# Qwen3-30B-A3B (hidden 2048); the larger hidden sizes and layer counts of 32B/72B want 4.
DEFAULT_MICRO_BATCH = {"qwen2.5-7b": 8, "qwen2.5-14b": 8, "qwen2.5-32b": 4, "qwen2.5-72b": 4, "qwen3-30b-a3b": 8}
SYNTHETIC_REWARD = "qerl_lab.train_step:synthetic_reward"
# The ladder of issue 20 (shape, base, budget GB), and issue 35's Qwen3-30B-A3B rung: each rung's
# step completes under its budget, except those in LADDER_REFUSED, which must be refused before any work.
LADDER = (("qwen2.5-7b", "nvfp4", 16), ("qwen2.5-14b", "nvfp4", 24), ("qwen2.5-32b", "nvfp4", 40),
          ("qwen2.5-72b", "nvfp4", 80), ("qwen2.5-72b", "bf16", 80), ("qwen3-30b-a3b", "nvfp4", 40))
LADDER_REFUSED = {("qwen2.5-72b", "bf16", 80)}
ESTIMATE_ERROR_TARGET = 0.05


@dataclass(frozen=True)
class StepSettings:
    prompts: int = 8
    group_size: int = 8
    prompt_len: int = 256
    response_len: int = 1024
    lora_rank: int = 32
    lora_experts: bool = False  # MoE: LoRA on every routed expert too (a recipe's train.lora.experts)
    micro_batch: int | None = None  # None: DEFAULT_MICRO_BATCH of the shape (4 for unknown ones)
    kv_slots: int | None = None  # engine slots; None: every sequence of the step at once
    # The warm-up step's prompts x samples: None = the timed step's, so its prefill, decode batch
    # and training micro-batch shapes (and every kernel compiled for them) are the timed step's.
    warmup_prompts: int | None = None
    warmup_group_size: int | None = None
    warmup_tokens: int = 32
    logprob_chunk: int = DEFAULT_CHUNK
    lr: float = 1e-5
    adapter: str = "lora"  # or "full": every weight trains (bf16 base only)
    # The NVFP4 dispatch column (kernels.dispatch): "deterministic" (the default) or "fast"
    # (humming's stream-K rows too: not the same bits run to run).
    kernels: str = "deterministic"
    # The rollout's FP8 settings (engine.activations, engine.kv_cache): "bf16" or "fp8" each.
    activations: str = "bf16"
    kv_cache: str = "bf16"
    # Run one more step with torch.profiler around its training phase (kernel time by kind).
    profile_train: bool = False
    # Steps timed one after another: the row's figures are the median of those after the first
    # (the steady state of a run); the first, which pays one-time costs, is reported beside them.
    timed_steps: int = 3
    # Run less than the planned step (issue 49's proof that a recipe runs at its budget): one wave of
    # the planned KV slots' prompts, responses stopped at `stop_at` tokens. The plan, the engine's
    # KV cache and its sequence length stay the full step's; the row says what was lowered.
    one_wave: bool = False
    stop_at: int | None = None

    @property
    def sequences(self) -> int:
        return self.prompts * self.group_size

    def shape(self, shape: str) -> StepShape:
        """The step for the planner: these settings are the upper bounds it chooses under."""
        return StepShape(self.sequences, self.prompts, self.prompt_len + self.response_len, self.prompt_len,
                         self.lora_rank, self.kv_slots or self.sequences,
                         self.micro_batch or DEFAULT_MICRO_BATCH.get(shape, 4), self.logprob_chunk, self.adapter,
                         lora_experts=self.lora_experts, kv_cache=self.kv_cache)


@dataclass(frozen=True)
class RecipeStep:
    """One recipe as the bench runs it: random weights of its model's shape (`qerl_pipe.model.shapes`)."""

    name: str  # the recipe file's name
    shape: str
    quant: str
    settings: StepSettings
    budget_gb: float | None


def read_recipe(path: Path) -> RecipeStep:
    """The step a recipe describes, read and validated as `qerl-pipe run` reads it (the recipe's
    defaults fill what it leaves out); its model.source must name a shape of `qerl_pipe.model.shapes`."""
    recipe = load_recipe(path)  # a RecipeError names the file and the key
    shape = shape_for_source(recipe.model.source)
    if shape is None:
        raise QerlError(f"{path.name}: model.source {recipe.model.source!r} is not a shape the bench can build "
                        f"random weights of ({', '.join(sorted(SHAPES))})")
    train, engine = recipe.train, recipe.engine
    if engine.max_seq_len <= train.max_new_tokens:
        raise QerlError(f"{path.name}: engine.max_seq_len ({engine.max_seq_len}) leaves no room for a prompt beside "
                        f"train.max_new_tokens ({train.max_new_tokens})")
    settings = StepSettings(prompts=train.prompts_per_step, group_size=train.group_size,
                            prompt_len=engine.max_seq_len - train.max_new_tokens, response_len=train.max_new_tokens,
                            lora_rank=train.lora.rank, lora_experts=train.lora.experts,
                            micro_batch=train.micro_batch_size, kv_slots=engine.max_batch,
                            adapter=train.adapter, kernels="deterministic" if engine.deterministic else "fast",
                            activations=engine.activations, kv_cache=engine.kv_cache)
    return RecipeStep(path.name, shape, engine.base_format, settings, train.memory_budget_gb)


# ---------------------------------------------------------------------- the synthetic task


class LetterTokenizer:
    """Stands in for a tokenizer (random weights have no vocabulary): one letter per token id, so
    each completion is a distinct string with no digits or \\boxed{} and scoring costs nothing."""

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        letters = string.ascii_lowercase
        return ["".join(letters[t % 26] for t in seq) for seq in sequences]


def synthetic_reward(completion: str, problem: Problem) -> float:
    """A reward in [0, 1) that differs between any two different completions: every group has a
    spread, so the advantages, the loss and its backward are real work."""
    return zlib.crc32(completion.encode()) / 2**32


def _prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the top of Qwen's vocabulary.
    return torch.randint(0, min(vocab, 150000), (count, length), generator=gen).tolist()


def train_config(s: StepSettings, micro: int, prompts: int, group: int, new_tokens: int) -> TrainSection:
    """The recipe's `train` section the step runs, built and validated as a recipe's is: its
    defaults, with the step's sizes, sampling at temperature 1 without top-p/top-k, the DAPO loss,
    the synthetic reward alone, no evaluation and no checkpoints. The schedule has the timed steps,
    and one more with --profile-train (the profiled step must be inside the AQN schedule)."""
    return TrainSection(
        eval_data=None, eval_limit=0, steps=s.timed_steps + s.profile_train, prompts_per_step=prompts, group_size=group, max_new_tokens=new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, loss="dapo", micro_batch_size=micro, lr=s.lr,
        gradient_checkpointing=True, adapter=s.adapter, lora={"rank": s.lora_rank, "alpha": 2.0 * s.lora_rank},
        rewards={"accuracy": 0.0, "format": 0.0, "custom": [SYNTHETIC_REWARD]}, checkpoint_every=0, seed=0,
    )


def _trainer(model: Decoder, engine: Engine, prompts: list[list[int]], cfg: TrainSection,
             logprob_chunk: int) -> Trainer:
    problems = [Problem(f"synthetic:{i}", "", "0", "arithmetic") for i in range(len(prompts))]
    # No stop ids: every response runs to max_new_tokens.
    # The section's micro-batch is the plan's; FP8 rollouts get the TIS default train gives them.
    fp8 = fp8_rollout({"activations": engine.activations, "limits": engine.limits.to_json()})  # as engine.json says
    run = replace(trainer_config(cfg, fp8=fp8), logprob_chunk=logprob_chunk)
    return Trainer(model, engine, LetterTokenizer(), problems, prompts, run, stop_token_ids=())


# ---------------------------------------------------------------------- GPU bookkeeping


def _cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _sync(device: str) -> None:
    if _cuda(device):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    """Return everything the last configuration held to the driver and restart the peak counters."""
    gc.collect()
    if _cuda(device):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peaks(device: str) -> dict[str, int | None]:
    if not _cuda(device):
        return {"allocated": None, "reserved": None}
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}


def _free_bytes(device: str) -> int | None:
    return torch.cuda.mem_get_info()[0] if _cuda(device) else None


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


# ---------------------------------------------------------------------- one configuration


def _warm_up(model: Decoder, engine: Engine, prompts: list[list[int]], s: StepSettings, size: StepSize,
             device: str) -> dict[str, Any]:
    """A small trainer step, then every decode graph. The warm-up step has the timed step's prompts
    x samples with short responses, so its prefill, decode batch and training micro-batch fall in
    the timed step's kernel rows and whatever they compile (Triton kernels, humming's NVRTC
    kernels) is compiled here, not inside the timed step (measured: with 1 x 2 prompts the timed
    7B NVFP4 rollout took 13.1 s against 7.7 s for the same generate right after it, on an H100);
    the captures cover every (batch, length) the timed rollout decodes at."""
    tokens = min(s.warmup_tokens, s.response_len)  # a step of short responses: no longer than them
    prompts_n, group = s.warmup_prompts or s.prompts, s.warmup_group_size or s.group_size
    cfg = train_config(s, size.micro_batch, prompts_n, group, tokens)
    t0 = time.perf_counter()
    _trainer(model, engine, prompts, cfg, size.logprob_chunk).step()  # its optimizer goes with it
    _sync(device)
    t1 = time.perf_counter()
    graphs = engine.capture_graphs()
    _sync(device)
    return {
        "what": (f"one trainer step of {prompts_n} prompt x {group} samples x "
                 f"{tokens} new tokens (prefill, decode, scoring, logprobs, backward, AdamW), "
                 "then capture of every decode CUDA graph (batch size x attention length)"),
        "step_s": t1 - t0, "graphs_captured": graphs, "capture_s": time.perf_counter() - t1,
        "peak_allocated_bytes_since_build": _peaks(device)["allocated"],
    }


def _lora_param_bytes(model: Decoder) -> int:
    return sum(p.numel() * p.element_size() for p in lora_parameters(model))


def _profiled_training(trainer: Trainer) -> dict:
    """One more step, with the profiler around its training phase only (the rollout's thousands of
    graph replays would drown it): where the training time goes, by kernel kind."""
    update, summary = trainer._update, {}

    def profiled(groups):
        result, summary["profile"] = profile_kinds(lambda: update(groups))
        return result

    trainer._update = profiled  # the instance attribute shadows the method for this one step
    try:
        trainer.step()
    finally:
        del trainer._update
    return summary["profile"]


def _optimizer_bytes(trainer: Trainer) -> int:
    """AdamW's moments, and under full fine-tuning the float32 masters it steps (not model weights)."""
    moments = sum(t.numel() * t.element_size() for state in trainer.optimizer.state.values()
                  for t in state.values() if isinstance(t, torch.Tensor))
    full = trainer.full
    masters = sum(m.numel() * 4 for m, w in zip(full.masters, full.weights) if m is not w) if full else 0
    return moments + masters


def measure_step(config: Mapping[str, Any], quant: str, s: StepSettings, size: StepSize,
                 device: str, kernel_copies: bool = True) -> dict[str, Any]:
    """Build, warm up, time `s.timed_steps` steps; every figure of a row that ran (`kernel_copies`: whether the
    plan keeps humming copies of an NVFP4 base)."""
    t0 = time.perf_counter()
    lora = LoraSpec(rank=s.lora_rank, alpha=2.0 * s.lora_rank, experts=s.lora_experts) if s.adapter == "lora" else None
    model = init_random_model(config, base_format=quant, device=device, lora=lora)
    _sync(device)
    build_s, build_peak = time.perf_counter() - t0, _peaks(device)["allocated"]
    limits = plan_limits(model.config, max_seq_len=size.seq_len, max_batch=size.kv_slots,
                         cuda_graphs=_cuda(device), kv_cache=s.kv_cache)
    engine = Engine(model, limits, kernel_copies=kernel_copies, activations=s.activations)
    prompts = _prompts(s.prompts, s.prompt_len, model.config.vocab_size)
    warmup = _warm_up(model, engine, prompts, s, size, device)

    cfg = train_config(s, size.micro_batch, s.prompts, s.group_size, s.response_len)
    trainer = _trainer(model, engine, prompts, cfg, size.logprob_chunk)
    _sync(device)
    captures = engine.runner.graphs.captures
    steps, peaks = [], {"allocated": 0, "reserved": 0}
    for _ in range(s.timed_steps):
        t0 = time.perf_counter()
        m = trainer.step()  # resets the peak counters at its start
        _sync(device)
        step_s = time.perf_counter() - t0
        # The trainer's clock stops before the last optimizer kernels finish; the synchronised tail
        # belongs to training: train = whole step - (noise draw, rollouts, scoring).
        steps.append({"step_s": step_s, "rollout_s": m["rollout_seconds"],
                      "train_s": step_s - (m["step_seconds"] - m["train_seconds"])})
        peaks = {k: None if v is None else max(v, peaks[k] or 0) for k, v in _peaks(device).items()}
    captures = engine.runner.graphs.captures - captures
    steady = {k: statistics.median(st[k] for st in (steps[1:] or steps)) for k in ("step_s", "rollout_s", "train_s")}
    # The same rollout outside the trainer (engine.generate alone, as `bench rollout` runs it):
    # whether the in-step rollout pays for something the engine alone does not.
    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=s.response_len, seed=1)
    t1 = time.perf_counter()
    engine.generate(prompts, n=s.group_size, sampling=sampling)
    _sync(device)
    rollout_alone_s = time.perf_counter() - t1
    rollout_tokens = s.sequences * round(m["response_length_mean"])
    lora_bytes = _lora_param_bytes(model) if s.adapter == "lora" else 0  # full: the weights are the model's
    resident = model_memory_bytes(model)
    profiled = {"train_profile": _profiled_training(trainer)} if s.profile_train and _cuda(device) else {}
    return {**profiled,
        "kernels": s.kernels, "humming_linears": sum(m.humming is not None for m in model.modules()
                                                     if isinstance(m, QuantLinear)),
        "build_s": build_s, "build_peak_allocated_bytes": build_peak, "warmup": warmup,
        **steady, "first_step": steps[0], "timed_steps": steps,
        "rollout_alone_s": rollout_alone_s, "graph_captures_in_step": captures,
        "rollout_tokens": rollout_tokens, "rollout_tokens_per_s": rollout_tokens / steady["rollout_s"],
        "train_tokens": m["train_tokens"], "train_tokens_per_s": m["train_tokens"] / steady["train_s"],
        "all_responses_full_length": m["response_length_mean"] == s.response_len and m["truncation_rate"] == 1.0,
        "peak_allocated_bytes": peaks["allocated"], "peak_reserved_bytes": peaks["reserved"],
        "peak_allocated_gib": _gib(peaks["allocated"]), "peak_reserved_gib": _gib(peaks["reserved"]),
        "model_resident_bytes": resident, "model_resident_gib": _gib(resident),
        "base_weights_bytes": resident - lora_bytes, "lora_param_bytes": lora_bytes,
        "optimizer_state_bytes": _optimizer_bytes(trainer), "kv_cache_bytes": limits.kv_cache_bytes,
        "cuda_graphs": engine.uses_cuda_graphs,
        "loss": m["loss"], "grad_norm": m["grad_norm"], "reward_std": m["reward_std"],
    }


def bench_config(name: str, config: Mapping[str, Any], quant: str, s: StepSettings, device: str = "cuda",
                 memory_limit_bytes: int | None = None, budget_gb: float | None = None,
                 recipe: str | None = None) -> dict[str, Any]:
    """One row: measured, or why not (refused by the planner, does not fit, out of memory, another
    error). Under `budget_gb` the planner chooses the settings and the process is capped to it."""
    _free(device)
    budget = None if budget_gb is None else int(budget_gb * GB)
    row: dict[str, Any] = {"shape": name, "quant": quant, "adapter": s.adapter,
                           **({"recipe": recipe} if recipe is not None else {}),
                           "memory_budget_gb": budget_gb, "memory_budget_bytes": budget}
    if _cuda(device):
        dispatch.configure(dispatch.table_for(torch.device(device)), deterministic=s.kernels == "deterministic")
    decoder_config = DecoderConfig.from_hf(config)
    base = parse_label(quant)[0]  # the row keeps the whole label (nvfp4+fp8)
    copies = copy_bytes_asked(decoder_config, base, torch.device(device), dispatch.active(torch.device(device))[0],
                              s.kernels == "deterministic", s.lora_experts, s.activations) if _cuda(device) else 0
    try:
        plan = plan_step(decoder_config, base, s.shape(name), budget,
                         budget_source="train.memory_budget_gb" if recipe else "--memory-budget-gb",
                         what=f"the {name} {quant} step", kernel_copies=copies)
    except MemoryBudgetError as e:  # before anything is allocated
        return {**row, "fits": False, "status": "refused", "needed_bytes": e.needed_bytes,
                "needed_gb": round(e.needed_bytes / GB, 2), "error": str(e)}
    size, estimate = plan.size, plan.estimate
    limit = memory_limit_bytes if memory_limit_bytes is not None else _free_bytes(device)
    row.update({"micro_batch": size.micro_batch, "kv_slots": size.kv_slots, "logprob_chunk": size.logprob_chunk,
                "memory_plan": plan.to_json(), "estimate_bytes": estimate, "estimate_gib": _gib(estimate["total"]),
                "memory_limit_bytes": limit})
    if limit is not None and estimate["total"] > limit:
        return {**row, "fits": False, "status": "does-not-fit", "asked_bytes": estimate["total"]}
    run = _lowered(s, size.kv_slots)
    if run != s:
        row["lowered"] = {"prompts_per_step": [s.prompts, run.prompts], "response_len": [s.response_len,
                                                                                           run.response_len]}
    try:
        if budget is not None:
            row["memory_fraction"] = enforce_budget(budget, torch.device(device))
        measured = measure_step(config, base, run, size, device, plan.kernel_copies)
        return {**row, "fits": True, "status": "ok", **measured, **_against_estimate(measured, estimate["total"], budget)}
    except torch.cuda.OutOfMemoryError as e:
        failed = {**row, "fits": False, "status": "oom", "error": str(e).splitlines()[0][:500],
                  "asked_bytes": estimate["total"]}
    except Exception as e:  # noqa: BLE001 - one broken configuration must not lose the others' data
        failed = {**row, "fits": None, "status": "error", "error": f"{type(e).__name__}: {e}"[:1000],
                  "traceback": traceback.format_exc()[-3000:]}
    finally:
        if budget is not None:
            release_budget(torch.device(device))
    # Outside the except block: the traceback, and with it the model, is released by now.
    _free(device)
    return failed


def _lowered(s: StepSettings, kv_slots: int) -> StepSettings:
    """The step that runs within the plan of `s`: one wave of `kv_slots` sequences (`one_wave`) and
    responses of at most `stop_at` tokens; `s` itself when neither is asked."""
    prompts = min(s.prompts, max(1, kv_slots // s.group_size)) if s.one_wave else s.prompts
    length = min(s.response_len, s.stop_at) if s.stop_at else s.response_len
    return replace(s, prompts=prompts, response_len=length)


def _against_estimate(measured: Mapping[str, Any], estimate: int, budget: int | None) -> dict[str, Any]:
    """The step's peak reserved against the estimate (and the budget): what the planner relied on."""
    peak = measured["peak_reserved_bytes"]
    if peak is None:  # CPU: no CUDA statistics
        return {}
    out: dict[str, Any] = {"peak_reserved_gb": round(peak / GB, 3),
                           "estimate_over_peak": round((estimate - peak) / peak, 4)}
    if budget is not None:
        out["peak_under_budget"] = peak <= budget
    return out


# ---------------------------------------------------------------------- targets and the run


def _row(rows: list[dict], shape: str, quant: str) -> dict | None:
    """The LoRA row of (shape, quant) run by --shape without a budget: the targets compare LoRA arms
    (full fine-tuning rows are extra; recipe and budget rows have targets of their own)."""
    return next((r for r in rows if r["shape"] == shape and r["quant"] == quant
                 and r.get("adapter", "lora") == "lora" and r.get("recipe") is None
                 and r.get("memory_budget_bytes") is None), None)


def _gb(gib: float | None) -> float | None:
    return None if gib is None else round(gib * GIB / 1e9, 2)


def _peak_target(rows: list[dict], shape: str, limit_gb: float, what: str) -> list[dict]:
    """The issue states memory targets in GB (10^9 bytes, as GPU memory is sold); rows hold GiB."""
    r = _row(rows, shape, "nvfp4")
    if r is None:
        return []
    if r["status"] != "ok":  # did not run: the estimate is what it asked for
        return [target(f"{shape} NVFP4 RL step {what} (did not run: {r['status']}; measured = estimated need)",
                       f"< {limit_gb} GB", _gb(r["estimate_gib"]), "GB", False)]
    peak = _gb(r["peak_reserved_gib"])
    return [target(f"{shape} NVFP4 RL step {what} (peak reserved)", f"< {limit_gb} GB", peak, "GB",
                   peak is not None and peak < limit_gb)]


def _ladder_row(rows: list[dict], shape: str, quant: str, budget_gb: float | None) -> dict | None:
    """The last recipe row of (shape, quant) at `budget_gb` (None: run --unconstrained)."""
    found = [r for r in rows if r.get("recipe") is not None and r["shape"] == shape and r["quant"] == quant
             and r.get("memory_budget_gb") == budget_gb]
    return found[-1] if found else None


def ladder_targets(rows: list[dict]) -> list[dict]:
    """Issue 20's ladder, for the rungs that ran: each step completes under its budget (peak
    reserved, GB) with the estimate within 5% of that peak; the bf16 72B step is refused before any
    work, naming the budget it needs."""
    out = []
    for shape, quant, gb in LADDER:
        r = _ladder_row(rows, shape, quant, gb)
        if r is None:
            continue
        what = f"ladder: {shape} {quant if base_format(quant).dense else quant.upper()} at {gb} GB"
        if (shape, quant, gb) in LADDER_REFUSED:
            out.append(target(f"{what}: refused before any work (measured: GB it says it needs)", "refused",
                              r.get("needed_gb"), "GB", r["status"] == "refused"))
            continue
        ok = r["status"] == "ok" and r.get("peak_reserved_gb") is not None
        peak = r.get("peak_reserved_gb") if ok else None
        out.append(target(f"{what}: one RL step completes, peak reserved under the budget ({r['status']})",
                          f"<= {gb} GB", peak, "GB", ok and r["peak_under_budget"]))
        error = r.get("estimate_over_peak") if ok else None
        out.append(target(f"{what}: planner's estimate vs measured peak reserved", "within 5%",
                          None if error is None else round(100 * error, 2), "%",
                          error is not None and abs(error) < ESTIMATE_ERROR_TARGET))
    return out


def ladder(rows: list[dict]) -> list[dict]:
    """Per recipe run under its budget: the plan, estimate, peak and step time, next to the same
    recipe run --unconstrained (what the smaller card costs in speed), when both ran."""
    out = []
    for r in rows:
        if r.get("recipe") is None or r.get("memory_budget_gb") is None:
            continue
        free = _ladder_row(rows, r["shape"], r["quant"], None)
        plan = r.get("memory_plan") or {}
        entry = {"recipe": r["recipe"], "shape": r["shape"], "quant": r["quant"], "budget_gb": r["memory_budget_gb"],
                 "status": r["status"], "needed_gb": r.get("needed_gb"),
                 **{k: plan.get(k) for k in ("kv_slots", "waves", "micro_batch", "logprob_chunk", "estimate_gb")},
                 "peak_reserved_gb": r.get("peak_reserved_gb"), "step_s": r.get("step_s"),
                 "unconstrained_step_s": free.get("step_s") if free else None,
                 "unconstrained_peak_reserved_gb": free.get("peak_reserved_gb") if free else None}
        if entry["step_s"] and entry["unconstrained_step_s"]:
            entry["slowdown"] = round(entry["step_s"] / entry["unconstrained_step_s"], 3)
        out.append(entry)
    return out


# The RL-step issue's targets (NVFP4 over bf16 LoRA, step time, same run): the 8 x 8 step of
# --shape, its training phase, and the paper's speed setting as recipes (recipes/speed/, run
# --unconstrained), keyed by the recipe's file name with its base format left out.
STEP_TARGETS = {"qwen2.5-7b": 1.10, "qwen2.5-32b": 1.30}
TRAIN_PHASE_TARGETS = {"qwen2.5-7b": 0.95}
# Issue 47: the step with FP8 rollout activations over bf16 LoRA's (H100's target; 1.10x on an H200).
FP8_STEP_TARGETS = {"qwen2.5-7b": 1.15, "qwen2.5-32b": 1.30}
PAPER_TARGETS = {"qwen2.5-7b-1x2.yaml": 1.75, "qwen2.5-7b-1x8.yaml": 1.60, "qwen2.5-32b-1x8.yaml": 1.75}


def _recipe_row(rows: list[dict], recipe: str, quant: str) -> dict | None:
    """The last unconstrained row of recipe `recipe` (file name without its base format) over `quant`."""
    found = [r for r in rows if r.get("recipe") is not None and r["quant"] == quant
             and r.get("memory_budget_gb") is None and r["recipe"].replace(f"-{quant}-", "-") == recipe]
    return found[-1] if found else None


def _ratio_target(what: str, want: float, bf16: dict | None, fp4: dict | None, key: str) -> list[dict]:
    """bf16's time over NVFP4's for `key`, named with the NVFP4 row's kernel column."""
    if not (bf16 and fp4 and bf16["status"] == fp4["status"] == "ok"):
        return []
    ratio = bf16[key] / fp4[key]
    name = what.format(how=f"NVFP4 ({fp4.get('kernels', 'deterministic')} kernels) over bf16 LoRA")
    return [target(name, f">= {want}x", round(ratio, 3), "x", ratio >= want)]


def targets(rows: list[dict]) -> list[dict]:
    out = _peak_target(rows, "qwen2.5-32b", 40, "peak GPU memory")
    out += _peak_target(rows, "qwen2.5-72b", 135, "fits on one H200")
    for shape, want in STEP_TARGETS.items():
        out += _ratio_target(shape + " RL step 8 x 8: {how} (step time, same run)", want,
                             _row(rows, shape, "bf16"), _row(rows, shape, "nvfp4"), "step_s")
    for shape, want in FP8_STEP_TARGETS.items():
        if shape == "qwen2.5-7b" and torch.cuda.is_available() and "H200" in torch.cuda.get_device_name():
            want = 1.10
        for label, what in (("nvfp4+fp8", "FP8 rollout activations"), ("nvfp4+fp8+fp8kv", "FP8 rollout (+ KV cache)")):
            out += _ratio_target(shape + f" RL step 8 x 8, {what}: {{how}} (step time, same run)", want,
                                 _row(rows, shape, "bf16"), _row(rows, shape, label), "step_s")
    for shape, want in TRAIN_PHASE_TARGETS.items():
        out += _ratio_target(shape + " RL step 8 x 8, training phase: {how}", want,
                             _row(rows, shape, "bf16"), _row(rows, shape, "nvfp4"), "train_s")
    for recipe, want in PAPER_TARGETS.items():
        out += _ratio_target(recipe.removesuffix(".yaml") + " (the paper's speed setting): {how}", want,
                             _recipe_row(rows, recipe, "bf16"), _recipe_row(rows, recipe, "nvfp4"), "step_s")
    return out + ladder_targets(rows)


def speedups(rows: list[dict], base: str = "bf16") -> list[dict]:
    """Per shape (8 x 8 rows) and per speed recipe with both run: `base`'s time over NVFP4's, per phase."""
    pairs = [(shape, _row(rows, shape, base), _row(rows, shape, "nvfp4"))
             for shape in dict.fromkeys(r["shape"] for r in rows)]
    pairs += [(recipe, _recipe_row(rows, recipe, base), _recipe_row(rows, recipe, "nvfp4"))
              for recipe in dict.fromkeys(r["recipe"].replace(f"-{r['quant']}-", "-") for r in rows
                                          if r.get("recipe") is not None)]
    return [{"shape": name, **{k: round(slow[f"{k}_s"] / fp4[f"{k}_s"], 3) for k in ("rollout", "train", "step")}}
            for name, slow, fp4 in pairs if slow and fp4 and slow["status"] == fp4["status"] == "ok"]


def _settings(s: StepSettings) -> dict[str, Any]:
    return {**asdict(s), "sampling": "temperature 1.0, no top-p/top-k, no stop token (every response "
            "runs to response_len)", "reward": "synthetic: crc32 of the response text, in [0, 1)",
            "loss": "dapo, mu 1, no KL, AQN schedule stage 0",
            "optimizer": ("AdamW on float32 masters of every weight, clip 1.0" if s.adapter == "full"
                          else "AdamW on the fp32 LoRA, clip 1.0"),
            "lora_alpha": 2 * s.lora_rank, "gradient_checkpointing": True}


def _summary(r: dict) -> str:
    what = f"{r.get('recipe') or r['shape']} {r['quant']}"
    if r["status"] == "refused":
        return f"{what}: refused: {r['error']}"
    plan = (f"{r['kv_slots']} KV slots ({r['memory_plan']['waves']} waves), micro-batch {r['micro_batch']}, "
            f"chunk {r['logprob_chunk']}, estimate {r['memory_plan']['estimate_gb']} GB"
            + (f" of {r['memory_budget_gb']} GB" if r.get("memory_budget_gb") is not None else ""))
    if r["status"] != "ok":
        return f"{what}: {r['status']} ({plan}) {r.get('error', '')}"
    return (f"{what}: {plan}: step {r['step_s']:.1f} s = rollout {r['rollout_s']:.1f} s "
            f"({r['rollout_tokens_per_s']:.0f} tok/s) + train {r['train_s']:.1f} s "
            f"({r['train_tokens_per_s']:.0f} tok/s), peak {r['peak_reserved_gib']} GiB reserved")


def with_rollout(s: StepSettings, label: str) -> StepSettings:
    """`s` with the rollout's FP8 settings a --quant label names (`nvfp4+fp8`: FP8 activations)."""
    _, activations, kv_cache = parse_label(label)
    return replace(s, activations=activations, kv_cache=kv_cache)


def run_train_step_bench(shapes: Sequence[str], quants: Sequence[str], s: StepSettings = StepSettings(),
                         device: str = "cuda", memory_limit_bytes: int | None = None, out: Path | None = None,
                         shape_configs: Mapping[str, Mapping[str, Any]] = SHAPES,
                         emit: Callable[[str], None] = lambda line: print(line, flush=True), *,
                         memory_budget_gb: float | None = None, recipes: Sequence[Path] = (),
                         unconstrained: bool = False, append: bool = False) -> dict[str, Any]:
    """Every recipe, then every (shape, quant), in order; after each, `emit` gets its JSON line and
    `out` is rewritten (`append`: after the rows it already holds, keeping its recipe settings, and
    its shape settings when this run has no shapes). `memory_budget_gb` applies to
    the shapes; recipes bring their own budgets, which `unconstrained` drops."""
    unknown = [q for q in quants if parse_label(q)[0] not in QUANTS] + [n for n in shapes if n not in shape_configs]
    if unknown:
        raise QerlError(f"unknown {unknown}: shapes are {sorted(shape_configs)}, quants {list(QUANTS)}, each with "
                        "+fp8 (FP8 rollout activations) and +fp8kv or +int8kv (a coded KV cache) if wanted")
    full_over_4bit = s.adapter == "full" and not all(base_format(parse_label(q)[0]).dense for q in quants)
    if shapes and (s.adapter not in ("lora", "full") or full_over_4bit):
        raise QerlError(f"--adapter {s.adapter} with --quant {','.join(quants)}: the adapter is lora or full, and "
                        "full fine-tuning trains a bf16 base only (pass --quant bf16)")
    steps = [read_recipe(Path(r)) for r in recipes]  # every recipe read before the first build
    # What the command line says of how to run a step applies to the recipes' steps too.
    steps = [replace(st, settings=replace(st.settings, one_wave=s.one_wave, stop_at=s.stop_at,
                                          timed_steps=s.timed_steps)) for st in steps]
    for step in steps:
        if step.quant not in QUANTS or step.settings.adapter != "lora":
            raise QerlError(f"{step.name}: the bench runs LoRA over a {'/'.join(QUANTS)} base, not "
                            f"{step.settings.adapter} over {step.quant}")
    if _cuda(device) and not torch.cuda.is_available():
        raise QerlError("bench train-step measures a GPU training step and needs a CUDA GPU; none is visible here")
    rows: list[dict] = []
    earlier: dict[str, Any] = {}  # the file appended to: its settings describe the rows it holds
    if append and out is not None and out.is_file():
        earlier = json.loads(out.read_text())
        rows = list(earlier.get("results", []))
    recipe_settings = {**(earlier.get("recipe_settings") or {}), **{st.name: _settings(st.settings) for st in steps}}

    def result() -> dict[str, Any]:
        settings = _settings(s) if shapes else earlier.get("settings")
        return results_file(rows, targets(rows), settings=settings, torch=torch.__version__,
                            nvfp4_over_bf16=speedups(rows), nvfp4_over_nf4=speedups(rows, "nf4"),
                            ladder=ladder(rows), recipe_settings=recipe_settings)

    latest = result()
    cases = [(st.shape, st.quant, st.settings, None if unconstrained else st.budget_gb, st.name) for st in steps]
    cases += [(name, quant, with_rollout(s, quant), memory_budget_gb, None) for name in shapes for quant in quants]
    for name, quant, settings, budget_gb, recipe in cases:
        config = shape_configs[name] if name in shape_configs else SHAPES[name]
        rows.append(bench_config(name, config, quant, settings, device, memory_limit_bytes, budget_gb, recipe))
        print(_summary(rows[-1]), file=sys.stderr, flush=True)
        emit(dumps(nulls_for_non_finite(rows[-1])))
        latest = result()  # one dict for the file and the caller: its date is taken once
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_json(out, nulls_for_non_finite(latest), indent=1)
    return latest
