"""The run's selections and hyper-parameters, bound in gin as ``train.<field>`` and ``model.path``.

Everything is a plain value (component NAMES, not objects) so a sweep is a list of strings
and the whole config pickles into a spawned generator process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import gin

__all__ = ["TrainConfig", "train_config", "model_config", "ConfigError"]


class ConfigError(ValueError):
    """An inconsistent or invalid training configuration (raised before anything runs)."""


@dataclass(frozen=True)
class TrainConfig:
    # -- components (registry names) ---------------------------------------------------
    model_path: str
    task: str = "arithmetic"
    task_kwargs: dict = field(default_factory=dict)
    engine: str = "torch"
    eval_engine: Optional[str] = None  # None: the same engine as training
    loss: str = "cispo"
    aggregation: str = "prompt_mean"
    advantage_norm: str = "batch"
    curriculum: tuple = ("uniform",)
    off_policy: str = "ppo_off_policy"
    precision: str = "fp32"
    length_control: Optional[str] = None  # None: plain truncation at max_tokens
    # -- batch and sampling ---------------------------------------------------------------
    prompts_per_step: int = 8
    generations_per_prompt: int = 8
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    micro_batch_size: int = 64  # sequences per forward/backward (padded micro-batches)
    max_tokens_per_micro_batch: Optional[int] = None  # token budget: packed micro-batches (overrides micro_batch_size)
    activation_checkpointing: bool = False  # recompute each decoder block in backward
    logprob_chunk_size: int = 1024  # tokens per chunk of the log-prob / entropy head (no [tokens, vocab] tensor)
    attn_implementation: Optional[str] = None  # transformers attn_implementation (None: sdpa)
    # -- optimizer ----------------------------------------------------------------------
    lr: float = 5e-7
    warmup_steps: int = 100
    adam_eps: float = 1e-15
    adam_betas: tuple = (0.9, 0.999)
    weight_decay: float = 0.01
    grad_clip: float = 1.0  # max grad norm; <= 0 disables clipping
    # -- schedule ---------------------------------------------------------------------------
    total_steps: int = 100
    compute_budget_hours: Optional[float] = None  # stop early once compute_hours reaches it
    eval_every: int = 100
    eval_k: int = 16
    eval_prompts: Optional[int] = None  # None: every held-out prompt
    eval_temperature: Optional[float] = None  # None: the training temperature
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    # -- downstream benchmarks (components/benchmarks.py; evaluation.evaluate_downstream) --
    downstream_every: int = 0  # 0: never; else every N steps (and at step 0 and the last step)
    downstream_benchmarks: tuple = ()  # benchmark specs: files / hub names, or dicts (components.benchmarks)
    downstream_k: int = 16  # samples per benchmark problem (mean@k, pass@1..k)
    # -- tracking (components/trainer/tracking.py; the run directory's JSONL stays the source of truth) --
    trackers: tuple = ()  # any of "wandb", "tensorboard", "mlflow"
    samples_every: int = 50  # every N steps a few completions go to samples.jsonl and the trackers (0: never)
    samples_per_log: int = 4  # completions per samples log
    # -- processes --------------------------------------------------------------------------
    num_generators: int = 1
    learner_ranks: int = 1  # data-parallel FSDP2 learner processes (one device each)
    # a ONE-rank learner that computes every step exactly as this many FSDP2 ranks would (their
    # row split, micro-batches, gradient reduction and grad-norm reduction): a run at
    # learner_ranks = 1 then reproduces a 2-rank run bit for bit (a check, not a speed-up)
    emulate_learner_ranks: int = 1
    heartbeat_s: float = 2.0  # every process beats this often
    heartbeat_timeout_s: float = 30.0  # a process silent this long is named dead or hung
    weight_sync_bucket_mb: float = 64.0  # tensors broadcast to the generators per bucket
    # "auto": nccl on GPU (vLLM's weight-transfer engine; gloo when vLLM is not installed), gloo on
    # CPU; "gloo" on GPU stages through host memory (e.g. a learner and a generator sharing one GPU,
    # which NCCL refuses)
    weight_sync_backend: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    seed: int = 0
    verifier_timeout_s: float = 10.0
    queue_timeout_s: float = 600.0  # the learner fails clearly if no rollout arrives this long

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)

    @property
    def batch_sequences(self) -> int:
        return self.prompts_per_step * self.generations_per_prompt

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["curriculum"] = list(self.curriculum)
        d["adam_betas"] = list(self.adam_betas)
        d["downstream_benchmarks"] = list(self.downstream_benchmarks)
        d["trackers"] = list(self.trackers)
        return d


@gin.configurable("model")
def model_config(
    path: str = gin.REQUIRED,
    build_if_missing: bool = False,
    builder: Optional[Any] = None,
    build_kwargs: Optional[dict] = None,
) -> str:
    """`model.path`: a local checkpoint directory (save_pretrained); nothing is downloaded.

    With `build_if_missing = True` a missing path is created locally by `builder(path,
    **build_kwargs)` (default: `components.models.build_tiny_policy`, a tiny random Llama and
    a char tokenizer), written to a temporary directory and renamed into place atomically.
    A gin recipe can point `model.builder` at any configurable (e.g. a warm-start builder).
    Returns the absolute path.
    """
    import os
    from pathlib import Path

    p = Path(str(path)).expanduser().absolute()
    if build_if_missing and not (p / "config.json").is_file():
        if builder is None:
            from components.models import build_tiny_policy as builder
        tmp = p.with_name(f".{p.name}.building-{os.getpid()}")
        builder(tmp, **dict(build_kwargs or {}))
        try:
            os.rename(tmp, p)
        except OSError:  # built concurrently by another run: keep theirs
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(p)


@gin.configurable("data")
def data_config(path: Optional[str] = None) -> Optional[str]:
    """`data.path`: a local dataset file for file-backed tasks (passed to the task as `path`)."""
    return None if path is None else str(path)


@gin.configurable("train")
def train_config(
    *,
    task: str = "arithmetic",
    task_kwargs: Optional[dict] = None,
    engine: str = "torch",
    eval_engine: Optional[str] = None,
    loss: str = "cispo",
    aggregation: str = "prompt_mean",
    advantage_norm: str = "batch",
    curriculum: Sequence[str] | str = ("uniform",),
    off_policy: str = "ppo_off_policy",
    precision: str = "fp32",
    length_control: Optional[str] = None,
    prompts_per_step: int = 8,
    generations_per_prompt: int = 8,
    max_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    micro_batch_size: int = 64,
    max_tokens_per_micro_batch: Optional[int] = None,
    activation_checkpointing: bool = False,
    logprob_chunk_size: int = 1024,
    attn_implementation: Optional[str] = None,
    lr: float = 5e-7,
    warmup_steps: int = 100,
    adam_eps: float = 1e-15,
    adam_betas: Sequence[float] = (0.9, 0.999),
    weight_decay: float = 0.01,
    grad_clip: float = 1.0,
    total_steps: int = 100,
    compute_budget_hours: Optional[float] = None,
    eval_every: int = 100,
    eval_k: int = 16,
    eval_prompts: Optional[int] = None,
    eval_temperature: Optional[float] = None,
    checkpoint_every: int = 50,
    keep_checkpoints: int = 2,
    downstream_every: int = 0,
    downstream_benchmarks: Sequence[Any] = (),
    downstream_k: int = 16,
    trackers: Sequence[str] | str = (),
    samples_every: int = 50,
    samples_per_log: int = 4,
    num_generators: int = 1,
    learner_ranks: int = 1,
    emulate_learner_ranks: int = 1,
    heartbeat_s: float = 2.0,
    heartbeat_timeout_s: float = 30.0,
    weight_sync_bucket_mb: float = 64.0,
    weight_sync_backend: str = "auto",
    device: str = "auto",
    seed: int = 0,
    verifier_timeout_s: float = 10.0,
    queue_timeout_s: float = 600.0,
    model_path: Optional[str] = None,
) -> TrainConfig:
    """The run's selections (component names) and hyper-parameters. `model.path` gives the model."""
    if model_path is None:
        model_path = model_config()
    if isinstance(curriculum, str):
        curriculum = (curriculum,)
    task_kwargs = dict(task_kwargs or {})
    data_path = data_config()
    if data_path is not None:
        task_kwargs.setdefault("path", data_path)
    return TrainConfig(
        model_path=str(model_path),
        task=task,
        task_kwargs=task_kwargs,
        engine=engine,
        eval_engine=eval_engine,
        loss=loss,
        aggregation=aggregation,
        advantage_norm=advantage_norm,
        curriculum=tuple(curriculum),
        off_policy=off_policy,
        precision=precision,
        length_control=length_control,
        prompts_per_step=int(prompts_per_step),
        generations_per_prompt=int(generations_per_prompt),
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        micro_batch_size=int(micro_batch_size),
        max_tokens_per_micro_batch=None if max_tokens_per_micro_batch is None else int(max_tokens_per_micro_batch),
        activation_checkpointing=bool(activation_checkpointing),
        logprob_chunk_size=int(logprob_chunk_size),
        attn_implementation=attn_implementation,
        lr=float(lr),
        warmup_steps=int(warmup_steps),
        adam_eps=float(adam_eps),
        adam_betas=tuple(float(b) for b in adam_betas),
        weight_decay=float(weight_decay),
        grad_clip=float(grad_clip),
        total_steps=int(total_steps),
        compute_budget_hours=compute_budget_hours,
        eval_every=int(eval_every),
        eval_k=int(eval_k),
        eval_prompts=eval_prompts,
        eval_temperature=eval_temperature,
        checkpoint_every=int(checkpoint_every),
        keep_checkpoints=int(keep_checkpoints),
        downstream_every=int(downstream_every),
        downstream_benchmarks=(downstream_benchmarks,) if isinstance(downstream_benchmarks, (str, dict)) else tuple(downstream_benchmarks),
        downstream_k=int(downstream_k),
        trackers=(trackers,) if isinstance(trackers, str) else tuple(trackers or ()),
        samples_every=int(samples_every),
        samples_per_log=int(samples_per_log),
        num_generators=int(num_generators),
        learner_ranks=int(learner_ranks),
        emulate_learner_ranks=int(emulate_learner_ranks),
        heartbeat_s=float(heartbeat_s),
        heartbeat_timeout_s=float(heartbeat_timeout_s),
        weight_sync_bucket_mb=float(weight_sync_bucket_mb),
        weight_sync_backend=str(weight_sync_backend),
        device=device,
        seed=int(seed),
        verifier_timeout_s=float(verifier_timeout_s),
        queue_timeout_s=float(queue_timeout_s),
    )


def validate(cfg: TrainConfig) -> None:
    """Fail early and clearly on inconsistent settings (component names are checked elsewhere)."""
    positive = {
        "prompts_per_step": cfg.prompts_per_step,
        "generations_per_prompt": cfg.generations_per_prompt,
        "max_tokens": cfg.max_tokens,
        "micro_batch_size": cfg.micro_batch_size,
        "total_steps": cfg.total_steps,
        "eval_every": cfg.eval_every,
        "eval_k": cfg.eval_k,
        "checkpoint_every": cfg.checkpoint_every,
        "num_generators": cfg.num_generators,
        "learner_ranks": cfg.learner_ranks,
        "keep_checkpoints": cfg.keep_checkpoints,
        "logprob_chunk_size": cfg.logprob_chunk_size,
    }
    for name, value in positive.items():
        if int(value) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {value!r}")
    if cfg.emulate_learner_ranks not in (1, 2):
        raise ConfigError(
            f"train.emulate_learner_ranks must be 1 (off) or 2, got {cfg.emulate_learner_ranks!r}: two ranks reduce "
            "a gradient with one exact addition; more ranks sum in the collective's own order, which one process "
            "cannot reproduce bit for bit"
        )
    if cfg.emulate_learner_ranks > 1 and cfg.learner_ranks != 1:
        raise ConfigError(
            f"train.emulate_learner_ranks = {cfg.emulate_learner_ranks} makes ONE learner rank compute as "
            f"{cfg.emulate_learner_ranks} ranks; got train.learner_ranks = {cfg.learner_ranks} (set it to 1)"
        )
    if cfg.generations_per_prompt < 2:
        raise ConfigError(
            f"train.generations_per_prompt must be >= 2 (group-relative advantages need a group), got {cfg.generations_per_prompt}"
        )
    if cfg.micro_batch_size > cfg.batch_sequences:
        raise ConfigError(
            f"train.micro_batch_size ({cfg.micro_batch_size}) is larger than the step batch "
            f"prompts_per_step x generations_per_prompt = {cfg.prompts_per_step} x {cfg.generations_per_prompt} = {cfg.batch_sequences}"
        )
    if cfg.max_tokens_per_micro_batch is not None and int(cfg.max_tokens_per_micro_batch) < 1:
        raise ConfigError(f"train.max_tokens_per_micro_batch must be >= 1 or None, got {cfg.max_tokens_per_micro_batch!r}")
    if not 0 < cfg.heartbeat_s < cfg.heartbeat_timeout_s:
        raise ConfigError(
            f"need 0 < train.heartbeat_s < train.heartbeat_timeout_s, got {cfg.heartbeat_s!r} and {cfg.heartbeat_timeout_s!r}"
        )
    if cfg.weight_sync_bucket_mb <= 0:
        raise ConfigError(f"train.weight_sync_bucket_mb must be > 0, got {cfg.weight_sync_bucket_mb!r}")
    if cfg.weight_sync_backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"train.weight_sync_backend must be one of auto, gloo, nccl; got {cfg.weight_sync_backend!r}")
    if cfg.temperature <= 0:
        raise ConfigError(f"train.temperature must be > 0 for RL sampling, got {cfg.temperature!r}")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"train.top_p must be in (0, 1], got {cfg.top_p!r}")
    if cfg.lr <= 0 or cfg.adam_eps <= 0 or cfg.weight_decay < 0 or cfg.warmup_steps < 0:
        raise ConfigError(
            f"optimizer settings out of range: lr={cfg.lr}, adam_eps={cfg.adam_eps}, "
            f"weight_decay={cfg.weight_decay}, warmup_steps={cfg.warmup_steps}"
        )
    if len(cfg.adam_betas) != 2 or not all(0 <= b < 1 for b in cfg.adam_betas):
        raise ConfigError(f"train.adam_betas must be two numbers in [0, 1), got {cfg.adam_betas!r}")
    if cfg.device not in ("auto", "cpu", "cuda") and not str(cfg.device).startswith("cuda:"):
        raise ConfigError(f"train.device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    if cfg.eval_prompts is not None and int(cfg.eval_prompts) < 1:
        raise ConfigError(f"train.eval_prompts must be >= 1 or None, got {cfg.eval_prompts!r}")
    if cfg.compute_budget_hours is not None and cfg.compute_budget_hours <= 0:
        raise ConfigError(f"train.compute_budget_hours must be > 0, got {cfg.compute_budget_hours!r}")
    if cfg.downstream_every < 0 or cfg.downstream_k < 1:
        raise ConfigError(
            f"need train.downstream_every >= 0 (0: never) and train.downstream_k >= 1, got {cfg.downstream_every!r} and {cfg.downstream_k!r}"
        )
    if cfg.downstream_every > 0 and not cfg.downstream_benchmarks:
        raise ConfigError(f"train.downstream_every = {cfg.downstream_every} but train.downstream_benchmarks is empty; name the benchmark files")
    if not cfg.curriculum:
        raise ConfigError("train.curriculum is empty; use ['uniform'] for plain uniform sampling")
    if cfg.samples_every < 0 or cfg.samples_per_log < 0:
        raise ConfigError(
            f"need train.samples_every >= 0 (0: never) and train.samples_per_log >= 0, got {cfg.samples_every!r} and {cfg.samples_per_log!r}"
        )
    from components.trainer.tracking import check_trackers

    try:
        check_trackers(cfg.trackers)  # unknown name: lists the valid ones; package missing: names the pip extra
    except ValueError as err:
        raise ConfigError(str(err)) from None
