"""Rewards as plain functions (registry `REWARDS`).

A reward is a function of the prompt text, the completion text and the dataset row::

    from components.registry import REWARDS

    @REWARDS.register("my_reward")
    def my_reward(prompt: str, completion: str, **row) -> float | bool:
        return 1.0 if row["answer"] in completion else 0.0

- ``prompt`` is the problem's user message (before the chat template), ``completion`` the
  decoded completion (thinking part included: strip it with
  `components.tasks.common.strip_thinking` if the reward should not see it);
- ``row`` holds the dataset row's columns under their own names, plus the mapped ``answer``
  (and ``tests``) of a task with a column mapping (`hf_dataset`);
- a ``bool`` is a verdict: the reward is the task's ``reward_correct`` / ``reward_incorrect``
  (+1 / -1 by default); a number is the reward itself, and the completion passes iff
  ``reward >= pass_threshold``. The trainer logs the mean reward (``reward_mean``) and the pass
  rate (``pass_rate``) separately.

A user's reward lives in their own file, imported by an ``import my_rewards`` line of the gin
file, and is selected by name with a dataset task: ``hf_dataset.reward = "my_reward"`` (also
``math_file.reward`` / ``code_file.reward``). Parameters with defaults bind from gin as
``my_reward.<param>``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Optional

from components.registry import REWARDS
from components.tasks.base import Verdict
from components.tasks.common import strip_special_tokens, strip_thinking
from components.tasks.math_answers import math_equal, parse_gold, plain_answer

__all__ = ["reward_verdict", "value_to_verdict", "check_reward", "math_answer_matches", "math_verify", "exact_match"]

# Row keys never passed as **row: they are the positional arguments.
RESERVED_KEYS = ("prompt", "completion")


def check_reward(name: Optional[str]) -> Optional[str]:
    """Validate a reward name early (the registry's error lists the registered names)."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward is selected by its registered name (a string), got {name!r}")
    REWARDS.check(name)
    return name


def reward_verdict(
    name: str,
    prompt: str,
    completion: str,
    row: Mapping[str, Any],
    *,
    pass_threshold: float = 1.0,
    reward_correct: float = 1.0,
    reward_incorrect: float = -1.0,
) -> Verdict:
    """Call reward `name` and turn its value into a Verdict; never raises.

    bool -> passed = value, reward = reward_correct / reward_incorrect;
    number -> reward = value, passed = value >= pass_threshold;
    anything else, a non-finite number, or an exception -> failed with the error set (the
    trainer then gives reward_incorrect and counts a verifier error).
    """
    kwargs = {k: v for k, v in row.items() if k not in RESERVED_KEYS}
    try:
        value = REWARDS.get(name)(prompt, completion, **kwargs)
    except Exception as err:  # noqa: BLE001 - a reward crashing on odd text fails the sample
        return Verdict(False, float(reward_incorrect), error=f"reward {name!r} raised {type(err).__name__}: {err}")
    return value_to_verdict(name, value, pass_threshold=pass_threshold, reward_correct=reward_correct,
                            reward_incorrect=reward_incorrect)


def value_to_verdict(name: str, value: Any, *, pass_threshold: float, reward_correct: float,
                     reward_incorrect: float) -> Verdict:
    """A reward function's return value as a Verdict (see `reward_verdict`)."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        passed = bool(value)
        return Verdict(passed, float(reward_correct if passed else reward_incorrect))
    if isinstance(value, numbers.Real):
        reward = float(value)
        if not math.isfinite(reward):
            return Verdict(False, float(reward_incorrect), error=f"reward {name!r} returned {reward!r}")
        return Verdict(reward >= pass_threshold, reward)
    return Verdict(
        False, float(reward_incorrect),
        error=f"reward {name!r} returned {type(value).__name__} {value!r:.80}; return a float or a bool",
    )


# -- built-in rewards --------------------------------------------------------------------------
def math_answer_matches(completion: str, answer: Any, max_answer_chars: int = 4000) -> bool:
    """math-verify equivalence of the text after the last </think> with the gold `answer`.

    No answer (a thinking part left open, or nothing after it) is wrong. A gold answer that
    math-verify cannot parse is compared as text with the last boxed answer / last line.
    """
    final = strip_thinking(completion)
    if final is None or not final.strip():
        return False
    final = strip_special_tokens(final)[-int(max_answer_chars):]
    gold_text = str(answer).strip()
    gold = parse_gold(gold_text)
    if not gold:
        return plain_answer(final) == gold_text
    return math_equal(gold, final)


@REWARDS.register("math_verify")
def math_verify(prompt: str, completion: str, *, answer: Any = None, max_answer_chars: int = 4000, **row) -> bool:
    """math-verify equivalence of the answer after the last </think> with the row's `answer`."""
    if answer is None or not str(answer).strip():
        raise ValueError(f"math_verify needs the row's 'answer' (map it: columns = {{'answer': ...}}); row keys: {sorted(row)}")
    return math_answer_matches(completion, answer, max_answer_chars)


@REWARDS.register("exact_match")
def exact_match(prompt: str, completion: str, *, answer: Any = None, **row) -> bool:
    """The answer part (after the last </think>, stripped) equals str(answer), stripped."""
    if answer is None:
        raise ValueError(f"exact_match needs the row's 'answer'; row keys: {sorted(row)}")
    final = strip_thinking(completion)
    return final is not None and strip_special_tokens(final).strip() == str(answer).strip()
