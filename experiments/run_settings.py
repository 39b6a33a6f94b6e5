"""A run's recorded settings are the ones that ran (issue 44 item 4).

A run records its full resolved settings in run.json (`"settings"`: every gin binding after
includes, the defaults of the functions it configures included, one `key -> text` entry each).
Re-invoking its directory (`scalerl train CONFIG --run-dir DIR`, a sweep re-run, a requeued job)
compares the new resolved settings with the recorded ones and refuses any difference, naming each
key with its recorded and new value, before anything is computed or written:

    new = resolved_settings(cfg)                  # while gin holds the run's parsed config
    rerun = check_rerun(run_dir, new, extend)     # SettingsChangedError, or what the re-run continues
    RunOwner(run, run_dir, rerun=rerun).open()    # run.json records run.settings (components/trainer/run_owner.py)

`--extend` accepts the keys of `EXTEND_KEYS` (a larger budget continues a finished run from its last
checkpoint); `ALLOWED_CHANGES` lists the settings that may change on any re-run because they do not
change what the run computes. A run with neither a checkpoint nor status done has nothing to
continue: it starts over with the new settings. A run recorded before settings were (no
`"settings"` in run.json) is not compared; its settings are recorded from then on.
"""

from __future__ import annotations

import dataclasses
import math
import pprint
import re
from pathlib import Path
from typing import Any, Optional

from components.trainer.config import ConfigError

__all__ = ["EXTEND_KEYS", "ALLOWED_CHANGES", "SettingsChangedError", "Rerun", "operative_sections", "resolved_settings",
           "setting_text", "stored_settings", "diff_settings", "check_rerun", "check_settings_unchanged",
           "resume_line", "check_planned", "refused_runs"]

# The settings `--extend` may change: a run's budget. Only upwards (an extension never shortens a run);
# `train.total_steps` only under a constant learning-rate schedule (a decaying one ends at total_steps, so
# an extended run would not be the run its new total_steps describes).
EXTEND_KEYS = ("train.total_steps", "train.compute_budget_flops", "train.compute_budget_hours")

# The settings any re-run may change, because they do not change what the run computes (its samples,
# updates, evaluations): where it logs and how often it copies samples, how often it checkpoints and
# keeps checkpoints, how patient its liveness checks are, and how the learner's work is laid out over
# processes and memory (the update does not depend on the number of learner ranks or on the micro-batch
# size, DESIGN.md "Scale beyond one machine"; they differ at most by float round-off; checkpoints resume
# at any learner_ranks). Everything else (the algorithm, the data, the model, the generators, the
# evaluation) is refused. The progress bar is a command-line flag (--no-progress), not a setting.
ALLOWED_CHANGES = {
    "train.trackers": "logging destinations (W&B, TensorBoard, MLflow)",
    "train.samples_every": "how often completions are copied to samples.jsonl",
    "train.samples_per_log": "how many completions each samples log copies",
    "train.checkpoint_every": "how often the run checkpoints",
    "train.keep_checkpoints": "how many checkpoints are kept",
    "train.heartbeat_s": "liveness: how often processes beat",
    "train.heartbeat_timeout_s": "liveness: how long a silent process is waited for",
    "train.queue_timeout_s": "liveness: how long the learner waits for a rollout",
    "train.learner_ranks": "learner layout (checkpoints resume at any learner_ranks)",
    "train.micro_batch_size": "learner memory: sequences per forward/backward",
    "train.max_tokens_per_micro_batch": "learner memory: tokens per packed micro-batch",
    "train.activation_checkpointing": "learner memory: recompute blocks in backward",
    "train.logprob_chunk_size": "learner memory: tokens per log-prob chunk",
    "train.compile": "learner speed: torch.compile",
    "train.compile_backend": "learner speed: the torch.compile backend",
    "train.weight_sync_bucket_mb": "weight sync: bytes per broadcast bucket",
    "warm_start.progress": "the warm start's progress bar",
    "warm_start.cache_dir": "where warm-started policies are cached (the policy is keyed by its settings)",
}

NOT_SET = "(not set)"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class SettingsChangedError(ConfigError):
    """Re-invoking a run directory with settings other than the ones it ran with; nothing was touched."""


@dataclasses.dataclass(frozen=True)
class Rerun:
    """What re-invoking a run directory continues: its status, the checkpoint (None: none), the settings
    that change (key -> (recorded, new)) and whether they extend it."""

    status: Optional[str]
    checkpoint: Optional[Path]
    step: int
    changes: dict
    extended: bool

    @property
    def done(self) -> bool:
        """A finished run that nothing extends: the re-run has nothing to do."""
        return self.status == "done" and not self.extended


# ---------------------------------------------------------------------------------------------
# the settings
def setting_text(value: Any) -> str:
    """One setting's value as text, the same in every process: one line, dict keys sorted, references as
    @name() / %MACRO, no object addresses."""
    return _ADDRESS.sub("", pprint.pformat(value, width=10**9, sort_dicts=True))


def operative_sections(cfg, *, rest_defaults: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The run's operative configuration as (title, {key: value}) sections: model.* and data.* (defaults
    and bindings; model.path as bound, not resolved), every train.* setting as the trainer reads it, the
    parameters of every component the run uses as the run resolved them once (`cfg.components`, the
    table `config.component_table` fills and `ResolvedRun` carries to every process: defaults, bindings,
    a task's train.task_kwargs), then every other bound configurable (with `rest_defaults`, its defaults
    too). Keys are `[scope/]selector.param` as gin's shortest selector spells them. Call while gin holds
    the run's parsed config."""
    import gin

    from components.registry import ALL_REGISTRIES, configurable_params
    from components.trainer.config import data_config, model_config
    from components.trainer.gin_config import configurable_selector, parsed_bindings, short_selector

    parsed = parsed_bindings()
    shown: set = set()
    out: list[tuple[str, dict[str, Any]]] = []

    def section(title: str, key: tuple, defaults: dict, overrides: Optional[dict] = None) -> None:
        scope, selector = key
        values = dict(defaults)
        values.update(parsed.get(key, {}))
        values.update(overrides or {})
        prefix = (f"{scope}/" if scope else "") + short_selector(selector)
        out.append((title, {f"{prefix}.{name}": value for name, value in values.items()}))
        shown.add(key)

    for title, name, fn in (("model (model.path as bound, not resolved)", "model", model_config), ("data", "data", data_config)):
        key = ("", configurable_selector(name))
        section(title, key, {p.name: p.default for p in configurable_params(fn) if not p.required and p.default is not gin.REQUIRED})
    train = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
             if f.name != "model_path" and f.metadata.get("gin", True)}  # not the resolved component table
    out.append(("train (every setting, as the trainer reads it)", {f"train.{k}": v for k, v in train.items()}))
    shown.add(("", configurable_selector("train")))
    for family, name, params in cfg.components:  # the run's resolved component table (ResolvedRun carries it)
        registry = ALL_REGISTRIES[family]
        selector = configurable_selector(f"{registry.gin_module}.{name}")
        if selector is None:  # registered without gin: nothing of it is bindable
            continue
        section(f"{registry.family} {name!r} (defaults and bindings)", ("", selector), {}, dict(params))
    rest = {key: values for key, values in parsed.items() if key not in shown and key[1] != "gin.macro"}
    for (scope, selector), _values in sorted(rest.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        defaults = _configurable_defaults(selector) if rest_defaults else {}
        short = short_selector(selector)
        section(f"{short} (bound)", (scope, selector), defaults)
    return out


def _configurable_defaults(selector: str) -> dict[str, Any]:
    """The parameters with defaults of the configurable `selector` names ({} when gin does not expose them)."""
    import gin

    from components.registry import configurable_params
    from components.trainer.config import SET_BY_TRAINER
    from components.trainer.gin_config import configurable_function

    fn = configurable_function(selector)
    if fn is None:
        return {}
    return {p.name: p.default for p in configurable_params(fn)
            if not p.required and p.default is not gin.REQUIRED and p.name not in SET_BY_TRAINER}


def resolved_settings(cfg) -> dict[str, str]:
    """Every setting of the run (call while gin holds its parsed config): `operative_sections` with the
    defaults of every configurable, macros as `%NAME`, imports as `import module`; values as
    `setting_text`. What run.json records and a re-run is compared against."""
    from components.trainer.gin_config import imported_modules, parsed_macros

    out: dict[str, str] = {f"import {module}": "" for module in sorted(imported_modules())}
    for name, value in parsed_macros().items():
        out[f"%{name}"] = setting_text(value)
    for _title, values in operative_sections(cfg, rest_defaults=True):
        out.update({key: setting_text(value) for key, value in values.items()})
    return out


def default_text(key: str) -> Optional[str]:
    """The text of the default this code gives the setting `key` (None: none known, e.g. a macro or a
    parameter this code does not have). A setting absent on one side of a comparison is at its default."""
    from components.trainer.config import TrainConfig, _field_default

    if key.startswith(("%", "import ")):
        return None
    selector, _, param = key.rpartition(".")
    selector = selector.rpartition("/")[2]  # a scope does not change the defaults
    if selector == "train":
        fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
        return setting_text(_field_default(fields[param])) if param in fields else None
    try:
        defaults = _configurable_defaults(selector)
    except (KeyError, ValueError):  # unknown or ambiguous selector
        return None
    return setting_text(defaults[param]) if param in defaults else None


def retired_train_setting(key: str) -> bool:
    """A `train.<name>` key of a setting TrainConfig no longer has (a run recorded by an older version lists
    every train.* value): left out of the comparison, as `scalerl eval` drops it from an older config.gin
    (`eval_run_settings.without_retired_train_settings`)."""
    from components.trainer.config import TrainConfig

    selector, _, param = key.rpartition(".")
    return selector == "train" and param not in {f.name for f in dataclasses.fields(TrainConfig)}


def diff_settings(stored: dict, new: dict) -> dict[str, tuple[str, str]]:
    """{key: (recorded, new)} of the settings that differ; a setting absent on one side is at this code's
    default there (a setting added to the code since, a section shown only when bound), else `NOT_SET`.
    A recorded train.* setting this code no longer has is not compared (`retired_train_setting`)."""
    out = {}
    for key in sorted(set(stored) | set(new)):
        if key not in new and retired_train_setting(key):
            continue
        default = None if key in stored and key in new else default_text(key)
        old_value = stored.get(key, default if default is not None else NOT_SET)
        new_value = new.get(key, default if default is not None else NOT_SET)
        if old_value != new_value:
            out[key] = (old_value, new_value)
    return out


# ---------------------------------------------------------------------------------------------
# the check
def stored_settings(run_dir: Path) -> Optional[dict]:
    """The settings run.json records (None: none recorded, or no run.json)."""
    from experiments.run_state import read_run_info

    settings = read_run_info(Path(run_dir)).get("settings")
    return dict(settings) if isinstance(settings, dict) else None


def _as_number(text: str) -> float:
    """A budget's text as a number; None (no budget) is infinite."""
    return math.inf if text in ("None", NOT_SET) else float(text)


def _extension_problems(extended: dict, new: dict) -> list[str]:
    """Why extending with these changes would not be an extension ([] when it is)."""
    problems = []
    for key, (old, value) in extended.items():
        try:
            shrinks = _as_number(value) < _as_number(old)
        except ValueError:
            problems.append(f"{key}: recorded {old}, new {value} (not a number)")
            continue
        if shrinks:
            problems.append(f"{key}: recorded {old}, new {value} (--extend only extends a run: the new value must be at "
                            f"least the recorded one{'; None is no budget' if 'budget' in key else ''})")
    schedule = new.get("train.lr_schedule", "'constant'")
    if "train.total_steps" in extended and schedule != "'constant'":
        problems.append(f"train.total_steps: recorded {extended['train.total_steps'][0]}, new "
                        f"{extended['train.total_steps'][1]} (train.lr_schedule = {schedule} decays to 0 at total_steps, so "
                        f"the extended run would not be the run its settings describe; extend by "
                        f"train.compute_budget_flops instead, or only runs with train.lr_schedule = 'constant')")
    return problems


def _refusal(run_dir: Path, refused: dict, problems: list[str], extend: bool) -> SettingsChangedError:
    lines = [f"{key}: recorded {old}, new {value}" for key, (old, value) in refused.items()] + problems
    extendable = ", ".join(EXTEND_KEYS)
    hint = (f"--extend accepts only {extendable}" if extend else
            f"only {extendable} may change, with --extend; or give another --run-dir")
    return SettingsChangedError(
        f"run directory {str(run_dir)!r} ran with other settings; refusing to continue it with these "
        f"({len(lines)} difference{'s' if len(lines) != 1 else ''}; nothing was changed): " + "; ".join(lines)
        + f". {hint}. Settings that may change on any re-run: {', '.join(sorted(ALLOWED_CHANGES))}")


def _latest_intact(run_dir: Path) -> tuple[Optional[Path], int]:
    """(the checkpoint a resume starts from, its step); (None, 0) when there is none (or none is intact:
    the learner then names every bad file)."""
    from components.trainer.checkpoint import CheckpointError, newest_intact_checkpoint, read_checkpoint_info

    try:
        path, _bad = newest_intact_checkpoint(Path(run_dir) / "checkpoints")
        return (path, int(read_checkpoint_info(path)["step"])) if path is not None else (None, 0)
    except (CheckpointError, KeyError, ValueError, OSError):
        return None, 0


def check_rerun(run_dir: Path, new: dict, extend: bool = False) -> Rerun:
    """Compare the settings of a re-invoked run directory with its recorded ones. Raises
    SettingsChangedError naming every difference that is neither in `ALLOWED_CHANGES` nor (with
    `extend`) an extension; reads only."""
    from experiments.run_state import read_run_info

    run_dir = Path(run_dir)
    status = read_run_info(run_dir).get("status")
    checkpoint, step = _latest_intact(run_dir)
    stored = stored_settings(run_dir)
    if stored is None and extend and status == "done":
        raise SettingsChangedError(f"--extend: run directory {str(run_dir)!r} records no settings (it started before runs "
                                   "recorded them), so what would extend it cannot be told; start a new run")
    if stored is None or (checkpoint is None and status != "done"):  # nothing recorded, or nothing to continue
        return Rerun(status, checkpoint, step, {}, False)
    changes = diff_settings(stored, new)
    extended = {k: v for k, v in changes.items() if extend and k in EXTEND_KEYS}
    refused = {k: v for k, v in changes.items() if k not in extended and k not in ALLOWED_CHANGES}
    problems = _extension_problems(extended, new)
    if refused or problems:
        raise _refusal(run_dir, refused, problems, extend)
    if extend and not extended and status == "done":
        raise SettingsChangedError(
            f"--extend: run directory {str(run_dir)!r} is done and these settings extend nothing (recorded "
            + ", ".join(f"{k} = {stored.get(k, default_text(k))}" for k in EXTEND_KEYS)
            + "); give a larger train.total_steps or compute budget")
    return Rerun(status, checkpoint, step, changes, bool(extended))


def check_settings_unchanged(run_dir: Path, new: dict, extend: bool = False) -> Optional[str]:
    """For a sweep's plan: None when re-running `run_dir` with `new` is allowed, else why not (one line)."""
    try:
        check_rerun(run_dir, new, extend)
    except SettingsChangedError as err:
        return str(err)
    return None


def resume_line(run_dir: Path, rerun: Rerun) -> Optional[str]:
    """'resuming <run_dir> from step N (checkpoint <path>)', with what changed; None for a fresh start."""
    if rerun.checkpoint is None:
        return None
    line = f"resuming {run_dir} from step {rerun.step} (checkpoint {rerun.checkpoint})"
    if rerun.changes:
        what = "extended" if rerun.extended else "changed"
        line += f"; {what}: " + ", ".join(f"{k} {old} -> {value}" for k, (old, value) in rerun.changes.items())
    return line


# ---------------------------------------------------------------------------------------------
# sweeps
_COMPARED_ACTIONS = ("submit", "resume", "retry", "skip-done")  # what a sweep would run, or reports done


def check_planned(planned: list, configs: dict, *, extend: bool = False) -> list:
    """A sweep's plan (`run_state.plan`) with every run whose directory ran with other settings turned into
    `skip-refused` (the reason names each difference), so that the sweep goes on with the others and
    touches none of that run's files. With `extend` (an adaptive sweep's rungs) a larger budget is an
    extension: a done run it extends is resumed. `configs`: {run name: RunConfig} (`validate_runs`)."""
    from experiments.run_state import Planned

    out = []
    for p in planned:
        new = getattr(configs.get(p.run.name), "settings", None)
        if p.action not in _COMPARED_ACTIONS or new is None or not (p.run_dir / "run.json").exists():
            out.append(p)
            continue
        try:
            rerun = check_rerun(p.run_dir, new, extend)
        except SettingsChangedError as err:
            out.append(Planned(p.run, p.run_dir, "skip-refused", str(err)))
            continue
        if rerun.extended and p.action == "skip-done":
            changed = ", ".join(f"{k} {old} -> {value}" for k, (old, value) in rerun.changes.items() if k in EXTEND_KEYS)
            p = Planned(p.run, p.run_dir, "resume", f"done; extended ({changed}): resumes from step {rerun.step}")
        out.append(dataclasses.replace(p, extend=extend))
    return out


def refused_runs(planned: list) -> list:
    """The runs of a plan that `check_planned` refused."""
    return [p for p in planned if p.action == "skip-refused"]
