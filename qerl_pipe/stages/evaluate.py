"""`qerl-pipe eval`: accuracy of an engine's model, with or without a LoRA adapter, on a problem set.

Reads an engine artifact (or builds the one the recipe describes for a quantize checkpoint or a
model source), loads a PEFT LoRA adapter onto it (a train run's `adapter/`, or any directory with
adapter_model.safetensors + adapter_config.json), samples k responses per problem (or one greedy
response) through the same engine train uses, and grades each whole extracted answer against the
gold answer (numerically or with math-verify). The artifact (kind `eval`): `report.json`,
`report.md`, `samples.jsonl` (one line per sample). Its parents: the engine, and the adapter's
artifact when it is one.

Everything that can be wrong with the inputs (data file, adapter format, adapter shapes against
the model's config.json, a --model that is no model) is checked before any engine is built or
any weight is read.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact, load_artifact
from qerl_pipe.artifacts.manifest import MANIFEST_NAME, sha256_file
from qerl_pipe.dag import BUILD_ENGINE, EVAL, QUANTIZE, TRAIN, MissingArtifact, find_or_build, recipe_artifact
from qerl_pipe.engine import Engine, SamplingParams
from qerl_pipe.engine.artifact import check_engine_for, load_engine
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.model.peft import (
    ADAPTER_WEIGHTS,
    AdapterFiles,
    check_adapter_fits,
    load_adapter_weights,
    read_adapter,
)
from qerl_pipe.lineage import base_mismatch, engine_model_name
from qerl_pipe.log import log
from qerl_pipe.model.dense_copy import dense_base_copy
from qerl_pipe.model.lora import lora_disabled
from qerl_pipe.recipe import EvalSection, Recipe
from qerl_pipe.rl.evaluate import Graded, generate_and_grade, pass_rates
from qerl_pipe.rl.tasks import Problem, load_problems
from qerl_pipe.sources import ALIASES, resolve_model
from qerl_pipe.hf import load_tokenizer, pick_device
from qerl_pipe.rl.prompts import fit_prompts, stop_token_ids

# Version 2: an arithmetic expression no longer grades as a numeric answer (accuracies made before are not reused).
STAGE = EVAL
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
SAMPLES = "samples.jsonl"
GRADING = ("the whole extracted answer (last complete \\boxed{...}, else the last number for GSM8K-style "
           "tasks) against the whole gold answer: exact decimal comparison for numbers, math-verify otherwise")


# ---------------------------------------------------------------------------- inputs


def check_eval_inputs(recipe: Recipe) -> list[Problem]:
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


@dataclass(frozen=True)
class AdapterInput:
    """The adapter to apply: its checked files, and the artifact holding them when there is one."""

    files: AdapterFiles
    artifact: Artifact | None

    def identity(self) -> dict[str, Any]:
        """What names the adapter in the eval's id: the artifact (its manifest hashes every file),
        or the content of a plain directory (so an edited adapter is never mistaken for the old one)."""
        if self.artifact is not None:
            return {"artifact": self.artifact.id, "subdir": self.files.dir.relative_to(self.artifact.path).as_posix()}
        return {"sha256": self.files.sha256()}


def open_adapter(adapter: Path | Artifact | str, store: ArtifactStore) -> AdapterInput:
    """A train run, any artifact or directory holding a PEFT LoRA adapter (itself or `adapter/`),
    or a store reference (id prefix, directory name) to one."""
    if isinstance(adapter, str):
        path = Path(adapter)
        # A path-like reference is a directory; anything else may name an artifact in the store.
        adapter = path if path.is_dir() or "/" in adapter or adapter.startswith(".") else store.resolve(adapter)
    if isinstance(adapter, Path) and (adapter / MANIFEST_NAME).is_file():
        adapter = load_artifact(adapter)  # an artifact given by path: verified, and it becomes a parent
    if isinstance(adapter, Artifact):
        if adapter.kind in (BUILD_ENGINE.kind, QUANTIZE.kind, EVAL.kind):
            raise ArtifactError(f"{adapter.path} is a '{adapter.kind}' artifact, not an adapter; pass a train run "
                                "(or an exported PEFT adapter) to --adapter")
        if adapter.kind == TRAIN.kind and adapter.manifest["config"]["train"].get("adapter") == "full":
            raise ArtifactError(f"{adapter.path} trained every weight (train.adapter=full) and has no adapter; "
                                f"evaluate its model: `qerl-pipe export --run {adapter.path} --format merged-bf16`, "
                                "then pass that export to --model")
        return AdapterInput(read_adapter(adapter.path), adapter)
    if not adapter.is_dir():
        raise ArtifactError(f"adapter {adapter} does not exist; pass a train run or a directory with "
                            "adapter_model.safetensors + adapter_config.json")
    return AdapterInput(read_adapter(adapter), None)


@dataclass(frozen=True)
class ModelTarget:
    """What --model named, before anything is built: an engine, or what the recipe builds one from."""

    engine: Artifact | None
    quantized: Artifact | None
    recipe: Recipe  # with model.source set when a model source was named
    hf_config: dict[str, Any]
    name: str


def _looks_like_source(ref: str) -> bool:
    return ref in ALIASES or ref.startswith("pkg:") or ref.endswith(".gguf") or "/" in ref


def _model_dir_artifact(artifact: Artifact) -> bool:
    """An artifact that is itself a Hugging Face model directory (an imported GGUF, a merged export)."""
    return (artifact.path / "config.json").is_file() and any(artifact.path.glob("*.safetensors"))


def _source_target(recipe: Recipe, source: str | None, store: ArtifactStore) -> ModelTarget:
    if source is not None:
        recipe = recipe.model_copy(deep=True)
        recipe.model.source = source
    resolved = resolve_model(recipe.model, store)
    return ModelTarget(None, None, recipe, resolved.config, recipe.model.source)


def resolve_model_target(ref: str | Artifact | None, recipe: Recipe, store: ArtifactStore) -> ModelTarget:
    """--model: an engine artifact; a quantize checkpoint or a model source (the recipe's engine
    section builds, or reuses, the engine); None = the recipe's own model. Builds nothing."""
    if ref is None:
        return _source_target(recipe, None, store)
    artifact = ref if isinstance(ref, Artifact) else None
    if isinstance(ref, str):
        path = Path(ref)
        if path.is_dir() and (path / MANIFEST_NAME).is_file():
            artifact = load_artifact(path)
        elif path.is_dir() or _looks_like_source(ref):
            return _source_target(recipe, ref, store)
        else:
            artifact = store.resolve(ref)
    assert artifact is not None
    config_file = artifact.path / "config.json"
    if artifact.kind == BUILD_ENGINE.kind:
        return ModelTarget(artifact, None, recipe, json.loads(config_file.read_text()), engine_model_name(artifact, store))
    if artifact.kind == QUANTIZE.kind:
        return ModelTarget(None, artifact, recipe, json.loads(config_file.read_text()), artifact.path.name)
    if artifact.kind == TRAIN.kind:
        raise ArtifactError(f"{artifact.path} is a train run (an adapter), not a model; pass it to --adapter and "
                            "its engine to --model")
    if _model_dir_artifact(artifact):
        return _source_target(recipe, str(artifact.path), store)
    raise ArtifactError(f"{artifact.path} is a '{artifact.kind}' artifact, not a model; --model takes an engine "
                        "(build-engine), a quantize checkpoint, or a model source")


def build_target_engine(target: ModelTarget, store: ArtifactStore, build_missing: bool = False) -> Artifact:
    """The engine --model names, or the one the recipe builds from the checkpoint or model source it
    names: found in the store, built (with its own missing inputs) only with `build_missing`."""
    if target.engine is not None:
        return target.engine
    made = {"quantize": target.quantized} if target.quantized is not None else {}
    try:
        return recipe_artifact(BUILD_ENGINE.name, target.recipe, store, build=build_missing, made=made)
    except MissingArtifact as exc:
        first = f" (which needs `qerl-pipe {exc.stage}` first)" if exc.stage != BUILD_ENGINE.name else ""
        raise QerlError(f"eval needs an engine for {target.name}, and the recipe's is not in {store.root}: run "
                        f"`qerl-pipe build-engine` with the same recipe and model{first}, pass --model ENGINE, or "
                        "add --build-missing") from None


# ---------------------------------------------------------------------------- the work


def sampling_params(section: EvalSection, stops: tuple[int, ...]) -> SamplingParams:
    if section.greedy:
        return SamplingParams(temperature=0.0, max_new_tokens=section.max_new_tokens, stop_token_ids=stops)
    return SamplingParams(temperature=section.temperature, top_p=section.top_p, top_k=section.top_k,
                          max_new_tokens=section.max_new_tokens, stop_token_ids=stops, seed=section.seed)


def _sampling_key(section: EvalSection) -> dict[str, Any]:
    """The section as it decides the result: sampling knobs are dropped when greedy ignores them,
    and the device is named separately, so equal evaluations share an id."""
    key = section.model_dump(exclude={"device"})
    if section.greedy:
        for unused in ("temperature", "top_p", "top_k"):
            key.pop(unused)
    return key


@torch.no_grad()
def adapter_effect(model: torch.nn.Module, prompt: list[int]) -> float:
    """Max |logit difference| the applied adapter makes on one prompt: a cheap proof, kept in the
    report, that the adapter is really in the forward pass (0 means it changes nothing)."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    with_adapter = model.logits(ids).float()
    with lora_disabled(model):
        base = model.logits(ids).float()
    return float((with_adapter - base).abs().max())


def sample_records(problems: list[Problem], prompt_texts: list[str], graded: Graded) -> list[dict[str, Any]]:
    """One samples.jsonl line per sample, problem-major."""
    records = []
    for i, text in enumerate(graded.texts):
        p = graded.problem_index[i]
        records.append({"problem_id": problems[p].id, "sample": graded.sample_index[i], "prompt": prompt_texts[p],
                        "response": text, "extracted": graded.extracted[i], "gold": problems[p].answer,
                        "correct": graded.correct[i], "finish_reason": graded.finish_reasons[i],
                        "response_tokens": graded.lengths[i]})
    return records


def summarize(section: EvalSection, graded: Graded, skipped: list[Problem]) -> dict[str, Any]:
    """The figures of report.json (pass rates, lengths, truncation, counts)."""
    k = 1 if section.greedy else section.k
    n = max(1, len(graded.texts))
    rates = pass_rates(graded.correct, k)
    problems = len(graded.texts) // k
    return {
        "data": section.data,
        "problems": problems,
        "skipped_problems": len(skipped),
        "skipped_ids": [p.id for p in skipped],
        "samples_per_problem": k,
        "samples": len(graded.texts),
        "correct_samples": sum(graded.correct),
        **rates,
        # Skipped problems (prompt too long for the engine) counted wrong: comparable with evaluations
        # that ran every problem of the set.
        "pass@1_all_problems": rates["pass@1"] * problems / (problems + len(skipped)),
        "no_answer_rate": sum(x is None for x in graded.extracted) / n,
        "response_tokens_mean": sum(graded.lengths) / n,
        "truncation_rate": graded.finish_reasons.count("length") / n,
        "generated_tokens_per_s": sum(graded.lengths) / graded.seconds if graded.seconds > 0 else None,
    }


def _adapter_report(adapter: AdapterInput, delta: float) -> dict[str, Any]:
    spec = adapter.files.spec
    return {
        "applied": True,
        "artifact": adapter.artifact.id if adapter.artifact is not None else None,
        "artifact_kind": adapter.artifact.kind if adapter.artifact is not None else None,
        "dir": str(adapter.files.dir),
        "sha256": adapter.files.sha256(),
        "rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets), "train_norms": spec.train_norms,
        "base_model_name_or_path": adapter.files.config.get("base_model_name_or_path"),
        "logit_max_abs_delta": delta,
    }


def _markdown(report: dict[str, Any]) -> str:
    k = report["samples_per_problem"]
    s = report["sampling"]
    how = "greedy" if s["greedy"] else f"T={s['temperature']}, top-p {s['top_p']}" + (
        f", top-k {s['top_k']}" if s["top_k"] else "")
    adapter = report["adapter"]
    adapter_line = "none (the base model)" if adapter is None else (
        f"{adapter['artifact'] or adapter['dir']} (r={adapter['rank']}, alpha={adapter['alpha']:g}; applied, max "
        f"|logit change| on the first prompt {adapter['logit_max_abs_delta']:.3g})")
    lines = [
        f"# Evaluation: {report['data']}", "",
        f"- model: {report['model']['source']} (engine {report['model']['engine']}, "
        f"{report['model']['base_format']} base)",
        f"- adapter: {adapter_line}",
        f"- decoding: {how}, {k} sample(s) per problem, at most {s['max_new_tokens']} new tokens, seed {s['seed']}",
        f"- grading: {GRADING}", "",
        "| problems | samples | pass@1 | ± s.e. | " + (f"pass@{k} | " if k > 1 else "") + "mean tokens | truncated "
        "| no answer |",
        "|---|---|---|---|" + ("---|" if k > 1 else "") + "---|---|---|",
        f"| {report['problems']} | {report['samples']} | {report['pass@1']:.4f} | {report['pass@1_stderr']:.4f} | "
        + (f"{report[f'pass@{k}']:.4f} | " if k > 1 else "")
        + f"{report['response_tokens_mean']:.1f} | {report['truncation_rate']:.3f} | {report['no_answer_rate']:.3f} |",
        "",
    ]
    if report["skipped_problems"]:
        lines += [f"{report['skipped_problems']} problem(s) were skipped: their prompts do not leave "
                  f"{s['max_new_tokens']} tokens in the engine's max_seq_len (ids in report.json). Counting "
                  f"them wrong, pass@1 is {report['pass@1_all_problems']:.4f}.", ""]
    lines += [f"{report['seconds']} s on {report['device']}.", ""]
    return "\n".join(lines)


def _evaluate(recipe: Recipe, engine: Artifact, adapter: AdapterInput | None, problems: list[Problem],
              device: torch.device, out: Path, model_name: str) -> dict[str, Any]:
    """Generate, grade and write the three files into `out`; returns the manifest summary."""
    section = recipe.eval
    started = time.perf_counter()
    model, limits = load_engine(engine.path, device, lora=adapter.files.spec if adapter else None)
    if adapter is not None:
        load_adapter_weights(model, adapter.files.dir / ADAPTER_WEIGHTS)
    tokenizer = load_tokenizer(engine.path, recipe.model.trust_remote_code)
    kept, prompts, skipped = fit_prompts(tokenizer, problems, section.instruction, limits.max_seq_len,
                                         section.max_new_tokens, "evaluation", STAGE.name)
    sampling = sampling_params(section, stop_token_ids(tokenizer, engine.path))
    k = 1 if section.greedy else section.k
    # CPU: the 4-bit reference matmul dequantizes every weight at every call; one copy for the run.
    with dense_base_copy(model) if device.type == "cpu" else nullcontext():
        delta = adapter_effect(model, prompts[0]) if adapter is not None else None
        if delta == 0.0:
            log("eval: warning: the adapter changes no logit (all lora_B zero?); the result is the base model's")
        log(f"eval: {len(kept)} problems x {k} sample(s) of {section.data} on {device}")
        graded = generate_and_grade(Engine(model, limits), tokenizer, kept, prompts, sampling, n=k)
    prompt_texts = [tokenizer.decode(ids) for ids in prompts]
    records = sample_records(kept, prompt_texts, graded)
    (out / SAMPLES).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    report = {
        **summarize(section, graded, skipped),
        "sampling": {"greedy": section.greedy, "temperature": sampling.temperature, "top_p": sampling.top_p,
                     "top_k": sampling.top_k, "max_new_tokens": sampling.max_new_tokens, "seed": section.seed,
                     "stop_token_ids": list(sampling.stop_token_ids)},
        "instruction": section.instruction,
        "grading": GRADING,
        "model": {"engine": engine.id, "source": model_name, "base_format": engine.summary.get("base_format"),
                  "dtype": engine.summary.get("dtype")},
        "adapter": _adapter_report(adapter, delta) if adapter is not None else None,
        "device": str(device),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2) + "\n")
    (out / REPORT_MD).write_text(_markdown(report))
    log(f"eval: pass@1 {report['pass@1']:.4f} ± {report['pass@1_stderr']:.4f} over {report['problems']} problems "
        f"x {k} sample(s)" + (f", pass@{k} {report[f'pass@{k}']:.4f}" if k > 1 else ""))
    return {"pass@1": report["pass@1"], f"pass@{k}": report[f"pass@{k}"], "problems": report["problems"],
            "samples_per_problem": k, "data": section.data, "engine": engine.id,
            "adapter": report["adapter"]["artifact"] or report["adapter"]["dir"] if adapter else None,
            "device": str(device)}


def run_eval(recipe: Recipe, store: ArtifactStore, *, model: Artifact | str | None = None,
             adapter: Path | Artifact | str | None = None, force: bool = False, build_missing: bool = False,
             find_only: bool = False) -> Artifact:
    """Evaluate the recipe's `eval` section on `model` (an engine artifact, a reference to one, a
    quantize checkpoint or a model source; None = the recipe's engine; an engine that is not in the
    store is built only with `build_missing`) with
    `adapter` applied (a train run, an artifact or directory holding a PEFT LoRA adapter; None =
    the base model). Reuses an up-to-date artifact unless `force`."""
    section = recipe.eval
    device = pick_device(section.device)
    problems = check_eval_inputs(recipe)
    adapter_in = open_adapter(adapter, store) if adapter is not None else None
    target = resolve_model_target(model, recipe, store)
    if adapter_in is not None:  # before an engine is built or a weight read
        check_adapter_fits(adapter_in.files, target.hf_config, target.name)
    engine_art = build_target_engine(target, store, build_missing and not find_only)
    check_engine_for(engine_art, "eval", section.max_new_tokens, "--model")
    if adapter_in is not None and adapter_in.artifact is not None and adapter_in.artifact.kind == TRAIN.kind:
        note = base_mismatch(adapter_in.artifact, engine_art, store)
        if note:
            log(f"eval: {note}")
    config: dict[str, Any] = {"eval": _sampling_key(section), "device": device.type,
                              "adapter": adapter_in.identity() if adapter_in is not None else None}
    if section.data.endswith(".jsonl"):
        config["data_sha256"] = sha256_file(Path(section.data))  # an edited file is new data
    parents = [engine_art.id] + ([adapter_in.artifact.id] if adapter_in and adapter_in.artifact else [])
    def build(pending: PendingArtifact) -> None:
        pending.summary.update(_evaluate(recipe, engine_art, adapter_in, problems, device, pending.dir,
                                         engine_model_name(engine_art, store)))

    artifact = find_or_build(STAGE, store, config=config, parents=parents, build=build, force=force,
                             find_only=find_only)
    log(f"eval: {artifact.path}")
    return artifact
