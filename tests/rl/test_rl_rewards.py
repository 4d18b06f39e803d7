"""Answer extraction, grading (math-verify), and weighted rewards with custom functions."""

from __future__ import annotations

import threading

import pytest

from qerl_pipe.errors import QerlError
from qerl_pipe.rl.task.rewards import RewardError, RewardSpec, extract_answer, is_correct, load_custom_rewards, score
from qerl_pipe.rl.task.tasks import Problem

POLAR = "\\left( 3, \\frac{\\pi}{2} \\right)"


@pytest.mark.parametrize("completion, kind, expected", [
    ("so \\boxed{42}.", "gsm8k", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "math", "\\frac{1}{2}"),  # the last one
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "math", POLAR),  # nested braces
    ("\\boxed{\\frac{a}{b_{1}}} and more text 7", "gsm8k", "\\frac{a}{b_{1}}"),  # boxed wins over numbers
    ("first \\boxed{5} then a cut-off \\boxed{6", "math", "5"),  # an open box is skipped
    ("\\fbox{9}", "math", "9"),
    ("The answer is 1,234.", "gsm8k", "1234"),
    ("It is 3 - 8 = -5.", "arithmetic", "-5"),
    ("costs 3.50 dollars", "jsonl", "3.50"),
    ("I think 12, or rather 13.", "gsm8k", "13"),
    ("no number here", "gsm8k", None),
    ("The answer is 5.", "math", None),  # math needs a box
    ("\\boxed{}", "math", None),
    ("", "arithmetic", None),
])
def test_extract_answer(completion, kind, expected):
    assert extract_answer(completion, kind) == expected


@pytest.mark.parametrize("extracted, gold, kind, expected", [
    ("42", "42", "gsm8k", True),
    ("42.0", "42", "gsm8k", True),
    ("1234", "1234", "gsm8k", True),
    ("1,234", "1234", "gsm8k", True),
    ("\\$18", "18", "gsm8k", True),
    ("-5", "-5", "arithmetic", True),
    ("5", "-5", "arithmetic", False),
    ("41", "42", "gsm8k", False),
    ("3,4", "34", "gsm8k", False),
    ("\\frac{1}{2}", "0.5", "math", True),
    ("0.5", "\\frac{1}{2}", "math", True),
    ("\\dfrac{1}{3}", "\\frac{1}{2}", "math", False),
    ("(3, \\pi/2)", POLAR, "math", True),
    (POLAR, POLAR, "math", True),
    ("\\left( 3, \\frac{\\pi}{3} \\right)", POLAR, "math", False),
    ("3", POLAR, "math", False),
    ("x^2+1", "1+x^2", "math", True),
    ("25\\%", "25", "gsm8k", True),
    ("18 \\text{ dollars}", "18", "gsm8k", True),
    (None, "42", "gsm8k", False),
    ("", "42", "gsm8k", False),
    ("\\frac{", "\\frac{1}{2}", "math", False),  # unparsable: wrong, no exception
    ("1" * 2000, "1", "math", False),  # degenerate length
    # A gold that states a number needs an answer that states one; an expression is not it, though
    # math-verify would evaluate it (a policy learned to box the question: "(27 + 82)").
    ("(27 + 82)", "109", "arithmetic", False),
    ("\\left(27\\right)+\\left(82\\right)", "109", "arithmetic", False),
    ("27\\,+\\,82", "109", "arithmetic", False),
    ("27+\\text{ }82", "109", "arithmetic", False),
    ("x = 27 + 82", "109", "arithmetic", False),
    ("0 = 27 + 82", "109", "arithmetic", False),
    ("2^{10}", "1024", "math", False),
    ("3 \\times 4", "12", "gsm8k", False),
    ("\\sqrt{144}", "12", "math", False),
    ("5!", "120", "math", False),
    ("\\frac{1}{2}+\\frac{1}{2}", "1", "math", False),
    ("(9+9)", "18 \\text{ dollars}", "gsm8k", False),
    ("2+3", "5^\\circ", "math", False),
    ("\\frac14+\\frac14", "\\frac{1}{2}", "math", False),
    # ... and states it in any of the usual ways
    ("27 + 82 = 109", "109", "arithmetic", True),
    ("27+82 \\approx 109", "109", "arithmetic", True),
    ("x = -5", "-5", "math", True),
    ("-\\frac{1}{2}", "-0.5", "math", True),
    ("\\frac{36}{2}", "18", "gsm8k", True),
    ("1.5 \\times 10^{3}", "1500", "math", True),
    ("5 \\times 10^{-3}", "0.005", "math", True),
    ("30^{\\circ}", "30", "math", True),
    ("10 \\text{ cm}^2", "10", "math", True),
    ("\\$1{,}000", "1000", "gsm8k", True),
    ("1\\,000", "1000", "gsm8k", True),
    ("\\$32,\\!348", "32,348", "math", True),
    ("−5", "-5", "arithmetic", True),
    ("1.09 \\times 10^{2}", "109", "math", True),  # exact: no float rounding of the mantissa
    ("f(3) = 12", "12", "math", True),  # an answer's other sides may be labels
    ("\\text{Total cost} = \\$12", "12", "gsm8k", True),
    ("{12}", "12", "math", True),
    ("\\textit{12},", "12", "math", True),
    ("\\cfrac{1}{2}", "0.5", "math", True),
    ("11,111,111,100", "11,\\! 111,\\! 111,\\! 100", "math", True),
    ("11111111000 + 100", "11,\\! 111,\\! 111,\\! 100", "math", False),
    ("1 \\times 10^{99999999999}", "109", "math", False),  # no such power is computed
    ("1/0", "5", "math", False),
    # symbolic golds are math-verify's: "2k" and "5x - 7y + 11z + 4 = 0" state no number
    ("2", "2k", "math", False),
    ("0", "5x - 7y + 11z + 4 = 0", "math", False),
])
def test_is_correct(extracted, gold, kind, expected):
    assert is_correct(extracted, gold, kind) is expected


def test_is_correct_off_the_main_thread():
    # math-verify's signal-based timeouts would raise off the main thread; ours switches them off there.
    results = []
    t = threading.Thread(target=lambda: results.append(
        (is_correct("\\frac{1}{2}", "0.5", "math"), is_correct("(3, \\pi/3)", POLAR, "math"))))
    t.start()
    t.join()
    assert results == [(True, False)]


@pytest.mark.parametrize("spec", ["math500:test", "gsm8k:test"])
def test_every_packaged_gold_answer_grades_correct_against_itself(spec):
    from qerl_pipe.rl.task.tasks import load_problems

    forms = ["So the answer is \\boxed{{{}}}."] + (["The answer is {}."] if spec.startswith("gsm8k") else [])
    wrong = [(form, p.answer) for p in load_problems(spec) for form in forms
             if not is_correct(extract_answer(form.format(p.answer), p.kind), p.answer, p.kind)]
    assert wrong == []


def test_copying_the_question_into_the_box_scores_nothing():
    # What a QLoRA policy learned on two-digit addition under a grader that evaluated expressions.
    completion = "\\boxed{(27 + 82)} 27 + 82 27 + 82 27 + 82"
    problem = Problem("arithmetic:1:0", "What is 27 + 82?", "109", "arithmetic")
    assert score([completion], [problem], RewardSpec()).rewards == [0.0]
    assert score(["\\boxed{109}"], [problem], RewardSpec()).rewards == [1.0]


def _problems(n=1):
    return [Problem(f"t:{i}", "What is 20 + 22?", "42", "arithmetic") for i in range(n)]


def test_score_weights_add_up():
    completions = ["\\boxed{42}", "it is 42", "\\boxed{41}", "nothing"]
    scored = score(completions, _problems(4), RewardSpec(accuracy=1.0, format=0.25))
    assert scored.components == {"accuracy": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0, 0.0]}
    assert scored.rewards == [1.25, 1.0, 0.25, 0.0]
    assert scored.correct == [True, True, False, False]
    assert scored.extracted == ["42", "42", "41", None]
    # correctness is reported even when it carries no weight
    scored = score(completions, _problems(4), RewardSpec(accuracy=0.0, format=1.0))
    assert scored.rewards == [1.0, 0.0, 1.0, 0.0] and scored.correct == [True, True, False, False]
    with pytest.raises(ValueError, match="one problem per completion"):
        score(completions, _problems(3), RewardSpec())


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def brevity(completion, problem):\n"
        "    return -len(completion) / 100\n"
        "def echo_id(completion, problem):\n"
        "    return float(problem.id.endswith(':1'))\n"
        "def explode(completion, problem):\n"
        "    if 'boom' in completion:\n"
        "        raise RuntimeError('kaboom')\n"
        "    return 0.0\n"
        "def nan(completion, problem):\n"
        "    return float('nan')\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_mod"


def test_custom_rewards_add_with_weight_one(reward_module):
    spec = RewardSpec(accuracy=2.0, custom=(f"{reward_module}:brevity", f"{reward_module}:echo_id"))
    scored = score(["\\boxed{42}", "x" * 50], _problems(2), spec)
    assert scored.components[f"{reward_module}:brevity"] == [-0.1, -0.5]
    assert scored.components[f"{reward_module}:echo_id"] == [0.0, 1.0]
    assert scored.rewards == pytest.approx([2.0 - 0.1, 0.0 - 0.5 + 1.0])


def test_raising_custom_reward_names_reward_problem_and_completion(reward_module):
    spec = RewardSpec(custom=(f"{reward_module}:explode",))
    completion = "fine until boom " + "y" * 300
    with pytest.raises(RewardError) as info:
        score(["ok", completion], _problems(2), spec)
    message = str(info.value)
    assert f"{reward_module}:explode" in message and "kaboom" in message and "t:1" in message
    assert repr(completion[:200]) in message and "y" * 201 not in message
    with pytest.raises(RewardError, match="returned nan, not a finite number, on problem t:0"):
        score(["ok"], _problems(1), RewardSpec(custom=(f"{reward_module}:nan",)))


@pytest.mark.parametrize("name, message", [
    ("no_colon", "write it as 'module:function'"),
    ("surely_missing_module_xyz:f", "cannot import module 'surely_missing_module_xyz'"),
    ("{mod}:absent", "has no function 'absent'"),
    ("{mod}:NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
])
def test_bad_custom_names_fail_at_load(reward_module, name, message):
    with pytest.raises(RewardError, match=message):
        load_custom_rewards([name.format(mod=reward_module)])
    assert issubclass(RewardError, QerlError)


def test_duplicate_custom_reward(reward_module):
    with pytest.raises(RewardError, match="listed twice"):
        load_custom_rewards([f"{reward_module}:brevity"] * 2)
    assert [n for n, _ in load_custom_rewards([f"{reward_module}:brevity"])] == [f"{reward_module}:brevity"]
