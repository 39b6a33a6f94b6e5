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

import dataclasses
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from components.quiet import quiet_gin
from experiments.plan import ModelIdError, PlanError, plan_inputs
from experiments.recipes import SweepError, gin_parser

DEFAULT_TARGET = "experiments.train:run_training"
MODEL_NOT_RESOLVED = "<not resolved before submission>"  # model.path is neither resolved nor built here


@dataclass(frozen=True)
class RunConfig:
    """What one run's gin files and bindings parse into."""

    train: Any  # components.trainer.config.TrainConfig
    engine_gpus: int  # GPUs one generator's engine uses (vllm.tensor_parallel_size, read from gin)
    plan_inputs: Any = None  # experiments.plan.PlanInputs: what `scalerl plan` reads besides the TrainConfig
    plan_error: str = ""  # why plan_inputs is None (e.g. a model whose config.json is not readable here)
    settings: Any = None  # experiments.run_settings.resolved_settings: what a re-run of its directory is compared with

def _component_params() -> dict[str, str]:
    """`train.<param>` factors whose values are component names -> the family (ALL_REGISTRIES key)
    that knows them: TrainConfig's own field declarations, and the task (a spec whose names are TASKS)."""
    from components.trainer.config import TrainConfig

    fields = dataclasses.fields(TrainConfig)
    return {**{f.name: f.metadata["registry"] for f in fields if "registry" in f.metadata}, "task": "tasks"}


COMPONENT_PARAMS = _component_params()


class _AnyDelegate:
    """gin parser delegate for checking one binding: references and macros are opaque."""

    def configurable_reference(self, name, evaluate):
        return f"@{name}{'()' if evaluate else ''}"

    def macro(self, name):
        return f"%{name}"


def parse_binding(binding: str) -> tuple[str, str, str, Any]:
    """'scope/train.loss = "dapo"' -> (scope, selector, param, value)."""
    from components.trainer.config import ConfigError
    from components.trainer.gin_config import check_binding_syntax

    cp = gin_parser()
    try:  # the same words as `scalerl train --gin` (a bare word: did you mean it quoted?)
        check_binding_syntax(binding, label="binding")
    except ConfigError as err:
        raise SweepError(str(err)) from None
    stmts = list(cp.ConfigParser(binding, _AnyDelegate()))
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
    from components import registry as reg
    from components.trainer.gin_config import (configurable_function, configurable_selector,
                                               unknown_configurable_message, unknown_parameter_message)

    _scope, selector, param, value = parse_binding(binding)
    try:
        full = configurable_selector(selector)
    except (KeyError, ValueError) as err:  # ValueError: ambiguous selector
        raise SweepError(f"binding {binding!r}: {err}") from None
    if full is None:
        raise SweepError(f"unknown factor {selector}.{param} in binding {binding!r}: {unknown_configurable_message(selector)}")
    params = _configurable_signature_params(configurable_function(full))
    if params is not None and param not in params:
        raise SweepError(f"unknown factor {selector}.{param} in binding {binding!r}: "
                         f"{unknown_parameter_message(selector, param, params)}")
    if full.rpartition(".")[2] == "train" and param in COMPONENT_PARAMS:
        registry = reg.ALL_REGISTRIES[COMPONENT_PARAMS[param]]
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
    from components.trainer.gin_config import gin_error_message

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
                raise SweepError(f"recipe {', '.join(files)} does not parse: {gin_error_message(err)}") from None
        for binding in dict.fromkeys(b for r in runs for b in r.bindings):
            check_binding(binding)
        for r in runs:
            try:
                _parse(r)
            except Exception as err:
                raise SweepError(f"run {r.name}: config does not parse: {gin_error_message(err)}") from None
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
    try:
        inputs, why = plan_inputs(), ""
    except ModelIdError:
        raise  # a hub id the job could not load either: `_checked_config` refuses the run
    except PlanError as err:
        inputs, why = None, str(err)
    from experiments.run_settings import resolved_settings

    return RunConfig(cfg, engine_gpus(cfg), inputs, why, resolved_settings(cfg))


def _checked_config(run: Any) -> RunConfig:
    """The parsed config, through the trainer's own consistency checks (batch vs micro-batch, ...),
    without building or loading the model. A hub id in model.path is checked by its config.json
    alone (`plan_inputs`: fetched into the HF cache unless cached), so a wrong id, revision or a
    gated repository is refused here, not by a job after its wait in the queue."""
    from components.registry import UnknownComponentError
    from components.trainer.gin_config import gin_error_message
    from components.trainer.config import check_settings

    try:
        rc = _parsed_config()
        check_settings(rc.train, on_this_machine=False)  # a recipe's component names too, as `scalerl train` checks them
    except ModelIdError as err:  # before a job waits in the queue to fail at its start
        raise SweepError(f"run {run.name}: {err}") from None
    except (ValueError, UnknownComponentError) as err:  # ConfigError is a ValueError
        raise SweepError(f"run {run.name}: {gin_error_message(err)}") from None
    return rc
