"""Several weighted rewards per task (issue 43 item 2): `train.reward_funcs`, `train.reward_weights`.

The reward of a completion is sum_i weight_i x reward_i over the listed functions ("verifier" is the
task's own verdict reward; a `REWARDS` name; an import path "module:function" of any callable, a
reward MODEL among them); each function is logged on its own as `reward/<name>` in metrics.jsonl;
the pass rate stays the task verifier's. A function is called per completion, ``fn(prompt,
completion, **row)``, or once per group as TRL's GRPOTrainer calls one, ``fn(prompts=...,
completions=..., completion_ids=..., **columns)``. Without reward_funcs nothing changes: a run with
``reward_funcs = ["verifier"]`` logs the same numbers as one without, bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from _helpers_trainer import BASE_BINDINGS, read_jsonl, tiny_model, write_gin
from components.registry import REWARDS
from components.rewards import (VERIFIER, build_reward_funcs, combined_rewards, parse_reward_funcs, reward_row,
                                reward_spec_of)
from components.tasks import make_task
from components.tasks.base import Problem

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "tests" / "user_components"


# -- module-level reward functions (importable by path, as the generator processes import them) -------
def shortness(prompt, completion, **row):
    """Per completion: 1 / (1 + number of characters)."""
    return 1.0 / (1.0 + len(completion))


def group_parity(prompts, completions, completion_ids, level, **kwargs):
    """Per group (TRL's convention): +1 for an even number of tokens, None (abstain) at level 2, else 0."""
    return [None if lv == 2 else float(len(ids) % 2 == 0) for ids, lv in zip(completion_ids, level)]


def explodes(prompt, completion, **row):
    raise RuntimeError("reward exploded")


def says_yes(prompt, completion, *, answer):  # no **row: only the columns it names are passed
    return completion.strip() == str(answer)


# -------------------------------------------------------------------------------------------------
def test_specs_names_and_weights():
    assert reward_spec_of(shortness) == f"{__name__}:shortness"  # a callable -> its import path
    assert reward_spec_of(REWARDS.get("exact_match")) == "exact_match"  # a registered one -> its name
    assert parse_reward_funcs([VERIFIER, "exact_match", shortness, "pkg.mod:fn"], [1, 0.5, -0.1, 2]) == [
        (VERIFIER, VERIFIER, 1.0), ("exact_match", "exact_match", 0.5),
        (f"{__name__}:shortness", "shortness", -0.1), ("pkg.mod:fn", "fn", 2.0)]
    assert [w for _, _, w in parse_reward_funcs(["verifier", "exact_match"], None)] == [1.0, 1.0]  # None: all 1
    funcs = build_reward_funcs([VERIFIER, f"{__name__}:shortness", f"{__name__}.group_parity"], None)
    assert [(f.name, f.batched, f.fn is None) for f in funcs] == [("verifier", False, True), ("shortness", False, False),
                                                                   ("group_parity", True, False)]


@pytest.mark.parametrize("funcs, weights, message", [
    (["verifier", "exact_match"], [1.0], "train.reward_weights has 1 weight(s) [1.0] for the 2 train.reward_funcs"),
    (["verifier"], [float("nan")], "the weight of 'verifier' must be a finite number, got nan"),
    (["verifier", "exact_match"], [0, 0.0], "are all 0"),
    ([], [1.0], "train.reward_funcs is empty"),
    (["exact_match", "exact_match"], None, "under the same name 'exact_match'"),
    (["exact_matc"], None, "Did you mean 'exact_match'?"),
    (["no_such_module_xyz:fn"], None, "cannot import 'no_such_module_xyz'"),
    ([f"{__name__}:nope"], None, "has no attribute 'nope'"),
    ([f"{__name__}:Problem"], None, "is a class"),
    ([lambda p, c: 1.0], None, "cannot be imported by name"),
])
def test_bad_reward_funcs_name_the_setting(funcs, weights, message):
    import gin

    from components.trainer.config import ConfigError, train_config

    gin.clear_config()  # no other test's bindings
    with pytest.raises(ConfigError) as err:
        train_config(reward_funcs=funcs, reward_weights=weights)  # validated before model.path is resolved
    assert message in str(err.value), str(err.value)


def test_a_bad_reward_func_is_refused_by_scalerl_train_before_a_run_directory(tmp_path, capsys):
    from experiments.cli import main

    gin_file = write_gin(tmp_path / "bad.gin", str(tmp_path / "no_model_needed"), train__reward_funcs='["verifier", "nope"]')
    run_dir = tmp_path / "runs" / "r"
    assert main(["train", gin_file, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "train.reward_funcs: 'nope' is not 'verifier', a registered reward or an import path" in err, err
    assert "Traceback" not in err and not run_dir.exists()


def test_combined_rewards_weights_abstentions_errors_and_both_conventions():
    p = Problem(id="p", prompt="1+1=", answer="2", meta={"split": "train"})
    row = {"answer": "2", "level": 0}
    texts, ids = ["2", "22", "x"], [[5], [5, 5], [9]]
    funcs = build_reward_funcs([VERIFIER, f"{__name__}:shortness", f"{__name__}:group_parity",
                                f"{__name__}:explodes", f"{__name__}:says_yes"], [1.0, 2.0, 0.5, 3.0, 0.25])
    totals, parts, errors = combined_rewards(funcs, p, row, texts, ids, [1.0, -1.0, -1.0], reward_correct=1.0,
                                             reward_incorrect=-1.0)
    assert parts["verifier"] == [1.0, -1.0, -1.0]
    assert parts["shortness"] == [0.5, 1 / 3, 0.5]
    assert parts["group_parity"] == [0.0, 1.0, 0.0]  # completion_ids' lengths 1, 2, 1
    assert all(math.isnan(x) for x in parts["explodes"]) and errors == 3  # raised on each: no contribution, 3 errors
    assert parts["says_yes"] == [1.0, -1.0, -1.0]  # a bool is the task's reward_correct / reward_incorrect
    want = [1.0 + 2 * 0.5 + 0 + 0.25, -1.0 + 2 / 3 + 0.5 - 0.25, -1.0 + 1.0 + 0 - 0.25]
    assert totals == pytest.approx(want, abs=1e-12)
    # None abstains (not an error); a batched function returning the wrong length is an error for the group
    totals, parts, errors = combined_rewards(build_reward_funcs([f"{__name__}:group_parity"], None), p,
                                             {"level": 2}, texts, ids, [0.0] * 3, reward_correct=1.0, reward_incorrect=0.0)
    assert all(math.isnan(x) for x in parts["group_parity"]) and errors == 0 and totals == [0.0, 0.0, 0.0]
    name = f"t_{uuid.uuid4().hex[:8]}"
    REWARDS.register(name)(lambda prompts, completions, **kw: [1.0])
    try:
        _, parts, errors = combined_rewards(build_reward_funcs([name], None), p, row, texts, ids, [0.0] * 3,
                                            reward_correct=1.0, reward_incorrect=0.0)
        assert errors == 3 and all(math.isnan(x) for x in parts[name])
    finally:
        REWARDS.unregister(name)


def test_the_columns_a_reward_sees(tmp_path, monkeypatch):
    """hf_dataset: every column of the row (plus the mapped answer); arithmetic: its answer and meta; a
    mixture: its member's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1), "level": i % 3, "source": "s"}) + "\n"
                            for i in range(20)))
    task = make_task("hf_dataset", path=str(data), columns={"prompt": "q", "answer": "a"}, eval_size=2,
                     cache_dir=str(tmp_path / "hf"))
    p = task.train_problems()[0]
    row = reward_row(task, p)
    assert set(row) == {"q", "a", "level", "source", "answer"} and row["answer"] == row["a"]
    arith = make_task("arithmetic", num_train=10, num_eval=2)
    q = arith.train_problems()[0]
    assert reward_row(arith, q)["answer"] == q.answer and reward_row(arith, q)["operands"] == q.meta["operands"]
    mix = make_task({"arithmetic": 0.5, "hf_dataset": 0.5}, seed=0, arithmetic={"num_train": 10, "num_eval": 2},
                    hf_dataset={"path": str(data), "columns": {"prompt": "q", "answer": "a"}, "eval_size": 2,
                                "cache_dir": str(tmp_path / "hf")})
    member = [x for x in mix.train_problems() if x.meta["task"] == "hf_dataset"][0]
    assert "level" in reward_row(mix, member) and "task" not in reward_row(mix, member)


# -------------------------------------------------------------------------------------------------
# end to end: a tiny run (seconds), in a fresh process whose working directory is the user's

RUN = """
import sys
from experiments.train import run_training
sys.exit(0 if run_training([{gin!r}], [], {run_dir!r}, progress=False) == "done" else 1)
"""

SHORT = {"train__total_steps": "3", "train__eval_every": "3", "train__checkpoint_every": "3"}


def _train(tmp_path: Path, name: str, cwd: Path, imports: tuple = (), **bindings) -> Path:
    gin_file = write_gin(tmp_path / f"{name}.gin", tiny_model(tmp_path), imports=imports, **{**SHORT, **bindings})
    run_dir = tmp_path / "runs" / name
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", RUN.format(gin=gin_file, run_dir=str(run_dir))], cwd=cwd,
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, (out.stderr[-4000:], (run_dir / "error.txt").read_text()
                                 if (run_dir / "error.txt").exists() else "")
    return run_dir


def test_weighted_rewards_with_a_reward_model_reach_the_learner_and_are_logged_each(tmp_path):
    """verifier (1.0) + a tiny torch classifier called TRL-style (0.5) + a registered plain-function
    reward (0.25): each logged as reward/<name>, reward_mean (what the advantages are computed from)
    is their weighted sum, the pass rate is the verifier's."""
    run_dir = _train(tmp_path, "weighted", USER_DIR, imports=("my_rewards",),
                     train__reward_funcs='["verifier", "my_reward_model:classifier_reward", "digits_partial_credit"]',
                     train__reward_weights="[1.0, 0.5, 0.25]", digits_partial_credit__partial="0.5")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        rv, rc, rd = m["reward/verifier"], m["reward/classifier_reward"], m["reward/digits_partial_credit"]
        assert rv == pytest.approx(2 * m["pass_rate"] - 1, abs=1e-9)  # +1 / -1: the verifier's verdicts
        assert 0.0 < rc < 1.0  # a sigmoid score
        assert 0.0 <= rd <= 1.0  # 1, 0.5 or 0 per completion
        assert m["reward_mean"] == pytest.approx(1.0 * rv + 0.5 * rc + 0.25 * rd, abs=1e-5)
        assert m["verifier_errors"] == 0  # every function found and scored in the generator
    info = json.loads((run_dir / "run.json").read_text())
    assert {"my_rewards", "my_reward_model"} <= {m["module"] for m in info["user_modules"]}


DETERMINISTIC = ("step", "version", "flops", "prompts", "generations", "tokens", "reward_mean", "pass_rate",
                 "zero_variance_frac", "truncation_rate", "completion_len_mean", "loss", "grad_norm", "entropy",
                 "advantage_abs_mean", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "trained_tokens")


def test_a_run_without_reward_funcs_is_unchanged(tmp_path):
    """The same seed with train.reward_funcs = ["verifier"] (weight 1) logs the same numbers as a run
    without reward_funcs, which has no reward/ key at all; held-out pass rates too."""
    plain = _train(tmp_path, "plain", REPO)
    listed = _train(tmp_path, "listed", REPO, train__reward_funcs='["verifier"]')
    a, b = read_jsonl(plain / "metrics.jsonl"), read_jsonl(listed / "metrics.jsonl")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert {k: x[k] for k in DETERMINISTIC} == {k: y[k] for k in DETERMINISTIC}
        assert not any(k.startswith("reward/") for k in x) and y["reward/verifier"] == pytest.approx(x["reward_mean"])
    assert ([e["pass_rate"] for e in read_jsonl(plain / "eval.jsonl")]
            == [e["pass_rate"] for e in read_jsonl(listed / "eval.jsonl")])


def only_completions(completions):  # TRL's shortest form: no prompts, no **kwargs
    return [float(len(c)) for c in completions]


def test_a_group_function_gets_only_the_arguments_it_names():
    p = Problem(id="p", prompt="1+1=", answer="2")
    _, parts, errors = combined_rewards(build_reward_funcs([f"{__name__}:only_completions"], None), p,
                                        {"answer": "2", "level": 1}, ["ab", "c"], [[1], [2]], [0.0, 0.0],
                                        reward_correct=1.0, reward_incorrect=-1.0)
    assert parts["only_completions"] == [2.0, 1.0] and errors == 0


README_CHECK = """
import json, sys
sys.path.insert(0, {user_dir!r})
from components.trainer.config import train_config
from components.trainer.gin_config import parse_gin_files
from components.rewards import build_reward_funcs
parse_gin_files([{gin!r}], [])
cfg = train_config(model_path="unused")
funcs = build_reward_funcs(cfg.reward_funcs, cfg.reward_weights)
print(json.dumps([[f.name, f.weight, f.batched] for f in funcs]))
"""


def test_the_readme_example_resolves_as_written(tmp_path):
    import re

    blocks = re.findall(r"```[a-z]*\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if "train.reward_funcs" in b]
    (tmp_path / "rewards.gin").write_text(block)
    code = README_CHECK.format(user_dir=str(USER_DIR), gin=str(tmp_path / "rewards.gin"))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [["verifier", 1.0, False],
                                                                ["digits_partial_credit", 0.25, False],
                                                                ["classifier_reward", 0.5, True]]
