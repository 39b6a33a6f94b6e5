"""How each structured ``train.*`` value is coerced and checked as TrainConfig stores it (the
`coerce` metadata of its field in components/trainer/config.py): a bad form is a ConfigError
naming the setting and the forms it takes."""

from __future__ import annotations

from typing import Any, Optional

from components.trainer.gin_config import ConfigError

__all__ = ["ALL_LINEAR", "strict_bool", "check_lora_targets", "lora_targets", "adam_betas", "reward_funcs",
           "reward_weights"]


def strict_bool(name: str):
    def coerce(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"train.{name} must be True or False, got {value!r}")
        return value

    return coerce


ALL_LINEAR = "all-linear"  # train.lora_targets: every linear layer of the decoder blocks (peft's name)


def check_lora_targets(targets: Any) -> None:
    """The form of train.lora_targets (no model needed; `lora.check_targets` matches the names on the
    model). ConfigError naming the setting."""
    if isinstance(targets, str) and targets == ALL_LINEAR:
        return
    names = [targets] if isinstance(targets, str) else list(targets)
    if not names:
        raise ConfigError(f'train.lora_targets is empty; use "{ALL_LINEAR}" or module names such as ["q_proj", "v_proj"]')
    bad = [n for n in names if not n or n == ALL_LINEAR or any(c in n for c in " *?[]()|^$\\")]
    if bad:
        raise ConfigError(f"train.lora_targets = {names!r}: {bad[0]!r} is not a module name (names are matched "
                          f'whole, as the last parts of a module path: "q_proj", "mlp.down_proj"; '
                          f'"{ALL_LINEAR}" stands alone)')


def lora_targets(value: Any) -> Any:
    """train.lora_targets as stored: "all-linear" (or one module name) as a string, several names as a tuple."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(v.strip() for v in value)
    raise ConfigError(f'train.lora_targets must be "all-linear" or a list of module names (["q_proj", "v_proj"]), '
                      f"got {value!r}")


def adam_betas(value: Any) -> tuple:
    """train.adam_betas as stored: two floats (beta1, beta2); any other form is a ConfigError naming the setting."""
    form = "two numbers (beta1, beta2) in [0, 1), e.g. train.adam_betas = (0.9, 0.999)"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"train.adam_betas = {value!r} is not a pair: give {form}")
    if len(value) != 2 or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in value):
        raise ConfigError(f"train.adam_betas = {value!r}: give {form}")
    return tuple(float(b) for b in value)


def reward_funcs(value: Any) -> tuple:
    """train.reward_funcs as stored: a tuple of specs (strings); a callable becomes its import path
    (`components.rewards.reward_spec_of`). One spec alone is a list of one."""
    from components.rewards import reward_spec_of

    items = [] if value is None else [value] if isinstance(value, str) or callable(value) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"train.reward_funcs = {value!r}: give a list of reward functions, e.g. "
                          "[\"verifier\", \"my_reward\", \"my_module:my_function\"]")
    try:
        return tuple(reward_spec_of(v) for v in items)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def reward_weights(value: Any) -> Optional[tuple]:
    """train.reward_weights as stored: None (every function weighs 1.0) or a tuple of numbers."""
    if value is None:
        return None
    items = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise ConfigError(f"train.reward_weights = {value!r}: give one number per train.reward_funcs entry, "
                          "e.g. [1.0, 0.1] (or None: all 1.0)")
    return tuple(items)
