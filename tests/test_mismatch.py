"""Training-inference mismatch corrections (issue 33, item 7; components/mismatch.py).

Each correction's weight against an independent float64 reference; the weight is detached and
scales the loss gradient; `none` leaves a learner step bit for bit as it was; tis / mis steps log
the mismatch metrics; on-policy in fp32 the KL is ~0 and the TIS weights are 1; the old log-probs
(the step's own forward, detached) equal a separate no-grad forward; the registry and the
config check name a typo; the mismatch sweep expands to its 9 runs.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers_trainer import tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "experiments" / "sweeps" / "mismatch.gin"
CORRECTIONS = ("none", "tis", "mis", "seq_tis", "seq_mis")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _clean_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("mismatch_model"))


# ---------------------------------------------------------------------------------------
# the weights, against a float64 reference written per token
def _random_logps(seed: int = 0, B: int = 6, T: int = 7, noise: float = 0.6):
    """old / gen log-probs with a mismatch of `noise` nats, and a mask with ragged lengths; garbage on padding."""
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(B, T, generator=g)  # [B, T]
    gen = old + noise * torch.randn(B, T, generator=g)  # [B, T]
    lengths = torch.randint(1, T + 1, (B,), generator=g)  # [B]
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    old = torch.where(mask, old, torch.full_like(old, float("-inf")))  # [B, T] padding garbage
    gen = torch.where(mask, gen, torch.full_like(gen, 1e4))  # [B, T]
    return old, gen, mask


def _reference(name: str, old, gen, mask, **hp) -> torch.Tensor:
    """The correction's weight, one token at a time, in float64 (math.exp, no torch ops on whole rows)."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        tokens = [t for t in range(T) if mask[b, t]]
        ratios = [math.exp(float(old[b, t]) - float(gen[b, t])) for t in tokens]
        seq = math.exp(sum(float(old[b, t]) - float(gen[b, t]) for t in tokens))
        for t, r in zip(tokens, ratios):
            if name == "none":
                w = 1.0
            elif name == "tis":
                w = min(r, hp.get("cap", 2.0))
            elif name == "mis":
                w = r if hp.get("low", 0.5) <= r <= hp.get("high", 2.0) else 0.0
            elif name == "seq_tis":
                w = min(seq, hp.get("cap", 2.0))
            else:
                w = seq if hp.get("low", 0.5) <= seq <= hp.get("high", 2.0) else 0.0
            out[b, t] = w
    return out


@pytest.mark.parametrize("name", CORRECTIONS)
@pytest.mark.parametrize("noise", [0.05, 0.6])
def test_each_correction_matches_a_float64_reference(name, noise):
    from components.registry import MISMATCH_CORRECTIONS

    old, gen, mask = _random_logps(noise=noise)
    fn = MISMATCH_CORRECTIONS.get(name)
    hps = [{}] if name == "none" else ([{}, {"cap": 1.3}] if "tis" in name else [{}, {"low": 0.8, "high": 1.1}])
    for hp in hps:
        w = fn(old, gen, mask, **hp)  # [B, T]
        assert w.shape == mask.shape and w.dtype == torch.float32
        assert bool(torch.isfinite(w).all()) and bool((w[~mask] == 0).all()), "0 on padding, never NaN"
        torch.testing.assert_close(w.double(), _reference(name, old, gen, mask, **hp), rtol=1e-5, atol=1e-6)


def test_sequence_ratios_overflow_to_the_cap_or_a_rejection_never_nan():
    from components.mismatch import seq_mis, seq_tis

    old = torch.zeros(2, 400)  # [B, T]
    gen = torch.full((2, 400), -1.0)  # [B, T]  log S = 400: exp overflows float32
    gen[1] = 1.0  # log S = -400: underflows to 0
    mask = torch.ones(2, 400, dtype=torch.bool)
    assert torch.equal(seq_tis(old, gen, mask)[:, 0], torch.tensor([2.0, 0.0]))
    assert torch.equal(seq_mis(old, gen, mask), torch.zeros(2, 400))


def test_weights_are_detached_and_scale_the_loss_gradient():
    """policy_loss = loss(logp, sg(logp)) * sg(w): its gradient is w times the loss's own gradient,
    which for every built-in loss at ratio 1 is REINFORCE's -A d logp (per token, before aggregation)."""
    from components.mismatch import policy_loss
    from components.registry import LOSSES, MISMATCH_CORRECTIONS

    _, gen, mask = _random_logps(seed=1)
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(mask.shape[0], generator=g)  # [B]
    base = torch.where(mask, gen + 0.3 * torch.randn(mask.shape, generator=g), torch.zeros_like(gen))  # [B, T]
    for name in ("tis", "mis", "seq_tis", "seq_mis"):
        correction = MISMATCH_CORRECTIONS.get(name)
        weight = correction(base, gen, mask)  # [B, T]
        leaf = base.clone().requires_grad_(True)
        assert not correction(leaf, gen, mask).requires_grad, f"{name}: the weight must carry no gradient"
        for loss in ("grpo", "dapo", "cispo", "gspo", "ppo_dual_clip", "icepop"):
            loss_fn = LOSSES.get(loss)
            logp = base.clone().requires_grad_(True)
            policy_loss(loss_fn, correction, logp, gen, adv, mask).sum().backward()
            plain = base.clone().requires_grad_(True)
            loss_fn(plain, plain.detach(), adv, mask).sum().backward()
            torch.testing.assert_close(logp.grad, plain.grad * weight, msg=f"{name} x {loss}")
            reinforce = torch.where(mask, -adv[:, None] * weight, torch.zeros_like(weight))  # [B, T]
            torch.testing.assert_close(logp.grad, reinforce, msg=f"{name} x {loss}")


def test_none_is_the_loss_itself():
    from components.mismatch import policy_loss, resolve_correction
    from components.registry import LOSSES

    old, gen, mask = _random_logps(seed=3)
    logp = torch.where(mask, old, torch.zeros_like(old))  # [B, T]
    adv = torch.linspace(-1, 1, mask.shape[0])  # [B]
    assert resolve_correction("none") is None
    for loss in ("dapo", "cispo"):
        fn = LOSSES.get(loss)
        assert torch.equal(policy_loss(fn, None, logp, gen, adv, mask), fn(logp, gen, adv, mask))


def test_k3_estimates_kl_of_the_generator_from_the_learner():
    """Summed over the whole vocabulary with the generator's probabilities (the tokens ARE its
    samples), k3 with log r = old - gen gives exactly KL(pi_gen || pi_old); the other direction does not."""
    from components.mismatch import k3

    g = torch.Generator().manual_seed(4)
    gen = torch.log_softmax(torch.randn(1, 50, generator=g, dtype=torch.float64), -1)  # [1, V]
    old = torch.log_softmax(gen + 0.5 * torch.randn(1, 50, generator=g, dtype=torch.float64), -1)  # [1, V]
    mask = torch.ones(1, 50, dtype=torch.bool)
    expected = float((gen.exp() * (gen - old)).sum())  # KL(gen || old)
    assert float((gen.exp() * k3(old, gen, mask)).sum()) == pytest.approx(expected, rel=1e-10)
    assert float((gen.exp() * k3(gen, old, mask)).sum()) != pytest.approx(expected, rel=1e-2)
    assert bool((k3(old, gen, mask) >= 0).all())


# ---------------------------------------------------------------------------------------
# the learner
def _rollouts(tokenizer, model=None, n_groups: int = 4, G: int = 4, seed: int = 0, T: int = 5):
    """Groups of G completions; gen_logp sampled by `model` (on-policy), else noisy (off-policy, ragged)."""
    from components.engines.base import Completion
    from components.engines.logprobs import token_logprobs
    from components.trainer.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    rollouts = []
    for gi in range(n_groups):
        prompt = tokenizer.encode(f"{gi}+{gi * 3}=", add_special_tokens=False)
        comps, rewards = [], []
        for s in range(G):
            if model is None:
                n = int(torch.randint(1, 10, (1,), generator=g))
                toks = torch.randint(4, vocab, (n,), generator=g).tolist()
                lps = (-3.5 - 0.8 * torch.randn(n, generator=g)).tolist()  # ratios well away from 1
            else:
                ids, toks, lps, n = list(prompt), [], [], T
                with torch.no_grad():
                    for _ in range(T):
                        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                        tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
                        lps.append(float(token_logprobs(logits, torch.tensor(tok))))
                        toks.append(tok)
                        ids.append(tok)
            comps.append(Completion(gi, s, list(prompt), toks, lps, [0] * n, [False] * n, "stop"))
            rewards.append(1.0 if (s + gi) % 3 == 0 else -1.0)
        rollouts.append(Rollout(order_id=gi, problem_id=f"p{gi}", completions=comps, rewards=rewards,
                                passed=[r > 0 for r in rewards]))
    return rollouts


def _learner(model_path: str, **kw):
    from components.models import load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner

    load_builtin_components()
    settings = dict(loss="dapo", aggregation="token_mean", advantage_norm="batch", lr=1e-3, warmup_steps=0,
                    weight_decay=0.0, micro_batch_size=6, prompts_per_step=4, generations_per_prompt=4,
                    precision="fp32")
    settings.update(kw)
    torch.manual_seed(0)
    tok = load_tokenizer(model_path)
    return Learner(load_causal_lm(model_path), TrainConfig(model_path=model_path, **settings), tok.pad_token_id,
                   torch.device("cpu")), tok


def _params(learner) -> dict:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def test_none_leaves_a_learner_step_bit_for_bit(model_path):
    """The field unset and set to "none": the same parameters after a step, bit for bit; a correction does change them."""
    unset, tok = _learner(model_path)
    rollouts = _rollouts(tok)
    keep = [True] * len(rollouts)
    assert unset.cfg.mismatch_correction == "none" and unset.correction is None
    s_unset = unset.step(rollouts, keep)
    explicit, _ = _learner(model_path, mismatch_correction="none")
    s_none = explicit.step(rollouts, keep)
    a, b = _params(unset), _params(explicit)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert s_unset["loss"] == s_none["loss"] and s_unset["grad_norm"] == s_none["grad_norm"]
    assert s_none["mismatch_masked_frac"] == 0.0 and s_none["mismatch_kl"] > 0  # free, so logged with none too
    corrected, _ = _learner(model_path, mismatch_correction="tis")
    corrected.step(rollouts, keep)
    c = _params(corrected)
    assert any(not torch.equal(a[n], c[n]) for n in a)


@pytest.mark.parametrize("name", ["tis", "mis", "seq_tis", "seq_mis"])
def test_a_corrected_step_logs_the_mismatch_metrics(model_path, name):
    from components.mismatch import k3
    from components.trainer.rollout import collate

    learner, tok = _learner(model_path, mismatch_correction=name, micro_batch_size=5)  # uneven micro-batches
    rollouts = _rollouts(tok, seed=5)
    batch = collate(rollouts, tok.pad_token_id)
    with torch.no_grad(), learner.compute_context():
        from components.engines.logprobs import sequence_logprobs

        old = sequence_logprobs(learner.model, batch.input_ids, batch.attention_mask, batch.completion_start)  # [B, T]
    stats = learner.step(rollouts, [True] * len(rollouts))
    assert learner.version == 1 and math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert stats["mismatch_kl"] >= 0
    assert stats["mismatch_kl"] == pytest.approx(float(k3(old, batch.gen_logp, batch.mask)[batch.mask].mean()), rel=1e-4)
    assert 0.0 <= stats["mismatch_masked_frac"] <= 1.0
    weights = _reference(name, old, batch.gen_logp, batch.mask)
    assert stats["mismatch_masked_frac"] == pytest.approx(float((weights[batch.mask] == 0).double().mean()))
    if "tis" in name:
        assert 0.0 <= stats["mismatch_truncated_frac"] <= 1.0 and stats["mismatch_masked_frac"] == 0.0
    else:
        assert "mismatch_truncated_frac" not in stats and stats["mismatch_masked_frac"] > 0  # these ratios leave [0.5, 2]
    assert stats["clip_frac"] == 0.0  # the loss's ratio is against sg(logp): nothing to clip


def test_on_policy_fp32_gives_zero_kl_and_unit_tis_weights(model_path):
    """Generator log-probs recorded by the learner's own model in fp32: the learner's old log-probs
    equal them (to fp32 rounding), so KL ~ 0, every TIS weight is 1, and the TIS step is none's step."""
    from components.mismatch import tis

    learner, tok = _learner(model_path, mismatch_correction="tis", loss="cispo")
    rollouts = _rollouts(tok, model=learner.model, seed=6)
    plan = learner.plan(rollouts, [True] * len(rollouts))
    for mb in plan.shards[0]:
        with torch.no_grad():
            logp, _ = learner.logprobs(mb)  # [b, T]
        w = tis(logp, mb.batch.gen_logp, mb.batch.mask)  # [b, T]
        torch.testing.assert_close(w, mb.batch.mask.float(), rtol=0, atol=1e-5)
    stats = learner.train(plan)
    assert 0 <= stats["mismatch_kl"] < 1e-10
    assert stats["mismatch_truncated_frac"] == 0.0 and stats["mismatch_masked_frac"] == 0.0
    plain, _ = _learner(model_path, loss="cispo")
    plain.step(rollouts, [True] * len(rollouts))
    a, b = _params(learner), _params(plain)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_corrected_step_does_not_depend_on_micro_batches_or_ranks(model_path):
    """The weights are per row (a sequence's ratio needs only its own tokens, which one micro-batch
    holds): one micro-batch, three uneven ones and two emulated ranks give the same update."""
    rollouts = None
    params = []
    from _emulated_ranks import step_as_ranks

    for kw, ranks in ((dict(micro_batch_size=16), 1), (dict(micro_batch_size=3), 1), (dict(micro_batch_size=3), 2)):
        learner, tok = _learner(model_path, mismatch_correction="seq_tis", grad_clip=0.0, **kw)
        rollouts = rollouts or _rollouts(tok, seed=9)
        if ranks == 1:
            learner.step(rollouts, [True] * len(rollouts))
        else:  # one process in the arithmetic of two ranks (tests/_emulated_ranks.py)
            step_as_ranks(learner, rollouts, ranks)
        params.append(_params(learner))
    for other in params[1:]:
        for n in params[0]:
            torch.testing.assert_close(other[n], params[0][n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16_fp32_head"])
def test_old_logprobs_are_what_a_separate_no_grad_forward_gives(model_path, precision):
    """The learner makes one update per step batch, so sg(logp) of the step's forward IS pi_old: a
    separate no-grad forward before the update (verl's and TRL's recompute) gives the same numbers,
    bit for bit, in fp32 and in bf16 (emulated on this CPU), so the correction runs no extra forward."""
    learner, tok = _learner(model_path, precision=precision, micro_batch_size=5)
    plan = learner.plan(_rollouts(tok, seed=7), [True] * 4)
    learner.model.train()
    for mb in plan.shards[0]:
        with torch.no_grad():
            recomputed, _ = learner.logprobs(mb)  # [b, T]
        logp, _ = learner.logprobs(mb)  # [b, T] with grad, as _backward computes it
        assert logp.requires_grad and torch.equal(logp.detach(), recomputed), precision


# ---------------------------------------------------------------------------------------
# by name: the registry, the config check, the sweep
def test_the_registry_lists_the_corrections_and_a_typo_gets_a_did_you_mean():
    from components.registry import ALL_REGISTRIES, MISMATCH_CORRECTIONS, UnknownComponentError
    from components.trainer.config import TrainConfig
    from components.trainer.config import check_settings

    assert ALL_REGISTRIES["mismatch_corrections"] is MISMATCH_CORRECTIONS
    assert set(CORRECTIONS) <= set(MISMATCH_CORRECTIONS.names())
    assert {p.name: p.default for p in MISMATCH_CORRECTIONS.params("tis")} == {"cap": 2.0}
    assert {p.name: p.default for p in MISMATCH_CORRECTIONS.params("mis")} == {"low": 0.5, "high": 2.0}
    with pytest.raises(UnknownComponentError, match="Did you mean 'tis'"):
        MISMATCH_CORRECTIONS.get("tsi")
    with pytest.raises(UnknownComponentError, match=r"train.mismatch_correction = 'smis'.*Did you mean 'mis'"):
        check_settings(TrainConfig(mismatch_correction="smis"), on_this_machine=False)
    check_settings(TrainConfig(mismatch_correction="seq_tis"), on_this_machine=False)


def test_hyper_parameters_bind_from_gin_and_are_range_checked():
    import gin

    from components.mismatch import mismatch_stats
    from components.registry import MISMATCH_CORRECTIONS
    from components.trainer.config import ConfigError, TrainConfig, validate

    gin.parse_config("tis.cap = 1.5")
    old, gen, mask = _random_logps(seed=8)
    assert float(MISMATCH_CORRECTIONS.get("tis")(old, gen, mask).max()) == 1.5  # bound by gin, called with no keyword
    expected = float(((old - gen).exp() > 1.5)[mask].double().mean())
    # the learner's statistics get the run's resolved values as arguments (issue 42), never gin's
    assert mismatch_stats("tis", old, gen, mask, {"cap": 1.5})["mismatch_truncated_frac"] == pytest.approx(expected)
    at_default = float(((old - gen).exp() > 2.0)[mask].double().mean())
    assert mismatch_stats("tis", old, gen, mask)["mismatch_truncated_frac"] == pytest.approx(at_default)
    validate(TrainConfig(mismatch_correction="tis"))
    gin.clear_config()
    gin.parse_config("tis.cap = 0.5")
    with pytest.raises(ConfigError, match=r"tis.cap = 0.5 is out of range: must be >= 1"):
        validate(TrainConfig(mismatch_correction="tis"))
    gin.clear_config()
    gin.parse_config("mis.high = 0.9")
    with pytest.raises(ConfigError, match=r"mis.high = 0.9 is out of range"):
        validate(TrainConfig(mismatch_correction="mis"))
    validate(TrainConfig(mismatch_correction="tis"))  # only the run's own correction is checked


def test_the_mismatch_sweep_crosses_precision_with_the_corrections():
    from experiments import run_config, sweep_spec
    from experiments.cli import main as scalerl

    spec = sweep_spec.load_spec(SWEEP)
    runs = sweep_spec.expand(spec, "tiny")
    precisions, corrections = ("bf16", "bf16_fp32_head", "fp32"), ("none", "tis", "mis")
    assert [r.name for r in runs] == [f"{p}-{c}-s0" for p in precisions for c in corrections]
    for r in runs:
        p, c = r.name[:-3].rsplit("-", 1)
        assert f'train.precision = "{p}"' in r.bindings and f'train.mismatch_correction = "{c}"' in r.bindings
    run_config.validate_runs(runs)
    assert len(sweep_spec.expand(spec, "paper")) == 9
    assert scalerl(["sweep", str(SWEEP), "--scale", "tiny", "--dry-run"]) == 0
    # not a paper ablation: outside the shipped sweeps that `scalerl reproduce` runs and findings judge
    from analysis.findings import FINDINGS
    from experiments.study_runs import select_specs

    assert SWEEP not in select_specs(None) and "mismatch" not in FINDINGS
