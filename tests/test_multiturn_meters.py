"""Issue 45: the learner's token meters count generated tokens only; an episode's observation tokens are
prompt tokens (tokens per step, completion lengths and their quantiles, forced tokens, eval tokens)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from components.engines.base import CompletedGroup, Completion, GenerationRequest
from components.environments import EpisodeOutcome
from components.trainer.evaluation import sample_and_grade
from components.trainer.step_plan import _rollout_stats
from components.trainer.rollout import Rollout, collate


def _episode(rng: random.Random, interruption: bool = False) -> Completion:
    """1-3 assistant turns with observations between them; optionally a forced (interruption) token in a turn."""
    tokens, observed, forced = [], [], []
    turns = rng.randint(1, 3)
    for t in range(turns):
        n = rng.randint(2, 6)
        tokens += [rng.randrange(3, 40) for _ in range(n)]
        observed += [False] * n
        forced += [interruption and i == 0 for i in range(n)]
        if t < turns - 1:
            m = rng.randint(1, 5)
            tokens += [rng.randrange(3, 40) for _ in range(m)]
            observed += [True] * m
            forced += [True] * m
    return Completion(group_id=0, sample_index=0, prompt_ids=[5, 6, 7], token_ids=tokens,
                      gen_logp=[0.0 if f else -0.5 for f in forced], versions=[0] * len(tokens), forced=forced,
                      finish_reason="stop", observed=observed)


def _rollouts(seed: int, interruption: bool = False) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for g in range(4):
        comps = [_episode(rng, interruption) for _ in range(3)]
        out.append(Rollout(order_id=g, problem_id=str(g), completions=comps, rewards=[rng.choice([0.0, 1.0]) for _ in comps],
                           passed=[False] * 3))
    return out


@pytest.mark.parametrize("interruption", [False, True])
def test_step_token_meters_leave_observations_out(interruption):
    rollouts = _rollouts(3, interruption)
    comps = [c for r in rollouts for c in r.completions]
    assert sum(sum(c.observed) for c in comps) > 0  # the batch has observations to leave out
    # the reference, written from the episodes themselves: generated = neither observed
    gen = np.array([sum(1 for o in c.observed if not o) for c in comps], dtype=np.float64)
    forced_not_obs = sum(1 for c in comps for f, o in zip(c.forced, c.observed) if f and not o)
    stats = _rollout_stats(collate(rollouts, 0), rollouts, [True] * len(rollouts))
    assert stats["tokens"] == int(gen.sum())
    assert stats["completion_len_mean"] == pytest.approx(gen.mean(), rel=1e-6)  # float32 as before issue 45
    for q in (10, 50, 90):
        assert stats[f"completion_tokens_p{q}"] == pytest.approx(np.quantile(gen, q / 100), rel=1e-12)
    assert stats["forced_tokens"] == forced_not_obs
    assert (forced_not_obs > 0) == interruption


def test_single_turn_token_meters_unchanged():
    rng = random.Random(0)
    comps = [Completion(0, i, [1, 2], [rng.randrange(3, 40) for _ in range(n)], [-0.1] * n, [0] * n, [False] * n, "stop")
             for i, n in enumerate((3, 7, 4))]
    rollouts = [Rollout(order_id=0, problem_id="0", completions=comps, rewards=[0.0, 1.0, 0.0], passed=[False] * 3)]
    stats = _rollout_stats(collate(rollouts, 0), rollouts, [True])
    assert stats["tokens"] == 14 and stats["completion_len_mean"] == pytest.approx(14 / 3, rel=1e-6)
    assert stats["forced_tokens"] == 0


class _Engine:
    """Returns fixed episodes for every request (no model)."""

    def __init__(self, comps):
        self.comps = comps

    def generate(self, requests, params):
        for req in requests:
            yield CompletedGroup(request=req, completions=list(self.comps))


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True, **kw):
        return [1, 2, 3]


def test_eval_tokens_leave_observations_out(monkeypatch):
    import components.trainer.evaluation as evaluation

    monkeypatch.setattr(evaluation, "render_prompt", lambda problem, tokenizer: [1, 2, 3])
    rng = random.Random(5)
    comps = [_episode(rng) for _ in range(4)]
    for c in comps:
        c.episode = EpisodeOutcome(1.0, True, {"verifier": 1.0}, turns=sum(1 for _ in c.observed))
    graded = sample_and_grade(_Engine(comps), None, [SimpleNamespace(id="p")], _Tok(), k=4, seed=0, temperature=1.0,
                              top_p=1.0, max_tokens=32, conversations=lambda problem, k: None)
    assert graded.tokens == sum(1 for c in comps for o in c.observed if not o)
    assert graded.tokens < sum(len(c.token_ids) for c in comps)
