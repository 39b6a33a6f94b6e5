"""A reward function's call and its value as a task's `Verdict`: what the tasks that grade with a
plain-function reward (math_file, code_file, hf_dataset, downstream benchmarks) call.

The rewards themselves (registry `REWARDS`) and the weighted reward functions of a run are
`components/rewards.py`'s, a layer above: the tasks look a reward up by name and never import it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Optional

from components.registry import REWARDS
from components.tasks.base import Verdict
from components.tasks.common import strip_special_tokens, strip_thinking
from components.tasks.math_answers import math_equal, parse_gold, plain_answer

__all__ = ["RESERVED_KEYS", "check_reward", "reward_verdict", "value_to_verdict", "math_answer_matches"]

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
    params: Optional[Mapping[str, Any]] = None,
) -> Verdict:
    """Call reward `name` (with `params`, its hyper-parameters in a resolved run; None: as gin
    configures it) and turn its value into a Verdict; never raises.

    bool -> passed = value, reward = reward_correct / reward_incorrect;
    number -> reward = value, passed = value >= pass_threshold;
    anything else, a non-finite number, or an exception -> failed with the error set (the
    trainer then gives reward_incorrect and counts a verifier error).
    """
    kwargs = {k: v for k, v in row.items() if k not in RESERVED_KEYS}
    try:
        value = REWARDS.build(name, params)(prompt, completion, **kwargs)
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
