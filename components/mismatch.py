"""Training-inference mismatch corrections (registry `MISMATCH_CORRECTIONS`, ``train.mismatch_correction``).

The generator samples token y_t and records its log-prob ``gen_logp`` with its own kernels, in the
generator's dtype of the precision policy, and (pipeline_rl, ppo_off_policy k > 1) possibly from
weights some versions old. The learner scores the same token with ``old_logp``. Even at the same
weights the two differ (bf16 rounding, other kernels: the "training-inference mismatch"). A
correction turns the pair into a per-token weight on the policy loss. Each is one pure function::

    correction(old_logp, gen_logp, mask, **hparams) -> weight   # [B, T] float, detached, 0 where mask is False

- old_logp [B, T]  log pi_learner_old(y_t): the learner's log-prob of the sampled token (see below)
- gen_logp [B, T]  log pi_gen(y_t): the generator's log-prob recorded at sampling time
- mask     [B, T]  bool, True on the completion tokens that are trained on

What "old" means, and what it costs
-----------------------------------
pi_learner_old is the learner's policy under its CURRENT weights before this step's update, computed
in the learner's precision context (`Learner.compute_context`), as verl (``old_log_prob``, recomputed by
the actor) and TRL (``old_per_token_logps``) define it. Under ppo_off_policy k = 1 these are the very
weights that generated the batch (the ratio is the pure kernel mismatch). For a stale batch
(ppo_off_policy k > 1, pipeline_rl) it is the proximal policy of decoupled PPO, so the ratio folds the
staleness in too. Without a correction, the losses take their ratio against gen_logp, as they always
have (components/losses.py: the paper's pi_gen(theta_old)).

This learner makes exactly ONE optimizer update per step batch (every micro-batch's gradient is
accumulated, then one AdamW step; ppo_off_policy(k) trains k DIFFERENT mini-batches, one update each).
The weights before the update are therefore the weights of the step's own forward pass, and old_logp
is that forward's log-prob, detached (``logp.detach()``), equal to what a separate no-grad forward
over the step's micro-batches would give (tests/test_mismatch.py checks this bit for bit, in fp32 and in
emulated bf16). verl and TRL pay for that extra forward, about 1/3 of a step's compute, because they make
several updates per batch or compute the weights before their training loop. Here it would change no
number, so it is not run. (Should a device's kernels ever differ between a grad and a no-grad forward,
the forward whose gradient is taken is the one that defines pi_old.) A correction costs a few
elementwise operations per token, and the learner step time of none, tis and mis is the same within
noise (BENCHMARKS.md "Mismatch corrections", which also measures what the extra forward would have
cost). When the learner makes several updates per batch (``train.update_epochs`` or ``train.mini_batches``
> 1), old_logp comes from one no-grad forward before the first of them (`Learner.fix_old_logprobs`), fixed
for the whole step, and counted in the FLOPs as one more forward.

How the weight enters the loss (decoupled PPO)
----------------------------------------------
With a correction on, the per-token loss of a step is (`policy_loss`)::

    loss(logp, old_logp, A, mask) * w(old_logp, gen_logp, mask)           # [B, T]

The loss's own ratio is taken against the proximal policy pi_old, not the generator, and w alone carries
the generator-learner mismatch. verl does the same (pg_losses with ratio exp(log_prob - old_log_prob),
times rollout_is_weights), and so does TRL (coef_1 against old_per_token_logps, times
importance_sampling_ratio). If w multiplied today's loss, whose ratio is against pi_gen, the mismatch
would be counted twice: at the update point rho = pi_old/pi_gen and w = min(pi_old/pi_gen, cap) give
about rho^2. Because old_logp = sg(logp), the loss's ratio is exp(logp - sg(logp)) = 1, with gradient
d logp. Every built-in loss (grpo, dapo, cispo, gspo, ppo_dual_clip, icepop) then becomes REINFORCE
weighted by w, -w * A * d logp. Its clip (a trust region around pi_old that a single update starts
inside) is inactive, and the correction's truncation or masking is what limits the step against the
generator. ``none`` calls the loss exactly as before, with its ratio against gen_logp: the same step,
bit for bit, with no extra work in the backward.

The aggregation's normalisers (token counts per sequence or prompt) are fixed on the whole step batch
before any forward (`learner.plan_step`). A token whose weight is 0 therefore still counts in them, as
with the `icepop` loss. verl's mask mode instead drops rejected tokens from the denominator.

The corrections
---------------
With log r_t = old_logp - gen_logp (r_t = pi_old / pi_gen per token) and, for a sequence,
log S = sum over its trained tokens of log r_t (S = pi_old(y|x) / pi_gen(y|x)):

- ``none``: w = 1 on trained tokens (only the metrics call it; the loss stays today's).
- ``tis(cap=2.0)``: w = min(r_t, cap). Token-level truncated IS: verl ``rollout_is`` token/truncate,
  TRL ``vllm_importance_sampling_cap``, SkyRL ``tis_imp_ratio_cap``.
- ``mis(low=0.5, high=2.0)``: w = r_t where low <= r_t <= high, else 0. Masked IS: the IS weight where
  the ratio is plausible, the token rejected otherwise. This is verl's token/mask mode (true ratios
  times the rejection mask) and IcePop's masking.
- ``seq_tis(cap=2.0)``: w = min(S, cap) on every trained token of the sequence.
- ``seq_mis(low=0.5, high=2.0)``: w = S on every trained token of a sequence with low <= S <= high,
  else 0 for the whole sequence.

The sequence ratio is the PRODUCT of the token ratios, which is verl's "sequence" level (verl calls the
geometric mean (prod r_t)^(1/|y|) its "geometric" level). The product is the importance ratio of the
sequence that was actually sampled, so min(S, cap) is truncated IS in the usual sense, unbiased for the
sequence-level gradient where S <= cap. The geometric mean is not the ratio of any two distributions
(its mean under pi_gen is not 1). The cost is variance that grows with length: log S is a sum of |y|
per-token mismatches, so long sequences hit the cap or leave [low, high] more often. seq_mis's
rejections are length-biased (the "length trap" that motivates verl's geometric rejection). The ratios
are formed in log space; S may overflow to inf (then truncated to cap, or rejected) and never becomes NaN.

Metrics (``learner.finish_stats``)
----------------------------------
Every step logs these metrics, whatever the correction, because they need only old_logp and the step's
forward gives it for free:

- ``mismatch_kl``: the k3 estimate of KL(pi_gen || pi_old) over trained tokens (masked mean):
  k3 = r - 1 - log r with log r = old_logp - gen_logp. The tokens are samples of pi_gen, and
  E_gen[r] = 1 for r = pi_old/pi_gen, so E_gen[k3] = E_gen[-log r] = KL(pi_gen || pi_old). Each term is
  >= 0 (x - 1 - log x >= 0). This is verl's ``mismatch_k3_kl``. The opposite ratio, log r = gen - old,
  would give a biased estimate under pi_gen's samples.
- ``mismatch_masked_frac``: the fraction of trained tokens whose weight is 0 (always 0 for none and tis,
  barring an underflow).
- ``mismatch_truncated_frac`` (tis, seq_tis; from their diagnostics hook): the fraction of trained tokens
  whose ratio (r_t, or its sequence's S) exceeds the cap.

A user's correction registers like a shipped one and may report metrics of its own through
``MISMATCH_CORRECTIONS.register(name, diagnostics=fn)``, where ``fn(old_logp, gen_logp, mask, **hparams)``
returns ``{metric: float}``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from components.registry import MISMATCH_CORRECTIONS

__all__ = ["NONE", "none", "tis", "mis", "seq_tis", "seq_mis", "resolve_correction", "policy_loss",
           "mismatch_stats", "token_log_ratio", "sequence_log_ratio", "k3"]

NONE = "none"


# ---------------------------------------------------------------------------------------
# shared pieces
def token_log_ratio(old_logp: Tensor, gen_logp: Tensor, mask: Tensor) -> Tensor:
    """log r_t = old_logp - gen_logp on trained tokens, 0 elsewhere (no NaN from padding).  [B, T]"""
    diff = old_logp.detach() - gen_logp.detach()  # [B, T]
    return torch.where(mask, diff, torch.zeros_like(diff))  # [B, T]


def sequence_log_ratio(old_logp: Tensor, gen_logp: Tensor, mask: Tensor) -> Tensor:
    """log S = sum of log r_t over each sequence's trained tokens (the product's log).  [B]"""
    return token_log_ratio(old_logp, gen_logp, mask).sum(dim=1)  # [B]


def _on_trained(weight: Tensor, mask: Tensor) -> Tensor:
    """`weight` on trained tokens, exactly 0 elsewhere.  [B, T]"""
    return torch.where(mask, weight, torch.zeros_like(weight))  # [B, T]


def _kept(ratio: Tensor, low: float, high: float) -> Tensor:
    """ratio where low <= ratio <= high, else 0 (inf: rejected).  same shape"""
    keep = (ratio >= low) & (ratio <= high)  # same shape, bool
    return torch.where(keep, ratio, torch.zeros_like(ratio))


def k3(old_logp: Tensor, gen_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 = r - 1 - log r with log r = old_logp - gen_logp, in float64.  [B, T]

    Over tokens sampled from pi_gen, E[k3] = KL(pi_gen || pi_old) (module docstring, "Metrics")."""
    log_r = token_log_ratio(old_logp.double(), gen_logp.double(), mask)  # [B, T]
    return torch.exp(log_r) - 1.0 - log_r  # [B, T], 0 on padding


# ---------------------------------------------------------------------------------------
# diagnostics hooks (registered with their corrections below)
def _frac(flags: Tensor, mask: Tensor) -> float:
    return float((flags & mask).sum()) / max(int(mask.sum()), 1)


def tis_diagnostics(old_logp: Tensor, gen_logp: Tensor, mask: Tensor, *, cap: float = 2.0) -> dict:
    ratio = torch.exp(token_log_ratio(old_logp, gen_logp, mask))  # [B, T]
    return {"mismatch_truncated_frac": _frac(ratio > cap, mask)}


def seq_tis_diagnostics(old_logp: Tensor, gen_logp: Tensor, mask: Tensor, *, cap: float = 2.0) -> dict:
    seq_ratio = torch.exp(sequence_log_ratio(old_logp, gen_logp, mask))  # [B]
    return {"mismatch_truncated_frac": _frac((seq_ratio > cap)[:, None].expand_as(mask), mask)}


# ---------------------------------------------------------------------------------------
# the corrections
@MISMATCH_CORRECTIONS.register(NONE, gin_configurable=False)  # no parameter; keeps `none.eps` (advantages) unambiguous
def none(old_logp: Tensor, gen_logp: Tensor, mask: Tensor) -> Tensor:
    """No correction: weight 1 (the learner keeps today's loss, ratio against the generator, and never calls this)."""
    return mask.to(old_logp.dtype)  # [B, T]


# a cap < 1 would down-weight on-policy tokens (ratio 1)
@MISMATCH_CORRECTIONS.register("tis", ranges={"cap": ">= 1"}, diagnostics=tis_diagnostics)
def tis(old_logp: Tensor, gen_logp: Tensor, mask: Tensor, *, cap: float = 2.0) -> Tensor:
    """Token-level truncated IS: w = min(pi_old / pi_gen, cap)."""
    ratio = torch.exp(token_log_ratio(old_logp, gen_logp, mask))  # [B, T]  (inf -> cap)
    return _on_trained(torch.clamp(ratio, max=cap), mask)  # [B, T]


@MISMATCH_CORRECTIONS.register("mis", ranges={"low": "[0, 1]", "high": ">= 1"})  # [low, high] must hold ratio 1
def mis(old_logp: Tensor, gen_logp: Tensor, mask: Tensor, *, low: float = 0.5, high: float = 2.0) -> Tensor:
    """Token-level masked IS: w = pi_old / pi_gen inside [low, high], 0 (token rejected) outside."""
    ratio = torch.exp(token_log_ratio(old_logp, gen_logp, mask))  # [B, T]
    return _on_trained(_kept(ratio, low, high), mask)  # [B, T]


@MISMATCH_CORRECTIONS.register("seq_tis", ranges={"cap": ">= 1"}, diagnostics=seq_tis_diagnostics)
def seq_tis(old_logp: Tensor, gen_logp: Tensor, mask: Tensor, *, cap: float = 2.0) -> Tensor:
    """Sequence-level truncated IS: w = min(prod_t pi_old / pi_gen, cap) on every trained token of the sequence."""
    seq_ratio = torch.exp(sequence_log_ratio(old_logp, gen_logp, mask))  # [B]  (inf -> cap)
    weight = torch.clamp(seq_ratio, max=cap)[:, None].expand_as(old_logp)  # [B, T]
    return _on_trained(weight, mask)  # [B, T]


@MISMATCH_CORRECTIONS.register("seq_mis", ranges={"low": "[0, 1]", "high": ">= 1"})
def seq_mis(old_logp: Tensor, gen_logp: Tensor, mask: Tensor, *, low: float = 0.5, high: float = 2.0) -> Tensor:
    """Sequence-level masked IS: w = prod_t pi_old / pi_gen if inside [low, high], else the whole sequence gets 0."""
    seq_ratio = torch.exp(sequence_log_ratio(old_logp, gen_logp, mask))  # [B]
    weight = _kept(seq_ratio, low, high)[:, None].expand_as(old_logp)  # [B, T]
    return _on_trained(weight, mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# the learner's side
def resolve_correction(name: str, params: Optional[Mapping[str, Any]] = None) -> Optional[Callable]:
    """The registered correction `name` with its hyper-parameters `params` (the run's; None: as gin
    configures it, `Registry.build`), or None for ``none`` (today's loss, untouched)."""
    fn = MISMATCH_CORRECTIONS.build(name, params)  # an unknown name: the registry's error, with a did-you-mean
    return None if name == NONE else fn


def policy_loss(loss_fn: Callable, correction: Optional[Callable], logp: Tensor, gen_logp: Tensor,
                advantages: Tensor, mask: Tensor, old_logp: Optional[Tensor] = None) -> Tensor:
    """The step's per-token policy loss.  [B, T]

    correction None: ``loss_fn(logp, gen_logp, A, mask)``, today's loss. Otherwise the decoupled
    form ``loss_fn(logp, old_logp, A, mask) * w(old_logp, gen_logp, mask)`` with old_logp = sg(logp), the
    learner's log-probs under the weights this step updates (module docstring), unless `old_logp` [B, T]
    gives pi_old fixed before the step's first update (train.update_epochs / train.mini_batches: several
    updates per batch, components/trainer/learner.py "Update epochs").
    """
    if correction is None:
        return loss_fn(logp, gen_logp, advantages, mask)  # [B, T]
    old_logp = logp.detach() if old_logp is None else old_logp.detach()  # [B, T]  pi_old: the pre-update weights
    weight = correction(old_logp, gen_logp.detach(), mask).detach()  # [B, T]
    return loss_fn(logp, old_logp, advantages, mask) * weight  # [B, T]


@torch.no_grad()
def mismatch_stats(name: str, old_logp: Tensor, gen_logp: Tensor, mask: Tensor,
                   params: Optional[Mapping[str, Any]] = None) -> dict:
    """The step's mismatch metrics over its trained tokens (module docstring, "Metrics"):
    mismatch_kl, mismatch_masked_frac, plus what the correction's diagnostics hook reports
    (the correction and its hook get the hyper-parameters `params`, the run's resolved values;
    a parameter `params` lacks keeps its default)."""
    n = int(mask.sum())
    if n == 0:
        return {"mismatch_kl": math.nan, "mismatch_masked_frac": math.nan}
    params = {**MISMATCH_CORRECTIONS.defaults(name), **dict(params or {})}
    weight = MISMATCH_CORRECTIONS.build(name, params)(old_logp, gen_logp, mask)  # [B, T]
    out = {
        "mismatch_kl": float(k3(old_logp, gen_logp, mask)[mask].mean()),
        "mismatch_masked_frac": _frac(weight == 0, mask),
    }
    hook = MISMATCH_CORRECTIONS.diagnostics_of(name)
    if hook is not None:
        reported = hook(old_logp, gen_logp, mask, **params)
        out.update({str(k): float(v) for k, v in dict(reported or {}).items()})
    return out
