"""Final answers: pulling one out of a completion, and grading it against the gold answer.

The last complete \\boxed{...}, else the last number; a gold that states a number needs that number
(exact rationals, an expression is wrong), other golds go to math-verify with the whole answer.
See docs/rewards.md, sections "Extracting the answer" and "Grading"."""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

log = logging.getLogger(__name__)

NUMBER_FALLBACK_KINDS = frozenset({"gsm8k", "arithmetic", "jsonl"})
MAX_ANSWER_CHARS = 1000  # longer "answers" are degenerate generations; sympy could spend minutes on them
MATH_VERIFY_TIMEOUT_S = 5  # per parse / per comparison, main thread only (see _timeout_s)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A minus sign only where it cannot be a binary minus ("3-5" gives 5, "= -5" gives -5); thousands
# commas only in groups of three, so "3, 4" is two numbers.
_TEXT_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
# LaTeX thousands separators, made plain commas: "1{,}000", "1\\,000"; a negative space "\\!" (with
# the spaces around it, as in "32,\\! 348") is dropped.
_LATEX_THOUSANDS = re.compile(r"\{,\}|(?<=\d)\\,(?=\d{3}(?!\d))")
_NEGATIVE_SPACE = re.compile(r"\s*\\!\s*")
# What may surround a stated number without changing it: LaTeX spacing and sizing, \\left / \\right,
# dollar, degree and percent signs.
_DECORATION = re.compile(r"\\left|\\right|\\displaystyle|\\[,;: ]|\\q?quad|~|\\\$|\$|\^\s*\{?\s*\\circ\s*\}?|°|\\?%")
# Text and font wrappers, replaced by their content after a space: "\\text{cm}" -> " cm".
_WRAPPER = re.compile(r"\\(?:text|textrm|textbf|textit|textsf|mathrm|mathbf|mathit|mathsf|mbox)\s*\{([^{}]*)\}")
_NUM = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
# One number: plain, a fraction, or scientific; in parentheses or braces or not; then unit words,
# each after a space ("5 cm^2", "5 m/s"; "2k" and "5r^5" are products, not units).
_STATED = re.compile(
    rf"[({{]?\s*(?P<sign>[-+]?)\s*(?:"
    rf"\\[dtc]?frac\s*(?:\{{\s*(?P<fn>-?{_NUM})\s*\}}|(?P<fn1>\d))\s*(?:\{{\s*(?P<fd>{_NUM})\s*\}}|(?P<fd1>\d))"
    rf"|(?P<sn>{_NUM})\s*/\s*(?P<sd>{_NUM})"
    rf"|(?P<mant>{_NUM})\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*(?:\{{\s*(?P<exp>-?\d+)\s*\}}|(?P<exp1>\d))"
    rf"|(?P<num>{_NUM}))\s*[)}}]?"
    r"(?:\s+[A-Za-z]+(?:\^\{?\d\}?)?(?:/[A-Za-z]+(?:\^\{?\d\}?)?)?)*\s*[.,]?")
MAX_EXPONENT = 400  # "1 \times 10^{99999999999}" states no number we compare (it would take forever)
_RELATION = re.compile(r"=|\\approx|≈|\\equiv")
_NAME = re.compile(r"[A-Za-z]\w*")  # "x" in "x = 5"
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")


def last_boxed(text: str) -> str | None:
    """The content of the last complete \\boxed{...} (or \\fbox{...}; one left open, a truncated
    completion, is skipped for an earlier complete one); None if there is none."""
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
    text = _LATEX_THOUSANDS.sub(",", _NEGATIVE_SPACE.sub("", text))
    return _DECORATION.sub(" ", text).strip()


def _number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def _value(m: re.Match[str]) -> Fraction | None:
    """The exact value of a `_STATED` match (None for a zero denominator or a huge exponent)."""
    g = m.groupdict()
    if g["num"] is not None:
        value = _number(g["num"])
    elif g["mant"] is not None:
        exponent = int(g["exp"] or g["exp1"])
        if abs(exponent) > MAX_EXPONENT:
            return None
        value = _number(g["mant"]) * Fraction(10) ** exponent
    else:
        numerator, denominator = (g["fn"] or g["fn1"] or g["sn"]), (g["fd"] or g["fd1"] or g["sd"])
        if _number(denominator) == 0:
            return None
        value = _number(numerator) / _number(denominator)
    return -value if g["sign"] == "-" else value


def stated_value(answer: str, *, any_other_sides: bool = False) -> Fraction | None:
    """The number an answer states, exactly: 18 from "18", "\\$18", "18 \\text{ dollars}" or "x = 18";
    -1/2 from "-\\frac{1}{2}"; None for an expression ("(27 + 82)", "2^{10}"), an equation or no number.
    In a relation the last side that states a number counts when each other side is a name or has no
    letters; with `any_other_sides` (an answer, not a gold) they may be anything. docs/rewards.md, "Grading"."""
    sides = [_undecorated(side) for side in _RELATION.split(answer.replace("−", "-").replace("–", "-"))]
    for i in reversed(range(len(sides))):
        m = _STATED.fullmatch(sides[i])
        if m is None:
            continue
        others = sides[:i] + sides[i + 1:]
        if any_other_sides or all(_NAME.fullmatch(o) or not re.search("[A-Za-z]", _LATEX_COMMAND.sub("", o))
                                  for o in others):
            return _value(m)
        return None
    return None


def is_correct(extracted: str | None, gold: str, kind: str) -> bool:
    """Whether the extracted answer equals the gold one (every `kind` alike today); never raises (what
    math-verify cannot handle, or a timeout, is wrong). A gold that states a number (`stated_value`) needs
    the same number, exactly as rationals; any other gold goes to math-verify with the whole answer."""
    if extracted is None or not extracted.strip() or len(extracted) > MAX_ANSWER_CHARS:
        return False
    gold_value = stated_value(gold)
    if gold_value is None:  # a symbolic gold: \\sqrt{2}, a tuple, an interval, a name
        return _math_verify(extracted, gold)
    # An expression math-verify would evaluate, or no number, is not the answer asked for: None.
    return stated_value(extracted, any_other_sides=True) == gold_value
