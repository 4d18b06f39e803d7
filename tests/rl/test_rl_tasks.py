"""Problem sets (packaged, generated, user jsonl) and prompt rendering."""

from __future__ import annotations

import json

import pytest

from conftest import train_tokenizer
from qerl_pipe.errors import QerlError
from qerl_pipe.rl.task.tasks import DEFAULT_INSTRUCTIONS, Problem, TaskError, load_problems, render_prompt


@pytest.mark.parametrize("spec, count, kind", [("gsm8k:train", 7473, "gsm8k"), ("gsm8k:test", 1319, "gsm8k"),
                                               ("math500:test", 500, "math")])
def test_packaged_counts_and_ids(spec, count, kind):
    problems = load_problems(spec)
    assert len(problems) == count
    assert {p.kind for p in problems} == {kind}
    assert problems[17].id == f"{spec}:17"
    assert len({p.id for p in problems}) == count
    assert all(p.question and p.answer for p in problems)


def test_gsm8k_gold_answers():
    train = load_problems("gsm8k:train")
    assert train[0].answer == "72"  # "... #### 72"
    assert train[345].answer == "1080"  # "#### 1,080"
    assert train[367].answer == "850000"  # "#### 850,000"
    assert train[5715].answer == "-7"
    test = load_problems("gsm8k:test", limit=3)
    assert [p.answer for p in test] == ["18", "3", "70000"]
    assert test[0].question.startswith("Janet")


def test_math500_gold_is_the_answer_field():
    problems = load_problems("math500:test", limit=2)
    assert len(problems) == 2
    assert problems[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert problems[0].question.startswith("Convert the point $(0,3)$")


def test_arithmetic_is_seeded_and_in_range():
    a = load_problems("arithmetic", seed=3)
    assert len(a) == 1000 and a[42].id == "arithmetic:3:42"
    assert a == load_problems("arithmetic:1000", seed=3)
    assert load_problems("arithmetic:20", seed=3) == a[:20] == load_problems("arithmetic", seed=3, limit=20)
    assert [p.question for p in load_problems("arithmetic:50", seed=4)] != [p.question for p in a[:50]]
    for p in a:
        x, y = (int(t) for t in p.question.removeprefix("What is ").removesuffix("?").split(" + "))
        assert 10 <= x <= 99 and 10 <= y <= 99 and p.answer == str(x + y) and p.kind == "arithmetic"


def test_jsonl_with_field_map(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"q": "2+2?", "a": 4}, {"q": "Half of 1?", "a": "\\frac{1}{2}"}, {"q": "Gsm style", "a": "so #### 1,000"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = load_problems(str(path), question_field="q", answer_field="a")
    assert problems == [Problem("mine.jsonl:0", "2+2?", "4", "jsonl"),
                        Problem("mine.jsonl:1", "Half of 1?", "\\frac{1}{2}", "jsonl"),
                        Problem("mine.jsonl:2", "Gsm style", "1000", "jsonl")]
    assert load_problems(str(path), question_field="q", answer_field="a", limit=1) == problems[:1]


def test_jsonl_default_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "Q", "answer": "7"}) + "\n")
    assert load_problems(str(path)) == [Problem("d.jsonl:0", "Q", "7", "jsonl")]


def test_addition_splits_are_fixed_disjoint_and_cover_the_one_digit_sums():
    train, test = load_problems("addition:train"), load_problems("addition:test")
    assert (len(train), len(test)) == (49, 32)
    questions = [p.question for p in train + test]
    assert len(set(questions)) == 81  # every "a + b", a and b in 1..9, exactly once: no question in both
    assert {q for q in questions} == {f"What is {a} + {b}?" for a in range(1, 10) for b in range(1, 10)}
    for p in train + test:
        a, b = (int(x) for x in p.question.removeprefix("What is ").removesuffix("?").split(" + "))
        assert p.answer == str(a + b) and p.kind == "arithmetic"
    assert test[0].id == "addition:test:0" and train[48].id == "addition:train:48"
    # The split ignores the seed (train.seed, eval.seed) and a limit keeps the first problems.
    assert load_problems("addition:test", seed=7) == test
    assert load_problems("addition:test", limit=5) == test[:5]
    assert load_problems("addition:train", limit=500) == train


@pytest.mark.parametrize("spec, kwargs, message", [
    ("gsm8k", {}, "arithmetic[:N]"),
    ("nope.jsonl", {}, "does not exist"),
    ("arithmetic:0", {}, "positive integer"),
    ("arithmetic:x", {}, "positive integer"),
    ("addition", {}, "addition:train, addition:test"),
    ("addition:dev", {}, "addition:train, addition:test"),
    ("gsm8k:test", {"limit": 0}, "at least 1"),
    ("gsm8k:test", {"question_field": "problem"}, "no field 'problem'"),
])
def test_bad_specs(spec, kwargs, message):
    with pytest.raises(TaskError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_problems(spec, **kwargs)


def test_jsonl_errors_name_file_line_and_fix(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "Q", "answer": "1"}) + "\n" + json.dumps({"question": "Q2"}) + "\n")
    with pytest.raises(TaskError, match=r"p\.jsonl:2: no field 'answer' \(fields: question\); set answer_field"):
        load_problems(str(path))
    path.write_text(json.dumps({"text": "Q"}) + "\n")
    with pytest.raises(TaskError, match="no field 'question'.*set question_field"):
        load_problems(str(path))
    path.write_text("{not json\n")
    with pytest.raises(TaskError, match=r"p\.jsonl:1: not valid JSON"):
        load_problems(str(path))
    path.write_text("\n\n")
    with pytest.raises(TaskError, match="holds no problems"):
        load_problems(str(path))
    path.write_text(json.dumps({"question": "Q", "answer": "  "}) + "\n")
    with pytest.raises(TaskError, match="empty answer"):
        load_problems(str(path))
    assert issubclass(TaskError, QerlError)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return out


def _load(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_render_prompt_plain_fallback(tokenizer_dir):
    # The conftest tokenizer has no chat template: the prompt is "question\ninstruction\n".
    tok = _load(tokenizer_dir)
    assert not getattr(tok, "chat_template", None)
    problem = Problem("x:0", "What is 12 + 30?", "42", "arithmetic")
    ids = render_prompt(tok, problem)
    assert ids == tok(f"What is 12 + 30?\n{DEFAULT_INSTRUCTIONS['arithmetic']}\n")["input_ids"]
    assert all(isinstance(i, int) for i in ids)
    assert render_prompt(tok, problem, "Be brief.") == tok("What is 12 + 30?\nBe brief.\n")["input_ids"]
    assert render_prompt(tok, problem, "") == tok("What is 12 + 30?\n")["input_ids"]


def test_render_prompt_chat_template(tokenizer_dir):
    tok = _load(tokenizer_dir)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    problem = Problem("x:0", "What is 12 + 30?", "42", "gsm8k")
    ids = render_prompt(tok, problem)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids[0] == tok.bos_token_id  # the template's <s> is the special token, not its characters
    text = f"<s>user: What is 12 + 30?\n{DEFAULT_INSTRUCTIONS['gsm8k']}\nassistant:"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]


def test_a_byte_order_mark_is_accepted_and_every_line_is_checked_whatever_the_limit(tmp_path):
    good = json.dumps({"question": "1 + 1?", "answer": "2"})
    path = tmp_path / "bom.jsonl"
    path.write_bytes("\ufeff".encode() + f"{good}\n{good}\n".encode())  # as some editors save UTF-8
    assert [p.answer for p in load_problems(str(path))] == ["2", "2"]
    path.write_text(f"{good}\n{good}\nnot json\n")
    for limit in (None, 1):  # a malformed line past the limit is still found
        with pytest.raises(TaskError, match=r"bom.jsonl:3: not valid JSON"):
            load_problems(str(path), limit=limit)
