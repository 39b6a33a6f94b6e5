"""Advantage normalizations (registry `ADVANTAGE_NORMS`): rewards -> one advantage per sequence.

Signature (DESIGN.md)::

    normalize(rewards, group_ids) -> advantages

- rewards   [B]  float, one per sequence (+1 / -1 by default)
- group_ids [B]  int, the prompt (rollout group) of each sequence

All start from the group-centred advantage  A_hat = r - mean of r within its group, then
- none:   A_hat                                   (Dr. GRPO)
- prompt: A_hat / (std of r within the group + eps)   (GRPO)
- batch:  A_hat / (std of all A_hat in the batch + eps) (ScaleRL)
std is the population std (ddof=0); eps = 1e-6.

Estimators added in 2026 (each docstring names its source and the peer implementation checked):
- rloo:         r - mean of the OTHER rewards of its group (leave-one-out baseline)
- reinforce_pp: group-mean baseline, then whitened over the whole batch (REINFORCE++-baseline)

The learner calls every normalization once per step on the WHOLE step batch (after the
curriculum's filters), before the batch is split across ranks and micro-batches, so a batch-wide
statistic (the batch std here) never depends on `train.micro_batch_size` or the rank count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.aggregation import group_index
from components.registry import ADVANTAGE_NORMS

__all__ = ["none", "prompt", "batch", "rloo", "reinforce_pp", "group_centered", "group_std", "group_size"]


def _group_mean(values: Tensor, idx: Tensor, num_groups: int) -> Tensor:
    """Mean of `values` over each sequence's group, broadcast back to sequences.  [B]"""
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add(0, idx, values)  # [P]
    counts = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add(0, idx, torch.ones_like(values))  # [P]
    return (sums / counts)[idx]  # [B]


def _check(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"advantages: rewards and group_ids must both be 1-D of the same length, got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )


def group_centered(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_hat = r - mean of r within its group.  [B]"""
    _check(rewards, group_ids)
    idx, num_groups = group_index(group_ids)  # [B], P
    return rewards - _group_mean(rewards, idx, num_groups)  # [B]


def group_std(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Population std of r within each sequence's group, broadcast to sequences.  [B]"""
    idx, num_groups = group_index(group_ids)  # [B], P
    centred = rewards - _group_mean(rewards, idx, num_groups)  # [B]
    return _group_mean(centred * centred, idx, num_groups).sqrt()  # [B]


@ADVANTAGE_NORMS.register("none", ranges={"eps": "> 0"})
def none(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """Group-centred only: r - mean(r of the prompt) (Dr. GRPO)."""
    return group_centered(rewards, group_ids)  # [B]


@ADVANTAGE_NORMS.register("prompt", ranges={"eps": "> 0"})  # eps = 0: 0 / 0 on a zero-variance group
def prompt(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """Group-centred, divided by the prompt's reward std + eps (GRPO)."""
    return group_centered(rewards, group_ids) / (group_std(rewards, group_ids) + eps)  # [B]


@ADVANTAGE_NORMS.register("batch", ranges={"eps": "> 0"})
def batch(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """Group-centred, divided by the std of all centred advantages in the batch + eps (ScaleRL)."""
    centred = group_centered(rewards, group_ids)  # [B]
    return centred / (centred.std(correction=0) + eps)  # [B]


# ---------------------------------------------------------------------------------------
# estimators added in 2026
def group_size(group_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """G: the number of sequences in each sequence's group, broadcast to sequences.  [B]"""
    idx, num_groups = group_index(group_ids)  # [B], P
    ones = torch.ones(idx.shape, dtype=dtype, device=group_ids.device)  # [B]
    return torch.zeros(num_groups, dtype=dtype, device=group_ids.device).index_add(0, idx, ones)[idx]  # [B]


@ADVANTAGE_NORMS.register("rloo")
def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: r minus the mean of the other G - 1 rewards of its group (leave-one-out baseline).

    A_i = r_i - (sum_{j != i} r_j) / (G - 1) = G / (G - 1) * (r_i - mean of the group), no scaling.
    A group of one sample has no other sample to form a baseline from: its advantage is 0.

    Sources: Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al.
    2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback
    in LLMs" (arXiv 2402.14740), Eq. for the RLOO estimator. Peer: verl core_algos.py
    `compute_rloo_outcome_advantage` / `compute_rloo_vectorized_outcome_advantage` (outcome
    rewards, the same formula; for a one-sample group the vectorized one gives 0, as here, the
    loop one keeps the raw reward).
    """
    _check(rewards, group_ids)
    size = group_size(group_ids, rewards.dtype)  # [B]
    centred = group_centered(rewards, group_ids)  # [B]
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))  # [B]
    return centred * scale  # [B]


def _group_mean_baseline(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """r minus the mean of its group; a group of one keeps r (its baseline is 0, as in verl).  [B]"""
    size = group_size(group_ids, rewards.dtype)  # [B]
    return torch.where(size > 1, group_centered(rewards, group_ids), rewards)  # [B]


@ADVANTAGE_NORMS.register("reinforce_pp", ranges={"eps": "> 0"})
def reinforce_pp(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-8) -> Tensor:
    """REINFORCE++-baseline: group-mean baseline, then whitened over the whole batch.

    A'_i = r_i - mean of r in its group (a group of one keeps r_i: baseline 0), then
    A_i  = (A'_i - mean of A' over the batch) / sqrt(var of A' over the batch + eps),
    var the UNBIASED (ddof = 1) variance. A batch of one sequence has no variance: A = 0.

    Sources: Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization" (arXiv 2501.03262), the "REINFORCE++-baseline" estimator for
    outcome rewards (group-mean baseline, global batch normalization). Peer: verl core_algos.py
    `compute_reinforce_plus_plus_baseline_outcome_advantage` (group-mean subtraction with a
    0 baseline for one-sample groups, then `masked_whiten`: mean subtracted, unbiased variance,
    rsqrt(var + 1e-8)), whose arithmetic this follows.

    Difference from verl, forced by the signature (rewards, group_ids) -> one advantage per
    sequence: verl whitens over TOKENS (each sequence weighted by its completion length), this
    whitens over SEQUENCES (each weighted 1). With every group of size >= 2 the sequence-level
    mean of A' is 0, so this differs from `batch` only by the unbiased variance and eps inside
    the square root; the token-weighted version would shift every advantage by the
    length-weighted mean of A' (a zero-variance group would then get a non-zero advantage).
    """
    _check(rewards, group_ids)
    baselined = _group_mean_baseline(rewards, group_ids)  # [B]
    n = baselined.numel()
    if n < 2:
        return torch.zeros_like(baselined)  # [B]
    centred = baselined - baselined.mean()  # [B]
    var = centred.square().sum() / (n - 1)  # []
    return centred * torch.rsqrt(var + eps)  # [B]
