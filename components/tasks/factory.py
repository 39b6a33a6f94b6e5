"""Building a task from its spec: a registered name, ``reasoning_gym:<dataset>``, or a weighted mixture."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from components.registry import TASKS
from components.tasks.base import Task

__all__ = ["make_task", "check_task_spec", "REASONING_GYM_PREFIX"]

REASONING_GYM_PREFIX = "reasoning_gym:"


def make_task(spec, params: Optional[Mapping[str, Mapping[str, Any]]] = None, **kwargs) -> Task:
    """Build a task from a spec: a registered name (``"arithmetic"``), ``"reasoning_gym:<dataset>"``,
    or a weighted mixture ``{"arithmetic": 0.5, "reasoning_gym:countdown": 0.5}``.

    Keyword arguments go to the task's constructor (``seed``, ``reward_correct``, ...); for a
    mixture, ``seed`` goes to every member and every other keyword is a member spec whose value
    is that member's constructor arguments (`components.tasks.mixture`).
    Unknown names raise the registry's `UnknownComponentError` listing the valid names.
    `params`: {registered task name: hyper-parameters} of a resolved run (a name it lacks: its
    defaults); None: each task as gin configures it (a tool outside a run).
    """

    def entry(name: str):
        return TASKS.get(name) if params is None else TASKS.build(name, params.get(name))

    if isinstance(spec, Mapping):
        seed = kwargs.pop("seed", 0)
        member = {} if params is None else {"member_params": dict(params)}
        return entry("mixture")(tasks=dict(spec), seed=seed, task_kwargs=kwargs, **member)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"task spec must be a non-empty string or a dict from task spec to weight, got {spec!r}")
    if spec.startswith(REASONING_GYM_PREFIX):
        dataset = spec[len(REASONING_GYM_PREFIX) :]
        if "dataset" in kwargs and kwargs["dataset"] != dataset:
            raise ValueError(f"task spec {spec!r} names dataset {dataset!r} but dataset={kwargs['dataset']!r} was also given")
        kwargs["dataset"] = dataset
        return entry("reasoning_gym")(**kwargs)
    return entry(spec)(**kwargs)


def check_task_spec(spec) -> None:
    """Fail early on an unknown task name in a spec (a name, ``reasoning_gym:<dataset>`` or a mixture dict)."""
    specs = list(spec) if isinstance(spec, Mapping) else [spec]
    for s in specs:
        if not isinstance(s, str) or not s:
            raise ValueError(f"task spec must be a non-empty string or a dict from task spec to weight, got {spec!r}")
        TASKS.check("reasoning_gym" if s.startswith(REASONING_GYM_PREFIX) else s)
