"""Float64 references for the loss / aggregation / advantage tests, written from the formulas.

These are deliberately NOT vectorised like the implementation: every reference walks the
tokens and groups with plain Python floats (`math`), straight from PAPER.md §5 and
DESIGN.md "Math contracts", so a shared mistake in tensor code cannot hide in both.

Conventions (DESIGN.md):
- per-token LOSS = minus the per-token objective; 0 on padding.
- rho[b][t] = exp(logp[b][t] - gen_logp[b][t]) (the generator's log-prob is the denominator).
- ``ref_per_token`` returns (loss, dloss) where dloss[b][t] = d loss[b][t] / d logp[b][t].
  Every loss here depends on logp[b][t] only through its own token (GSPO-token puts a
  stop-gradient on the sequence ratio), so the gradient of any aggregate sum_bt w_bt*loss_bt
  with respect to logp[b][t] is w_bt * dloss[b][t].
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import torch

# Defaults fixed by DESIGN.md "Math contracts" (and the extras' documented defaults).
DEFAULTS = {
    "grpo": {"eps": 0.2},
    "dapo": {"eps_low": 0.2, "eps_high": 0.28},
    "cispo": {"eps_max": 4.0},
    "gspo": {"eps_low": 3e-3, "eps_high": 5e-3},
    "ppo_dual_clip": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0},
    "icepop": {"low": 0.5, "high": 2.0},
    "dppo": {"delta_low": 0.2, "delta_high": 0.2, "kl_tau": 0.0},
}


def _rows(x: torch.Tensor) -> list:
    return x.detach().to(torch.float64).tolist()


def _clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


# ----------------------------------------------------------------------------------------
# per-token references
def _ppo_token(rho: float, a: float, lo: float, hi: float) -> tuple[float, float]:
    """Loss -min(rho*A, clip(rho, lo, hi)*A) and its derivative w.r.t. log pi (d rho = rho d logp)."""
    unclipped = rho * a
    clipped = _clip(rho, lo, hi) * a
    if unclipped <= clipped:  # the min takes the unclipped branch: gradient flows
        return -unclipped, -a * rho
    return -clipped, 0.0  # the clipped branch is a constant in theta


def ref_per_token(name: str, logp, gen_logp, advantages, mask, **hp) -> tuple[list, list]:
    """(loss[b][t], dloss/dlogp[b][t]) for loss `name` with hyper-parameters `hp` (defaults filled)."""
    hp = {**DEFAULTS[name], **hp}
    lp, glp, adv, m = _rows(logp), _rows(gen_logp), _rows(advantages), mask.tolist()
    B, T = len(lp), len(lp[0])
    loss = [[0.0] * T for _ in range(B)]
    grad = [[0.0] * T for _ in range(B)]
    for b in range(B):
        a = adv[b]
        toks = [t for t in range(T) if m[b][t]]
        if name == "gspo":
            # s_b = (pi(y|x) / pi_gen(y|x)) ** (1/|y|): geometric mean of the token ratios
            s = math.exp(sum(lp[b][t] - glp[b][t] for t in toks) / len(toks)) if toks else 1.0
            unclipped = s * a
            clipped = _clip(s, 1 - hp["eps_low"], 1 + hp["eps_high"]) * a
            # GSPO-token: s_bt = sg(s_b) * pi_bt / sg(pi_bt): value s_b, d s_bt / d logp_bt = s_b
            val, d = (-unclipped, -a * s) if unclipped <= clipped else (-clipped, 0.0)
            for t in toks:
                loss[b][t], grad[b][t] = val, d
            continue
        for t in toks:
            rho = math.exp(lp[b][t] - glp[b][t])
            if name == "grpo":
                loss[b][t], grad[b][t] = _ppo_token(rho, a, 1 - hp["eps"], 1 + hp["eps"])
            elif name == "dapo":
                loss[b][t], grad[b][t] = _ppo_token(rho, a, 1 - hp["eps_low"], 1 + hp["eps_high"])
            elif name == "cispo":
                # J = sg(min(rho, eps_max)) * A * log pi  (ScaleRL Eq. 4, absolute cap)
                w = min(rho, hp["eps_max"])
                loss[b][t], grad[b][t] = -w * a * lp[b][t], -w * a
            elif name == "ppo_dual_clip":
                val, d = _ppo_token(rho, a, 1 - hp["eps_low"], 1 + hp["eps_high"])
                # dual clip (Ye et al. 2020): for A < 0 the objective is max(clipped obj, c*A)
                if a < 0 and -val < hp["dual_clip"] * a:
                    val, d = -hp["dual_clip"] * a, 0.0
                loss[b][t], grad[b][t] = val, d
            elif name == "icepop":
                # masked IS policy gradient: weight sg(rho) inside [low, high], zero outside
                w = rho if hp["low"] <= rho <= hp["high"] else 0.0
                loss[b][t], grad[b][t] = -w * a * lp[b][t], -w * a
            elif name == "dppo":
                # DPPO-Binary-TV (arXiv 2602.04879; prime-rl's default loss): -M rho A + kl_tau (log rho)^2,
                # M = 0 where pi - mu of the sampled token passed the bound in the advantage's direction
                m_t = 0.0 if _dppo_outside(lp[b][t], glp[b][t], a, hp) else 1.0
                log_r = lp[b][t] - glp[b][t]
                loss[b][t] = -m_t * rho * a + hp["kl_tau"] * log_r * log_r
                grad[b][t] = -m_t * rho * a + 2.0 * hp["kl_tau"] * log_r  # d rho / d logp = rho
            else:
                raise KeyError(name)
    return loss, grad


def _dppo_outside(lp: float, glp: float, a: float, hp: dict) -> bool:
    """DPPO's trust region on the binary TV |pi - mu| of the sampled token, one-sided by the advantage."""
    diff = math.exp(lp) - math.exp(glp)
    return (a > 0 and diff > hp["delta_high"]) or (a < 0 and diff < -hp["delta_low"])


def ref_clipped_tokens(name: str, logp, gen_logp, advantages, mask, **hp) -> list:
    """bool[b][t]: tokens whose gradient the loss zeroes or whose IS weight it truncates."""
    hp = {**DEFAULTS[name], **hp}
    lp, glp, adv, m = _rows(logp), _rows(gen_logp), _rows(advantages), mask.tolist()
    out = []
    for b in range(len(lp)):
        a = adv[b]
        toks = [t for t in range(len(lp[b])) if m[b][t]]
        s = math.exp(sum(lp[b][t] - glp[b][t] for t in toks) / len(toks)) if toks else 1.0
        row = []
        for t in range(len(lp[b])):
            if not m[b][t]:
                row.append(False)
                continue
            rho = math.exp(lp[b][t] - glp[b][t])
            if name == "grpo":
                c = (a > 0 and rho > 1 + hp["eps"]) or (a < 0 and rho < 1 - hp["eps"])
            elif name == "dapo":
                c = (a > 0 and rho > 1 + hp["eps_high"]) or (a < 0 and rho < 1 - hp["eps_low"])
            elif name == "gspo":
                c = (a > 0 and s > 1 + hp["eps_high"]) or (a < 0 and s < 1 - hp["eps_low"])
            elif name == "cispo":
                c = rho > hp["eps_max"]
            elif name == "ppo_dual_clip":
                c = ((a > 0 and rho > 1 + hp["eps_high"]) or (a < 0 and rho < 1 - hp["eps_low"])
                     or (a < 0 and rho > hp["dual_clip"]))
            elif name == "icepop":
                c = not (hp["low"] <= rho <= hp["high"])
            elif name == "dppo":
                c = _dppo_outside(lp[b][t], glp[b][t], a, hp)
            else:
                raise KeyError(name)
            row.append(bool(c))
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------
# aggregation references
def _groups(group_ids) -> "OrderedDict[int, list[int]]":
    groups: OrderedDict[int, list[int]] = OrderedDict()
    for b, g in enumerate(group_ids.tolist()):
        groups.setdefault(g, []).append(b)
    return groups


def ref_aggregate(name: str, loss: list, mask, group_ids) -> float:
    """The scalar of aggregation `name`, by explicit loops over tokens / sequences / prompts."""
    m = mask.tolist()
    B, T = len(m), len(m[0])
    if name == "token_mean":
        vals = [loss[b][t] for b in range(B) for t in range(T) if m[b][t]]
        return sum(vals) / len(vals)
    if name == "sample_mean":
        per_seq = []
        for b in range(B):
            vals = [loss[b][t] for t in range(T) if m[b][t]]
            per_seq.append(sum(vals) / len(vals))
        return sum(per_seq) / B
    if name == "prompt_mean":
        per_prompt = []
        for rows in _groups(group_ids).values():
            vals = [loss[b][t] for b in rows for t in range(T) if m[b][t]]
            per_prompt.append(sum(vals) / len(vals))
        return sum(per_prompt) / len(per_prompt)
    raise KeyError(name)


def ref_weights(name: str, mask, group_ids) -> list:
    """w[b][t] = d aggregate / d loss[b][t] (0 on padding)."""
    m = mask.tolist()
    B, T = len(m), len(m[0])
    lengths = [sum(row) for row in m]
    w = [[0.0] * T for _ in range(B)]
    if name == "token_mean":
        n = sum(lengths)
        per_seq = [1.0 / n] * B
    elif name == "sample_mean":
        per_seq = [1.0 / (B * lengths[b]) for b in range(B)]
    elif name == "prompt_mean":
        groups = _groups(group_ids)
        per_seq = [0.0] * B
        for rows in groups.values():
            total = sum(lengths[b] for b in rows)
            for b in rows:
                per_seq[b] = 1.0 / (len(groups) * total)
    else:
        raise KeyError(name)
    for b in range(B):
        for t in range(T):
            if m[b][t]:
                w[b][t] = per_seq[b]
    return w


def times(w: list, d: list) -> torch.Tensor:
    """Elementwise product of two nested lists, as a float64 tensor."""
    return torch.tensor(w, dtype=torch.float64) * torch.tensor(d, dtype=torch.float64)


# ----------------------------------------------------------------------------------------
# advantage references
def ref_advantages(name: str, rewards: Sequence[float], group_ids: Sequence[int], eps: float = 1e-6) -> list:
    r = [float(x) for x in rewards]
    g = [int(x) for x in group_ids]
    members: dict[int, list[int]] = {}
    for i, gi in enumerate(g):
        members.setdefault(gi, []).append(i)
    mean = {gi: sum(r[i] for i in rows) / len(rows) for gi, rows in members.items()}
    centred = [r[i] - mean[g[i]] for i in range(len(r))]
    if name == "none":
        return centred
    if name == "prompt":
        std = {gi: math.sqrt(sum((r[i] - mean[gi]) ** 2 for i in rows) / len(rows)) for gi, rows in members.items()}
        return [centred[i] / (std[g[i]] + eps) for i in range(len(r))]
    if name == "batch":
        mu = sum(centred) / len(centred)
        std = math.sqrt(sum((c - mu) ** 2 for c in centred) / len(centred))
        return [c / (std + eps) for c in centred]
    raise KeyError(name)


# ----------------------------------------------------------------------------------------
# test batches
LENGTHS = (9, 3, 6, 1, 7, 4, 9, 2)  # unequal, one single-token completion
GROUP_IDS = (7, 7, 2, 7, 2, 2, 4, 4)  # interleaved, non-contiguous prompt ids: 3 prompts
ADVANTAGES = (1.3, -0.7, 0.0, -1.1, 0.4, 0.9, -0.25, 2.0)

# "narrow" batch: per-sequence mean log-ratio put on each side of GSPO's default bounds
# (log(1-3e-3) = -0.0030045, log(1+5e-3) = 0.0049875), per advantage sign.
_NARROW_OFFSETS = (-0.005, -0.006, 0.0, 0.007, 0.006, 0.001, 0.002, -0.001)


def make_batch(kind: str = "wide", seed: int = 0, pad_value: float = 0.0) -> dict:
    """A float64 batch: logp (leaf, requires grad), gen_logp, advantages [B], mask [B, T], group_ids [B].

    kind="wide": token log-ratios in [-0.6, 0.6] plus a few large ones, so every clip /
    truncation / mask region of every loss is hit on both sides.
    kind="narrow": token log-ratios of order 1e-2 whose per-sequence means sit inside and on
    both sides of GSPO's default bounds.
    """
    gen = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = True
    gen_logp = -0.05 - 3.0 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    if kind == "wide":
        delta = (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 1.2
        # explicit tokens beyond the wide thresholds: cispo cap 4, dual clip 3, icepop [0.5, 2]
        delta[0, 1] = 1.7   # rho 5.47, A>0
        delta[1, 0] = 1.5   # rho 4.48, A<0
        delta[3, 0] = 1.2   # rho 3.32, A<0 (single-token sequence)
        delta[6, 4] = 1.3   # rho 3.67, A<0
        delta[4, 2] = -0.9  # rho 0.41, A>0
        delta[5, 3] = 0.8   # rho 2.23, A>0
    elif kind == "narrow":
        noise = (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 0.02
        delta = torch.zeros(B, T, dtype=torch.float64)
        for b, n in enumerate(LENGTHS):
            row = noise[b, :n] - noise[b, :n].mean()  # per-sequence mean exactly the offset
            delta[b, :n] = row + _NARROW_OFFSETS[b]
    else:
        raise ValueError(kind)
    logp = (gen_logp + delta).clone()
    logp = torch.where(mask, logp, torch.full_like(logp, pad_value))
    gen_logp = torch.where(mask, gen_logp, torch.full_like(gen_logp, pad_value))
    _assert_off_thresholds(logp, gen_logp, mask)
    return {
        "logp": logp.requires_grad_(True),
        "gen_logp": gen_logp,
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float64),
        "mask": mask,
        "group_ids": torch.tensor(GROUP_IDS, dtype=torch.long),
    }


# every clip / cap / mask bound used by the tests (defaults and the non-default cases)
_THRESHOLDS = (0.5, 0.8, 0.9, 1.1, 1.2, 1.28, 1.4, 1.5, 2.0, 3.0, 4.0, 1 - 3e-3, 1 + 5e-3)


# DPPO's bounds on the probability change pi - mu (defaults and the non-default cases), both signs
_PROB_DIFF_THRESHOLDS = (0.2, 0.1, 0.3)


def _assert_off_thresholds(logp, gen_logp, mask) -> None:
    """No ratio (nor DPPO's probability change) sits on a threshold (ties make sub-gradients ambiguous)."""
    rho = torch.exp(logp - gen_logp)[mask]
    for th in _THRESHOLDS:
        assert (rho - th).abs().min() > 1e-6, f"test batch has a ratio on the threshold {th}"
    diff = (torch.exp(logp) - torch.exp(gen_logp))[mask]
    for th in _PROB_DIFF_THRESHOLDS:
        assert (diff.abs() - th).abs().min() > 1e-6, f"test batch has a probability change on the threshold {th}"
