"""Float64 references for the estimators and losses added in 2026 (issue 43 item 4), from their papers.

Like `_helpers_losses.py` these walk tokens, sequences and groups with plain Python floats
(`math`), written from each paper's formula, never from the implementation's tensor code:

- SAPO (arXiv 2511.20347): f(rho) = (4 / tau) sigmoid(tau (rho - 1)), tau = tau_pos if A > 0 else tau_neg.
- GMPO (arXiv 2507.20673): J_i = sgn(A_i) (prod_t |min(rho_t A_i, clip(rho_t, e^-eps_low, e^eps_high) A_i)|)^(1/|o_i|).
- Clip-Cov / KL-Cov (arXiv 2505.22617): Cov_t = (log pi_t - mean log pi)(A_t - mean A) over the tokens.
- Dr. GRPO (arXiv 2503.20783): sum of the token losses / (sequences x MAX_TOKENS).
- RLOO (arXiv 2402.14740) and REINFORCE++-baseline (arXiv 2501.03262).

``ref_*`` losses return (loss[b][t], dloss[b][t]) with dloss = d loss[b][t] / d logp[b][t], the
derivative of the per-token loss through its own token (GMPO-token puts a stop-gradient on the
sequence's geometric mean, as GSPO-token does), so an aggregate's gradient is w[b][t] * dloss[b][t].
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

DEFAULTS_2026 = {
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "gmpo": {"eps_low": 0.4, "eps_high": 0.4},
    "clip_cov": {"ratio": 2e-4, "cov_lb": 1.0, "cov_ub": 5.0, "eps_low": 1.0, "eps_high": 1.0},
    "kl_cov": {"ratio": 2e-3, "kl_coef": 1.0},
}


def _rows(x: torch.Tensor) -> list:
    return x.detach().to(torch.float64).tolist()


def _tokens(mask) -> list:
    """[(b, t)] of the masked tokens, row-major."""
    m = mask.tolist()
    return [(b, t) for b in range(len(m)) for t in range(len(m[0])) if m[b][t]]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _zeros(mask) -> list:
    B, T = mask.shape
    return [[0.0] * T for _ in range(B)]


# ----------------------------------------------------------------------------------------
# SAPO
def ref_sapo(logp, gen_logp, advantages, mask, tau_pos=1.0, tau_neg=1.05):
    lp, glp, adv = _rows(logp), _rows(gen_logp), _rows(advantages)
    loss, grad = _zeros(mask), _zeros(mask)
    for b, t in _tokens(mask):
        a = adv[b]
        rho = math.exp(lp[b][t] - glp[b][t])
        tau = tau_pos if a > 0 else tau_neg
        s = _sigmoid(tau * (rho - 1.0))
        loss[b][t] = -(4.0 / tau) * s * a  # minus the objective f(rho) A
        grad[b][t] = -4.0 * s * (1.0 - s) * rho * a  # f'(rho) = 4 s (1 - s), d rho / d logp = rho
    return loss, grad


def ref_sapo_weight(logp, gen_logp, advantages, mask, tau_pos=1.0, tau_neg=1.05) -> list:
    """[(b, t, w)]: the gradient weight sech^2(tau (rho - 1) / 2) of every masked token."""
    lp, glp, adv = _rows(logp), _rows(gen_logp), _rows(advantages)
    out = []
    for b, t in _tokens(mask):
        tau = tau_pos if adv[b] > 0 else tau_neg
        x = tau * (math.exp(lp[b][t] - glp[b][t]) - 1.0) / 2.0
        out.append((b, t, 1.0 / math.cosh(x) ** 2))
    return out


# ----------------------------------------------------------------------------------------
# GMPO
def _gmpo_term(rho: float, a: float, eps_low: float, eps_high: float) -> tuple[float, bool]:
    """(|min(rho A, clip(rho, e^-eps_low, e^eps_high) A)|, whether the min takes the rho A branch)."""
    clipped = min(max(rho, math.exp(-eps_low)), math.exp(eps_high))
    unclipped_obj, clipped_obj = rho * a, clipped * a
    return abs(min(unclipped_obj, clipped_obj)), unclipped_obj <= clipped_obj


def ref_gmpo_objectives(logp, gen_logp, advantages, mask, eps_low=0.4, eps_high=0.4) -> list:
    """J_i for every sequence, from the paper's product form (0 for a sequence with no token or A = 0)."""
    lp, glp, adv, m = _rows(logp), _rows(gen_logp), _rows(advantages), mask.tolist()
    out = []
    for b in range(len(lp)):
        a = adv[b]
        toks = [t for t in range(len(lp[b])) if m[b][t]]
        if not toks or a == 0:
            out.append(0.0)
            continue
        log_prod = sum(math.log(_gmpo_term(math.exp(lp[b][t] - glp[b][t]), a, eps_low, eps_high)[0]) for t in toks)
        out.append(math.copysign(1.0, a) * math.exp(log_prod / len(toks)))
    return out


def ref_gmpo(logp, gen_logp, advantages, mask, eps_low=0.4, eps_high=0.4):
    """GMPO-token: loss -J_i on every token of sequence i; d/dlogp_t = -A_i S_i [t takes the unclipped branch]."""
    lp, glp, adv = _rows(logp), _rows(gen_logp), _rows(advantages)
    J = ref_gmpo_objectives(logp, gen_logp, advantages, mask, eps_low, eps_high)
    loss, grad = _zeros(mask), _zeros(mask)
    for b, t in _tokens(mask):
        a = adv[b]
        loss[b][t] = -J[b]
        _, unclipped = _gmpo_term(math.exp(lp[b][t] - glp[b][t]), a, eps_low, eps_high)
        grad[b][t] = -J[b] if (unclipped and a != 0) else 0.0  # J = A S: d(A S)/d logp_t = A S when unclipped
    return loss, grad


def ref_gmpo_clipped(logp, gen_logp, advantages, mask, eps_low=0.4, eps_high=0.4) -> list:
    lp, glp, adv = _rows(logp), _rows(gen_logp), _rows(advantages)
    return [(b, t) for b, t in _tokens(mask)
            if adv[b] != 0 and not _gmpo_term(math.exp(lp[b][t] - glp[b][t]), adv[b], eps_low, eps_high)[1]]


# ----------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov
def ref_covariance(logp, advantages, mask) -> dict:
    """{(b, t): Cov_t} over the masked tokens, means taken over those tokens."""
    lp, adv = _rows(logp), _rows(advantages)
    toks = _tokens(mask)
    mean_lp = sum(lp[b][t] for b, t in toks) / len(toks)
    mean_a = sum(adv[b] for b, _ in toks) / len(toks)
    return {(b, t): (lp[b][t] - mean_lp) * (adv[b] - mean_a) for b, t in toks}


def _ppo_clipped(rho: float, a: float, lo: float, hi: float) -> bool:
    return (a > 0 and rho > hi) or (a < 0 and rho < lo)


def ref_clip_cov_candidates(logp, gen_logp, advantages, mask, ratio=2e-4, cov_lb=1.0, cov_ub=5.0, eps_low=1.0,
                            eps_high=1.0) -> tuple[set, set, int]:
    """(PPO-clipped tokens, candidates, how many to detach = max(floor(ratio N), 1))."""
    lp, glp, adv = _rows(logp), _rows(gen_logp), _rows(advantages)
    cov = ref_covariance(logp, advantages, mask)
    clipped, candidates = set(), set()
    for (b, t), c in cov.items():
        if _ppo_clipped(math.exp(lp[b][t] - glp[b][t]), adv[b], 1 - eps_low, 1 + eps_high):
            clipped.add((b, t))
        elif cov_lb < c < cov_ub:
            candidates.add((b, t))
    return clipped, candidates, max(math.floor(ratio * len(cov)), 1)


def ref_clip_cov(logp, gen_logp, advantages, mask, detached: set, eps_low=1.0, eps_high=1.0, **_):
    """The PPO clipped surrogate, 0 (value and gradient) on the `detached` tokens."""
    lp, glp, adv = _rows(logp), _rows(gen_logp), _rows(advantages)
    loss, grad = _zeros(mask), _zeros(mask)
    lo, hi = 1 - eps_low, 1 + eps_high
    for b, t in _tokens(mask):
        if (b, t) in detached:
            continue
        a, rho = adv[b], math.exp(lp[b][t] - glp[b][t])
        if _ppo_clipped(rho, a, lo, hi):
            loss[b][t] = -min(max(rho, lo), hi) * a
        else:
            loss[b][t], grad[b][t] = -rho * a, -rho * a
    return loss, grad


def ref_kl_cov_selected(logp, advantages, mask, ratio=2e-3) -> set:
    cov = ref_covariance(logp, advantages, mask)
    k = max(math.floor(ratio * len(cov)), 1)
    ranked = sorted(cov, key=lambda bt: -cov[bt])
    return set(ranked[:k])


def ref_kl_cov(logp, gen_logp, advantages, mask, ratio=2e-3, kl_coef=1.0):
    """-rho A everywhere, + kl_coef |log rho| on the top-k covariance tokens."""
    lp, glp, adv = _rows(logp), _rows(gen_logp), _rows(advantages)
    selected = ref_kl_cov_selected(logp, advantages, mask, ratio)
    loss, grad = _zeros(mask), _zeros(mask)
    for b, t in _tokens(mask):
        a, lr = adv[b], lp[b][t] - glp[b][t]
        rho = math.exp(lr)
        loss[b][t], grad[b][t] = -rho * a, -rho * a
        if (b, t) in selected:
            loss[b][t] += kl_coef * abs(lr)
            grad[b][t] += kl_coef * math.copysign(1.0, lr)
    return loss, grad


# ----------------------------------------------------------------------------------------
# Dr. GRPO aggregation
def ref_dr_grpo(loss: list, mask, max_tokens: Optional[int]) -> tuple[float, list]:
    """(sum of the masked token losses / (B * L), the weight 1 / (B * L) of every masked token)."""
    m = mask.tolist()
    B, T = len(m), len(m[0])
    L = T if max_tokens is None else max_tokens
    total = sum(loss[b][t] for b in range(B) for t in range(T) if m[b][t])
    w = [[1.0 / (B * L) if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return total / (B * L), w


# ----------------------------------------------------------------------------------------
# advantages
def ref_rloo(rewards: Sequence[float], group_ids: Sequence[int]) -> list:
    out = []
    for i, (r, g) in enumerate(zip(rewards, group_ids)):
        others = [float(rewards[j]) for j, h in enumerate(group_ids) if h == g and j != i]
        out.append(float(r) - sum(others) / len(others) if others else 0.0)
    return out


def ref_reinforce_pp(rewards: Sequence[float], group_ids: Sequence[int], eps: float = 1e-8) -> list:
    baselined = []
    for r, g in zip(rewards, group_ids):
        group = [float(rewards[j]) for j, h in enumerate(group_ids) if h == g]
        baselined.append(float(r) - (sum(group) / len(group) if len(group) > 1 else 0.0))
    n = len(baselined)
    if n < 2:
        return [0.0] * n
    mean = sum(baselined) / n
    var = sum((x - mean) ** 2 for x in baselined) / (n - 1)
    return [(x - mean) / math.sqrt(var + eps) for x in baselined]
