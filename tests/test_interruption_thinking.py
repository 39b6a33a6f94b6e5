"""Forced interruptions only while the model is still thinking (issue 12 item 4).

An interruption must not be injected after ``</think>`` nor into an answer that started without a
thinking part. Checked on the rule itself (`still_thinking`), on the length control that builds the
interruptions, on the torch engine with a scripted policy (its head emits a fixed token sequence,
so the placement is exact), and on the vllm engine's decision (`_on_finished`, with vLLM stubbed).
"""

from __future__ import annotations

import random

import pytest
import torch

from components.engines import GenerationRequest, Interruption, SamplingParams, make_engine
from components.engines.base import PendingGroup, still_thinking
from components.length_control import ForcedInterruption
from components.models import build_tiny_policy, load_causal_lm, load_tokenizer

torch.set_num_threads(1)

OPEN, CLOSE, A, B = 90, 91, 92, 93  # arbitrary ids for the pure-rule tests


def it(at=3, open_ids=(OPEN,), close_ids=(CLOSE,)):
    return Interruption(at_token=at, phrase_ids=(CLOSE,), answer_budget=2, think_open_ids=open_ids, think_close_ids=close_ids)


@pytest.mark.parametrize(
    "prompt,completion,expected",
    [
        ([1, 2], [OPEN, A, A], True),  # opened in the completion, not closed
        ([1, 2], [OPEN, A, CLOSE, B], False),  # closed: the answer has started
        ([1, 2], [A, B, A], False),  # answered without thinking
        ([1, OPEN], [A, B], True),  # the prompt (chat template) opened the thinking part
        ([1, OPEN], [A, CLOSE, B], False),
        ([OPEN, 5, CLOSE, 7], [A, B], False),  # the prompt's thinking part is closed already
        ([OPEN, 5, CLOSE, OPEN], [A], True),
        ([1, 2], [], False),
    ],
)
def test_still_thinking_rule(prompt, completion, expected):
    assert still_thinking(it(), prompt, completion) is expected


def test_still_thinking_multi_token_markers_and_no_markers():
    multi = it(open_ids=(5, 6), close_ids=(7, 8))
    assert still_thinking(multi, [1], [5, 6, 1, 7])  # a partial close is no close
    assert not still_thinking(multi, [1], [5, 6, 1, 7, 8, 2])
    assert not still_thinking(multi, [1], [5, 1, 6])  # "5 1 6" does not open
    assert still_thinking(it(open_ids=(), close_ids=()), [1], [CLOSE, A])  # no markers: always thinking
    assert still_thinking(it(open_ids=()), [1], [A, B])  # close marker only: thinking until it is sampled
    assert not still_thinking(it(open_ids=()), [1], [A, CLOSE])


def test_length_control_carries_the_markers(tmp_path):
    tok = load_tokenizer(build_tiny_policy(tmp_path / "m"))
    lc = ForcedInterruption(thinking_min=4, thinking_max=6, answer_budget=3, phrase="</think>")
    its = lc.interruptions(5, random.Random(0), tok)
    assert all(4 <= i.at_token <= 6 and i.answer_budget == 3 for i in its)
    assert its[0].think_open_ids == (tok.convert_tokens_to_ids("<think>"),)
    assert its[0].think_close_ids == (tok.convert_tokens_to_ids("</think>"),) == its[0].phrase_ids
    assert lc.max_tokens(99) == 9
    with pytest.raises(ValueError, match="must close the thinking part"):
        ForcedInterruption(phrase=" so: ")
    legacy = ForcedInterruption(phrase=" so: ", think_close=None, think_open=None)
    assert legacy.interruptions(1, random.Random(0), tok)[0].think_close_ids == ()


class ScriptedHead(torch.nn.Linear):
    """An LM head whose k-th call puts (almost) all mass on script[k] for every row (ignores its input)."""

    def __init__(self, hidden, vocab, script):
        super().__init__(hidden, vocab, bias=False)
        self.script, self.calls = list(script), 0

    def forward(self, x):
        tok = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        logits = torch.full((*x.shape[:-1], self.out_features), -40.0, dtype=x.dtype)  # [..., V]
        logits[..., tok] = 0.0
        return logits + 0.0 * x.sum(-1, keepdim=True)  # keep the graph shape-honest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("think")))


def scripted_engine(path, script):
    model = load_causal_lm(path)
    model.lm_head = ScriptedHead(model.config.hidden_size, model.config.vocab_size, script)
    return make_engine("torch", path, precision="fp32", model=model, seed=0)


def run(path, script, prompt_text, at_token, max_tokens=12):
    tok = load_tokenizer(path)
    ids = lambda s: [tok.convert_tokens_to_ids(c) for c in s]  # noqa: E731
    eng = scripted_engine(path, ids(script))
    lc = ForcedInterruption(thinking_min=at_token, thinking_max=at_token, answer_budget=2, phrase="</think>")
    req = GenerationRequest(group_id=0, prompt_ids=ids(prompt_text), n=2,
                            interruptions=lc.interruptions(2, random.Random(0), tok))
    (group,) = list(eng.generate([req], SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_token_ids=())))
    return [([tok.convert_ids_to_tokens(t) for t in c.token_ids], c.forced, c.finish_reason) for c in group.completions]


def test_torch_engine_interrupts_an_open_thinking_part(tiny):
    script = ["<think>"] + ["a"] * 20
    for toks, forced, reason in run(tiny, script, ["1", "+", "2", "="], at_token=4):
        assert toks[:4] == ["<think>", "a", "a", "a"] and toks[4] == "</think>" and forced[4]
        assert sum(forced) == 1 and len(toks) == 4 + 1 + 2 and reason == "length"  # answer budget 2


def test_torch_engine_interrupts_thinking_opened_by_the_prompt(tiny):
    for toks, forced, _ in run(tiny, ["a"] * 20, ["1", "=", "<think>"], at_token=3):
        assert toks[3] == "</think>" and forced == [False] * 3 + [True] + [False] * 2


def test_torch_engine_never_interrupts_after_the_thinking_part_closed(tiny):
    script = ["<think>", "a", "</think>", "4", "2"] + ["9"] * 20
    for toks, forced, reason in run(tiny, script, ["1", "="], at_token=4, max_tokens=12):
        assert not any(forced), toks
        assert toks[:5] == ["<think>", "a", "</think>", "4", "2"] and len(toks) == 12 and reason == "length"


def test_torch_engine_never_interrupts_an_answer_without_thinking(tiny):
    for toks, forced, _ in run(tiny, ["4"] * 20, ["1", "="], at_token=2, max_tokens=7):
        assert not any(forced) and len(toks) == 7


def test_vllm_engine_decision_at_the_interruption_point():
    """`VllmEngine._on_finished` (vLLM stubbed): inject only while thinking, else continue to max_tokens."""
    from components.engines.vllm_engine import VllmEngine, _Seq

    eng = object.__new__(VllmEngine)
    calls = []
    eng._inject = lambda seq: calls.append(("inject", list(seq.tokens)))
    eng._submit = lambda seq, prompt, budget: calls.append(("submit", prompt, budget))
    eng._finish = lambda seq, reason: calls.append(("finish", reason))
    params = SamplingParams(max_tokens=10)

    def seq(tokens, prompt=(1, 2)):
        group = PendingGroup(request=GenerationRequest(group_id=0, prompt_ids=list(prompt), n=1))
        s = _Seq(group=group, sample_index=0, params=params, interruption=it(at=len(tokens)))
        s.tokens, s.sampled = list(tokens), len(tokens)
        return s

    eng._on_finished(seq([OPEN, A, A]), "length")
    assert calls[-1] == ("inject", [OPEN, A, A])
    s = seq([OPEN, CLOSE, A])
    eng._on_finished(s, "length")
    assert calls[-1] == ("submit", [1, 2, OPEN, CLOSE, A], 7) and s.interruption is None
    eng._on_finished(s, "length")  # the continuation ends: a plain finish, no second decision
    assert calls[-1] == ("finish", "length")
    eng._on_finished(seq([A, B, A]), "length")
    assert calls[-1] == ("submit", [1, 2, A, B, A], 7)
    eng._on_finished(seq([A, B], prompt=(1, OPEN)), "length")
    assert calls[-1] == ("inject", [A, B])
