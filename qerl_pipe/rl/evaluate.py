"""Greedy accuracy of the current policy (adapter as it is, no AQN noise) through the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qerl_pipe.engine import Engine, SamplingParams
from qerl_pipe.rl.aqn import clear_noise
from qerl_pipe.rl.rewards import RewardSpec, score
from qerl_pipe.rl.tasks import Problem


@dataclass
class EvalResult:
    accuracy: float
    correct: int
    total: int
    response_length_mean: float
    truncation_rate: float
    samples: list[dict[str, Any]] = field(default_factory=list)  # one per problem

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "samples"}


def greedy_eval(engine: Engine, tokenizer, problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
                max_new_tokens: int, stop_token_ids: tuple[int, ...]) -> EvalResult:
    """Greedy completions of `prompts`, graded for correctness against `problems`."""
    clear_noise(engine.model)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    out = engine.generate(prompts, n=1, sampling=params)
    texts = tokenizer.batch_decode(out.tokens, skip_special_tokens=True)
    scored = score(texts, list(problems), RewardSpec(accuracy=1.0))
    n = max(1, len(problems))
    samples = [{"id": p.id, "question": p.question, "answer": p.answer, "completion": t, "extracted": x,
                "correct": ok, "finish_reason": f}
               for p, t, x, ok, f in zip(problems, texts, scored.extracted, scored.correct, out.finish_reasons)]
    return EvalResult(
        accuracy=sum(scored.correct) / n,
        correct=sum(scored.correct),
        total=len(problems),
        response_length_mean=sum(out.lengths) / n,
        truncation_rate=out.finish_reasons.count("length") / n,
        samples=samples,
    )
