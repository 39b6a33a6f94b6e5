"""The run's selections and hyper-parameters, bound in gin as ``train.<field>`` and ``model.path``.

Everything is a plain value (component NAMES, not objects) so a sweep is a list of strings
and the whole config pickles into a spawned generator process.

Numeric settings are checked before anything is built or computed (`validate`): every
``train.*`` number against `TRAIN_RANGES` (finite, and e.g. ``lr > 0``), and every numeric
hyper-parameter of every component the run uses with the values it will be called with
(defaults, gin bindings, ``train.task_kwargs``) against the range declared at registration
(`components.registry`). A refused value names itself: ``cispo.eps_max = -1.0 is out of
range: must be > 0``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import gin

from components.quiet import quiet_gin
from components.registry import ENGINES, WEIGHT_SYNC_BACKENDS, UnknownComponentError, load_builtin_components

__all__ = ["TrainConfig", "train_config", "model_config", "ConfigError", "TRAIN_RANGES", "validate",
           "check_train_values", "check_components", "parse_gin_files", "engine_gpus"]

log = logging.getLogger("scalerl.config")


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
    compile: bool = False  # torch.compile each decoder block and the log-prob head's per-chunk math (learner only)
    compile_backend: str = "inductor"  # the torch.compile backend of train.compile ("aot_eager": no code generation)
    logprob_chunk_size: int = 1024  # tokens per chunk of the log-prob / entropy head (no [tokens, vocab] tensor)
    attn_implementation: Optional[str] = None  # the learner's attention (None: sdpa; "torch_varlen": torch's varlen flash kernel for packed rows on GPU; "auto": torch_varlen where it runs, else sdpa; attention.ATTN_IMPLEMENTATIONS)
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
    compute_budget_flops: Optional[float] = None  # stop early once the run's FLOPs reach it (reproducible)
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
    # CPU; "gloo" on GPU stages through host memory; "ipc" (one node) hands the generators shared
    # buffers instead: CUDA IPC for a learner and generators sharing one GPU (which NCCL refuses),
    # shared memory on CPU
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
    new_model: bool = False,
    builder: Optional[Any] = None,
    build_kwargs: Optional[dict] = None,
    build_if_missing: bool = False,
) -> str:
    """`model.path`: a local checkpoint directory (save_pretrained); nothing is downloaded.

    A path with no checkpoint is an error (`components.models.check_model_path`), unless
    `model.new_model = True` asks for a NEW, randomly initialised model: it is then built at
    the path by `builder(path, **build_kwargs)` (default: `components.models.build_tiny_policy`,
    a tiny random Llama and a char tokenizer) the first time, and reused by later runs
    (`components.models.ensure_new_model`). A gin recipe can point `model.builder` at any
    configurable. `build_if_missing` is the deprecated name of `new_model`, kept so saved
    configs still parse (it warns). Returns the absolute path.
    """
    from components.models import ensure_new_model

    p = Path(str(path)).expanduser().absolute()
    if build_if_missing and not new_model:
        log.warning("model.build_if_missing is deprecated: write model.new_model = True (a missing model.path is built "
                    "only when a new model is asked for explicitly)")
        if not (p / "config.json").is_file():
            ensure_new_model(p, builder=builder, build_kwargs=build_kwargs)
    elif new_model:
        ensure_new_model(p, builder=builder, build_kwargs=build_kwargs)
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
    compile: bool = False,
    compile_backend: str = "inductor",
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
    compute_budget_flops: Optional[float] = None,
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
    """The run's selections (component names) and hyper-parameters. `model.path` gives the model.

    When `model_path` is not given, the whole config is validated (`validate`) BEFORE
    `model.path` is resolved, since resolving it may build a model (a warm start, a new model).
    """
    check_train_values({k: v for k, v in locals().items() if k in _TRAIN_PARAM_NAMES})  # before int() / float()
    if not isinstance(compile, bool):
        raise ConfigError(f"train.compile must be True or False, got {compile!r}")
    resolve_model = model_path is None
    if resolve_model:
        model_path = UNRESOLVED_MODEL_PATH
    if isinstance(curriculum, str):
        curriculum = (curriculum,)
    task_kwargs = dict(task_kwargs or {})
    data_path = data_config()
    if data_path is not None:
        task_kwargs.setdefault("path", data_path)
    cfg = TrainConfig(
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
        compile=bool(compile),
        compile_backend=str(compile_backend),
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
        compute_budget_flops=None if compute_budget_flops is None else float(compute_budget_flops),
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
    if resolve_model:
        validate(cfg)
        cfg = cfg.replace(model_path=model_config())
    return cfg


UNRESOLVED_MODEL_PATH = "<model.path not resolved yet>"

# The allowed values of the numeric train.* settings (components.registry.parse_range). Every
# numeric setting must also be a finite number, an int one an integer.
TRAIN_RANGES = {
    "prompts_per_step": ">= 1",
    "generations_per_prompt": ">= 2",  # group-relative advantages need a group
    "max_tokens": ">= 1",
    "temperature": "> 0",
    "top_p": "(0, 1]",
    "micro_batch_size": ">= 1",
    "max_tokens_per_micro_batch": ">= 1",
    "logprob_chunk_size": ">= 1",
    "lr": "> 0",
    "warmup_steps": ">= 0",
    "adam_eps": "> 0",
    "weight_decay": ">= 0",
    "total_steps": ">= 1",
    "compute_budget_hours": "> 0",
    "compute_budget_flops": "> 0",
    "eval_every": ">= 1",
    "eval_k": ">= 1",
    "eval_prompts": ">= 1",
    "eval_temperature": ">= 0",  # 0: greedy held-out evaluation (both engines sample greedily at T <= 0)
    "checkpoint_every": ">= 1",
    "keep_checkpoints": ">= 1",
    "downstream_every": ">= 0",  # 0: never
    "downstream_k": ">= 1",
    "samples_every": ">= 0",  # 0: never
    "samples_per_log": ">= 0",
    "num_generators": ">= 1",
    "learner_ranks": ">= 1",
    "heartbeat_s": "> 0",
    "heartbeat_timeout_s": "> 0",
    "weight_sync_bucket_mb": "> 0",
    "verifier_timeout_s": "> 0",  # 0: every verification times out, every reward is the incorrect one
    "queue_timeout_s": "> 0",
}


def _train_params():
    """The train.* settings as registry ParamSpecs (name, default, annotation) from train_config's signature."""
    from components.registry import configurable_params

    return configurable_params(train_config)


_TRAIN_PARAM_NAMES = frozenset(
    name for name in TrainConfig.__dataclass_fields__ if name != "model_path"
)


def check_train_values(values: Mapping[str, Any]) -> None:
    """Refuse train.* numbers that are not finite or outside `TRAIN_RANGES` (ConfigError naming each)."""
    from components.registry import ParamRangeError, check_numeric

    try:
        check_numeric("train", _train_params(), values, TRAIN_RANGES)
    except ParamRangeError as err:
        raise ConfigError(str(err)) from None


def _task_components(task: Any, task_kwargs: Mapping[str, Any], seed: int) -> list[tuple[str, dict]]:
    """(registered task name, its explicit keywords) for each task a task spec builds (a mixture: every member)."""
    from components.tasks import REASONING_GYM_PREFIX

    def one(spec: str, kwargs: Mapping[str, Any]) -> tuple[str, dict]:
        kw = {**dict(kwargs), "seed": seed}
        if spec.startswith(REASONING_GYM_PREFIX):
            return "reasoning_gym", kw
        return spec, kw

    if isinstance(task, Mapping):
        members = [one(s, (task_kwargs or {}).get(s) or {}) for s in task if isinstance(s, str)]
        return [("mixture", {"seed": seed})] + members
    return [one(task, task_kwargs)] if isinstance(task, str) and task else []


def _reward_order_problem(task: str, values: Mapping[str, Any]) -> list[str]:
    """A task whose correct verdict is not rewarded above the incorrect one trains towards wrong answers."""
    good, bad = values.get("reward_correct"), values.get("reward_incorrect")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (good, bad))
    if numbers and not good > bad:
        return [f"{task}.reward_correct = {good!r} must be above {task}.reward_incorrect = {bad!r} "
                "(advantages would push the policy towards wrong answers, or be all zero)"]
    return []


def _mixture_weight_problem(task: Any) -> list[str]:
    """A mixture's weights are numbers too: each must be finite and > 0 (checked here, not only when the
    task is built, which comes after model.path is resolved, i.e. after a warm start trained)."""
    if not isinstance(task, Mapping):
        return []
    from components.tasks.mixture import mixture_weights

    try:
        mixture_weights(task)
    except ValueError as err:
        return [f"train.task: {err} (must be finite and > 0)"]
    return []


def check_components(cfg: "TrainConfig") -> None:
    """Refuse numeric hyper-parameters of the run's components that are not finite or out of their range.

    Every component the run uses (the task's plain-function reward too) is checked with the
    values it will be called with: its defaults, the gin bindings (``cispo.eps_max = ...``)
    and, for the task, ``train.task_kwargs``.
    Unknown names are left to the name checks (`experiments.train.validate_components`).
    """
    from components.registry import (
        ADVANTAGE_NORMS, AGGREGATIONS, CURRICULA, ENGINES, LENGTH_CONTROLS, LOSSES, OFF_POLICY, PRECISIONS, REWARDS,
        TASKS, ParamRangeError,
    )

    used = [(LOSSES, cfg.loss, None), (AGGREGATIONS, cfg.aggregation, None), (ADVANTAGE_NORMS, cfg.advantage_norm, None),
            (OFF_POLICY, cfg.off_policy, None), (PRECISIONS, cfg.precision, None)]
    used += [(CURRICULA, name, None) for name in cfg.curriculum]
    used += [(ENGINES, name, None) for name in dict.fromkeys([cfg.engine, cfg.eval_engine or cfg.engine])]
    if cfg.length_control:
        used.append((LENGTH_CONTROLS, cfg.length_control, None))
    used += [(TASKS, name, kw) for name, kw in _task_components(cfg.task, cfg.task_kwargs, cfg.seed)]
    problems = _mixture_weight_problem(cfg.task)
    while used:
        registry, name, overrides = used.pop(0)
        if not isinstance(name, str) or name not in registry:
            continue
        try:
            values = registry.check_params(name, overrides)
        except ParamRangeError as err:
            problems.append(str(err))
            continue
        if registry is TASKS:
            problems += _reward_order_problem(name, values)
            used.append((REWARDS, values.get("reward"), None))  # a plain-function reward the task grades with
    if problems:
        raise ConfigError("; ".join(problems))
    if cfg.length_control and cfg.length_control in LENGTH_CONTROLS:
        try:  # its constructor checks the parameters together (thinking_min <= thinking_max, ...)
            LENGTH_CONTROLS.get(cfg.length_control)()
        except (ValueError, TypeError) as err:
            raise ConfigError(f"length control {cfg.length_control!r}: {err}") from None


def _check_compile_precision(cfg: TrainConfig) -> None:
    """train.compile with a bf16 policy that is surely emulated (precision.emulate = "on", or "auto"
    with train.device = "cpu"): refused here, before anything runs. With train.device = "auto" the
    learner decides on its own device (a GPU node may run what a login node validates)."""
    import torch

    from components.precision import PRECISIONS, emulation_mode

    if not isinstance(cfg.precision, str) or cfg.precision not in PRECISIONS:
        return  # the name check reports it
    mode = emulation_mode()
    nominal = PRECISIONS.get(cfg.precision)()
    if nominal.param_dtype != torch.float32 and (mode == "on" or (mode == "auto" and cfg.device == "cpu")):
        raise ConfigError(
            f"train.compile = True needs real arithmetic, but train.precision = {cfg.precision!r} is emulated here "
            f"(precision.emulate = {mode!r}, train.device = {cfg.device!r}); use train.compile = False, "
            "train.precision = 'fp32', or precision.emulate = \"off\" (real bf16)")


def validate(cfg: TrainConfig) -> None:
    """Fail early and clearly on out-of-range or inconsistent settings (component names are checked elsewhere).

    Checks every numeric train.* setting (`TRAIN_RANGES`), the settings that must agree with
    each other, and the numeric hyper-parameters of the run's components (`check_components`).
    """
    check_train_values({name: getattr(cfg, name) for name in _TRAIN_PARAM_NAMES})
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
    if cfg.micro_batch_size > cfg.batch_sequences:
        raise ConfigError(
            f"train.micro_batch_size ({cfg.micro_batch_size}) is larger than the step batch "
            f"prompts_per_step x generations_per_prompt = {cfg.prompts_per_step} x {cfg.generations_per_prompt} = {cfg.batch_sequences}"
        )
    if not cfg.heartbeat_s < cfg.heartbeat_timeout_s:
        raise ConfigError(
            f"need 0 < train.heartbeat_s < train.heartbeat_timeout_s, got {cfg.heartbeat_s!r} and {cfg.heartbeat_timeout_s!r}"
        )
    if cfg.compile:
        _check_compile_precision(cfg)
    if cfg.compile_backend != "inductor":
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if cfg.compile_backend not in backends:
            raise ConfigError(f"train.compile_backend = {cfg.compile_backend!r} is not a torch.compile backend; "
                              f"valid: {backends}")
    if cfg.weight_sync_backend != "auto":  # "auto" picks a registered backend at start
        try:
            WEIGHT_SYNC_BACKENDS.get(cfg.weight_sync_backend)
        except UnknownComponentError as err:
            raise ConfigError(f"train.weight_sync_backend: {err} (or 'auto')") from None
    if len(cfg.adam_betas) != 2 or not all(0 <= b < 1 for b in cfg.adam_betas):
        raise ConfigError(f"train.adam_betas must be two numbers in [0, 1), got {cfg.adam_betas!r}")
    if cfg.device not in ("auto", "cpu", "cuda", "cuda:0"):
        if str(cfg.device).startswith("cuda:"):
            raise ConfigError(
                f"train.device = {cfg.device!r}: every process of a run gets its own GPU(s) from the launcher "
                "(CUDA_VISIBLE_DEVICES), where its first one is cuda:0, so a run has no GPU index to pick; use "
                "'cuda', and choose a machine's GPUs with CUDA_VISIBLE_DEVICES before `scalerl train`")
        raise ConfigError(f"train.device must be auto, cpu or cuda (cuda:0 is cuda), got {cfg.device!r}")
    if cfg.downstream_every > 0 and not cfg.downstream_benchmarks:
        raise ConfigError(f"train.downstream_every = {cfg.downstream_every} but train.downstream_benchmarks is empty; name the benchmark files")
    if not cfg.curriculum:
        raise ConfigError("train.curriculum is empty; use ['uniform'] for plain uniform sampling")
    from components.trainer.tracking import check_trackers

    try:
        check_trackers(cfg.trackers)  # unknown name: lists the valid ones; package missing: names the pip extra
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_components(cfg)


_GIN_SEARCH_PATHS: set[str] = set()  # directories already given to gin.add_config_file_search_path


def parse_gin_files(config_files: Sequence[str], bindings: Sequence[str]) -> tuple[list[str], list[str]]:
    """Import paths + built-in components, then parse the gin files and bindings (as `scalerl train`,
    `scalerl plan` and a sweep read a run's config). Returns (absolute config files, sys_path)."""
    files = []
    for f in config_files:
        p = Path(f).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"gin config file {str(f)!r} does not exist")
        files.append(str(p.resolve()))
    sys_path = []
    for d in [str(Path(f).parent) for f in files] + [os.getcwd()]:
        if d not in sys_path:
            sys_path.append(d)
    for d in reversed(sys_path):
        if d not in sys.path:
            sys.path.insert(0, d)
    failures = load_builtin_components()
    for mod, err in failures.items():
        log.debug("built-in component module %s not loaded: %s", mod, err)
    quiet_gin()
    gin.clear_config()
    for d in sys_path:  # `include 'base.gin'` resolves next to the including file
        if d not in _GIN_SEARCH_PATHS:  # gin appends on every call; a sweep parses many runs
            gin.add_config_file_search_path(d)
            _GIN_SEARCH_PATHS.add(d)
    gin.parse_config_files_and_bindings(files, list(bindings), finalize_config=False, skip_unknown=False)
    return files, sys_path


def engine_gpus(cfg) -> int:
    """GPUs one generator's engine uses, as its registered class says (`Engine.gpus_per_instance`
    with its defaults and gin bindings: vLLM's tensor_parallel_size; 1 for the torch engine)."""
    engine_cls = ENGINES.original(cfg.engine)  # an unknown name: the registry's error
    gpus = getattr(engine_cls, "gpus_per_instance", None)
    return max(int(gpus(ENGINES.bound_values(cfg.engine))), 1) if gpus is not None else 1
