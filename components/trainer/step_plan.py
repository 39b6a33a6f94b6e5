"""A learner step's plan (learner rank 0, whole batch): filters, advantages and aggregation weights on the
WHOLE step batch, then its rows split across the learner ranks and into micro-batches (and, with
train.mini_batches > 1, into mini-batches of whole prompt groups). Split from learner.py, which
re-exports these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from components.aggregation import token_weights
from components.environments import observation_token_count
from components.registry import ADVANTAGE_NORMS, AGGREGATIONS
from components.trainer.config import build_component
from components.trainer.forward import plan_micro_batches
from components.trainer.rollout import Batch, Rollout, collate
from components.trainer.step_stats import quantile_stats

__all__ = ["MicroBatch", "MiniBatchPlan", "StepPlan", "StepPeers", "split_rows", "split_groups", "plan_mini_batches",
           "plan_step"]


@dataclass
class MicroBatch:
    """One forward/backward: padded rows with their share of the (global) loss normalisers."""

    batch: Batch  # [b, P+T] padded (prompts left, completions right)
    advantages: torch.Tensor  # [b] float32, normalised on the whole step batch
    weights: torch.Tensor  # [b, T] float32, aggregation token weights from the whole step batch (or mini-batch)
    # [b, T] the learner's pi_old, fixed before the step's first update (update epochs with a mismatch
    # correction: `Learner.fix_old_logprobs`); None: the loss takes sg(logp), this forward's own
    old_logp: Optional[torch.Tensor] = None

    @property
    def dummy(self) -> bool:
        return not bool(self.batch.mask.any())


@dataclass
class MiniBatchPlan:
    """One optimizer update's share of a step (train.mini_batches > 1): its rows split across the ranks."""

    shards: list  # [T] lists of MicroBatch, all of equal length (aggregation weights of this mini-batch)
    rows: list  # [T] index tensors into the STEP batch: the rows each rank trains on (in micro-batch order)


@dataclass
class StepPlan:
    """What every learner rank trains on this step, and what rank 0 keeps for the statistics."""

    shards: list  # [T] lists of MicroBatch, all of equal length
    batch: Batch  # the whole kept batch (rank 0)
    advantages: torch.Tensor  # [B]
    rows: list  # [T] index tensors: the rows of `batch` each rank trains on (in micro-batch order)
    stats: dict
    time_plan: float = 0.0  # seconds spent planning (counted in the step's time_train)
    # train.mini_batches > 1: one plan per mini-batch (whole prompt groups); [] : the step is one mini-batch
    minis: list = field(default_factory=list)

    def mini_batch_plans(self) -> list:
        """The step's mini-batches, each one optimizer update per epoch (the whole batch when there is one)."""
        return list(self.minis) or [MiniBatchPlan(shards=self.shards, rows=self.rows)]


class StepPeers(Protocol):
    """Learner ranks 1..T-1 as rank 0 sees them (the trainer hands them their shards by message)."""

    def send(self, shards: Sequence[Sequence[MicroBatch]]) -> None:
        """Hand rank k its shard, shards[k - 1]; each trains it with `Learner.train_shard`."""

    def gather(self) -> list[dict]:
        """Their partial results, in rank order (once every one has reported)."""

    def score_old(self, shards: Sequence[Sequence[Sequence[MicroBatch]]]) -> None:
        """Have rank k compute pi_old of its micro-batches of each mini-batch, shards[k - 1] (`Learner.old_logprobs`)."""

    def gather_old(self) -> list[list[list[torch.Tensor]]]:
        """Their pi_old [b, T] per micro-batch of each mini-batch, in rank order."""


def split_rows(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Assign rows to ranks with balanced token counts (longest first to the lightest rank).

    Returns `ranks` lists of row indices, each sorted ascending (so a rank's rows keep the
    batch order, and one rank gets exactly the original order).
    """
    if ranks == 1:
        return [list(range(len(lengths)))]
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda j: (-int(lengths[j]), j)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        out[r].append(i)
        load[r] += int(lengths[i])
    return [sorted(rows) for rows in out]


def _micro_batch_rows(rows: list[int], lengths: Sequence[int], cfg) -> list[list[int]]:
    """Consecutive micro-batches of `rows`: by token budget when set, else by sequence count."""
    budget = cfg.max_tokens_per_micro_batch
    if budget is None:
        n = max(int(cfg.micro_batch_size), 1)
        return [rows[i : i + n] for i in range(0, len(rows), n)]
    groups = plan_micro_batches([int(lengths[r]) for r in rows], int(budget))
    return [[rows[i] for i in g] for g in groups]


def _dummy_micro_batch(batch: Batch) -> MicroBatch:
    """One padding row with no trainable token: keeps the ranks' collective counts equal."""
    one = batch.select(torch.tensor([0])).trim()
    one.mask = torch.zeros_like(one.mask)
    return MicroBatch(one, torch.zeros(1), torch.zeros(one.mask.shape))


def split_groups(group_ids: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Row indices of `parts` consecutive mini-batches of whole groups (as equal in groups as they can be:
    numpy's array_split; fewer parts when there are fewer groups). group_ids [B]: a group's rows are
    consecutive (`collate`). Returns index tensors [b_i], in row order, covering every row once."""
    _, counts = torch.unique_consecutive(group_ids, return_counts=True)  # [G]
    starts = torch.cumsum(counts, 0) - counts  # [G] first row of each group
    out = []
    for chunk in np.array_split(np.arange(len(counts)), min(int(parts), len(counts))):
        first, last = int(chunk[0]), int(chunk[-1])
        out.append(torch.arange(int(starts[first]), int(starts[last] + counts[last]), dtype=torch.long))  # [b_i]
    return out


def _shard_rows(batch: Batch, advantages: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, cfg,
                ranks: int) -> tuple[list, list]:
    """The step batch's `rows` [b] split across `ranks` (balanced tokens), then into micro-batches per rank
    (equal count per rank, padded with dummies). weights [B, T]: the aggregation weights of these rows.
    Returns (shards [ranks] lists of MicroBatch, row order [ranks] index tensors into `batch`)."""
    lengths = batch.attention_mask[rows].sum(dim=1).tolist()  # [b] prompt + completion tokens
    per_rank = split_rows(lengths, ranks)
    groups = [_micro_batch_rows(r, lengths, cfg) for r in per_rank]
    n_mb = max(len(g) for g in groups)
    shards, order = [], []
    for g in groups:
        mbs = []
        for local in g:
            idx = rows[torch.tensor(local, dtype=torch.long)]  # [b_mb] rows of the step batch
            sub = batch.select(idx).trim()
            mbs.append(MicroBatch(sub, advantages[idx], weights[idx][:, : sub.mask.shape[1]]))
        while len(mbs) < n_mb:
            mbs.append(_dummy_micro_batch(batch))
        shards.append(mbs)
        order.append(rows[torch.tensor([r for local in g for r in local], dtype=torch.long)])
    return shards, order


def plan_mini_batches(batch: Batch, advantages: torch.Tensor, cfg, ranks: int) -> list[MiniBatchPlan]:
    """train.mini_batches > 1: the step batch in mini-batches of whole prompt groups (`split_groups`), each with
    its OWN aggregation weights (an update's loss is the aggregate over its mini-batch) and the step's advantages."""
    aggregate = build_component(cfg, AGGREGATIONS, AGGREGATIONS.check(cfg.aggregation))
    plans = []
    for rows in split_groups(batch.group_ids, cfg.mini_batches):
        weights = torch.zeros(batch.mask.shape)  # [B, T]; only `rows` are read
        weights[rows] = token_weights(aggregate, batch.mask[rows], batch.group_ids[rows], turn_ids=batch._turns(rows))  # [b, T]
        shards, order = _shard_rows(batch, advantages, weights, rows, cfg, ranks)
        plans.append(MiniBatchPlan(shards=shards, rows=order))
    return plans


def plan_step(rollouts: Sequence[Rollout], keep: Sequence[bool], cfg, pad_id: int, ranks: int) -> StepPlan:
    """Filters, advantages and aggregation weights on the WHOLE step batch, split across `ranks`
    (and, with train.mini_batches > 1, into mini-batches of whole groups: `plan_mini_batches`).

    A plan with no shards means there is nothing to train on (every group filtered, or no
    completion): no optimizer update this step.
    """
    if not rollouts or not any(r.completions for r in rollouts):  # e.g. a refill that found nothing
        stats = {"prompts": len(rollouts), "generations": 0, "tokens": 0, "reward_mean": math.nan, "pass_rate": math.nan,
                 "zero_variance_frac": math.nan, "filtered_frac": math.nan, "truncation_rate": math.nan,
                 "completion_len_mean": math.nan, "verifier_errors": 0, "multi_version_frac": 0.0, "groups_trained": 0,
                 "forced_tokens": 0, "interrupted_frac": math.nan}
        return StepPlan(shards=[], batch=None, advantages=torch.zeros(0), rows=[], stats=stats)
    all_batch = collate(rollouts, pad_id, mask_observations=getattr(cfg, "mask_observations", True))
    stats = _rollout_stats(all_batch, rollouts, keep)
    # 1. filters: groups the curriculum drops leave the loss (no refill here)
    kept = [r for r, k in zip(rollouts, keep) if k]
    stats["groups_trained"] = len(kept)
    if not kept or sum(len(r.completions) for r in kept) == 0:
        return StepPlan(shards=[], batch=all_batch, advantages=torch.zeros(0), rows=[], stats=stats)
    kept_rows = torch.tensor([k for r, k in zip(rollouts, keep) for _ in r.completions], dtype=torch.bool)  # [B_all]
    batch = all_batch if bool(kept_rows.all()) else all_batch.select(kept_rows)
    # 2. advantages: one per sequence, normalised by name on the whole batch (batch std included)
    normalize = build_component(cfg, ADVANTAGE_NORMS, cfg.advantage_norm)
    advantages = normalize(batch.rewards.double(), batch.group_ids).float()  # [B]
    # 3. aggregation weights on the whole batch: micro-batches and ranks sum exactly to the aggregate
    weights = token_weights(build_component(cfg, AGGREGATIONS, AGGREGATIONS.check(cfg.aggregation)), batch.mask,
                            batch.group_ids, turn_ids=batch.turn_ids)  # [B, T]
    # 4. split: rows to ranks (balanced tokens), then micro-batches per rank, equal count per rank
    all_rows = torch.arange(batch.mask.shape[0], dtype=torch.long)  # [B]
    shards, order = _shard_rows(batch, advantages, weights, all_rows, cfg, ranks)
    minis = plan_mini_batches(batch, advantages, cfg, ranks) if getattr(cfg, "mini_batches", 1) > 1 else []
    return StepPlan(shards=shards, batch=batch, advantages=advantages, rows=order, stats=stats, minis=minis)


def _rollout_stats(batch: Batch, rollouts: Sequence[Rollout], keep: Sequence[bool]) -> dict:
    """Statistics over EVERY group of the step (before filtering)."""
    n_groups = len(rollouts)
    zero_var = sum(1 for r in rollouts if len(set(float(x) for x in r.rewards)) <= 1)
    # completions whose sampled tokens came from more than one policy version (in-flight updates)
    spans = [len({v for v, f in zip(c.versions, c.forced) if not f}) > 1 for r in rollouts for c in r.completions]
    n = len(batch)
    # multi-turn: observation tokens are prompt tokens, never counted as generated (issue 45)
    observed = torch.tensor([observation_token_count(c) for r in rollouts for c in r.completions], dtype=torch.long)
    gen_len = (batch.num_tokens - observed).float() if n else torch.zeros(0)  # [B]
    return {
        "prompts": n_groups,
        "generations": n,
        "tokens": int(gen_len.sum()) if n else 0,
        "reward_mean": float(batch.rewards.mean()) if n else math.nan,
        "pass_rate": float(batch.passed.float().mean()) if n else math.nan,
        "zero_variance_frac": zero_var / max(n_groups, 1),
        "filtered_frac": 1.0 - sum(bool(k) for k in keep) / max(n_groups, 1),
        "truncation_rate": float(batch.truncated.float().mean()) if n else math.nan,
        "completion_len_mean": float(gen_len.mean()) if n else math.nan,
        **quantile_stats(gen_len, (0.1, 0.5, 0.9), "completion_tokens_p"),
        "verifier_errors": int(sum(r.verifier_errors for r in rollouts)),
        "multi_version_frac": sum(spans) / max(len(spans), 1),
        "forced_tokens": int(sum(sum(bool(f) for f in c.forced) for r in rollouts for c in r.completions) - observed.sum()),
        "interrupted_frac": float(np.mean([c.finish_reason == "interrupted" for r in rollouts for c in r.completions]))
        if n else math.nan,
        **_reward_part_means(rollouts),
    }


def _reward_part_means(rollouts: Sequence[Rollout]) -> dict:
    """train.reward_funcs: {"reward/<name>": the mean of that function's (unweighted) reward over every
    generation of the step that it scored (NaN: none)}; empty without reward functions."""
    names = list(dict.fromkeys(name for r in rollouts for name in (r.reward_parts or {})))
    out = {}
    for name in names:
        values = [float(v) for r in rollouts for v in (r.reward_parts or {}).get(name, ()) if math.isfinite(float(v))]
        out[f"reward/{name}"] = math.fsum(values) / len(values) if values else math.nan
    return out
