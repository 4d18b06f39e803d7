"""Problems to train and evaluate on, and the prompts the policy sees.

A `Problem` is a question and its gold final answer: packaged GSM8K / MATH-500, generated additions,
or a user .jsonl file, all checked while loading. See docs/rewards.md, sections "Tasks" and "Prompts"."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from qerl_pipe.errors import QerlError
from qerl_pipe.textdata import PACKAGED, packaged_path
from qerl_pipe.userfiles import read_jsonl_objects


class TaskError(QerlError):
    """A problem set cannot be loaded: unknown spec, missing file, missing field, or nothing in it."""


@dataclass(frozen=True)
class Problem:
    id: str  # stable across runs: "<spec>:<row>", "arithmetic:<seed>:<i>", "addition:<split>:<i>", "<file name>:<row>"
    question: str
    answer: str  # gold final answer (GSM8K: the number after '####', commas removed)
    kind: str  # "gsm8k" | "math" | "arithmetic" | "jsonl"


ARITHMETIC_DEFAULT_N = 1000
# One-digit additions: the 81 questions "What is a + b?" (a, b in 1..9), shuffled once with a fixed
# seed; the first ADDITION_HELD_OUT are 'addition:test', the rest 'addition:train'. The split never
# depends on a recipe's seed, so a training pool and an evaluation of this task are always disjoint.
ADDITION_SPLITS = ("addition:train", "addition:test")
ADDITION_HELD_OUT = 32
_ADDITION_SHUFFLE_SEED = 123

_BOXED = "Let's think step by step and output the final answer within \\boxed{}."
DEFAULT_INSTRUCTIONS: dict[str, str] = {"gsm8k": _BOXED, "math": _BOXED, "jsonl": _BOXED,
                                        "arithmetic": "Put the answer in \\boxed{}."}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def load_problems(spec: str, *, limit: int | None = None, seed: int = 0,
                  question_field: str | None = None, answer_field: str | None = None) -> list[Problem]:
    """Problems from a spec: 'gsm8k:train|test', 'math500:test', 'arithmetic[:N]', 'addition:train|test'
    or a .jsonl path; `limit`: the first N (arithmetic: how many to generate); `seed`: arithmetic's
    generator only; `question_field` / `answer_field` rename the fields read. A GSM8K-style answer
    keeps the text after the last '####' (thousands commas dropped from a number). docs/rewards.md."""
    if limit is not None and limit < 1:
        raise TaskError(f"problem limit {limit}: must be at least 1 (or unset for all)")
    if spec == "arithmetic" or spec.startswith("arithmetic:"):
        return _arithmetic(spec, limit, seed)
    if spec in ADDITION_SPLITS:
        return addition(spec)[:limit]
    if spec in PACKAGED:
        rel, q_default, a_default, kind = PACKAGED[spec]
        path, prefix = packaged_path(rel), spec
    else:
        path = Path(spec)
        if path.suffix != ".jsonl":
            raise TaskError(f"problem set '{spec}': expected one of {', '.join((*PACKAGED, *ADDITION_SPLITS))}, "
                            "'arithmetic[:N]', or a path to a .jsonl file")
        if not path.is_file():
            raise TaskError(f"problem file {path} does not exist; give an existing .jsonl path or one of "
                            f"{', '.join(PACKAGED)}")
        q_default, a_default, kind, prefix = "question", "answer", "jsonl", path.name
    problems = _read_jsonl(path, prefix, kind, question_field or q_default, answer_field or a_default, limit)
    if not problems:
        raise TaskError(f"problem file {path} holds no problems; it needs one JSON object per line")
    return problems


def _read_jsonl(path: Path, prefix: str, kind: str, q_field: str, a_field: str, limit: int | None) -> list[Problem]:
    problems: list[Problem] = []
    # Every line is checked, also past `limit`: a malformed line is an error whatever the limit,
    # so a file that passes with `limit` set passes without it.
    for lineno, row in read_jsonl_objects(path, "problem file", TaskError):
        for field, option in ((q_field, "question_field"), (a_field, "answer_field")):
            if row.get(field) is None:
                raise TaskError(f"{path}:{lineno}: no field '{field}' (fields: {', '.join(row) or 'none'}); "
                                f"set {option} to the field that holds it")
        answer = _gold(str(row[a_field]), kind)
        if not answer:
            raise TaskError(f"{path}:{lineno}: empty answer in field '{a_field}'"
                            + (" (a GSM8K answer must end with '#### <number>')" if kind == "gsm8k" else ""))
        if limit is None or len(problems) < limit:
            problems.append(Problem(f"{prefix}:{len(problems)}", str(row[q_field]), answer, kind))
    return problems


def _gold(raw: str, kind: str) -> str:
    """The final answer in a gold field: GSM8K solutions end in '#### <answer>'; others are the answer."""
    if kind == "gsm8k" and "####" not in raw:
        return ""
    answer = raw.rsplit("####", 1)[-1].strip() if "####" in raw else raw.strip()
    plain = answer.replace(",", "")
    return plain if _NUMBER.fullmatch(plain) else answer


def _arithmetic(spec: str, limit: int | None, seed: int) -> list[Problem]:
    """'What is a + b?' with a, b uniform in 10..99, the same list for the same seed (a prefix for a smaller N)."""
    _, _, count = spec.partition(":")
    if count and not (count.isdigit() and int(count) > 0):
        raise TaskError(f"problem set '{spec}': write 'arithmetic' or 'arithmetic:N' with N a positive integer")
    n = int(count) if count else ARITHMETIC_DEFAULT_N
    if limit is not None:
        n = min(n, limit)
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
    return [Problem(f"arithmetic:{seed}:{i}", f"What is {a} + {b}?", str(a + b), "arithmetic")
            for i, (a, b) in enumerate(pairs)]


def addition(spec: str) -> list[Problem]:
    """'addition:train' (49 questions) or 'addition:test' (the 32 others): "What is a + b?" with a, b
    in 1..9, in the fixed shuffled order (the same on every machine and for every seed)."""
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(_ADDITION_SHUFFLE_SEED).shuffle(pairs)
    split = spec.partition(":")[2]
    chosen = pairs[:ADDITION_HELD_OUT] if split == "test" else pairs[ADDITION_HELD_OUT:]
    return [Problem(f"{spec}:{i}", f"What is {a} + {b}?", str(a + b), "arithmetic") for i, (a, b) in enumerate(chosen)]


def render_prompt(tokenizer, problem: Problem, instruction: str | None = None) -> list[int]:
    """Token ids of the prompt for one problem, ending where the answer starts: the question, a
    newline and the instruction (DEFAULT_INSTRUCTIONS[kind] when None; "" adds none), through the
    chat template with add_generation_prompt=True where there is one, else the plain text
    f"{question}\\n{instruction}\\n" with the tokenizer's special tokens (base models)."""
    if instruction is None:
        instruction = DEFAULT_INSTRUCTIONS.get(problem.kind, _BOXED)
    content = f"{problem.question}\n{instruction}" if instruction else problem.question
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                            add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding here; 4.x returns the ids.
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(i) for i in ids]
    return list(tokenizer(content + "\n", add_special_tokens=True)["input_ids"])
