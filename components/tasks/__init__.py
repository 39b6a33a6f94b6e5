"""Tasks: prompt sources with a seeded train / held-out split and a binary verifier (registry `TASKS`).

Built-in tasks (each registered under its name):

- ``arithmetic``: procedural integer arithmetic (the embedded CPU demo and the tests);
- ``stories``: procedural word problems with a worked scratchpad and a 4k-word vocabulary (the
  small testbed, `--scale small`);
- ``reasoning_gym``: any reasoning-gym dataset, spelled ``reasoning_gym:<dataset>`` in specs;
- ``math_file``: a local JSONL / Parquet file with ``problem`` and ``answer`` columns (Polaris-53K
  layout), graded by math-verify on the text after ``</think>``;
- ``code_file``: a local JSONL file of problems with unit tests (DeepCoder / LiveCodeBench
  style), graded by running the program in a sandbox (`components.tasks.sandbox`);
- ``hf_dataset``: any Hugging Face ``datasets.load_dataset`` source (Hub name or local
  parquet / jsonl / json / csv / arrow) with a column mapping, graded by math-verify, the
  sandboxed tests, or a plain-function reward (`components.rewards`).
- ``tool_arithmetic``: multi-digit products solved with the calculator tool (``train.environment =
  "calculator"``; `components.tasks.tool_arithmetic`);
- ``mixture``: a weighted mixture of any of these, spelled as a dict in specs
  (``{"arithmetic": 0.5, "reasoning_gym:countdown": 0.5}``; `components.tasks.mixture`).

``make_task(spec, **kwargs)`` builds one from a spec string; ``render_prompt(problem, tokenizer)``
turns a problem into prompt token ids through the tokenizer's chat template.
"""

from __future__ import annotations

import importlib
import logging
from typing import Mapping

from components.registry import TASKS
from components.tasks.base import Problem, Task, Verdict
from components.tasks.common import render_prompt, strip_thinking

_log = logging.getLogger(__name__)

# Each module registers its task on import. The optional libraries (reasoning-gym,
# math-verify) are imported lazily inside them, so importing never fails for their absence;
# the guard below only protects against a module broken in some other way.
_BUILTIN_TASK_MODULES = (
    "components.tasks.arithmetic",
    "components.tasks.stories",
    "components.tasks.reasoning_gym_task",
    "components.tasks.math_file",
    "components.tasks.code_file",
    "components.tasks.hf_dataset",
    "components.tasks.mixture",
    "components.tasks.tool_arithmetic",
)
IMPORT_ERRORS: dict[str, str] = {}
for _mod in _BUILTIN_TASK_MODULES:
    try:
        importlib.import_module(_mod)
    except ImportError as _err:  # pragma: no cover - depends on the installation
        IMPORT_ERRORS[_mod] = f"{type(_err).__name__}: {_err}"
        _log.warning("task module %s not available: %s", _mod, _err)

REASONING_GYM_PREFIX = "reasoning_gym:"

# The code task's numeric settings (a sandbox limit of 0 fails every program: every reward -1).
# Declared for the parameters its signature has, so the grader can gain or drop knobs freely.
CODE_FILE_RANGES = {"eval_size": ">= 0", "eval_fraction": "[0, 1)", "cpu_seconds": "> 0", "wall_seconds": "> 0",
                    "memory_mb": ">= 1", "max_processes": ">= 1", "output_kb": ">= 1", "max_tests": ">= 1",
                    "case_workers": ">= 1", "max_total_seconds": "> 0"}
if "components.tasks.code_file" not in IMPORT_ERRORS:
    _code_file_params = {p.name for p in TASKS.params("code_file")}
    TASKS.declare_ranges("code_file", {k: v for k, v in CODE_FILE_RANGES.items() if k in _code_file_params})


def make_task(spec, **kwargs) -> Task:
    """Build a task from a spec: a registered name (``"arithmetic"``), ``"reasoning_gym:<dataset>"``,
    or a weighted mixture ``{"arithmetic": 0.5, "reasoning_gym:countdown": 0.5}``.

    Keyword arguments go to the task's constructor (``seed``, ``reward_correct``, ...); for a
    mixture, ``seed`` goes to every member and every other keyword is a member spec whose value
    is that member's constructor arguments (`components.tasks.mixture`).
    Unknown names raise the registry's `UnknownComponentError` listing the valid names.
    """
    if isinstance(spec, Mapping):
        seed = kwargs.pop("seed", 0)
        return TASKS.get("mixture")(tasks=dict(spec), seed=seed, task_kwargs=kwargs)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"task spec must be a non-empty string or a dict from task spec to weight, got {spec!r}")
    if spec.startswith(REASONING_GYM_PREFIX):
        dataset = spec[len(REASONING_GYM_PREFIX) :]
        if "dataset" in kwargs and kwargs["dataset"] != dataset:
            raise ValueError(f"task spec {spec!r} names dataset {dataset!r} but dataset={kwargs['dataset']!r} was also given")
        kwargs["dataset"] = dataset
        return TASKS.get("reasoning_gym")(**kwargs)
    return TASKS.get(spec)(**kwargs)


def check_task_spec(spec) -> None:
    """Fail early on an unknown task name in a spec (a name, ``reasoning_gym:<dataset>`` or a mixture dict)."""
    specs = list(spec) if isinstance(spec, Mapping) else [spec]
    for s in specs:
        if not isinstance(s, str) or not s:
            raise ValueError(f"task spec must be a non-empty string or a dict from task spec to weight, got {spec!r}")
        TASKS.check("reasoning_gym" if s.startswith(REASONING_GYM_PREFIX) else s)


__all__ = ["Problem", "Task", "Verdict", "make_task", "check_task_spec", "render_prompt", "strip_thinking", "TASKS", "IMPORT_ERRORS"]
