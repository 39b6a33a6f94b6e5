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
import time
from typing import Optional, Sequence

import torch

from components.aggregation import weighted_sum
from components.mismatch import policy_loss, resolve_correction
from components.precision import get_precision, untie_lm_head
from components.registry import AGGREGATIONS, KL_ESTIMATORS, LOSSES, LR_SCHEDULES, MISMATCH_CORRECTIONS
from components.trainer.config import build_component, component_params
from components.trainer.forward import enable_activation_checkpointing, pack_batch, sequence_logprobs_packed
from components.trainer.rollout import Batch, Rollout
# the step's plan and statistics live beside the learner (split for size); their names stay importable here
from components.trainer.step_plan import (MicroBatch, MiniBatchPlan, StepPeers, StepPlan, plan_mini_batches, plan_step,
                                          split_groups, split_rows)
from components.trainer.step_stats import finish_stats, finish_update_stats

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
    "plan_mini_batches",
    "finish_stats",
    "finish_update_stats",
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
                   schedule: str = "constant", total_steps: int = 1, schedule_params: Optional[dict] = None,
                   updates_per_step: int = 1):
    """AdamW + the LR schedule `schedule` (``train.lr_schedule``, components/schedules.py) with its
    hyper-parameters `schedule_params` (default: its defaults): linear warmup, then constant (the
    paper's schedule, the default) or a decay to 0 at `total_steps`.

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
    schedule_fn = LR_SCHEDULES.build(schedule, schedule_params)

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
            schedule_params=component_params(cfg, LR_SCHEDULES, cfg.lr_schedule),
            updates_per_step=cfg.updates_per_step,
        )
        self.loss_fn = build_component(cfg, LOSSES, cfg.loss)
        # None for "none" (components/mismatch.py)
        self.correction = resolve_correction(cfg.mismatch_correction,
                                             component_params(cfg, MISMATCH_CORRECTIONS, cfg.mismatch_correction))
        self.kl_fn = build_component(cfg, KL_ESTIMATORS, cfg.kl_estimator) if cfg.kl_coef > 0 else None
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

    def backward(self, mb: MicroBatch, scale: float) -> tuple[float, torch.Tensor | None, torch.Tensor | None, dict]:
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
            loss, logp, entropy, extra = self.backward(mb, scale)
            total += loss
            if logp is not None:
                logps.append(logp)
                entropies.append(entropy)
            for key, value in extra.items():
                extras.setdefault(key, []).append(value)
        return {"loss": total, "logp": logps, "entropy": entropies, **extras}

    def grad_norm(self) -> float:
        """The global gradient norm (over every rank's shard); clips to cfg.grad_clip when > 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        clip = self.cfg.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip and clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def update(self) -> float:
        """AdamW and the schedule on the (clipped) gradients; the new weights are version + 1.
        Returns the learning rate the update used."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return lr

    def apply_update(self) -> tuple[float, float]:
        """Clip, AdamW, schedule; the new weights are version + 1. Returns (grad_norm, lr)."""
        grad_norm = self.grad_norm()
        return grad_norm, self.update()

    def train_shard(self, micro_batches: Sequence[MicroBatch]) -> dict:
        """One step on this rank's share (a collective when T > 1): accumulate, then update."""
        t0 = time.perf_counter()
        part = self.accumulate(micro_batches)
        grad_norm, lr = self.apply_update()
        part.update(grad_norm=grad_norm, lr=lr, time_train=time.perf_counter() - t0)
        return part

    # -------------------------------------------------------------------------------------
    def plan(self, rollouts: Sequence[Rollout], keep: Sequence[bool]) -> StepPlan:
        """The step's plan for this learner's ranks (`keep[i]`: the filters' verdict on group i)."""
        t0 = time.perf_counter()
        plan = plan_step(rollouts, keep, self.cfg, self.pad_id, self.ranks)
        plan.time_plan = time.perf_counter() - t0
        return plan

    def train(self, plan: StepPlan, peers: Optional[StepPeers] = None) -> dict:
        """THE learner step (production, tests and benchmarks): train every shard of `plan`, update
        once, return the step's statistics. Rank 0 trains shards[0] while `peers` (ranks 1..T-1,
        needed when T > 1) train the others in the same collectives."""
        t0 = time.perf_counter()
        if not plan.shards:  # nothing to train on: no optimizer update, the version stays
            return finish_stats(plan, None, self.version, self.cfg, plan.time_plan + time.perf_counter() - t0)
        if self.cfg.updates_per_step > 1:
            return self.train_updates(plan, peers)
        parts = self.update_all_ranks(plan.shards, peers)
        return finish_stats(plan, parts, self.version, self.cfg, plan.time_plan + time.perf_counter() - t0)

    def update_all_ranks(self, shards: Sequence[Sequence[MicroBatch]], peers: Optional[StepPeers] = None) -> list[dict]:
        """ONE optimizer update on `shards` (one per rank): every rank's partial results, in rank order."""
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
        if T == 1:
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
                updates.append((epoch, mini, self.update_all_ranks(mini.shards, peers)))
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
