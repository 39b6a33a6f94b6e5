"""Length control (registry ``LENGTH_CONTROLS``): generator-side and reward-side policies.

``LENGTH_CONTROLS.get(name)(**kw)`` returns an object with

- ``interruptions(n, rng, tokenizer) -> list[Interruption | None]``: generator side, one entry
  per sample of a prompt (None = no interruption); put on ``GenerationRequest.interruptions``.
- ``max_tokens(requested) -> int``: the ``SamplingParams.max_tokens`` the generator should use
  when the run asks for ``requested`` (interruption: thinking_max + answer_budget;
  length_penalty: L_max, so that the penalty reaches −1 exactly at the cap; truncate: its own
  ``max_tokens`` if set, else ``requested``).
- ``shape_reward(reward, passed, num_tokens) -> float``: reward side (length_penalty adds the
  DAPO/ScaleRL overlong penalty to correct traces only; the others return ``reward``).

Policies:
- ``interruption`` (ScaleRL, PAPER.md §2): each sample gets an interruption point drawn
  uniformly from [thinking_min, thinking_max]; if it is still generating there AND still
  thinking (its ``think_open`` part, default ``<think>``, is open, in the completion or left
  open by the prompt, and it has not sampled ``think_close``, default ``</think>``), the phrase
  (default "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>";
  it must contain ``think_close``) is appended and ``answer_budget`` more tokens are allowed;
  its finish reason is "interrupted". A sample whose answer has started is never interrupted
  and samples on to the cap (``max_tokens``). ``think_close = None`` treats every sample as
  thinking (a model without a thinking part). Paper defaults: 10,240–12,288 thinking tokens,
  2,048 answer tokens. Tiny runs bind smaller budgets in gin (experiments/configs/tiny_cpu.gin:
  a short phrase that closes the thinking part, budgets of a few tokens).
- ``length_penalty`` (DAPO overlong shaping as ScaleRL uses it, PAPER.md §5): for a correct
  trace, reward + clip((L_max − |y|)/L_cache − 1, −1, 0); incorrect traces unchanged.
  Defaults L_max = 14,336, L_cache = 2,048 (ScaleRL's "14k and 2k").
- ``truncate``: plain truncation at the generation cap; rewards unchanged.
"""

from __future__ import annotations

import random
from typing import Optional

from components.engines.base import Interruption
from components.registry import LENGTH_CONTROLS

__all__ = ["DEFAULT_INTERRUPTION_PHRASE", "ForcedInterruption", "LengthPenalty", "Truncate", "overlong_penalty"]

DEFAULT_INTERRUPTION_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"


def overlong_penalty(num_tokens: int, l_max: int, l_cache: int) -> float:
    """DAPO's soft overlong penalty: clip((L_max − |y|)/L_cache − 1, −1, 0).

    0 up to L_max − L_cache tokens, then linear down to −1 at L_max, −1 beyond.
    """
    value = (l_max - num_tokens) / l_cache - 1.0
    return min(0.0, max(-1.0, value))


class _LengthControl:
    """Shared defaults: no interruptions, reward unchanged, generation cap unchanged."""

    name = "base"

    def interruptions(self, n: int, rng: random.Random, tokenizer) -> list[Optional[Interruption]]:
        return [None] * int(n)

    def max_tokens(self, requested: int) -> int:
        return int(requested)

    def shape_reward(self, reward: float, passed: bool, num_tokens: int) -> float:
        return reward


@LENGTH_CONTROLS.register("interruption", ranges={"thinking_min": ">= 0", "thinking_max": ">= 0", "answer_budget": ">= 1"})
class ForcedInterruption(_LengthControl):
    """Forced interruption: at a random point in [thinking_min, thinking_max] append `phrase`, then allow `answer_budget`."""

    name = "interruption"

    def __init__(
        self,
        thinking_min: int = 10240,
        thinking_max: int = 12288,
        answer_budget: int = 2048,
        phrase: str = DEFAULT_INTERRUPTION_PHRASE,
        think_open: Optional[str] = "<think>",
        think_close: Optional[str] = "</think>",
    ):
        if not 0 <= thinking_min <= thinking_max:
            raise ValueError(
                f"interruption: need 0 <= thinking_min <= thinking_max, got thinking_min={thinking_min}, "
                f"thinking_max={thinking_max}"
            )
        if answer_budget < 1:
            raise ValueError(f"interruption: answer_budget must be >= 1, got {answer_budget}")
        if not phrase:
            raise ValueError("interruption: the phrase must be a non-empty string")
        if think_close and think_close not in phrase:
            raise ValueError(
                f"interruption: the phrase {phrase!r} must close the thinking part (contain think_close "
                f"{think_close!r}), or the answer after it would still count as thinking; set "
                "interruption.think_close = None for a model without a thinking part"
            )
        self.thinking_min = int(thinking_min)
        self.thinking_max = int(thinking_max)
        self.answer_budget = int(answer_budget)
        self.phrase = phrase
        self.think_open = think_open or None
        self.think_close = think_close or None
        self._phrase_cache: dict[int, tuple[int, ...]] = {}
        self._marker_cache: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def phrase_ids(self, tokenizer) -> tuple[int, ...]:
        """The phrase tokenised without special tokens added (cached per tokenizer)."""
        key = id(tokenizer)
        if key not in self._phrase_cache:
            ids = tokenizer.encode(self.phrase, add_special_tokens=False)
            if not ids:
                raise ValueError(f"interruption: the phrase {self.phrase!r} tokenises to nothing")
            self._phrase_cache[key] = tuple(int(i) for i in ids)
        return self._phrase_cache[key]

    def marker_ids(self, tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ids of think_open, ids of think_close), tokenised without special tokens added; () when unset."""
        key = id(tokenizer)
        if key not in self._marker_cache:
            out = []
            for marker in (self.think_open, self.think_close):
                ids = tuple(int(i) for i in tokenizer.encode(marker, add_special_tokens=False)) if marker else ()
                if marker and not ids:
                    raise ValueError(f"interruption: the thinking marker {marker!r} tokenises to nothing")
                out.append(ids)
            self._marker_cache[key] = (out[0], out[1])
        return self._marker_cache[key]

    def interruptions(self, n: int, rng: random.Random, tokenizer) -> list[Optional[Interruption]]:
        ids = self.phrase_ids(tokenizer)
        opening, closing = self.marker_ids(tokenizer)
        return [
            Interruption(at_token=rng.randint(self.thinking_min, self.thinking_max), phrase_ids=ids,
                         answer_budget=self.answer_budget, think_open_ids=opening, think_close_ids=closing)
            for _ in range(int(n))
        ]

    def max_tokens(self, requested: int) -> int:
        """Sampled-token cap: the longest thinking plus the answer budget (the request is superseded)."""
        return self.thinking_max + self.answer_budget

    def __repr__(self) -> str:
        return (
            f"interruption(thinking_min={self.thinking_min}, thinking_max={self.thinking_max}, "
            f"answer_budget={self.answer_budget}, phrase={self.phrase!r}, think_open={self.think_open!r}, "
            f"think_close={self.think_close!r})"
        )


@LENGTH_CONTROLS.register("length_penalty", ranges={"l_max": ">= 2", "l_cache": ">= 1"})
class LengthPenalty(_LengthControl):
    """DAPO-style overlong penalty clip((L_max − |y|)/L_cache − 1, −1, 0), added to correct traces only."""

    name = "length_penalty"

    def __init__(self, l_max: int = 14336, l_cache: int = 2048):
        if l_cache < 1 or l_max <= l_cache:
            raise ValueError(f"length_penalty: need 1 <= l_cache < l_max, got l_max={l_max}, l_cache={l_cache}")
        self.l_max = int(l_max)
        self.l_cache = int(l_cache)

    def max_tokens(self, requested: int) -> int:
        return self.l_max

    def shape_reward(self, reward: float, passed: bool, num_tokens: int) -> float:
        if not passed:
            return reward
        return reward + overlong_penalty(num_tokens, self.l_max, self.l_cache)

    def __repr__(self) -> str:
        return f"length_penalty(l_max={self.l_max}, l_cache={self.l_cache})"


@LENGTH_CONTROLS.register("truncate", ranges={"max_tokens": ">= 1"})
class Truncate(_LengthControl):
    """Plain truncation at the generation cap (`max_tokens`, or the run's when None); rewards unchanged."""

    name = "truncate"

    def __init__(self, max_tokens: Optional[int] = None):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"truncate: max_tokens must be >= 1 or None, got {max_tokens}")
        self._max_tokens = max_tokens

    def max_tokens(self, requested: int) -> int:
        return int(self._max_tokens) if self._max_tokens is not None else int(requested)

    def __repr__(self) -> str:
        return f"truncate(max_tokens={self._max_tokens})"
