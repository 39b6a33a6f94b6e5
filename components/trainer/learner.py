"""The learner: one optimizer step on a batch of rollout groups, read top to bottom.

    filters -> advantages -> loss -> aggregation (global weights across micro-batches)
            -> AdamW (warmup, eps 1e-15, weight decay, grad clipping) -> new version
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np
import torch

from components.aggregation import token_weights, weighted_sum
from components.losses import loss_diagnostics
from components.registry import ADVANTAGE_NORMS, AGGREGATIONS, LOSSES
from components.trainer.rollout import Batch, Rollout, collate

__all__ = ["Learner", "token_logprobs", "make_optimizer", "count_parameters"]


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def token_logprobs(model, batch: Batch, temperature: float, with_entropy: bool = True):
    """Trainer log-prob (and entropy) of each completion token under `model`.

    Returns logp [B, T] (carries grad) and entropy [B, T] (no grad, or None). The log-prob is
    the engines' shared definition (`components.engines.logprobs.token_logprobs`), on the
    same forward pass as `sequence_logprobs` (positions from the attention mask), so the
    trainer, the engines and the gap metric agree.
    """
    from components.engines.logprobs import position_ids_from_mask
    from components.engines.logprobs import token_logprobs as shared_token_logprobs

    P = batch.completion_start
    T = batch.input_ids.shape[1] - P
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids_from_mask(batch.attention_mask),
        use_cache=False,
        logits_to_keep=T + 1,  # logits at columns P-1 .. L-1
    )
    logits = out.logits[:, :-1, :]  # [B, T, V]: column P-1+t predicts token P+t
    targets = batch.input_ids[:, P:]  # [B, T]
    logp = shared_token_logprobs(logits, targets, temperature)  # [B, T] float32
    entropy = None
    if with_entropy:
        with torch.no_grad():
            lp = torch.log_softmax(logits.detach().float() / temperature, dim=-1)  # [B, T, V], as token_logprobs
            entropy = -(lp.exp() * lp).sum(-1)  # [B, T]
    return logp, entropy


def make_optimizer(model: torch.nn.Module, *, lr: float, betas, eps: float, weight_decay: float, warmup_steps: int):
    """AdamW + linear warmup to a constant LR (the paper's schedule)."""
    params = list(model.parameters())
    # the fused kernel is ~3x faster than the per-parameter loop on CPU for small models
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused)
    warm = max(int(warmup_steps), 0)

    def factor(update: int) -> float:
        return 1.0 if warm == 0 else min(1.0, (update + 1) / warm)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler


class Learner:
    """Owns the trained model, its optimizer and the step function."""

    def __init__(self, model, cfg, pad_id: int, device: torch.device):
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        self.device = device
        self.version = 0  # number of optimizer updates applied
        self.optimizer, self.scheduler = make_optimizer(
            model,
            lr=cfg.lr,
            betas=cfg.adam_betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            warmup_steps=cfg.warmup_steps,
        )
        self.loss_fn = LOSSES.get(cfg.loss)
        self.aggregate_name = AGGREGATIONS.check(cfg.aggregation)
        self.advantage_fn = ADVANTAGE_NORMS.get(cfg.advantage_norm)
        self.num_parameters = count_parameters(model)

    # -------------------------------------------------------------------------------------
    def step(self, rollouts: Sequence[Rollout], keep: Sequence[bool]) -> dict:
        """One learner step on `rollouts`; `keep[i]` is the curriculum filters' verdict on group i."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if not rollouts or not any(r.completions for r in rollouts):  # e.g. a refill that found nothing
            stats = {"prompts": len(rollouts), "generations": 0, "tokens": 0, "reward_mean": math.nan, "pass_rate": math.nan,
                     "zero_variance_frac": math.nan, "filtered_frac": math.nan, "truncation_rate": math.nan,
                     "completion_len_mean": math.nan, "verifier_errors": 0, "multi_version_frac": 0.0, "groups_trained": 0,
                     "forced_tokens": 0, "interrupted_frac": math.nan}
            stats.update(_empty_step_stats(self.version))
            stats["time_train"] = time.perf_counter() - t0
            return stats
        all_batch = collate(rollouts, self.pad_id)
        stats = _rollout_stats(all_batch, rollouts, keep)

        # 1. filters: groups the curriculum drops leave the loss (no refill here)
        kept = [r for r, k in zip(rollouts, keep) if k]
        stats["groups_trained"] = len(kept)
        if not kept or sum(len(r.completions) for r in kept) == 0:
            stats.update(_empty_step_stats(self.version))
            stats["time_train"] = time.perf_counter() - t0
            return stats
        # the kept groups' rows of the step batch (no second collate)
        kept_rows = torch.tensor([k for r, k in zip(rollouts, keep) for _ in r.completions], dtype=torch.bool)  # [B_all]
        batch = all_batch if bool(kept_rows.all()) else all_batch.select(kept_rows)
        batch = batch.to(self.device)

        # 2. advantages: one per sequence, normalised by name (ADVANTAGE_NORMS)
        advantages = self.advantage_fn(batch.rewards.double(), batch.group_ids).float()  # [B]

        # 3.-4. loss and aggregation: weights computed on the WHOLE batch, so micro-batches sum exactly
        weights = token_weights(self.aggregate_name, batch.mask, batch.group_ids)  # [B, T]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        logp_parts, entropy_parts = [], []
        B = len(batch)
        for start in range(0, B, cfg.micro_batch_size):
            mb = batch.slice(start, start + cfg.micro_batch_size)
            logp, entropy = token_logprobs(self.model, mb, cfg.temperature)  # [b, T] each
            per_token = self.loss_fn(logp, mb.gen_logp, advantages[start : start + len(mb)], mb.mask)  # [b, T]
            loss = weighted_sum(per_token, weights[start : start + len(mb)])  # []
            loss.backward()
            total_loss += float(loss.detach())
            logp_parts.append(logp.detach())
            entropy_parts.append(entropy)

        # 5. optimizer step: clip, AdamW, schedule; the new weights are version + 1
        grad_norm = _grad_norm(self.model, cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        lag = (self.version - batch.versions[batch.mask]).float()  # [N] versions behind the learner
        self.version += 1

        # diagnostics on the trained tokens
        logp_all = torch.cat(logp_parts)  # [B, T]
        entropy_all = torch.cat(entropy_parts)  # [B, T]
        diag = loss_diagnostics(cfg.loss, logp_all, batch.gen_logp, advantages, batch.mask)
        gap = (logp_all - batch.gen_logp)[batch.mask].abs()
        stats.update(
            loss=total_loss,
            grad_norm=grad_norm,
            lr=lr,
            entropy=float(entropy_all[batch.mask].mean()),
            clip_frac=diag["clip_frac"],
            is_ratio_mean=diag["is_ratio_mean"],
            is_ratio_min=diag["is_ratio_min"],
            is_ratio_max=diag["is_ratio_max"],
            logprob_gap_mean=float(gap.mean()),
            logprob_gap_max=float(gap.max()),
            lag_mean=float(lag.mean()),
            lag_max=int(lag.max()),
            advantage_abs_mean=float(advantages.abs().mean()),
            trained_tokens=int(batch.mask.sum()),
            trained_seq_tokens=int(batch.attention_mask.sum()),
            version=self.version,
            time_train=time.perf_counter() - t0,
        )
        return stats

    # -------------------------------------------------------------------------------------
    def weights_for_generators(self) -> dict:
        """The current weights on CPU, to be serialized at once (no copy on CPU: serializing is the copy)."""
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])


def _grad_norm(model, clip: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    max_norm = clip if clip and clip > 0 else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def _rollout_stats(batch: Batch, rollouts: Sequence[Rollout], keep: Sequence[bool]) -> dict:
    """Statistics over EVERY group of the step (before filtering)."""
    n_groups = len(rollouts)
    zero_var = sum(1 for r in rollouts if len(set(float(x) for x in r.rewards)) <= 1)
    # completions whose sampled tokens came from more than one policy version (in-flight updates)
    spans = [len({v for v, f in zip(c.versions, c.forced) if not f}) > 1 for r in rollouts for c in r.completions]
    return {
        "prompts": n_groups,
        "generations": len(batch),
        "tokens": int(batch.num_tokens.sum()),
        "reward_mean": float(batch.rewards.mean()) if len(batch) else math.nan,
        "pass_rate": float(batch.passed.float().mean()) if len(batch) else math.nan,
        "zero_variance_frac": zero_var / max(n_groups, 1),
        "filtered_frac": 1.0 - sum(bool(k) for k in keep) / max(n_groups, 1),
        "truncation_rate": float(batch.truncated.float().mean()) if len(batch) else math.nan,
        "completion_len_mean": float(batch.num_tokens.float().mean()) if len(batch) else math.nan,
        "verifier_errors": int(sum(r.verifier_errors for r in rollouts)),
        "multi_version_frac": sum(spans) / max(len(spans), 1),
        "forced_tokens": int(sum(sum(bool(f) for f in c.forced) for r in rollouts for c in r.completions)),
        "interrupted_frac": float(np.mean([c.finish_reason == "interrupted" for r in rollouts for c in r.completions]))
        if len(batch) else math.nan,
    }


def _empty_step_stats(version: int) -> dict:
    nan = math.nan
    return dict(
        loss=nan, grad_norm=nan, lr=nan, entropy=nan, clip_frac=nan, is_ratio_mean=nan, is_ratio_min=nan,
        is_ratio_max=nan, logprob_gap_mean=nan, logprob_gap_max=nan, lag_mean=nan, lag_max=nan,
        advantage_abs_mean=nan, trained_tokens=0, trained_seq_tokens=0, version=version, skipped_update=1,
    )
