"""The Python API (issue 43, item 1): `import scalerl`; train, sweep, fit, compare, evaluate, load_runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gin
import pandas as pd
import pytest

import scalerl
from analysis.synthetic import write_sweep
from scalerl.api import bindings_of, callable_spec, gin_literal, resolve_config, run_settings

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RUN_KW = dict(steps=60, eval_every=3, device="cpu", count=2)


@pytest.fixture(autouse=True)
def _fresh_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def module_level_reward(prompts, completions, **columns):
    """A reward the generators can import (tests/test_python_api.py is importable as test_python_api)."""
    return [0.0 for _ in completions]


# ---------------------------------------------------------------------------------------
# the package
def test_the_package_exports_every_verb_and_nothing_unknown():
    for name in ("train", "sweep", "fit", "compare", "evaluate", "load_runs"):
        assert callable(getattr(scalerl, name)), name
    with pytest.raises(AttributeError, match="has no attribute 'trian'.*'train'"):
        scalerl.trian  # noqa: B018


def test_the_package_is_installed_from_pyproject():
    text = (REPO / "pyproject.toml").read_text()
    assert '"scalerl*"' in text


# ---------------------------------------------------------------------------------------
# settings as gin bindings
@pytest.mark.parametrize("value, text", [
    (1e-3, "0.001"), (3, "3"), (True, "True"), (None, "None"), ("dapo", '"dapo"'), (Path("/a b"), '"/a b"'),
    (["uniform", "zero_variance_filter"], '["uniform", "zero_variance_filter"]'), ((0.9, 0.99), "(0.9, 0.99)"),
    ((1,), "(1,)"), ({"num_train": 10, "ops": "+-"}, '{"num_train": 10, "ops": "+-"}'),
])
def test_gin_literal_writes_values_gin_reads_back(value, text):
    assert gin_literal(value) == text
    gin.parse_config(f"x.y = {text}", skip_unknown=True)  # it parses


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), object()])
def test_gin_literal_refuses_what_gin_cannot_read(bad):
    with pytest.raises(ValueError, match="finite|cannot be written"):
        gin_literal(bad)


def test_bindings_of_names_train_settings_and_refuses_bad_keys():
    assert bindings_of({"lr": 1e-3, "cispo.eps_max": 5.0, "train.loss": "dapo"}) == [
        "train.lr = 0.001", "cispo.eps_max = 5.0", 'train.loss = "dapo"']
    with pytest.raises(ValueError, match="'train lr' is not a setting name"):
        bindings_of({"train lr": 1})
    with pytest.raises(ValueError, match=r"overrides\['train.lr'\]: nan is not a finite number"):
        bindings_of({"train.lr": float("nan")})


def test_resolve_config_takes_paths_and_recipe_names():
    assert resolve_config("tiny_cpu") == [str(REPO / "experiments" / "configs" / "tiny_cpu.gin")]
    with pytest.raises(FileNotFoundError, match="'nope' is not a file.*'tiny_cpu'"):
        resolve_config("nope")


# ---------------------------------------------------------------------------------------
# Python objects reach the run's processes by name
def test_callable_spec_names_module_level_functions_and_refuses_lambdas_and_locals():
    assert callable_spec(module_level_reward) == "test_python_api:module_level_reward"
    assert callable_spec("verifier") == "verifier"
    with pytest.raises(ValueError, match="is a lambda.*define it with `def` at the top level"):
        callable_spec(lambda prompts, completions: [])

    def local(prompts, completions):
        return []

    with pytest.raises(ValueError, match="defined inside another function.*top level of a module"):
        callable_spec(local)
    with pytest.raises(TypeError, match="is not callable"):
        callable_spec(3)


def test_callable_spec_names_a_scripts_function_by_its_file(tmp_path, monkeypatch):
    """A function of the script being run (module __main__) is named by the script's file, importable in children."""
    import importlib.util

    script = tmp_path / "my_script.py"
    script.write_text("def my_reward(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n")
    spec = importlib.util.spec_from_file_location("__main__", script)
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    assert callable_spec(main.my_reward) == "my_script:my_reward"
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    child = subprocess.run([sys.executable, "-c", "import my_script; print(my_script.my_reward(None, [1, 2]))"],
                           capture_output=True, text=True, cwd="/", env=dict(os.environ))
    assert child.stdout.strip() == "[1.0, 1.0]", child.stderr


def test_train_refuses_a_lambda_and_bad_settings_before_any_run_directory(tmp_path):
    run_dir = tmp_path / "runs" / "x"
    with pytest.raises(ValueError, match="is a lambda"):
        scalerl.train("tiny_cpu", run_dir=run_dir, reward_funcs=[lambda p, c: []])
    with pytest.raises(ValueError, match="2 weights for 1 reward_funcs"):
        scalerl.train("tiny_cpu", run_dir=run_dir, reward_funcs=[module_level_reward], reward_weights=[1.0, 2.0])
    from components.trainer.config import ConfigError

    with pytest.raises(ConfigError, match="train.update_epochs = 0 is out of range"):
        scalerl.train("tiny_cpu", {"update_epochs": 0}, run_dir=run_dir)
    assert not run_dir.exists()


def test_a_dataset_is_saved_in_the_run_directory_and_read_by_hf_dataset(tmp_path):
    """The Dataset the API saves (save_to_disk) is what the hf_dataset task trains on, in any process."""
    import datasets

    from components.tasks.hf_dataset import HFDatasetTask
    from scalerl.api import _dataset_overrides, save_datasets

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(12)]
    train, held = datasets.Dataset.from_list(rows[:9]), datasets.Dataset.from_list(rows[9:])
    path = save_datasets(tmp_path / "run", train, held)
    assert path == tmp_path / "run" / "dataset" and (path / "dataset_dict.json").is_file()
    assert save_datasets(tmp_path / "run", train, held) == path  # a resumed run: the same data, kept
    with pytest.raises(ValueError, match="already holds another dataset"):
        save_datasets(tmp_path / "run", held, train)
    settings = _dataset_overrides(path, True, {"system_prompt": "Be brief."})
    assert settings["train.task"] == "hf_dataset"
    task = HFDatasetTask(**settings["train.task_kwargs"])
    assert len(task.train_problems()) == 9 and len(task.eval_problems()) == 3
    first = task.train_problems()[0]
    assert first.meta["messages"][-1] == {"role": "user", "content": first.prompt} and first.answer in {"1", "2", "3", "4",
                                                                                                     "5", "6", "7", "8", "9"}
    with pytest.raises(ValueError, match="set by the Python API"):
        _dataset_overrides(path, True, {"split": "x"})
    with pytest.raises(ValueError, match="has no split 'dev'; its splits: \\['test', 'train'\\]"):
        HFDatasetTask(path=str(path), split="dev")


# ---------------------------------------------------------------------------------------
# the analysis verbs on synthetic run directories
def _study(root: Path) -> Path:
    write_sweep(root, "loss_type", "train.loss", {"cispo": (0.6, 1.8, 1.0), "gspo": (0.5, 1.8, 1.0)},
                seeds=(0, 1, 2), noise=0.01, final_compute=10.0, **RUN_KW)
    return root


def test_load_runs_is_one_row_per_run_with_its_settings_and_summary(tmp_path):
    root = _study(tmp_path)
    table = scalerl.load_runs(root)
    assert len(table) == 6 and table["run"].is_unique
    assert {"status", "n_steps", "flops", "last_pass_rate", "best_pass_rate", "train.seed", "train.recipe"} <= set(table)
    assert sorted(table["train.seed"]) == [0, 0, 1, 1, 2, 2]
    evals = scalerl.load_runs  # the per-evaluation view stays analysis.load_runs's
    from analysis import load_runs as per_eval

    ev = per_eval(root)
    best = ev.groupby("run")["pass_rate"].max()
    assert all(table.set_index("run")["best_pass_rate"][r] == best[r] for r in best.index)
    assert evals is scalerl.load_runs
    with pytest.raises(FileNotFoundError, match="no such runs directory"):
        scalerl.load_runs(tmp_path / "nope")


def test_run_settings_reads_every_binding_of_config_gin(tmp_path):
    (tmp_path / "config.gin").write_text(textwrap.dedent("""\
        import components.warm_start
        model.path = @warm_start()
        train.lr = 0.002
        train.curriculum = ['uniform']
        cispo.eps_max = 4.0
        scope/train.seed = 3
    """))
    assert run_settings(tmp_path) == {"model.path": "@warm_start()", "train.lr": 0.002, "train.curriculum": ["uniform"],
                                      "cispo.eps_max": 4.0, "scope/train.seed": 3}
    assert run_settings(tmp_path / "none") == {}


def test_compare_returns_the_pairs_scalerl_compare_prints(tmp_path, capsys):
    from experiments.cli import main

    root = _study(tmp_path)
    pairs = scalerl.compare(root)
    assert main(["compare", str(root), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(pairs) == len(printed) == 3  # one pair x A, tail, auc
    for row, want in zip(pairs.to_dict(orient="records"), printed):
        assert {k: row[k] for k in ("a", "b", "metric", "verdict", "n", "paired")} == \
               {k: want[k] for k in ("a", "b", "metric", "verdict", "n", "paired")}
        if want["delta"] is not None:
            assert row["delta"] == pytest.approx(want["delta"])
    tail = pairs[pairs.metric == "tail"].iloc[0]
    assert {tail.a, tail.b} == {"cispo", "gspo"} and tail.paired
    assert (tail.delta > 0) == (tail.a == "cispo")  # cispo's asymptote is higher
    assert list(scalerl.compare(root, metric="tail").metric) == ["tail"]
    with pytest.raises(TypeError, match="unknown option 'metrc'.*'metric'"):
        scalerl.compare(root, metrc="A")


def test_fit_returns_the_per_run_table_scalerl_fit_writes(tmp_path, capsys):
    from experiments.cli import main

    root = _study(tmp_path)
    fits = scalerl.fit(root, min_compute="none")
    assert len(fits) == 6 and {"A", "B", "C_mid", "rank", "tail"} <= set(fits)
    assert main(["fit", str(root), "--min-compute", "none", "--csv", str(tmp_path / "out") + "/"]) == 0
    csv = pd.read_csv(tmp_path / "out" / "fits.csv")
    merged = fits.merge(csv, on="run", suffixes=("", "_csv"))
    assert len(merged) == 6 and (merged["A"] - merged["A_csv"]).abs().max() < 1e-9
    by_config = fits.groupby("config")["A"].mean()
    assert by_config["cispo"] == pytest.approx(0.6, abs=0.05) and by_config["gspo"] == pytest.approx(0.5, abs=0.05)
    assert len(scalerl.fit(root, what="configs", min_compute="none")) == 2
    with pytest.raises(ValueError, match="what = 'x'; valid"):
        scalerl.fit(root, what="x")


# ---------------------------------------------------------------------------------------
# sweep: the CLI's spec handling, planning and executors
def test_sweep_dry_run_lists_the_planned_runs(tmp_path):
    plan = scalerl.sweep("update_epochs", scale="tiny", runs=tmp_path, dry_run=True)
    assert list(plan["run"]) == ["update_epochs1-s0", "update_epochs2-s0", "update_epochs4-s0"]
    assert all("train.update_epochs = 4" in b for b in plan[plan.run == "update_epochs4-s0"]["bindings"])
    assert not any(tmp_path.iterdir())
    from experiments.recipes import SweepError

    with pytest.raises(SweepError):
        scalerl.sweep("no_such_sweep", runs=tmp_path, dry_run=True)


def test_sweep_runs_with_the_debug_executor_and_returns_its_runs(tmp_path, monkeypatch):
    from _helpers_sweep import FAKE_RECIPE

    monkeypatch.syspath_prepend(str(HERE))
    (tmp_path / "recipe.gin").write_text(FAKE_RECIPE)
    spec = tmp_path / "fake.gin"
    spec.write_text('sweep.name = "fake"\nsweep.base = "recipe.gin"\nsweep.tiny_base = "recipe.gin"\n'
                    'sweep.factor = "train.loss"\nsweep.values = ["dapo", "cispo"]\n'
                    'sweep.tiny_overrides = ["train.total_steps = 3"]\nsweep.seeds = [0]\n')
    table = scalerl.sweep(spec, scale="tiny", executor="debug", runs=tmp_path / "runs",
                          target="_helpers_sweep:fake_training")
    assert sorted(table["run"]) == ["cispo-s0", "dapo-s0"] and set(table["status"]) == {"done"}
    assert sorted(table["value"]) == ["cispo", "dapo"] and set(table["factor"]) == {"train.loss"}


# ---------------------------------------------------------------------------------------
# end to end: the example (train with a Dataset and weighted rewards, load_runs, compare), then evaluate
@pytest.mark.slow
def test_the_python_api_example_trains_compares_and_evaluates(tmp_path):
    runs = tmp_path / "python_api"
    env = {**os.environ, "SCALERL_EXAMPLE_QUICK": "1"}
    done = subprocess.run([sys.executable, str(REPO / "docs" / "examples" / "python_api.py"), "--runs", str(runs)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = scalerl.load_runs(runs).set_index("run")
    assert set(table.index) == {"default", "dataset_rewards"} and set(table["status"]) == {"done"}
    assert table.loc["dataset_rewards", "train.task"] == "hf_dataset"
    assert table.loc["dataset_rewards", "train.reward_funcs"] == ["python_api:answer_reward", "python_api:format_reward",
                                                                   "verifier"]
    assert table.loc["dataset_rewards", "train.reward_weights"] == [0.5, 0.25, 1.0]
    assert (runs / "dataset_rewards" / "dataset" / "dataset_dict.json").is_file()
    metrics = [json.loads(line) for line in (runs / "dataset_rewards" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/answer_reward", "reward/format_reward", "reward/verifier"} <= set(metrics[-1])
    assert "nothing to compare" not in done.stdout and "verdict" in done.stdout
    records = scalerl.evaluate(runs / "dataset_rewards", k=1, limit=4)
    assert list(records["benchmark"]) == ["held_out"] and 0.0 <= records["mean@k"].iloc[0] <= 1.0
