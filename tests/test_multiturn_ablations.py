"""Issue 45 item 5, the multi-turn ablation axes: turn ids per token in the batch, the turn-level aggregation
`turn_mean` (a float64 reference written from its definition, its gradient, micro-batch exactness),
train.mask_observations (False: the known bug, observations trained on) and the three sweep specs."""
from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from components.aggregation import token_weights, weighted_sum
from components.engines.base import Completion
from components.registry import AGGREGATIONS
from components.trainer.rollout import Rollout, collate, turn_index

torch.set_num_threads(1)
G = 3


def _episode(rng: random.Random) -> Completion:
    tokens, observed = [], []
    turns = rng.randint(1, 4)
    for t in range(turns):
        n = rng.randint(1, 6)
        tokens += [rng.randrange(3, 40) for _ in range(n)]
        observed += [False] * n
        if t < turns - 1:
            m = rng.randint(1, 4)
            tokens += [rng.randrange(3, 40) for _ in range(m)]
            observed += [True] * m
    return Completion(group_id=0, sample_index=0, prompt_ids=[5, 6], token_ids=tokens,
                      gen_logp=[0.0 if o else -0.7 for o in observed], versions=[0] * len(tokens),
                      forced=list(observed), finish_reason="stop", observed=list(observed))


def _rollouts(seed: int, prompts: int = 4) -> list[Rollout]:
    rng = random.Random(seed)
    return [Rollout(order_id=10 + g, problem_id=str(g), completions=[_episode(rng) for _ in range(G)],
                    rewards=[rng.choice([0.0, 1.0]) for _ in range(G)], passed=[False] * G) for g in range(prompts)]


def test_turn_index_counts_assistant_turns():
    assert turn_index(None, 3) == [0, 0, 0]
    obs = [False, False, True, True, False, True, False, False]
    assert turn_index(obs, len(obs)) == [0, 0, 0, 0, 1, 1, 2, 2]  # an observation takes the turn it follows


def test_collate_turn_ids_and_the_observation_mask():
    rollouts = _rollouts(0)
    comps = [c for r in rollouts for c in r.completions]
    batch = collate(rollouts, 0)
    bug = collate(rollouts, 0, mask_observations=False)
    for b, c in enumerate(comps):
        n = len(c.token_ids)
        turn = 0
        for t in range(n):
            if t and not c.observed[t] and c.observed[t - 1]:
                turn += 1
            assert int(batch.turn_ids[b, t]) == turn
            assert bool(batch.mask[b, t]) == (not c.observed[t])
            assert bool(bug.mask[b, t])  # the known bug: every completion token, observations included
        assert bool((batch.turn_ids[b, n:] == -1).all()) and not bool(bug.mask[b, n:].any())
    # turn ids survive select / trim, row for row
    rows = torch.tensor([2, 5, 7])
    sub = batch.select(rows).trim()
    assert torch.equal(sub.turn_ids, batch.turn_ids[rows][:, : sub.mask.shape[1]])


def _reference_turn_mean(loss, mask, groups, turns) -> float:
    """turn_mean in float64 from its definition, with python loops: prompts -> turns -> tokens."""
    per_group = defaultdict(list)  # group -> the mean of each of its turns
    for b in range(len(loss)):
        per_turn = defaultdict(list)
        for t in range(len(loss[b])):
            if mask[b][t]:
                per_turn[turns[b][t]].append(loss[b][t])
        for values in per_turn.values():
            per_group[groups[b]].append(sum(values) / len(values))
    groups_all = sorted(set(groups))
    return sum(sum(per_group[g]) / len(per_group[g]) if per_group[g] else 0.0 for g in groups_all) / len(groups_all)


def _case(seed: int):
    batch = collate(_rollouts(seed), 0)
    torch.manual_seed(seed)
    loss = torch.randn(batch.mask.shape, dtype=torch.float64)  # [B, T]
    loss = torch.where(batch.mask, loss, 0.0)
    return batch, loss


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turn_mean_matches_a_float64_reference(seed):
    batch, loss = _case(seed)
    got = AGGREGATIONS.get("turn_mean")(loss, batch.mask, batch.group_ids, turn_ids=batch.turn_ids)
    ref = _reference_turn_mean(loss.tolist(), batch.mask.tolist(), batch.group_ids.tolist(), batch.turn_ids.tolist())
    assert got.dtype == torch.float64 and float(got) == pytest.approx(ref, rel=1e-12, abs=1e-14)
    # it is not prompt_mean (token-level): turns of different lengths weigh alike
    tok = AGGREGATIONS.get("prompt_mean")(loss, batch.mask, batch.group_ids)
    assert abs(float(tok) - ref) > 1e-6


def test_turn_mean_gradient_and_micro_batches():
    batch, loss = _case(4)
    mask, groups, turns = batch.mask, batch.group_ids, batch.turn_ids
    # the gradient with respect to each token's loss, from the reference: 1 / (P x turns of its prompt x tokens of its turn)
    P = len(set(groups.tolist()))
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    for g in set(groups.tolist()):
        rows = [b for b in range(mask.shape[0]) if int(groups[b]) == g]
        cells = defaultdict(list)
        for b in rows:
            for t in range(mask.shape[1]):
                if mask[b, t]:
                    cells[(b, int(turns[b, t]))].append(t)
        for (b, _), ts in cells.items():
            for t in ts:
                expected[b, t] = 1.0 / (P * len(cells) * len(ts))
    x = loss.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(AGGREGATIONS.get("turn_mean")(x, mask, groups, turn_ids=turns), x)
    assert torch.allclose(grad, expected, rtol=1e-12, atol=0)
    weights = token_weights("turn_mean", mask, groups, dtype=torch.float64, turn_ids=turns)
    assert torch.allclose(weights, expected, rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(lambda y: AGGREGATIONS.get("turn_mean")(y, mask, groups, turn_ids=turns),
                                    (loss.clone().requires_grad_(True),))
    # micro-batches with the whole-batch weights sum to the aggregate
    whole = float(AGGREGATIONS.get("turn_mean")(loss, mask, groups, turn_ids=turns))
    parts = sum(float(weighted_sum(loss[i : i + 5], weights[i : i + 5])) for i in range(0, loss.shape[0], 5))
    assert parts == pytest.approx(whole, rel=1e-12)


def test_turn_mean_without_turn_ids_is_one_turn_per_sequence():
    batch, loss = _case(5)
    single = torch.zeros_like(batch.turn_ids)
    got = AGGREGATIONS.get("turn_mean")(loss, batch.mask, batch.group_ids)
    ref = _reference_turn_mean(loss.tolist(), batch.mask.tolist(), batch.group_ids.tolist(), single.tolist())
    assert float(got) == pytest.approx(ref, rel=1e-12)
    # token_weights gives an aggregation without a turn_ids keyword the same call as before
    assert torch.equal(token_weights("prompt_mean", batch.mask, batch.group_ids, turn_ids=batch.turn_ids),
                       token_weights("prompt_mean", batch.mask, batch.group_ids))


def test_learner_plan_uses_turn_ids_and_the_observation_mask():
    from types import SimpleNamespace

    from components.trainer.learner import plan_step

    rollouts = _rollouts(6)
    cfg = SimpleNamespace(advantage_norm="prompt", aggregation="turn_mean", mini_batches=1, micro_batch_size=64,
                          max_tokens_per_micro_batch=None, sequence_parallel=1, mask_observations=True,
                          components=(), params_of=lambda family, name: None)  # no resolved table: defaults
    plan = plan_step(rollouts, [True] * len(rollouts), cfg, pad_id=0, ranks=1)
    batch = plan.batch
    expected = token_weights("turn_mean", batch.mask, batch.group_ids, turn_ids=batch.turn_ids)  # [B, T]
    (mb,) = plan.shards[0]  # 12 rows, one micro-batch
    order = plan.rows[0]
    assert torch.equal(mb.weights, expected[order][:, : mb.weights.shape[1]])
    assert float(expected.sum()) == pytest.approx(1.0, rel=1e-6)  # a mean of means: the weights sum to 1
    assert not bool((expected > 0)[~batch.mask].any())
    cfg.mask_observations = False
    bug = plan_step(rollouts, [True] * len(rollouts), cfg, pad_id=0, ranks=1).batch
    assert int(bug.mask.sum()) == sum(len(c.token_ids) for r in rollouts for c in r.completions)


@pytest.mark.parametrize("value, match", [
    ('"yes"', r"train.mask_observations must be True or False, got 'yes'"),
    ("1", r"train.mask_observations must be True or False, got 1"),
])
def test_bad_mask_observations_is_refused(value, match):
    import gin

    from components.trainer.config import ConfigError, train_config, validate

    gin.clear_config()
    try:
        gin.parse_config(f'train.environment = "calculator"\ntrain.mask_observations = {value}')
        with pytest.raises(ConfigError, match=match):
            validate(train_config())
    finally:
        gin.clear_config()


def test_mask_observations_off_needs_an_environment():
    from components.trainer.config import ConfigError, TrainConfig, validate

    with pytest.raises(ConfigError, match=r"train.mask_observations = False needs train.environment"):
        validate(TrainConfig(mask_observations=False))


# the sweeps, run for real at tiny scale through `scalerl sweep` (debug executor: in this process), shortened
_SHORT = ["train.total_steps = 2", "warm_start.sft_steps = 30", 'warm_start.task_kwargs = {"num_train": 200, "num_eval": 8, "digits": 2}',
          'train.task_kwargs = {"num_train": 200, "num_eval": 8, "digits": 2}', "train.prompts_per_step = 4", "train.generations_per_prompt = 2",
          "train.eval_every = 100", "train.eval_prompts = 4", "train.eval_k = 2", "train.checkpoint_every = 100",
          "train.curriculum = ['uniform']", "train.micro_batch_size = 8"]


@pytest.mark.slow
@pytest.mark.parametrize("sweep, runs, ran", [  # ran: the runs that differ from tiny_tool.gin (its own runs elsewhere)
    ("max_turns", ["max_turns1-s0", "max_turns2-s0", "max_turns3-s0"], ["max_turns1-s0", "max_turns2-s0"]),
    ("mask_observations", ["masked-s0", "unmasked_bug-s0"], ["unmasked_bug-s0"]),
    ("turn_aggregation", ["prompt_mean-s0", "turn_mean-s0"], ["turn_mean-s0"]),
    ("tool_use", ["calculator-s0", "no_tool-s0"], ["no_tool-s0"]),
])
def test_multi_turn_sweeps_expand_and_run_at_tiny_scale(tmp_path, sweep, runs, ran):
    import json

    from experiments.cli import main as scalerl
    from experiments.run_config import validate_runs
    from experiments.sweep_spec import expand, load_spec

    spec = load_spec(sweep)
    assert not spec.paper_ablation
    assert [r.name for r in expand(spec, "tiny") if r.name.endswith("-s0")] == runs
    validate_runs(expand(spec, "paper"))
    args = ["sweep", sweep, "--scale", "tiny", "--executor", "debug", "--runs", str(tmp_path), "--seeds", "0",
            "--only", *ran]
    assert scalerl(args + [a for b in _SHORT for a in ("--gin", b)]) == 0
    for name in ran:
        run = tmp_path / sweep / name
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2], name
        config = (run / "config.gin").read_text()
        for r in rows:
            assert r["generated_tokens"] > 0
            if sweep == "tool_use":  # no environment: single-turn, no turn meters
                assert "turns_mean" not in r and "train.environment = None" in config
                continue
            assert r["turns_mean"] >= 1.0
            if sweep == "max_turns":
                assert r["turns_mean"] <= int(name[len("max_turns"):].split("-")[0])
        if sweep == "mask_observations":
            assert ("mask_observations = False" in config) == (name == "unmasked_bug-s0")
        if sweep == "turn_aggregation":
            assert f"'{name[:-3]}'" in config or f'"{name[:-3]}"' in config
