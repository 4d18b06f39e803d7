"""Accuracy of the current policy (adapter as it is, no AQN noise) through the engine.

`generate_and_grade` is shared by the train job (greedy before/after) and the eval job (greedy, or
average pass@1 over k samples); grading is `rewards.score`. See docs/eval.md, section
"What is measured"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qerl_pipe.engine import Engine, SamplingParams
from qerl_pipe.log import heartbeat
from qerl_pipe.rl.algo.aqn import clear_noise
from qerl_pipe.rl.task.rewards import RewardSpec, score
from qerl_pipe.rl.task.tasks import Problem


@dataclass
class Graded:
    """n samples of each of P problems, prompt-major (problem 0 samples 0..n-1, problem 1, ...)."""

    problem_index: list[int]
    sample_index: list[int]
    texts: list[str]
    extracted: list[str | None]
    correct: list[bool]
    finish_reasons: list[str]
    lengths: list[int]  # generated tokens, a stop token included
    seconds: float


def generate_and_grade(engine: Engine, tokenizer, problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
                       sampling: SamplingParams, n: int = 1) -> Graded:
    """n completions of each prompt, decoded without special tokens and graded against its problem."""
    clear_noise(engine.model)  # an evaluation measures the policy, not a noisy rollout of it
    with heartbeat(f"generating {len(prompts) * n} responses to {len(prompts)} problems"):
        out = engine.generate(prompts, n=n, sampling=sampling)
    texts = tokenizer.batch_decode(out.tokens, skip_special_tokens=True)
    scored = score(texts, [problems[i] for i in out.prompt_index], RewardSpec(accuracy=1.0))
    return Graded(out.prompt_index, out.sample_index, texts, scored.extracted, scored.correct,
                  out.finish_reasons, out.lengths, out.prefill_seconds + out.decode_seconds)


def pass_rates(correct: Sequence[bool], n: int) -> dict[str, float]:
    """pass@1 = mean over problems of c_i / n (unbiased from n samples, Chen et al. 2021), its
    standard error over problems (what limits telling two evaluations apart), and pass@n = share of
    problems with a correct sample."""
    if n < 1 or len(correct) % n:
        raise ValueError(f"{len(correct)} samples are not a whole number of problems of {n} samples")
    per_problem = [sum(correct[i:i + n]) / n for i in range(0, len(correct), n)]
    count = len(per_problem)
    if count == 0:
        return {"pass@1": 0.0, "pass@1_stderr": 0.0, f"pass@{n}": 0.0}
    mean = sum(per_problem) / count
    var = sum((p - mean) ** 2 for p in per_problem) / (count - 1) if count > 1 else 0.0
    return {"pass@1": mean, "pass@1_stderr": math.sqrt(var / count),
            f"pass@{n}": sum(p > 0 for p in per_problem) / count}


@dataclass
class GreedyAccuracy:
    accuracy: float
    correct: int
    total: int
    response_length_mean: float
    truncation_rate: float
    samples: list[dict[str, Any]] = field(default_factory=list)  # one per problem

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "samples"}


def greedy_accuracy(engine: Engine, tokenizer, problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
                max_new_tokens: int, stop_token_ids: tuple[int, ...]) -> GreedyAccuracy:
    """Greedy completions of `prompts`, graded for correctness against `problems`."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    g = generate_and_grade(engine, tokenizer, problems, prompts, params)
    n = max(1, len(problems))
    samples = [{"id": p.id, "question": p.question, "answer": p.answer, "completion": t, "extracted": x,
                "correct": ok, "finish_reason": f}
               for p, t, x, ok, f in zip(problems, g.texts, g.extracted, g.correct, g.finish_reasons)]
    return GreedyAccuracy(accuracy=sum(g.correct) / n, correct=sum(g.correct), total=len(problems),
                          response_length_mean=sum(g.lengths) / n,
                          truncation_rate=g.finish_reasons.count("length") / n, samples=samples)
