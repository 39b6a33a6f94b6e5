"""Multi-turn (issue 45 item 2): observation tokens never carry a gradient, nor enter aggregation,
clipping, KL, entropy or the mismatch corrections.

The check, in float64, through the learner's own step code (`Learner._backward`: mismatch correction,
loss, KL penalty, entropy bonus, aggregation weights): for a batch collated from multi-turn completions
(assistant turns interleaved with environment observations, `Completion.observed`),
  1. the gradient on every observation position (log-prob, entropy) is exactly zero, and
  2. the loss and the gradient on every policy token equal those of the SAME sequences with the
     observation tokens excluded (each row's policy tokens packed to the left, same width),
for every registered loss x aggregation x mismatch correction, and for every KL estimator.
Observation positions hold wild values (log-probs far from the generator's) so that a leak shows.
Then the same at the model level: through the learner's forward (`sequence_logprobs_packed`), the
gradient reaching the final hidden state that predicts an observation token is exactly zero.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from components.aggregation import token_weights
from components.engines.base import Completion
from components.mismatch import resolve_correction
from components.registry import AGGREGATIONS, KL_ESTIMATORS, LOSSES, MISMATCH_CORRECTIONS
from components.trainer.learner import Learner, MicroBatch
from components.trainer.rollout import Batch, Rollout, collate

torch.set_num_threads(1)

PAD = 0
G = 3  # generations per prompt


def _episode(rng: random.Random, vocab: int = 40) -> Completion:
    """A completion of 1-3 assistant turns with observations between them (forced and observed)."""
    tokens, observed = [], []
    turns = rng.randint(1, 3)
    for t in range(turns):
        n = rng.randint(1, 5)
        tokens += [rng.randrange(3, vocab) for _ in range(n)]
        observed += [False] * n
        if t < turns - 1:
            m = rng.randint(1, 4)
            tokens += [rng.randrange(3, vocab) for _ in range(m)]
            observed += [True] * m
    gen_logp = [0.0 if o else -rng.uniform(0.05, 3.0) for o in observed]
    return Completion(group_id=0, sample_index=0, prompt_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(2, 4))],
                      token_ids=tokens, gen_logp=gen_logp, versions=[0] * len(tokens), forced=list(observed),
                      finish_reason="stop", observed=list(observed))


def _batch(seed: int = 0, prompts: int = 3) -> tuple[Batch, torch.Tensor]:
    """A collated multi-turn batch and its [B, T] observation mask."""
    rng = random.Random(seed)
    rollouts = [Rollout(order_id=g, problem_id=str(g), completions=[_episode(rng) for _ in range(G)],
                        rewards=[rng.choice([-1.0, 1.0]) for _ in range(G)], passed=[False] * G) for g in range(prompts)]
    batch = collate(rollouts, PAD)
    B, T = batch.mask.shape
    obs = torch.zeros((B, T), dtype=torch.bool)  # [B, T]
    for b, c in enumerate(c for r in rollouts for c in r.completions):
        obs[b, : len(c.observed)] = torch.tensor(c.observed)
    return batch, obs


def _exclude(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's `keep` entries packed to the left, zeros after, same width.  [B, T]"""
    out = torch.zeros_like(x)  # [B, T]
    for b in range(x.shape[0]):
        kept = x[b][keep[b]]
        out[b, : kept.numel()] = kept
    return out


def _fake_learner(loss: str, correction: str, kl: str | None, logp, entropy, ref_logp):
    """What `Learner.backward` reads from its learner, with the per-token inputs given (float64 leaves)."""
    return SimpleNamespace(
        loss_fn=LOSSES.get(loss), correction=resolve_correction(correction),
        kl_fn=KL_ESTIMATORS.get(kl) if kl else None, device=torch.device("cpu"),
        cfg=SimpleNamespace(kl_coef=0.1 if kl else 0.0, entropy_coef=0.01),
        logprobs=lambda mb: (logp, entropy), reference_logprobs=lambda mb: ref_logp,
    )


def _step(batch: Batch, advantages, aggregation: str, loss: str, correction: str, kl, logp0, ent0, ref0):
    """The learner's loss on `batch` and its gradients w.r.t. logp and entropy (float64).  [], [B, T], [B, T]"""
    logp = logp0.clone().requires_grad_(True)  # [B, T]
    entropy = ent0.clone().requires_grad_(True)  # [B, T]
    weights = token_weights(aggregation, batch.mask, batch.group_ids, dtype=torch.float64)  # [B, T]
    torch.manual_seed(1234)  # losses that draw tokens at random (clip_cov) draw the same in both batches
    value, *_ = Learner.backward(_fake_learner(loss, correction, kl, logp, entropy, ref0),
                                  MicroBatch(batch, advantages, weights), 1.0)
    grad_logp = logp.grad if logp.grad is not None else torch.zeros_like(logp)
    grad_ent = entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)
    return value, grad_logp, grad_ent


def _inputs(batch: Batch, obs: torch.Tensor, seed: int = 0):
    """float64 logp, entropy, ref_logp [B, T] (wild at observations) and the batch with float64 gen_logp."""
    g = torch.Generator().manual_seed(seed)
    B, T = batch.mask.shape
    logp = batch.gen_logp.double() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # [B, T]
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 2  # [B, T]
    ref = batch.gen_logp.double() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)  # [B, T]
    gen = batch.gen_logp.double().clone()  # [B, T]
    logp[obs], entropy[obs], ref[obs], gen[obs] = -40.0, 9.0, 25.0, 30.0  # a leak would show
    return logp, entropy, ref, Batch(**{**{k: getattr(batch, k) for k in Batch._TENSORS}, "gen_logp": gen},
                                     completion_start=batch.completion_start)


def _excluded_batch(batch: Batch, keep: torch.Tensor) -> Batch:
    """The same sequences with the observation tokens left out (policy tokens packed left, same width)."""
    return Batch(**{**{k: getattr(batch, k) for k in Batch._TENSORS},
                    "mask": _exclude(batch.mask, keep), "gen_logp": _exclude(batch.gen_logp, keep),
                    "versions": _exclude(batch.versions, keep)}, completion_start=batch.completion_start)


def test_collate_masks_every_observation_token():
    batch, obs = _batch()
    assert bool(obs.any())
    assert not bool((batch.mask & obs).any())  # never trained on
    assert bool(batch.mask.sum() > 0)
    assert torch.equal(batch.gen_logp[obs], torch.zeros(int(obs.sum())))


def _check(loss: str, aggregation: str, correction: str, kl, seed: int = 0):
    batch, obs = _batch(seed)
    logp, ent, ref, batch = _inputs(batch, obs, seed)
    advantages = torch.linspace(-1.5, 1.2, len(batch), dtype=torch.float64)  # [B]
    value, g_logp, g_ent = _step(batch, advantages, aggregation, loss, correction, kl, logp, ent, ref)
    # 1. exactly zero on every observation position
    assert torch.equal(g_logp[obs], torch.zeros_like(g_logp[obs])), f"{loss}/{aggregation}/{correction}: logp grad leaks"
    assert torch.equal(g_ent[obs], torch.zeros_like(g_ent[obs])), f"{loss}/{aggregation}/{correction}: entropy grad leaks"
    # 2. the same as the sequences with the observations excluded
    keep = ~obs & (torch.arange(obs.shape[1])[None, :] < batch.num_tokens[:, None])  # [B, T] the policy's tokens
    ref_batch = _excluded_batch(batch, keep)
    value_x, g_logp_x, g_ent_x = _step(ref_batch, advantages, aggregation, loss, correction, kl,
                                       _exclude(logp, keep), _exclude(ent, keep), _exclude(ref, keep))
    assert abs(value - value_x) <= 1e-12 * max(1.0, abs(value_x)), (loss, aggregation, correction, value, value_x)
    torch.testing.assert_close(_exclude(g_logp, keep), g_logp_x, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(_exclude(g_ent, keep), g_ent_x, rtol=1e-12, atol=1e-15)
    assert bool(g_logp_x[ref_batch.mask].abs().sum() > 0) or loss in ("kl_cov", "clip_cov")  # the check is not vacuous


@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
@pytest.mark.parametrize("loss", LOSSES.names())
def test_observations_get_no_gradient_each_loss_and_aggregation(loss, aggregation):
    for correction in MISMATCH_CORRECTIONS.names():
        _check(loss, aggregation, correction, kl="k3")
        _check(loss, aggregation, correction, kl=None, seed=1)


@pytest.mark.parametrize("kl", KL_ESTIMATORS.names())
def test_observations_get_no_gradient_each_kl_estimator(kl):
    _check("cispo", "prompt_mean", "none", kl=kl, seed=2)


def test_model_level_hidden_state_before_an_observation_gets_no_gradient():
    """Through the learner's forward: the final hidden state whose head output predicts an observation token
    receives exactly zero gradient; the ones predicting policy tokens do not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.trainer.forward import pack_batch, sequence_logprobs_packed

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double()
    batch, obs = _batch(3)
    captured = {}

    def keep_grad(module, inputs, output):
        output.retain_grad()
        captured["h"] = output

    handle = model.model.norm.register_forward_hook(keep_grad)
    try:
        logp, entropy = sequence_logprobs_packed(model, pack_batch(batch), temperature=1.0, chunk_size=7,
                                                 with_entropy=True, entropy_grad=True)  # [B, T] each
        advantages = torch.linspace(-1.0, 1.0, len(batch))  # [B]
        weights = token_weights("token_mean", batch.mask, batch.group_ids)  # [B, T]
        fake = SimpleNamespace(loss_fn=LOSSES.get("cispo"), correction=resolve_correction("tis"),
                               kl_fn=None, device=torch.device("cpu"), cfg=SimpleNamespace(kl_coef=0.0, entropy_coef=0.01),
                               logprobs=lambda mb: (logp, entropy), reference_logprobs=None)
        Learner.backward(fake, MicroBatch(batch, advantages, weights), 1.0)
    finally:
        handle.remove()
    grad = captured["h"].grad[0]  # [N, H]: the packed row, sequences one after another
    # the packed row holds each sequence's prompt then completion; completion token j is predicted at j - 1
    prompts = batch.attention_mask[:, : batch.completion_start].sum(dim=1).tolist()
    start, checked = 0, 0
    for b, n in enumerate(batch.num_tokens.tolist()):
        p = int(prompts[b])
        for j in range(n):
            row = grad[start + p + j - 1]  # [H]
            if obs[b, j]:
                assert torch.equal(row, torch.zeros_like(row)), f"sequence {b}: hidden state before observation token {j}"
                checked += 1
            else:
                assert bool(row.abs().sum() > 0)
        start += p + n
    assert checked == int(obs.sum()) > 0
