"""`qerl-pipe train`: GRPO/DAPO of a LoRA adapter over an engine's frozen base (or, with
`train.adapter: full`, of every weight of a bf16 base), with AQN.

Reads an engine artifact (`--engine`, else the recipe's, found in the store), trains in a work
directory that is stable for the run's id, `<store>/.runs/train-<id>/`, so that a killed run
started again with the same inputs resumes from its last checkpoint. When the last step is done
it evaluates, exports the adapter, and the whole work directory becomes the artifact (hard links
into the store's pending directory, sealed by its manifest; the work directory is removed after).
What happens inside the work directory, and its layout, is `rl.run`; this module keys the run,
finds its engine, plans its step to `train.memory_budget_gb` (`rl.run.plan_run`, before any
work) and seals the result (plus `run.json`, which holds the plan).

Under torchrun (WORLD_SIZE > 1) every rank trains (rl/distributed.py); rank 0 alone resolves the
engine, holds the store's lock, evaluates and writes the artifact, and tells the other ranks the
run directory and the result, so they all agree on one run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact, load_artifact
from qerl_pipe.artifacts.store import link_tree
from qerl_pipe.dag import TRAIN, find_or_build, input_artifact
from qerl_pipe.engine.artifact import check_engine_for
from qerl_pipe.hf import pick_device
from qerl_pipe.lineage import engine_model_name
from qerl_pipe.log import log
from qerl_pipe.memory.plan import MemoryPlan
from qerl_pipe.memory.preflight import check_recipe_step
from qerl_pipe.memwatch import return_freed_tensors_to_os
from qerl_pipe.recipe import Recipe, TrainSection
from qerl_pipe.rl.distributed import Dist, init_distributed
from qerl_pipe.rl.rewards import custom_reward_digests
from qerl_pipe.rl.run import check_train_inputs, plan_run, train_run
from qerl_pipe.rl.tasks import Problem
from qerl_pipe.strict_json import write_json
from qerl_pipe.userfiles import data_file_key, data_spec_key, resumable_on_full_disk

# Version 2: an arithmetic expression no longer grades as a numeric answer (runs made before are not reused).
STAGE = TRAIN
RUN_FILE = "run.json"


def train_key(section: TrainSection) -> dict[str, Any]:
    """The train section as the run's id sees it."""
    key = section.model_dump()
    key["data"], key["eval_data"] = data_spec_key(section.data), data_spec_key(section.eval_data)
    if key["memory_budget_gb"] is None:
        # Planned to the GPU's free memory, which is no setting (runs made before keep their ids). A
        # budget sets the micro-batch and the rollout waves (the adapter's bits) and run.json's plan.
        del key["memory_budget_gb"]
    if key["adapter"] == "lora":
        del key["adapter"]  # the default: runs made before the setting existed keep their ids
    else:
        del key["lora"]  # a full run has no adapter: its settings change nothing
    return key


def run_dir_for(store: ArtifactStore, art_id: str) -> Path:
    return store.work_dir_for(STAGE.name, art_id)


def check_train_recipe(recipe: Recipe, store: ArtifactStore) -> None:
    """`run`'s check before its first stage: the train inputs (`check_train_inputs`) and the step
    against train.memory_budget_gb, from the model's config.json alone (`memory.preflight`)."""
    check_train_inputs(recipe)
    check_recipe_step(recipe, store)


def run_train(recipe: Recipe, store: ArtifactStore, *, engine: Artifact | None = None, force: bool = False,
              build_missing: bool = False, find_only: bool = False) -> Artifact:
    """Train the recipe's `train` section over `engine` (default: the recipe's engine, found in the
    store; built only with `build_missing`).

    An interrupted run with the same inputs is resumed from its last checkpoint; `force` starts it
    over (and redoes a finished one). Under torchrun every rank calls this; all return the artifact.
    """
    section = recipe.train
    dist, device_choice = init_distributed(section.device)
    device = pick_device(device_choice)
    problems, eval_problems, custom_rewards = check_train_inputs(recipe, engine)  # before any model work
    dist.share(section.prompts_per_step)  # B must split evenly over the ranks
    if engine is None:  # rank 0 finds (or builds) it; the others load what it found
        found = input_artifact(STAGE.name, "--engine", recipe, store, build_missing=build_missing,
                               find_only=find_only) if dist.is_main else None
        path = dist.broadcast(found.path if found is not None else None)
        engine = found if found is not None else load_artifact(path, verify=False)
    check_engine_for(engine, "train", section.max_new_tokens, "--engine")
    plan = plan_run(section, engine.path, device, dist)  # over train.memory_budget_gb: refused now
    config = {"train": train_key(section), "device": device.type}
    for key, spec in (("data_sha256", section.data), ("eval_data_sha256", section.eval_data)):
        digest = data_file_key(spec)
        if digest is not None:
            config[key] = digest  # an edited file is new data: never a reuse, never a resume
    rewards = custom_reward_digests(custom_rewards)
    if rewards:
        config["custom_rewards_sha256"] = rewards  # an edited reward function is a new run
    if dist.enabled:  # ranks change the floating-point sums (not the method): a run of its own
        config["processes"] = dist.world_size
    return_freed_tensors_to_os()  # as quantize: a CPU train grew its heap 55% past its plan without it
    if not dist.is_main:
        return _follow_train(recipe, section, engine, problems, eval_problems, device, plan, dist)
    built: list[Path] = []

    def build(pending: PendingArtifact) -> None:
        run_dir = run_dir_for(store, pending.id)
        dist.broadcast((None, str(run_dir)))
        if force and run_dir.exists():
            shutil.rmtree(run_dir)
        with resumable_on_full_disk(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            run = {"id": pending.id, "engine": engine.id, **config, "memory_plan": plan.to_json()}
            write_json(run_dir / RUN_FILE, run)
            dist.barrier()  # the run directory is ready (and an old one cleared) before any rank reads it
            summary = train_run(section, engine.path, problems, eval_problems, device, run_dir,
                                engine_model_name(engine, store), recipe.model.trust_remote_code, dist, plan)
            link_tree(run_dir, pending.dir)
        pending.summary.update(summary)
        built.append(run_dir)

    artifact = find_or_build(STAGE, store, config=config, parents=[engine.id], build=build, force=force,
                             find_only=find_only)
    if not built:
        dist.broadcast((str(artifact.path), None))
        return artifact
    shutil.rmtree(built[0])  # sealed: the artifact holds it all
    dist.broadcast(str(artifact.path))
    log(f"train: {artifact.path}")
    return artifact


def _follow_train(recipe: Recipe, section: TrainSection, engine: Artifact, problems: list[Problem],
                  eval_problems: list[Problem], device: torch.device, plan: MemoryPlan, dist: Dist) -> Artifact:
    """A rank other than 0: train in the run directory rank 0 chose, then return the artifact it sealed.

    Rank 0 raising (say, a locked or damaged store) ends the whole torchrun group, so the
    broadcasts here never wait for nothing.
    """
    existing, run_dir = dist.broadcast(None)
    if existing is not None:
        return load_artifact(Path(existing), verify=False)
    dist.barrier()
    train_run(section, engine.path, problems, eval_problems, device, Path(run_dir), "",
              recipe.model.trust_remote_code, dist, plan)
    return load_artifact(Path(dist.broadcast(None)), verify=False)
