"""Rewards for completions: correctness, format, and user functions ("module:function"), summed with
weights. Custom names are imported up front, and a custom reward that raises or returns a
non-finite number stops scoring with a RewardError. See docs/rewards.md, section "Rewards"."""

from __future__ import annotations

import importlib
import inspect
import math
from pathlib import Path
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from qerl_pipe.errors import QerlError
from qerl_pipe.rl.task.answers import extract_answer, is_correct, last_boxed
from qerl_pipe.rl.task.tasks import Problem

__all__ = ["RewardError", "RewardSpec", "Scored", "extract_answer", "is_correct", "load_custom_rewards", "score"]

CustomReward = Callable[[str, Problem], float]
EXCERPT_CHARS = 200


class RewardError(QerlError):
    """A custom reward cannot be imported, or failed on a completion."""


@dataclass(frozen=True)
class RewardSpec:
    accuracy: float = 1.0  # weight of the correctness reward (1 if the answer is right, else 0)
    format: float = 0.0  # weight of the format reward (1 if the response has a \boxed{...} answer, else 0)
    custom: tuple[str, ...] = ()  # "module:function" names, each added with weight 1


@dataclass
class Scored:
    rewards: list[float]  # weighted total per completion
    correct: list[bool]  # the accuracy component is > 0 (whatever its weight)
    extracted: list[str | None]  # the answer graded (None: none found)
    components: dict[str, list[float]] = field(default_factory=dict)  # unweighted: "accuracy", "format", custom names


def load_custom_rewards(names: Iterable[str]) -> list[tuple[str, CustomReward]]:
    """Import each "module:function"; a bad name is a RewardError naming it and saying what is wrong."""
    loaded: list[tuple[str, CustomReward]] = []
    for name in names:
        if any(name == seen for seen, _ in loaded):
            raise RewardError(f"custom reward '{name}' is listed twice; list each reward once")
        module_name, sep, attr = name.partition(":")
        if not (sep and module_name and attr):
            raise RewardError(f"custom reward '{name}': write it as 'module:function' (e.g. 'my_rewards:length')")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - ImportError, or whatever the module raises on import
            raise RewardError(f"custom reward '{name}': cannot import module '{module_name}' "
                              f"({type(e).__name__}: {e}); put it on PYTHONPATH or install it") from e
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise RewardError(f"custom reward '{name}': module '{module_name}' has no function '{attr}'")
        loaded.append((name, fn))
    return loaded


def custom_reward_digests(loaded: Iterable[tuple[str, CustomReward]]) -> dict[str, str]:
    """name -> sha256 of the source file defining each custom reward: a run keyed by the name alone
    would be reused (or resumed) after the function was edited, with rewards it never computed."""
    from qerl_pipe.artifacts.manifest import sha256_file

    digests = {}
    for name, fn in loaded:
        try:
            source = inspect.getsourcefile(fn)
        except TypeError:  # a builtin or C function: no source, its module's name is what we have
            source = None
        digests[name] = sha256_file(Path(source)) if source and Path(source).is_file() else "no-source"
    return digests


def _excerpt(completion: str) -> str:
    return repr(completion[:EXCERPT_CHARS]) + ("..." if len(completion) > EXCERPT_CHARS else "")


def _call_custom(name: str, fn: CustomReward, completion: str, problem: Problem) -> float:
    try:
        value = fn(completion, problem)
    except Exception as e:  # noqa: BLE001 - any failure in user code stops the run with context
        raise RewardError(f"custom reward '{name}' raised {type(e).__name__}: {e} on problem {problem.id}, "
                          f"completion {_excerpt(completion)}") from e
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise RewardError(f"custom reward '{name}' returned {value!r}, not a finite number, on problem "
                          f"{problem.id}, completion {_excerpt(completion)}")
    return value


def score(completions: list[str], problems: list[Problem], spec: RewardSpec) -> Scored:
    """Rewards for completions[i] answering problems[i] (repeat each problem for its G samples)."""
    if len(completions) != len(problems):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems: pass one problem per completion")
    custom = load_custom_rewards(spec.custom)
    extracted = [extract_answer(c, p.kind) for c, p in zip(completions, problems)]
    correct = [is_correct(x, p.answer, p.kind) for x, p in zip(extracted, problems)]
    components = {
        "accuracy": [1.0 if ok else 0.0 for ok in correct],
        "format": [1.0 if last_boxed(c) else 0.0 for c in completions],
    }
    for name, fn in custom:
        components[name] = [_call_custom(name, fn, c, p) for c, p in zip(completions, problems)]
    weights = {"accuracy": spec.accuracy, "format": spec.format} | {name: 1.0 for name, _ in custom}
    rewards = [sum(weights[k] * components[k][i] for k in components) for i in range(len(completions))]
    return Scored(rewards=rewards, correct=correct, extracted=extracted, components=components)
