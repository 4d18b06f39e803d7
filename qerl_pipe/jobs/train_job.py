"""One training run in its work directory: train (or resume), greedy evaluation before and after, the
adapter (or the full model), plots and reports; the step planned to `train.memory_budget_gb` here
(`plan_run`). The train stage keys the run, picks the directory and seals it.
See docs/training.md, sections "Checkpoints and resume" and "The artifact (`train-<id>/`, kind `run`)"."""

from __future__ import annotations

import json
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact
from qerl_pipe.artifacts.store import link_tree
from qerl_pipe.engine import Engine
from qerl_pipe.jobs.engine_artifact import load_engine
from qerl_pipe.errors import QerlError
from qerl_pipe.formats.modelopt_writer import write_dense_config
from qerl_pipe.hf import load_tokenizer, pick_device
from qerl_pipe.jobs.step_plan import plan_recipe_step, plan_train
from qerl_pipe.jobs.train_config import plan_changes
from qerl_pipe.kernels.base_formats import base_format
from qerl_pipe.log import log
from qerl_pipe.memory.plan import MemoryPlan, enforce_budget
from qerl_pipe.memwatch import return_freed_tensors_to_os
from qerl_pipe.model.dense_copy import dense_base_copy
from qerl_pipe.model.full import full_training_bytes
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.lora import LoraSpec, apply_lora, check_lora_targets
from qerl_pipe.model.peft import ADAPTER_DIR, save_adapter
from qerl_pipe.model.save import save_hf_weights
from qerl_pipe.recipe import Recipe, TrainSection
from qerl_pipe.rl.algo.losses import MISMATCH_MEANS
from qerl_pipe.rl.loop.accuracy import greedy_accuracy
from qerl_pipe.rl.loop.checkpoint import latest_checkpoint
from qerl_pipe.rl.loop.config import TrainConfig
from qerl_pipe.rl.loop.distributed import Dist
from qerl_pipe.rl.loop.metrics import PLOTS_DIR, greedy_line, write_plots
from qerl_pipe.rl.loop.trainer import Trainer, fit
from qerl_pipe.rl.task.prompts import fit_prompts, stop_token_ids
from qerl_pipe.rl.task.rewards import CustomReward, load_custom_rewards
from qerl_pipe.rl.task.tasks import Problem, load_problems
from qerl_pipe.strict_json import dumps, write_json
from qerl_pipe.userfiles import resumable_on_full_disk

# The run's record of what names it and its memory plan, in its work directory and artifact.
RUN_FILE = "run.json"

# Where a full fine-tuning run keeps its trained weights, a Hugging Face model directory (a LoRA
# run keeps its adapter in ADAPTER_DIR); export reads them there.
MODEL_DIR = "model"
EVAL_DIR = "eval"
SECTION = "train"  # the recipe section, named in messages


def load_train_problems(section: TrainSection) -> tuple[list[Problem], list[Problem]]:
    """Training and evaluation problems (raises before any model work when a spec is bad)."""
    def fields(spec: str) -> dict[str, Any]:
        if not spec.endswith(".jsonl"):
            return {}
        return {"question_field": section.question_field, "answer_field": section.answer_field}

    train = load_problems(section.data, seed=section.seed, **fields(section.data))
    evaluation: list[Problem] = []
    if section.eval_data and section.eval_limit:
        # seed + 1: generated problems (arithmetic) differ from the training ones.
        evaluation = load_problems(section.eval_data, limit=section.eval_limit, seed=section.seed + 1,
                                   **fields(section.eval_data))
    return train, evaluation


def check_train_inputs(recipe: Recipe, engine: Artifact | None = None
                       ) -> tuple[list[Problem], list[Problem], list[tuple[str, CustomReward]]]:
    """Everything about the train section that can fail without a model (data files, fields, custom reward
    names, full fine-tuning over a 4-bit base: `engine`'s, else the recipe's), before any model work and
    before `run`'s first stage. Returns the training and evaluation problems and the custom rewards."""
    if recipe.train.adapter == "full":
        base = engine.summary.get("base_format") if engine is not None else recipe.engine.base_format
        if base is not None and not base_format(base).dense:
            source = f"the engine {engine.path.name}" if engine is not None else "engine.base_format"
            fix = ("pass a bf16 engine to --engine" if engine is not None
                   else "set engine.base_format=bf16 (--set engine.base_format=bf16)")
            raise QerlError(f"train.adapter=full trains every weight, which needs a bf16 base, but {source} is "
                            f"{base} (4-bit codes cannot take gradient updates): {fix}, or train LoRA over the "
                            "4-bit base with train.adapter=lora")
    check_optimizer(recipe.train.optimizer, recipe.train.device)
    problems, eval_problems = load_train_problems(recipe.train)
    return problems, eval_problems, load_custom_rewards(recipe.train.rewards.custom)


def check_optimizer(optimizer: str, device: str) -> None:
    """AdamW8bit runs on CUDA tensors with bitsandbytes installed: refused, naming the fix, where not."""
    if optimizer != "adamw8bit":
        return
    if pick_device(device).type != "cuda":
        raise QerlError("train.optimizer=adamw8bit (bitsandbytes' AdamW8bit) steps CUDA tensors only, and this train "
                        "runs on the CPU: set train.optimizer=adamw")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise QerlError("train.optimizer=adamw8bit needs bitsandbytes: pip install -e '.[qlora]', or set "
                        "train.optimizer=adamw") from None


def check_train_model(recipe: Recipe, hf_config: dict[str, Any]) -> None:
    """The train section against the model's config.json, before any work: LoRA targets the
    model can carry (all of Phi3's fused q/k/v or none), and a step that fits the memory budget."""
    if recipe.train.adapter == "lora":
        check_lora_targets(DecoderConfig.from_hf(hf_config), tuple(recipe.train.lora.targets))
    plan_recipe_step(recipe, hf_config)


def plan_run(section: TrainSection, engine_dir: Path, device: torch.device, dist: Dist = Dist()) -> MemoryPlan:
    """The plan of each rank's step over the engine in `engine_dir` (`step_plan.plan_train`), the process
    capped to train.memory_budget_gb on CUDA; MemoryBudgetError before anything is loaded."""
    plan, enforced = plan_train(section, engine_dir, device, dist.world_size)
    if enforced:
        enforce_budget(plan.budget_bytes, device)
    return plan


def write_report(run_dir: Path, section: TrainSection, records: list[dict[str, Any]], before: dict | None,
                 after: dict | None, seconds: float, device: str, plan: MemoryPlan) -> dict[str, Any]:
    tenth = max(1, len(records) // 10)

    def mean(key: str, rows: list[dict[str, Any]]) -> float:
        return sum(r[key] for r in rows) / max(1, len(rows))

    # A resumed run's records hold every step (metrics.jsonl is kept across sessions), so their step
    # times add up to the whole run's RL time; this session's clock alone would show the last part.
    report = {
        "steps": len(records), "device": device, "step_seconds_total": round(sum(r["step_seconds"] for r in records), 1),
        "seconds_this_session": round(seconds, 1), "train_data": section.data,
        "eval_data": section.eval_data if before else None, "eval_before": before, "eval_after": after,
        "reward_first_tenth": mean("reward_mean", records[:tenth]),
        "reward_last_tenth": mean("reward_mean", records[-tenth:]),
        "accuracy_first_tenth": mean("accuracy", records[:tenth]),
        "accuracy_last_tenth": mean("accuracy", records[-tenth:]),
        "rollout_tokens_per_s": mean("rollout_tokens_per_s", records),
        "step_seconds_mean": mean("step_seconds", records), "memory_plan_changes": plan_changes(plan),
        "mismatch": _mismatch(records),
    }
    write_json(run_dir / "report.json", report)
    trains = "full fine-tuning (every weight)" if section.adapter == "full" else f"LoRA r={section.lora.rank}"
    lines = [f"# Training report ({len(records)} steps on {device}: {report['step_seconds_total']} s of RL steps in "
             f"all sessions; this session {report['seconds_this_session']} s with loading and evaluation)", "",
             f"Loss {section.loss}, B={section.prompts_per_step} prompts x G={section.group_size}, lr {section.lr}, "
             f"{trains}, AQN {section.aqn.schedule} {section.aqn.sigma_start:g} -> "
             f"{section.aqn.sigma_end:g}, data {section.data}.", "",
             f"Memory plan: {plan.describe()}; {plan_changes(plan)}.", ""]
    if before and after:
        lines += [f"Greedy accuracy on {before['total']} problems of {section.eval_data}:", "",
                  "| | accuracy | mean length | truncated |", "|---|---|---|---|"]
        for name, r in (("before", before), ("after", after)):
            lines.append(f"| {name} | {r['accuracy']:.3f} ({r['correct']}/{r['total']}) | "
                         f"{r['response_length_mean']:.1f} | {r['truncation_rate']:.2f} |")
        lines.append("")
    if (m := report["mismatch"]) is not None:
        lines += [f"Rollout vs trainer log-probabilities over the {m['steps']} updating steps: k3 KL(rollout || trainer) "
                  f"{m['mismatch_k3']:.2e} per token on average, ratio trainer / rollout mean {m['tis_ratio_mean']:.4f} and "
                  f"max {m['tis_ratio_max']:.3g}, share of tokens above the TIS cap {m['tis_truncated']:.4f}.", ""]
    lines += [f"Training reward, first tenth of the steps: {report['reward_first_tenth']:.3f}; last tenth: "
              f"{report['reward_last_tenth']:.3f} (accuracy {report['accuracy_first_tenth']:.3f} -> "
              f"{report['accuracy_last_tenth']:.3f}).", ""]
    (run_dir / "report.md").write_text("\n".join(lines))
    return report


def _mismatch(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rollout/trainer mismatch over the steps that updated (means of the per-step means, the
    largest ratio); None when no step did (or the records predate the metrics)."""
    rows = [r for r in records if r.get("mismatch_k3") is not None]
    if not rows:
        return None
    out: dict[str, Any] = {key: sum(r[key] for r in rows) / len(rows) for key in MISMATCH_MEANS}
    return {**out, "tis_ratio_max": max(r["tis_ratio_max"] for r in rows), "steps": len(rows)}


def _full_memory_line(model: torch.nn.Module) -> tuple[str, dict[str, Any]]:
    """What full fine-tuning adds to the engine's memory, said before the first step."""
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    extra = full_training_bytes(params, model.dtype)  # the bf16 weights themselves are the engine's

    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    masters = " and masters" if model.dtype != torch.float32 else ""  # a float32 weight is its own
    line = (f"train: full fine-tuning of {params / 1e6:.1f}M parameters: weights {size(weights)}, plus "
            f"{size(extra)} of float32 gradients and AdamW moments{masters}")
    return line, {"trained_parameters": params, "train_state_gib": round(extra / 2**30, 3)}


@dataclass(frozen=True)
class RunInputs:
    """Everything a train run needs, settled at the stage boundary before the store is asked: the
    recipe (its train section gives the adapter's shape, the prompts and the report's words), the
    trainer's config built from it and the memory plan, the engine, the problems."""

    store: ArtifactStore
    force: bool  # start the run over (`--force`)
    recipe: Recipe
    engine: Artifact
    model_name: str  # the model as the recipe named it (adapter configs, reports); "" off rank 0
    config: dict[str, Any]  # what names the run (written to run.json)
    cfg: TrainConfig  # what the trainer runs
    plan: MemoryPlan  # sets the KV slots (`plan_run`); cfg holds its micro-batch and chunk
    problems: list[Problem]
    eval_problems: list[Problem]
    device: torch.device
    dist: Dist
    activations: str  # the engine's rollout activations (engine.json), "bf16" or "fp8"


@dataclass
class TrainSession:
    """What `setup_run` builds: the shared model with its adapter, the engine over it, the trainer."""

    model: torch.nn.Module
    spec: LoraSpec
    tokenizer: Any
    stops: tuple[int, ...]
    engine: Engine
    trainer: Trainer
    eval_problems: list[Problem]
    eval_prompts: list[list[int]]


def setup_run(run: RunInputs) -> TrainSession:
    """Load the engine artifact (its KV cache at the plan's slots), put the adapter on the model,
    fit the prompts and build the trainer."""
    section, engine_dir = run.recipe.train, run.engine.path
    # As quantize does: the stages' reads before this (a standalone CPU train's engine lookup and
    # plan) left freed memory in the heap, and the run peaked 55% over its plan line without this.
    return_freed_tensors_to_os()
    model, limits = load_engine(engine_dir, run.device)
    limits = limits.with_batch(run.plan.kv_slots)  # the plan's KV cache: the engine's, or fewer slots
    spec = LoraSpec(section.lora.rank, section.lora.alpha, tuple(section.lora.targets), section.lora.train_norms,
                    section.lora.experts)
    if section.adapter != "full":
        apply_lora(model, spec, seed=section.seed)
    tokenizer = load_tokenizer(engine_dir, run.recipe.model.trust_remote_code)
    stops = stop_token_ids(tokenizer, engine_dir)
    problems, prompts, _ = fit_prompts(tokenizer, run.problems, section.instruction, limits.max_seq_len,
                                       section.max_new_tokens, "training", SECTION)
    eval_problems, eval_prompts, _ = fit_prompts(tokenizer, run.eval_problems, section.instruction,
                                                 limits.max_seq_len, section.max_new_tokens, "evaluation", SECTION)
    engine = Engine(model, limits, kernel_copies=run.plan.kernel_copies, activations=run.activations)
    trainer = Trainer(model, engine, tokenizer, problems, prompts, run.cfg, stops, dist=run.dist)
    return TrainSession(model, spec, tokenizer, stops, engine, trainer, eval_problems, eval_prompts)


def train_run(session: TrainSession, run: RunInputs, run_dir: Path) -> tuple[list[dict], dict | None, dict | None]:
    """Greedy accuracy before (rank 0, once per run), the steps (every rank), accuracy after:
    (the step records, before, after)."""
    section, dist = run.recipe.train, run.dist
    before = after = None

    def greedy(name: str) -> dict[str, Any]:
        result = greedy_accuracy(session.engine, session.tokenizer, session.eval_problems, session.eval_prompts,
                                 section.max_new_tokens, session.stops)
        (run_dir / EVAL_DIR).mkdir(exist_ok=True)
        (run_dir / EVAL_DIR / f"{name}.jsonl").write_text("".join(dumps(s) + "\n" for s in result.samples))
        write_json(run_dir / EVAL_DIR / f"{name}.json", result.summary())
        return result.summary()

    if session.eval_prompts and dist.is_main:
        before_file = run_dir / EVAL_DIR / "before.json"
        if before_file.is_file():  # a resumed run evaluated the fresh adapter already
            before = json.loads(before_file.read_text())
        else:
            before = greedy("before")
            log(greedy_line("before", before, section.eval_data))
    records = fit(session.trainer, run_dir, section.checkpoint_every)
    if session.eval_prompts and dist.is_main:
        after = greedy("after")
        log(f"{greedy_line('after', after, section.eval_data)}; before {before['accuracy']:.3f}")
    return records, before, after


def save_run(session: TrainSession, run: RunInputs, run_dir: Path, records: list[dict[str, Any]],
             before: dict | None, after: dict | None, seconds: float, memory: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: the adapter (or the full model), plots and reports; returns the manifest summary."""
    section, plan = run.recipe.train, run.plan
    if section.adapter == "full":  # a Hugging Face model directory: safetensors, config.json, tokenizer files
        save_hf_weights(session.model, run_dir / MODEL_DIR)
        write_dense_config(run.engine.path, run_dir / MODEL_DIR, session.model.dtype)
    else:
        save_adapter(session.model, session.spec, run_dir / ADAPTER_DIR, run.model_name)
    write_plots(records, run_dir / PLOTS_DIR, section.max_new_tokens)
    report = write_report(run_dir, section, records, before, after, seconds, str(run.device), plan)
    return {
        "steps": len(records), "accuracy_before": before["accuracy"] if before else None,
        "accuracy_after": after["accuracy"] if after else None, "reward_first_tenth": report["reward_first_tenth"],
        "reward_last_tenth": report["reward_last_tenth"], "device": str(run.device), "adapter": section.adapter,
        **memory, "memory_plan": plan.to_json(), **({"processes": run.dist.world_size} if run.dist.enabled else {}),
        "seconds_this_session": round(seconds, 1),
    }


def run_train_job(run: RunInputs, run_dir: Path) -> dict[str, Any]:
    """Train (or resume) in `run_dir`, evaluate, save: setup, train, save. With several ranks all
    of them train; rank 0 alone evaluates and writes the files (the others return {})."""
    started = time.perf_counter()
    session = setup_run(run)
    # CPU: the 4-bit reference matmul dequantizes every weight at every call; one copy for the run.
    with dense_base_copy(session.model) if run.device.type == "cpu" else nullcontext() as dense_bytes:
        if dense_bytes and run.dist.is_main:
            log(f"train: CPU run, 4-bit base dequantized once ({dense_bytes / 2**20:.1f} MiB) instead of per call")
        memory: dict[str, Any] = {}
        if run.recipe.train.adapter == "full" and run.dist.is_main:
            line, memory = _full_memory_line(session.model)
            log(line)
        records, before, after = train_run(session, run, run_dir)
    if not run.dist.is_main:
        return {}
    return save_run(session, run, run_dir, records, before, after, time.perf_counter() - started, memory)


def train_in_work_dir(pending: PendingArtifact, run: RunInputs, built: list[Path]) -> None:
    """Train (or resume) in the run's work directory (`store.work_dir_for`), then link it into
    `pending`; appends the work directory to `built`."""
    dist = run.dist
    run_dir = run.store.work_dir_for("train", pending.id)
    dist.broadcast((None, str(run_dir)))
    if run.force and run_dir.exists():
        shutil.rmtree(run_dir)
    log(f"train: memory plan: {run.plan.describe()}")
    log(f"train: memory plan: {plan_changes(run.plan)}")
    with resumable_on_full_disk(run_dir, lambda: latest_checkpoint(run_dir) is not None):
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"id": pending.id, "engine": run.engine.id, **run.config, "memory_plan": run.plan.to_json()}
        write_json(run_dir / RUN_FILE, record)
        dist.barrier()  # the run directory is ready (and an old one cleared) before any rank reads it
        summary = run_train_job(run, run_dir)
        link_tree(run_dir, pending.dir)
    pending.summary.update(summary)
    built.append(run_dir)
