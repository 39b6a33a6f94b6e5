"""`scalerl eval RUN_DIR` with the run's own settings (issue 33 item 4; issue 43 item 6).

A run directory is evaluated as it was trained: its completion budget and forced interruptions,
precision, evaluation temperature and prompt format, read from its config.gin, unless a flag
says otherwise; a model directory keeps the defaults. Bad flag values are exit-2 errors (no
traceback), `--step N` names the steps there are, `--dump FILE` writes every completion.

Without --benchmark, a run directory is evaluated on its own task's held-out set with its own
settings (train.eval_k, train.eval_prompts, the sampling knobs), and a run whose gin imported a
user module is evaluable from any working directory while the module's file is where it was.

One tiny run (2 steps, a checkpoint at each) is trained once for the module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers_trainer import tiny_model, write_gin

REPO = Path(__file__).resolve().parents[1]

BENCH_ROWS = [{"problem": "3+4", "answer": "7"}, {"problem": "Q: 5+6=", "answer": "11"}, {"problem": "2+9", "answer": "11"}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run whose settings all differ from `scalerl eval`'s defaults: max_tokens 8 under
    forced interruptions, bf16_fp32_head, eval temperature 0.7, prompts 'Q: {expr}='."""
    from experiments.train import run_training

    root = tmp_path_factory.mktemp("eval_run")
    gin_file = write_gin(root / "run.gin", tiny_model(root), train__total_steps="2", train__checkpoint_every="1",
                         train__eval_every="100", train__max_tokens="8", train__eval_temperature="0.7",
                         train__length_control='"interruption"', interruption__thinking_min="3",
                         interruption__thinking_max="5", interruption__answer_budget="3",
                         interruption__phrase='"</think>"', train__precision='"bf16_fp32_head"',
                         arithmetic__prompt_template='"Q: {expr}="', train__top_k="5", train__min_p="0.01")
    run_dir = root / "run"
    assert run_training([gin_file], [], str(run_dir), progress=False) == "done"
    assert (run_dir / "final" / "config.json").is_file() and (run_dir / "config.gin").is_file()
    bench = root / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in BENCH_ROWS))
    return {"dir": run_dir, "bench": bench}


def _last_record(path: Path) -> dict:
    return json.loads(Path(path).read_text().splitlines()[-1])


def test_eval_of_a_run_uses_its_own_settings_and_dumps_every_completion(run, tmp_path, capsys):
    """No flags: the run's max_tokens (8, not 1024: the 128-position model fits it), forced
    interruptions, bf16_fp32_head, eval temperature 0.7 and prompt format; --dump writes one
    graded line per completion."""
    import gin

    from experiments.cli import main

    dump = tmp_path / "completions.jsonl"
    out = tmp_path / "records.jsonl"
    assert main(["eval", str(run["dir"]), "--benchmark", str(run["bench"]), "--k", "4", "--dump", str(dump),
                 "--out", str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"from {(run['dir'] / 'config.gin').resolve()}" in printed, printed
    for line in ("max_tokens      8  [run]", "temperature     0.7  [run]", "'bf16_fp32_head'  [run]",
                 "length_control  interruption(thinking_min=3, thinking_max=5, answer_budget=3",
                 "prompt_template 'Q: {problem}='  [run]"):
        assert line in printed, (line, printed)
    assert "pass@4" in printed and f"wrote every completion to {dump}" in printed
    rec = _last_record(out)
    assert rec["max_tokens"] == 8 and rec["temperature"] == 0.7 and rec["top_p"] == 1.0
    assert rec["precision"] == "bf16_fp32_head" and rec["prompt_template"] == "Q: {problem}="
    assert (rec["top_k"], rec["min_p"], rec["repetition_penalty"]) == (5, 0.01, 1.0)  # the run's sampling knobs
    assert rec["length_control"].startswith("interruption(") and rec["sampled_token_cap"] == 8  # 5 + 3
    assert set(rec["settings_from"].values()) == {"run"} and rec["step"] == 2
    with pytest.raises(ValueError):  # the run's bindings do not stay behind in gin
        gin.query_parameter("train.max_tokens")

    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    assert len(rows) == len(BENCH_ROWS) * 4  # one line per completion
    assert sorted((r["problem_index"], r["sample_index"]) for r in rows) == [(i, j) for i in range(3) for j in range(4)]
    assert {"benchmark", "prompt", "rendered_prompt", "completion", "answer", "passed", "reward", "error",
            "finish_reason", "completion_tokens", "step"} <= set(rows[0])
    by_problem = {r["problem_index"]: r for r in rows}
    # the run's format; a problem already written in it is not wrapped twice
    assert [by_problem[i]["prompt"] for i in range(3)] == ["Q: 3+4=", "Q: 5+6=", "Q: 2+9="]
    assert [by_problem[i]["answer"] for i in range(3)] == ["7", "11", "11"]
    assert all(isinstance(r["passed"], bool) and r["reward"] in (1.0, -1.0) for r in rows)
    assert all(r["completion_tokens"] <= 8 and r["step"] == 2 for r in rows)
    assert sum(r["passed"] for r in rows) / len(rows) == pytest.approx(rec["mean@k"])


def test_flags_override_the_run_and_a_model_directory_keeps_the_defaults(run, tmp_path, capsys):
    from experiments.cli import main

    out = tmp_path / "records.jsonl"
    args = ["eval", str(run["dir"]), "--benchmark", str(run["bench"]), "--k", "2", "--out", str(out)]
    assert main(args + ["--max-tokens", "5", "--temperature", "0", "--length-control", "none", "--precision", "fp32",
                        "--prompt-template", "{problem}"]) == 0
    rec = _last_record(out)
    assert (rec["max_tokens"], rec["temperature"], rec["precision"], rec["length_control"]) == (5, 0.0, "fp32", None)
    assert rec["prompt_template"] == "{problem}" and rec["top_p"] == 1.0
    assert {k: v for k, v in rec["settings_from"].items() if v == "run"} == {
        "engine": "run", "top_p": "run", "top_k": "run", "min_p": "run", "repetition_penalty": "run", "system_prompt": "run"}
    capsys.readouterr()
    # the run's final/ policy copied out of the run: a plain model directory, evaluated with the defaults
    model = tmp_path / "model"
    shutil.copytree(run["dir"] / "final", model)
    assert main(["eval", str(model), "--benchmark", str(run["bench"]), "--k", "2", "--max-tokens", "4",
                 "--out", str(out)]) == 0
    rec = _last_record(out)
    assert (rec["temperature"], rec["precision"], rec["length_control"], rec["prompt_template"]) == (1.0, "fp32", None, None)
    assert rec["settings_from"]["max_tokens"] == "flag" and rec["settings_from"]["temperature"] == "default"
    assert rec["run_config"] is None
    # the default budget (1024) does not fit this model's 128 positions: the run's own (8) is what made it work
    assert main(["eval", str(model), "--benchmark", str(run["bench"]), "--k", "2", "--out", str(out)]) == 2
    assert "max_position_embeddings (128)" in capsys.readouterr().err


def test_step_picks_a_checkpoint_and_an_unknown_step_names_those_there_are(run, tmp_path, capsys):
    from experiments.cli import main

    out = tmp_path / "records.jsonl"
    args = ["eval", str(run["dir"]), "--benchmark", str(run["bench"]), "--k", "2", "--out", str(out)]
    assert main(args + ["--step", "1"]) == 0
    rec = _last_record(out)
    assert rec["step"] == 1 and rec["checkpoint"].endswith("step_00000001") and rec["max_tokens"] == 8
    capsys.readouterr()
    assert main(args + ["--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 7" in err and "steps 1, 2" in err and "final/" in err and "(step 2)" in err, err
    assert "Traceback" not in err


def test_the_run_s_engine_is_the_default_and_one_not_installed_here_says_how_to_evaluate_anyway(run, tmp_path, capsys):
    """A run that generated with vLLM is evaluated with vLLM unless --engine says otherwise; where vLLM is
    not installed (this machine), the error names the run's setting and the flag, before any model loads."""
    from experiments.cli import main

    vllm_run = tmp_path / "vllm_run"
    shutil.copytree(run["dir"], vllm_run, ignore=shutil.ignore_patterns("checkpoints"))
    gin_text = (vllm_run / "config.gin").read_text()
    assert "train.engine = 'torch'" in gin_text
    (vllm_run / "config.gin").write_text(gin_text.replace("train.engine = 'torch'", "train.engine = 'vllm'"))
    args = ["eval", str(vllm_run), "--benchmark", str(run["bench"]), "--k", "2", "--out", str(tmp_path / "r.jsonl")]
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "train.engine = 'vllm'" in err and "--engine torch" in err and "Traceback" not in err, err
    assert main(args + ["--engine", "torch"]) == 0
    out = capsys.readouterr().out
    assert "engine          'torch'  [flag]" in out, out
    assert _last_record(tmp_path / "r.jsonl")["engine"] == "torch"


@pytest.mark.parametrize("flags, message", [
    (["--precision", "fp16"], "Registered precision policy names: bf16, bf16_fp32_head, fp32"),
    (["--k", "-1"], "--k must be >= 1"),
    (["--step", "-3"], "--step must be >= 0"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--length-control", "interupt"], "Did you mean 'interruption'?"),
    (["--limit", "0"], "limit must be >= 1"),
    (["--reward", "nope"], "Registered reward names:"),
    (["--pass-threshold", "nan"], "--pass-threshold must be a finite number"),
])
def test_bad_flag_values_are_usage_errors(run, flags, message, capsys):
    from experiments.cli import main

    assert main(["eval", str(run["dir"]), "--benchmark", str(run["bench"]), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scalerl eval: error:") and message in err and "Traceback" not in err, err


def test_the_prompt_format_of_each_task():
    """A task's prompt_template with the problem in place of its placeholder (cheap: nothing is built)."""
    from components.benchmarks import MATH_TEMPLATE, apply_template
    from experiments.eval_run_settings import _run_prompt_format

    assert _run_prompt_format("arithmetic", {})[:2] == ("{problem}=", None)
    assert _run_prompt_format("math_file", {"system_prompt": "Think."})[:2] == (MATH_TEMPLATE, "Think.")
    assert _run_prompt_format("hf_dataset", {"prompt_template": "Compute {prompt}."})[0] == "Compute {problem}."
    assert _run_prompt_format("code_file", {})[0] == "{problem}\n\n{instruction}"
    same = _run_prompt_format({"arithmetic": 0.5, "math_file": 0.5}, {"math_file": {"prompt_template": "{problem}="}})
    assert same == ("{problem}=", None, None)
    mixed = _run_prompt_format({"arithmetic": 0.5, "math_file": 0.5}, {})
    assert mixed[0] == "{problem}" and "differently" in mixed[2]
    # applying a template: a problem already in its form is kept
    assert apply_template("{problem}=", "3+4") == "3+4=" and apply_template("{problem}=", "3+4=") == "3+4="
    assert apply_template("{problem}", " 3+4 ") == "3+4"
    assert apply_template(MATH_TEMPLATE, "What is 1+1?").endswith("within \\boxed{}.")
    assert apply_template(MATH_TEMPLATE, apply_template(MATH_TEMPLATE, "What is 1+1?")).count("boxed") == 1


def test_a_run_directory_without_a_config_gets_the_defaults(tmp_path):
    from experiments.evaluate import DEFAULTS, eval_settings

    (tmp_path / "run.json").write_text("{}")
    s = eval_settings(tmp_path, {"max_tokens": 6})
    assert s.values == {**DEFAULTS, "max_tokens": 6} and s.config is None
    assert "no config.gin" in s.notes[0]


def test_no_benchmark_evaluates_the_run_s_held_out_set_with_its_settings(run, tmp_path, capsys):
    """`scalerl eval RUN_DIR`, no flags: the run's task (its prompt format, split and seed), its
    train.eval_prompts (4) of the held-out prompts, train.eval_k (2) samples each, its budget,
    interruptions, precision, temperature and sampling knobs; graded by the task's verifier."""
    from experiments.cli import main

    out = tmp_path / "records.jsonl"
    dump = tmp_path / "dump.jsonl"
    assert main(["eval", str(run["dir"]), "--out", str(out), "--dump", str(dump)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "held_out" in printed and "4 of its 8 prompts (train.eval_prompts = 4), k = 2 (train.eval_k)" in printed
    assert "top_k           5  [run]" in printed and "prompt_template None  [task]" in printed, printed
    rec = _last_record(out)
    assert rec["benchmark"] == "held_out" and rec["task"] == "arithmetic" and (rec["k"], rec["prompts"]) == (2, 4)
    assert (rec["max_tokens"], rec["temperature"], rec["precision"], rec["top_k"]) == (8, 0.7, "bf16_fp32_head", 5)
    assert rec["length_control"].startswith("interruption(") and rec["sampled_token_cap"] == 8
    assert set(rec["per_task"]) == {"arithmetic"} and rec["per_task"]["arithmetic"] == pytest.approx(rec["mean@k"])
    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    from components.tasks import make_task

    held = make_task("arithmetic", seed=0, num_train=120, num_eval=8, max_operand=12, operators="+").eval_problems()[:4]
    assert [rows[2 * i]["prompt"] for i in range(4)] == [f"Q: {p.meta['expr']}=" for p in held]  # the run's format
    assert sum(r["passed"] for r in rows) / len(rows) == pytest.approx(rec["mean@k"])
    # --k and --limit change the set's size
    assert main(["eval", str(run["dir"]), "--out", str(out), "--k", "3", "--limit", "2"]) == 0
    assert (_last_record(out)["k"], _last_record(out)["prompts"]) == (3, 2)


@pytest.mark.parametrize("flags, message", [
    (["--prompt-template", "{problem}"], "--prompt-template and --system-prompt format benchmark problems"),
    (["--reward", "exact_match"], "--reward applies to --benchmark files"),
    (["--split", "test", "--grader", "math"], "--split, --grader apply to --benchmark files"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--min-p", "2"], "--min-p must be in [0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--limit", "0"], "--limit must be >= 1"),
])
def test_held_out_flags_that_do_not_apply_are_refused(run, flags, message, capsys):
    from experiments.cli import main

    assert main(["eval", str(run["dir"]), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_model_directory_needs_a_benchmark(run, tmp_path, capsys):
    from experiments.cli import main

    model = tmp_path / "model"
    shutil.copytree(run["dir"] / "final", model)
    assert main(["eval", str(model)]) == 2
    assert "give --benchmark FILE" in capsys.readouterr().err


EVAL = [sys.executable, "-m", "experiments.cli", "eval"]


def test_a_run_that_imported_a_user_module_is_evaluable_from_anywhere(tmp_path):
    """A run whose gin says `import my_losses` (its loss), trained from the user's directory, greedy held-out
    evaluations: `scalerl eval RUN_DIR` from that directory and from elsewhere re-scores the held-out set
    exactly as the run's last evaluation did; once the module's file is gone, the error names it."""
    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(REPO / "tests" / "user_components" / "my_losses.py", user / "my_losses.py")
    gin_file = write_gin(user / "mine.gin", tiny_model(tmp_path), imports=("my_losses",), train__loss='"my_reinforce"',
                         my_reinforce__scale="0.5", train__total_steps="2", train__eval_every="2",
                         train__checkpoint_every="2", train__eval_temperature="0")
    run_dir = tmp_path / "runs" / "mine"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    train = (f"import sys; from experiments.train import run_training; "
             f"sys.exit(0 if run_training([{gin_file!r}], [], {str(run_dir)!r}, progress=False) == 'done' else 1)")
    done = subprocess.run([sys.executable, "-c", train], cwd=user, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    info = json.loads((run_dir / "run.json").read_text())
    assert {"module": "my_losses", "file": str(user / "my_losses.py"), "path": str(user)} in info["user_modules"]
    last = [e for e in _jsonl(run_dir / "eval.jsonl") if "pass_rate" in e][-1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd in (user, elsewhere):
        out = subprocess.run(EVAL + [str(run_dir), "--out", str(tmp_path / f"{cwd.name}.jsonl")], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (cwd, out.stderr[-3000:])
        rec = _last_record(tmp_path / f"{cwd.name}.jsonl")
        assert rec["benchmark"] == "held_out" and (rec["k"], rec["prompts"], rec["temperature"]) == (2, 4, 0.0)
        assert rec["step"] == last["step"] == 2 and rec["mean@k"] == pytest.approx(last["pass_rate"], abs=1e-12)
        # the same completions: as many tokens, the same log-probs (greedy, same prompts, same weights)
        assert rec["eval_tokens"] == last["eval_tokens"] and rec["eval_truncation_rate"] == last["eval_truncation_rate"]
        assert rec["entropy"] == pytest.approx(last["entropy"], rel=1e-5)
    (user / "my_losses.py").rename(tmp_path / "moved.py")
    out = subprocess.run(EVAL + [str(run_dir)], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert "module 'my_losses'" in out.stderr and str(user / "my_losses.py") in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def _jsonl(path: Path) -> list:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def test_a_stored_config_binding_a_retired_train_setting_is_read_without_it():
    """An older run's config.gin lists every train.* value, settings since removed included
    (issue 42 retired train.emulate_learner_ranks): they are dropped, with their continuation lines."""
    from experiments.eval_run_settings import without_retired_train_settings

    text = ("train.lr = 0.001\ntrain.emulate_learner_ranks = 1\ntrain.gone = {'a': 1,\n    'b': 2}\n"
            "train.seed = 3\nother.x = 1\n")
    kept, dropped = without_retired_train_settings(text)
    assert kept == "train.lr = 0.001\ntrain.seed = 3\nother.x = 1\n"
    assert dropped == ["train.emulate_learner_ranks", "train.gone"]
    assert without_retired_train_settings("train.lr = 0.1\n") == ("train.lr = 0.1\n", [])
