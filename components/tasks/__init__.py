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
- ``tool_arithmetic``: two-digit products to be worked out with the calculator tool (multi-turn,
  `components.environments`);
- ``mixture``: a weighted mixture of any of these, spelled as a dict in specs
  (``{"arithmetic": 0.5, "reasoning_gym:countdown": 0.5}``; `components.tasks.mixture`).

``make_task(spec, **kwargs)`` builds one from a spec string (`factory.py`); ``render_prompt(problem, tokenizer)``
turns a problem into prompt token ids through the tokenizer's chat template. The task modules
register on import; `components.registry.BUILTIN_MODULES` (the one list of built-in modules)
names them, and the first lookup in a registry imports them.
"""

from __future__ import annotations

from components.registry import TASKS
from components.tasks.base import Problem, Task, Verdict
from components.tasks.common import render_prompt, strip_thinking
from components.tasks.factory import REASONING_GYM_PREFIX, check_task_spec, make_task

__all__ = ["Problem", "Task", "Verdict", "make_task", "check_task_spec", "render_prompt", "strip_thinking", "TASKS",
           "REASONING_GYM_PREFIX"]
