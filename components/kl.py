"""Per-token estimators of KL(pi || pi_ref) from one sampled token (registry `KL_ESTIMATORS`).

The reference-KL penalty (``train.kl_coef > 0``) adds ``kl_coef * kl`` to every trained token's
loss, so the run's aggregation weighs it like the policy loss; ``train.kl_estimator`` picks `kl`.
Every estimator has one signature::

    estimator(logp, ref_logp) -> kl   # [B, T]

- logp      [B, T]  the trained policy's log-prob of each sampled token (carries grad)
- ref_logp  [B, T]  the frozen reference policy's log-prob of the same token (no grad)

With the log-ratio log r = ref_logp - logp (r = pi_ref / pi, the token sampled from pi), the
three estimators of J. Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html) are

    k1 = -log r                  unbiased, high variance, can be negative
    k2 = (log r)^2 / 2           biased (low for close policies), low variance, >= 0
    k3 = (r - 1) - log r         unbiased, low variance, >= 0 (r - 1 >= log r)

Each is elementwise: padding is the caller's to mask. The gradient flows through `logp` only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.registry import KL_ESTIMATORS

__all__ = ["k1", "k2", "k3"]


def _log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log r = log pi_ref - log pi per token, the reference side held constant.  [B, T]"""
    return ref_logp.detach() - logp  # [B, T]


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = -log r = log pi - log pi_ref: unbiased, high variance, may be negative (Schulman 2020)."""
    return -_log_ratio(logp, ref_logp)  # [B, T]


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = (log r)^2 / 2: biased, low variance, >= 0 (Schulman 2020)."""
    return 0.5 * _log_ratio(logp, ref_logp).square()  # [B, T]


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = (r - 1) - log r: unbiased, low variance, >= 0 (Schulman 2020; GRPO's KL term)."""
    log_r = _log_ratio(logp, ref_logp)  # [B, T]
    return torch.expm1(log_r) - log_r  # [B, T]
