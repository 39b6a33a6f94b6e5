"""`stories`: procedural word problems with a worked scratchpad, the task of the small testbed.

A problem follows one person's count of one item through a story of events::

    prompt:  Dalmi has 7 velk . #1 Dalmi finds 4 velk . #2 Dalmi gives 3 velk to Orsu . #3 Dalmi buys
             9 velk . how many velk does Dalmi have ?
    gold:    <think> 7 velk . #1 finds 4 velk : 7 + 4 = 11 . #2 gives 3 velk to Orsu : 11 - 3 = 8 .
             #3 buys 9 velk : 8 + 9 = 17 . </think> 17

so a correct completion restates each event (copying its verb, amount, item and any other person
from the prompt, found by its marker #k) and does its arithmetic. Its length grows with the number of events, so a
difficulty range gives completions of widely varied length; every step is a small, local
computation on numbers below `max_value`, so a tiny model learns the format and most of the
arithmetic in a short supervised phase and RL has a per-step error rate to lower.

Difficulty knobs: `min_steps` .. `max_steps` events per story (uniform), `max_delta` (the largest
amount an event moves), `max_value` (counts stay in 0..max_value), `others` (the chance that an
event involves another person, to be copied).

The vocabulary is large on purpose (the small testbed's LM head must be large enough for its
precision to matter): `num_names` person names and `num_items` item nouns, pseudo-words drawn
from syllables with a FIXED lexicon seed, so every run seed, warm start and difficulty setting
shares one vocabulary (`vocabulary()`, what a word-level tokenizer is trained on:
components/models.py). Every token of the text is separated by a space.

The split is decided per problem by a keyed hash of its text and the seed (`held_out_share` of
all texts are held out), so two tasks built with the same seed but different difficulty knobs
(a warm start on easier stories, RL on all of them) never put one problem on both sides.
"""

from __future__ import annotations

import random
import zlib
from typing import Optional

from components.registry import TASKS
from components.tasks.arithmetic import verify_last_int
from components.tasks.base import Problem, Verdict
from components.tasks.common import SplitTask

__all__ = ["StoryTask", "lexicon", "GAIN_VERBS", "LOSS_VERBS"]

# (verb, preposition): "Dalmi gets 3 velk from Orsu" / "Dalmi gives 3 velk to Orsu"
GAIN_VERBS = ("finds", "buys", "picks", "wins", "makes", "gets")
LOSS_VERBS = ("loses", "eats", "sells", "drops", "uses", "gives")
_WITH_OTHER = {"gets": "from", "gives": "to", "wins": "from", "sells": "to"}
FUNCTION_WORDS = ("has", "how", "many", "does", "have", "?", ".", ":", "+", "-", "=", "to", "from")
LEXICON_SEED = 20261128  # one vocabulary for every seed and setting
MAX_STEPS = 16  # the largest max_steps (event markers #1..#16 are in every vocabulary)
MAX_VALUE = 99  # the largest max_value (the numbers 0..99 are in every vocabulary)
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "st", "tr", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "k", "m")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)


def lexicon(num_names: int, num_items: int) -> tuple[list[str], list[str]]:
    """(names, items): `num_names` capitalised and `num_items` lower-case pseudo-words, all distinct
    and distinct from the task's other words, drawn with the fixed LEXICON_SEED."""
    rng = random.Random(LEXICON_SEED)
    taken = set(GAIN_VERBS) | set(LOSS_VERBS) | set(FUNCTION_WORDS)
    out: list[list[str]] = [[], []]
    for i, n in enumerate((num_names, num_items)):
        tries = 0
        while len(out[i]) < n:
            tries += 1
            if tries > 200 * n + 1000:
                raise ValueError(f"stories: cannot draw {n} distinct pseudo-words; lower num_names / num_items")
            w = _word(rng, rng.choice((2, 2, 3)))
            w = w.capitalize() if i == 0 else w
            if w.lower() not in taken:
                taken.add(w.lower())
                out[i].append(w)
    return out[0], out[1]


class StoryTask(SplitTask):
    """Word problems tracking one count through `min_steps`..`max_steps` events (module doc).

    Args:
        seed: draws the stories and decides the split.
        num_train / num_eval: sizes of the two splits (distinct stories).
        min_steps / max_steps: events per story, uniform in this range (>= 1).
        max_delta: the largest amount one event adds or removes (>= 1).
        max_value: every count stays in 0..max_value (>= max_delta).
        others: the chance that an event names another person (gives to / gets from), in [0, 1].
        num_names / num_items: the lexicon (vocabulary) sizes.
        held_out_share: the share of all possible stories that belongs to the held-out side.
        reward_correct / reward_incorrect: the rewards of the verdicts (+1 / -1 by default).
    """

    name = "stories"

    def __init__(
        self,
        seed: int = 0,
        reward_correct: float = 1.0,
        reward_incorrect: float = -1.0,
        num_train: int = 4000,
        num_eval: int = 400,
        min_steps: int = 2,
        max_steps: int = 8,
        max_delta: int = 9,
        max_value: int = 60,
        others: float = 0.3,
        num_names: int = 2400,
        num_items: int = 1700,
        held_out_share: float = 0.1,
    ):
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"stories: need 1 <= min_steps <= max_steps, got min_steps={min_steps}, max_steps={max_steps}")
        if max_steps > MAX_STEPS:
            raise ValueError(f"stories: max_steps must be <= {MAX_STEPS}, got {max_steps}")
        if max_delta < 1 or not max_delta <= max_value <= MAX_VALUE:
            raise ValueError(f"stories: need 1 <= max_delta <= max_value <= {MAX_VALUE}, got max_delta={max_delta}, "
                             f"max_value={max_value}")
        if not 0.0 <= others <= 1.0:
            raise ValueError(f"stories: others must be in [0, 1], got {others}")
        if not 0.0 < held_out_share < 1.0:
            raise ValueError(f"stories: held_out_share must be in (0, 1), got {held_out_share}")
        if num_train < 0 or num_eval < 0 or num_names < 2 or num_items < 1:
            raise ValueError(f"stories: num_train ({num_train}) and num_eval ({num_eval}) must be >= 0, "
                             f"num_names ({num_names}) >= 2 and num_items ({num_items}) >= 1")
        self.seed = seed
        self.reward_correct, self.reward_incorrect = float(reward_correct), float(reward_incorrect)
        self.min_steps, self.max_steps = int(min_steps), int(max_steps)
        self.max_delta, self.max_value, self.others = int(max_delta), int(max_value), float(others)
        self.held_out_share = float(held_out_share)
        self.names, self.items = lexicon(num_names, num_items)
        self._train, self._eval = self._draw(num_train, num_eval)

    # -- vocabulary ---------------------------------------------------------------------
    def vocabulary(self) -> list[str]:
        """Every word any setting of the difficulty knobs can use (the word-level tokenizer's
        vocabulary): it depends on the lexicon sizes only, so a warm start on easier stories and RL
        on harder ones share one tokenizer."""
        numbers = [str(v) for v in range(MAX_VALUE + 1)]
        markers = [f"#{k}" for k in range(1, MAX_STEPS + 1)]
        return [*FUNCTION_WORDS, *GAIN_VERBS, *LOSS_VERBS, *numbers, *markers, *self.names, *self.items]

    # -- generation -----------------------------------------------------------------------
    def _story(self, rng: random.Random) -> tuple[str, str, int, list[tuple[str, int, Optional[str]]]]:
        hero, item = rng.choice(self.names), rng.choice(self.items)
        count = rng.randint(0, self.max_value)
        start = count
        events = []
        for _ in range(rng.randint(self.min_steps, self.max_steps)):
            can_gain = [d for d in range(1, self.max_delta + 1) if count + d <= self.max_value]
            can_lose = [d for d in range(1, self.max_delta + 1) if count - d >= 0]
            gain = bool(can_gain) and (not can_lose or rng.random() < 0.5)
            amount = rng.choice(can_gain if gain else can_lose)
            verb = rng.choice(GAIN_VERBS if gain else LOSS_VERBS)
            other = None
            if verb in _WITH_OTHER and rng.random() < self.others:
                other = rng.choice([n for n in self.names[:64] if n != hero] or self.names)
            events.append((verb, amount, other))
            count += amount if gain else -amount
        return hero, item, start, events

    def _draw(self, num_train: int, num_eval: int) -> tuple[list[Problem], list[Problem]]:
        rng = random.Random(self.seed)
        train: list[Problem] = []
        held: list[Problem] = []
        seen: set[str] = set()
        tries = 0
        while len(train) < num_train or len(held) < num_eval:
            tries += 1
            if tries > 50 * (num_train + num_eval) + 1000:
                raise ValueError(f"stories: could not draw {num_train} + {num_eval} distinct stories; widen the knobs")
            problem = self._problem(*self._story(rng))
            if problem.prompt in seen:
                continue
            seen.add(problem.prompt)
            side = held if self._is_held_out(problem.prompt) else train
            if len(side) < (num_eval if side is held else num_train):
                side.append(problem)
        for p in held:
            p.meta["split"] = "eval"
        return train, held

    def _is_held_out(self, text: str) -> bool:
        h = zlib.crc32(f"{self.seed}\x00{text}".encode())
        return h % 1_000_003 < self.held_out_share * 1_000_003

    def _problem(self, hero: str, item: str, start: int, events: list) -> Problem:
        words = [f"{hero} has {start} {item} ."]
        count = start
        steps = []
        for k, (verb, amount, other) in enumerate(events, start=1):
            gain = verb in GAIN_VERBS
            tail = f" {_WITH_OTHER[verb]} {other}" if other else ""
            words.append(f"#{k} {hero} {verb} {amount} {item}{tail} .")
            new = count + amount if gain else count - amount
            steps.append(f"#{k} {verb} {amount} {item}{tail} : {count} {'+' if gain else '-'} {amount} = {new} .")
            count = new
        words.append(f"how many {item} does {hero} have ?")
        return Problem(
            id=f"stories:{zlib.crc32(' '.join(words).encode()):08x}",
            prompt=" ".join(words),
            answer=count,
            meta={"split": "train", "steps": len(events), "start": start, "item": item,
                  "scratchpad": f"<think> {start} {item} . " + " ".join(steps) + " </think>"},
        )

    # -- Task interface -------------------------------------------------------------------
    def solution_text(self, problem: Problem) -> str:
        """The gold completion: the worked scratchpad, then the answer."""
        return f"{problem.meta['scratchpad']} {problem.answer}"

    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Correct iff the last integer after the thinking part equals the answer."""
        return verify_last_int(self, problem, completion)


TASKS.register("stories", ranges={"num_train": ">= 0", "num_eval": ">= 0", "min_steps": ">= 1",
                                  "max_steps": f"[1, {MAX_STEPS}]", "max_delta": ">= 1", "max_value": f"[1, {MAX_VALUE}]", "others": "[0, 1]",
                                  "num_names": ">= 2", "num_items": ">= 1", "held_out_share": "(0, 1)"})(StoryTask)
