"""One run's configuration as the trainer will see it: its gin files and bindings parsed once into `TrainConfig`.

A run (a `RunSpec`, or anything with `name`, `config_files` and `bindings`) is checked before
anything is submitted, in a clean gin state, with the trainer's own configurables and
registries loaded:

    configs = validate_runs(runs, target)     # {run name: RunConfig}, or SweepError naming the run
    check_binding('train.loss = "cispo"')     # configurable, parameter and component name exist
    parse_binding('s/train.lr = 1e-5')        # -> ("s", "train", "lr", 1e-5)
    configs = parse_run_configs(runs)         # {run name: RunConfig | None}, without validating

Every binding's configurable and parameter must exist (a typo gets a did-you-mean), values
naming a component must be registered, every recipe must parse, and each run's parsed config
must pass the trainer's consistency checks (`components.trainer.config.validate`). What each
run parsed into (`RunConfig`: the typed `TrainConfig` and the GPUs its engine takes) carries its
layout (learner ranks, generators, engine, device), which submission reads instead of parsing
the run again.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from components.quiet import quiet_gin
from experiments.recipes import SweepError, did_you_mean, gin_parser

DEFAULT_TARGET = "experiments.train:run_training"
MODEL_NOT_RESOLVED = "<not resolved before submission>"  # model.path is neither resolved nor built here


@dataclass(frozen=True)
class RunConfig:
    """What one run's gin files and bindings parse into."""

    train: Any  # components.trainer.config.TrainConfig
    engine_gpus: int  # GPUs one generator's engine uses (vllm.tensor_parallel_size, read from gin)

# `train.<param>` factors whose values are component names, and the registry that knows them.
COMPONENT_PARAMS = {
    "loss": "LOSSES",
    "aggregation": "AGGREGATIONS",
    "advantage_norm": "ADVANTAGE_NORMS",
    "curriculum": "CURRICULA",
    "precision": "PRECISIONS",
    "length_control": "LENGTH_CONTROLS",
    "off_policy": "OFF_POLICY",
    "task": "TASKS",
    "engine": "ENGINES",
}


class _AnyDelegate:
    """gin parser delegate for checking one binding: references and macros are opaque."""

    def configurable_reference(self, name, evaluate):
        return f"@{name}{'()' if evaluate else ''}"

    def macro(self, name):
        return f"%{name}"


def parse_binding(binding: str) -> tuple[str, str, str, Any]:
    """'scope/train.loss = "dapo"' -> (scope, selector, param, value)."""
    cp = gin_parser()
    try:
        stmts = list(cp.ConfigParser(binding, _AnyDelegate()))
    except SyntaxError as err:
        raise SweepError(f"cannot parse binding {binding!r}: {err}") from None
    if len(stmts) != 1 or not isinstance(stmts[0], cp.BindingStatement):
        raise SweepError(f"expected one `configurable.param = value` binding, got {binding!r}")
    s = stmts[0]
    return s.scope, s.selector, s.arg_name, s.value


def load_trainer_configurables(target: str = DEFAULT_TARGET) -> None:
    """Fill the registries and import the module of the function the jobs will call (it
    registers the gin configurables the runs bind)."""
    from components.registry import load_builtin_components

    load_builtin_components()
    module = target.partition(":")[0]
    try:
        importlib.import_module(module)
        importlib.import_module("components.trainer.config")  # `train` and `model` (imported lazily by the trainer)
    except ImportError as err:
        raise SweepError(f"cannot import the trainer ({module}): {err}") from None


def _configurable_signature_params(fn: Any) -> list[str] | None:
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return None  # accepts anything
    return [p.name for p in sig.parameters.values() if p.name != "self"]


def check_binding(binding: str) -> None:
    """The binding's configurable and parameter exist; component-name values are registered."""
    import gin
    from components import registry as reg

    _scope, selector, param, value = parse_binding(binding)
    gin_registry = gin.config._REGISTRY  # gin's own selector map (no public lookup API)
    try:
        configurable = gin_registry.get_match(selector)
    except (KeyError, ValueError) as err:  # ValueError: ambiguous selector
        raise SweepError(f"binding {binding!r}: {err}") from None
    if configurable is None:
        known = list(getattr(gin_registry, "_selector_map", {}))  # complete selectors, e.g. "losses.cispo"
        close = did_you_mean(selector, sorted({k.rsplit(".", 1)[-1] for k in known} | set(known)))
        raise SweepError(f"unknown factor {selector}.{param} in binding {binding!r}: no gin configurable named "
                         f"{selector!r}.{close}")
    params = _configurable_signature_params(configurable.wrapped)
    if params is not None and param not in params:
        raise SweepError(f"unknown factor {selector}.{param} in binding {binding!r}: {selector} has no "
                         f"parameter {param!r}; its parameters: {', '.join(params)}.{did_you_mean(param, params)}")
    if configurable.name == "train" and param in COMPONENT_PARAMS:
        registry = getattr(reg, COMPONENT_PARAMS[param])
        names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
        for name in names:  # train.curriculum is a list of names
            if not isinstance(name, str) or name.startswith(("@", "%")):
                continue
            try:
                registry.check(name)
            except reg.UnknownComponentError as err:
                raise SweepError(f"binding {binding!r}: {err}") from None


_SEARCH_PATHS_ADDED: set = set()


def validate_runs(runs: Sequence[Any], target: str = DEFAULT_TARGET) -> dict[str, RunConfig]:
    """Check every run's recipe and bindings with gin and the registries, in a clean gin state;
    {run name: the RunConfig it parsed into}."""
    import gin

    if not runs:
        raise SweepError("the sweep has no runs")
    load_trainer_configurables(target)
    _add_search_paths(runs)
    quiet_gin()
    configs = {}
    try:
        for files in dict.fromkeys(r.config_files for r in runs):
            gin.clear_config()
            try:  # imports the modules a recipe names, so user components are registered too
                gin.parse_config_files_and_bindings(list(files), [], finalize_config=False)
            except Exception as err:  # gin raises ValueError/KeyError/ImportError/... with a message
                raise SweepError(f"recipe {', '.join(files)} does not parse: {err}") from None
        for binding in dict.fromkeys(b for r in runs for b in r.bindings):
            check_binding(binding)
        for r in runs:
            try:
                _parse(r)
            except Exception as err:
                raise SweepError(f"run {r.name}: config does not parse: {err}") from None
            configs[r.name] = _checked_config(r)
    finally:
        gin.clear_config()
    return configs


def parse_run_configs(runs: Sequence[Any]) -> dict[str, RunConfig | None]:
    """{run name: RunConfig} of runs not validated here, None for a run whose config does not
    parse into one (a stand-in trainer's config, or one `validate_runs` reports)."""
    import gin

    load_trainer_configurables(DEFAULT_TARGET)
    quiet_gin()
    out = {}
    try:
        for r in runs:
            try:
                _parse(r)
                out[r.name] = _parsed_config()
            except Exception:  # reported by validate_runs, where it matters
                out[r.name] = None
    finally:
        gin.clear_config()
    return out


def _add_search_paths(runs: Sequence[Any]) -> None:
    """As the trainer does: `include 'base.gin'` resolves next to the including file, and a
    recipe's `import my_components` finds modules next to it or in the working directory."""
    import gin

    for d in dict.fromkeys([str(Path(f).parent) for r in runs for f in r.config_files] + [os.getcwd()]):
        if d not in _SEARCH_PATHS_ADDED:
            gin.add_config_file_search_path(d)
            _SEARCH_PATHS_ADDED.add(d)
        if d not in sys.path:
            sys.path.append(d)


def _parse(run: Any) -> None:
    """The run's files and bindings into gin's (cleared) global config."""
    import gin

    gin.clear_config()
    gin.parse_config_files_and_bindings(list(run.config_files), list(run.bindings), finalize_config=False)


def _parsed_config() -> RunConfig:
    """The parsed gin config (live in gin's global state) as a RunConfig."""
    from components.trainer.config import engine_gpus, train_config

    cfg = train_config(model_path=MODEL_NOT_RESOLVED)
    return RunConfig(cfg, engine_gpus(cfg))


def _checked_config(run: Any) -> RunConfig:
    """The parsed config, through the trainer's own consistency checks (batch vs micro-batch, ...),
    without touching the model (model.path is not resolved or built here)."""
    from components.trainer.config import ConfigError, validate

    try:
        rc = _parsed_config()
        validate(rc.train)
    except ConfigError as err:
        raise SweepError(f"run {run.name}: {err}") from None
    return rc
