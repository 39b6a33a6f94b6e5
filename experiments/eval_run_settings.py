"""What a run directory tells `scalerl eval`: the modules its config imported, its config.gin read
into a TrainConfig (`read_run_config`; settings this version no longer has are dropped with a
note), the prompt format its task wrote, and its held-out set (`build_held_out`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

__all__ = ["EvalInputError", "HeldOut", "import_run_modules", "without_retired_train_settings", "read_run_config",
           "build_held_out"]


class EvalInputError(ValueError):
    """Bad input to `scalerl eval` (no such model, nothing to evaluate in a run, bad option)."""


_TASK_PLACEHOLDERS = ("{problem}", "{prompt}", "{expr}", "{question}")


def _task_format(spec: str, kwargs: Mapping) -> tuple[str, Optional[str]]:
    """(benchmark prompt template, system prompt) of one task spec, as the run's gin binds it (live)."""
    from components.registry import TASKS
    from components.trainer.gin_config import bound_values

    name = "reasoning_gym" if spec.startswith("reasoning_gym:") else spec
    values: dict = {}
    try:
        obj = TASKS.original(name)
        for cls in reversed(inspect.getmro(obj) if inspect.isclass(obj) else (obj,)):  # a subclass's own default wins
            target = cls.__init__ if inspect.isclass(cls) else cls
            try:
                params = inspect.signature(target).parameters
            except (TypeError, ValueError):
                continue
            values.update({p.name: p.default for p in params.values() if p.default is not inspect.Parameter.empty})
        values.update(bound_values(TASKS, name))
    except Exception:  # noqa: BLE001 - a task this python cannot load: its format is unknown
        pass
    values.update(kwargs or {})
    template = values.get("prompt_template")
    if isinstance(template, str):
        found = next((ph for ph in _TASK_PLACEHOLDERS if ph in template), None)
        template = template.replace(found, "{problem}") if found else "{problem}"
    elif isinstance(values.get("instruction"), str):  # reasoning-gym: the question, then its instruction
        template = "{problem}" + values["instruction"].replace("{", "{{").replace("}", "}}")
    else:
        template = "{problem}"
    system = values.get("system_prompt")
    return template, (system if isinstance(system, str) and system else None)


def _run_prompt_format(task: Any, task_kwargs: Mapping) -> tuple[str, Optional[str], Optional[str]]:
    """(prompt template, system prompt, note) of a run's train.task (a mixture: its members' common one)."""
    if isinstance(task, Mapping):
        formats = {str(spec): _task_format(str(spec), (task_kwargs or {}).get(spec, {})) for spec in task}
        if len(set(formats.values())) == 1:
            return (*next(iter(formats.values())), None)
        shown = ", ".join(f"{spec}: {t!r}" for spec, (t, _) in formats.items())
        return "{problem}", None, (f"the run's tasks write their prompts differently ({shown}); each benchmark "
                                   "problem is given as it is (--prompt-template to choose)")
    return (*_task_format(str(task), task_kwargs), None)


@dataclass
class HeldOut:
    """A run's held-out set, built from its config (`eval_settings(..., held_out=True)`)."""

    task: Any  # the run's Task (its verifier grades)
    problems: list  # the first train.eval_prompts held-out problems (or --limit)
    k: int  # train.eval_k, or --k
    spec: Any  # train.task as bound (a name or a mixture dict)
    verifier_timeout_s: float
    max_prompt_length: Optional[int] = None
    total: int = 0  # held-out problems the task has


def import_run_modules(run_dir: Optional[Path]) -> list[str]:
    """Import the modules a run's gin imported (run.json "user_modules": module, file, sys.path entry)
    from where the run found them, before its config.gin is parsed; returns notes. A module whose
    file is gone is imported from wherever this python finds it, else EvalInputError naming it."""
    import importlib
    import importlib.util

    if run_dir is None or not (run_dir / "run.json").is_file():
        return []
    try:
        info = json.loads((run_dir / "run.json").read_text())
    except ValueError:
        return []
    notes = []
    for rec in info.get("user_modules") or []:
        name, file, entry = rec.get("module"), rec.get("file"), rec.get("path")
        if not name or name in sys.modules:
            continue
        if file and Path(file).is_file() and entry:
            if entry not in sys.path:
                sys.path.insert(0, entry)
            try:
                importlib.import_module(name)  # now: a same-named module of the working directory must not win
            except Exception as err:  # noqa: BLE001 - the user's module raised on import
                raise EvalInputError(f"the run imported module {name!r} from {file}; importing it here failed: "
                                     f"{type(err).__name__}: {err}") from None
            continue
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise EvalInputError(f"the run's config imports module {name!r}, which it found at {file or '(unknown)'}; "
                                 "that file is gone and this python cannot import the module: put it back, or on "
                                 "PYTHONPATH, or run from its directory")
        notes.append(f"module {name!r} is no longer at {file}; imported from {found.origin}")
    return notes


_TRAIN_BINDING = re.compile(r"^train\.(\w+)\s*=")


def without_retired_train_settings(text: str) -> tuple[str, list[str]]:
    """A stored config.gin without its `train.<name> = ...` bindings of settings TrainConfig no longer
    has (an older run's operative config lists every train.* value), and the names dropped. A
    binding's continuation lines (indented) go with it."""
    from components.trainer.config import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    kept, dropped, skipping = [], [], False
    for line in text.splitlines(keepends=True):
        if skipping and line[:1] in (" ", "\t"):
            continue
        match = _TRAIN_BINDING.match(line)
        skipping = bool(match) and match.group(1) not in known
        if skipping:
            dropped.append(f"train.{match.group(1)}")
        else:
            kept.append(line)
    return "".join(kept), dropped


def read_run_config(config: Path) -> tuple[dict, Any]:
    """(the settings a run's config.gin binds, a "_note" where there is something to say; its TrainConfig);
    gin's global config holds the run's bindings on return."""
    from components.trainer.config import train_config
    from components.trainer.gin_config import parse_gin_files

    text, retired = without_retired_train_settings(config.read_text())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source = config
            if retired:  # parse a copy without them (the run directory may be read-only)
                source = Path(tmp) / "config.gin"
                source.write_text(text)
            parse_gin_files([str(source)], [])
            cfg = train_config(model_path=str(config.parent))  # the model is not resolved (nor built) here
    except Exception as err:  # noqa: BLE001 - gin and the config raise anything, with a message
        raise EvalInputError(f"cannot read the run's settings from {config}: {type(err).__name__}: {err} "
                             "(a module the run imported must be importable here: run from the directory the run "
                             "was started in, or put it on PYTHONPATH)") from None
    template, system, note = _run_prompt_format(cfg.task, cfg.task_kwargs)
    if retired:
        note = "; ".join(filter(None, [note, f"settings this version no longer has were ignored: {', '.join(retired)}"]))
    values = {
        "engine": cfg.engine,
        "max_tokens": int(cfg.max_tokens),
        "temperature": float(cfg.eval_temperature if cfg.eval_temperature is not None else cfg.temperature),
        "top_p": float(cfg.top_p),
        "top_k": 0 if cfg.top_k is None else int(cfg.top_k),
        "min_p": float(cfg.min_p),
        "repetition_penalty": float(cfg.repetition_penalty),
        "precision": cfg.precision,
        "length_control": cfg.length_control or None,
        "prompt_template": template,
        "system_prompt": system,
    }
    return ({**values, "_note": note} if note else values), cfg


def build_held_out(cfg, k: Optional[int], limit: Optional[int]) -> HeldOut:
    """The run's task (under the run's bindings, live now) and the held-out problems its evaluations use."""
    from components.tasks import make_task

    try:
        task = make_task(cfg.task, seed=cfg.seed, **cfg.task_kwargs)
        problems = list(task.eval_problems())
    except Exception as err:  # noqa: BLE001 - a dataset that moved, a sandbox that is missing, ...
        raise EvalInputError(f"cannot build the run's task {cfg.task!r} (task_kwargs={cfg.task_kwargs!r}) for its "
                             f"held-out set: {type(err).__name__}: {err}") from None
    if not problems:
        raise EvalInputError(f"the run's task {cfg.task!r} has no held-out problems")
    total = len(problems)
    n = int(limit) if limit is not None else (int(cfg.eval_prompts) if cfg.eval_prompts else total)
    return HeldOut(task=task, problems=problems[:n], k=int(k) if k is not None else int(cfg.eval_k), spec=cfg.task,
                   verifier_timeout_s=float(cfg.verifier_timeout_s), max_prompt_length=cfg.max_prompt_length,
                   total=total)
