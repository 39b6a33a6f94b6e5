"""`hf_dataset`: datasets.load_dataset sources (local files made here; nothing is downloaded),
column mapping, held-out splits, the system prompt travelling with the problems, and grading
(math-verify, sandboxed tests, plain-function rewards)."""

from __future__ import annotations

import json
import pickle
import sys
import uuid

import pytest

from components.models import CHAT_TEMPLATE, make_char_tokenizer
from components.registry import REWARDS, UnknownComponentError
from components.tasks import make_task, render_prompt

ROWS = [{"question": f"What is {i} + {i + 1}?", "solution": str(2 * i + 1), "level": i % 3} for i in range(40)]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Never reach the Hub; keep datasets' cache in tmp."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    return tmp_path / "hf_cache"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def write_csv(path, rows):
    import pandas as pd

    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


COLUMNS = {"prompt": "question", "answer": "solution"}


@pytest.fixture
def tok():
    return make_char_tokenizer()  # has CHAT_TEMPLATE: system -> "{content}\n", user -> "<|user|>{content}\n"


def test_jsonl_with_column_mapping_system_prompt_and_seeded_split(tmp_path, offline, tok):
    path = write_jsonl(tmp_path / "arith.jsonl", ROWS + [ROWS[3], {"question": "", "solution": "1", "level": 0}])
    kw = dict(path=path, columns=COLUMNS, system_prompt="Answer with a number.", eval_size=8, seed=3, cache_dir=str(offline))
    task = make_task("hf_dataset", **kw)
    train, held = task.train_problems(), task.eval_problems()
    assert len(train) == 32 and len(held) == 8  # 42 rows: one empty, one repeated prompt dropped
    assert task.load_stats == {"rows_read": 42, "train_dropped_empty": 1, "train_dropped_duplicate": 1}
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    again = make_task("hf_dataset", **kw)
    assert [p.id for p in again.eval_problems()] == [p.id for p in held]  # seeded
    assert [p.id for p in make_task("hf_dataset", **{**kw, "seed": 4}).eval_problems()] != [p.id for p in held]
    by_text = {r["question"]: r for r in ROWS}
    for p in train + held:
        assert p.answer == by_text[p.prompt]["solution"]
        assert p.meta["split"] == ("train" if p in train else "eval")
    # the chat template and the system prompt, with no argument: what the generator and the
    # evaluation call (render_prompt(problem, tokenizer)) -- training and evaluation alike
    for p in (train[0], held[0]):
        want = "Answer with a number.\n" + "<|user|>" + p.prompt + "\n" + "<|assistant|>"
        assert render_prompt(p, tok) == tok.encode(want, add_special_tokens=False)
        assert tok.decode(render_prompt(p, tok)) == want
    plain = make_char_tokenizer()
    plain.chat_template = None  # a base model's tokenizer: the system prompt is prepended as text
    assert render_prompt(train[0], plain) == plain.encode("Answer with a number.\n" + train[0].prompt, add_special_tokens=True)
    # an explicit system prompt still wins; a problem without one renders as before
    assert tok.decode(render_prompt(train[0], tok, system_prompt="S")) == f"S\n<|user|>{train[0].prompt}\n<|assistant|>"
    no_sys = make_task("hf_dataset", **{**kw, "system_prompt": None}).train_problems()[0]
    assert tok.decode(render_prompt(no_sys, tok)) == f"<|user|>{no_sys.prompt}\n<|assistant|>"
    assert tok.chat_template == CHAT_TEMPLATE


def test_parquet_with_held_out_split_from_data_files(tmp_path, offline):
    train_rows = ROWS[:30] + ROWS[30:32]  # two of them also held out: dropped from training
    files = {"train": write_parquet(tmp_path / "train.parquet", train_rows),
             "test": write_parquet(tmp_path / "test.parquet", ROWS[30:40])}
    task = make_task("hf_dataset", data_files=files, split="train", eval_split="test", columns=COLUMNS, cache_dir=str(offline))
    assert [p.prompt for p in task.eval_problems()] == [r["question"] for r in ROWS[30:40]]
    assert [p.prompt for p in task.train_problems()] == [r["question"] for r in ROWS[:30]]
    assert task.load_stats["dropped_in_eval_split"] == 2
    assert task.train_problems()[0].id == "hf_dataset:train:train:0"
    with pytest.raises(ValueError, match="eval_split .* or eval_size"):
        make_task("hf_dataset", data_files=files, eval_split="test", eval_size=3, columns=COLUMNS)
    # a slice of a split, through datasets' own split syntax
    sliced = make_task("hf_dataset", data_files=files, split="train[:20]", eval_size=5, columns=COLUMNS, cache_dir=str(offline))
    assert len(sliced.train_problems()) + len(sliced.eval_problems()) == 20


def test_csv_and_default_columns_and_a_prompt_template(tmp_path, offline):
    rows = [{"problem": f"{i}*2", "answer": 2 * i, "extra": "x"} for i in range(1, 21)]
    path = write_csv(tmp_path / "mul.csv", rows)
    task = make_task("hf_dataset", path=path, eval_size=4, prompt_template="Compute {prompt}.", cache_dir=str(offline))
    assert task.columns == {"prompt": "problem", "answer": "answer"}  # found without a mapping
    p = task.train_problems()[0]
    i = int(p.prompt[len("Compute "):].split("*")[0])
    assert p.prompt == f"Compute {i}*2." and int(p.answer) == 2 * i
    assert task.verify(p, f"so \\boxed{{{2 * i}}}").passed


def test_clear_errors(tmp_path, offline):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError) as err:
        make_task("hf_dataset", path=path, columns={"prompt": "query", "answer": "solution"}, cache_dir=str(offline))
    msg = str(err.value)
    assert "'query'" in msg and "columns present: ['question', 'solution', 'level']" in msg
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['answers'\].*\['prompt', 'answer', 'tests'\]"):
        make_task("hf_dataset", path=path, columns={"prompt": "question", "answers": "solution"}, cache_dir=str(offline))
    with pytest.raises(ValueError, match="needs an answer column.*columns present: \\['question', 'solution', 'level'\\]"):
        make_task("hf_dataset", path=path, columns={"prompt": "question"}, cache_dir=str(offline))
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"q": r["question"], "a": r["solution"]} for r in ROWS])
    with pytest.raises(ValueError, match=r"none of the prompt columns \['prompt', 'problem', 'question'\].*present: \['q', 'a'\]"):
        make_task("hf_dataset", path=odd, columns={"answer": "a"}, cache_dir=str(offline))
    with pytest.raises(ValueError, match="give a source"):
        make_task("hf_dataset")
    with pytest.raises(FileNotFoundError, match="no such file"):
        make_task("hf_dataset", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        make_task("hf_dataset", data_files=str(tmp_path / "d.txtx"))
    with pytest.raises(UnknownComponentError, match="Unknown reward 'no_such_reward'.*math_verify"):
        make_task("hf_dataset", path=path, columns=COLUMNS, reward="no_such_reward", cache_dir=str(offline))
    # a Hub name is passed to datasets as is: offline here, so datasets says it cannot reach it
    with pytest.raises(Exception, match="someorg/not-a-dataset"):
        make_task("hf_dataset", path="someorg/not-a-dataset", cache_dir=str(offline))


def test_math_verify_grading_after_think(tmp_path, offline):
    task = make_task("hf_dataset", path=write_jsonl(tmp_path / "d.jsonl", ROWS), columns=COLUMNS, eval_size=4,
                     reward_correct=1.0, reward_incorrect=0.0, cache_dir=str(offline))
    p = next(p for p in task.train_problems() if p.answer == "7")
    assert task.verify(p, "<think>3+4 is 8? no</think> The answer is \\boxed{7}.").passed
    assert task.verify(p, "<think>3+4 is 8? no</think> The answer is \\boxed{7}.").reward == 1.0
    assert task.verify(p, "\\boxed{7.0}").passed  # math equivalence, not string equality
    v = task.verify(p, "<think>\\boxed{7}</think> \\boxed{8}")
    assert not v.passed and v.reward == 0.0
    assert not task.verify(p, "<think>\\boxed{7} and I ran out of tokens").passed  # thinking left open
    clone = pickle.loads(pickle.dumps(task))  # generators get tasks by pickling or rebuilding
    assert clone.verify(p, "\\boxed{7}").passed


def test_tests_column_grades_programs_in_the_sandbox(tmp_path, offline):
    rows = [
        {"statement": "Read n and print 2n.", "cases": [{"input": "3\n", "output": "6\n"}, {"input": "10\n", "output": "20\n"}]},
        {"statement": "Read a and b, print a+b.", "cases": [{"input": "1 2\n", "output": "3\n"}]},
        {"statement": "Define sq(x).", "cases": [{"input": "3", "output": "9", "testtype": "functional"}], "fn_name": "sq"},
    ]
    path = write_parquet(tmp_path / "code.parquet", rows)  # parquet fills absent struct fields with None
    task = make_task("hf_dataset", path=path, columns={"prompt": "statement", "tests": "cases"}, eval_size=1, seed=0,
                     cache_dir=str(offline))
    problems = {p.prompt.split("\n")[0]: p for p in task.train_problems() + task.eval_problems()}
    double = problems["Read n and print 2n."]
    assert "```python" in double.prompt  # the code instruction is appended by default
    assert double.answer is None and task.tests_of(double)["kind"] == "stdio"
    assert task.verify(double, "```python\nn = int(input())\nprint(2 * n)\n```").passed
    assert not task.verify(double, "```python\nn = int(input())\nprint(n + 3)\n```").passed  # 6 ok, 13 != 20
    sq = problems["Define sq(x)."]
    assert task.verify(sq, "```python\ndef sq(x):\n    return x * x\n```").passed
    assert not task.verify(sq, "```python\ndef sq(x):\n    return x + x\n```").passed


def test_plain_function_reward_float_and_threshold(tmp_path, offline):
    name = f"test_reward_{uuid.uuid4().hex[:8]}"
    seen = []

    @REWARDS.register(name)
    def partial(prompt, completion, *, answer, level, bonus=0.0, **row):
        seen.append((prompt, completion, answer, level, sorted(row)))
        if completion.strip() == answer:
            return 1.0 + bonus
        return 0.5 if answer in completion else 0.0

    try:
        path = write_jsonl(tmp_path / "d.jsonl", ROWS)
        task = make_task("hf_dataset", path=path, columns=COLUMNS, reward=name, pass_threshold=0.9, eval_size=4,
                         cache_dir=str(offline))
        p = task.train_problems()[0]
        ans = p.answer
        v = task.verify(p, ans)
        assert (v.passed, v.reward) == (True, 1.0)
        v = task.verify(p, f"maybe {ans}?")
        assert (v.passed, v.reward) == (False, 0.5)  # a float reward: passed iff >= pass_threshold
        assert task.verify(p, "no idea").reward == 0.0
        # the reward sees the prompt, the completion, the mapped answer and every column of the row
        assert seen[0][0] == p.prompt and seen[0][2] == ans and seen[0][3] == ROWS[p.meta["row"]]["level"]
        assert seen[0][4] == ["question", "solution"]
        loose = make_task("hf_dataset", path=path, columns=COLUMNS, reward=name, pass_threshold=0.5, eval_size=4,
                          cache_dir=str(offline))
        assert loose.verify(p, f"maybe {ans}?").passed
    finally:
        REWARDS.unregister(name)


def test_math_file_and_code_file_take_a_system_prompt_and_a_reward(tmp_path, tok):
    math_path = write_jsonl(tmp_path / "m.jsonl", [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(20)])
    task = make_task("math_file", path=math_path, eval_size=2, system_prompt="Be exact.", reward="exact_match",
                     reward_incorrect=0.0)
    p = task.train_problems()[0]
    assert tok.decode(render_prompt(p, tok)) == f"Be exact.\n<|user|>{p.prompt}\n<|assistant|>"
    assert task.verify(p, f"<think>hmm</think>{p.answer}").passed
    assert not task.verify(p, f"\\boxed{{{p.answer}}}").passed  # exact_match, not math-verify
    assert tok.decode(render_prompt(make_task("math_file", path=math_path, eval_size=2).train_problems()[0], tok)).startswith("<|user|>")

    code_path = write_jsonl(tmp_path / "c.jsonl", [{"problem": f"Print {i}.", "tests": [{"input": "", "output": f"{i}\n"}]}
                                                   for i in range(10)])
    task = make_task("code_file", path=code_path, eval_size=1, system_prompt="Write Python.")
    p = task.train_problems()[0]
    assert tok.decode(render_prompt(p, tok)).startswith("Write Python.\n<|user|>Print ")
    n = p.prompt.split(".")[0].split()[-1]
    assert task.verify(p, f"```python\nprint({n})\n```").passed


# -- conversational prompts and chat_template_kwargs (issue 43 item 2) ---------------------------------
CONVERSATIONS = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}+1?"}],
                  "answer": str(i + 1), "level": i % 3} for i in range(20)]
# a template that opens a thinking part after the generation prompt unless enable_thinking is false (as Qwen3's)
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is not defined or enable_thinking %}<think>"
    "{% endif %}{% endif %}")


def test_conversational_prompts_render_their_messages_with_chat_template_kwargs(tmp_path, offline, tok):
    """TRL's conversational format: a prompt column of messages. The messages (the last user one through
    prompt_template) are what the chat template renders, in training and evaluation alike; the
    chat_template_kwargs reach the template; a repeated conversation is kept once, the same question under
    another system message is not a repeat; the reward sees the text and the row's columns."""
    rows = CONVERSATIONS + [CONVERSATIONS[0],  # a repeat
                            {"prompt": [{"role": "user", "content": "What is 0+1?"}], "answer": "1", "level": 9}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    kw = dict(path=path, eval_size=4, prompt_template="Q: {prompt}", chat_template_kwargs={"enable_thinking": False},
              cache_dir=str(offline))
    task = make_task("hf_dataset", **kw)
    train, held = task.train_problems(), task.eval_problems()
    assert len(train) + len(held) == 21 and task.load_stats["train_dropped_duplicate"] == 1
    think = make_char_tokenizer()
    think.chat_template = THINKING_TEMPLATE
    for p in (train[0], held[0]):
        assert p.prompt.startswith("Q: What is ") and p.meta["messages"][-1] == {"role": "user", "content": p.prompt}
        system = "Be brief.\n" if len(p.meta["messages"]) == 2 else ""
        assert tok.decode(render_prompt(p, tok)) == f"{system}<|user|>{p.prompt}\n<|assistant|>"
        assert think.decode(render_prompt(p, think)) == f"{system}<|user|>{p.prompt}\n<|assistant|>"  # enable_thinking=False
        assert task.verify(p, f"\\boxed{{{p.answer}}}").passed  # math-verify against the answer column
    on = make_task("hf_dataset", **{**kw, "chat_template_kwargs": None}).train_problems()[0]
    assert think.decode(render_prompt(on, think)).endswith("<|assistant|><think>")  # the template's default
    plain = make_char_tokenizer()
    plain.chat_template = None  # no template: the messages' contents, one a line
    p = next(x for x in train if len(x.meta["messages"]) == 2)
    assert render_prompt(p, plain) == plain.encode(f"Be brief.\n{p.prompt}", add_special_tokens=True)
    # the rewards: the per-completion prompt is the text; a TRL-style function gets the messages
    from components.rewards import build_reward_funcs, combined_rewards, reward_row

    seen = {}

    def trl_style(prompts, completions, level, **kwargs):
        seen.update(prompts=prompts, completions=completions, level=level)
        return [1.0] * len(completions)

    mod = sys.modules[__name__]
    setattr(mod, "_trl_style", trl_style)
    funcs = build_reward_funcs([f"{__name__}:_trl_style"], None)
    combined_rewards(funcs, p, reward_row(task, p), ["4", "5"], [[1], [2]], [0.0, 0.0], reward_correct=1.0,
                     reward_incorrect=-1.0)
    assert seen["prompts"] == [p.meta["messages"]] * 2
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert seen["level"] == [reward_row(task, p)["level"]] * 2 and "prompt" in reward_row(task, p)


@pytest.mark.parametrize("row, extra, message", [
    ({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "answer": "1"}, {},
     "last message is the 'assistant''s"),
    ({"prompt": ["What is 1+1?"], "answer": "2"}, {}, "item 0 ('What is 1+1?') is not a {'role': str, 'content': str}"),
    ({"prompt": [], "answer": "2"}, {}, "holds an empty list"),
    ({"prompt": {"role": "user"}, "answer": "2"}, {}, "holds a dict, not text"),
    (CONVERSATIONS[1], {"system_prompt": "Think."}, "has a system message, and system_prompt = 'Think.' gives another"),
    (CONVERSATIONS[1], {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs must be a dict"),
])
def test_malformed_conversations_are_named(tmp_path, offline, row, extra, message):
    path = write_jsonl(tmp_path / "bad.jsonl", CONVERSATIONS[2:] + [row])
    with pytest.raises(ValueError) as err:
        make_task("hf_dataset", path=path, eval_size=2, cache_dir=str(offline), **extra)
    msg = str(err.value)
    assert message in msg, msg
    if "chat_template_kwargs" not in extra and "system_prompt" not in extra:
        assert "row 18" in msg and "column 'prompt'" in msg, msg
