"""Final answers: pulling one out of a completion, and grading it against the gold answer.

Extraction: the last complete \\boxed{...} (balanced braces); else, for gsm8k / arithmetic / jsonl,
the last number in the text; else None. Grading: an exact numeric comparison when both sides are
plain numbers, else math-verify (https://github.com/huggingface/Math-Verify) on both sides, which
knows that \\frac{1}{2} = 0.5, that (3, \\pi/2) = \\left( 3, \\frac{\\pi}{2} \\right), and so on.
Against a numeric gold answer, an arithmetic expression (27 + 82, 2^{10}) is wrong: math-verify
would evaluate it, and a policy learns to copy the question into the box (seen in training).
"""

from __future__ import annotations

import logging
import re
import threading
from decimal import Decimal, InvalidOperation

log = logging.getLogger(__name__)

NUMBER_FALLBACK_KINDS = frozenset({"gsm8k", "arithmetic", "jsonl"})
MAX_ANSWER_CHARS = 1000  # longer "answers" are degenerate generations; sympy could spend minutes on them
MATH_VERIFY_TIMEOUT_S = 5  # per parse / per comparison, main thread only (see _timeout_s)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A minus sign only where it cannot be a binary minus ("3-5" gives 5, "= -5" gives -5); thousands
# commas only in groups of three, so "3, 4" is two numbers.
_TEXT_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
# Decorations around a number that do not change it: "\$18", "$-5$", "\!", and LaTeX thousands
# separators "1{,}000", "1\,000" (plain "1,000" is handled by _THOUSANDS, so "3,4" stays a pair).
_NUMBER_NOISE = re.compile(r"\\\$|\$|\\!|\\,|\{,\}")
# Two numbers joined by an arithmetic operator: "27 + 82", "(27) - (82)", "2^{10}", "3 \\times 4".
# Fractions (a/b, \\frac{a}{b}) are a way to state a value and are not matched.
_ARITHMETIC = re.compile(r"\d[\s)}\]]*(?:[-+*^×÷−]|\\times|\\cdot|\\div|\\ast)[\s({\[]*\d")


def last_boxed(text: str) -> str | None:
    """The content of the last complete \\boxed{...} (or \\fbox{...}); None if there is none.

    A \\boxed{ left open (a truncated completion) is skipped in favour of an earlier complete one.
    """
    for m in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number written in the text, commas removed ('The answer is 1,234.' gives '1234')."""
    found = _TEXT_NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_answer(completion: str, kind: str) -> str | None:
    """The answer to grade: the last \\boxed{} content, else (not for 'math') the last number, else None."""
    boxed = last_boxed(completion)
    if boxed:
        return boxed
    if kind in NUMBER_FALLBACK_KINDS:
        return last_number(completion)
    return None


def _as_number(text: str) -> Decimal | None:
    cleaned = _NUMBER_NOISE.sub("", text).strip().rstrip(".")
    if _THOUSANDS.fullmatch(cleaned):
        cleaned = cleaned.replace(",", "")
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def _timeout_s() -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread and raises
    # ValueError elsewhere; off the main thread we pass None (no timeout) so grading works from any
    # thread, and MAX_ANSWER_CHARS keeps inputs small.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _math_verify(extracted: str, gold: str) -> bool:
    """math-verify on both sides; False (logged at debug) on anything it cannot parse or compare."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException  # a BaseException, not an Exception

    timeout = _timeout_s()
    try:
        # Both sides are bare answers; boxing them makes math-verify's LaTeX extraction take the whole string.
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
        pred_parsed = parse(f"\\boxed{{{extracted}}}", parsing_timeout=timeout)
        return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except (Exception, TimeoutException):  # noqa: BLE001 - a grader must not stop a training run
        log.debug("math-verify failed on %r vs gold %r; graded wrong", extracted[:200], gold, exc_info=True)
        return False


def _is_arithmetic(answer: str) -> bool:
    """Whether the answer's final value (after its last '=') is an arithmetic expression of
    numbers rather than a number: "(27 + 82)" and "2^{10}" are, "27 + 82 = 109" and "30^\\circ" are not."""
    return _ARITHMETIC.search(answer.rsplit("=", 1)[-1]) is not None


def is_correct(extracted: str | None, gold: str, kind: str) -> bool:
    """Whether the extracted answer equals the gold one; never raises (what math-verify cannot
    handle, or a timeout, counts as wrong). `kind` is there for kind-specific rules; all kinds are
    graded alike today: an exact decimal comparison when both are plain numbers (72 == 72.0,
    "1,234" == 1234); against a numeric gold, an arithmetic expression is wrong; else math-verify."""
    if extracted is None or not extracted.strip() or len(extracted) > MAX_ANSWER_CHARS:
        return False
    pred_num, gold_num = _as_number(extracted), _as_number(gold)
    if pred_num is not None and gold_num is not None:
        return pred_num == gold_num
    if gold_num is not None and _is_arithmetic(extracted):
        return False
    return _math_verify(extracted, gold)
