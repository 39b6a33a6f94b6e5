"""Issue 45: the torch engine feeds an environment's observation in ONE forward (a prefill of the appended
tokens), not one token per decoding step; the token / observation layout and the log-probs stay those of
the model on the whole episode (a float64 reference, one unpadded sequence at a time)."""
from __future__ import annotations

import random

import pytest
import torch

from components.engines import GenerationRequest, SamplingParams, make_engine
from components.engines.base import Conversation
from components.models import build_tiny_policy, load_causal_lm

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_prefill")))


class _Echo(Conversation):
    """After each turn, the observation `obs` (fixed ids), `turns` times; records the turns it was handed."""

    def __init__(self, obs, turns, per_turn=None):
        self.obs, self.left, self.max_tokens_per_turn = list(obs), turns, per_turn
        self.max_observation_tokens = len(obs) * turns
        self.calls = []

    def on_turn_end(self, turn_ids, finish_reason, budget_left):
        self.calls.append(list(turn_ids))
        if self.left > 0 and budget_left > 0:
            self.left -= 1
            return list(self.obs)
        self.outcome = {"turns": len(self.calls)}
        return None


def _widths(engine):
    """Wrap the engine model's forward: the list it returns gets each call's input width."""
    widths = []
    inner = engine.model.forward

    def forward(*args, **kwargs):
        widths.append(int(kwargs["input_ids"].shape[1]))
        return inner(*args, **kwargs)

    engine.model.forward = forward
    return widths


def _reference_logp(model64, prompt, tokens, temperature):
    """float64 log-probs of each token of `tokens` after `prompt` (the whole episode, no padding).  [len(tokens)]"""
    ids = torch.tensor([list(prompt) + list(tokens)], dtype=torch.long)
    with torch.no_grad():
        logits = model64(input_ids=ids).logits[0].double()  # [P+T, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    P = len(prompt)
    return logp[P - 1 : P - 1 + len(tokens)].gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)  # [T]


def test_one_episode_feeds_each_observation_in_one_forward(tiny):
    eng = make_engine("torch", tiny, precision="fp32", seed=3)
    widths = _widths(eng)
    obs = [20, 21, 22, 23, 24]
    conv = _Echo(obs, turns=2, per_turn=4)
    req = GenerationRequest(group_id=0, prompt_ids=[9, 10, 11, 12], n=1, conversations=[conv])
    c = next(iter(eng.generate([req], SamplingParams(temperature=1.0, max_tokens=30)))).completions[0]
    sampled = sum(not o for o in c.observed)
    fed = sum(c.observed)
    assert fed == 2 * len(obs) and len(conv.calls) == 3
    # the prompt's prefill samples the first token, each later forward exactly one: no step feeds only
    # observation tokens (one token per step would take `fed` more forwards)
    assert len(widths) == sampled
    assert widths[0] == 4 and sorted(widths[1:]).count(len(obs) + 1) == 2
    assert all(w == 1 for w in widths[1:] if w != len(obs) + 1)


def test_prefill_keeps_the_layout_and_logprobs_of_the_episode(tiny):
    eng = make_engine("torch", tiny, precision="fp32", seed=7, max_batch_size=8)
    rng = random.Random(1)
    prompts = [[rng.randrange(8, 60) for _ in range(rng.randint(3, 9))] for _ in range(3)]
    # observations of different lengths, in the same batch as single-turn rows: their steps fall apart,
    # so rows are left-padded within a step's chunk
    convs = [_Echo([20, 21, 22], 2, 3), _Echo([30, 31, 32, 33, 34, 35, 36], 1, 5), _Echo([40], 3, 2)]
    reqs = [GenerationRequest(group_id=0, prompt_ids=prompts[0], n=3, conversations=convs),
            GenerationRequest(group_id=1, prompt_ids=prompts[1], n=2),
            GenerationRequest(group_id=2, prompt_ids=prompts[2], n=1, conversations=[_Echo([50, 51], 1, 4)])]
    temperature = 0.9
    groups = {g.request.group_id: g for g in eng.generate(reqs, SamplingParams(temperature=temperature, max_tokens=20))}
    model64 = load_causal_lm(tiny).double().eval()
    episodes = list(zip(groups[0].completions, convs)) + [(groups[2].completions[0], None)]
    for c, conv in episodes:
        # layout: turns as handed to the environment, each followed by its whole observation
        turns, observations, cur, cur_obs = [], [], [], []
        for tok, o in zip(c.token_ids, c.observed):
            if o:
                cur_obs.append(tok)
            else:
                if cur_obs:
                    observations.append(cur_obs)
                    turns.append(cur)
                    cur, cur_obs = [], []
                cur.append(tok)
        turns.append(cur)
        if conv is not None:
            assert turns == conv.calls[: len(turns)] and observations == [conv.obs] * len(observations)
        assert c.forced == c.observed
        assert all(v == c.versions[0] for v in c.versions)
    comps = [c for g in groups.values() for c in g.completions]
    for c in comps:
        ref = _reference_logp(model64, c.prompt_ids, c.token_ids, temperature)  # [T] float64
        gen = torch.tensor(c.gen_logp, dtype=torch.float64)
        sampled = ~torch.tensor(c.forced, dtype=torch.bool)
        assert float((ref - gen).abs()[sampled].max()) < 1e-4
        assert torch.all(gen[~sampled] == 0.0)
    assert any(sum(c.observed) for c in comps)


def test_observation_tokens_count_as_seen_for_the_repetition_penalty(tiny):
    """With a repetition penalty the observation tokens are in the penalised context (as a prompt token is)."""
    eng = make_engine("torch", tiny, precision="fp32", seed=0)
    conv = _Echo([20, 21, 22], turns=1, per_turn=2)
    req = GenerationRequest(group_id=0, prompt_ids=[9, 10, 11], n=1, conversations=[conv])
    params = SamplingParams(temperature=1.0, max_tokens=6, repetition_penalty=1.5)
    seen_rows = []
    inner = eng._mark_seen

    def mark(seen, rows, lengths):
        inner(seen, rows, lengths)
        seen_rows.append(seen[0].nonzero().flatten().tolist())

    eng._mark_seen = mark
    c = next(iter(eng.generate([req], params))).completions[0]
    assert sum(c.observed) == 3
    assert {20, 21, 22} <= set(seen_rows[-1]) and set(c.token_ids) <= set(seen_rows[-1])
