"""One evaluation of an engine (with a PEFT adapter applied, or the base alone): sample k responses
per problem (or one greedy response) through the same engine train uses, grade each, and write
`samples.jsonl` (one line per sample), `report.json` and `report.md`. The eval stage resolves
what it is pointed at, keys the artifact and seals what this writes."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact
from qerl_pipe.engine import Engine, SamplingParams
from qerl_pipe.jobs.engine_artifact import load_engine
from qerl_pipe.hf import load_tokenizer
from qerl_pipe.log import log
from qerl_pipe.model.dense_copy import dense_base_copy
from qerl_pipe.model.lora import lora_disabled
from qerl_pipe.model.peft import ADAPTER_WEIGHTS, AdapterFiles, load_adapter_weights
from qerl_pipe.recipe import EvalSection
from qerl_pipe.rl.loop.accuracy import Graded, generate_and_grade, pass_rates
from qerl_pipe.rl.task.prompts import fit_prompts, stop_token_ids
from qerl_pipe.rl.task.tasks import Problem
from qerl_pipe.strict_json import dumps, write_json

SECTION = "eval"  # the recipe section, named in messages
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
SAMPLES = "samples.jsonl"
GRADING = ("the whole extracted answer (last complete \\boxed{...}, else the last number for GSM8K-style "
           "tasks) against the whole gold answer: exact decimal comparison for numbers, math-verify otherwise")


@dataclass(frozen=True)
class EngineInfo:
    """The engine evaluated: its directory and what the report says of it."""

    dir: Path
    id: str
    model_name: str  # the model it was made from, as the recipe named it
    base_format: str | None
    dtype: str | None


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
    return [{"problem_id": problems[p].id, "sample": graded.sample_index[i], "prompt": prompt_texts[p],
             "response": text, "extracted": graded.extracted[i], "gold": problems[p].answer,
             "correct": graded.correct[i], "finish_reason": graded.finish_reasons[i],
             "response_tokens": graded.lengths[i]}
            for i, (text, p) in enumerate(zip(graded.texts, graded.problem_index))]


def summarize(section: EvalSection, graded: Graded, skipped: list[Problem]) -> dict[str, Any]:
    """The figures of report.json (pass rates, lengths, truncation, counts)."""
    k = 1 if section.greedy else section.k
    n = max(1, len(graded.texts))
    rates = pass_rates(graded.correct, k)
    problems = len(graded.texts) // k
    return {
        "data": section.data, "problems": problems, "skipped_problems": len(skipped),
        "skipped_ids": [p.id for p in skipped], "samples_per_problem": k, "samples": len(graded.texts),
        "correct_samples": sum(graded.correct), **rates,
        # Skipped problems (prompt too long for the engine) counted wrong: comparable with evaluations
        # that ran every problem of the set.
        "pass@1_all_problems": rates["pass@1"] * problems / (problems + len(skipped)),
        "no_answer_rate": sum(x is None for x in graded.extracted) / n,
        "response_tokens_mean": sum(graded.lengths) / n,
        "truncation_rate": graded.finish_reasons.count("length") / n,
        "generated_tokens_per_s": sum(graded.lengths) / graded.seconds if graded.seconds > 0 else None,
    }


def _adapter_report(adapter: AdapterFiles, artifact: Artifact | None, delta: float) -> dict[str, Any]:
    spec = adapter.spec
    return {
        "applied": True, "artifact": artifact.id if artifact is not None else None,
        "artifact_kind": artifact.kind if artifact is not None else None, "dir": str(adapter.dir),
        "sha256": adapter.sha256, "rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets),
        "train_norms": spec.train_norms, "experts": spec.experts,
        "base_model_name_or_path": adapter.config.get("base_model_name_or_path"), "logit_max_abs_delta": delta,
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


def run_eval_job(section: EvalSection, engine: EngineInfo, adapter: AdapterFiles | None,
                 adapter_artifact: Artifact | None, problems: list[Problem], device: torch.device, out: Path,
                 trust_remote_code: bool = False) -> dict[str, Any]:
    """Generate, grade and write the three files into `out`; returns the manifest summary.
    `adapter_artifact` is the artifact holding `adapter`, when it is one (named in the report)."""
    started = time.perf_counter()
    model, limits = load_engine(engine.dir, device, lora=adapter.spec if adapter else None)
    if adapter is not None:
        load_adapter_weights(model, adapter.dir / ADAPTER_WEIGHTS)
    tokenizer = load_tokenizer(engine.dir, trust_remote_code)
    kept, prompts, skipped = fit_prompts(tokenizer, problems, section.instruction, limits.max_seq_len,
                                         section.max_new_tokens, "evaluation", SECTION)
    stops = stop_token_ids(tokenizer, engine.dir)
    sampling = (SamplingParams(temperature=0.0, max_new_tokens=section.max_new_tokens, stop_token_ids=stops)
                if section.greedy else
                SamplingParams(temperature=section.temperature, top_p=section.top_p, top_k=section.top_k,
                               max_new_tokens=section.max_new_tokens, stop_token_ids=stops, seed=section.seed))
    k = 1 if section.greedy else section.k
    # CPU: the 4-bit reference matmul dequantizes every weight at every call; one copy for the run.
    with dense_base_copy(model) if device.type == "cpu" else nullcontext():
        delta = adapter_effect(model, prompts[0]) if adapter is not None else None
        if delta == 0.0:
            log("eval: warning: the adapter changes no logit (all lora_B zero?); the result is the base model's")
        log(f"eval: {len(kept)} problems x {k} sample(s) of {section.data} on {device}")
        graded = generate_and_grade(Engine(model, limits), tokenizer, kept, prompts, sampling, n=k)
    records = sample_records(kept, [tokenizer.decode(ids) for ids in prompts], graded)
    (out / SAMPLES).write_text("".join(dumps(r, ensure_ascii=False) + "\n" for r in records))
    report = {
        **summarize(section, graded, skipped),
        "sampling": {"greedy": section.greedy, "temperature": sampling.temperature, "top_p": sampling.top_p,
                     "top_k": sampling.top_k, "max_new_tokens": sampling.max_new_tokens, "seed": section.seed,
                     "stop_token_ids": list(sampling.stop_token_ids)},
        "instruction": section.instruction, "grading": GRADING,
        "model": {"engine": engine.id, "source": engine.model_name, "base_format": engine.base_format,
                  "dtype": engine.dtype},
        "adapter": _adapter_report(adapter, adapter_artifact, delta) if adapter is not None else None,
        "device": str(device), "seconds": round(time.perf_counter() - started, 1),
    }
    write_json(out / REPORT_JSON, report)
    (out / REPORT_MD).write_text(_markdown(report))
    log(f"eval: pass@1 {report['pass@1']:.4f} ± {report['pass@1_stderr']:.4f} over {report['problems']} problems "
        f"x {k} sample(s)" + (f", pass@{k} {report[f'pass@{k}']:.4f}" if k > 1 else ""))
    return {"pass@1": report["pass@1"], f"pass@{k}": report[f"pass@{k}"], "problems": report["problems"],
            "samples_per_problem": k, "data": section.data, "engine": engine.id,
            "adapter": report["adapter"]["artifact"] or report["adapter"]["dir"] if adapter else None,
            "device": str(device)}
