"""Off-policy schemes: ppo_off_policy(k) and pipeline_rl(k) (PAPER.md §5)."""

from __future__ import annotations

import gin
import pytest

from _helpers_trainer import read_jsonl, tiny_model, write_gin, write_user_task
from components.offpolicy import is_too_stale, pipeline_rl, ppo_off_policy, token_lag
from components.registry import OFF_POLICY


@pytest.fixture(autouse=True)
def _fresh_gin():
    """Gin bindings are process-global: start and end every test with none."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()



def test_schemes_registered_and_gin_bindable():
    assert {"ppo_off_policy", "pipeline_rl"} <= set(OFF_POLICY.names())
    assert OFF_POLICY.get("ppo_off_policy")().k == 1  # synchronous by default
    gin.clear_config()
    try:
        gin.parse_config(["pipeline_rl.k = 4", "pipeline_rl.inflight_batches = 3"])
        scheme = OFF_POLICY.get("pipeline_rl")()
        assert (scheme.k, scheme.streaming, scheme.inflight_batches) == (4, True, 3)
    finally:
        gin.clear_config()
    ppo = ppo_off_policy(k=8)
    assert not ppo.streaming and ppo.prompts_per_round_factor == 8
    assert pipeline_rl(k=8).prompts_per_round_factor == 1


@pytest.mark.parametrize("scheme", [pipeline_rl, ppo_off_policy])
@pytest.mark.parametrize("bad", [0, -1])
def test_bad_k_fails_clearly(scheme, bad):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        scheme(k=bad)


def test_lag_and_staleness_rule():
    assert token_lag(10, [7, 9, 10]) == 3
    assert token_lag(3, []) == 0
    assert not is_too_stale(10, 2, 8)  # exactly k old is allowed
    assert is_too_stale(10, 1, 8)  # k + 1 old is not


@pytest.mark.slow
def test_ppo_off_policy_k_lag_pattern(tmp_path):
    """ppo_off_policy(2): each round is generated with frozen weights, so the 2nd step of a round is 1 version stale."""
    from experiments.train import run_training

    gin_file = write_gin(
        tmp_path / "ppo2.gin", tiny_model(tmp_path.parent / "model"),
        train__off_policy='"ppo_off_policy"', ppo_off_policy__k="2", train__total_steps="6",
        train__eval_every="100", train__checkpoint_every="100",
    )
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert [m["lag_max"] for m in metrics] == [0, 1, 0, 1, 0, 1]
    assert [m["lag_mean"] for m in metrics] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert all(m["multi_version_frac"] == 0.0 for m in metrics)  # frozen weights: never mixed


@pytest.mark.slow
@pytest.mark.parametrize("generators", [1, 2])
def test_pipeline_rl_bounds_staleness_and_spans_versions(tmp_path, generators):
    """pipeline_rl(k): never trains on a token more than k versions old, and in-flight
    weight updates make completions span several versions; with 2 generators the bound holds
    across both (each gets every weight update)."""
    from experiments.train import run_training

    k = 1
    gin_file = write_gin(
        tmp_path / "pipe.gin", tiny_model(tmp_path.parent / "model"), imports=(write_user_task(tmp_path),),
        train__engine='"trainer_test_slow_torch"',  # decoding slower than a learner step, as on real hardware
        trainer_test_slow_torch__step_delay="0.02",
        train__off_policy='"pipeline_rl"', pipeline_rl__k=str(k), pipeline_rl__inflight_batches="3",
        train__max_tokens="32", train__total_steps="10", train__eval_every="100", train__checkpoint_every="100",
        train__task_kwargs='{"num_train": 120, "num_eval": 8, "max_operand": 12, "operators": "+"}',
        train__num_generators=str(generators),
    )
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11))
    used = {g for m in metrics for g in m["groups_by_generator"]}
    assert used == {f"generator-{i}" for i in range(generators)}, used
    trained = [m for m in metrics if m["lag_max"] is not None]
    assert trained and all(m["lag_max"] <= k for m in trained), [m["lag_max"] for m in metrics]
    # the generator really runs ahead of the learner: some tokens are off-policy ...
    assert max(m["lag_max"] for m in trained) == k
    # ... and some completions contain tokens of more than one policy version
    assert sum(m["multi_version_frac"] for m in metrics) > 0
    # too-stale groups were dropped rather than trained on (3 batches in flight, k=1)
    assert sum(m["stale_dropped"] for m in metrics) > 0
