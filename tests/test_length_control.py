"""Length control policies (components/length_control.py)."""

from __future__ import annotations

import random

import pytest

from components.engines.base import Interruption
from components.length_control import DEFAULT_INTERRUPTION_PHRASE, overlong_penalty
from components.models import make_char_tokenizer
from components.registry import LENGTH_CONTROLS, UnknownComponentError


def dapo_reference(n: int, l_max: int, l_cache: int) -> float:
    """DAPO's piecewise overlong reward (PAPER.md §5), in float64 as written in the paper."""
    if n <= l_max - l_cache:
        return 0.0
    if n <= l_max:
        return ((l_max - l_cache) - n) / l_cache
    return -1.0


def test_registry():
    assert {"interruption", "length_penalty", "truncate"} <= set(LENGTH_CONTROLS.names())
    with pytest.raises(UnknownComponentError):
        LENGTH_CONTROLS.get("interuption")


@pytest.mark.parametrize("l_max,l_cache", [(14336, 2048), (20480, 4096), (64, 16), (10, 3)])
def test_overlong_penalty_matches_dapo_piecewise(l_max, l_cache):
    for n in list(range(0, l_max + 2 * l_cache, max(1, l_cache // 7))) + [l_max - l_cache, l_max - l_cache + 1, l_max, l_max + 1]:
        assert overlong_penalty(n, l_max, l_cache) == pytest.approx(dapo_reference(n, l_max, l_cache), abs=1e-12)


def test_length_penalty_only_on_correct_traces():
    lp = LENGTH_CONTROLS.get("length_penalty")(l_max=100, l_cache=20)
    assert lp.shape_reward(1.0, True, 50) == 1.0
    assert lp.shape_reward(1.0, True, 90) == pytest.approx(1.0 - 10 / 20)
    assert lp.shape_reward(1.0, True, 100) == pytest.approx(0.0)
    assert lp.shape_reward(1.0, True, 150) == pytest.approx(0.0)
    assert lp.shape_reward(-1.0, False, 150) == -1.0  # incorrect: unchanged
    assert lp.max_tokens(64) == 100
    assert lp.interruptions(3, random.Random(0), None) == [None, None, None]
    default = LENGTH_CONTROLS.get("length_penalty")()
    assert (default.l_max, default.l_cache) == (14336, 2048)
    with pytest.raises(ValueError, match="l_cache"):
        LENGTH_CONTROLS.get("length_penalty")(l_max=10, l_cache=10)


def test_interruption_points_and_phrase():
    tok = make_char_tokenizer()
    ctl = LENGTH_CONTROLS.get("interruption")(thinking_min=5, thinking_max=9, answer_budget=4)
    its = ctl.interruptions(400, random.Random(0), tok)
    assert len(its) == 400 and all(isinstance(i, Interruption) for i in its)
    points = [i.at_token for i in its]
    assert min(points) == 5 and max(points) == 9  # uniform over the closed range
    assert all(i.answer_budget == 4 for i in its)
    assert tok.decode(list(its[0].phrase_ids)) == DEFAULT_INTERRUPTION_PHRASE
    assert its[0].phrase_ids[-1] == tok.convert_tokens_to_ids("</think>")
    again = ctl.interruptions(400, random.Random(0), tok)
    assert [i.at_token for i in again] == points  # deterministic given the rng
    assert ctl.max_tokens(64) == 9 + 4
    assert ctl.shape_reward(1.0, True, 10_000) == 1.0


def test_interruption_defaults_follow_the_paper():
    ctl = LENGTH_CONTROLS.get("interruption")()
    assert (ctl.thinking_min, ctl.thinking_max, ctl.answer_budget) == (10240, 12288, 2048)
    assert DEFAULT_INTERRUPTION_PHRASE == "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
    custom = LENGTH_CONTROLS.get("interruption")(phrase="Time is up. </think>", thinking_min=1, thinking_max=2, answer_budget=1)
    tok = make_char_tokenizer()
    assert tok.decode(list(custom.interruptions(1, random.Random(1), tok)[0].phrase_ids)) == "Time is up. </think>"
    for bad in (dict(thinking_min=5, thinking_max=4), dict(answer_budget=0), dict(phrase="")):
        with pytest.raises(ValueError):
            LENGTH_CONTROLS.get("interruption")(**bad)


def test_truncate():
    tr = LENGTH_CONTROLS.get("truncate")()
    assert tr.max_tokens(77) == 77 and tr.shape_reward(-1.0, False, 10**6) == -1.0
    assert LENGTH_CONTROLS.get("truncate")(max_tokens=12).max_tokens(77) == 12
    assert tr.interruptions(2, random.Random(0), None) == [None, None]
