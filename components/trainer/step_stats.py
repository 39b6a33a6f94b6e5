"""A learner step's statistics (learner rank 0): from the step's plan and every rank's partial results.

`finish_stats` for a step of one optimizer update, `finish_update_stats` for a step of several
(train.update_epochs x train.mini_batches; components/trainer/learner.py "Update epochs"). Split from
learner.py, which re-exports both.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from components.losses import STANDARD_DIAGNOSTICS, loss_diagnostics
from components.mismatch import NONE, mismatch_stats
from components.registry import LOSSES, MISMATCH_CORRECTIONS
from components.trainer.config import component_params
from components.trainer.rollout import turn_lag_stats

if TYPE_CHECKING:
    from components.trainer.step_plan import StepPlan

__all__ = ["finish_stats", "finish_update_stats", "quantile_stats", "RATIO_QUANTILES", "LAG_QUANTILES"]


def finish_stats(plan: "StepPlan", parts: Optional[list], version: int, cfg, time_train: float) -> dict:
    """The metrics of a step from the plan and every rank's partial results (rank order)."""
    stats = dict(plan.stats)
    if parts is None:  # nothing trained: no optimizer update, the version stays
        stats.update(_empty_step_stats(version))
        stats["time_train"] = time_train
        if cfg.kl_coef > 0:
            stats["kl"] = math.nan
        return stats
    batch, advantages = plan.batch, plan.advantages
    B, T = batch.mask.shape
    logp_all = _scatter_rows(plan.rows, [p["logp"] for p in parts], B, T)  # [B, T]
    entropy_all = _scatter_rows(plan.rows, [p["entropy"] for p in parts], B, T)  # [B, T]
    mask = batch.mask
    loss_params = component_params(cfg, LOSSES, cfg.loss)
    diag = loss_diagnostics(cfg.loss, logp_all, batch.gen_logp, advantages, mask, **loss_params)
    if cfg.mismatch_correction != NONE:  # the loss's ratio was against sg(logp): clip_frac is what it clipped there
        against_self = loss_diagnostics(cfg.loss, logp_all, logp_all, advantages, mask, **loss_params)
        diag.update({k: v for k, v in against_self.items() if k.startswith("clip_frac")})
    return _trained_stats(stats, plan, logp_all, entropy_all, parts, diag, cfg, version=version, lag_version=version,
                          loss=float(sum(p["loss"] for p in parts)), grad_norm=parts[0]["grad_norm"], lr=parts[0]["lr"],
                          time_train=time_train, optimizer_steps=1)


def _scatter_rows(row_orders: Sequence[torch.Tensor], per_rank: Sequence[Sequence[torch.Tensor]], B: int, T: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-micro-batch [b, t] values of every rank put back at their rows of the step batch.  [B, T]

    row_orders [ranks] index tensors (the rows each rank trained, in micro-batch order); per_rank [ranks]
    lists of [b, t] tensors (dummy micro-batches report none). Rows not given stay as in `out` (zeros)."""
    out = torch.zeros(B, T) if out is None else out  # [B, T]
    for rows, values in zip(row_orders, per_rank):
        start = 0
        for v in values:
            idx = rows[start : start + v.shape[0]]
            out[idx, : v.shape[1]] = v
            start += v.shape[0]
    return out


def finish_update_stats(plan: "StepPlan", updates: list, start_version: int, version: int, cfg, time_train: float) -> dict:
    """The metrics of a step of several updates (`Learner.train_updates`): `updates` holds (epoch, MiniBatchPlan,
    every rank's partial results) per update, in order. Statistics of the policy before the update come from
    each row's first-epoch forward; the clip fractions and IS ratios from every pass, against the fixed pi_old
    (gen_logp, or the learner's pi_old with a mismatch correction); loss, grad_norm and lr are means over the
    updates (module docstring, "Update epochs")."""
    batch, advantages = plan.batch, plan.advantages
    B, T = batch.mask.shape
    epochs = 1 + max(e for e, _, _ in updates)
    logp = [torch.zeros(B, T) for _ in range(epochs)]  # [epochs] x [B, T] each pass's log-probs
    entropy_all = torch.zeros(B, T)  # [B, T] first epoch
    first_parts = []  # every first-epoch rank result, re-indexed to the step batch (for the KL)
    for epoch, mini, parts in updates:
        _scatter_rows(mini.rows, [p["logp"] for p in parts], B, T, out=logp[epoch])
        if epoch == 0:
            _scatter_rows(mini.rows, [p["entropy"] for p in parts], B, T, out=entropy_all)
            first_parts += [(rows, part) for rows, part in zip(mini.rows, parts)]
    old_logp = batch.gen_logp  # [B, T] the fixed pi_old of the losses' ratio without a correction
    if cfg.mismatch_correction != NONE:  # the learner's pi_old, fixed before the first update
        minis = [mini for epoch, mini, _ in updates if epoch == 0]
        old_logp = _scatter_rows([rows for mini in minis for rows in mini.rows],
                                 [[mb.old_logp for mb in shard if not mb.dummy] for mini in minis for shard in mini.shards],
                                 B, T)  # [B, T]
    passes = torch.cat(logp)  # [epochs * B, T]
    mask, adv = batch.mask.repeat(epochs, 1), advantages.repeat(epochs)  # [epochs * B, T], [epochs * B]
    loss_params = component_params(cfg, LOSSES, cfg.loss)
    diag = loss_diagnostics(cfg.loss, passes, batch.gen_logp.repeat(epochs, 1), adv, mask,
                            **loss_params)  # IS ratios vs the generator
    against_old = loss_diagnostics(cfg.loss, passes, old_logp.repeat(epochs, 1), adv, mask,
                                   **loss_params)  # what the losses clipped
    diag.update({k: v for k, v in against_old.items() if k.startswith("clip_frac")})
    losses = [float(sum(p["loss"] for p in parts)) for _, _, parts in updates]
    first = [part for _, part in first_parts]
    return _trained_stats(dict(plan.stats), plan, logp[0], entropy_all, first, diag, cfg, version=version,
                          lag_version=start_version + 1, loss=math.fsum(losses) / len(losses),
                          grad_norm=math.fsum(p[0]["grad_norm"] for _, _, p in updates) / len(updates),
                          lr=math.fsum(p[0]["lr"] for _, _, p in updates) / len(updates), time_train=time_train,
                          optimizer_steps=len(updates), kl_rows=[rows for rows, _ in first_parts],
                          mismatch_old=old_logp if cfg.mismatch_correction != NONE else None)


def _trained_stats(stats: dict, plan: "StepPlan", logp_all: torch.Tensor, entropy_all: torch.Tensor, parts: list,
                   diag: dict, cfg, *, version: int, lag_version: int, loss: float, grad_norm: float, lr: float,
                   time_train: float, optimizer_steps: int, kl_rows: Optional[list] = None,
                   mismatch_old: Optional[torch.Tensor] = None) -> dict:
    """The metrics of a step that trained: logp_all and entropy_all [B, T] are the rows' log-probs and
    entropies before their update, `parts` the rank results holding the KL values (in `kl_rows` order, else
    the plan's), `diag` the loss diagnostics; the lag is counted from `lag_version` - 1; the mismatch
    metrics compare `mismatch_old` [B, T] (default logp_all) with the generator."""
    batch, advantages = plan.batch, plan.advantages
    B, T = batch.mask.shape
    mask = batch.mask
    gap = (logp_all - batch.gen_logp)[mask].abs()  # [N]
    lag = (lag_version - 1 - batch.versions[mask]).float()  # [N] versions behind the learner when it trained
    gap_lag0 = gap[lag == 0]  # [N0] tokens sampled by the very weights trained on: kernel/precision mismatch only
    stats.update(
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        entropy=float(entropy_all[mask].mean()) if bool(mask.any()) else math.nan,
        clip_frac=diag["clip_frac"],
        is_ratio_mean=diag["is_ratio_mean"],
        is_ratio_min=diag["is_ratio_min"],
        is_ratio_max=diag["is_ratio_max"],
        logprob_gap_mean=float(gap.mean()) if gap.numel() else math.nan,
        logprob_gap_max=float(gap.max()) if gap.numel() else math.nan,
        lag_mean=float(lag.mean()) if lag.numel() else math.nan,
        lag_max=int(lag.max()) if lag.numel() else 0,
        logprob_gap_lag0=float(gap_lag0.mean()) if gap_lag0.numel() else math.nan,
        **_mechanism_quantiles(logp_all, batch.gen_logp, mask, lag),
        advantage_abs_mean=float(advantages.abs().mean()),
        trained_tokens=int(mask.sum()),
        trained_seq_tokens=int(batch.attention_mask.sum()),
        version=version,
        time_train=time_train,
    )
    if getattr(cfg, "environment", None) and batch.turn_ids is not None:  # multi-turn: the lag of each turn
        stats.update(turn_lag_stats(batch.versions, mask, batch.turn_ids, lag_version))
    # the reference-KL penalty (train.kl_coef > 0): `kl` is the mean per-token estimate over the trained tokens
    if any("kl" in part for part in parts):
        kl_all = _scatter_rows(plan.rows if kl_rows is None else kl_rows, [p.get("kl", []) for p in parts], B, T)  # [B, T]
        stats["kl"] = float(kl_all[mask].mean()) if bool(mask.any()) else math.nan
    # what the loss's own diagnostics hook reports beyond the standard fields (a user's loss metrics)
    stats.update({k: v for k, v in diag.items() if k not in STANDARD_DIAGNOSTICS and k not in stats})
    # generator vs learner before the update (free: logp_all are those log-probs); components/mismatch.py
    old = logp_all if mismatch_old is None else mismatch_old  # [B, T]
    stats.update(mismatch_stats(cfg.mismatch_correction, old, batch.gen_logp, mask,
                                component_params(cfg, MISMATCH_CORRECTIONS, cfg.mismatch_correction)))
    stats["optimizer_steps"] = optimizer_steps
    return stats


RATIO_QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)  # ratio_p01 ... ratio_p99: how far the importance ratios spread
LAG_QUANTILES = (0.5, 0.9)  # lag_p50, lag_p90 (lag_mean and lag_max beside them)


def quantile_stats(values: torch.Tensor, qs: Sequence[float], prefix: str) -> dict:
    """{f"{prefix}{round(100 q):02d}": the q-quantile of the 1-D `values`} (NaN when empty)."""
    keys = [f"{prefix}{round(100 * q):02d}" for q in qs]
    if not values.numel():
        return dict.fromkeys(keys, math.nan)
    got = torch.quantile(values.double(), torch.tensor(qs, dtype=torch.float64))  # [len(qs)]
    return {k: float(v) for k, v in zip(keys, got)}


def _mechanism_quantiles(logp: torch.Tensor, gen_logp: torch.Tensor, mask: torch.Tensor, lag: torch.Tensor) -> dict:
    """The meters of the off-policy mechanisms over the trained tokens: quantiles of the importance
    ratio pi_train / pi_gen (before the update) and of the policy lag. logp, gen_logp, mask [B, T];
    lag [N] (N = mask.sum())."""
    ratio = torch.exp(logp.detach() - gen_logp)[mask]  # [N]
    return {**quantile_stats(ratio, RATIO_QUANTILES, "ratio_p"), **quantile_stats(lag, LAG_QUANTILES, "lag_p")}


def _empty_step_stats(version: int) -> dict:
    nan = math.nan
    return dict(
        loss=nan, grad_norm=nan, lr=nan, entropy=nan, clip_frac=nan, is_ratio_mean=nan, is_ratio_min=nan,
        is_ratio_max=nan, logprob_gap_mean=nan, logprob_gap_max=nan, lag_mean=nan, lag_max=nan, logprob_gap_lag0=nan,
        **{f"ratio_p{round(100 * q):02d}": nan for q in RATIO_QUANTILES},
        **{f"lag_p{round(100 * q):02d}": nan for q in LAG_QUANTILES},
        advantage_abs_mean=nan, trained_tokens=0, trained_seq_tokens=0, version=version, skipped_update=1, optimizer_steps=0,
        mismatch_kl=nan, mismatch_masked_frac=nan,
    )
