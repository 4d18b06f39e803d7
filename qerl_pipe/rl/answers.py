"""Final answers: pulling one out of a completion, and grading it against the gold answer.

Extraction: the last complete \\boxed{...} (balanced braces); else, for gsm8k / arithmetic / jsonl,
the last number in the text; else None. Grading: where the gold states a number (42, -\\frac{1}{2},
30^\\circ, 18 \\text{ dollars}), the answer must state one too, compared exactly as decimals, or by
math-verify (https://github.com/huggingface/Math-Verify) for fractions and the scientific form. An
expression (27 + 82, 2^{10}, \\sqrt{144}) is wrong there, though math-verify would evaluate it: a
policy learned to copy the question into the box. Other golds (\\sqrt{2}, tuples, intervals) go to
math-verify whole, which knows that (3, \\pi/2) = \\left( 3, \\frac{\\pi}{2} \\right), and so on.
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
# LaTeX thousands separators, made plain commas: "1{,}000", "1\\,000", "32,\\!348".
_LATEX_THOUSANDS = re.compile(r"\{,\}|(?<=\d)\\,(?=\d{3}(?!\d))|\\!")
# What may surround a stated number without changing it: LaTeX spacing, \\left / \\right, dollar
# signs, degree and percent signs.
_DECORATION = re.compile(r"\\left|\\right|\\[,;: ]|\\q?quad|~|\\\$|\$|\^\s*\{?\s*\\circ\s*\}?|°|\\?%")
# Text wrappers, replaced by their content after a space: "\\text{cm}" -> " cm", "\\mathbf{5}" -> " 5".
_WRAPPER = re.compile(r"\\(?:text|textrm|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_NUM = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
# One number: plain, a fraction, or scientific; in parentheses or not; then unit words, each after a
# space ("5 cm^2", "5 m/s"; "2k" and "5r^5" are products, not units).
_STATED = re.compile(
    rf"\(?\s*(?P<value>[-+]?\s*(?:\\[dt]?frac\s*(?:\{{\s*-?{_NUM}\s*\}}|\d)\s*(?:\{{\s*{_NUM}\s*\}}|\d)"
    rf"|{_NUM}\s*/\s*{_NUM}"
    rf"|{_NUM}\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*(?:\{{\s*-?\d+\s*\}}|\d)"
    rf"|{_NUM}))\s*\)?"
    r"(?:\s+[A-Za-z]+(?:\^\{?\d\}?)?(?:/[A-Za-z]+(?:\^\{?\d\}?)?)?)*\s*\.?")
_RELATION = re.compile(r"=|\\approx|≈|\\equiv")
_NAME = re.compile(r"[A-Za-z]\w*")  # "x" in "x = 5"
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")


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
    """A plain decimal number ("-5", "72.0", "1,234"; thousands commas in groups of three), else None."""
    cleaned = text.replace(",", "") if _THOUSANDS.fullmatch(text) else text
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


def _undecorated(text: str) -> str:
    """The text without what may surround a number: wrappers kept as their content, LaTeX thousands
    separators as commas, spacing, \\left/\\right, dollar, degree and percent signs."""
    while (unwrapped := _WRAPPER.sub(r" \1", text)) != text:
        text = unwrapped
    text = _LATEX_THOUSANDS.sub(lambda m: "" if m.group() == "\\!" else ",", text)
    return _DECORATION.sub(" ", text).strip()


def stated_number(answer: str) -> str | None:
    """The number an answer states, without its decorations: "18" from "\\$18", "18 \\text{ dollars}"
    or "x = 18"; "-\\frac{1}{2}"; "1.5 \\times 10^{3}". In a relation, the last side that states one,
    when each other side is a name ("x") or has no letters ("27 + 82 = 109"). None for anything else:
    an expression ("(27 + 82)", "2^{10}", "\\sqrt{144}", "5!", "2k"), an equation, no number."""
    sides = [_undecorated(side) for side in _RELATION.split(answer.replace("−", "-"))]
    for i in reversed(range(len(sides))):
        m = _STATED.fullmatch(sides[i])
        if m is None:
            continue
        others = sides[:i] + sides[i + 1:]
        if all(_NAME.fullmatch(o) or not re.search("[A-Za-z]", _LATEX_COMMAND.sub("", o)) for o in others):
            return re.sub(r"^([-+])\s+", r"\1", m.group("value").strip())
        return None
    return None


def is_correct(extracted: str | None, gold: str, kind: str) -> bool:
    """Whether the extracted answer equals the gold one; never raises (what math-verify cannot
    handle, or a timeout, counts as wrong). `kind` is there for kind-specific rules; all kinds are
    graded alike today. A gold that states a number (`stated_number`) needs an answer that states
    one: compared exactly as decimals when both are plain numbers (72 == 72.0, "1,234" == 1234),
    else (fractions, scientific form) by math-verify. Any other gold goes to math-verify whole."""
    if extracted is None or not extracted.strip() or len(extracted) > MAX_ANSWER_CHARS:
        return False
    gold_value = stated_number(gold)
    if gold_value is None:  # a symbolic gold: \\sqrt{2}, a tuple, an interval, a name
        return _math_verify(extracted, gold)
    value = stated_number(extracted)
    if value is None:  # an expression math-verify would evaluate, or no number: not the answer asked for
        return False
    pred_num, gold_num = _as_number(value), _as_number(gold_value)
    if pred_num is not None and gold_num is not None:
        return pred_num == gold_num
    return _math_verify(value, gold_value)
