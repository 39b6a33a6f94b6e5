"""The mechanism meters, end to end (issue 40 item 3): real training runs log them per step and the
run table summarises them. A synchronous run shows lag 0 and ratios at 1; a run whose learner takes
several steps per generation at a planted large learning rate shows DAPO clipping on both sides."""

from __future__ import annotations

import math

import pytest

from _helpers_trainer import read_jsonl, tiny_model, write_gin

PER_STEP = ("completion_tokens_p10", "completion_tokens_p50", "completion_tokens_p90", "clip_frac_low",
            "clip_frac_high", "ratio_p01", "ratio_p05", "ratio_p50", "ratio_p95", "ratio_p99", "lag_p50", "lag_p90",
            "lag_mean", "lag_max", "logprob_gap_lag0", "zero_variance_frac", "truncation_rate", "interrupted_frac")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("meters_model"))


def _run(tmp_path, model_path, name, **overrides):
    from analysis.runs import load_runs
    from experiments.train import run_training

    gin_file = write_gin(tmp_path / f"{name}.gin", model_path, train__loss='"dapo"', train__total_steps="8",
                         train__eval_every="8", **overrides)
    run_dir = tmp_path / "meters" / name
    assert run_training([gin_file], [], str(run_dir), run_info={"name": name, "sweep": "meters"},
                        progress=False) == "done"
    table = load_runs(run_dir, what="runs").iloc[0]
    return read_jsonl(run_dir / "metrics.jsonl"), table


def test_a_synchronous_run_shows_lag_0_and_no_clipping(tmp_path, model_path):
    metrics, table = _run(tmp_path, model_path, "sync", ppo_off_policy__k="1")
    for m in metrics:
        assert not set(PER_STEP) - set(m), set(PER_STEP) - set(m)
        assert m["lag_max"] == 0 and m["lag_mean"] == 0 and m["lag_p90"] == 0
        # the weights that sampled are the weights trained on (fp32 on both sides): ratio 1 up to kernels
        assert abs(m["ratio_p01"] - 1) < 1e-3 and abs(m["ratio_p99"] - 1) < 1e-3
        assert m["clip_frac_low"] == 0 and m["clip_frac_high"] == 0
        assert m["completion_tokens_p10"] <= m["completion_tokens_p50"] <= m["completion_tokens_p90"] <= 6
    assert table["lag_max"] == 0 and table["clip_frac_low"] == 0 and table["clip_frac_high"] == 0
    assert table["logprob_gap"] < 1e-3 and math.isnan(table["pool_left_min"])  # uniform sampling keeps no pool


def test_a_planted_large_learning_rate_shows_clipping_and_lag(tmp_path, model_path):
    """ppo_off_policy k = 4: one generation with frozen weights, then four learner steps on its four
    mini-batches; at lr 0.05 the policy moves far between them, so the ratio leaves DAPO's
    [0.8, 1.28] on both sides and tokens are 0..3 versions old."""
    # a task the random tiny policy sometimes solves (0..2 + 0..2), 8 samples a prompt: rewards vary,
    # so advantages are non-zero and the clip has a side to act on
    metrics, table = _run(tmp_path, model_path, "hot", ppo_off_policy__k="4", train__lr="5e-2",
                          train__warmup_steps="0", train__generations_per_prompt="8", train__micro_batch_size="32",
                          train__task_kwargs='{"num_train": 6, "num_eval": 3, "max_operand": 2, "operators": "+"}',
                          train__eval_prompts="3")
    lags = {m["lag_max"] for m in metrics}
    assert lags == {0, 1, 2, 3}, lags
    assert table["lag_max"] == 3 and 0 < table["lag_mean"] < 3
    assert table["clip_frac_low"] > 0 and table["clip_frac_high"] > 0, table[["clip_frac_low", "clip_frac_high"]]
    assert table["ratio_p01"] < 0.8 and table["ratio_p99"] > 1.28
    # the per-side fractions add up to the loss's own clip fraction on every step
    for m in metrics:
        assert m["clip_frac_low"] + m["clip_frac_high"] == pytest.approx(m["clip_frac"], abs=1e-12)
