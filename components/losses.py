"""Per-token policy losses (registry `LOSSES`).

Every loss has one signature (DESIGN.md "Math contracts")::

    loss(logp, gen_logp, advantages, mask, **hparams) -> per_token_loss   # [B, T]

- logp       [B, T]  trainer log-prob of each sampled token (carries grad)
- gen_logp   [B, T]  generator log-prob recorded at sampling time (no grad): the paper's
                     pi_gen(theta_old), folding staleness and kernel mismatch together
- advantages [B]     one per sequence, already normalised
- mask       [B, T]  bool, True on completion tokens that are trained on

The result is the LOSS to minimise (the negative objective), exactly 0 where mask is False.
Aggregation (components/aggregation.py) turns it into a scalar.

Token ratio rho[b, t] = exp(logp - gen_logp). Per-loss diagnostics (clip fraction, IS ratio
stats) come from `loss_diagnostics`, never from a changed loss signature. A loss reports its
own diagnostics through the hook registered with it::

    @LOSSES.register("cispo", diagnostics=cispo_diagnostics)

    cispo_diagnostics(logp, gen_logp, advantages, mask, **hparams) -> {"clip_frac": float, ...}

called with the same hyper-parameters the loss gets (its registry entry's defaults and gin
bindings). ``clip_frac`` is the fraction of trained tokens whose gradient the loss clips
(zeroes) or whose importance weight it truncates; any other key is reported as a metric too.

Losses added in 2026 (`sapo`, `gmpo`, `clip_cov`, `kl_cov`; the table in docs/adding_a_loss.md
lists their sources). `clip_cov` and `kl_cov` choose tokens by a covariance taken over the tokens
they are GIVEN: the learner calls a loss once per micro-batch (`Learner.backward`: the rows of one
micro-batch of one rank, `train.micro_batch_size` sequences or `train.max_tokens_per_micro_batch`
tokens), so their statistics are per micro-batch, as in verl and in the authors' code, and equal to
the whole-batch ones only when a step is one micro-batch on one rank (their docstrings say more).
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.registry import LOSSES

__all__ = ["grpo", "dapo", "cispo", "gspo", "ppo_dual_clip", "icepop", "dppo", "sapo", "gmpo", "clip_cov", "kl_cov",
           "loss_diagnostics", "token_ratio", "token_covariance", "STANDARD_DIAGNOSTICS"]

# ---------------------------------------------------------------------------------------
# shared pieces
def token_ratio(logp: Tensor, gen_logp: Tensor) -> Tensor:
    """rho = pi_train / pi_gen per token.  [B, T]"""
    return torch.exp(logp - gen_logp.detach())  # [B, T]


def _sanitize(logp: Tensor, gen_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Zero padding positions so garbage there (even -inf) cannot produce NaN gradients."""
    zeros = torch.zeros_like(logp)
    return torch.where(mask, logp, zeros), torch.where(mask, gen_logp.detach(), zeros)  # [B, T] each


def _masked(loss: Tensor, mask: Tensor) -> Tensor:
    # torch.where (not multiplication) so inf/nan on padding never leaks into the sum or grad
    return torch.where(mask, loss, torch.zeros_like(loss))  # [B, T]


def _clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> Tensor:
    """-min(rho*A, clip(rho, low, high)*A): the PPO clipped surrogate, as a loss.  [B, T]"""
    unclipped = ratio * adv  # [B, T]
    clipped = torch.clamp(ratio, low, high) * adv  # [B, T]
    return -torch.minimum(unclipped, clipped)  # [B, T]


def _ppo_clip_active(ratio: Tensor, adv: Tensor, low: float, high: float) -> Tensor:
    """Where the min picks the clipped branch with a constant value (zero gradient).  [B, T] bool"""
    return ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))


def _clip_frac(clipped: Tensor, mask: Tensor, ratio: Tensor | None = None) -> dict:
    """{"clip_frac": fraction of the trained tokens in the bool [B, T] `clipped`}; with the [B, T]
    `ratio` the clip acts on, also the two sides: "clip_frac_low" (clipped where ratio < 1, the
    1 − ε_low side) and "clip_frac_high" (ratio >= 1, the 1 + ε_high side), summing to clip_frac."""
    n = max(int(mask.sum()), 1)
    hit = clipped & mask  # [B, T]
    out = {"clip_frac": float(hit.sum()) / n}
    if ratio is not None:
        low = hit & (ratio < 1.0)  # [B, T]
        out["clip_frac_low"] = float(low.sum()) / n
        out["clip_frac_high"] = float((hit & ~low).sum()) / n
    return out


# diagnostics hooks (registered with their losses below): the tokens each loss clips
def grpo_diagnostics(logp, gen_logp, advantages, mask, *, eps=0.2) -> dict:
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    return _clip_frac(_ppo_clip_active(ratio, advantages[:, None], 1.0 - eps, 1.0 + eps), mask, ratio)


def dapo_diagnostics(logp, gen_logp, advantages, mask, *, eps_low=0.2, eps_high=0.28) -> dict:
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    return _clip_frac(_ppo_clip_active(ratio, advantages[:, None], 1.0 - eps_low, 1.0 + eps_high), mask, ratio)


def cispo_diagnostics(logp, gen_logp, advantages, mask, *, eps_max=4.0) -> dict:
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    return _clip_frac(ratio > eps_max, mask, ratio)


def gspo_diagnostics(logp, gen_logp, advantages, mask, *, eps_low=3e-3, eps_high=5e-3) -> dict:
    seq_ratio = _sequence_ratio(logp, gen_logp, mask)[:, None].expand_as(logp)  # [B, T]
    return _clip_frac(_ppo_clip_active(seq_ratio, advantages[:, None], 1.0 - eps_low, 1.0 + eps_high), mask, seq_ratio)


def ppo_dual_clip_diagnostics(logp, gen_logp, advantages, mask, *, eps_low=0.2, eps_high=0.2, dual_clip=3.0) -> dict:
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    adv = advantages[:, None]
    return _clip_frac(_ppo_clip_active(ratio, adv, 1.0 - eps_low, 1.0 + eps_high) | ((adv < 0) & (ratio > dual_clip)),
                      mask, ratio)


def icepop_diagnostics(logp, gen_logp, advantages, mask, *, low=0.5, high=2.0) -> dict:
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    return _clip_frac((ratio < low) | (ratio > high), mask, ratio)


def dppo_diagnostics(logp, gen_logp, advantages, mask, *, delta_low=0.2, delta_high=0.2, kl_tau=0.0) -> dict:
    return _clip_frac(_dppo_outside(logp, gen_logp, advantages, delta_low, delta_high), mask, token_ratio(logp, gen_logp))


# ---------------------------------------------------------------------------------------
# GRPO (DeepSeekMath; ScaleRL Eq. 7 without KL): symmetric token-level clip
@LOSSES.register("grpo", ranges={"eps": "[0, 1)"}, diagnostics=grpo_diagnostics)  # the low clip 1 - eps must stay > 0
def grpo(logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps: float = 0.2) -> Tensor:
    """GRPO clipped surrogate, symmetric clip [1-eps, 1+eps], no KL term."""
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    return _masked(_clipped_surrogate(ratio, adv, 1.0 - eps, 1.0 + eps), mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# DAPO: asymmetric "clip-higher" [1-eps_low, 1+eps_high]
@LOSSES.register("dapo", ranges={"eps_low": "[0, 1)", "eps_high": ">= 0"}, diagnostics=dapo_diagnostics)
def dapo(
    logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps_low: float = 0.2, eps_high: float = 0.28
) -> Tensor:
    """DAPO clipped surrogate with clip-higher (eps_low, eps_high), token-level ratio, no KL."""
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    return _masked(_clipped_surrogate(ratio, adv, 1.0 - eps_low, 1.0 + eps_high), mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# CISPO (MiniMax-M1), ScaleRL Eq. 4 form: sg(min(rho, eps_max)) * A * log pi
@LOSSES.register("cispo", ranges={"eps_max": "> 0"}, diagnostics=cispo_diagnostics)  # a cap <= 0 flips or zeroes the gradient
def cispo(logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps_max: float = 4.0) -> Tensor:
    """CISPO: truncated IS weight sg(min(rho, eps_max)) times A times log-prob (absolute cap, ScaleRL Eq. 4)."""
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    weight = torch.clamp(ratio, max=eps_max).detach()  # [B, T]  no gradient through the weight
    return _masked(-weight * advantages[:, None] * logp, mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# GSPO (Qwen), GSPO-token form with the length-normalised sequence ratio
def _sequence_ratio(logp: Tensor, gen_logp: Tensor, mask: Tensor) -> Tensor:
    """s_i = exp(mean over the sequence's tokens of log rho), the geometric-mean ratio.  [B]"""
    log_ratio = torch.where(mask, logp - gen_logp.detach(), torch.zeros_like(logp))  # [B, T]
    lengths = mask.sum(dim=1).clamp(min=1)  # [B]
    return torch.exp(log_ratio.sum(dim=1) / lengths)  # [B]


@LOSSES.register("gspo", ranges={"eps_low": "[0, 1)", "eps_high": ">= 0"}, diagnostics=gspo_diagnostics)
def gspo(
    logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps_low: float = 3e-3, eps_high: float = 5e-3
) -> Tensor:
    """GSPO-token: s_it = sg(s_i) * pi/sg(pi), clipped at sequence level; sample_mean gives GSPO exactly."""
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    seq_ratio = _sequence_ratio(logp, gen_logp, mask).detach()  # [B]
    token_ratio_ = seq_ratio[:, None] * torch.exp(logp - logp.detach())  # [B, T]  == s_i, grad s_i * dlogp
    adv = advantages[:, None]  # [B, 1]
    return _masked(_clipped_surrogate(token_ratio_, adv, 1.0 - eps_low, 1.0 + eps_high), mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# Extras beyond the paper's four
@LOSSES.register("ppo_dual_clip", ranges={"eps_low": "[0, 1)", "eps_high": ">= 0", "dual_clip": "> 1"},
                 diagnostics=ppo_dual_clip_diagnostics)
def ppo_dual_clip(
    logp: Tensor,
    gen_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float = 3.0,
) -> Tensor:
    """PPO-clip with dual clip (Ye et al. 2020): for A<0 the loss is also capped at -dual_clip*A."""
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    if dual_clip <= 1.0:
        raise ValueError(f"ppo_dual_clip: dual_clip must be > 1.0, got {dual_clip}")
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    adv = advantages[:, None].expand_as(ratio)  # [B, T]
    loss = _clipped_surrogate(ratio, adv, 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    capped = torch.minimum(loss, -dual_clip * adv)  # [B, T]
    return _masked(torch.where(adv < 0, capped, loss), mask)  # [B, T]


@LOSSES.register("icepop", ranges={"low": ">= 0", "high": "> 0"}, diagnostics=icepop_diagnostics)
def icepop(
    logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, *, low: float = 0.5, high: float = 2.0
) -> Tensor:
    """IcePop-style masked IS policy gradient: sg(rho)*A*log pi, zero gradient where rho is outside [low, high]."""
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    ratio = token_ratio(logp, gen_logp).detach()  # [B, T]
    keep = (ratio >= low) & (ratio <= high)  # [B, T]
    weight = torch.where(keep, ratio, torch.zeros_like(ratio))  # [B, T]
    return _masked(-weight * advantages[:, None] * logp, mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879):
# a trust region by a divergence bound on the sampled token, not by ratio clipping; prime-rl's default loss
def _dppo_outside(logp: Tensor, gen_logp: Tensor, advantages: Tensor, delta_low: float, delta_high: float) -> Tensor:
    """Where DPPO-Binary-TV masks a token: the sampled token's probability moved past the trust region
    in the direction its advantage pushes it (pi - mu > delta_high with A > 0, < -delta_low with A < 0).  [B, T] bool"""
    diff = torch.exp(logp.detach()) - torch.exp(gen_logp.detach())  # [B, T]: pi(y_t) - mu(y_t)
    adv = advantages[:, None]  # [B, 1]
    return ((adv > 0) & (diff > delta_high)) | ((adv < 0) & (diff < -delta_low))  # [B, T]


@LOSSES.register("dppo", ranges={"delta_low": ">= 0", "delta_high": ">= 0", "kl_tau": ">= 0"},
                 diagnostics=dppo_diagnostics)
def dppo(
    logp: Tensor,
    gen_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    kl_tau: float = 0.0,
) -> Tensor:
    """DPPO-Binary-TV: -M * rho * A, M = 0 where the token's probability left the TV trust region (+ kl_tau * log^2 rho).

    Per token, with rho = pi / mu (mu = the generator's pi_gen, `gen_logp`) and the total variation
    of the binary distribution {sampled token, any other token}, D_TV = |pi(y_t) - mu(y_t)|::

        loss_t = -M_t * rho_t * A + kl_tau * (log rho_t)^2
        M_t    = 0  if (A > 0 and pi(y_t) - mu(y_t) > delta_high) or (A < 0 and pi(y_t) - mu(y_t) < -delta_low)
                 1  otherwise

    Sources: the DPPO objective with its Binary-TV approximation (arXiv 2602.04879: the masked
    surrogate M_t * r_t * A_t, M_t = 0 when the update leaves the divergence bound in the
    advantage's direction; sail-sg/Stable-RL `dppo_tv`), and prime-rl's default loss
    (src/prime_rl/trainer/rl/loss.py `default_loss_fn`, docs/algorithms.md "Default RL Loss":
    `dppo_mask_low` = `dppo_mask_high` = 0.2, the mask on pi - mu, the un-truncated ratio, plus
    `kl_tau` (1e-3 there) times the squared log-ratio on every trained token, after Kimi-K2.5).
    kl_tau = 0 (the default) is the paper's DPPO; kl_tau = 1e-3 is prime-rl's default loss.
    The mask carries no gradient, so d loss_t / d log pi = -M_t * rho_t * A + 2 kl_tau log rho_t.

    Differences: the paper's Top-K divergence approximation needs the top-K probabilities of both
    policies, which this signature (sampled-token log-probs only) does not carry, so it is not here;
    prime-rl's advantages are per token, ours one per sequence (the same for outcome rewards); how the
    per-token loss is summed is the run's aggregation (prime-rl sums over tokens / token count).
    """
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    keep = ~_dppo_outside(logp, gen_logp, advantages, delta_low, delta_high)  # [B, T]
    surrogate = torch.where(keep, ratio * advantages[:, None], torch.zeros_like(ratio))  # [B, T]
    log_ratio = logp - gen_logp  # [B, T]
    return _masked(-surrogate + kl_tau * log_ratio.square(), mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# Losses added in 2026
#
# SAPO (Gao et al. 2025, Qwen, "Soft Adaptive Policy Optimization", arXiv 2511.20347)
_SAPO_LOG_RATIO_CAP = 20.0  # |log rho| is capped here (as verl does): exp stays finite, the gate is flat there


def _sapo_gate(logp: Tensor, gen_logp: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> tuple[Tensor, Tensor]:
    """(sigma, tau): sigma = sigmoid(tau (rho - 1)), tau = tau_pos where A > 0 else tau_neg.  [B, T], [B, 1]"""
    log_ratio = (logp - gen_logp.detach()).clamp(-_SAPO_LOG_RATIO_CAP, _SAPO_LOG_RATIO_CAP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))  # [B, 1]
    return torch.sigmoid(tau * (ratio - 1.0)), tau  # [B, T], [B, 1]


def sapo_diagnostics(logp, gen_logp, advantages, mask, *, tau_pos=1.0, tau_neg=1.05) -> dict:
    """clip_frac: the tokens whose gradient the soft gate at least halves (weight 4 s (1 - s) < 1/2);
    sapo_gate_weight_mean: the mean of that weight over the trained tokens (1 = the plain policy gradient)."""
    sigma, _ = _sapo_gate(logp, gen_logp, advantages, tau_pos, tau_neg)  # [B, T]
    weight = 4.0 * sigma * (1.0 - sigma)  # [B, T]
    out = _clip_frac(weight < 0.5, mask, token_ratio(logp, gen_logp))
    out["sapo_gate_weight_mean"] = float(weight[mask].mean()) if bool(mask.any()) else float("nan")
    return out


@LOSSES.register("sapo", ranges={"tau_pos": "> 0", "tau_neg": "> 0"}, diagnostics=sapo_diagnostics)
def sapo(
    logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, *, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> Tensor:
    """SAPO: a smooth sigmoid gate f(rho) = (4 / tau) sigmoid(tau (rho - 1)) in place of the hard clip.

    Per token, with rho = pi / pi_gen and tau = tau_pos where A > 0, else tau_neg::

        loss_t = -(4 / tau) * sigmoid(tau * (rho_t - 1)) * A
        d loss_t / d log pi = -w_t * rho_t * A,   w_t = 4 s (1 - s) = sech^2(tau (rho_t - 1) / 2),  s = sigmoid(tau (rho_t - 1))

    so the gradient is the plain policy gradient's (rho A) times a weight that is 1 on-policy and
    decays smoothly as rho leaves 1; the larger tau, the faster (tau_neg > tau_pos damps negative
    updates more). The value on-policy is -2 A / tau, not -A (a constant: no gradient). The paper
    averages tokens per sequence, then over sequences: `sample_mean` gives its objective exactly.

    Sources: Gao et al. 2025 (Qwen), "Soft Adaptive Policy Optimization", arXiv 2511.20347 (the
    gate, the gradient weight, tau_pos = 1.0, tau_neg = 1.05). Peers checked: verl core_algos.py
    `compute_policy_loss_sapo` (which also caps |log rho| at 20, as here: beyond it the gate is
    flat and exp would overflow) and TRL GRPOTrainer ``loss_type="sapo"``
    (``sapo_temperature_pos`` / ``sapo_temperature_neg``).
    """
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    sigma, tau = _sapo_gate(logp, gen_logp, advantages, tau_pos, tau_neg)  # [B, T], [B, 1]
    gate = sigma * (4.0 / tau)  # [B, T]
    return _masked(-gate * advantages[:, None], mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673)
def _gmpo_log_ratio(logp: Tensor, gen_logp: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """The pessimistically clipped log-ratio sgn(A) min(sgn(A) l, sgn(A) clip(l, -eps_low, eps_high)), l = log rho.  [B, T]"""
    log_ratio = logp - gen_logp.detach()  # [B, T]
    sign = torch.sign(advantages)[:, None]  # [B, 1]
    clipped = log_ratio.clamp(-eps_low, eps_high)  # [B, T]
    return sign * torch.minimum(sign * log_ratio, sign * clipped)  # [B, T]


def _gmpo_clip_active(logp: Tensor, gen_logp: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """Where GMPO's min takes the clipped (constant) branch: A > 0 and l > eps_high, or A < 0 and l < -eps_low.  [B, T] bool"""
    log_ratio = logp - gen_logp  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    return ((adv > 0) & (log_ratio > eps_high)) | ((adv < 0) & (log_ratio < -eps_low))  # [B, T]


def gmpo_diagnostics(logp, gen_logp, advantages, mask, *, eps_low=0.4, eps_high=0.4) -> dict:
    return _clip_frac(_gmpo_clip_active(logp, gen_logp, advantages, eps_low, eps_high), mask, token_ratio(logp, gen_logp))


@LOSSES.register("gmpo", ranges={"eps_low": ">= 0", "eps_high": ">= 0"}, diagnostics=gmpo_diagnostics)
def gmpo(
    logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps_low: float = 0.4, eps_high: float = 0.4
) -> Tensor:
    """GMPO-token: the geometric mean of the token ratios, clipped per token in log space; sample_mean gives GMPO exactly.

    Sequence objective (the paper's), with l_t = log rho_t and the clip range (e^-eps_low, e^eps_high)::

        J_i = A_i * S_i,   S_i = exp( (1/|o_i|) sum_t lt_t ),   lt_t = sgn(A_i) min(sgn(A_i) l_t, sgn(A_i) clip(l_t, -eps_low, eps_high))

    i.e. sgn(A) (prod_t |min(rho_t A, clip(rho_t) A)|)^(1/|o_i|), the PPO min taken per token before
    the geometric mean. Per token this returns -A_i sg(S_i) exp(lt_t - sg(lt_t)): value -A_i S_i on
    every token of the sequence and d/d log pi_t = -A_i S_i [t unclipped], so `sample_mean` (mean over
    sequences of the per-token mean) is exactly -(1/B) sum_i J_i and its gradient (as GSPO-token does
    for GSPO). Clipped tokens (A > 0 and l_t > eps_high, A < 0 and l_t < -eps_low) get no gradient.

    Sources: Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673 (objective
    and the default range (e^-0.4, e^0.4)); the authors' code (callsys/GMPO train_zero_math_gmpo.py,
    CLIPRANGE = 0.4). Peer checked: verl core_algos.py `compute_policy_loss_geo_mean` (``geo_mean``:
    the same signed min in log space, clamp(l, -clip_ratio_low, clip_ratio_high), the per-sequence
    loss -A exp(mean) averaged over sequences).
    """
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    clipped = _gmpo_log_ratio(logp, gen_logp, advantages, eps_low, eps_high)  # [B, T]
    lengths = mask.sum(dim=1).clamp(min=1)  # [B]
    seq_ratio = torch.exp(torch.where(mask, clipped, torch.zeros_like(clipped)).sum(dim=1) / lengths).detach()  # [B]
    token_ratio_ = seq_ratio[:, None] * torch.exp(clipped - clipped.detach())  # [B, T]  == S_i, grad S_i * d lt
    return _masked(-advantages[:, None] * token_ratio_, mask)  # [B, T]


# ---------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
# Reasoning Language Models", arXiv 2505.22617): act on the few tokens whose log-prob covaries most
# with their advantage (the tokens that drive the entropy down)
def token_covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Cov_t = (log pi_t - mean log pi) (A_t - mean A), both means over the masked tokens GIVEN (no grad).  [B, T]

    A_t is the sequence's advantage on each of its tokens, so mean A is token-weighted. With no
    masked token the result is all zeros.
    """
    lp = logp.detach()  # [B, T]
    adv = advantages.detach()[:, None].expand_as(lp)  # [B, T]
    n = mask.sum().clamp(min=1)  # []
    mean_lp = torch.where(mask, lp, torch.zeros_like(lp)).sum() / n  # []
    mean_adv = torch.where(mask, adv, torch.zeros_like(adv)).sum() / n  # []
    cov = (lp - mean_lp) * (adv - mean_adv)  # [B, T]
    return torch.where(mask, cov, torch.zeros_like(cov))  # [B, T]


def _cov_token_count(ratio: float, mask: Tensor) -> int:
    """How many tokens a covariance loss acts on among the masked ones: max(floor(ratio * N), 1), 0 when N = 0."""
    n = int(mask.sum())
    return max(int(ratio * n), 1) if n > 0 else 0


def _clip_cov_candidates(logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
                         eps_high: float, cov_lb: float, cov_ub: float) -> tuple[Tensor, Tensor]:
    """(PPO-clipped tokens, Clip-Cov's candidates: trained, not PPO-clipped, cov_lb < Cov < cov_ub).  [B, T] bool each"""
    ratio = token_ratio(logp, gen_logp)  # [B, T]
    ppo_clipped = _ppo_clip_active(ratio, advantages[:, None], 1.0 - eps_low, 1.0 + eps_high) & mask  # [B, T]
    cov = token_covariance(logp, advantages, mask)  # [B, T]
    return ppo_clipped, mask & ~ppo_clipped & (cov > cov_lb) & (cov < cov_ub)  # [B, T] each


def _random_subset(candidates: Tensor, count: int) -> Tensor:
    """`count` of the True entries of `candidates` drawn uniformly without replacement (all when fewer).  [B, T] bool

    The draw uses torch's global CPU generator (as verl's torch.randperm does): a seeded process repeats it.
    """
    flat = candidates.reshape(-1)  # [B*T]
    idx = flat.nonzero().squeeze(1)  # [C]
    if idx.numel() > count:
        idx = idx[torch.randperm(idx.numel())[:count].to(idx.device)]  # [count]
    chosen = torch.zeros_like(flat)  # [B*T]
    chosen[idx] = True
    return chosen.view_as(candidates)  # [B, T]


def clip_cov_diagnostics(logp, gen_logp, advantages, mask, *, ratio=2e-4, cov_lb=1.0, cov_ub=5.0, eps_low=1.0,
                         eps_high=1.0) -> dict:
    """clip_frac: PPO-clipped tokens plus the tokens Clip-Cov detaches (min(count, candidates), disjoint from
    the first); clip_cov_frac: the detached ones alone. Computed on the tokens given (the trainer: the
    whole step batch), so with several micro-batches it is what ONE micro-batch would have done."""
    ppo_clipped, candidates = _clip_cov_candidates(logp, gen_logp, advantages, mask, eps_low, eps_high, cov_lb, cov_ub)
    n = max(int(mask.sum()), 1)
    detached = min(_cov_token_count(ratio, mask), int(candidates.sum()))
    return {"clip_frac": (int(ppo_clipped.sum()) + detached) / n, "clip_cov_frac": detached / n}


# cov_lb < cov_ub is checked when the loss runs (a range cannot relate two parameters)
@LOSSES.register("clip_cov", ranges={"ratio": "(0, 1]", "eps_low": "[0, 1]", "eps_high": ">= 0"},
                 diagnostics=clip_cov_diagnostics)
def clip_cov(
    logp: Tensor,
    gen_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    eps_low: float = 1.0,
    eps_high: float = 1.0,
) -> Tensor:
    """Clip-Cov: the PPO clipped surrogate, with a random few high-covariance tokens taking no part (0, no gradient).

    Over the N masked tokens it is given: Cov_t = (log pi_t - mean log pi)(A_t - mean A)
    (`token_covariance`); candidates are the tokens the PPO clip [1 - eps_low, 1 + eps_high] does not
    already clip whose Cov_t lies in (cov_lb, cov_ub); max(floor(ratio * N), 1) of them (all if
    fewer) are drawn uniformly at random (torch's global CPU generator) and contribute 0 to the loss
    and to the gradient; every other token is -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A).

    Sources: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv 2505.22617, Clip-Cov (ratio r = 2e-4, bounds (omega_low, omega_high) = (1, 5));
    the authors' recipe (PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_clip_cov.sh) runs it on
    the PPO surrogate with clip_ratio_low = clip_ratio_high = 1, the defaults here. Peer checked:
    verl core_algos.py `compute_policy_loss_clip_cov` (same candidates, count and random draw; its
    default clip ratio is 0.2: ``clip_cov.eps_low = 0.2``, ``clip_cov.eps_high = 0.2``).

    Micro-batching: the means, N and the draw are those of the tokens this call gets. The learner calls
    the loss once per micro-batch of each rank, so Cov, the count and the candidates are per
    micro-batch (as in verl and the authors' code, which also compute it per micro-batch); the result
    is the whole-batch Clip-Cov only when a step is one micro-batch on one rank
    (train.micro_batch_size >= the step's sequences, no train.max_tokens_per_micro_batch,
    train.learner_ranks = 1). The loss is not a per-row function, so it is not exact under
    micro-batching the way the built-in clipping losses are.
    """
    if not cov_lb < cov_ub:
        raise ValueError(f"clip_cov: need cov_lb < cov_ub, got cov_lb = {cov_lb}, cov_ub = {cov_ub}")
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    _, candidates = _clip_cov_candidates(logp, gen_logp, advantages, mask, eps_low, eps_high, cov_lb, cov_ub)  # [B, T]
    detached = _random_subset(candidates, _cov_token_count(ratio, mask))  # [B, T]
    surrogate = _clipped_surrogate(token_ratio(logp, gen_logp), advantages[:, None], 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    return _masked(torch.where(detached, torch.zeros_like(surrogate), surrogate), mask)  # [B, T]


def _kl_cov_selected(logp: Tensor, advantages: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """The max(floor(ratio * N), 1) masked tokens of largest Cov_t (KL-Cov's penalised tokens).  [B, T] bool"""
    count = _cov_token_count(ratio, mask)
    cov = token_covariance(logp, advantages, mask)  # [B, T]
    ranked = torch.where(mask, cov, torch.full_like(cov, float("-inf"))).reshape(-1)  # [B*T]
    chosen = torch.zeros(ranked.shape, dtype=torch.bool, device=ranked.device)  # [B*T]
    if count > 0:
        chosen[torch.topk(ranked, count).indices] = True
    return chosen.view_as(mask)  # [B, T]


def kl_cov_diagnostics(logp, gen_logp, advantages, mask, *, ratio=2e-3, kl_coef=1.0) -> dict:
    """clip_frac: the tokens whose update KL-Cov holds back with its penalty (max(floor(ratio * N), 1) / N), on
    the tokens given (the trainer: the whole step batch; with several micro-batches, what ONE would do)."""
    return _clip_frac(_kl_cov_selected(logp, advantages, mask, ratio), mask)


@LOSSES.register("kl_cov", ranges={"ratio": "(0, 1]", "kl_coef": ">= 0"}, diagnostics=kl_cov_diagnostics)
def kl_cov(
    logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, *, ratio: float = 2e-3, kl_coef: float = 1.0
) -> Tensor:
    """KL-Cov: the unclipped surrogate -rho A, plus kl_coef |log rho| on the top-ratio tokens by covariance.

    Over the N masked tokens it is given: Cov_t = (log pi_t - mean log pi)(A_t - mean A)
    (`token_covariance`); the max(floor(ratio * N), 1) tokens of largest Cov_t get
    loss_t = -rho_t A + kl_coef |log rho_t|, every other token loss_t = -rho_t A (no clip).
    d loss_t / d log pi = -rho_t A + kl_coef sgn(log rho_t) on the penalised tokens.

    Sources: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv 2505.22617, KL-Cov (k = 2e-3 for the 7B runs, 2e-4 for 32B; beta = 1). The paper
    writes the penalty as beta KL(pi_old || pi) on the token; the authors' code
    (PRIME-RL/Entropy-Mechanism-of-RL, `compute_policy_loss_kl_cov`, ppo_kl_coef = 1) and verl's
    port (core_algos.py `compute_policy_loss_kl_cov`, ``kl_cov_ratio``, ``ppo_kl_coef``; verl's
    config defaults are 2e-4 and 0.1) both use |log rho|, which is what this computes.

    Micro-batching: as `clip_cov`, the covariance, N and the top-k are over the tokens of this call,
    i.e. per micro-batch of each rank in the learner (as in verl and the authors' code); it equals
    the whole-batch KL-Cov only when a step is one micro-batch on one rank.
    """
    logp, gen_logp = _sanitize(logp, gen_logp, mask)
    ratio_is = token_ratio(logp, gen_logp)  # [B, T]
    selected = _kl_cov_selected(logp, advantages, mask, ratio)  # [B, T]
    penalty = kl_coef * (logp - gen_logp).abs()  # [B, T]
    loss = -ratio_is * advantages[:, None] + torch.where(selected, penalty, torch.zeros_like(penalty))  # [B, T]
    return _masked(loss, mask)  # [B, T]


# ---------------------------------------------------------------------------------------
STANDARD_DIAGNOSTICS = ("clip_frac", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "log_ratio_abs_mean")


@torch.no_grad()
def loss_diagnostics(name: str, logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, **hparams) -> dict:
    """Per-step diagnostics of loss `name` over the masked tokens.

    Returns {"clip_frac", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "log_ratio_abs_mean"}
    plus whatever else the loss's diagnostics hook reports. clip_frac comes from the hook
    (``LOSSES.register(name, diagnostics=fn)``); NaN for a loss that registers none. The hook gets
    the hyper-parameters the loss gets: its defaults, overridden by `hparams` (the run's resolved
    values, `TrainConfig.params_of`).
    """
    hook = LOSSES.diagnostics_of(name)  # clear error for an unknown name
    logp, gen_logp = logp.detach(), gen_logp.detach()
    n = int(mask.sum())
    nan = float("nan")
    if n == 0:
        return {key: nan for key in STANDARD_DIAGNOSTICS}
    log_ratio = (logp - gen_logp)[mask]  # [N]
    ratio = torch.exp(log_ratio)  # [N]
    out = {
        "clip_frac": nan,
        "is_ratio_mean": float(ratio.mean()),
        "is_ratio_min": float(ratio.min()),
        "is_ratio_max": float(ratio.max()),
        "log_ratio_abs_mean": float(log_ratio.abs().mean()),
    }
    if hook is not None:
        hp = {**LOSSES.defaults(name), **hparams}
        reported = hook(logp, gen_logp, advantages, mask, **hp)
        out.update({str(k): float(v) for k, v in dict(reported or {}).items()})
    return out
