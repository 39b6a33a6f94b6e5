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
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.aggregation import group_index
from components.registry import ADVANTAGE_NORMS

__all__ = ["none", "prompt", "batch", "group_centered", "group_std"]


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
