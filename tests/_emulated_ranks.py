"""A test double: ONE process computing a learner step in the arithmetic of two FSDP2 ranks.

It checks the sharded arithmetic of the learner on one device, bit for bit against two real gloo
ranks (tests/test_learner_ranks.py, tests/test_lora.py, tests/test_mismatch.py). It is not a way
to train, so it lives here and not in components/.

FSDP2 reduces after each backward: rank r computes micro-batch m of its shard, the ranks'
gradients of micro-batch m are summed (reduce-scatter) and added to the sharded gradient,
micro-batch after micro-batch. `accumulate_as_ranks` does the same in one process: each shard's
micro-batch m gets its own gradient, those are summed across shards in rank order, and the sum is
added to the step's gradient. With two ranks the reduction is one addition, exact and order-free
(the loss scale T and FSDP2's division by T are powers of two, also exact), so .grad ends bit for
bit equal to the two ranks' sharded gradients put together. `sharded_grad_norm` reduces the grad
norm as DTensor reduces it from the dim-0 shards. Only 2 ranks: at more, the collective sums in
its own order.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch


def sharded_grad_norm(grads: Sequence[torch.Tensor], ranks: int) -> torch.Tensor:
    """The total 2-norm of `grads` [full tensors] computed as `ranks` FSDP2 ranks compute it from
    their dim-0 shards (`clip_grad_norm_` on DTensors), bit for bit: each rank takes the norm of
    each of its shards (torch.chunk along dim 0, FSDP2's split; a rank past the last chunk holds
    an empty one), every parameter's norm is reduced over the ranks as (sum of squares) ** 0.5
    (DTensor's partial norm), then the norms of all parameters are stacked and normed. Returns a
    0-d tensor."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for g in grads:
        chunks = list(torch.chunk(g, ranks, dim=0))  # FSDP2 `Shard(0)`
        chunks += [g.new_empty(0)] * (ranks - len(chunks))
        for r, c in enumerate(chunks):
            per_rank[r].append(c)
    local = [torch._foreach_norm(ts, 2.0) for ts in per_rank]  # [ranks][params] 0-d each
    norms = []
    for p in range(len(grads)):
        total = local[0][p] ** 2.0
        for r in range(1, ranks):
            total = total + local[r][p] ** 2.0
        norms.append(total ** (1.0 / 2.0))
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def accumulate_as_ranks(learner, shards) -> list[dict]:
    """Forward + backward over EVERY shard of a step in the arithmetic of `len(shards)` ranks
    (the gradients end in .grad); one partial result per shard, as the ranks would return."""
    learner.model.train()
    learner.optimizer.zero_grad(set_to_none=True)
    params = [p for p in learner.model.parameters() if p.requires_grad]
    n_mb = {len(s) for s in shards}
    if len(n_mb) != 1:
        raise RuntimeError(f"every rank needs the same number of micro-batches, got {[len(s) for s in shards]}")
    parts = [{"loss": 0.0, "logp": [], "entropy": []} for _ in shards]
    step_grad: list[torch.Tensor] | None = None
    for m in range(n_mb.pop()):
        reduced: list[torch.Tensor] | None = None
        for part, shard in zip(parts, shards):
            loss, logp, entropy, extra = learner.backward(shard[m], 1.0)
            part["loss"] += loss
            for key, value in extra.items():
                part.setdefault(key, []).append(value)
            if logp is not None:
                part["logp"].append(logp)
                part["entropy"].append(entropy)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            for p in params:
                p.grad = None
            reduced = grads if reduced is None else [a + b for a, b in zip(reduced, grads)]
        step_grad = reduced if step_grad is None else [a + b for a, b in zip(step_grad, reduced)]
    for p, g in zip(params, step_grad or []):
        p.grad = g
    return parts


def clip_as_ranks(learner, ranks: int) -> float:
    """The grad norm reduced as `ranks` ranks reduce it, and the clip to cfg.grad_clip with it."""
    params = [p for p in learner.model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    clip = learner.cfg.grad_clip
    norm = sharded_grad_norm([p.grad for p in params], ranks)
    torch.nn.utils.clip_grads_with_norm_(params, clip if clip and clip > 0 else float("inf"), norm)
    return float(norm)


def update_as_ranks(learner, shards) -> list[dict]:
    """ONE optimizer update on every shard (accumulate, clip, AdamW) in the arithmetic of len(shards)
    ranks; one partial result per shard, the first carrying the grad norm, lr and time
    (`Learner.update_all_ranks` as T ranks compute it)."""
    t0 = time.perf_counter()
    parts = accumulate_as_ranks(learner, shards)
    grad_norm = clip_as_ranks(learner, len(shards))
    lr = learner.update()
    parts[0].update(grad_norm=grad_norm, lr=lr, time_train=time.perf_counter() - t0)
    return parts


def step_as_ranks(learner, rollouts, ranks: int = 2) -> dict:
    """One whole learner step (plan, every shard, clip, AdamW) of ONE process in the arithmetic of
    `ranks` ranks; returns the step's statistics as `Learner.train` would. With train.update_epochs
    x train.mini_batches > 1, the step's updates as `Learner.train_updates` makes them: pi_old fixed
    first (every shard's micro-batches, `Learner.old_logprobs`, as each rank computes its own), then
    every epoch over every mini-batch, one update each."""
    from components.trainer.learner import finish_stats, finish_update_stats, plan_step

    t0 = time.perf_counter()
    plan = plan_step(rollouts, [True] * len(rollouts), learner.cfg, learner.pad_id, ranks)
    if not plan.shards:
        return finish_stats(plan, None, learner.version, learner.cfg, time.perf_counter() - t0)
    if learner.cfg.updates_per_step == 1:
        parts = update_as_ranks(learner, plan.shards)
        return finish_stats(plan, parts, learner.version, learner.cfg, time.perf_counter() - t0)
    start_version = learner.version
    minis = plan.mini_batch_plans()
    if learner.fixes_old_logprobs:
        for mini in minis:
            for shard in mini.shards:
                learner.old_logprobs(shard)
    updates = [(epoch, mini, update_as_ranks(learner, mini.shards))
               for epoch in range(learner.cfg.update_epochs) for mini in minis]
    return finish_update_stats(plan, updates, start_version, learner.version, learner.cfg, time.perf_counter() - t0)
