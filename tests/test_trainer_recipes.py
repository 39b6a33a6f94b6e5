"""The recipe gin files parse, validate, and select what PAPER.md §2-§3 says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _helpers_trainer import REPO, tiny_model
from components.registry import OFF_POLICY


@pytest.fixture(autouse=True)
def _fresh_gin():
    """Gin bindings are process-global: start and end every test with none."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


CONFIGS = REPO / "experiments" / "configs"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    data = root / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(20)))
    return tiny_model(root), str(data)


def _prepare(name, paths, *extra):
    from experiments.train import prepare

    model, data = paths
    bindings = [f'model.path = "{model}"', f'data.path = "{data}"', 'train.engine = "torch"', 'train.task_kwargs = {"eval_size": 4}', *extra]
    cfg, _, _ = prepare([str(CONFIGS / f"{name}.gin")], bindings)
    return cfg


def test_scalerl_recipe(paths):
    import gin

    cfg = _prepare("scalerl", paths)
    assert (cfg.off_policy, cfg.loss, cfg.aggregation, cfg.advantage_norm) == ("pipeline_rl", "cispo", "prompt_mean", "batch")
    assert OFF_POLICY.get(cfg.off_policy)().k == 8
    assert cfg.curriculum == ("no_positive_resampling", "zero_variance_filter")
    assert (cfg.precision, cfg.length_control) == ("bf16_fp32_head", "interruption")
    assert (cfg.lr, cfg.warmup_steps, cfg.adam_eps, cfg.weight_decay) == (5e-7, 100, 1e-15, 0.01)
    assert (cfg.prompts_per_step, cfg.generations_per_prompt) == (48, 16)
    assert (cfg.eval_every, cfg.eval_k) == (100, 16)
    assert gin.query_parameter("no_positive_resampling.threshold") == 0.9
    assert gin.query_parameter("interruption.thinking_min") == 10240


@pytest.mark.parametrize(
    "name, expected",
    [
        ("deepseek_grpo", dict(loss="grpo", aggregation="sample_mean", off_policy="ppo_off_policy", k=8, precision="bf16", prompts=48)),
        ("qwen_dapo", dict(loss="dapo", aggregation="prompt_mean", off_policy="ppo_off_policy", k=8, precision="bf16", prompts=80)),
        ("magistral", dict(loss="dapo", aggregation="prompt_mean", off_policy="pipeline_rl", k=8, precision="bf16", prompts=80)),
        ("minimax", dict(loss="cispo", aggregation="prompt_mean", off_policy="ppo_off_policy", k=8, precision="bf16_fp32_head", prompts=80)),
    ],
)
def test_prevalent_recipes(paths, name, expected):
    import gin

    cfg = _prepare(name, paths)
    assert (cfg.loss, cfg.aggregation, cfg.off_policy, cfg.precision) == (
        expected["loss"], expected["aggregation"], expected["off_policy"], expected["precision"]
    )
    assert OFF_POLICY.get(cfg.off_policy)().k == expected["k"]
    assert cfg.prompts_per_step == expected["prompts"] and cfg.generations_per_prompt == 16
    if name in ("qwen_dapo", "magistral"):
        assert (gin.query_parameter("dapo.eps_low"), gin.query_parameter("dapo.eps_high")) == (0.2, 0.26)
    if name in ("qwen_dapo", "magistral", "minimax"):
        assert "zero_variance_filter" in cfg.curriculum  # dropped, not refilled
    if name == "deepseek_grpo":
        assert gin.query_parameter("grpo.eps") == 0.2


def test_recipes_need_local_model_and_data(paths, tmp_path):
    from experiments.train import prepare

    with pytest.raises(Exception, match="model.path"):
        prepare([str(CONFIGS / "scalerl.gin")], ['train.engine = "torch"'])
    model, _ = paths
    with pytest.raises(Exception, match="could not be loaded"):
        prepare([str(CONFIGS / "scalerl.gin")], [f'model.path = "{model}"', 'train.engine = "torch"',
                                                  f'data.path = "{tmp_path / "missing.parquet"}"'])


def test_tiny_cpu_builds_its_model_locally(tmp_path):
    from experiments.train import prepare

    model_dir = tmp_path / "models" / "tiny_cpu"
    cfg, _, _ = prepare([str(CONFIGS / "tiny_cpu.gin")], [f'model.path = "{model_dir}"', "model.new_model = True"])
    assert Path(cfg.model_path) == model_dir and (model_dir / "config.json").is_file()
    assert cfg.engine == "torch" and cfg.device == "cpu"
