"""Tasks: prompt sources with a seeded train / held-out split and a binary verifier (registry `TASKS`).

Built-in tasks (each registered under its name):

- ``arithmetic``: procedural integer arithmetic (the embedded CPU demo and the tests);
- ``reasoning_gym``: any reasoning-gym dataset, spelled ``reasoning_gym:<dataset>`` in specs;
- ``math_file``: a local JSONL / Parquet file with ``problem`` and ``answer`` columns (Polaris-53K
  layout), graded by math-verify on the text after ``</think>``;
- ``code_file``: a local JSONL file of problems with unit tests (DeepCoder / LiveCodeBench
  style), graded by running the program in a sandbox (`components.tasks.sandbox`).

``make_task(spec, **kwargs)`` builds one from a spec string; ``render_prompt(problem, tokenizer)``
turns a problem into prompt token ids through the tokenizer's chat template.
"""

from __future__ import annotations

import importlib
import logging

from components.registry import TASKS
from components.tasks.base import Problem, Task, Verdict
from components.tasks.common import render_prompt, strip_thinking

_log = logging.getLogger(__name__)

# Each module registers its task on import. The optional libraries (reasoning-gym,
# math-verify) are imported lazily inside them, so importing never fails for their absence;
# the guard below only protects against a module broken in some other way.
_BUILTIN_TASK_MODULES = (
    "components.tasks.arithmetic",
    "components.tasks.reasoning_gym_task",
    "components.tasks.math_file",
    "components.tasks.code_file",
)
IMPORT_ERRORS: dict[str, str] = {}
for _mod in _BUILTIN_TASK_MODULES:
    try:
        importlib.import_module(_mod)
    except ImportError as _err:  # pragma: no cover - depends on the installation
        IMPORT_ERRORS[_mod] = f"{type(_err).__name__}: {_err}"
        _log.warning("task module %s not available: %s", _mod, _err)

REASONING_GYM_PREFIX = "reasoning_gym:"


def make_task(spec: str, **kwargs) -> Task:
    """Build a task from a spec: a registered name (``"arithmetic"``) or ``"reasoning_gym:<dataset>"``.

    Keyword arguments go to the task's constructor (``seed``, ``reward_correct``, ...).
    Unknown names raise the registry's `UnknownComponentError` listing the valid names.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"task spec must be a non-empty string, got {spec!r}")
    if spec.startswith(REASONING_GYM_PREFIX):
        dataset = spec[len(REASONING_GYM_PREFIX) :]
        if "dataset" in kwargs and kwargs["dataset"] != dataset:
            raise ValueError(f"task spec {spec!r} names dataset {dataset!r} but dataset={kwargs['dataset']!r} was also given")
        kwargs["dataset"] = dataset
        return TASKS.get("reasoning_gym")(**kwargs)
    return TASKS.get(spec)(**kwargs)


__all__ = ["Problem", "Task", "Verdict", "make_task", "render_prompt", "strip_thinking", "TASKS", "IMPORT_ERRORS"]
