"""Prompt samplers and group filters (registry `CURRICULA`), composed as the paper composes them.

A run selects a LIST of names, e.g. ``train.curriculum = ["no_positive_resampling",
"zero_variance_filter"]`` (ScaleRL). At most one entry is a *sampler* (which prompts are
generated: `uniform`, `no_positive_resampling`); the others are *filters* on finished
rollout groups (which groups enter the loss: `zero_variance_filter`, `dynamic_sampling`).
No sampler named means `uniform`.

- ``uniform``: epochs over the training prompts, each a fresh seeded permutation.
- ``no_positive_resampling(threshold=0.9, history=1)``: keeps per prompt the pass rates of
  its last `history` rollout groups; once it has `history` of them and their mean reaches
  `threshold` the prompt is dropped for good (Polaris / ScaleRL; the paper does not say how
  many observations define the "historical pass rate", so it is a parameter). A finite pool
  can run out: once every prompt (of a task, in a mixture) is dropped, drawing the next
  prompt raises `CurriculumExhausted` naming the pool, the threshold and the epoch. It never
  falls back to the dropped prompts silently, which would turn the run into uniform
  resampling of solved prompts. Size the pool so that it lasts the run (tiny_cpu.gin does:
  `curriculum_active` in metrics.jsonl shows the margin). Once fewer prompts are active than one
  order draws (a synchronous step orders all its prompts at once), the same prompt fills several
  groups of that order: the sampler warns once, naming the order's size and the prompts left.
- ``zero_variance_filter``: groups whose rewards are all equal leave the loss; no refill.
- ``dynamic_sampling(max_rounds=8)``: DAPO's dynamic sampling: the same filter, but the
  learner keeps drawing prompts until a full batch of non-zero-variance groups is
  collected (at most `max_rounds` extra rounds per step).

Samplers are deterministic in (seed, epoch) and carry all their state in `state_dict()`
(checkpointed with the run, pass-rate history included).

Task mixtures (``train.task = {"arithmetic": 0.5, "reasoning_gym:countdown": 0.5}``): every
sampler draws prompts by task weight (smooth weighted round robin over the tasks, then each
task's own seeded epochs; see `PromptSampler`). The pass-rate history keys on problem ids,
which the mixture prefixes with the task spec, so it stays per prompt across tasks.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from components.registry import CURRICULA

log = logging.getLogger(__name__)

__all__ = [
    "CurriculumExhausted",
    "UniformSampler",
    "NoPositiveResampling",
    "ZeroVarianceFilter",
    "DynamicSampling",
    "Curriculum",
    "build_curriculum",
    "is_zero_variance",
]


class CurriculumExhausted(RuntimeError):
    """A prompt sampler has no prompt left to draw (No-Positive-Resampling dropped the whole pool)."""


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward of a group is equal (the group carries no learning signal)."""
    r = np.asarray(list(rewards), dtype=np.float64)
    return r.size == 0 or bool(np.all(r == r[0]))


class _Stream:
    """Epochs over one set of prompt indices (the whole task, or one member of a task mixture)."""

    def __init__(self, indices: Sequence[int], rng_key: tuple[int, ...]):
        self.indices = list(indices)
        self.rng_key = tuple(rng_key)
        self.epoch = 0
        self.position = 0
        self.perm: list[int] = []
        self.exhausted = False

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "perm": list(self.perm), "exhausted": self.exhausted}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.perm = list(state["perm"])
        self.exhausted = bool(state.get("exhausted", False))


def mixture_strata(problems: Sequence[Any]) -> list[tuple[str, float, list[int]]] | None:
    """[(task, weight, indices)] when the problems come from a task mixture, else None.

    Mixture problems (`components.tasks.mixture`) carry ``meta["task"]`` and
    ``meta["mixture_weight"]``; every problem of a task must carry the same weight.
    """
    metas = [getattr(p, "meta", None) or {} for p in problems]
    flagged = ["mixture_weight" in m for m in metas]
    if not any(flagged):
        return None
    if not all(flagged):
        raise ValueError("some problems carry a mixture weight (meta['mixture_weight']) and others do not")
    strata: dict[str, tuple[float, list[int]]] = {}
    for i, m in enumerate(metas):
        task, w = str(m.get("task")), float(m["mixture_weight"])
        if task in strata and strata[task][0] != w:
            raise ValueError(f"task {task!r} carries two mixture weights ({strata[task][0]} and {w})")
        if not w > 0:
            raise ValueError(f"task {task!r} has mixture weight {w}; weights must be > 0")
        strata.setdefault(task, (w, []))[1].append(i)
    return [(task, w, idx) for task, (w, idx) in strata.items()]


class PromptSampler:
    """Base sampler: `sample(n)` problems, `observe(problem_id, pass_rate)` after verification.

    A task mixture (problems carrying ``meta["mixture_weight"]``, see `mixture_strata`) is
    sampled by weight: each draw picks a task by smooth weighted round robin (deterministic;
    after any n draws every task has had its weight x n draws to within one), then the next
    prompt of that task's own epoch (a fresh seeded permutation of its prompts per epoch).
    Samplers that drop prompts never fall back to them: drawing from a task whose prompts are all
    dropped raises `CurriculumExhausted` naming the task.
    """

    kind = "sampler"

    def __init__(self, problems: Sequence[Any], seed: int = 0, /):
        if len(problems) == 0:
            raise ValueError(f"{type(self).__name__}: the task has no training problems")
        self.problems = list(problems)
        ids = [p.id for p in self.problems]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{type(self).__name__}: problem ids are not unique")
        self._index = {pid: i for i, pid in enumerate(ids)}
        self.seed = int(seed)
        strata = mixture_strata(self.problems)
        if strata is None:
            self.tasks: list[str] = []
            self.weights: list[float] = []
            self._streams = [_Stream(range(len(self.problems)), (self.seed, 7919))]
        else:
            self.tasks = [t for t, _, _ in strata]
            total = sum(w for _, w, _ in strata)
            self.weights = [w / total for _, w, _ in strata]
            self._streams = [_Stream(idx, (self.seed, 7919, j + 1)) for j, (_, _, idx) in enumerate(strata)]
        self._credit = [0.0] * len(self._streams)  # smooth weighted round robin state

    # -- the single-task view (kept for callers and checkpoints of one-task runs) ---------
    @property
    def epoch(self) -> int:
        return min(s.epoch for s in self._streams)

    @property
    def exhausted(self) -> bool:
        return any(s.exhausted for s in self._streams)

    # -- which prompts may be drawn -----------------------------------------------------
    def active(self, i: int) -> bool:
        return True

    def _new_epoch_permutation(self, stream: _Stream) -> list[int]:
        seed_part, *rest = stream.rng_key
        rng = np.random.default_rng([seed_part, stream.epoch, *rest])
        candidates = [i for i in stream.indices if self.active(i)]
        if not candidates:  # every prompt dropped: stop with a clear error, never resample them silently
            stream.exhausted = True
            raise CurriculumExhausted(self.exhaustion_message(stream))
        return [candidates[j] for j in rng.permutation(len(candidates))]

    def exhaustion_message(self, stream: _Stream) -> str:
        """Why `stream` has no prompt left to draw (samplers that drop prompts override it)."""
        return f"{type(self).__name__}: no active prompt left among {len(stream.indices)} (epoch {stream.epoch})"

    def _next_stream(self) -> _Stream:
        if len(self._streams) == 1:
            return self._streams[0]
        for j, w in enumerate(self.weights):
            self._credit[j] += w
        j = max(range(len(self._credit)), key=lambda x: (self._credit[x], -x))
        self._credit[j] -= 1.0
        return self._streams[j]

    def _draw(self, stream: _Stream) -> Any:
        while True:
            if not stream.perm or stream.position >= len(stream.perm):
                if stream.perm:
                    stream.epoch += 1
                stream.perm = self._new_epoch_permutation(stream)
                stream.position = 0
            i = stream.perm[stream.position]
            stream.position += 1
            if self.active(i):
                return self.problems[i]  # a prompt dropped mid-epoch is skipped for good

    def sample(self, n: int) -> list[Any]:
        return [self._draw(self._next_stream()) for _ in range(n)]

    def observe(self, problem_id: str, pass_rate: float) -> None:
        """Called once per finished rollout group with its pass rate."""

    # -- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        if not self.tasks:
            return self._streams[0].state_dict()
        return {"streams": {t: s.state_dict() for t, s in zip(self.tasks, self._streams)}, "credit": list(self._credit)}

    def load_state_dict(self, state: dict) -> None:
        if not self.tasks:
            self._streams[0].load_state_dict(state)
            return
        if "streams" not in state or set(state["streams"]) != set(self.tasks):
            got = sorted(state.get("streams", {})) if "streams" in state else "a one-task state"
            raise ValueError(f"sampler state holds tasks {got}, but this mixture has {sorted(self.tasks)}")
        for t, s in zip(self.tasks, self._streams):
            s.load_state_dict(state["streams"][t])
        self._credit = [float(c) for c in state["credit"]]

    def stats(self) -> dict:
        return {"curriculum_epoch": self.epoch}


class UniformSampler(PromptSampler):
    """Uniform resampling: epochs over all training prompts, one seeded permutation per epoch."""


class NoPositiveResampling(PromptSampler):
    """Drop a prompt for good once the mean of its last `history` pass rates reaches `threshold`."""

    def __init__(self, problems: Sequence[Any], seed: int = 0, /, *, threshold: float = 0.9, history: int = 1):
        super().__init__(problems, seed)
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"no_positive_resampling.threshold must be in (0, 1], got {threshold!r}")
        if int(history) < 1:
            raise ValueError(f"no_positive_resampling.history must be >= 1, got {history!r}")
        self.threshold = float(threshold)
        self.history = int(history)
        self.pass_history: dict[str, deque] = {}
        self.dropped: set[str] = set()
        self._warned_thin = False

    def sample(self, n: int) -> list[Any]:
        left = len(self.problems) - len(self.dropped)
        if 0 < left < n and not self._warned_thin:
            self._warned_thin = True
            log.warning("no_positive_resampling: %d of %d training prompts are left (the rest reached a pass rate "
                        ">= %g) but %d were ordered at once: the same prompt now fills several of their groups, until "
                        "the pool runs out. Give the run more training prompts or raise the threshold",
                        left, len(self.problems), self.threshold, n)
        return super().sample(n)

    def active(self, i: int) -> bool:
        return self.problems[i].id not in self.dropped

    def exhaustion_message(self, stream: _Stream) -> str:
        j = self._streams.index(stream)
        task = f" of task {self.tasks[j]!r}" if self.tasks else ""
        return (
            f"no_positive_resampling: all {len(stream.indices)} training prompts{task} have been dropped "
            f"(mean pass rate >= {self.threshold} over their last {self.history} rollout group(s)) by epoch "
            f"{stream.epoch}; the paper drops them for good, so a finite pool runs out. Give the run more training "
            f"prompts (e.g. the task's num_train), raise no_positive_resampling.threshold or .history, train fewer "
            f"steps, or use the 'uniform' sampler"
        )

    def observe(self, problem_id: str, pass_rate: float) -> None:
        h = self.pass_history.setdefault(problem_id, deque(maxlen=self.history))
        h.append(float(pass_rate))
        if len(h) == self.history and float(np.mean(h)) >= self.threshold:
            self.dropped.add(problem_id)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["pass_history"] = {k: list(v) for k, v in sorted(self.pass_history.items())}
        state["dropped"] = sorted(self.dropped)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.pass_history = {k: deque(v, maxlen=self.history) for k, v in state["pass_history"].items()}
        self.dropped = set(state["dropped"])

    def stats(self) -> dict:
        return {
            "curriculum_epoch": self.epoch,
            "curriculum_dropped": len(self.dropped),
            "curriculum_active": len(self.problems) - len(self.dropped),
            "curriculum_exhausted": int(self.exhausted),
        }


class GroupFilter:
    """Base filter: `keep(rewards)` decides whether a finished group enters the loss."""

    kind = "filter"
    refill = False
    max_rounds = 0

    def keep(self, rewards: Sequence[float]) -> bool:
        raise NotImplementedError


class ZeroVarianceFilter(GroupFilter):
    """Groups whose rewards are all equal leave the loss (ScaleRL's effective batch); no refill."""

    def keep(self, rewards: Sequence[float]) -> bool:
        return not is_zero_variance(rewards)


class DynamicSampling(ZeroVarianceFilter):
    """DAPO dynamic sampling: drop zero-variance groups and refill the batch (at most `max_rounds` extra rounds)."""

    refill = True

    def __init__(self, *, max_rounds: int = 8):
        if int(max_rounds) < 0:
            raise ValueError(f"dynamic_sampling.max_rounds must be >= 0, got {max_rounds!r}")
        self.max_rounds = int(max_rounds)


# Registered without rebinding the module names, so `isinstance(x, UniformSampler)` holds for
# objects built through the registry's gin-configurable wrappers.
CURRICULA.register("uniform")(UniformSampler)
CURRICULA.register("no_positive_resampling", ranges={"threshold": "(0, 1]", "history": ">= 1"})(NoPositiveResampling)
CURRICULA.register("zero_variance_filter")(ZeroVarianceFilter)
CURRICULA.register("dynamic_sampling", ranges={"max_rounds": ">= 0"})(DynamicSampling)


@dataclass
class Curriculum:
    """One sampler + any number of filters."""

    sampler: PromptSampler
    filters: list[GroupFilter] = field(default_factory=list)

    @property
    def refill(self) -> bool:
        return any(f.refill for f in self.filters)

    @property
    def max_refill_rounds(self) -> int:
        return max([f.max_rounds for f in self.filters if f.refill], default=0)

    def keep(self, rewards: Sequence[float]) -> bool:
        return all(f.keep(rewards) for f in self.filters)

    def sample(self, n: int) -> list[Any]:
        return self.sampler.sample(n)

    def observe(self, problem_id: str, pass_rate: float) -> None:
        self.sampler.observe(problem_id, pass_rate)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])


def build_curriculum(names: Sequence[str] | str, problems: Sequence[Any], seed: int = 0,
                     params: Optional[Mapping[str, Mapping[str, Any]]] = None) -> Curriculum:
    """Compose `names` (registry CURRICULA) into one Curriculum; unknown names raise the registry's error.

    `params`: {name: hyper-parameters} of a resolved run (a name it lacks: its defaults); None: each
    entry as gin configures it (a tool outside a run)."""
    if isinstance(names, str):
        names = [names]
    sampler = None
    filters: list[GroupFilter] = []

    def entry(name: str):
        return CURRICULA.get(name) if params is None else CURRICULA.build(name, params.get(name))

    for name in names:
        cls = entry(name)
        original = CURRICULA.original(name)
        if isinstance(original, type) and issubclass(original, PromptSampler):
            if sampler is not None:
                raise ValueError(
                    f"curriculum {list(names)!r} names two prompt samplers ({type(sampler).__name__} and {name!r}); "
                    "choose one sampler and any number of filters"
                )
            sampler = cls(problems, seed)
        else:
            obj = cls()
            if not hasattr(obj, "keep"):
                raise TypeError(f"curriculum entry {name!r} is neither a prompt sampler nor a group filter")
            filters.append(obj)
    if sampler is None:
        sampler = entry("uniform")(problems, seed)
    return Curriculum(sampler=sampler, filters=filters)
