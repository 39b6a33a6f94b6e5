"""Settings that would wreck training are refused before anything is built or computed (issue 14 item 7).

Every numeric train.* setting and every numeric hyper-parameter of the components a run uses
(defaults, gin bindings, train.task_kwargs) must be finite and inside its declared range
(`components.registry`, `components.trainer.config.TRAIN_RANGES`); a model path with no
checkpoint is an error unless `model.new_model = True` asks for a new model.
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid

import gin
import pytest

from _helpers_trainer import REPO, write_gin
from components.registry import ALL_REGISTRIES, LOSSES, ParamRangeError, load_builtin_components
from components.trainer.config import ConfigError, TrainConfig, model_config, train_config, validate
from components.trainer.gin_config import bound_values

# model.path = @validation_spy_model(): resolving the model path (a build, in a real recipe) is
# recorded, so a test sees whether a refusal came before it.
SPY_CALLS: list[int] = []
SPY_MODEL = "/nonexistent/validation-spy-model"


@gin.configurable("validation_spy_model")
def _spy_model() -> str:
    SPY_CALLS.append(1)
    return SPY_MODEL


@pytest.fixture(autouse=True)
def _clean_gin():
    load_builtin_components()  # the built-in components are gin configurables before a binding names them
    gin.clear_config()
    SPY_CALLS.clear()
    yield
    gin.clear_config()


def _prepare(tmp_path, **overrides):
    from experiments.train import prepare

    return prepare([write_gin(tmp_path / "run.gin", SPY_MODEL, model__path="@validation_spy_model()", **overrides)])


@pytest.mark.parametrize(
    "overrides, good, message",
    [
        # the gradient's sign flips (held-out pass rate 0.226 -> 0.016 in 40 steps)
        (dict(cispo__eps_max="-1"), dict(cispo__eps_max="4.0"), r"cispo\.eps_max = -1(\.0)? is out of range: must be > 0"),
        # through a gin macro: the bound value, not the default, is checked
        (dict(NEG="-1.0", cispo__eps_max="%NEG"), dict(NEG="0.5", cispo__eps_max="%NEG"),
         r"cispo\.eps_max = -1\.0 is out of range: must be > 0"),
        # every verification times out: every reward is -1
        (dict(train__verifier_timeout_s="0"), dict(train__verifier_timeout_s="0.5"),
         r"train\.verifier_timeout_s = 0(\.0)? is out of range: must be > 0"),
        (dict(train__lr="1e999"), dict(train__lr="1e300"), r"train\.lr = inf is out of range: must be finite and > 0"),
        (dict(train__temperature="1e999"), dict(train__temperature="1e3"),
         r"train\.temperature = inf is out of range: must be finite and > 0"),
        # None where a number is needed: named, not a TypeError from int(None)
        (dict(train__max_observation_tokens="None"), dict(train__max_observation_tokens="32"),
         r"train\.max_observation_tokens = None: it takes a value \(int\), not None"),
    ],
)
def test_wrecking_settings_are_refused_before_the_model_is_resolved(tmp_path, overrides, good, message):
    with pytest.raises(ConfigError, match=message):
        _prepare(tmp_path, **overrides)
    assert SPY_CALLS == []  # refused before model.path was resolved (nothing built, nothing run)
    # the control: with an allowed value the same config passes and stops only at the (missing) model
    with pytest.raises(FileNotFoundError, match=r"does not exist \(a local path\)"):
        _prepare(tmp_path, **good)
    assert SPY_CALLS == [1]


@pytest.mark.parametrize("param", ["lr", "temperature", "verifier_timeout_s"])
def test_nan_is_refused_in_gin_and_in_a_config(param):
    gin.parse_config("model.path = @validation_spy_model()\ntrain.task = 'arithmetic'")
    gin.bind_parameter(f"train.{param}", float("nan"))
    message = rf"train\.{param} = nan is out of range: must be finite and > 0"
    with pytest.raises(ConfigError, match=message):
        train_config()
    assert SPY_CALLS == []
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig(model_path="m", **{param: float("nan")}))


@pytest.mark.parametrize(
    "gin_text, fields, message",
    [
        ("pipeline_rl.k = 0", dict(off_policy="pipeline_rl"), r"pipeline_rl\.k = 0 is out of range: must be an integer >= 1"),
        ("no_positive_resampling.threshold = 0.0", dict(curriculum=("no_positive_resampling",)),
         r"no_positive_resampling\.threshold = 0\.0 is out of range: must be in \(0, 1\]"),
        ("batch.eps = 0.0", dict(advantage_norm="batch"), r"batch\.eps = 0\.0 is out of range: must be > 0"),
        ("dapo.eps_low = 1.5", dict(loss="dapo"), r"dapo\.eps_low = 1\.5 is out of range: must be in \[0, 1\)"),
        ("vllm.gpu_memory_utilization = 2.0", dict(engine="vllm"),
         r"vllm\.gpu_memory_utilization = 2\.0 is out of range: must be in \(0, 1\]"),
        ("", dict(task="code_file", task_kwargs={"path": "x.jsonl", "cpu_seconds": 0}),
         r"code_file\.cpu_seconds = 0 is out of range: must be > 0"),
        ("", dict(task="arithmetic", task_kwargs={"num_operands": 2.5}),
         r"arithmetic\.num_operands = 2\.5 is out of range: must be an integer >= 2"),
        ("", dict(task={"arithmetic": 0.5, "reasoning_gym:spell_backward": 0.5},
                  task_kwargs={"reasoning_gym:spell_backward": {"threshold": 2.0}}),
         r"reasoning_gym\.threshold = 2\.0 is out of range: must be in \[0, 1\]"),
        ("math_verify.max_answer_chars = 1e999", dict(task="math_file", task_kwargs={"path": "x.jsonl", "reward": "math_verify"}),
         r"math_verify\.max_answer_chars = inf is out of range: must be an integer"),
        # a mixture's weights are numbers too (refused by the task's constructor only after a warm start)
        ("", dict(task={"arithmetic": float("inf"), "reasoning_gym:spell_backward": 0.5}),
         r"weight of 'arithmetic' must be a positive number, got inf"),
        # each value is finite, but together they reward wrong answers
        ("arithmetic.reward_correct = -1.0\narithmetic.reward_incorrect = 1.0", dict(task="arithmetic"),
         r"arithmetic\.reward_correct = -1\.0 must be above arithmetic\.reward_incorrect = 1\.0"),
    ],
)
def test_component_parameters_of_the_run_are_checked(gin_text, fields, message):
    gin.parse_config(gin_text)
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig(model_path="m", **fields))


def test_greedy_held_out_evaluation_is_still_a_valid_setting():
    # both engines sample greedily at temperature <= 0; only the training temperature must be > 0
    validate(TrainConfig(model_path="m", eval_temperature=0.0))
    with pytest.raises(ConfigError, match=r"train\.eval_temperature = -1\.0 is out of range: must be >= 0"):
        validate(TrainConfig(model_path="m", eval_temperature=-1.0))


def test_a_gpu_index_is_refused_since_each_process_owns_its_gpus():
    """The launcher hands each process its own GPU(s) through CUDA_VISIBLE_DEVICES, where the first is
    cuda:0: a 'cuda:1' would be an invalid ordinal in every process, so it is refused before the run."""
    for device in ("auto", "cpu", "cuda", "cuda:0"):
        validate(TrainConfig(model_path="m", device=device))
    with pytest.raises(ConfigError, match=r"train.device = 'cuda:1': every process of a run gets its own GPU\(s\) "
                                          r".*use 'cuda', and choose a machine's GPUs with CUDA_VISIBLE_DEVICES"):
        validate(TrainConfig(model_path="m", device="cuda:1"))
    with pytest.raises(ConfigError, match=r"train.device must be auto, cpu or cuda \(cuda:0 is cuda\), got 'gpu'"):
        validate(TrainConfig(model_path="m", device="gpu"))


def _user_loss_name() -> str:
    return f"user_loss_{uuid.uuid4().hex[:8]}"


def test_user_component_gets_its_declared_range_and_finite_floats():
    declared, plain = _user_loss_name(), _user_loss_name()

    @LOSSES.register(declared, ranges={"beta": ">= 0"})
    def with_range(logp, gen_logp, advantages, mask, *, beta: float = 0.1, scale=1.0, steps: int = 3):
        return -advantages[:, None] * logp

    @LOSSES.register(plain)
    def without_range(logp, gen_logp, advantages, mask, *, alpha: float = 0.5):
        return -advantages[:, None] * logp

    try:
        assert {k: str(r) for k, r in LOSSES.param_ranges(declared).items()} == {"beta": ">= 0"}
        gin.parse_config(f"{plain}.alpha = 1e999")  # a component the run does not use is not checked
        validate(TrainConfig(model_path="m", loss=declared))  # the defaults pass
        cases = [
            (declared, f"{declared}.beta = -0.5", rf"{declared}\.beta = -0\.5 is out of range: must be >= 0"),
            (declared, f"{declared}.scale = 1e999", rf"{declared}\.scale = inf is out of range: must be a finite number"),
            (declared, f"{declared}.steps = 2.5", rf"{declared}\.steps = 2\.5 is out of range: must be an integer"),
            (plain, f"{plain}.alpha = 1e999", rf"{plain}\.alpha = inf is out of range: must be a finite number"),
        ]
        for name, binding, message in cases:
            gin.clear_config()
            gin.parse_config(binding)
            with pytest.raises(ConfigError, match=message):
                validate(TrainConfig(model_path="m", loss=name))
            with pytest.raises(ParamRangeError, match=message):
                LOSSES.check_params(name, bound_values(LOSSES, name))
    finally:
        LOSSES.unregister(declared)
        LOSSES.unregister(plain)


def test_a_range_declaration_is_itself_checked():
    with pytest.raises(ValueError, match=r"ranges name 'bta'.*its parameters: beta"):
        LOSSES.register(_user_loss_name(), ranges={"bta": "> 0"})(lambda logp, gen_logp, advantages, mask, *, beta=1.0: logp)
    with pytest.raises(ValueError, match=r"cannot read the range 'positive'"):
        LOSSES.register(_user_loss_name(), ranges={"beta": "positive"})(lambda logp, gen_logp, advantages, mask, *, beta=1.0: logp)


def test_every_builtin_default_is_inside_its_declared_range():
    load_builtin_components()
    for family, registry in ALL_REGISTRIES.items():
        for name in registry.names():
            registry.check_params(name)  # raises on a default outside its own range
    assert str(LOSSES.param_ranges("cispo")["eps_max"]) == "> 0"


def test_mistyped_model_path_is_an_error_not_a_random_model(tmp_path):
    from experiments.train import prepare

    typo = tmp_path / "my-modle"
    with pytest.raises(FileNotFoundError, match=r"does not exist \(a local path\).*model\.new_model = True"):
        prepare([str(REPO / "experiments/configs/tiny_cpu.gin")], [f'model.path = "{typo}"'])
    assert not typo.exists()


@pytest.mark.parametrize("binding, message", [
    ("warm_start.sft_lr = 1e999", "warm_start.sft_lr = inf is out of range: must be finite and > 0"),
    ("warm_start.label_noise = 1.5", "warm_start.label_noise = 1.5 is out of range: must be in [0, 1]"),
    ("warm_start.sft_batch_size = 0", "warm_start.sft_batch_size = 0 is out of range: must be an integer >= 1"),
])
def test_warm_start_settings_are_refused_before_the_build(tmp_path, binding, message):
    """The tiny recipe's model comes from `warm_start` (not a registered component): its numbers
    are checked too, before anything is built (the cache dir stays empty)."""
    from experiments.train import prepare

    cache = tmp_path / "warm"
    with pytest.raises(ParamRangeError, match=re.escape(message)):
        prepare([str(REPO / "experiments/configs/tiny_cpu.gin")], [binding, f'warm_start.cache_dir = "{cache}"'])
    assert not cache.exists() or not any(cache.iterdir())


def test_new_model_setting_builds_then_reuses_and_never_replaces_a_checkpoint(tmp_path, caplog):
    kwargs = dict(hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=32)
    path = tmp_path / "new"
    gin.parse_config(f"model.path = {json.dumps(str(path))}\nmodel.new_model = True\nmodel.build_kwargs = {json.dumps(kwargs)}")
    assert model_config() == str(path)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 16 and config["num_hidden_layers"] == 1
    stamp = (path / "config.json").stat().st_mtime_ns
    assert model_config() == str(path) and (path / "config.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    gin.bind_parameter("model.build_kwargs", {**kwargs, "hidden_size": 32})  # another model: not the one built there
    with pytest.raises(FileExistsError, match=r"was built with model\.build_kwargs = .*'hidden_size': 16"):
        model_config()

    real = tmp_path / "real_checkpoint"  # a directory no builder made
    real.mkdir()
    (real / "config.json").write_text("{}")
    gin.bind_parameter("model.path", str(real))
    with pytest.raises(FileExistsError, match=r"new_model = True asks for a NEW model.*model\.new_model = False"):
        model_config()

    # the old name still works for saved configs, and says it is deprecated
    old = tmp_path / "old"
    gin.clear_config()
    gin.parse_config(f"model.path = {json.dumps(str(old))}\nmodel.build_if_missing = True\nmodel.build_kwargs = {json.dumps(kwargs)}")
    with caplog.at_level(logging.WARNING):
        assert model_config() == str(old)
    assert (old / "config.json").is_file() and "build_if_missing is deprecated" in caplog.text


def test_range_text_forms():
    from components.registry import parse_range

    r = parse_range("(0, 1]")
    assert [r.contains(x) for x in (0.0, 1e-9, 1.0, 1.5, math.nan)] == [False, True, True, False, False]
    assert str(parse_range(" >=1 ")) == ">= 1" and str(parse_range("[0,1)")) == "in [0, 1)"
    unbounded = parse_range("[0, inf]")  # a closed infinite bound lets infinity through
    assert unbounded.contains(math.inf) and not parse_range(">= 0").contains(math.inf)
    assert re.fullmatch(r"in \(-inf, 0\)", str(parse_range("(-inf, 0)")))
