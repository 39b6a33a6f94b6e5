"""Tasks: arithmetic, reasoning-gym, math files; make_task and render_prompt."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest

from components.registry import TASKS, UnknownComponentError
from components.tasks import Problem, Task, make_task, render_prompt, strip_thinking
from components.tasks.arithmetic import ArithmeticTask, evaluate, format_expression, parse_last_int
from components.tasks.common import extract_code


# -- registry / make_task ----------------------------------------------------------------
def test_builtin_tasks_registered():
    for name in ("arithmetic", "reasoning_gym", "math_file", "code_file"):
        assert name in TASKS, TASKS.names()
        assert issubclass(TASKS.original(name), Task)


def test_make_task_unknown_name_lists_valid_names():
    with pytest.raises(UnknownComponentError) as err:
        make_task("arithmatic")
    msg = str(err.value)
    assert "arithmetic" in msg and "math_file" in msg and "Did you mean 'arithmetic'" in msg


def test_make_task_unknown_reasoning_gym_dataset_suggests_close_matches():
    with pytest.raises(ValueError, match=r"unknown reasoning-gym dataset 'countdwn'.*countdown"):
        make_task("reasoning_gym:countdwn")
    with pytest.raises(ValueError, match="valid datasets: .*basic_arithmetic"):
        make_task("reasoning_gym:zzzzzzzzqqqq")


# -- thinking part / helpers ---------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", "42"),
        ("<think>7</think>42", "42"),
        ("<think>a</think>x<think>b</think> 5", " 5"),  # after the LAST </think>
        ("<think>never closed 42", None),
    ],
)
def test_strip_thinking(text, expected):
    assert strip_thinking(text) == expected


def test_extract_code_prefers_last_python_block():
    text = "```text\nnot code\n```\n```python\nprint(1)\n```\nand\n```py\nprint(2)\n```\n```\nplain\n```"
    assert extract_code(text).strip() == "print(2)"
    assert extract_code("no fence, just code()").strip() == "no fence, just code()"
    assert extract_code("```python\nprint(3)\n").strip() == "print(3)"  # truncated fence


# -- arithmetic --------------------------------------------------------------------------------
def test_evaluate_matches_python_precedence():
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randint(2, 5)
        ops = [rng.randint(-30, 30) for _ in range(k)]
        opr = [rng.choice("+-*") for _ in range(k - 1)]
        expr = format_expression(ops, opr)
        assert evaluate(ops, opr) == eval(expr), expr  # noqa: S307 - our own digits and operators


def test_arithmetic_split_disjoint_seeded_and_sized():
    a = ArithmeticTask(seed=3, num_train=300, num_eval=50)
    b = ArithmeticTask(seed=3, num_train=300, num_eval=50)
    c = ArithmeticTask(seed=4, num_train=300, num_eval=50)
    train, held = a.train_problems(), a.eval_problems()
    assert len(train) == 300 and len(held) == 50
    assert {p.id for p in train}.isdisjoint({p.id for p in held})
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})
    assert len({p.id for p in train}) == 300  # distinct expressions
    assert [p.prompt for p in held] == [p.prompt for p in b.eval_problems()]
    assert [p.prompt for p in held] != [p.prompt for p in c.eval_problems()]
    assert all(p.meta["split"] == "eval" for p in held)
    for p in train + held:
        assert p.prompt == p.meta["expr"] + "="
        assert p.answer == eval(p.meta["expr"])  # noqa: S307


def test_arithmetic_difficulty_knobs():
    t = ArithmeticTask(num_train=200, num_eval=20, num_operands=3, max_operand=99, operators="+-*")
    for p in t.train_problems():
        nums = [int(x) for x in p.meta["expr"].replace("*", " ").replace("+", " ").replace("-", " ").split()]
        assert len(nums) == 3 and all(0 <= x <= 99 for x in nums)
        assert p.answer >= 0  # allow_negative=False
    seen_ops = {ch for p in t.train_problems() for ch in p.meta["expr"] if ch in "+-*"}
    assert seen_ops == set("+-*")
    neg = ArithmeticTask(num_train=300, num_eval=20, allow_negative=True, max_operand=9, operators="-")
    assert any(p.answer < 0 for p in neg.train_problems())
    assert any("(-" in p.prompt for p in neg.train_problems())


def test_arithmetic_too_small_space_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the 121 distinct expressions"):
        ArithmeticTask(num_train=120, num_eval=10, max_operand=10, operators="+")
    with pytest.raises(ValueError, match="operators"):
        ArithmeticTask(operators="/")


def test_arithmetic_large_space_uses_rejection_sampling():
    t = ArithmeticTask(num_train=500, num_eval=100, num_operands=4, max_operand=999, operators="+-*")
    assert len({p.id for p in t.train_problems() + t.eval_problems()}) == 600


def test_arithmetic_verify_and_solution_text():
    t = ArithmeticTask(num_train=10, num_eval=5)
    p = Problem(id="x", prompt="12+7=", answer=19)
    assert t.solution_text(p) == "19"
    good = ["19", " 19</s>", "<think>12+7 is 19</think>19", "<think>x</think>The answer is 19.", "=19"]
    bad = ["18", "", "<think>19", "19 20", "abc", "<think>19</think>", "1 9"]
    for c in good:
        v = t.verify(p, c)
        assert v.passed and v.reward == 1.0 and v.error is None, c
    for c in bad:
        v = t.verify(p, c)
        assert not v.passed and v.reward == -1.0, c
    neg = Problem(id="y", prompt="3-5=", answer=-2)
    assert t.verify(neg, "-2").passed and not t.verify(neg, "2").passed
    for prob in t.train_problems():
        assert t.verify(prob, t.solution_text(prob)).passed


def test_arithmetic_reward_configurable_to_one_zero():
    t = make_task("arithmetic", num_train=10, num_eval=5, reward_correct=1.0, reward_incorrect=0.0)
    p = t.eval_problems()[0]
    assert t.verify(p, str(p.answer)).reward == 1.0
    assert t.verify(p, str(p.answer + 1)).reward == 0.0


def test_arithmetic_verify_never_raises():
    t = ArithmeticTask(num_train=10, num_eval=5)
    p = Problem(id="z", prompt="1+1=", answer="not an int")
    v = t.verify(p, "2")
    assert not v.passed and v.error and "ValueError" in v.error
    assert parse_last_int("a -12 b 7") == 7 and parse_last_int("none") is None


# -- render_prompt -------------------------------------------------------------------------
def test_render_prompt_uses_chat_template():
    from components.models import make_char_tokenizer

    tok = make_char_tokenizer()
    p = Problem(id="a", prompt="12+7=", answer=19)
    ids = render_prompt(p, tok)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "<|user|>12+7=\n<|assistant|>"
    assert ids == render_prompt("12+7=", tok)


def test_render_prompt_without_chat_template_encodes_plain_text():
    from components.models import make_char_tokenizer

    tok = make_char_tokenizer()
    tok.chat_template = None
    ids = render_prompt(Problem(id="a", prompt="3*4=", answer=12), tok)
    assert tok.decode(ids, skip_special_tokens=True) == "3*4="


# -- reasoning-gym -----------------------------------------------------------------------------
def test_reasoning_gym_split_and_scoring():
    t = make_task("reasoning_gym:basic_arithmetic", num_train=40, num_eval=10, seed=1)
    train, held = t.train_problems(), t.eval_problems()
    assert len(held) == 10 and 30 <= len(train) <= 40
    assert {p.meta["question"] for p in train}.isdisjoint({p.meta["question"] for p in held})
    assert {p.id for p in train}.isdisjoint({p.id for p in held})
    same = make_task("reasoning_gym:basic_arithmetic", num_train=40, num_eval=10, seed=1)
    assert [p.prompt for p in held] == [p.prompt for p in same.eval_problems()]
    for p in held[:5] + train[:5]:
        assert "<answer>" in p.prompt
        assert t.verify(p, f"<think>work</think><answer>{p.answer}</answer>").passed
        assert t.verify(p, f"blah\n{p.answer}").passed  # no tags: the last line
        assert not t.verify(p, "<answer>definitely wrong</answer>").passed
        assert not t.verify(p, f"<think><answer>{p.answer}</answer>").passed  # unclosed thinking


def test_reasoning_gym_threshold_on_partial_credit():
    # countdown gives partial credit (0.05) to a valid-looking wrong expression.
    strict = make_task("reasoning_gym:countdown", num_train=5, num_eval=3, seed=0)
    lenient = make_task("reasoning_gym:countdown", num_train=5, num_eval=3, seed=0, threshold=0.01)
    p = strict.eval_problems()[0]
    wrong = "<answer>1+2</answer>"
    assert 0.0 < strict.score(p, wrong) < 1.0
    assert not strict.verify(p, wrong).passed
    assert lenient.verify(p, wrong).passed
    with pytest.raises(ValueError, match="threshold"):
        make_task("reasoning_gym:countdown", threshold=2.0)


# -- math files --------------------------------------------------------------------------------
MATH_ROWS = [{"problem": f"Compute {i}/8 in lowest terms.", "answer": f"\\frac{{{i}}}{{8}}"} for i in range(1, 30)]


@pytest.fixture
def math_jsonl(tmp_path):
    path = tmp_path / "polaris.jsonl"
    rows = MATH_ROWS + [MATH_ROWS[0], {"problem": "", "answer": "1"}]  # a duplicate and an empty row
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_math_file_jsonl_split_dedup_and_sizes(math_jsonl):
    t = make_task("math_file", path=str(math_jsonl), eval_size=5, seed=2)
    train, held = t.train_problems(), t.eval_problems()
    assert len(held) == 5 and len(train) == 24
    assert t.load_stats == {"rows_read": 31, "dropped_empty": 1, "dropped_duplicate": 1}
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})
    again = make_task("math_file", path=str(math_jsonl), eval_size=5, seed=2)
    assert [p.id for p in held] == [p.id for p in again.eval_problems()]
    assert "\\boxed{}" in held[0].prompt
    frac = make_task("math_file", path=str(math_jsonl), eval_fraction=0.2)
    assert len(frac.eval_problems()) == round(29 * 0.2)
    with pytest.raises(ValueError, match="not both"):
        make_task("math_file", path=str(math_jsonl), eval_size=3, eval_fraction=0.1)


def test_math_file_parquet_and_custom_columns(tmp_path):
    path = tmp_path / "m.parquet"
    pd.DataFrame({"question": ["What is 2+2?", "What is 3+3?", "What is 1+9?"], "solution": [4, 6, 10]}).to_parquet(path)
    t = make_task("math_file", path=str(path), eval_size=1, problem_key="question", answer_key="solution")
    assert len(t.train_problems()) == 2
    p = t.eval_problems()[0]
    assert t.verify(p, f"\\boxed{{{p.answer}}}").passed


def test_math_file_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        make_task("math_file", path=str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"question": ["q"], "answer": ["1"]}).to_parquet(bad)
    with pytest.raises(ValueError, match=r"no column\(s\) \['problem'\]; columns present: \['question', 'answer'\]"):
        make_task("math_file", path=str(bad))
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("{not json\n")
    with pytest.raises(ValueError, match="garbage.jsonl"):
        make_task("math_file", path=str(garbage))


def test_math_file_verify_equivalent_forms_and_thinking(math_jsonl):
    t = make_task("math_file", path=str(math_jsonl), eval_size=3)
    p = Problem(id="q", prompt="?", answer="\\frac{3}{4}")
    assert t.verify(p, "<think>the answer is 7</think>So it is \\boxed{0.75}").passed
    assert t.verify(p, "\\boxed{\\frac{6}{8}}").passed
    assert t.verify(p, "\\boxed{3/4}").passed
    assert not t.verify(p, "<think>\\boxed{3/4}</think>\\boxed{7}").passed  # thinking part ignored
    assert not t.verify(p, "<think>\\boxed{3/4}").passed  # unclosed thinking: no answer
    assert not t.verify(p, "").passed
    v = t.verify(p, "\\boxed{\\frac{")  # malformed latex: a wrong answer, not an exception
    assert not v.passed


def test_math_file_verify_in_threads(math_jsonl):
    t = make_task("math_file", path=str(math_jsonl), eval_size=3)
    probs = t.train_problems()[:8]

    def grade(p):
        assert threading.current_thread() is not threading.main_thread()
        return t.verify(p, f"\\boxed{{{p.answer}}}").passed, t.verify(p, "\\boxed{12345}").passed

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(grade, probs))
    assert results == [(True, False)] * len(probs)


# -- gin and pickling ----------------------------------------------------------------------------
def test_gin_bindings_reach_tasks_built_by_make_task():
    import gin

    gin.parse_config("arithmetic.max_operand = 9\narithmetic.num_train = 50\narithmetic.num_eval = 20")
    try:
        t = make_task("arithmetic")
        assert t.max_operand == 9 and len(t.train_problems()) == 50 and len(t.eval_problems()) == 20
        assert make_task("arithmetic", num_eval=5).eval_problems().__len__() == 5  # explicit kwargs win
    finally:
        gin.clear_config()


def test_tasks_pickle(math_jsonl):
    import pickle

    for task in (
        make_task("arithmetic", num_train=20, num_eval=5),
        make_task("reasoning_gym:basic_arithmetic", num_train=5, num_eval=2),
        make_task("math_file", path=str(math_jsonl), eval_size=3),
    ):
        clone = pickle.loads(pickle.dumps(task))
        assert [p.id for p in clone.eval_problems()] == [p.id for p in task.eval_problems()]
        p = task.eval_problems()[0]
        assert clone.verify(p, task.solution_text(p)).passed
        assert all(task.verify(q, task.solution_text(q)).passed for q in task.train_problems()[:5])
