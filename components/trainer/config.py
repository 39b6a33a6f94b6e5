"""The run's selections and hyper-parameters, bound in gin as ``train.<field>`` and ``model.path``.

Everything is a plain value (component NAMES, not objects) so a sweep is a list of strings
and the whole config pickles into a spawned generator process.

`TrainConfig` declares every ``train.*`` setting ONCE: the gin configurable `train_config`
takes its signature from the dataclass fields (so gin refuses an unknown ``train.*`` name),
coerces each value by its annotation, and a field that names a component declares its registry
(`_component`), which is how the name checks and the range checks find every component the run
uses (`component_fields`). A component's own hyper-parameters reach it through its registry
entry (gin-configurable, ``cispo.eps_max = ...``), never through TrainConfig.

Numeric settings are checked before anything is built or computed (`validate`): every
``train.*`` number against `TRAIN_RANGES` (finite, and e.g. ``lr > 0``), and every numeric
hyper-parameter of every component the run uses with the values it will be called with
(defaults, gin bindings, ``train.task_kwargs``) against the range declared at registration
(`components.registry`). A refused value names itself: ``cispo.eps_max = -1.0 is out of
range: must be > 0``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import gin

from components.registry import ALL_REGISTRIES, ENGINES, TRACKERS, WEIGHT_SYNC_BACKENDS, UnknownComponentError
from components.trainer.config_values import ALL_LINEAR, adam_betas as _adam_betas, check_lora_targets as _check_lora_targets
from components.trainer.config_values import lora_targets as _lora_targets, reward_funcs as _reward_funcs
from components.trainer.config_values import reward_weights as _reward_weights, strict_bool as _strict_bool
from components.trainer.gin_config import ConfigError, bound_values

__all__ = ["TrainConfig", "train_config", "model_config", "ConfigError", "TRAIN_RANGES", "validate",
           "check_train_values", "check_components", "check_mini_batches", "check_settings", "component_fields", "component_names", "on_gpu", "attention_of", "engine_gpus"]

log = logging.getLogger("scalerl.config")


UNRESOLVED_MODEL_PATH = "<model.path not resolved yet>"


def _component(family: str, default: Any):
    """A field that names a component (or several) of registry `ALL_REGISTRIES[family]`."""
    kw = {"default_factory": lambda: default} if isinstance(default, (dict, list)) else {"default": default}
    return field(metadata={"registry": family}, **kw)


@dataclass(frozen=True)
class TrainConfig:
    # -- components (registry names) ---------------------------------------------------
    model_path: str = field(default=UNRESOLVED_MODEL_PATH, metadata={"gin": False})  # set from model.path
    task: Any = "arithmetic"  # a TASKS name, "reasoning_gym:<dataset>", or a mixture {spec: weight}
    task_kwargs: dict = field(default_factory=dict)
    engine: str = _component("engines", "torch")
    eval_engine: Optional[str] = _component("engines", None)  # None: the same engine as training
    loss: str = _component("losses", "cispo")
    aggregation: str = _component("aggregations", "prompt_mean")
    advantage_norm: str = _component("advantage_norms", "batch")
    curriculum: tuple = _component("curricula", ("uniform",))  # one name or several, applied in order
    off_policy: str = _component("off_policy", "ppo_off_policy")
    precision: str = _component("precisions", "fp32")
    length_control: Optional[str] = _component("length_controls", None)  # None: plain truncation at max_tokens
    # a per-token weight on the policy loss for the generator-learner log-prob mismatch: "none" (today's
    # loss), "tis", "mis", "seq_tis", "seq_mis" (components/mismatch.py)
    mismatch_correction: str = _component("mismatch_corrections", "none")
    # several weighted rewards (components/rewards.py): () = the task's verifier alone (today's reward). Else the
    # reward is sum_i reward_weights[i] x reward_funcs[i], each logged as reward/<name>; "verifier" is the task's
    # own verdict reward; an entry is a REWARDS name or an import path "module:function"; the pass rate stays the verifier's
    reward_funcs: tuple = field(default=(), metadata={"coerce": _reward_funcs})
    reward_weights: Optional[tuple] = field(default=None, metadata={"coerce": _reward_weights})  # None: all 1.0
    # multi-turn rollouts (components/environments.py): an ENVIRONMENTS name answers each assistant turn with an
    # observation (appended as prompt tokens, never trained on) or ends the episode with a reward; None: single turn
    environment: Optional[str] = _component("environments", None)
    max_turns: int = 4  # assistant turns per episode (with an environment); the last one is graded or cut
    max_tokens_per_turn: Optional[int] = None  # sampled tokens per assistant turn (None: only train.max_tokens, all turns)
    max_observation_tokens: int = 64  # tokens per observation, chat framing included (longer text is cut)
    # True (correct): observation tokens are prompt tokens, out of the loss. False is THE KNOWN BUG, an ablation
    # only (experiments/sweeps/mask_observations.gin): observations trained on as if generated (gen_logp 0)
    mask_observations: bool = field(default=True, metadata={"coerce": _strict_bool("mask_observations")})
    # -- batch and sampling ---------------------------------------------------------------
    prompts_per_step: int = 8
    generations_per_prompt: int = 8
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    # more sampling knobs, applied by both engines in vLLM's order (components/engines/base.py SamplingParams);
    # gen_logp stays log_softmax(logits / temperature) of the raw logits whatever they are
    top_k: Optional[int] = 0  # sample among the k most likely tokens (0 or None: off)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0: off)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or completion (1: off)
    max_prompt_length: Optional[int] = None  # a longer prompt is refused with an error naming it (None: no limit)
    # PPO-style reuse of each step batch (TRL's num_iterations, verl's ppo_epochs / ppo_mini_batch_size): the
    # learner passes over the batch update_epochs times, each pass split into mini_batches mini-batches of
    # whole prompt groups, one optimizer update per mini-batch (update_epochs x mini_batches updates per step).
    # pi_old is fixed for the whole step (components/trainer/learner.py "Update epochs"); 1 and 1: one update
    update_epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int = 64  # sequences per forward/backward (padded micro-batches)
    max_tokens_per_micro_batch: Optional[int] = None  # token budget: packed micro-batches (overrides micro_batch_size)
    activation_checkpointing: bool = False  # recompute each decoder block in backward
    compile: bool = field(default=False, metadata={"coerce": _strict_bool("compile")})  # torch.compile each decoder block and the log-prob head's per-chunk math (learner only)
    compile_backend: str = "inductor"  # the torch.compile backend of train.compile ("aot_eager": no code generation)
    logprob_chunk_size: int = 1024  # tokens per chunk of the log-prob / entropy head (no [tokens, vocab] tensor)
    attn_implementation: Optional[str] = None  # the learner's attention (None: sdpa; "torch_varlen": torch's varlen flash kernel for packed rows on GPU; "auto": torch_varlen where it runs, else sdpa; attention.ATTN_IMPLEMENTATIONS)
    # -- optimizer ----------------------------------------------------------------------
    lr: float = 5e-7
    warmup_steps: int = 100
    adam_eps: float = 1e-15
    adam_betas: tuple = field(default=(0.9, 0.999), metadata={"coerce": _adam_betas})
    weight_decay: float = 0.01
    grad_clip: float = 1.0  # max grad norm; <= 0 disables clipping
    lr_schedule: str = _component("lr_schedules", "constant")  # after the warmup: constant, linear or cosine decay to 0 at total_steps
    # -- regularisers (added to the per-token loss, aggregated like it) -----------------------
    kl_coef: float = 0.0  # + kl_coef * KL(pi || pi_ref) per token; 0: no reference policy is built
    kl_estimator: str = _component("kl_estimators", "k3")  # the per-token KL estimate (components/kl.py)
    entropy_coef: float = 0.0  # - entropy_coef * entropy per token (an entropy bonus; 0: none)
    # -- LoRA (components/trainer/lora.py; peft). 0: full fine-tuning ------------------------
    lora_rank: int = 0  # r > 0: train rank-r adapters on the frozen base; generators and final/ get merged weights
    lora_alpha: float = 16.0  # peft's convention: the update is (lora_alpha / lora_rank) x B A (x 2 at rank 8)
    lora_dropout: float = 0.0  # peft's lora_dropout on each adapter's input while the learner trains (0: none)
    # "all-linear" (every nn.Linear of the decoder blocks, not the LM head) or module names (["q_proj", "v_proj"])
    lora_targets: Any = field(default="all-linear", metadata={"coerce": _lora_targets})
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
    trackers: tuple = _component("trackers", ())  # any of "wandb", "tensorboard", "mlflow"
    samples_every: int = 50  # every N steps a few completions go to samples.jsonl and the trackers (0: never)
    samples_per_log: int = 4  # completions per samples log
    # -- processes --------------------------------------------------------------------------
    num_generators: int = 1
    learner_ranks: int = 1  # data-parallel FSDP2 learner processes (one device each)
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

    # -- resolved, not bound: every chosen component's hyper-parameters, defaults included, as the run
    # calls it: ((registry family, name, ((param, value), ...)), ...) (`component_table`; () in a
    # TrainConfig made by hand, whose components then read their values where they are built)
    components: tuple = field(default=(), metadata={"gin": False})

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)

    def params_of(self, family: str, name: str) -> Optional[dict]:
        """The resolved hyper-parameters of component `name` of registry family `family` (a key of
        `ALL_REGISTRIES`), or None when this config holds none for it."""
        for fam, entry, params in self.components:
            if fam == family and entry == name:
                return dict(params)
        return None

    @property
    def batch_sequences(self) -> int:
        return self.prompts_per_step * self.generations_per_prompt

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per learner step (a full step batch): update_epochs x mini_batches."""
        return self.update_epochs * self.mini_batches

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["curriculum"] = list(self.curriculum)
        d["adam_betas"] = list(self.adam_betas)
        d["downstream_benchmarks"] = list(self.downstream_benchmarks)
        d["trackers"] = list(self.trackers)
        d["reward_funcs"] = list(self.reward_funcs)
        if self.reward_weights is not None:
            d["reward_weights"] = list(self.reward_weights)
        if isinstance(self.lora_targets, tuple):
            d["lora_targets"] = list(self.lora_targets)
        d["components"] = {f"{family}/{name}": dict(params) for family, name, params in self.components}
        return d


@gin.configurable("model")
def model_config(
    path: str = gin.REQUIRED,
    new_model: bool = False,
    builder: Optional[Any] = None,
    build_kwargs: Optional[dict] = None,
    build_if_missing: bool = False,
    revision: Optional[str] = None,
) -> str:
    """`model.path`: a local checkpoint directory (save_pretrained), or a Hugging Face hub id
    ("Qwen/Qwen2.5-0.5B-Instruct") at `model.revision` (a branch, tag or commit; None: main).

    A hub id resolves to its local snapshot directory, downloaded into the Hugging Face cache
    unless cached (HF_HOME; HF_HUB_OFFLINE=1: the cache only), so every consumer loads a local
    directory; config.gin keeps the id and revision as given, run.json adds the commit
    (`components.models.resolve_model_path`). A missing local path, a malformed id or an id that
    cannot be resolved is an error (`components.models.ModelPathError`), unless
    `model.new_model = True` asks for a NEW, randomly initialised model: it is then built at
    the (local) path by `builder(path, **build_kwargs)` (default: `components.models.build_tiny_policy`,
    a tiny random Llama and a char tokenizer) the first time, and reused by later runs
    (`components.models.ensure_new_model`). A gin recipe can point `model.builder` at any
    configurable. `build_if_missing` is the deprecated name of `new_model`, kept so saved
    configs still parse (it warns). Returns the absolute local path.
    """
    from components.models import ensure_new_model, resolve_model_path

    if not (new_model or build_if_missing):
        return resolve_model_path(str(path), revision)
    if revision is not None:
        raise ConfigError(f"model.revision = {revision!r} selects a revision of a hub model; model.new_model builds a "
                          "new local model: drop one of them")
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


def _coerce(spec: dataclasses.Field, value: Any) -> Any:
    """One train.* value as its TrainConfig field stores it (after `check_train_values`)."""
    if "coerce" in spec.metadata:
        return spec.metadata["coerce"](value)
    kind = str(spec.type)
    if value is None and kind.startswith("Optional["):
        return None
    base = kind.removeprefix("Optional[").removesuffix("]")
    if base in ("int", "float", "bool"):
        if value is None:
            raise ConfigError(f"train.{spec.name} = None: it takes a value ({base}), not None")
        return {"int": int, "float": float, "bool": bool}[base](value)
    if base == "tuple":  # one name (a string) or one benchmark spec (a dict) is a tuple of one
        return (value,) if isinstance(value, (str, dict)) else tuple(value or ())
    if base == "dict":
        return dict(value or {})
    return value


def _train_fields() -> list[dataclasses.Field]:
    """The fields bound as train.<name> (all but model_path, which comes from model.path)."""
    return [f for f in dataclasses.fields(TrainConfig) if f.metadata.get("gin", True)]


def _field_default(spec: dataclasses.Field) -> Any:
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def train_config(**values: Any) -> TrainConfig:
    """The run's selections (component names) and hyper-parameters; bound in gin as ``train.<field>``
    (every `TrainConfig` field but model_path); `model.path` gives the model.

    The signature is TrainConfig's fields (set below), so gin refuses an unknown ``train.*`` name.
    Every component the run uses gets its hyper-parameters here, from gin (`component_table`).
    When `model_path` is not given, the whole config is validated (`validate`) BEFORE `model.path`
    is resolved, since resolving it may build a model (a warm start, a new model).
    """
    model_path = values.pop("model_path", None)
    fields = {f.name: f for f in _train_fields()}
    values = {name: values[name] if name in values else _field_default(spec) for name, spec in fields.items()}
    check_train_values(values)  # before int() / float()
    values = {name: _coerce(fields[name], value) for name, value in values.items()}
    data_path = data_config()
    if data_path is not None:
        values["task_kwargs"].setdefault("path", data_path)
    resolve_model = model_path is None
    cfg = TrainConfig(model_path=UNRESOLVED_MODEL_PATH if resolve_model else str(model_path), **values)
    cfg = cfg.replace(components=component_table(cfg))  # each component's values under this config, read once
    if resolve_model:
        validate(cfg)
        cfg = cfg.replace(model_path=model_config())
    return cfg


train_config.__signature__ = inspect.Signature(
    [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_field_default(f), annotation=f.type)
     for f in _train_fields()]
    + [inspect.Parameter("model_path", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Optional[str]")],
    return_annotation="TrainConfig",
)
train_config = gin.configurable("train")(train_config)


# The allowed values of the numeric train.* settings (components.registry.parse_range). Every
# numeric setting must also be a finite number, an int one an integer.
TRAIN_RANGES = {
    "prompts_per_step": ">= 1",
    "generations_per_prompt": ">= 2",  # group-relative advantages need a group
    "max_tokens": ">= 1",
    "max_turns": ">= 1",
    "max_tokens_per_turn": ">= 1",  # None: no per-turn budget
    "max_observation_tokens": ">= 1",
    "temperature": "> 0",
    "top_p": "(0, 1]",
    "top_k": ">= 0",  # 0: off
    "min_p": "[0, 1]",  # 0: off
    "repetition_penalty": "> 0",  # 1: off
    "max_prompt_length": ">= 1",  # None: no limit
    "update_epochs": ">= 1",
    "mini_batches": ">= 1",
    "micro_batch_size": ">= 1",
    "max_tokens_per_micro_batch": ">= 1",
    "logprob_chunk_size": ">= 1",
    "lr": "> 0",
    "warmup_steps": ">= 0",
    "adam_eps": "> 0",
    "weight_decay": ">= 0",
    "lora_rank": ">= 0",  # 0: full fine-tuning
    "lora_alpha": "> 0",
    "lora_dropout": "[0, 1)",
    "kl_coef": ">= 0",
    "entropy_coef": ">= 0",
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


_TRAIN_PARAM_NAMES = frozenset(f.name for f in _train_fields())


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


def component_fields(cfg: "TrainConfig") -> list[tuple[str, Any, str]]:
    """(train.* field, registry, name) for every component the run names in a field declared with
    `_component`, in field order (the task, a spec rather than a name, is `_task_components`'
    business). An unset `eval_engine` names nothing (it is the training engine)."""
    named = []
    for spec in dataclasses.fields(cfg):
        family, value = spec.metadata.get("registry"), getattr(cfg, spec.name)
        if family is None or value is None:
            continue
        for name in value if isinstance(value, tuple) else (value,):
            named.append((spec.name, ALL_REGISTRIES[family], name))
    return named


def component_names(cfg: "TrainConfig") -> list[tuple[Any, str]]:
    """(registry, name) for every component the run uses, each once (`component_fields`)."""
    return list(dict.fromkeys((registry, name) for _, registry, name in component_fields(cfg)))


def family_key(registry) -> str:
    """The key of `registry` in `ALL_REGISTRIES` ("losses", "curricula", ...)."""
    for key, reg in ALL_REGISTRIES.items():
        if reg is registry:
            return key
    raise KeyError(f"{registry!r} is not one of the registries in ALL_REGISTRIES")


def component_params(cfg: "TrainConfig", registry, name: str) -> dict:
    """The hyper-parameters component `name` of `registry` is built with in this run: the resolved
    ones `cfg` carries; for a TrainConfig made by hand (no table), its defaults and gin bindings now."""
    params = cfg.params_of(family_key(registry), name)
    return params if params is not None else bound_values(registry, name)


def family_params(cfg: "TrainConfig", registry) -> Optional[dict[str, dict]]:
    """{name: hyper-parameters} of every resolved component of `registry` in this run, or None for a
    TrainConfig made by hand (the builders then take gin's bindings, as a tool outside a run does)."""
    if not cfg.components:
        return None
    family = family_key(registry)
    return {name: dict(params) for fam, name, params in cfg.components if fam == family}


def build_component(cfg: "TrainConfig", registry, name: str):
    """Component `name` of `registry` with this run's hyper-parameters bound as arguments (`Registry.build`)."""
    return registry.build(name, component_params(cfg, registry, name))


def _used_components(cfg: "TrainConfig") -> list[tuple[Any, str, Optional[dict]]]:
    """(registry, name, explicit keywords) of every registered component the run builds: its named
    components, each task of its task spec (with train.task_kwargs), the plain-function rewards of
    train.reward_funcs and of train.downstream_benchmarks' reward graders. A task's own reward (its
    `reward` parameter) is added by `component_table`."""
    from components.registry import REWARDS, TASKS

    used = [(registry, name, None) for registry, name in component_names(cfg)]
    used += [(TASKS, name, kw) for name, kw in _task_components(cfg.task, cfg.task_kwargs, cfg.seed)]
    used += [(REWARDS, name, None) for name in cfg.reward_funcs if isinstance(name, str)]  # train.reward_funcs' own
    used += [(REWARDS, spec.get("reward"), None) for spec in _benchmark_specs(cfg.downstream_benchmarks)]
    return used


def _benchmark_specs(specs) -> list:
    """The mapping specs of train.downstream_benchmarks (a plain path names no reward)."""
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    return [s for s in (specs or ()) if isinstance(s, Mapping)]


# constructor arguments the trainer gives every component it builds (from train.*), not hyper-parameters
SET_BY_TRAINER = frozenset({"seed", "device", "precision", "model", "tokenizer"})


def component_table(cfg: "TrainConfig") -> tuple:
    """Every registered component the run uses with its hyper-parameters under the parsed gin config
    (defaults, then bindings; `TrainConfig.components`; the arguments `SET_BY_TRAINER` aside). A
    value gin left as a reference (``@fn()``) is refused: the run's processes get values, never gin."""
    from components.registry import REWARDS, TASKS

    from components.trainer.gin_config import is_gin_reference

    table: dict[tuple[str, str], dict] = {}
    todo = _used_components(cfg)
    while todo:
        registry, name, explicit = todo.pop(0)
        if not isinstance(name, str) or name not in registry or (family_key(registry), name) in table:
            continue
        params = bound_values(registry, name)
        refs = sorted(k for k, v in params.items() if is_gin_reference(v))
        if refs:
            raise ConfigError(f"{registry.family} {name!r}: {', '.join(f'{name}.{k}' for k in refs)} is bound to a gin "
                              "reference (@...); bind a value")
        if registry is TASKS:  # its explicit keywords (train.task_kwargs) are what it is built with
            params.update(explicit or {})
            reward = params.get("reward")
            if "reward_params" in params and isinstance(reward, str) and reward in REWARDS:
                params["reward_params"] = {k: v for k, v in bound_values(REWARDS, reward).items() if k not in SET_BY_TRAINER}
        table[(family_key(registry), name)] = {k: v for k, v in params.items() if k not in SET_BY_TRAINER}
        if registry is TASKS:
            todo.append((REWARDS, {**params, **dict(explicit or {})}.get("reward"), None))
    return tuple((family, name, tuple(params.items())) for (family, name), params in table.items())


def check_components(cfg: "TrainConfig") -> None:
    """Refuse numeric hyper-parameters of the run's components that are not finite or out of their range.

    Every component the run uses (the task's plain-function reward too) is checked with the
    values it will be called with: its defaults, the gin bindings (``cispo.eps_max = ...``)
    and, for the task, ``train.task_kwargs``.
    Unknown names are left to the name checks (`check_settings`).
    """
    from components.registry import LENGTH_CONTROLS, REWARDS, TASKS, ParamRangeError

    used = [(registry, name, kw) for registry, name, kw in _used_components(cfg) if registry is not TRACKERS]
    problems = _mixture_weight_problem(cfg.task)
    while used:
        registry, name, overrides = used.pop(0)
        if not isinstance(name, str) or name not in registry:
            continue
        try:
            values = registry.check_params(name, {**component_params(cfg, registry, name), **dict(overrides or {})})
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
            build_component(cfg, LENGTH_CONTROLS, cfg.length_control)()
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
    nominal = build_component(cfg, PRECISIONS, cfg.precision)()
    if nominal.param_dtype != torch.float32 and (mode == "on" or (mode == "auto" and cfg.device == "cpu")):
        raise ConfigError(
            f"train.compile = True needs real arithmetic, but train.precision = {cfg.precision!r} is emulated here "
            f"(precision.emulate = {mode!r}, train.device = {cfg.device!r}); use train.compile = False, "
            "train.precision = 'fp32', or precision.emulate = \"off\" (real bf16)")


def check_mini_batches(prompts_per_step: int, mini_batches: int) -> None:
    """train.mini_batches must split a step's prompts_per_step prompt groups into equal mini-batches of whole
    groups (a group's advantages and prompt_mean's normaliser stay in one update). ConfigError naming the
    value and the valid ones (the divisors of prompts_per_step)."""
    if mini_batches >= 1 and prompts_per_step >= 1 and prompts_per_step % mini_batches:
        valid = [d for d in range(1, prompts_per_step + 1) if prompts_per_step % d == 0]
        raise ConfigError(f"train.mini_batches = {mini_batches} does not divide train.prompts_per_step = "
                          f"{prompts_per_step} (mini-batches hold whole prompt groups); valid: {valid}")


def validate(cfg: TrainConfig) -> None:
    """Fail early and clearly on out-of-range or inconsistent settings (component names are checked elsewhere).

    Checks every numeric train.* setting (`TRAIN_RANGES`), the settings that must agree with
    each other, and the numeric hyper-parameters of the run's components (`check_components`).
    """
    check_train_values({name: getattr(cfg, name) for name in _TRAIN_PARAM_NAMES})
    check_mini_batches(cfg.prompts_per_step, cfg.mini_batches)
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
    _check_multi_turn(cfg)
    if cfg.lora_rank > 0:
        _check_lora_targets(cfg.lora_targets)  # their form; which modules they match is checked on the model (lora.check_targets)
    if cfg.reward_funcs or cfg.reward_weights is not None:
        from components.rewards import check_reward_funcs

        try:
            check_reward_funcs(cfg.reward_funcs, cfg.reward_weights)  # each resolves (imports), weights match
        except ValueError as err:
            raise ConfigError(str(err)) from None
    from components.trainer.tracking import check_trackers

    try:
        check_trackers(cfg.trackers)  # unknown name: lists the valid ones; package missing: names the pip extra
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_components(cfg)


def _check_multi_turn(cfg: TrainConfig) -> None:
    """train.environment's settings agree: a per-turn budget needs an environment and fits in max_tokens, and a
    forced-interruption length control (it counts sampled tokens across turns) is refused beside one."""
    if not cfg.environment:
        if cfg.max_tokens_per_turn is not None:
            raise ConfigError(f"train.max_tokens_per_turn = {cfg.max_tokens_per_turn} needs train.environment "
                              "(a single-turn run has one turn: its budget is train.max_tokens)")
        if cfg.mask_observations is not True:
            raise ConfigError(f"train.mask_observations = {cfg.mask_observations!r} needs train.environment "
                              "(a single-turn run has no observation tokens)")
        return
    if cfg.max_tokens_per_turn is not None and cfg.max_tokens_per_turn > cfg.max_tokens:
        raise ConfigError(f"train.max_tokens_per_turn = {cfg.max_tokens_per_turn} is above train.max_tokens = "
                          f"{cfg.max_tokens}, the sampled-token budget of the whole episode")
    if cfg.length_control == "interruption":
        raise ConfigError(f"train.length_control = 'interruption' cannot run with train.environment = "
                          f"{cfg.environment!r}: forced interruptions count sampled tokens across turns; use "
                          "train.max_tokens_per_turn, 'length_penalty' or 'truncate'")


def check_settings(cfg: TrainConfig, on_this_machine: bool = True) -> None:
    """Every component the config names is registered (else the registry's error, with its did-you-mean,
    after the train.* setting that names it), every number is in range and the settings agree
    (`validate`). Reads no data and touches no model: `scalerl train` and a sweep run it before
    anything is built or submitted. `on_this_machine`: the run trains here, so
    train.attn_implementation is checked against this machine's device too (not for a run submitted
    to another machine)."""
    from components.registry import OFF_POLICY
    from components.tasks import check_task_spec

    for setting, registry, name in component_fields(cfg):  # every train.* field that names components
        try:
            registry.check(name)
        except UnknownComponentError as err:
            where = f"train.{setting} = {name!r}" if getattr(cfg, setting) == name else f"train.{setting}"  # a list
            raise UnknownComponentError(f"{where}: {err}") from None
    try:
        check_task_spec(cfg.task)  # a name, "reasoning_gym:<dataset>" or a mixture {spec: weight}
    except UnknownComponentError as err:
        raise UnknownComponentError(f"train.task = {cfg.task!r}: {err}") from None
    except ValueError as err:
        raise ConfigError(f"train.task: {err}") from None
    validate(cfg)
    build_component(cfg, OFF_POLICY, cfg.off_policy)()  # also validates k
    if on_this_machine:
        _check_device_here(cfg)
        try:
            attention_of(cfg)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _check_device_here(cfg: TrainConfig) -> None:
    """train.device = "cuda" on a machine where torch sees no CUDA device: refused before any process
    starts (the run would otherwise start its processes and fail in each)."""
    if not str(cfg.device).startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"train.device = {cfg.device!r} but {why} on this machine (torch {torch.__version__}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use "
                          "train.device = \"auto\" (a GPU where there is one, else the CPU) or \"cpu\", or submit the "
                          "run to a GPU machine (--executor slurm)")


def on_gpu(cfg: TrainConfig) -> bool:
    """Does this run's learner train on a GPU here (train.device, or "auto" with CUDA available)?"""
    import torch

    return cfg.device != "cpu" and (cfg.device != "auto" or torch.cuda.is_available())


def attention_of(cfg: TrainConfig) -> str:
    """The transformers attention implementation the learner uses (train.attn_implementation resolved)."""
    from components.trainer.attention import learner_attn_implementation

    return learner_attn_implementation(cfg, "cuda" if on_gpu(cfg) else "cpu")


def engine_gpus(cfg) -> int:
    """GPUs one generator's engine uses, as its registered class says (`Engine.gpus_per_instance`
    with its defaults and gin bindings: vLLM's tensor_parallel_size; 1 for the torch engine)."""
    engine_cls = ENGINES.original(cfg.engine)  # an unknown name: the registry's error
    gpus = getattr(engine_cls, "gpus_per_instance", None)
    return max(int(gpus(component_params(cfg, ENGINES, cfg.engine))), 1) if gpus is not None else 1
