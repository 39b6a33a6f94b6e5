"""Reference KL, LR schedules and the entropy bonus (issue 33 item 6) against float64 references.

- KL estimators (components/kl.py, Schulman's k1/k2/k3) vs formulas written with `math`, value and
  gradient; k3 >= 0; k1 and k3 average to the true KL of two known categorical distributions.
- LR schedules (components/schedules.py) vs hand-computed values at warmup end, mid-decay and the end.
- The learner: `train.kl_coef > 0` builds a frozen reference policy and adds kl_coef * kl per token
  (its gradient equals a float64 computation on a tiny model, `kl` is in the step stats);
  `train.entropy_coef > 0` changes the gradient by exactly -coef * d(entropy); the defaults build
  nothing and give the policy loss's gradient bit for bit.
"""

from __future__ import annotations

import copy
import math
import pickle
import sys
from pathlib import Path

import gin
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers_trainer import tiny_model  # noqa: E402

from components.registry import KL_ESTIMATORS, LR_SCHEDULES, UnknownComponentError  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


# ----------------------------------------------------------------------------------------
# KL estimators: float64 references written from the formulas, token by token
def _ref_kl(name: str, lp: float, ref: float) -> tuple[float, float]:
    """(estimate, d estimate / d logp) with log r = ref - lp, r = pi_ref / pi (Schulman 2020)."""
    log_r = ref - lp
    if name == "k1":
        return -log_r, 1.0
    if name == "k2":
        return 0.5 * log_r * log_r, -log_r
    if name == "k3":
        return (math.exp(log_r) - 1.0) - log_r, 1.0 - math.exp(log_r)
    raise KeyError(name)


def _random_pair(seed: int = 0, B: int = 5, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = -0.05 - 4.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    ref_logp = logp + 1.5 * torch.randn(B, T, generator=g, dtype=torch.float64)  # log-ratios of either sign, some large
    return logp.requires_grad_(True), ref_logp


def test_the_estimators_are_registered_with_the_one_signature():
    assert set(KL_ESTIMATORS.names()) >= {"k1", "k2", "k3"}
    for name in ("k1", "k2", "k3"):
        assert KL_ESTIMATORS.params(name) == []  # no hyper-parameters: (logp, ref_logp) -> kl
    with pytest.raises(UnknownComponentError, match="Did you mean 'k3'"):
        KL_ESTIMATORS.get("k4")


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_estimator_value_and_gradient_against_float64_formula(name):
    logp, ref_logp = _random_pair()
    ref_logp.requires_grad_(True)  # the reference side must get no gradient even if it carries one
    kl = KL_ESTIMATORS.get(name)(logp, ref_logp)  # [B, T]
    assert kl.shape == logp.shape and kl.dtype == torch.float64
    w = torch.rand(logp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # any aggregation weights
    grad_logp, grad_ref = torch.autograd.grad((w * kl).sum(), [logp, ref_logp], allow_unused=True)
    values, grads = [], []
    for row_lp, row_ref, row_w in zip(logp.tolist(), ref_logp.tolist(), w.tolist()):
        pairs = [_ref_kl(name, a, b) for a, b in zip(row_lp, row_ref)]
        values.append([v for v, _ in pairs])
        grads.append([wt * d for wt, (_, d) in zip(row_w, pairs)])
    torch.testing.assert_close(kl.detach(), torch.tensor(values, dtype=torch.float64), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grad_logp, torch.tensor(grads, dtype=torch.float64), rtol=1e-12, atol=1e-13)
    assert grad_ref is None or (grad_ref == 0).all()


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_estimator_gradcheck(name):
    logp, ref_logp = _random_pair(seed=3, B=2, T=3)
    assert torch.autograd.gradcheck(lambda lp: KL_ESTIMATORS.get(name)(lp, ref_logp), (logp,))


def test_k2_and_k3_are_never_negative_and_all_vanish_at_equal_policies():
    logp, ref_logp = _random_pair(seed=4, B=50, T=50)
    for name in ("k2", "k3"):
        assert (KL_ESTIMATORS.get(name)(logp, ref_logp) >= 0).all(), name
    assert (KL_ESTIMATORS.get("k1")(logp, ref_logp) < 0).any()  # k1 alone can go negative
    for name in ("k1", "k2", "k3"):
        assert (KL_ESTIMATORS.get(name)(logp, logp.detach()) == 0).all(), name


def test_k1_and_k3_average_to_the_true_kl_of_two_categoricals():
    """Tokens sampled from pi: E[k1] = E[k3] = KL(pi || pi_ref) (known in closed form); k3 has the
    lower variance (Schulman 2020) and k2 is close for close policies."""
    pi = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
    ref = torch.tensor([0.30, 0.30, 0.10, 0.12, 0.08, 0.10], dtype=torch.float64)
    true_kl = sum(p * math.log(p / q) for p, q in zip(pi.tolist(), ref.tolist()))
    n = 400_000
    tokens = torch.multinomial(pi, n, replacement=True, generator=torch.Generator().manual_seed(0))  # [n]
    logp, ref_logp = pi.log()[tokens][None], ref.log()[tokens][None]  # [1, n]
    est = {name: KL_ESTIMATORS.get(name)(logp, ref_logp)[0] for name in ("k1", "k2", "k3")}  # [n] each
    for name in ("k1", "k3"):
        mean, se = float(est[name].mean()), float(est[name].std()) / math.sqrt(n)
        assert abs(mean - true_kl) < 4 * se, (name, mean, true_kl, se)
    assert float(est["k3"].std()) < float(est["k1"].std())
    assert float(est["k2"].mean()) == pytest.approx(true_kl, rel=0.15)


# ----------------------------------------------------------------------------------------
# LR schedules: hand-computed float64 values (warmup 10, total 110: the decay spans 100 updates)
WARM, TOTAL = 10, 110
SCHEDULE_VALUES = {
    # update: factor
    "constant": {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 60: 1.0, 109: 1.0, 500: 1.0},
    "linear": {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 35: 0.75, 60: 0.5, 109: 0.01, 110: 0.0, 500: 0.0},
    # 0.5 * (1 + cos(pi * (u - 10) / 100)): u=35 -> (1 + sqrt(2)/2) / 2, u=85 -> (1 - sqrt(2)/2) / 2
    "cosine": {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 35: 0.8535533905932737, 60: 0.5, 85: 0.14644660940672624,
               110: 0.0, 500: 0.0},
}


@pytest.mark.parametrize("name", sorted(SCHEDULE_VALUES))
def test_schedules_against_hand_computed_values(name):
    fn = LR_SCHEDULES.get(name)
    for update, want in SCHEDULE_VALUES[name].items():
        assert fn(update, WARM, TOTAL) == pytest.approx(want, rel=1e-12, abs=1e-15), (name, update)


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_decays_without_warmup_and_past_the_end(name):
    fn = LR_SCHEDULES.get(name)
    assert fn(0, 0, 100) == 1.0 and fn(50, 0, 100) == pytest.approx(0.5) and fn(100, 0, 100) == pytest.approx(0.0, abs=1e-15)
    # a warmup as long as the run leaves no decay (its span counts as 1 update): 0 one update later
    assert fn(5, 10, 10) == pytest.approx(0.6) and fn(10, 10, 10) == 1.0 and fn(11, 10, 10) == 0.0
    factors = [fn(u, WARM, TOTAL) for u in range(WARM, TOTAL + 1)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))  # monotone decay


def _old_constant_factor(update: int, warmup_steps: int) -> float:
    """make_optimizer's factor before train.lr_schedule existed (linear warmup, then constant)."""
    warm = max(int(warmup_steps), 0)
    return 1.0 if warm == 0 else min(1.0, (update + 1) / warm)


def test_constant_is_the_old_schedule_exactly():
    fn = LR_SCHEDULES.get("constant")
    for warm in (0, 1, 3, 7, 100):
        for update in range(0, 250):
            assert fn(update, warm, 100) == _old_constant_factor(update, warm)  # bit for bit


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_make_optimizer_applies_the_schedule(name):
    from components.trainer.learner import make_optimizer

    lr = 0.3
    opt, sched = make_optimizer(torch.nn.Linear(2, 2), lr=lr, betas=(0.9, 0.999), eps=1e-15, weight_decay=0.0,
                                warmup_steps=WARM, schedule=name, total_steps=TOTAL)
    seen = []
    for _ in range(TOTAL + 3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    fn = LR_SCHEDULES.get(name)
    for update, got in enumerate(seen):
        assert got == pytest.approx(lr * fn(update, WARM, TOTAL), rel=1e-12, abs=1e-15), update
    with pytest.raises(UnknownComponentError, match="Did you mean 'cosine'"):
        make_optimizer(torch.nn.Linear(2, 2), lr=lr, betas=(0.9, 0.999), eps=1e-15, weight_decay=0.0, warmup_steps=0,
                       schedule="cosin", total_steps=10)


def test_the_default_optimizer_lr_sequence_is_unchanged():
    from components.trainer.learner import make_optimizer

    opt, sched = make_optimizer(torch.nn.Linear(2, 2), lr=5e-7, betas=(0.9, 0.999), eps=1e-15, weight_decay=0.0,
                                warmup_steps=7)
    for update in range(20):
        assert opt.param_groups[0]["lr"] == 5e-7 * _old_constant_factor(update, 7)
        opt.step()
        sched.step()


# ----------------------------------------------------------------------------------------
# config: the knobs, their ranges and their registries
def test_config_fields_ranges_and_names():
    from components.trainer.config import ConfigError, TrainConfig, component_names, validate

    cfg = TrainConfig(model_path="/x")
    assert (cfg.kl_coef, cfg.kl_estimator, cfg.entropy_coef, cfg.lr_schedule) == (0.0, "k3", 0.0, "constant")
    pairs = component_names(cfg.replace(kl_estimator="k1", lr_schedule="cosine"))
    assert (KL_ESTIMATORS, "k1") in pairs and (LR_SCHEDULES, "cosine") in pairs
    for bad in ({"kl_coef": -0.1}, {"entropy_coef": -1e-3}, {"kl_coef": float("nan")}):
        with pytest.raises(ConfigError, match=f"train.{next(iter(bad))}"):
            validate(cfg.replace(**bad))


def test_train_config_binds_the_knobs_from_gin():
    from components.trainer.config import train_config

    gin.parse_config("train.kl_coef = 0.05\ntrain.kl_estimator = 'k2'\n"
                     "train.entropy_coef = 1e-3\ntrain.lr_schedule = 'cosine'")
    cfg = train_config(model_path="/x")
    assert (cfg.kl_coef, cfg.kl_estimator, cfg.entropy_coef, cfg.lr_schedule) == (0.05, "k2", 1e-3, "cosine")


# ----------------------------------------------------------------------------------------
# the learner on a tiny model
@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("kl_model"))


def _rollouts(tokenizer, rewards=None, n_groups: int = 3, G: int = 4, seed: int = 0):
    """Groups of completions of unequal lengths (random tokens, off-policy generator log-probs)."""
    from components.engines.base import Completion
    from components.trainer.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    out = []
    for gi in range(n_groups):
        prompt = tokenizer.encode(f"{gi}+{gi + 2}=", add_special_tokens=False)
        comps, rs = [], []
        for s in range(G):
            n = int(torch.randint(2, 8, (1,), generator=g))
            toks = torch.randint(4, vocab, (n,), generator=g).tolist()
            gen_logp = (-1.0 - 3.0 * torch.rand(n, generator=g)).tolist()
            comps.append(Completion(gi, s, list(prompt), toks, gen_logp, [0] * n, [False] * n, "stop"))
            rs.append(rewards if rewards is not None else (1.0 if (s + gi) % 2 == 0 else -1.0))
        out.append(Rollout(order_id=gi, problem_id=f"p{gi}", completions=comps, rewards=rs, passed=[r > 0 for r in rs]))
    return out


def _learner(model_path, **overrides):
    from components.models import load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner

    load_builtin_components()
    settings = dict(lr=1e-2, warmup_steps=0, weight_decay=0.0, micro_batch_size=12, prompts_per_step=3,
                    generations_per_prompt=4, temperature=0.7, grad_clip=0.0, loss="cispo", aggregation="prompt_mean")
    settings.update(overrides)
    cfg = TrainConfig(model_path=model_path, **settings)
    tok = load_tokenizer(model_path)
    return Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu")), tok


def _perturb(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> None:
    """Move the trained policy away from the reference (same noise for every learner given `seed`)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _grads(learner, mb) -> dict:
    learner.accumulate([mb])
    return {name: p.grad.detach().clone() for name, p in learner.model.named_parameters()}


def _float64_head(model, mb, temperature: float):
    """logp [b, T] and the full log-softmax [b, T, V] of a micro-batch's completion tokens, in float64
    (a double copy of `model`, the padded forward: positions from the mask, column P-1+t predicts P+t)."""
    from components.engines.logprobs import position_ids_from_mask

    batch = mb.batch
    P = int(batch.completion_start)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=position_ids_from_mask(batch.attention_mask), use_cache=False).logits  # [b, L, V]
    lp_all = torch.log_softmax(logits[:, P - 1 : -1].double() / temperature, dim=-1)  # [b, T, V]
    logp = lp_all.gather(-1, batch.input_ids[:, P:].unsqueeze(-1)).squeeze(-1)  # [b, T]
    return logp, lp_all


def _relative_error(got: dict, want: dict) -> float:
    num = sum(float((got[k].double() - want[k]).square().sum()) for k in want)
    den = sum(float(want[k].square().sum()) for k in want)
    return math.sqrt(num / den)


def test_defaults_build_no_reference_and_give_the_policy_loss_gradient_bit_for_bit(model_path):
    """kl_coef = 0 and entropy_coef = 0 (the defaults): no reference, no `kl`, and the gradient is the
    policy loss's alone, computed as before these knobs (the chunked head with a non-differentiable entropy)."""
    from components.aggregation import weighted_sum
    from components.registry import LOSSES
    from components.trainer.forward import sequence_logprobs_packed

    learner, tok = _learner(model_path)
    assert learner.reference is None and learner.kl_fn is None
    explicit, _ = _learner(model_path, kl_coef=0.0, entropy_coef=0.0, kl_estimator="k3", lr_schedule="constant")
    assert explicit.reference is None
    plan = learner.plan(_rollouts(tok), [True] * 3)
    mb = plan.shards[0][0]
    manual = copy.deepcopy(learner.model)
    grads = _grads(learner, mb)
    logp, entropy = sequence_logprobs_packed(manual, mb.batch, temperature=0.7, chunk_size=1024, with_entropy=True)
    assert not entropy.requires_grad
    per_token = LOSSES.get("cispo")(logp, mb.batch.gen_logp, mb.advantages, mb.batch.mask)
    weighted_sum(per_token, mb.weights).backward()
    for name, p in manual.named_parameters():
        assert torch.equal(grads[name], p.grad), name
    stats = learner.train(plan)
    stats_explicit = explicit.step(_rollouts(tok), [True] * 3)
    assert "kl" not in stats and "kl" not in stats_explicit
    for (name, a), (_, b) in zip(learner.model.named_parameters(), explicit.model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_gradient_and_stat_against_float64(model_path, estimator):
    """Zero advantages (every reward equal) leave only the KL term: its gradient is
    kl_coef * sum_bt w_bt * dk/dlogp_bt * dlogp_bt/dtheta, computed here in float64 from the formulas."""
    coef = 0.3
    learner, tok = _learner(model_path, kl_coef=coef, kl_estimator=estimator)
    ref = learner.reference
    assert ref is not None and not ref.training and not any(p.requires_grad for p in ref.parameters())
    initial = {name: p.detach().clone() for name, p in ref.named_parameters()}
    _perturb(learner.model)
    plan = learner.plan(_rollouts(tok, rewards=1.0), [True] * 3)
    mb = plan.shards[0][0]
    assert (mb.advantages == 0).all()
    policy64 = copy.deepcopy(learner.model).double()
    grads = _grads(learner, mb)
    # float64: the per-token coefficient from the formulas, then its product with dlogp/dtheta
    logp64, _ = _float64_head(policy64, mb, 0.7)
    with torch.no_grad():
        ref_logp64, _ = _float64_head(copy.deepcopy(ref).double(), mb, 0.7)
    mask, w = mb.batch.mask, mb.weights.double()
    coeff = torch.zeros_like(logp64)
    kl64 = []
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                value, d = _ref_kl(estimator, logp64[b, t].item(), ref_logp64[b, t].item())
                coeff[b, t] = coef * float(w[b, t]) * d
                kl64.append(value)
    (coeff * logp64).sum().backward()
    want = {name: p.grad for name, p in policy64.named_parameters()}
    assert _relative_error(grads, want) < 1e-5
    # the step: `kl` is the mean estimate over the trained tokens; the reference never moves
    stats = learner.train(plan)
    assert stats["kl"] == pytest.approx(sum(kl64) / len(kl64), rel=1e-5, abs=1e-7)
    if estimator != "k1":
        assert stats["kl"] > 0
    for name, p in ref.named_parameters():
        assert torch.equal(p, initial[name]), name


def test_kl_is_exactly_zero_while_the_policy_is_the_reference_also_in_emulated_bf16(model_path):
    """The reference is computed like the policy (same forward, head, temperature and precision context):
    before any update the two log-probs agree bit for bit, so every estimator gives 0."""
    for precision in ("fp32", "bf16"):
        learner, tok = _learner(model_path, kl_coef=1.0, kl_estimator="k1", precision=precision)
        stats = learner.step(_rollouts(tok), [True] * 3)
        assert stats["kl"] == 0.0, precision
        stats = learner.step(_rollouts(tok, seed=1), [True] * 3)
        assert stats["kl"] != 0.0 and math.isfinite(stats["kl"]), precision


def test_a_strong_kl_penalty_keeps_the_policy_nearer_the_reference(model_path):
    """Same rollouts, same steps: with kl_coef > 0 the policy ends nearer its initial weights'
    log-probs (the reference) than with kl_coef = 0."""
    rollouts_by_step = None
    dist = {}
    for coef in (0.0, 5.0):
        learner, tok = _learner(model_path, kl_coef=coef, kl_estimator="k2", lr=3e-3, grad_clip=1.0)
        rollouts_by_step = rollouts_by_step or [_rollouts(tok, seed=s) for s in range(4)]
        reference = copy.deepcopy(learner.model) if coef == 0 else learner.reference
        for rollouts in rollouts_by_step:
            learner.step(rollouts, [True] * 3)
        plan = learner.plan(rollouts_by_step[0], [True] * 3)
        with torch.no_grad():
            a, _ = _float64_head(copy.deepcopy(learner.model).double(), plan.shards[0][0], 0.7)
            b, _ = _float64_head(copy.deepcopy(reference).double(), plan.shards[0][0], 0.7)
        dist[coef] = float((a - b)[plan.shards[0][0].batch.mask].square().mean())
    assert dist[5.0] < dist[0.0]


def test_entropy_bonus_changes_the_gradient_by_minus_coef_times_the_entropy_gradient(model_path):
    """Zero advantages: the gradient is -entropy_coef * sum_bt w_bt * dH_bt/dtheta, H the entropy of the
    temperature-scaled next-token distribution, compared with float64 autograd on the double model."""
    coef = 0.2
    learner, tok = _learner(model_path, entropy_coef=coef)
    plan = learner.plan(_rollouts(tok, rewards=-1.0), [True] * 3)
    mb = plan.shards[0][0]
    policy64 = copy.deepcopy(learner.model).double()
    grads = _grads(learner, mb)
    _, lp_all = _float64_head(policy64, mb, 0.7)
    entropy64 = -(lp_all.exp() * lp_all).sum(-1)  # [b, T]
    bonus = (mb.weights.double() * torch.where(mb.batch.mask, entropy64, torch.zeros_like(entropy64))).sum()
    (-coef * bonus).backward()
    want = {name: p.grad for name, p in policy64.named_parameters()}
    assert _relative_error(grads, want) < 1e-5
    # with non-zero advantages the bonus adds exactly that term to the policy-loss gradient
    plain, _ = _learner(model_path)
    with_bonus, _ = _learner(model_path, entropy_coef=coef)
    mb = plain.plan(_rollouts(tok), [True] * 3).shards[0][0]
    policy64 = copy.deepcopy(plain.model).double()
    g_plain, g_bonus = _grads(plain, mb), _grads(with_bonus, mb)
    _, lp_all = _float64_head(policy64, mb, 0.7)
    entropy64 = -(lp_all.exp() * lp_all).sum(-1)  # [b, T]
    (-coef * (mb.weights.double() * torch.where(mb.batch.mask, entropy64, torch.zeros_like(entropy64))).sum()).backward()
    diff = {name: g_bonus[name] - g_plain[name] for name in g_plain}
    assert _relative_error(diff, {name: p.grad for name, p in policy64.named_parameters()}) < 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_head_entropy_gradient_against_float64(temperature):
    """`chunked_token_logprobs(..., entropy_grad=True)` over several chunks: d(sum a*logp + c*entropy)
    w.r.t. hidden, weight and bias equals float64 autograd of the plain log-softmax; without
    entropy_grad the entropy carries no grad (the default path)."""
    from components.trainer.forward import chunked_token_logprobs

    g = torch.Generator().manual_seed(0)
    N, H, V = 11, 6, 13
    hidden = torch.randn(N, H, generator=g).requires_grad_(True)
    weight = torch.randn(V, H, generator=g).requires_grad_(True)
    bias = torch.randn(V, generator=g).requires_grad_(True)
    targets = torch.randint(0, V, (N,), generator=g)
    a, c = torch.randn(N, generator=g), torch.randn(N, generator=g)
    logp, ent = chunked_token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=4, bias=bias,
                                       with_entropy=True, entropy_grad=True)
    got = torch.autograd.grad((a * logp + c * ent).sum(), [hidden, weight, bias])
    h64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (hidden, weight, bias))
    lp = torch.log_softmax((h64 @ w64.T + b64) / temperature, dim=-1)  # [N, V]
    logp64 = lp.gather(-1, targets[:, None]).squeeze(-1)
    ent64 = -(lp.exp() * lp).sum(-1)
    torch.testing.assert_close(logp.detach().double(), logp64.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent.detach().double(), ent64.detach(), rtol=1e-5, atol=1e-6)
    want = torch.autograd.grad((a.double() * logp64 + c.double() * ent64).sum(), [h64, w64, b64])
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y, rtol=1e-4, atol=1e-5)
    _, ent_plain = chunked_token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=4, bias=bias,
                                          with_entropy=True)
    assert not ent_plain.requires_grad


# ----------------------------------------------------------------------------------------
# two FSDP2 learner ranks: the reference is sharded like the policy (rank 1 starting empty)
def _config(model_path: str, **kw):
    from components.trainer.config import TrainConfig

    settings = dict(loss="grpo", aggregation="token_mean", advantage_norm="batch", lr=1e-3, warmup_steps=0,
                    weight_decay=0.0, micro_batch_size=3, prompts_per_step=3, generations_per_prompt=4, grad_clip=0.0,
                    precision="fp32", temperature=0.7, kl_coef=0.5, kl_estimator="k3")
    settings.update(kw)
    return TrainConfig(model_path=model_path, **settings)


def _kl_gradients(model, model_path: str, ranks: int, rank: int):
    from components.models import load_tokenizer
    from components.trainer.learner import Learner, plan_step

    tok = load_tokenizer(model_path)
    cfg = _config(model_path)
    learner = Learner(model, cfg, tok.pad_token_id, torch.device("cpu"))
    if ranks == 1:
        _perturb(learner.model)
    else:  # the same noise on the full tensors, applied to this rank's shards
        from torch.distributed.tensor import distribute_tensor

        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in learner.model.parameters():
                noise = 0.05 * torch.randn(p.shape, generator=g)
                p.add_(distribute_tensor(noise, p.device_mesh, p.placements))
    rollouts = _rollouts(tok)
    plan = plan_step(rollouts, [True] * len(rollouts), cfg, tok.pad_token_id, ranks)
    part = learner.accumulate(plan.shards[rank])
    grads = {}
    for name, p in learner.model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    sharded = all(hasattr(p, "full_tensor") for p in learner.reference.parameters())
    return grads, [kl.clone() for kl in part.get("kl", [])], sharded


def _rank_main(rank: int, world: int, init_file: str, model_path: str, out: str) -> None:
    import torch.distributed as dist

    from components.models import empty_causal_lm, load_causal_lm
    from components.registry import load_builtin_components

    torch.set_num_threads(1)
    load_builtin_components()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = load_causal_lm(model_path) if rank == 0 else empty_causal_lm(model_path)
        grads, kls, sharded = _kl_gradients(model, model_path, world, rank)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(dict(grads=grads, kls=kls, sharded=sharded), f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_shard_the_reference_and_give_the_one_process_kl_gradient(tmp_path, model_path):
    import torch.multiprocessing as mp

    from components.models import load_causal_lm
    from components.registry import load_builtin_components

    load_builtin_components()
    out = tmp_path / "kl"
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), model_path, str(out)), nprocs=2, start_method="spawn")
    r0, r1 = (pickle.loads(Path(f"{out}.{r}").read_bytes()) for r in (0, 1))
    assert r0["sharded"] and r1["sharded"]
    one, _, _ = _kl_gradients(load_causal_lm(model_path), model_path, 1, 0)
    assert r0["kls"] and r1["kls"] and all(float(k.abs().sum()) > 0 for k in r0["kls"] + r1["kls"])
    for name, g in one.items():
        torch.testing.assert_close(r0["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
        assert torch.equal(r0["grads"][name], r1["grads"][name]), name
