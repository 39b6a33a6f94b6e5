"""Rewards as plain functions (components/rewards.py, registry REWARDS).

The end-to-end check registers a user's reward in tests/user_components/my_rewards.py (a file
outside the package), imports it from a gin file, selects it for an `hf_dataset` task read from
a local JSONL file, and trains a few steps with `experiments.train.run_training`, in a fresh
process whose working directory is the user's directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from _helpers_trainer import BASE_BINDINGS, read_jsonl, tiny_model
from components.registry import REWARDS
from components.rewards import reward_verdict, value_to_verdict

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "tests" / "user_components"

PARTIAL = 0.25
THRESHOLD = 0.9


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, (True, 1.0, None)),
        (False, (False, -1.0, None)),
        (np.bool_(True), (True, 1.0, None)),
        (0.95, (True, 0.95, None)),  # a float is the reward itself; passed iff >= threshold (0.9)
        (0.9, (True, 0.9, None)),
        (0.5, (False, 0.5, None)),
        (np.float32(0.25), (False, 0.25, None)),
        (1, (True, 1.0, None)),  # an int is a number, not a verdict
        (-3.0, (False, -3.0, None)),
    ],
)
def test_value_to_verdict(value, expected):
    v = value_to_verdict("r", value, pass_threshold=0.9, reward_correct=1.0, reward_incorrect=-1.0)
    assert (v.passed, v.reward, v.error) == expected


@pytest.mark.parametrize("value, fragment", [(float("nan"), "returned nan"), (float("inf"), "returned inf"),
                                             ("1.0", "returned str"), (None, "returned NoneType")])
def test_bad_reward_values_fail_the_sample_with_an_error(value, fragment):
    v = value_to_verdict("r", value, pass_threshold=0.5, reward_correct=1.0, reward_incorrect=0.0)
    assert not v.passed and v.reward == 0.0 and fragment in v.error and "'r'" in v.error


def test_reward_verdict_passes_the_row_and_catches_errors():
    name = f"t_{uuid.uuid4().hex[:8]}"
    calls = []

    @REWARDS.register(name)
    def fn(prompt, completion, *, answer, scale=1.0, **row):
        calls.append((prompt, completion, answer, scale, row))
        if completion == "boom":
            raise RuntimeError("reward exploded")
        return scale * float(completion == answer)

    try:
        row = {"prompt": "shadowed", "completion": "shadowed", "answer": "7", "level": 2}
        v = reward_verdict(name, "3+4=", "7", row, pass_threshold=1.0)
        assert (v.passed, v.reward) == (True, 1.0)
        assert calls[-1] == ("3+4=", "7", "7", 1.0, {"level": 2})  # row keys "prompt"/"completion" are not passed
        v = reward_verdict(name, "3+4=", "boom", row, reward_incorrect=-1.0)
        assert not v.passed and v.reward == -1.0 and "reward exploded" in v.error and name in v.error
    finally:
        REWARDS.unregister(name)


def test_builtin_rewards():
    assert REWARDS.get("math_verify")("q", "<think>x</think> \\boxed{\\frac{1}{2}}", answer="0.5") is True
    assert REWARDS.get("math_verify")("q", "\\boxed{3}", answer="0.5") is False
    assert REWARDS.get("exact_match")("q", "<think>hm</think> 12 ", answer=12) is True
    assert REWARDS.get("exact_match")("q", "<think>12", answer=12) is False
    with pytest.raises(ValueError, match="needs the row's 'answer'"):
        REWARDS.get("math_verify")("q", "1")


RUN = """
import sys
from experiments.train import run_training
sys.exit(0 if run_training([{gin!r}], [], {run_dir!r}, progress=False) == "done" else 1)
"""


@pytest.mark.slow
def test_user_reward_from_own_file_trains_with_a_dataset_task(tmp_path):
    model = tiny_model(tmp_path)
    rows = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(12) for b in range(10)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bindings = dict(BASE_BINDINGS)
    bindings.update({
        "model.path": json.dumps(model),
        "train.task": '"hf_dataset"',
        "train.task_kwargs": json.dumps({"path": str(data), "columns": {"prompt": "q", "answer": "a"}, "eval_size": 8,
                                         "system_prompt": "Add the numbers.", "cache_dir": str(tmp_path / "hf")}),
        "train.total_steps": "3", "train.eval_every": "3", "train.checkpoint_every": "3",
        "hf_dataset.reward": '"digits_partial_credit"',
        "hf_dataset.pass_threshold": str(THRESHOLD),
        "digits_partial_credit.partial": str(PARTIAL),
    })
    gin_file = tmp_path / "my_reward_recipe.gin"
    gin_file.write_text("import my_rewards\n" + "".join(f"{k} = {v}\n" for k, v in bindings.items()))
    run_dir = tmp_path / "runs" / "user_reward" / "run0"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    # cwd = the user's directory: `import my_rewards` resolves there, in the learner and in the generators
    out = subprocess.run([sys.executable, "-c", RUN.format(gin=str(gin_file), run_dir=str(run_dir))], cwd=USER_DIR,
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:], (run_dir / "error.txt").read_text()
                                 if (run_dir / "error.txt").exists() else "")

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    partial_total = 0
    for m in metrics:
        n = m["generations"]
        exact = m["pass_rate"] * n  # passed iff reward >= 0.9: only the exact answer (1.0)
        assert abs(exact - round(exact)) < 1e-6
        partial = (m["reward_mean"] * n - round(exact)) / PARTIAL  # the rest earned 0.25 or 0.0
        assert abs(partial - round(partial)) < 1e-4 and 0 <= round(partial) <= n - round(exact), m
        assert m["verifier_errors"] == 0  # the reward was found in every process
        partial_total += round(partial)
    assert partial_total > 0  # float rewards reached the learner (a binary verdict gives +-1)
    assert all(m["reward_mean"] >= 0 for m in metrics)
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3]
    assert all(0.0 <= e["pass_rate"] <= 1.0 and e["eval_verifier_errors"] == 0 for e in evals)


README_CHECK = """
import json, sys
sys.path.insert(0, {user_dir!r})
import gin
import components.trainer.config  # defines train.*
from components.registry import REWARDS, TASKS
TASKS.get("hf_dataset")  # the built-ins, hf_dataset among them
gin.parse_config_files_and_bindings([{reward_gin!r}, {dataset_gin!r}, {tracking_gin!r}], [])
fn = REWARDS.get(gin.query_parameter("hf_dataset.reward"))
print(json.dumps({{
    "exact": fn("1+1=", " 2 ", answer=2), "partial": fn("1+1=", "it is 2?", answer=2), "none": fn("1+1=", "no", answer=2),
    "threshold": gin.query_parameter("hf_dataset.pass_threshold"),
    "columns": gin.query_parameter("hf_dataset.columns"),
    "system": gin.query_parameter("hf_dataset.system_prompt"),
    "trackers": gin.query_parameter("train.trackers"),
}}))
"""


def test_readme_examples_work_as_written(tmp_path):
    """README "Using it": the reward file, its gin lines, the dataset and tracking gin lines."""
    import re

    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    (py,) = [b for b in blocks if "@REWARDS.register(" in b]
    (reward_gin,) = [b for b in blocks if "hf_dataset.reward" in b]
    (dataset_gin,) = [b for b in blocks if "hf_dataset.columns" in b]
    (tracking_gin,) = [b for b in blocks if "train.trackers" in b]
    (tmp_path / "my_rewards.py").write_text(py)
    files = {}
    for name, body in (("reward", reward_gin), ("dataset", dataset_gin), ("tracking", tracking_gin)):
        files[name] = tmp_path / f"{name}.gin"
        files[name].write_text(body)
    code = README_CHECK.format(user_dir=str(tmp_path), reward_gin=str(files["reward"]), dataset_gin=str(files["dataset"]),
                               tracking_gin=str(files["tracking"]))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["exact"] == 1.0 and got["partial"] == 0.25 and got["none"] == 0.0  # my_reward.partial = 0.25 from gin
    assert got["threshold"] == 0.9 and got["columns"] == {"prompt": "question", "answer": "solution"}
    assert got["system"] == "Reason step by step, then give the answer in \\boxed{}."
    assert got["trackers"] == ["wandb", "tensorboard", "mlflow"]
