"""Update epochs (issue 43, item 3): train.update_epochs x train.mini_batches optimizer updates per step,
pi_old fixed per batch, the LR schedule and FLOPs counting the extra passes, bad values refused early."""

from __future__ import annotations

import copy

import gin
import pytest
import torch

from _helpers_trainer import read_jsonl, tiny_model, write_gin
from components.trainer.config import ConfigError, TrainConfig, validate

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("update_epochs_model"))


def _rollouts(model, tokenizer, n_groups=4, G=4, T=5, seed=0):
    """Completions sampled from `model` by hand, gen_logp recorded as an engine records it."""
    from components.engines.base import Completion
    from components.engines.logprobs import token_logprobs
    from components.trainer.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for gi in range(n_groups):
        prompt = tokenizer.encode(f"{gi}+{gi % 3}=", add_special_tokens=False)
        comps, rewards = [], []
        for s in range(G):
            ids, toks, lps = list(prompt), [], []
            with torch.no_grad():
                for _ in range(T):
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1]  # [V]
                    tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
                    lps.append(float(token_logprobs(logits, torch.tensor(tok))))
                    toks.append(tok)
                    ids.append(tok)
            comps.append(Completion(gi, s, list(prompt), toks, lps, [0] * T, [False] * T, "length"))
            rewards.append(1.0 if (s + gi) % 2 == 0 else -1.0)
        rollouts.append(Rollout(order_id=gi, problem_id=f"p{gi}", completions=comps, rewards=rewards,
                                passed=[r > 0 for r in rewards]))
    return rollouts


def _learner(model_path, **overrides):
    from components.models import load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.learner import Learner

    load_builtin_components()
    settings = dict(lr=1e-2, warmup_steps=0, weight_decay=0.0, micro_batch_size=16, prompts_per_step=4,
                    generations_per_prompt=4, temperature=1.0, loss="grpo", aggregation="token_mean",
                    advantage_norm="batch", grad_clip=0.0)
    settings.update(overrides)
    cfg = TrainConfig(model_path=model_path, **settings)
    tok = load_tokenizer(model_path)
    return Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu")), tok


# ---------------------------------------------------------------------------------------
# bad values: refused before any compute, naming the value and the valid ones
@pytest.mark.parametrize("overrides, match", [
    (dict(update_epochs=0), r"train.update_epochs = 0 is out of range: must be an integer >= 1"),
    (dict(update_epochs=-2), r"train.update_epochs = -2 is out of range: must be an integer >= 1"),
    (dict(mini_batches=0), r"train.mini_batches = 0 is out of range: must be an integer >= 1"),
    (dict(mini_batches=-1), r"train.mini_batches = -1 is out of range: must be an integer >= 1"),
    (dict(mini_batches=3), r"train.mini_batches = 3 does not divide train.prompts_per_step = 8 .*valid: \[1, 2, 4, 8\]"),
    (dict(mini_batches=16), r"train.mini_batches = 16 does not divide .*valid: \[1, 2, 4, 8\]"),
])
def test_bad_update_settings_are_refused_with_the_valid_choices(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(TrainConfig(prompts_per_step=8, **overrides))


def test_bad_update_settings_are_refused_before_the_model_or_data_are_touched(tmp_path):
    from experiments.train import check_config

    gin_file = write_gin(tmp_path / "bad.gin", tmp_path / "no_such_model", train__mini_batches="3")
    with pytest.raises(ConfigError, match=r"train.mini_batches = 3 does not divide train.prompts_per_step = 4"):
        check_config([gin_file], read_data=False)
    assert not (tmp_path / "no_such_model").exists()


# ---------------------------------------------------------------------------------------
# the pieces
def test_split_groups_keeps_groups_whole_and_covers_every_row_once():
    from components.trainer.learner import split_groups

    group_ids = torch.tensor([7, 7, 7, 3, 3, 9, 9, 9, 9, 1])  # [10], 4 groups of 3, 2, 4, 1 rows
    parts = split_groups(group_ids, 2)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    parts = split_groups(group_ids, 3)  # array_split: 2 + 1 + 1 groups
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert len(split_groups(group_ids, 8)) == 4  # fewer groups than mini-batches: one group each


def test_lr_schedule_counts_optimizer_updates_over_learner_steps():
    from components.trainer.learner import make_optimizer

    def lrs(per_step, schedule, n):
        opt, sched = make_optimizer(torch.nn.Linear(2, 2), lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                    warmup_steps=2, schedule=schedule, total_steps=4, updates_per_step=per_step)
        out = []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    # 2 warmup steps of 3 updates each: the warmup spans 6 updates
    assert lrs(3, "constant", 8) == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0, 1.0, 1.0])
    # a linear decay reaches 0 at total_steps x updates_per_step = 12 updates, as at 4 with one update a step
    one, three = lrs(1, "linear", 5), lrs(3, "linear", 13)
    assert three[6::3] == pytest.approx(one[2:]) == [1.0, 0.5, 0.0]  # after the warmup: the same curve per step
    assert three[12] == 0.0 and three[9] == pytest.approx(0.5) and three[10] == pytest.approx(1 / 3)


def test_flop_terms_count_every_epoch_the_reference_and_the_pi_old_forward():
    from components.trainer.accounting import FlopCounter, step_flop_terms

    c = FlopCounter(n_params=1000, layers=2, attn_width=8)
    train, fwd = c.training(3, 5), c.generation(3, 5)
    assert step_flop_terms(c, 3, 5) == [train]  # one epoch: as before update epochs existed
    assert step_flop_terms(c, 3, 5, epochs=4) == [train] * 4
    assert step_flop_terms(c, 3, 5, epochs=2, reference=True, old_pass=True) == [train, fwd, train, fwd, fwd]
    assert train == pytest.approx(3 * fwd)
    lora = c.for_lora(100)
    assert step_flop_terms(lora, 3, 5, old_pass=True)[-1] == lora.policy_forward(3, 5) > lora.generation(3, 5)


# ---------------------------------------------------------------------------------------
# the learner step
def test_one_epoch_one_mini_batch_is_one_update(model_path):
    learner, tok = _learner(model_path)
    stats = learner.step(_rollouts(learner.model, tok), [True] * 4)
    assert learner.version == 1 and stats["optimizer_steps"] == 1
    assert stats["clip_frac"] == 0.0 and stats["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_pi_old_is_fixed_across_epochs_while_pi_theta_moves(model_path, correction):
    """The loss's pi_old argument, per row, is the same at every one of the mu x M updates (the generator's
    gen_logp without a correction, the learner's pre-update log-probs with one), while logp moves."""
    from components.engines.logprobs import sequence_logprobs
    from components.losses import grpo
    from components.trainer.rollout import collate

    calls = []

    def spy(logp, old_logp, advantages, mask, *, eps=0.2):
        calls.append((logp.detach().double().clone(), old_logp.detach().double().clone(), mask.clone()))
        return grpo(logp, old_logp, advantages, mask, eps=eps)

    learner, tok = _learner(model_path, loss="grpo", update_epochs=3, mini_batches=2, micro_batch_size=8,
                            mismatch_correction=correction)
    learner.loss_fn = spy  # grpo, recording what each update hands it
    rollouts = _rollouts(learner.model, tok, seed=2)
    batch = collate(rollouts, tok.pad_token_id)
    with torch.no_grad():
        before = sequence_logprobs(learner.model, batch.input_ids, batch.attention_mask, batch.completion_start)  # [B, T]
    stats = learner.step(rollouts, [True] * 4)
    assert len(calls) == 3 * 2 and learner.version == 6 and stats["optimizer_steps"] == 6
    # mini-batch 0 holds rows 0..7 (groups 0, 1), mini-batch 1 rows 8..15; updates alternate between them
    for k, (logp, old, mask) in enumerate(calls):
        rows = slice(0, 8) if k % 2 == 0 else slice(8, 16)
        T = logp.shape[1]
        expected = batch.gen_logp[rows, :T] if correction == "none" else before[rows, :T]
        torch.testing.assert_close(old[mask], expected.double()[mask], rtol=0, atol=1e-6 if correction == "tis" else 0)
        first = calls[k % 2]
        assert torch.equal(old, first[1])  # the same pi_old, bit for bit, at every epoch
        if k >= 2:
            assert (logp - first[0])[mask].abs().max() > 1e-3  # pi_theta moved
    assert stats["clip_frac_low"] + stats["clip_frac_high"] > 0  # the ratio left [1 - eps, 1 + eps] somewhere


def _ref_logp(model, batch, temperature=1.0):
    """float64 log-prob of each completion token under `model` (a float64 copy).  [B, T]"""
    from components.engines.logprobs import position_ids_from_mask

    P = batch.completion_start
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask), use_cache=False)
    logits = out.logits[:, P - 1 : -1].double() / temperature  # [B, T, V]
    return torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, P:, None]).squeeze(-1)  # [B, T]


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_update_epochs_match_a_float64_reference(model_path, correction):
    """mu = 2 epochs x M = 2 mini-batches of the learner (float32) against a float64 PPO-epochs loop written from
    the definitions: advantages on the whole batch, each mini-batch aggregated on its own, pi_old fixed before
    the first update (gen_logp; with tis the pre-update learner log-probs and the weight min(pi_old/pi_gen, 2))."""
    from components.losses import grpo
    from components.mismatch import tis
    from components.registry import ADVANTAGE_NORMS, AGGREGATIONS
    from components.trainer.rollout import collate

    settings = dict(update_epochs=2, mini_batches=2, micro_batch_size=5, adam_eps=1e-3, lr=3e-3,
                    mismatch_correction=correction, aggregation="prompt_mean")
    learner, tok = _learner(model_path, **settings)
    ref = copy.deepcopy(learner.model).double()
    rollouts = _rollouts(learner.model, tok, seed=3)
    batch = collate(rollouts, tok.pad_token_id)
    stats = learner.step(rollouts, [True] * 4)

    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3, betas=(0.9, 0.999), eps=1e-3,
                            weight_decay=0.0)
    adv = ADVANTAGE_NORMS.get("batch")(batch.rewards.double(), batch.group_ids)  # [B] whole batch
    minis = [torch.arange(0, 8), torch.arange(8, 16)]
    with torch.no_grad():
        old_all = _ref_logp(ref, batch) if correction == "tis" else batch.gen_logp.double()  # [B, T]
    grad_norms = []
    for _epoch in range(2):
        for rows in minis:
            sub = batch.select(rows)
            logp = _ref_logp(ref, sub)  # [b, T]
            old, mask = old_all[rows], sub.mask
            per_token = grpo(logp, old, adv[rows], mask)  # [b, T]
            if correction == "tis":
                per_token = per_token * tis(old, sub.gen_logp.double(), mask)
            loss = AGGREGATIONS.get("prompt_mean")(per_token, mask, sub.group_ids)
            opt.zero_grad()
            loss.backward()
            grad_norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()
                                                                           if p.grad is not None]))))
            opt.step()
    for (name, got), (_, want) in zip(learner.model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5, msg=name)
    assert stats["grad_norm"] == pytest.approx(sum(grad_norms) / 4, rel=1e-3)
    assert learner.version == 4 and stats["optimizer_steps"] == 4


def test_emulated_ranks_fix_pi_old_like_one_rank(model_path):
    """One process in the arithmetic of two ranks (the test double tests/_emulated_ranks.py) computes pi_old
    per shard: the same step as one rank."""
    from _emulated_ranks import step_as_ranks

    one, tok = _learner(model_path, update_epochs=2, mini_batches=2, micro_batch_size=4, mismatch_correction="tis")
    two, _ = _learner(model_path, update_epochs=2, mini_batches=2, micro_batch_size=4, mismatch_correction="tis")
    rollouts = _rollouts(one.model, tok, seed=4)
    s1, s2 = one.step(rollouts, [True] * 4), step_as_ranks(two, rollouts, 2)
    for (name, a), (_, b) in zip(one.model.named_parameters(), two.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    assert s1["optimizer_steps"] == s2["optimizer_steps"] == 4
    assert s1["mismatch_kl"] == pytest.approx(s2["mismatch_kl"], rel=1e-3, abs=1e-9)


def test_filtered_groups_leave_fewer_mini_batches_and_no_update_when_all_are_dropped(model_path):
    learner, tok = _learner(model_path, update_epochs=2, mini_batches=4, micro_batch_size=4)
    rollouts = _rollouts(learner.model, tok, seed=5)
    stats = learner.step(rollouts, [True, False, True, False])  # 2 groups kept: 2 mini-batches x 2 epochs
    assert stats["optimizer_steps"] == 4 and learner.version == 4
    empty = learner.step(rollouts, [False] * 4)
    assert empty["optimizer_steps"] == 0 and empty["skipped_update"] == 1 and learner.version == 4


def test_lag_and_lr_are_the_steps_own(model_path):
    learner, tok = _learner(model_path, update_epochs=2, mini_batches=2, warmup_steps=2, micro_batch_size=8)
    stats = learner.step(_rollouts(learner.model, tok, seed=6), [True] * 4)
    assert stats["lag_max"] == 0  # the batch was sampled by the weights its first update starts from
    assert stats["lr"] == pytest.approx(1e-2 * (1 + 2 + 3 + 4) / 8 / 4)  # the mean of 4 updates warming up over 2 x 4


# ---------------------------------------------------------------------------------------
# end to end: a tiny run
@pytest.mark.slow
def test_update_epochs_end_to_end_clip_fractions_move(tmp_path, model_path):
    from experiments.train import run_training

    runs = {}
    for mu in (1, 4):
        gin_file = write_gin(tmp_path / f"mu{mu}.gin", model_path, train__loss='"grpo"', train__lr="1e-2",
                             train__update_epochs=str(mu), train__total_steps="3",
                             train__eval_every="3", train__checkpoint_every="3")
        assert run_training([gin_file], [], str(tmp_path / f"mu{mu}"), progress=False) == "done"
        runs[mu] = read_jsonl(tmp_path / f"mu{mu}" / "metrics.jsonl")
    for mu, metrics in runs.items():
        assert [m["optimizer_steps"] for m in metrics] == [mu] * 3
        assert [m["version"] for m in metrics] == [mu * s for s in (1, 2, 3)]
    clipped = {mu: sum(m["clip_frac_low"] + m["clip_frac_high"] for m in metrics) for mu, metrics in runs.items()}
    assert clipped[4] > 0.0 and clipped[4] > 10 * clipped[1]
    assert all(m["lag_max"] == 0 for m in runs[4])  # synchronous: each batch from the weights it starts at
