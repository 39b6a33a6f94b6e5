"""The learner: one optimizer step on a batch of rollout groups, read top to bottom.

    (learner rank 0, on the WHOLE step batch)
    filters -> advantages -> aggregation token weights -> split rows across the T ranks
            -> micro-batches per rank (equal count on every rank: FSDP2 collectives must match)
    (every learner rank, on its share)
    loss (x the mismatch correction's weight, components/mismatch.py)
         (+ kl_coef * KL to the frozen reference policy, - entropy_coef * entropy, per token)
         -> weighted_sum with the global weights (x T: FSDP2 averages gradients over ranks)
         -> backward per micro-batch -> clip the global grad norm -> AdamW -> new version

Master weights, gradients and AdamW state are float32 whatever the precision policy. The
policy decides the COMPUTE path (`PrecisionPolicy.compute_context`): with one rank, autocast to
bfloat16 (the fp32 LM head computed outside autocast for ``bf16_fp32_head``, the bf16 head in
bf16); with T > 1 ranks, FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` per
decoder block and an fp32 root for the fp32 head. On CPU bf16 is EMULATED by default
(``precision.emulate = "auto"``): fp32 compute with values rounded to bf16 where bf16 rounds,
FSDP2 then computing in fp32 (components/precision.py). What the generators receive is cast
per policy by weight_sync.

LoRA (``train.lora_rank`` > 0, components/trainer/lora.py): peft adapters are injected into the
model in place before checkpointing, sharding and compile; the base is frozen, so the optimizer,
the clip and the gradient reductions hold the adapters only, and the generators receive merged
weights (weight_sync). The KL penalty's reference is then the policy's own frozen base with its
adapters off (`reference_logprobs`), not a copy of the model.

Because every normaliser (token counts, per-prompt counts, sequence counts, the batch
advantage std) is computed on the whole step batch before it is split, the update does
not depend on T nor on the micro-batch size (tests/test_learner_ranks.py).

Update epochs (``train.update_epochs`` = mu, ``train.mini_batches`` = M; TRL's ``num_iterations``, verl's
``ppo_epochs`` and ``ppo_mini_batch_size``). With mu = M = 1 (the default) a step is the one update above,
bit for bit. Otherwise the step batch is split into M mini-batches of whole prompt groups (consecutive, the
same split every epoch), and the learner passes over them mu times: mu x M optimizer updates per step, each
one mini-batch. Advantages are normalised once, on the whole step batch; the aggregation's normalisers are
each mini-batch's own (an update's loss is the aggregate over its mini-batch, as TRL and verl normalise).
pi_old, the policy the losses' ratio is taken against, is FIXED for the whole step, before its first update:
- without a mismatch correction it is the generator's pi_gen (``gen_logp``, the paper's pi_gen(theta_old),
  DESIGN.md), recorded when the batch was sampled: the policy that generated it;
- with one (components/mismatch.py) it is the learner's own log-prob under the weights current when the
  batch arrived, computed by one no-grad forward over the batch before the first update
  (`Learner.fix_old_logprobs`, what verl's ``old_log_prob`` and TRL's ``old_per_token_logps`` are); the
  correction's weight pi_old / pi_gen is then fixed too.
pi_theta moves with every update, so the clipped losses' ratios leave 1 and their clip fractions rise.
The step's metrics: `loss`, `grad_norm` and `lr` are means over its updates, `optimizer_steps` their number,
the clip fractions and IS-ratio statistics are over every pass (each epoch's forward of each row), and the
before-the-update statistics (entropy, log-prob gap, ratio quantiles, mismatch, KL) come from each row's
first-epoch forward. `version` counts optimizer updates, so it grows by mu x M per step (the lag and
pipeline_rl's k count updates too).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from components.aggregation import token_weights, weighted_sum
from components.environments import observation_token_count
from components.losses import STANDARD_DIAGNOSTICS, loss_diagnostics
from components.mismatch import NONE, mismatch_stats, policy_loss, resolve_correction
from components.precision import get_precision, untie_lm_head
from components.registry import ADVANTAGE_NORMS, AGGREGATIONS, KL_ESTIMATORS, LOSSES, LR_SCHEDULES
from components.trainer.forward import (enable_activation_checkpointing, pack_batch, plan_micro_batches,
                                       sequence_logprobs_packed)
from components.trainer.rollout import Batch, Rollout, collate, turn_lag_stats

__all__ = [
    "Learner",
    "MicroBatch",
    "StepPlan",
    "MiniBatchPlan",
    "split_groups",
    "StepPeers",
    "plan_step",
    "split_rows",
    "token_logprobs",
    "make_optimizer",
    "count_parameters",
    "shard_model",
    "compile_blocks",
    "load_from_rank0",
    "tied_aliases",
]


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that never trains (the KL penalty's reference policy): no grad, eval mode."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


def token_logprobs(model, batch: Batch, temperature: float, with_entropy: bool = True):
    """Trainer log-prob (and entropy) of each completion token under `model`, padded layout.

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


def make_optimizer(model: torch.nn.Module, *, lr: float, betas, eps: float, weight_decay: float, warmup_steps: int,
                   schedule: str = "constant", total_steps: int = 1, updates_per_step: int = 1):
    """AdamW + the LR schedule `schedule` (``train.lr_schedule``, components/schedules.py): linear
    warmup, then constant (the paper's schedule, the default) or a decay to 0 at `total_steps`.

    `warmup_steps` and `total_steps` count learner steps; the schedule advances once per optimizer update,
    and a step makes `updates_per_step` of them (train.update_epochs x train.mini_batches), so the warmup
    spans warmup_steps x updates_per_step updates and a decay reaches 0 after total_steps x updates_per_step:
    the LR against the step (and the compute axis) keeps its shape whatever the number of updates."""
    params = [p for p in model.parameters() if p.requires_grad]
    # the fused kernel is ~3x faster than the per-parameter loop on CPU for small models
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused)
    per_step = max(int(updates_per_step), 1)
    warm = max(int(warmup_steps), 0) * per_step
    schedule_fn = LR_SCHEDULES.get(schedule)

    def factor(update: int) -> float:
        return schedule_fn(update, warm, int(total_steps) * per_step)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler


# ---------------------------------------------------------------------------------------
# sharding
def decoder_layers(model: torch.nn.Module) -> list:
    """The decoder blocks of a transformers causal LM (model.model.layers for Llama/Qwen2-style models)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder blocks (expected model.model.layers)")
    return list(layers)


def shard_model(model: torch.nn.Module, precision: str, device: torch.device) -> torch.nn.Module:
    """FSDP2: `fully_shard` each decoder block and the root, with the policy's mixed precision, over
    the learner group (the default process group, as a one-dimensional mesh) on `device`'s type.

    The mesh is given, not left to FSDP2's default, which takes the machine's accelerator: a CPU
    (gloo) learner on a machine with GPUs would otherwise get a CUDA mesh and its shards moved there.

    Blocks compute in the policy's dtype (bf16 for bf16 / bf16_fp32_head), gradients are
    reduced in fp32, parameters stay fp32 (master). For bf16_fp32_head the root group (input
    embedding, LM head) computes in fp32 and the final norm in bf16, as the generators do.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # the learner group itself (init_device_mesh would make a new group, with torch's default timeout,
    # for a CPU mesh on a machine with CUDA)
    mesh = DeviceMesh.from_group(dist.group.WORLD, torch.device(device).type)
    policy = get_precision(precision)  # a name (real bf16) or the learner's resolved policy
    compute = policy.compute_dtype  # float32 when bf16 is emulated (precision.emulate)
    block_mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    root_dtype = torch.float32 if policy.fp32_head else compute
    root_mp = MixedPrecisionPolicy(param_dtype=root_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=block_mp)
    norm = getattr(getattr(model, "model", None), "norm", None)
    if policy.fp32_head and norm is not None:
        fully_shard(norm, mesh=mesh, mp_policy=block_mp)
    fully_shard(model, mesh=mesh, mp_policy=root_mp)
    return model


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """torch.compile each decoder block's `forward` in place (`train.compile`, with
    `train.compile_backend`); returns the number of blocks.

    Call it AFTER `fully_shard` and activation checkpointing: the compiled function is the
    block's `forward`, so FSDP2's unshard / reshard hooks (which `__call__` runs around it) stay
    outside the compiled graph, and the checkpoint transformers wraps around `forward` inside it.
    Parameter names and state-dict keys are unchanged (no `_orig_mod.` prefix). The blocks share
    their compiled graphs (one code object, parameters as graph inputs), so the number of graphs
    does not grow with the depth; the graphs take dynamic shapes from the start, so micro-batches
    of any shape reuse them.
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)  # micro-batch shapes vary
    return len(layers)


def load_from_rank0(model: torch.nn.Module, full_state: dict) -> None:
    """Give every learner rank learner rank 0's weights: each rank keeps only its own shards.

    `full_state` is rank 0's full (unsharded) state dict, `{}` on the other ranks, whose
    sharded `model` may be uninitialised (`to_empty` after a meta-device build). Parameters
    and persistent buffers go one tensor at a time through torch.distributed.checkpoint's
    `set_model_state_dict(broadcast_from_rank0=True)`; the non-persistent buffers no state
    dict carries (the rotary `inv_freq`) are broadcast after them, in module order.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # A tied head is the embedding under a second name: sent once, under the embedding's. Not
    # strict, since the alias is then absent; any other missing or unexpected key is an error.
    aliases = tied_aliases(model)
    full_state = {name: t for name, t in full_state.items() if name not in aliases}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    result = set_model_state_dict(model, full_state, options=options)
    missing = sorted(set(result.missing_keys) - set(aliases))
    if missing or result.unexpected_keys:
        raise RuntimeError(f"learner rank {dist.get_rank()}: rank 0's weights do not fit this model: missing "
                           f"{missing}, unexpected {sorted(result.unexpected_keys)}")
    with torch.no_grad():
        for _, buffer in model.named_buffers():
            dist.broadcast(buffer, src=0)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{name: first name} of every parameter reachable under a second name (a tied LM head)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


# ---------------------------------------------------------------------------------------
# the step plan (learner rank 0, whole batch)
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
    name = AGGREGATIONS.check(cfg.aggregation)
    plans = []
    for rows in split_groups(batch.group_ids, cfg.mini_batches):
        weights = torch.zeros(batch.mask.shape)  # [B, T]; only `rows` are read
        weights[rows] = token_weights(name, batch.mask[rows], batch.group_ids[rows], turn_ids=batch._turns(rows))  # [b, T]
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
    advantages = ADVANTAGE_NORMS.get(cfg.advantage_norm)(batch.rewards.double(), batch.group_ids).float()  # [B]
    # 3. aggregation weights on the whole batch: micro-batches and ranks sum exactly to the aggregate
    weights = token_weights(AGGREGATIONS.check(cfg.aggregation), batch.mask, batch.group_ids, turn_ids=batch.turn_ids)  # [B, T]
    # 4. split: rows to ranks (balanced tokens), then micro-batches per rank, equal count per rank
    all_rows = torch.arange(batch.mask.shape[0], dtype=torch.long)  # [B]
    shards, order = _shard_rows(batch, advantages, weights, all_rows, cfg, ranks)
    minis = plan_mini_batches(batch, advantages, cfg, ranks) if getattr(cfg, "mini_batches", 1) > 1 else []
    return StepPlan(shards=shards, batch=batch, advantages=advantages, rows=order, stats=stats, minis=minis)


# ---------------------------------------------------------------------------------------
class Learner:
    """Owns the trained model (fp32 master), its optimizer and the step function of one learner rank.

    With `torch.distributed` initialised for the learner group (world size T > 1) the model
    is sharded with FSDP2; otherwise it is a plain module computing under autocast.
    """

    def __init__(self, model, cfg, pad_id: int, device: torch.device):
        import torch.distributed as dist

        self.cfg = cfg
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.policy = get_precision(cfg.precision, device=self.device)  # real or emulated bf16 on this device
        self.ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.ranks > 1 else 0
        on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        if on_meta and (self.ranks == 1 or self.rank == 0):
            raise ValueError(
                f"learner rank {self.rank} of {self.ranks} got a model on the meta device (no weights): only "
                "learner ranks >= 1 of a sharded learner may start empty; rank 0 loads the checkpoint and sends them theirs"
            )
        # master weights: float32 whatever the policy; the fp32 head needs its own matrix
        if self.policy.fp32_head:
            untie_lm_head(model)
        model.to(dtype=torch.float32)
        if getattr(model, "config", None) is not None:
            model.config.scalerl_precision = self.policy.name
        if cfg.compile and self.policy.emulated:
            raise ValueError(
                f"train.compile = True needs real arithmetic, but precision {self.policy.name!r} is emulated on "
                f"{self.device.type} (precision.emulate): compiled kernels fuse the operations emulation rounds "
                "between. Use train.compile = False, train.precision = 'fp32', or precision.emulate = \"off\" (real bf16)"
            )
        # the KL penalty's reference policy (train.kl_coef > 0): a frozen copy of these initial weights
        # (model.path), taken before checkpointing, sharding or compiling; placed like the policy below.
        # Under LoRA no copy: the reference is the policy's own frozen base, its adapters off (`reference_logprobs`)
        reference = frozen_copy(model) if cfg.kl_coef > 0 and cfg.lora_rank <= 0 else None
        if cfg.lora_rank > 0:  # adapters on the frozen fp32 base, before checkpointing, sharding and compile
            from components.trainer.lora import apply_lora

            apply_lora(model, cfg)  # only the adapters require grad: the optimizer and the clip see them alone
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.num_parameters = count_parameters(model)  # before sharding: the full count
        self.num_trainable_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.model = self._place(model, on_meta)
        self.reference = self._place(reference, on_meta) if reference is not None else None
        self.version = 0  # number of optimizer updates applied
        self.optimizer, self.scheduler = make_optimizer(
            model,
            lr=cfg.lr,
            betas=cfg.adam_betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            warmup_steps=cfg.warmup_steps,
            schedule=cfg.lr_schedule,
            total_steps=cfg.total_steps,
            updates_per_step=cfg.updates_per_step,
        )
        self.loss_fn = LOSSES.get(cfg.loss)
        self.correction = resolve_correction(cfg.mismatch_correction)  # None for "none" (components/mismatch.py)
        self.kl_fn = KL_ESTIMATORS.get(cfg.kl_estimator) if cfg.kl_coef > 0 else None
        self.aggregate_name = AGGREGATIONS.check(cfg.aggregation)

    def _place(self, module: torch.nn.Module, on_meta: bool) -> torch.nn.Module:
        """`module` (the policy, or the KL penalty's frozen reference) sharded, placed on this rank's
        device and compiled; with T > 1 its weights come from learner rank 0."""
        if self.ranks > 1:
            full = module.state_dict() if self.rank == 0 else {}  # rank 0's full fp32 weights (host memory)
            # fully_shard keeps 1/T of each tensor per rank: the full model never sits on one GPU
            shard_model(module, self.policy, self.device)
            if on_meta:
                module.to_empty(device=self.device)  # this rank's shards only, filled next
            else:
                module.to(device=self.device)
            load_from_rank0(module, full)
            del full
        else:
            module.to(device=self.device)
        if self.cfg.compile:
            compile_blocks(module, self.cfg.compile_backend)  # after sharding: FSDP2's hooks stay outside the graphs
        return module

    # -------------------------------------------------------------------------------------
    def compute_context(self):
        """The compute precision of a forward pass (`PrecisionPolicy.compute_context`): autocast for an
        unsharded real-bf16 policy (the bf16 head included), bf16 emulation where it is emulated."""
        return self.policy.compute_context(self.model, self.device, sharded=self.ranks > 1)

    def logprobs(self, mb: MicroBatch):
        """logp [b, T] (grad) and entropy [b, T] of a micro-batch's completion tokens."""
        cfg = self.cfg
        batch = mb.batch.to(self.device)
        rows = pack_batch(batch) if cfg.max_tokens_per_micro_batch is not None else batch
        with self.compute_context():
            return sequence_logprobs_packed(
                self.model, rows, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size, with_entropy=True,
                compile_backend=cfg.compile_backend if cfg.compile else None,
                entropy_grad=cfg.entropy_coef > 0,  # the entropy bonus differentiates the entropy
            )

    @property
    def has_reference(self) -> bool:
        """Whether each step runs the KL penalty's reference forward (train.kl_coef > 0): on the frozen
        copy `self.reference` (full fine-tuning), or on the policy with its adapters off (LoRA, no copy:
        `self.reference` is None)."""
        return self.kl_fn is not None

    @contextlib.contextmanager
    def _reference_policy(self):
        """The module that computes the reference's log-probs, in the reference's state: the frozen copy
        as it is (eval mode), or under LoRA the policy itself in eval mode with its adapters off (its
        frozen base = its initial weights), every module's mode and adapter state restored after."""
        if self.reference is not None:
            yield self.reference
            return
        from components.trainer.lora import frozen_base

        with frozen_base(self.model):
            yield self.model

    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """ref_logp [b, T] (no grad) of a micro-batch's completion tokens under the frozen reference
        policy, computed as the policy's are (same forward, head, temperature and precision)."""
        cfg = self.cfg
        batch = mb.batch.to(self.device)
        rows = pack_batch(batch) if cfg.max_tokens_per_micro_batch is not None else batch
        sharded = self.ranks > 1
        with self._reference_policy() as reference:
            with torch.no_grad(), self.policy.compute_context(reference, self.device, sharded=sharded):
                ref_logp, _ = sequence_logprobs_packed(
                    reference, rows, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size, with_entropy=False,
                    compile_backend=cfg.compile_backend if cfg.compile else None,
                )  # [b, T]
            if sharded:
                reference.reshard()  # FSDP2 keeps the root unsharded after forward (for a backward that never comes)
        return ref_logp

    def _backward(self, mb: MicroBatch, scale: float) -> tuple[float, torch.Tensor | None, torch.Tensor | None, dict]:
        """Forward + backward of one micro-batch (gradients added into .grad). Returns its loss and,
        unless it is a dummy, the detached log-probs [b, T] and entropies [b, T] of its tokens, and
        the other detached per-token values the statistics need ({"kl": [b, T]} with a KL penalty)."""
        # the KL penalty's reference forward first: its transient memory is gone before the policy's graph exists
        ref_logp = self.reference_logprobs(mb) if self.kl_fn is not None else None  # [b, T], no grad
        logp, entropy = self.logprobs(mb)  # [b, T] each
        adv = mb.advantages.to(self.device)  # [b]
        batch = mb.batch.to(self.device)
        # train.mismatch_correction: none -> loss_fn as is; else loss_fn against sg(logp) times the weight
        old_logp = mb.old_logp.to(self.device) if mb.old_logp is not None else None  # [b, T] fixed pi_old, or None
        per_token = policy_loss(self.loss_fn, self.correction, logp, batch.gen_logp, adv, batch.mask,
                                old_logp=old_logp)  # [b, T]
        extra = {}
        # reference-KL penalty (train.kl_coef > 0): + kl_coef * kl per token, aggregated like the policy loss
        if self.kl_fn is not None:
            kl = self.kl_fn(logp, ref_logp)  # [b, T]
            kl = torch.where(batch.mask, kl, torch.zeros_like(kl))  # [b, T]
            per_token = per_token + self.cfg.kl_coef * kl  # [b, T]
            extra["kl"] = kl.detach().float().cpu()
        # entropy bonus (train.entropy_coef > 0): - entropy_coef * entropy per token (the entropy carries grad then)
        if self.cfg.entropy_coef > 0:
            bonus = torch.where(batch.mask, entropy, torch.zeros_like(entropy))  # [b, T]
            per_token = per_token - self.cfg.entropy_coef * bonus  # [b, T]
        loss = weighted_sum(per_token, mb.weights.to(self.device))  # []
        (loss * scale).backward()
        if mb.dummy:
            return float(loss.detach()), None, None, {}
        ent = entropy.detach().float().cpu() if entropy is not None else torch.zeros_like(logp).cpu()
        return float(loss.detach()), logp.detach().float().cpu(), ent, extra

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> dict:
        """Forward + backward over this rank's micro-batches (gradients summed into .grad).

        Returns this rank's partial results: the loss sum and, per micro-batch, the detached
        log-probs and entropies of its trainable tokens (rank 0 computes the statistics).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        scale = float(self.ranks)  # FSDP2 averages gradients over the ranks: undo it
        total = 0.0
        logps, entropies = [], []
        extras: dict[str, list] = {}  # per micro-batch, as logp: {"kl": [...]} with a KL penalty
        for mb in micro_batches:
            loss, logp, entropy, extra = self._backward(mb, scale)
            total += loss
            if logp is not None:
                logps.append(logp)
                entropies.append(entropy)
            for key, value in extra.items():
                extras.setdefault(key, []).append(value)
        return {"loss": total, "logp": logps, "entropy": entropies, **extras}

    def accumulate_as_ranks(self, shards: Sequence[Sequence[MicroBatch]]) -> list[dict]:
        """Forward + backward over EVERY shard of a step, in this one process, in the arithmetic
        of `len(shards)` FSDP2 ranks (`train.emulate_learner_ranks`).

        FSDP2 reduces after each backward: rank r computes micro-batch m of its shard, the
        ranks' gradients of micro-batch m are summed (reduce-scatter) and added to the sharded
        gradient, micro-batch after micro-batch. So here: each shard's micro-batch m gets its
        own gradient, those are summed across shards in rank order, and the sum is added to the
        step's gradient. With two ranks the reduction is one addition, exact and order-free
        (the loss scale T and FSDP2's division by T are powers of two, also exact), so .grad
        ends bit for bit equal to the two ranks' sharded gradients put together. Costs two more
        gradient-sized buffers; returns one partial result per shard, as the ranks would.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        n_mb = {len(s) for s in shards}
        if len(n_mb) != 1:
            raise RuntimeError(f"every rank needs the same number of micro-batches, got {[len(s) for s in shards]}")
        parts = [{"loss": 0.0, "logp": [], "entropy": []} for _ in shards]
        step_grad: list[torch.Tensor] | None = None
        for m in range(n_mb.pop()):
            reduced: list[torch.Tensor] | None = None
            for part, shard in zip(parts, shards):
                loss, logp, entropy, extra = self._backward(shard[m], 1.0)
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

    def grad_norm(self, as_ranks: int = 1) -> float:
        """The global gradient norm (over every rank's shard); clips to cfg.grad_clip when > 0.
        as_ranks > 1 (one process emulating that many ranks): the norm is reduced as the ranks
        reduce it (`sharded_grad_norm`), so the clip factor is bit for bit theirs."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        clip = self.cfg.grad_clip
        max_norm = clip if clip and clip > 0 else float("inf")
        if as_ranks > 1:
            norm = sharded_grad_norm([p.grad for p in params], as_ranks)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            return float(norm)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def apply_update(self, as_ranks: int = 1) -> tuple[float, float]:
        """Clip, AdamW, schedule; the new weights are version + 1. Returns (grad_norm, lr)."""
        grad_norm = self.grad_norm(as_ranks)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return grad_norm, lr

    def train_shard(self, micro_batches: Sequence[MicroBatch]) -> dict:
        """One step on this rank's share (a collective when T > 1): accumulate, then update."""
        t0 = time.perf_counter()
        part = self.accumulate(micro_batches)
        grad_norm, lr = self.apply_update()
        part.update(grad_norm=grad_norm, lr=lr, time_train=time.perf_counter() - t0)
        return part

    def train_as_ranks(self, shards: Sequence[Sequence[MicroBatch]]) -> list[dict]:
        """One step on every shard in the arithmetic of len(shards) ranks (one process); one
        partial result per shard, the first carrying the grad norm, lr and time."""
        t0 = time.perf_counter()
        parts = self.accumulate_as_ranks(shards)
        grad_norm, lr = self.apply_update(as_ranks=len(shards))
        parts[0].update(grad_norm=grad_norm, lr=lr, time_train=time.perf_counter() - t0)
        return parts

    # -------------------------------------------------------------------------------------
    def plan(self, rollouts: Sequence[Rollout], keep: Sequence[bool]) -> StepPlan:
        """The step's plan for this learner's ranks (`keep[i]`: the filters' verdict on group i): its
        world size, or the ranks it computes as (`train.emulate_learner_ranks`)."""
        t0 = time.perf_counter()
        plan = plan_step(rollouts, keep, self.cfg, self.pad_id, max(self.ranks, self.cfg.emulate_learner_ranks))
        plan.time_plan = time.perf_counter() - t0
        return plan

    def train(self, plan: StepPlan, peers: Optional[StepPeers] = None) -> dict:
        """THE learner step (production, tests and benchmarks): train every shard of `plan`, update
        once, return the step's statistics. Rank 0 trains shards[0] while `peers` (ranks 1..T-1,
        needed when T > 1) train the others in the same collectives. With
        ``train.emulate_learner_ranks = 2`` this one rank computes every shard in the arithmetic of
        two ranks (`train_as_ranks`): a 1-rank run then reproduces a 2-rank run bit for bit, a check
        of the sharded path on one device (components/trainer/README.md, "1 vs 2 learner ranks")."""
        t0 = time.perf_counter()
        if not plan.shards:  # nothing to train on: no optimizer update, the version stays
            return finish_stats(plan, None, self.version, self.cfg, plan.time_plan + time.perf_counter() - t0)
        if self.cfg.updates_per_step > 1:
            return self.train_updates(plan, peers)
        parts = self.update(plan.shards, peers)
        return finish_stats(plan, parts, self.version, self.cfg, plan.time_plan + time.perf_counter() - t0)

    def update(self, shards: Sequence[Sequence[MicroBatch]], peers: Optional[StepPeers] = None) -> list[dict]:
        """ONE optimizer update on `shards` (one per rank): every rank's partial results, in rank order."""
        if self.cfg.emulate_learner_ranks > 1:
            return self.train_as_ranks(shards)
        if len(shards) > 1:
            if peers is None:
                raise RuntimeError(f"a {len(shards)}-rank step needs its peer ranks (peers=None)")
            peers.send(shards[1:])
        parts = [self.train_shard(shards[0])]  # a collective with the peers when T > 1
        if len(shards) > 1:
            parts += peers.gather()
        return parts

    @property
    def fixes_old_logprobs(self) -> bool:
        """Whether a step starts with a no-grad forward for pi_old (a mismatch correction with several updates
        per step; one more forward per trained sequence in the FLOPs)."""
        return self.correction is not None and self.cfg.updates_per_step > 1

    @torch.no_grad()
    def old_logprobs(self, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """pi_old [b, T] of each micro-batch (dummies included: the ranks' collectives must match): a no-grad
        forward, in eval mode (no dropout), under the current weights. Sets each micro-batch's `old_logp`."""
        self.model.eval()
        out = []
        for mb in micro_batches:
            logp, _ = self.logprobs(mb)  # [b, T]
            mb.old_logp = logp.detach().float().cpu()
            out.append(mb.old_logp)
        if self.ranks > 1:
            self.model.reshard()  # FSDP2 keeps the root unsharded after a forward with no backward
        self.model.train()
        return out

    def fix_old_logprobs(self, minis: Sequence[MiniBatchPlan], peers=None) -> None:
        """Before a step's first update: every micro-batch of every mini-batch gets its pi_old (`old_logprobs`),
        on the rank that trains it; peer ranks compute theirs and send them back, so the micro-batches
        rank 0 hands out later carry them."""
        T = len(minis[0].shards)
        if self.cfg.emulate_learner_ranks > 1 or T == 1:
            for mini in minis:
                for shard in mini.shards:
                    self.old_logprobs(shard)
            return
        if peers is None:
            raise RuntimeError(f"a {T}-rank step needs its peer ranks (peers=None)")
        peers.score_old([[mini.shards[k] for mini in minis] for k in range(1, T)])
        for mini in minis:
            self.old_logprobs(mini.shards[0])  # the same forwards, in the same order, as the peers
        for k, per_mini in enumerate(peers.gather_old(), start=1):
            for mini, logps in zip(minis, per_mini):
                for mb, lp in zip(mini.shards[k], logps):
                    mb.old_logp = lp

    def train_updates(self, plan: StepPlan, peers: Optional[StepPeers] = None) -> dict:
        """A step of train.update_epochs x train.mini_batches optimizer updates on one batch (module docstring,
        "Update epochs"): pi_old fixed first, then every epoch passes over every mini-batch, one update each."""
        t0 = time.perf_counter()
        start_version = self.version
        minis = plan.mini_batch_plans()
        if self.fixes_old_logprobs:
            self.fix_old_logprobs(minis, peers)
        updates = []  # (epoch, mini-batch plan, every rank's partial results)
        for epoch in range(self.cfg.update_epochs):
            for mini in minis:
                updates.append((epoch, mini, self.update(mini.shards, peers)))
        return finish_update_stats(plan, updates, start_version, self.version, self.cfg,
                                   plan.time_plan + time.perf_counter() - t0)

    def step(self, rollouts: Sequence[Rollout], keep: Sequence[bool], peers: Optional[StepPeers] = None) -> dict:
        """`plan` then `train`: one step on `rollouts` (`keep[i]`: the filters' verdict on group i)."""
        return self.train(self.plan(rollouts, keep), peers)

    # -------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# statistics (learner rank 0)
def finish_stats(plan: StepPlan, parts: Optional[list], version: int, cfg, time_train: float) -> dict:
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
    diag = loss_diagnostics(cfg.loss, logp_all, batch.gen_logp, advantages, mask)
    if cfg.mismatch_correction != NONE:  # the loss's ratio was against sg(logp): clip_frac is what it clipped there
        against_self = loss_diagnostics(cfg.loss, logp_all, logp_all, advantages, mask)
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


def finish_update_stats(plan: StepPlan, updates: list, start_version: int, version: int, cfg, time_train: float) -> dict:
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
    diag = loss_diagnostics(cfg.loss, passes, batch.gen_logp.repeat(epochs, 1), adv, mask)  # IS ratios vs the generator
    against_old = loss_diagnostics(cfg.loss, passes, old_logp.repeat(epochs, 1), adv, mask)  # what the losses clipped
    diag.update({k: v for k, v in against_old.items() if k.startswith("clip_frac")})
    losses = [float(sum(p["loss"] for p in parts)) for _, _, parts in updates]
    first = [part for _, part in first_parts]
    return _trained_stats(dict(plan.stats), plan, logp[0], entropy_all, first, diag, cfg, version=version,
                          lag_version=start_version + 1, loss=math.fsum(losses) / len(losses),
                          grad_norm=math.fsum(p[0]["grad_norm"] for _, _, p in updates) / len(updates),
                          lr=math.fsum(p[0]["lr"] for _, _, p in updates) / len(updates), time_train=time_train,
                          optimizer_steps=len(updates), kl_rows=[rows for rows, _ in first_parts],
                          mismatch_old=old_logp if cfg.mismatch_correction != NONE else None)


def _trained_stats(stats: dict, plan: StepPlan, logp_all: torch.Tensor, entropy_all: torch.Tensor, parts: list,
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
    stats.update(mismatch_stats(cfg.mismatch_correction, old, batch.gen_logp, mask))
    stats["optimizer_steps"] = optimizer_steps
    return stats


RATIO_QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)  # ratio_p01 ... ratio_p99: how far the importance ratios spread
LAG_QUANTILES = (0.5, 0.9)  # lag_p50, lag_p90 (lag_mean and lag_max beside them)


def _quantile_stats(values: torch.Tensor, qs: Sequence[float], prefix: str) -> dict:
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
    return {**_quantile_stats(ratio, RATIO_QUANTILES, "ratio_p"), **_quantile_stats(lag, LAG_QUANTILES, "lag_p")}


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
        **_quantile_stats(gen_len, (0.1, 0.5, 0.9), "completion_tokens_p"),
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
