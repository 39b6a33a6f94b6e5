"""`mixture`: a weighted mixture of tasks, itself a `Task`, so the trainer needs no special case.

In gin, ``train.task`` takes a dict from task spec to weight, and ``train.task_kwargs`` then
takes one dict of constructor arguments per task::

    train.task = {"arithmetic": 0.5, "reasoning_gym:spell_backward": 0.5}
    train.task_kwargs = {"arithmetic": {"max_operand": 30},
                         "reasoning_gym:spell_backward": {"dataset_config": {"max_word_len": 5}}}

(``make_task(spec_dict, seed=..., **per_task_kwargs)`` builds the same thing in Python.)
Weights are positive numbers, normalised to sum to 1. Every member gets the run's seed.

- Problems keep their prompt and answer; their id is prefixed with the member's spec
  (``"arithmetic/arithmetic:12+7"``), so ids are unique across members and the curricula's
  per-prompt pass-rate history never mixes two tasks' prompts.
- ``problem.meta`` holds the member's own meta plus ``task`` (the member spec: held-out
  evaluation reports ``per_task`` pass rates by it), ``mixture_weight`` (the normalised
  weight: `components.curricula` samples prompts by it) and ``inner_id`` / ``inner_meta``
  (what the member's verifier needs).
- ``verify`` hands the member's own problem to the member's verifier; ``solution_text``
  (the warm start's SFT target) likewise.
- The training split is every member's training split; the held-out split interleaves the
  members' held-out problems one by one (round robin), so ``train.eval_prompts = N`` keeps
  the first N and still holds every member equally (until the smaller split runs out).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Mapping, Optional, Sequence

from components.registry import TASKS
from components.tasks.base import Problem, Task, Verdict
from components.tasks.factory import make_task

__all__ = ["MixtureTask", "MIXTURE_META_KEYS", "mixture_weights"]

# Keys the mixture adds to problem.meta (the member's own meta keys are kept beside them).
MIXTURE_META_KEYS = ("task", "mixture_weight", "inner_id", "inner_meta")
ID_SEPARATOR = "/"


def mixture_weights(tasks: Mapping[str, Any]) -> dict[str, float]:
    """Validated, normalised weights {spec: w} (sum 1), in the mapping's order."""
    if not isinstance(tasks, Mapping) or not tasks:
        raise ValueError(
            f"a task mixture is a non-empty dict from task spec to weight, e.g. "
            f'{{"arithmetic": 0.5, "reasoning_gym:countdown": 0.5}}; got {tasks!r}'
        )
    out = {}
    for spec, w in tasks.items():
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"task mixture: every key must be a task spec string, got {spec!r}")
        if isinstance(w, bool) or not isinstance(w, Real) or not math.isfinite(float(w)) or float(w) <= 0:
            raise ValueError(f"task mixture: the weight of {spec!r} must be a positive number, got {w!r}")
        out[spec] = float(w)
    total = sum(out.values())
    return {spec: w / total for spec, w in out.items()}


class MixtureTask(Task):
    """A weighted mixture of tasks (see the module doc).

    Args:
        tasks: {task spec: weight}; specs as for `make_task` ("arithmetic",
            "reasoning_gym:<dataset>", "math_file", ...). Weights > 0, normalised.
        seed: every member's seed.
        task_kwargs: {task spec: {constructor keyword: value}}; every key must be a member.
        member_params: {registered task name: hyper-parameters} of a resolved run (`make_task`'s
            `params`); None: each member as gin configures it.
    """

    name = "mixture"

    def __init__(self, tasks: Optional[Mapping[str, float]] = None, seed: int = 0,
                 task_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 member_params: Optional[Mapping[str, Mapping[str, Any]]] = None):
        self.weights = mixture_weights(tasks if tasks is not None else {})
        per_task = dict(task_kwargs or {})
        unknown = [k for k in per_task if k not in self.weights]
        if unknown:
            hint = ""
            if "path" in unknown:
                hint = " (data.path cannot pick a member of a mixture: give each task its path in train.task_kwargs)"
            raise ValueError(
                f"task mixture: task_kwargs names {unknown}, which are not members of the mixture "
                f"{list(self.weights)}; give one dict of constructor arguments per member{hint}"
            )
        for spec, kw in per_task.items():
            if not isinstance(kw, Mapping):
                raise ValueError(f"task mixture: task_kwargs[{spec!r}] must be a dict of constructor arguments, got {kw!r}")
        self.seed = int(seed)
        self.tasks: dict[str, Task] = {}
        for spec in self.weights:
            kw = dict(per_task.get(spec, {}))
            if "seed" in kw:
                raise ValueError(f"task mixture: task_kwargs[{spec!r}] sets 'seed'; every member takes the run's seed")
            if isinstance(spec, str) and spec == self.name:
                raise ValueError("task mixture: a mixture cannot contain another mixture")
            self.tasks[spec] = make_task(spec, member_params, seed=self.seed, **kw)
        rewards = {(t.reward_correct, t.reward_incorrect) for t in self.tasks.values()}
        if len(rewards) != 1:
            detail = {s: (t.reward_correct, t.reward_incorrect) for s, t in self.tasks.items()}
            raise ValueError(
                f"task mixture: members give different rewards (correct, incorrect) {detail}; "
                "set the same reward_correct / reward_incorrect for every member"
            )
        self.reward_correct, self.reward_incorrect = rewards.pop()
        self._train = [self._wrap(spec, p) for spec, t in self.tasks.items() for p in t.train_problems()]
        per_member_eval = [[self._wrap(spec, p) for p in t.eval_problems()] for spec, t in self.tasks.items()]
        self._eval = _round_robin(per_member_eval)

    # -- problems -----------------------------------------------------------------------------
    def _wrap(self, spec: str, inner: Problem) -> Problem:
        meta = dict(inner.meta or {})
        meta.update(task=spec, mixture_weight=self.weights[spec], inner_id=inner.id, inner_meta=dict(inner.meta or {}))
        return Problem(id=f"{spec}{ID_SEPARATOR}{inner.id}", prompt=inner.prompt, answer=inner.answer, meta=meta)

    def member_of(self, problem: Problem) -> tuple[str, Task, Problem]:
        """(member spec, member task, the member's own problem) of a mixture problem."""
        meta = problem.meta or {}
        spec = meta.get("task")
        if spec not in self.tasks or "inner_id" not in meta:
            raise ValueError(f"problem {problem.id!r} is not a problem of this mixture (members: {list(self.tasks)})")
        inner = Problem(id=meta["inner_id"], prompt=problem.prompt, answer=problem.answer, meta=dict(meta.get("inner_meta", {})))
        return spec, self.tasks[spec], inner

    def train_problems(self) -> list[Problem]:
        return list(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    # -- grading ------------------------------------------------------------------------------
    def verify(self, problem: Problem, completion: str) -> Verdict:
        """The member's own verifier on the member's own problem."""
        try:
            _, task, inner = self.member_of(problem)
        except ValueError as err:
            return self.verdict(False, error=str(err))
        return task.verify(inner, completion)

    def verification_seconds(self, problem: Problem):
        """The member's grading budget for its problem (None where the member declares none)."""
        _, task, inner = self.member_of(problem)
        budget = getattr(task, "verification_seconds", None)
        return None if budget is None else budget(inner)

    def solution_text(self, problem: Problem) -> str:
        """The member's gold completion (for SFT warm starts); TypeError if that member has none."""
        spec, task, inner = self.member_of(problem)
        solve = getattr(task, "solution_text", None)
        if solve is None:
            raise TypeError(f"mixture member {spec!r} ({type(task).__name__}) has no solution_text(problem)")
        return solve(inner)

    def __repr__(self) -> str:
        return f"MixtureTask({self.weights!r}, seed={self.seed})"


def _round_robin(lists: Sequence[Sequence[Problem]]) -> list[Problem]:
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


# Registered without rebinding the class name (instances stay picklable; see arithmetic.py).
TASKS.register("mixture")(MixtureTask)
