"""Loss aggregations (registry `AGGREGATIONS`): per-token loss [B, T] -> scalar.

Signature (DESIGN.md)::

    aggregate(per_token_loss, mask, group_ids) -> scalar

- per_token_loss [B, T]  from a loss; 0 where mask is False
- mask           [B, T]  bool, completion tokens
- group_ids      [B]     int, the prompt each sequence answers (its rollout group)

All three of the paper's aggregations are LINEAR in the per-token loss: each is
sum over (b, t) of w[b, t] * loss[b, t] for a weight matrix that depends only on the mask
and the groups. That is what makes micro-batching exact: compute the weights once on the
WHOLE step batch (`token_weights`), then each micro-batch's loss is
`weighted_sum(per_token_loss_mb, weights_mb)`, and the sum of micro-batch gradients equals
the whole-batch gradient. (Normalising by micro-batch counts instead is the bug verl,
prime-rl and open-instruct each shipped: verl #5625, prime-rl #583, open-instruct #1161.)

`dr_grpo` (added in 2026) is linear too: sum over every masked token / (B x a constant token
count), B the number of sequences of the step batch, so its weights are one number for every
token of the batch and micro-batching stays exact. Its constant is a hyper-parameter
(``dr_grpo.max_tokens``), bound in gin like any other.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from components.registry import AGGREGATIONS

__all__ = ["token_mean", "sample_mean", "prompt_mean", "dr_grpo", "turn_mean", "token_weights", "weighted_sum", "group_index"]


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense 0..P-1 index of each sequence's group, and the number of groups P.  [B], int"""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [B]
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _lengths(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return mask.sum(dim=1).to(dtype)  # [B]


@AGGREGATIONS.register("token_mean")
def token_mean(per_token_loss: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
    """Sum over every masked token of the batch / number of masked tokens (verl token-mean)."""
    num_tokens = mask.sum().clamp(min=1).to(per_token_loss.dtype)  # []
    return torch.where(mask, per_token_loss, 0.0).sum() / num_tokens  # []


@AGGREGATIONS.register("sample_mean")
def sample_mean(per_token_loss: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
    """Mean over sequences of (sum over its tokens / its length) (GRPO sample average)."""
    per_seq = torch.where(mask, per_token_loss, 0.0).sum(dim=1)  # [B]
    lengths = _lengths(mask, per_token_loss.dtype).clamp(min=1)  # [B]
    return (per_seq / lengths).sum() / max(per_token_loss.shape[0], 1)  # []


@AGGREGATIONS.register("prompt_mean")
def prompt_mean(per_token_loss: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
    """Mean over prompts of (sum over the tokens of its G generations / their total token count) (ScaleRL)."""
    idx, num_groups = group_index(group_ids)  # [B], P
    per_seq = torch.where(mask, per_token_loss, 0.0).sum(dim=1)  # [B]
    lengths = _lengths(mask, per_token_loss.dtype)  # [B]
    per_group_sum = torch.zeros(num_groups, dtype=per_seq.dtype, device=per_seq.device).index_add(0, idx, per_seq)  # [P]
    per_group_len = torch.zeros(num_groups, dtype=lengths.dtype, device=lengths.device).index_add(0, idx, lengths)  # [P]
    return (per_group_sum / per_group_len.clamp(min=1)).sum() / max(num_groups, 1)  # []


@AGGREGATIONS.register("dr_grpo", ranges={"max_tokens": ">= 1"})
def dr_grpo(per_token_loss: Tensor, mask: Tensor, group_ids: Tensor, *, max_tokens: Optional[int] = None) -> Tensor:
    """Dr. GRPO: sum over every masked token / (number of sequences x max_tokens), a constant normaliser.

    value = sum_{b, t: mask} loss[b, t] / (B * L), B the sequences of the step batch, L =
    `max_tokens` (the generation budget: bind ``dr_grpo.max_tokens`` to the run's
    ``train.max_tokens``, e.g. through one gin macro). With max_tokens None (the default) L is the
    padded completion length T of the step batch, which is the longest completion of the step, not a
    constant: bind it for the paper's estimator.

    Sources: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv 2503.20783), Dr. GRPO's fix of the length bias: the per-sequence 1/|o_i| is replaced by
    a constant (the generation budget, MAX_TOKENS). Peers: TRL GRPOTrainer ``loss_type="dr_grpo"``
    (sum of masked token losses / (batch size x ``max_completion_length``)); verl
    ``loss_agg_mode="seq-mean-token-sum-norm"`` (sum / ``loss_scale_factor``, by default the
    padded response length). B and L are taken on the WHOLE step batch (the learner computes the
    weights there, `token_weights`), so ranks and micro-batches change nothing.
    """
    length = per_token_loss.shape[1] if max_tokens is None else int(max_tokens)
    norm = max(per_token_loss.shape[0], 1) * max(length, 1)
    return torch.where(mask, per_token_loss, 0.0).sum() / norm  # []


@AGGREGATIONS.register("turn_mean")
def turn_mean(per_token_loss: Tensor, mask: Tensor, group_ids: Tensor, *, turn_ids: Optional[Tensor] = None) -> Tensor:
    """Turn-level aggregation (multi-turn, issue 45): mean over prompts of (mean over the assistant turns of its G
    generations of (mean over that turn's masked tokens)).

    turn_ids [B, T] long: the turn of each token (`rollout.turn_index`; the learner passes the batch's). A turn
    with no masked token counts for nothing. Against `prompt_mean` (token-level within a prompt) a long turn
    weighs as much as a short one. Without turn ids (single-turn) every sequence is one turn: the mean over a
    prompt's sequences of their token means."""
    B, T = mask.shape
    turns = torch.zeros((B, T), dtype=torch.long, device=mask.device) if turn_ids is None else turn_ids.clamp(min=0)
    idx, num_groups = group_index(group_ids)  # [B], P
    width = int(turns.max()) + 1 if turns.numel() else 1
    seg = (torch.arange(B, device=mask.device).unsqueeze(1) * width + turns).flatten()  # [B*T] one id per (row, turn)
    m = mask.flatten().to(per_token_loss.dtype)  # [B*T]
    n_seg = B * width
    seg_sum = torch.zeros(n_seg, dtype=per_token_loss.dtype, device=mask.device).index_add(
        0, seg, torch.where(mask, per_token_loss, 0.0).flatten())  # [B*width]
    seg_len = torch.zeros(n_seg, dtype=m.dtype, device=mask.device).index_add(0, seg, m)  # [B*width]
    present = seg_len > 0  # [B*width] turns with a trained token
    seg_mean = torch.where(present, seg_sum / seg_len.clamp(min=1), 0.0)  # [B*width]
    seg_group = idx.repeat_interleave(width)  # [B*width] each turn's prompt
    group_sum = torch.zeros(num_groups, dtype=seg_mean.dtype, device=mask.device).index_add(0, seg_group, seg_mean)  # [P]
    group_turns = torch.zeros(num_groups, dtype=seg_mean.dtype, device=mask.device).index_add(
        0, seg_group, present.to(seg_mean.dtype))  # [P]
    return (group_sum / group_turns.clamp(min=1)).sum() / max(num_groups, 1)  # []


def _takes_turn_ids(aggregate) -> bool:
    import inspect

    fn = getattr(aggregate, "__wrapped__", aggregate)
    try:
        return "turn_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def token_weights(aggregation, mask: Tensor, group_ids: Tensor, dtype: torch.dtype = torch.float32, *,
                  turn_ids: Optional[Tensor] = None) -> Tensor:
    """The weight of every token in `aggregation` (a registered name, built with its defaults, or the
    aggregate function itself), computed on the WHOLE step batch.  [B, T]

    Works for any registered aggregation that is linear in the per-token loss (the paper's
    three, and any user one that is): the weights are the gradient of the aggregate with
    respect to the per-token loss. `turn_ids` [B, T] reaches an aggregation that takes a
    `turn_ids` keyword (turn_mean).
    """
    aggregate = AGGREGATIONS.build(aggregation) if isinstance(aggregation, str) else aggregation
    extra = {"turn_ids": turn_ids} if turn_ids is not None and _takes_turn_ids(aggregate) else {}
    probe = torch.zeros(mask.shape, dtype=dtype, device=mask.device, requires_grad=True)  # [B, T]
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(aggregate(probe, mask, group_ids, **extra), probe, allow_unused=True)
    if weights is None:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return torch.where(mask, weights, 0.0).detach()  # [B, T]


def weighted_sum(per_token_loss: Tensor, weights: Tensor) -> Tensor:
    """A micro-batch's share of the aggregate: sum of weights * loss (weights from `token_weights`).  []"""
    return (per_token_loss * weights.to(per_token_loss.dtype)).sum()  # []
