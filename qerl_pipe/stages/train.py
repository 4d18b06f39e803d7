"""`qerl-pipe train`: GRPO/DAPO of a LoRA adapter (or, `train.adapter: full`, of every weight of a
bf16 base) over an engine, with AQN. Keys the run, plans its step and builds its `TrainConfig` before
any work, trains in `<store>/.runs/train-<id>/` (a killed run resumes there; the run is
`jobs.train_job`) and seals it; under torchrun rank 0 alone resolves, evaluates and seals.
See docs/training.md, sections "Checkpoints and resume" and "Several GPUs"."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact, ArtifactStore, load_artifact
from qerl_pipe.dag import TRAIN, register
from qerl_pipe.jobs.engine_artifact import check_engine_for, read_engine_json
from qerl_pipe.hf import pick_device
from qerl_pipe.jobs.train_config import fp8_rollout, train_config
from qerl_pipe.jobs.train_job import (
    RunInputs, check_train_inputs, check_train_model, plan_run, run_train_job, train_in_work_dir,
)
from qerl_pipe.lineage import engine_model_name
from qerl_pipe.log import log
from qerl_pipe.recipe import Recipe, TrainSection
from qerl_pipe.rl.loop.distributed import Dist, init_distributed
from qerl_pipe.rl.task.rewards import custom_reward_digests
from qerl_pipe.runner import StageCall
from qerl_pipe.sources import peek_model_config
from qerl_pipe.userfiles import data_file_key, data_spec_key

STAGE = TRAIN


def train_key(section: TrainSection) -> dict[str, Any]:
    """The train section as the run's id sees it."""
    key = section.model_dump()
    key["data"], key["eval_data"] = data_spec_key(section.data), data_spec_key(section.eval_data)
    if key["memory_budget_gb"] is None:  # the free memory is no setting: runs made before keep their ids
        del key["memory_budget_gb"]  # (a budget sets the micro-batch and the rollout waves: it is in the id)
    if key["adapter"] == "lora":
        del key["adapter"]  # the default: runs made before the setting existed keep their ids
    else:
        del key["lora"]  # a full run has no adapter: its settings change nothing
    if key["optimizer"] == "adamw":
        del key["optimizer"]  # the default: likewise
    return key


def check_train_recipe(recipe: Recipe, store: ArtifactStore) -> None:
    """`run`'s check before its first stage: the train inputs (`check_train_inputs`), the LoRA
    targets and the step against train.memory_budget_gb, from the model's config.json (a GGUF
    file's metadata) when it can be read without work (a hub id offline: build-engine and train
    check it then)."""
    check_train_inputs(recipe)
    if (hf_config := peek_model_config(recipe.model, store)) is not None:
        check_train_model(recipe, hf_config)


def _engine(call: StageCall, dist: Dist) -> Artifact:
    """The engine passed, or the recipe's, which rank 0 alone finds (or builds) and the others load."""
    if call.passed("engine") is not None:
        return call.input("engine")
    found = call.input("engine") if dist.is_main else None
    path = dist.broadcast(found.path if found is not None else None)
    return found if found is not None else load_artifact(path, verify=False)


def _run_config(section: TrainSection, device: torch.device, custom_rewards: list, dist: Dist) -> dict[str, Any]:
    """What names the run: its settings, device, data and reward files by content, and its ranks."""
    config = {"train": train_key(section), "device": device.type}
    for key, spec in (("data_sha256", section.data), ("eval_data_sha256", section.eval_data)):
        if (digest := data_file_key(spec)) is not None:
            config[key] = digest  # an edited file is new data: never a reuse, never a resume
    if rewards := custom_reward_digests(custom_rewards):
        config["custom_rewards_sha256"] = rewards  # an edited reward function is a new run
    if dist.enabled:  # ranks change the floating-point sums (not the method): a run of its own
        config["processes"] = dist.world_size
    return config


@register(STAGE, check=check_train_recipe)
def train_stage(call: StageCall) -> Artifact:
    """Train the recipe's `train` section over the engine (resuming an interrupted run; `force`
    starts it over). Under torchrun every rank calls this; all return the artifact."""
    recipe, section = call.recipe, call.recipe.train
    dist, device_choice = init_distributed(section.device)
    device = pick_device(device_choice)
    problems, eval_problems, custom_rewards = check_train_inputs(recipe, call.passed("engine"))  # before any work
    dist.share(section.prompts_per_step)  # B must split evenly over the ranks
    engine = _engine(call, dist)
    check_engine_for(engine, "train", section.max_new_tokens)
    plan = plan_run(section, engine.path, device, dist)  # over train.memory_budget_gb: refused now
    cfg = train_config(section, plan, fp8_rollout(spec := read_engine_json(engine.path)))
    config = _run_config(section, device, custom_rewards, dist)
    model_name = engine_model_name(engine, call.store) if dist.is_main else ""
    run = RunInputs(call.store, call.force, recipe, engine, model_name, config, cfg, plan, problems, eval_problems,
                    device, dist, spec.get("activations", "bf16"))
    if not dist.is_main:
        return _follow_train(run)
    built: list[Path] = []
    artifact = call.seal(config=config, parents=[engine.id], build=partial(train_in_work_dir, run=run, built=built))
    if not built:
        dist.broadcast((str(artifact.path), None))
        return artifact
    shutil.rmtree(built[0])  # sealed: the artifact holds it all
    dist.broadcast(str(artifact.path))
    log(f"train: {artifact.path}")
    return artifact


def _follow_train(run: RunInputs) -> Artifact:
    """A rank other than 0: train in the run directory rank 0 chose, then return the artifact it sealed.
    Rank 0 raising (say, a locked or damaged store) ends the whole torchrun group: no broadcast here waits forever."""
    existing, run_dir = run.dist.broadcast(None)
    if existing is not None:
        return load_artifact(Path(existing), verify=False)
    run.dist.barrier()
    run_train_job(run, Path(run_dir))
    return load_artifact(Path(run.dist.broadcast(None)), verify=False)
