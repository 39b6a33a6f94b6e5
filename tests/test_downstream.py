"""Downstream benchmarks: the unbiased pass@k estimator (float64 references), benchmark files
through `datasets` (math-verify and sandboxed code grading), evaluate_benchmark /
evaluate_downstream records, and `scalerl eval` on a model directory and on a run directory."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from components.benchmarks import load_benchmark, load_benchmarks
from components.trainer.evaluation import (
    benchmark_scores,
    downstream_due,
    evaluate_benchmark,
    evaluate_downstream,
    is_downstream_record,
    pass_at_k,
    pass_ks,
)
from test_mixture import ScriptedEngine

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=256, seed=0)


# ----------------------------------------------------------------------------- the estimator
def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_subset_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_exact_where_binomials_overflow_a_float():
    n = 2000
    with pytest.raises(OverflowError):
        float(math.comb(n, 1000))  # the textbook formula in floats cannot even be formed
    for c in (0, 1, 7, 500, 1999, 2000):
        for k in (1, 10, 100, 1000, 1993, 2000):
            exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # exact rational reference
            assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-11, abs=1e-15), (c, k)
    assert pass_at_k(n, 7, 1) == pytest.approx(7 / n, rel=1e-14)  # pass@1 is the mean


def test_pass_at_k_rejects_bad_counts():
    for n, c, k in ((0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
            pass_at_k(n, c, k)


def test_pass_ks_and_benchmark_scores():
    assert pass_ks(16) == [1, 2, 4, 8, 16] and pass_ks(10) == [1, 2, 4, 8, 10] and pass_ks(1) == [1]
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_ks(0)
    s = benchmark_scores([0, 2, 4], n=4)
    assert s["mean@k"] == pytest.approx((0 + 0.5 + 1) / 3)
    assert s["pass@k"]["1"] == pytest.approx(s["mean@k"])
    assert s["pass@k"]["2"] == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)  # C(2,2)/C(4,2) = 1/6
    assert s["pass@k"]["4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        benchmark_scores([5], n=4)


# ----------------------------------------------------------------------------- benchmark files
def _math_rows():
    return [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "Write 3/4 as a decimal.", "answer": "0.75"},
            {"problem": "What is 2*3?", "answer": 6}]


@pytest.fixture
def math_files(tmp_path):
    import pandas as pd

    rows = _math_rows()
    jl = tmp_path / "aime_mini.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = pd.DataFrame([{**r, "answer": str(r["answer"])} for r in rows])
    pq, csv = tmp_path / "mini.parquet", tmp_path / "mini.csv"
    df.to_parquet(pq)
    df.rename(columns={"problem": "question", "answer": "final_answer"}).to_csv(csv, index=False)
    return {"jsonl": jl, "parquet": pq, "csv": csv}


def test_math_benchmark_from_jsonl_parquet_csv(math_files):
    for kind, path in math_files.items():
        b = load_benchmark(str(path))
        assert b.grader == "math" and len(b) == 3, kind
        assert b.name == path.stem
        p1 = b.problems[1]
        assert "3/4" in p1.prompt and "\\boxed{}" in p1.prompt
        assert b.task.verify(p1, "<think>three quarters</think> so \\boxed{\\frac{3}{4}}").passed, kind
        assert not b.task.verify(p1, "<think>\\boxed{0.75}</think> \\boxed{0.7}").passed  # graded after </think>
        assert not b.task.verify(p1, "<think>never closed \\boxed{0.75}").passed
        assert b.task.verify(b.problems[2], "\\boxed{6}").passed


def test_benchmark_spec_options_and_errors(math_files, tmp_path):
    b = load_benchmark({"path": str(math_files["jsonl"]), "name": "aime24", "limit": 2, "system_prompt": "Be brief."})
    assert b.name == "aime24" and len(b) == 2 and b.problems[0].meta["system_prompt"] == "Be brief."
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_benchmark(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown key"):
        load_benchmark({"path": str(math_files["jsonl"]), "colums": {}})
    with pytest.raises(ValueError, match="no prompt column"):
        load_benchmark(_only(tmp_path, "answer"))
    with pytest.raises(ValueError, match="needs an answer column"):
        load_benchmark(_only(tmp_path, "problem"))
    with pytest.raises(ValueError, match="no answer column 'gold'"):
        load_benchmark({"path": str(math_files["jsonl"]), "answer_column": "gold"})
    with pytest.raises(ValueError, match="grader must be one of"):
        load_benchmark({"path": str(math_files["jsonl"]), "grader": "maths"})
    with pytest.raises(ValueError, match=r"named \['aime_mini'\]"):
        load_benchmarks([str(math_files["jsonl"]), str(math_files["jsonl"])])


def _only(tmp_path, column: str) -> str:
    p = tmp_path / f"only_{column}.jsonl"
    p.write_text(json.dumps({column: "1"}) + "\n")
    return str(p)


def test_code_benchmark_is_graded_in_the_sandbox(tmp_path):
    rows = [
        {"question": "Read a and b, print a+b.", "tests": json.dumps([{"input": "1 2\n", "output": "3\n"},
                                                                     {"input": "5 7\n", "output": "12\n"}])},
        {"question": "Write double(x).", "tests": [{"input": "3", "output": "6", "testtype": "functional"}],
         "metadata": json.dumps({"func_name": "double"})},
    ]
    path = tmp_path / "lcb_mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    b = load_benchmark({"path": str(path), "wall_seconds": 5, "cpu_seconds": 2})
    assert b.grader == "code" and len(b) == 2
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    bad = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    assert b.task.verify(b.problems[0], good).passed
    assert not b.task.verify(b.problems[0], bad).passed
    assert b.task.verify(b.problems[1], "<think>easy</think>```python\ndef double(x):\n    return 2 * x\n```").passed
    assert not b.task.verify(b.problems[1], "```python\ndef double(x):\n    return x\n```").passed
    with pytest.raises(ValueError, match="only apply to grader 'code'"):
        load_benchmark({"path": str(path), "grader": "math", "answer_column": "question", "wall_seconds": 5})


# ----------------------------------------------------------------------------- records
def _scripted(b, correct_per_problem, k):
    """An engine whose sample j of problem i is right iff j < correct_per_problem[i]."""
    from components.models import make_char_tokenizer

    tok = make_char_tokenizer()
    answer = lambda i, j: f"\\boxed{{{b.problems[i].answer}}}" if j < correct_per_problem[i] else "\\boxed{99}"
    return ScriptedEngine(tok, answer, lambda n: ([-0.5] * n, [False] * n)), tok


def test_evaluate_benchmark_record(math_files):
    b = load_benchmark(str(math_files["jsonl"]))
    correct, k = [0, 3, 8], 8
    engine, tok = _scripted(b, correct, k)
    rec = evaluate_benchmark(engine, b, tok, k=k, seed=0, max_tokens=32)
    assert rec["benchmark"] == "aime_mini" and rec["k"] == 8 and rec["prompts"] == 3
    assert set(rec["pass@k"]) == {"1", "2", "4", "8"}
    assert rec["mean@k"] == pytest.approx(np.mean(np.array(correct) / k))
    for kk in (1, 2, 4, 8):
        ref = np.mean([brute_force_pass_at_k(k, c, kk) for c in correct])
        assert rec["pass@k"][str(kk)] == pytest.approx(ref, abs=1e-12)
    assert rec["entropy"] == pytest.approx(0.5) and "pass_rate" not in rec  # never read as the held-out curve
    assert is_downstream_record(rec) and not is_downstream_record({"pass_rate": 0.3, "step": 1})


def test_evaluate_downstream_follows_the_config(math_files):
    benches = load_benchmarks([str(math_files["jsonl"]), {"path": str(math_files["csv"]), "name": "csv_bench"}])
    cfg = SimpleNamespace(downstream_every=5, downstream_benchmarks=("a", "b"), downstream_k=4, eval_temperature=None,
                          temperature=1.0, top_p=1.0, max_tokens=16, seed=0, verifier_timeout_s=5.0)
    assert [downstream_due(cfg, s) for s in (0, 3, 5, 7)] == [True, False, True, False]
    assert downstream_due(cfg, 7, last=True)
    assert not downstream_due(SimpleNamespace(downstream_every=0, downstream_benchmarks=("a",)), 0)
    engine, tok = _scripted(benches[0], [4, 0, 2], 4)
    recs = evaluate_downstream(engine, benches, tok, cfg, step=5)
    assert [r["benchmark"] for r in recs] == ["aime_mini", "csv_bench"] and all(r["k"] == 4 for r in recs)
    assert recs[0]["mean@k"] == pytest.approx(0.5)


def test_config_fields_and_validation():
    from components.trainer.config import ConfigError, TrainConfig, validate

    base = TrainConfig(model_path="/nowhere")
    assert base.downstream_every == 0 and base.downstream_benchmarks == () and base.downstream_k == 16
    with pytest.raises(ConfigError, match="downstream_benchmarks is empty"):
        validate(base.replace(downstream_every=10))
    with pytest.raises(ConfigError, match="downstream_k"):
        validate(base.replace(downstream_k=0))
    assert base.replace(downstream_benchmarks=("/a.jsonl",)).to_dict()["downstream_benchmarks"] == ["/a.jsonl"]


# ----------------------------------------------------------------------------- scalerl eval
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from components.models import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("eval") / "tiny", **TINY)


def test_scalerl_eval_on_a_model_directory(tiny, math_files, tmp_path, capsys):
    from experiments.cli import main

    rc = main(["eval", str(tiny), "--benchmark", str(math_files["jsonl"]), "--benchmark", str(math_files["csv"]),
               "--k", "4", "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mean@k" in out and "pass@4" in out and "aime_mini" in out
    lines = [json.loads(x) for x in (tiny / "downstream.jsonl").read_text().splitlines()]
    assert [r["benchmark"] for r in lines[-2:]] == ["aime_mini", "mini"]
    r = lines[-1]
    assert r["model"] == str(tiny.resolve()) and r["k"] == 4 and set(r["pass@k"]) == {"1", "2", "4"}
    assert 0.0 <= r["mean@k"] <= 1.0 and r["engine"] == "torch" and r["step"] is None
    # --out, --limit and --json
    out_file = tmp_path / "res.jsonl"
    assert main(["eval", str(tiny), "--benchmark", str(math_files["parquet"]), "--k", "2", "--max-tokens", "4",
                 "--limit", "1", "--out", str(out_file), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert rec["prompts"] == 1 and json.loads(out_file.read_text())["prompts"] == 1


def test_scalerl_eval_input_errors(tiny, math_files, tmp_path, capsys):
    from experiments.cli import main

    assert main(["eval", str(tmp_path / "nope"), "--benchmark", str(math_files["jsonl"])]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty"), "--benchmark", str(math_files["jsonl"])]) == 2
    assert "neither a model directory" in capsys.readouterr().err
    assert main(["eval", str(tiny), "--benchmark", str(math_files["jsonl"]), "--k", "0"]) == 2
    assert "--k must be >= 1" in capsys.readouterr().err
    assert main(["eval", str(tiny), "--benchmark", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", str(tiny), "--benchmark", str(math_files["jsonl"]), "--engine", "vlm"]) == 2
    assert "vllm" in capsys.readouterr().err  # the registry names the engines


def test_scalerl_eval_on_a_run_directory(tiny, math_files, tmp_path, capsys):
    """A run directory: final/ when present; otherwise (or with --step) its checkpoint, exported."""
    import shutil

    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.checkpoint import save_checkpoint
    from experiments.cli import main

    run = tmp_path / "run"
    model, tok = load_causal_lm(tiny), load_tokenizer(tiny)
    save_checkpoint(run / "checkpoints", 3, model=model, optimizer=None, scheduler_state=None,
                    trainer_state={"step": 3}, rank_state=None, tokenizer=tok)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "compute_hours": 0.01 * s}) + "\n" for s in (1, 2, 3)))
    assert main(["eval", str(run), "--benchmark", str(math_files["jsonl"]), "--k", "2", "--max-tokens", "4"]) == 0
    rec = json.loads((run / "downstream.jsonl").read_text().splitlines()[-1])
    assert rec["step"] == 3 and rec["compute_hours"] == pytest.approx(0.03) and rec["checkpoint"].endswith("step_00000003")
    assert rec["model"] is None and not list(run.glob(".scalerl-eval-*"))  # the temporary export is gone
    shutil.copytree(tiny, run / "final")
    capsys.readouterr()
    assert main(["eval", str(run), "--benchmark", str(math_files["jsonl"]), "--k", "2", "--max-tokens", "4"]) == 0
    rec = json.loads((run / "downstream.jsonl").read_text().splitlines()[-1])
    assert rec["model"] == str((run / "final").resolve()) and rec["checkpoint"] is None and rec["step"] == 3
    assert main(["eval", str(run), "--benchmark", str(math_files["jsonl"]), "--step", "7"]) == 2
    assert "step 7" in capsys.readouterr().err


def test_scalerl_eval_with_a_user_reward_from_outside_the_package(tiny, math_files, tmp_path, monkeypatch, capsys):
    """--import a user's file registering a plain-function reward, then grade a benchmark with it."""
    from experiments.cli import main

    (tmp_path / "my_bench_reward.py").write_text(
        "from components.registry import REWARDS\n\n"
        "@REWARDS.register('bench_always_half')\n"
        "def bench_always_half(prompt, completion, **row):\n"
        "    assert 'answer' in row and 'problem' in row  # the whole row, plus the answer\n"
        "    return 0.5\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.jsonl"
    args = ["eval", str(tiny), "--benchmark", str(math_files["jsonl"]), "--k", "2", "--max-tokens", "3",
            "--import", "my_bench_reward", "--reward", "bench_always_half", "--out", str(out)]
    assert main(args + ["--pass-threshold", "0.4"]) == 0
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["grader"] == "reward" and rec["mean@k"] == 1.0 and rec["eval_verifier_errors"] == 0
    assert main(args + ["--pass-threshold", "0.6"]) == 0
    assert json.loads(out.read_text().splitlines()[-1])["mean@k"] == 0.0
    assert main(args[:-4] + ["--import", "no_such_module_xyz"]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err


def test_a_downstream_reward_is_called_with_the_runs_resolved_values_gin_unread(math_files):
    """A plain-function reward grading a downstream benchmark is in the run's component table with its
    bindings, and a generator (which reads no gin) calls it with those values, not its defaults."""
    import gin

    from components.registry import REWARDS
    from experiments.train import check_config

    name = "bench_scaled_reward"

    @REWARDS.register(name)
    def scaled(prompt, completion, *, scale=1.0, **row):
        return 0.25 * scale

    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / "experiments" / "configs" / "tiny_cpu.gin")
    try:
        spec = {"path": str(math_files["jsonl"]), "reward": name, "pass_threshold": 0.4}
        cfg, _, _ = check_config([config], [f"train.downstream_benchmarks = [{spec!r}]", f"{name}.scale = 2.0"],
                                 read_data=False, on_this_machine=False)
        assert cfg.params_of("rewards", name) == {"scale": 2.0}
        gin.clear_config()  # what a generator sees: no gin
        bench, = load_benchmarks(cfg.downstream_benchmarks, lambda n: cfg.params_of("rewards", n))
        verdict = bench.task.verify(bench.problems[0], "anything")
        assert (verdict.reward, verdict.passed) == (0.5, True)  # 0.25 x the bound scale 2.0
        unresolved, = load_benchmarks(cfg.downstream_benchmarks)  # no run's values: gin's, empty here
        assert unresolved.task.verify(bench.problems[0], "anything").reward == 0.25
    finally:
        REWARDS.unregister(name)
        gin.clear_config()
