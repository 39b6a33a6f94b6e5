"""The one interface every task implements (registry `TASKS`).

A task is a prompt source with a seeded train / held-out split and a verifier that turns
a completion's text into a binary verdict (reward +1 / -1 by default, configurable to 1 / 0).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class Problem:
    """One prompt with what its verifier needs.

    `prompt` is the user message text; `render_prompt` applies the tokenizer's chat
    template where it has one. `answer` is whatever the verifier compares against.
    """

    id: str
    prompt: str
    answer: Any
    meta: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Verdict:
    """The verifier's judgement of one completion."""

    passed: bool
    reward: float
    error: Optional[str] = None  # set when the verifier raised / timed out (then passed=False)


class Task(ABC):
    """A prompt source + verifier. Subclasses register with `@TASKS.register(name)`.

    Constructors take at least `seed`, `reward_correct` (default 1.0) and
    `reward_incorrect` (default -1.0).
    """

    name: str = "task"
    reward_correct: float = 1.0
    reward_incorrect: float = -1.0

    @abstractmethod
    def train_problems(self) -> Sequence[Problem]:
        """The training split (deterministic for a given seed)."""

    @abstractmethod
    def eval_problems(self) -> Sequence[Problem]:
        """The held-out split, disjoint from the training split."""

    @abstractmethod
    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Judge one completion's text (the decoded completion, without the prompt)."""

    def verdict(self, passed: bool, error: Optional[str] = None) -> Verdict:
        return Verdict(passed=bool(passed), reward=self.reward_correct if passed else self.reward_incorrect, error=error)
