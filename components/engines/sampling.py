"""The distribution a torch-engine row samples from, knob by knob in vLLM's order: the repetition
penalty on the raw logits (`repetition_penalized`), then (after the temperature) min-p and top-k
(`min_p_top_k_keep`) and top-p on the renormalised rest (`top_p_filter`); `sampling_probs` puts
them together. Tested against a float64 reference (tests/test_sampling_knobs.py).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["top_p_filter", "repetition_penalized", "min_p_top_k_keep", "sampling_probs"]


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's nucleus (not renormalised).

    probs [B, V] (rows sum to 1), top_p [B] in (0, 1] -> [B, V]. A token is kept when the
    probability mass of the strictly more likely tokens is below top_p, so the most likely
    token is always kept.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [B, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p.unsqueeze(-1), 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def repetition_penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """vLLM's repetition penalty: a logit of a token already seen is divided by the penalty when > 0,
    multiplied by it otherwise.  [B, V]

    logits [B, V] (float32), seen [B, V] bool (the token is in the prompt or the completion so far),
    penalty [B] (> 0; 1 leaves the row unchanged).
    """
    factor = torch.where(seen, penalty.to(logits.dtype).unsqueeze(-1), torch.ones_like(logits))  # [B, V]
    return logits * torch.where(logits > 0, 1.0 / factor, factor)  # [B, V]


def min_p_top_k_keep(logp: torch.Tensor, top_k: Optional[torch.Tensor], min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """The tokens min-p then top-k keep.  [B, V] bool

    logp [B, V] (log-probs after the penalty and the temperature); min_p [B] in [0, 1]: keep a token
    whose probability is >= min_p x the row's largest; top_k [B] (0: off): of those, keep the ones
    whose log-prob is >= the k-th largest (ties with the k-th are kept, as vLLM keeps them).
    """
    keep = torch.ones_like(logp, dtype=torch.bool)  # [B, V]
    if min_p is not None:
        probs = logp.exp()  # [B, V]
        keep = probs >= min_p.to(probs.dtype).unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)  # [B, V]
    if top_k is not None:
        k = top_k.clamp(max=logp.shape[-1])  # [B]
        kmax = int(k.max())
        if kmax > 0:
            kept = logp.masked_fill(~keep, float("-inf"))  # [B, V]
            kth = kept.topk(kmax, dim=-1).values.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1))  # [B, 1]
            kth = torch.where(k.unsqueeze(-1) > 0, kth, torch.full_like(kth, float("-inf")))  # [B, 1]
            keep = keep & (kept >= kth)  # [B, V]
    return keep


def sampling_probs(logp: torch.Tensor, top_k: Optional[torch.Tensor] = None, top_p: Optional[torch.Tensor] = None,
                   min_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The (unnormalised) distribution a row samples from.  [B, V]

    logp [B, V]: log-probs after the repetition penalty and the temperature. min-p and top-k
    (`min_p_top_k_keep`) zero the tokens they drop and the rest is renormalised; top-p then keeps
    the nucleus of that renormalised distribution (`top_p_filter`). A knob given as None is off;
    with all three None this is exp(logp).
    """
    probs = logp.exp()  # [B, V]
    if top_k is not None or min_p is not None:
        keep = min_p_top_k_keep(logp, top_k, min_p)  # [B, V]
        probs = torch.where(keep, probs, torch.zeros_like(probs))  # [B, V]
        probs = probs / probs.sum(dim=-1, keepdim=True)  # [B, V]
    if top_p is not None:
        probs = top_p_filter(probs, top_p)  # [B, V]
    return probs
