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
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.registry import LOSSES

__all__ = ["grpo", "dapo", "cispo", "gspo", "ppo_dual_clip", "icepop", "dppo", "loss_diagnostics", "token_ratio",
           "STANDARD_DIAGNOSTICS"]

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


def _clip_frac(clipped: Tensor, mask: Tensor) -> dict:
    """{"clip_frac": fraction of the trained tokens in the bool [B, T] `clipped`}."""
    return {"clip_frac": float((clipped & mask).sum()) / max(int(mask.sum()), 1)}


# diagnostics hooks (registered with their losses below): the tokens each loss clips
def grpo_diagnostics(logp, gen_logp, advantages, mask, *, eps=0.2) -> dict:
    return _clip_frac(_ppo_clip_active(token_ratio(logp, gen_logp), advantages[:, None], 1.0 - eps, 1.0 + eps), mask)


def dapo_diagnostics(logp, gen_logp, advantages, mask, *, eps_low=0.2, eps_high=0.28) -> dict:
    return _clip_frac(_ppo_clip_active(token_ratio(logp, gen_logp), advantages[:, None], 1.0 - eps_low, 1.0 + eps_high), mask)


def cispo_diagnostics(logp, gen_logp, advantages, mask, *, eps_max=4.0) -> dict:
    return _clip_frac(token_ratio(logp, gen_logp) > eps_max, mask)


def gspo_diagnostics(logp, gen_logp, advantages, mask, *, eps_low=3e-3, eps_high=5e-3) -> dict:
    seq_ratio = _sequence_ratio(logp, gen_logp, mask)[:, None].expand_as(logp)  # [B, T]
    return _clip_frac(_ppo_clip_active(seq_ratio, advantages[:, None], 1.0 - eps_low, 1.0 + eps_high), mask)


def ppo_dual_clip_diagnostics(logp, gen_logp, advantages, mask, *, eps_low=0.2, eps_high=0.2, dual_clip=3.0) -> dict:
    ratio = token_ratio(logp, gen_logp)
    adv = advantages[:, None]
    return _clip_frac(_ppo_clip_active(ratio, adv, 1.0 - eps_low, 1.0 + eps_high) | ((adv < 0) & (ratio > dual_clip)), mask)


def icepop_diagnostics(logp, gen_logp, advantages, mask, *, low=0.5, high=2.0) -> dict:
    ratio = token_ratio(logp, gen_logp)
    return _clip_frac((ratio < low) | (ratio > high), mask)


def dppo_diagnostics(logp, gen_logp, advantages, mask, *, delta_low=0.2, delta_high=0.2, kl_tau=0.0) -> dict:
    return _clip_frac(_dppo_outside(logp, gen_logp, advantages, delta_low, delta_high), mask)


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
STANDARD_DIAGNOSTICS = ("clip_frac", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "log_ratio_abs_mean")


@torch.no_grad()
def loss_diagnostics(name: str, logp: Tensor, gen_logp: Tensor, advantages: Tensor, mask: Tensor, **hparams) -> dict:
    """Per-step diagnostics of loss `name` over the masked tokens.

    Returns {"clip_frac", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "log_ratio_abs_mean"}
    plus whatever else the loss's diagnostics hook reports. clip_frac comes from the hook
    (``LOSSES.register(name, diagnostics=fn)``); NaN for a loss that registers none. The hook gets
    the hyper-parameters the loss gets (its registry entry's defaults and gin bindings,
    `Registry.bound_values`), overridden by `hparams`.
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
        hp = {**LOSSES.bound_values(name), **hparams}
        reported = hook(logp, gen_logp, advantages, mask, **hp)
        out.update({str(k): float(v) for k, v in dict(reported or {}).items()})
    return out
