"""`qerl-pipe eval`: accuracy of an engine's model, with or without a LoRA adapter, on a problem set.

Inputs are resolved by `eval_inputs` and checked before any engine is built or weight read; the
work is `jobs.eval_job`; this module keys the evaluation and seals it.
See docs/eval.md, sections "Inputs" and "The artifact (`eval-<id>/`, kind `eval`)"."""

from __future__ import annotations

from typing import Any

from qerl_pipe.artifacts import Artifact, PendingArtifact
from qerl_pipe.dag import EVAL, TRAIN, register
from qerl_pipe.jobs.engine_artifact import check_engine_for
from qerl_pipe.eval_inputs import build_target_engine, open_adapter, resolve_model_target
from qerl_pipe.hf import pick_device
from qerl_pipe.jobs.eval_job import EngineInfo, run_eval_job
from qerl_pipe.lineage import base_mismatch, engine_model_name
from qerl_pipe.log import log
from qerl_pipe.model.peft import check_adapter_fits
from qerl_pipe.recipe import EvalSection, Recipe
from qerl_pipe.rl.task.tasks import Problem, load_problems
from qerl_pipe.runner import StageCall
from qerl_pipe.userfiles import data_file_key, data_spec_key

STAGE = EVAL


def load_eval_problems(recipe: Recipe) -> list[Problem]:
    """The problems, or the error a bad data spec, file or field gives (before any model work)."""
    section = recipe.eval
    fields: dict[str, Any] = {}
    if section.data.endswith(".jsonl"):
        fields = {"question_field": section.question_field, "answer_field": section.answer_field}
    if section.data.startswith("arithmetic") and recipe.train.data.startswith("arithmetic") \
            and section.seed == recipe.train.seed:
        log(f"eval: warning: arithmetic drawn with eval.seed {section.seed} is the training pool (train.seed "
            f"{recipe.train.seed}); eval.seed={recipe.train.seed + 1} gives the problems train held out")
    return load_problems(section.data, limit=section.limit, seed=section.seed, **fields)


def _sampling_key(section: EvalSection) -> dict[str, Any]:
    """The section as it decides the result: sampling knobs are dropped when greedy ignores them,
    and the device is named separately, so equal evaluations share an id."""
    key = section.model_dump(exclude={"device"}) | {"data": data_spec_key(section.data)}
    if section.greedy:
        for unused in ("temperature", "top_p", "top_k"):
            key.pop(unused)
    return key


@register(STAGE, check=lambda recipe, store: load_eval_problems(recipe))  # `run`'s check before its first stage
def eval_stage(call: StageCall) -> Artifact:
    """Evaluate the recipe's `eval` section on --model (`eval_inputs.resolve_model_target`; None:
    the recipe's engine) with --adapter applied (`eval_inputs.open_adapter`; None: the base model)."""
    recipe, store, section = call.recipe, call.store, call.recipe.eval
    device = pick_device(section.device)
    problems = load_eval_problems(recipe)
    adapter = call.passed("adapter")
    adapter_in = open_adapter(adapter, store) if adapter is not None else None
    target = resolve_model_target(call.passed("model"), call)
    if adapter_in is not None:  # before an engine is built or a weight read
        check_adapter_fits(adapter_in.files, target.hf_config, target.name)
    engine_art = build_target_engine(target, call)
    check_engine_for(engine_art, "eval", section.max_new_tokens)
    if adapter_in is not None and adapter_in.artifact is not None and adapter_in.artifact.kind == TRAIN.kind:
        note = base_mismatch(adapter_in.artifact, engine_art, store)
        if note:
            log(f"eval: {note}")
    config: dict[str, Any] = {"eval": _sampling_key(section), "device": device.type,
                              "adapter": adapter_in.identity() if adapter_in is not None else None}
    data_sha256 = data_file_key(section.data)
    if data_sha256 is not None:
        config["data_sha256"] = data_sha256  # an edited file is new data
    parents = [engine_art.id] + ([adapter_in.artifact.id] if adapter_in and adapter_in.artifact else [])

    def build(pending: PendingArtifact) -> None:
        engine = EngineInfo(engine_art.path, engine_art.id, engine_model_name(engine_art, store),
                            engine_art.summary.get("base_format"), engine_art.summary.get("dtype"))
        pending.summary.update(run_eval_job(section, engine, adapter_in.files if adapter_in else None,
                                               adapter_in.artifact if adapter_in else None, problems, device,
                                               pending.dir, recipe.model.trust_remote_code))

    artifact = call.seal(config=config, parents=parents, build=build)
    log(f"eval: {artifact.path}")
    return artifact
