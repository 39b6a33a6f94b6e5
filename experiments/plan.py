"""`scalerl plan CONFIG [CONFIG...] [--gin BINDING]... [--gpu-memory-gb 80]`: memory per GPU before submission.

Parses the run's gin config exactly as `scalerl train` does (`components.trainer.gin_config.parse_gin_files`),
reads the model's `config.json` only (no weights, no model built), reads the run's layout
(`train.learner_ranks`, `train.num_generators`, the engine's knobs such as
`vllm.tensor_parallel_size`, `vllm.max_num_seqs`, `vllm.max_model_len`,
`vllm.gpu_memory_utilization`) and prints, per learner GPU and per generator GPU, what each part
of the run needs. Exit status: 0 when everything fits, 1 when something does not (each problem is
named), 2 when the config cannot be planned (a bad value, no config.json to read).

A CPU run (`train.device = "cpu"`) is estimated but not checked unless `--gpu-memory-gb` is given.

The arithmetic (what each part of a learner and a generator needs, and why) is
`experiments/memory_model.py`; this module reads a run's configuration into it and prints the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from experiments.memory_model import (  # the arithmetic; re-exported for `scalerl plan`'s callers
    GeneratorLayout, GiB, LearnerLayout, ModelIdError, ModelShape, PlanError,
    has_fp32_head, activation_bytes_per_token_layer, engine_memory_model, generator_memory, kv_bytes_per_token,
    learner_memory, parameter_counts, planned_attention,
)

DEFAULT_GPU_MEMORY_GB = 80.0
DEFAULT_PROMPT_TOKENS = 2048  # the paper's prompt budget: the allowance for a prompt before the generation cap

__all__ = [
    "ModelShape",
    "LearnerLayout",
    "GeneratorLayout",
    "MemoryPlan",
    "PlanError",
    "parameter_counts",
    "activation_bytes_per_token_layer",
    "kv_bytes_per_token",
    "learner_memory",
    "generator_memory",
    "tiny_policy_config",
    "plan_config",
    "render",
    "sweep_memory",
    "PlanInputs",
    "plan_inputs",
    "plan_memory",
    "print_sweep_memory",
    "add_arguments",
    "main",
]

# ---------------------------------------------------------------------------------------------
# reading a run's config (gin) without building anything
def tiny_policy_config(**build_kwargs) -> dict:
    """The config.json `components.models.build_tiny_policy(**build_kwargs)` writes, without writing it."""
    from components.models import SPECIAL_TOKENS, build_tiny_policy

    defaults = {n: p.default for n, p in inspect.signature(build_tiny_policy).parameters.items() if p.default is not p.empty}
    unknown = sorted(set(build_kwargs) - set(defaults))
    if unknown:
        raise PlanError(f"build_tiny_policy has no parameter(s) {', '.join(unknown)}; its parameters: {', '.join(defaults)}")
    kw = {**defaults, **build_kwargs}
    hidden = int(kw["hidden_size"])
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(kw["intermediate_size"] or 4 * hidden),
        "num_hidden_layers": int(kw["num_layers"]),
        "num_attention_heads": int(kw["num_heads"]),
        "num_key_value_heads": int(kw["num_heads"]),
        "max_position_embeddings": int(kw["max_position_embeddings"]),
        "tie_word_embeddings": bool(kw["tie_word_embeddings"]),
        "vocab_size": len(dict.fromkeys(list(SPECIAL_TOKENS) + list(kw["alphabet"]))),
    }


def _is_ref(value) -> bool:
    import gin

    return isinstance(value, gin.config.ConfigurableReference)


def _resolve(value):
    """A gin value with macros evaluated; references to other configurables are returned as is."""
    if _is_ref(value) and value.configurable.name == "macro":
        return value.scoped_configurable_fn()
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    return value


def _bound(selector: str, param: str, default=None):
    """The value bound to `selector.param` in the parsed gin config (macros evaluated), else `default`."""
    from components.trainer.gin_config import bound_parameter

    try:
        return _resolve(bound_parameter(f"{selector}.{param}"))
    except ValueError:
        return default


def _model_config() -> tuple[dict, str]:
    """(config dict, where it came from) for the run's model.path, never running a builder.

    A Hugging Face hub id is read from its config.json alone (fetched into the HF cache unless
    cached; HF_HUB_OFFLINE=1: the cache only), at model.revision."""
    from components.models import ModelPathError, hub_model_file, looks_local

    path = _bound("model", "path", None)
    if path is None:
        raise PlanError('model.path is not set: bind it in the gin file or with --gin \'model.path = "/path/to/checkpoint"\'')
    if isinstance(path, str):
        p = Path(path).expanduser()
        if (p / "config.json").is_file():
            try:
                return json.loads((p / "config.json").read_text()), str(p / "config.json")
            except ValueError as err:
                raise PlanError(f"{p / 'config.json'} is not valid JSON: {err}") from None
    # not there (yet): the shapes of a locally built tiny policy can be derived from its keywords
    if _is_ref(path) and path.configurable.name == "warm_start":
        kwargs = _bound("warm_start", "model_kwargs", None) or {}
        return tiny_policy_config(**dict(kwargs)), "the warm-start builder's tiny policy (shapes from warm_start.model_kwargs; nothing built)"
    builder = _bound("model", "builder", None)
    new_model = _bound("model", "new_model", False) or _bound("model", "build_if_missing", False)  # the latter: deprecated name
    if isinstance(path, str) and new_model and builder is None:
        kwargs = _bound("model", "build_kwargs", None) or {}
        return tiny_policy_config(**dict(kwargs)), f"build_tiny_policy(**model.build_kwargs) (model.path {path} not built; nothing built)"
    if isinstance(path, str) and not new_model and not looks_local(path):  # a hub id: its config.json alone
        revision = _bound("model", "revision", None)
        try:
            file = hub_model_file(path, "config.json", revision)
            return json.loads(Path(file).read_text()), f"{path} (revision {revision or 'main'}): {file}"
        except ModelPathError as err:
            raise ModelIdError(str(err)) from None
        except ValueError as err:
            raise PlanError(f"the config.json of {path} is not valid JSON: {err}") from None
    where = str(path) if isinstance(path, str) else f"@{path.configurable.name}()"
    raise PlanError(
        f"cannot read the model's shapes: model.path {where} has no config.json, and the plan reads config.json only "
        "(no weights, no builder run). Point model.path at a local checkpoint directory (a config.json alone is enough)."
    )


def _engine_knobs(engine: str) -> dict:
    """The engine constructor's keyword values: gin-bound ones, else the signature's defaults."""
    from components.registry import ENGINES

    try:
        specs = ENGINES.params(engine)
    except Exception as err:
        raise PlanError(str(err)) from None
    knobs = {p.name: (None if p.required else p.default) for p in specs}
    for name in list(knobs) + ["max_num_batched_tokens"]:
        knobs[name] = _bound(engine, name, knobs.get(name))
        if _is_ref(knobs[name]):
            raise PlanError(f"{engine}.{name} is bound to @{knobs[name].configurable.name}: the plan needs a literal value")
    return knobs


def _length_control_cap(cfg) -> Optional[int]:
    """The generation cap the run's length control puts on train.max_tokens (None: no length control,
    or one that keeps max_tokens); its constructor reads its gin bindings."""
    return _length_control_cap_and_source(cfg)[0]


def _length_control_cap_and_source(cfg) -> tuple[Optional[int], Optional[str]]:
    """(the length control's generation cap, the settings it comes from in words), or (None, None)."""
    if not cfg.length_control:
        return None, None
    from components.registry import LENGTH_CONTROLS

    control = LENGTH_CONTROLS.get(cfg.length_control)()
    if not hasattr(control, "max_tokens"):
        return None, None
    cap = int(control.max_tokens(cfg.max_tokens))
    name = cfg.length_control
    if hasattr(control, "thinking_max") and hasattr(control, "answer_budget"):
        source = (f"{name}.thinking_max + {name}.answer_budget = {control.thinking_max} + {control.answer_budget} "
                  f"= {cap}")
    elif hasattr(control, "l_max"):
        source = f"{name}.l_max = {cap}"
    elif getattr(control, "_max_tokens", None) is not None:
        source = f"{name}.max_tokens = {cap}"
    else:
        source = f"the length control {name!r}: {cap}"
    return cap, source


@dataclass
class MemoryPlan:
    """A run's memory plan: what was read, the estimates, and what does not fit."""

    config_files: list
    bindings: list
    model_source: str
    shape: ModelShape
    cpu: bool
    checked: bool
    gpu_bytes: int
    learner_ranks: int
    num_generators: int
    engine: str
    tensor_parallel_size: int
    learner_layout: LearnerLayout
    generator_layout: GeneratorLayout
    learner: dict
    generator: dict
    longest_sequence: int
    generation_cap: int
    packed: bool
    problems: list = field(default_factory=list)  # what does not fit (checked runs only)
    notes: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def gpus(self) -> int:
        return self.learner_ranks + self.num_generators * self.tensor_parallel_size

    def summary(self) -> str:
        """One line for a sweep table."""
        lt, gt = self.learner["total"], self.generator["total"]
        if self.cpu and not self.checked:
            return f"CPU run, not checked: learner ~{_size(lt)}, generator ~{_size(gt)}"
        head = "fits" if self.fits else "DOES NOT FIT: " + "; ".join(self.problems)
        kv = ""
        if engine_memory_model(self.engine) == "paged":
            kv = f", KV need {_gib(self.generator['kv_needed'])} of {_gib(self.generator['kv_budget'])} GiB"
        return (f"{head} (GPU {_gib(self.gpu_bytes)} GiB: learner {_gib(lt)} GiB x {self.learner_ranks}, "
                f"generator {_gib(gt)} GiB x {self.num_generators * self.tensor_parallel_size}{kv})")


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def _size(x: float) -> str:
    return f"{x / GiB:.1f} GiB" if x >= GiB else f"{x / 2**20:.0f} MiB"


def plan_config(
    config_files: Sequence[str],
    bindings: Sequence[str] = (),
    *,
    gpu_memory_gb: Optional[float] = None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> MemoryPlan:
    """Parse the gin config (as `scalerl train` does) and plan its memory. Raises PlanError.

    gpu_memory_gb: memory of one GPU in GiB; None: 80 for GPU runs, and CPU runs
    (train.device = "cpu") are estimated but not checked.
    """
    from components.trainer.config import ConfigError, train_config, validate
    from components.trainer.gin_config import parse_gin_files

    _check_plan_args(gpu_memory_gb, prompt_tokens)
    try:
        files, _ = parse_gin_files(config_files, bindings)
    except (FileNotFoundError, ValueError, KeyError, ImportError, SyntaxError) as err:
        raise PlanError(f"the gin config does not parse: {type(err).__name__}: {err}") from None
    inputs = plan_inputs()
    try:
        cfg = train_config(model_path="<read by scalerl plan>")
        validate(cfg)
    except (ConfigError, TypeError, ValueError) as err:
        raise PlanError(f"{type(err).__name__}: {err}") from None
    return plan_memory(cfg, inputs, gpu_memory_gb=gpu_memory_gb, prompt_tokens=prompt_tokens,
                       config_files=files, bindings=bindings)


@dataclass(frozen=True)
class PlanInputs:
    """What a memory plan reads from a run's parsed gin config besides its TrainConfig: the model's
    config.json (or the tiny policy's, derived), the engine's knobs and the generation cap's
    length control. Read once, while gin holds the run (`plan_inputs`), so a sweep parses each
    run once (`experiments.run_config`)."""

    model_config: dict
    model_source: str
    engine_knobs: dict
    length_control_cap: Optional[int]  # the length control's own cap on max_tokens (None: none)
    length_control_source: Optional[str] = None  # the settings that cap comes from, in words


def plan_inputs() -> PlanInputs:
    """`PlanInputs` from the gin config parsed now (raises PlanError), never building a model."""
    from components.trainer.config import ConfigError, train_config

    config, source = _model_config()
    try:
        cfg = train_config(model_path="<read by scalerl plan>")
    except (ConfigError, TypeError, ValueError) as err:
        raise PlanError(f"{type(err).__name__}: {err}") from None
    return PlanInputs(config, source, _engine_knobs(cfg.engine), *_length_control_cap_and_source(cfg))


def _check_plan_args(gpu_memory_gb: Optional[float], prompt_tokens: int) -> None:
    if int(prompt_tokens) < 1:
        raise PlanError(f"--prompt-tokens must be >= 1, got {prompt_tokens!r}")
    if gpu_memory_gb is not None and not float(gpu_memory_gb) > 0:
        raise PlanError(f"--gpu-memory-gb must be > 0, got {gpu_memory_gb!r}")


def _fit_problems(cfg, learner: dict, generator: dict, layout_g, gpu_bytes: int, is_vllm: bool) -> list[str]:
    """Where the learner or a generator does not fit its GPU of `gpu_bytes` (vLLM: its KV cache)."""
    problems: list[str] = []
    if learner["total"] > gpu_bytes:
        problems.append(f"learner GPU needs {_gib(learner['total'])} GiB > {_gib(gpu_bytes)} GiB "
                        f"(train.learner_ranks = {cfg.learner_ranks}: raise it to shard the fp32 state further, "
                        "or lower train.max_tokens_per_micro_batch / turn on train.activation_checkpointing)")
    if is_vllm:
        if generator["kv_budget"] <= 0:
            problems.append(f"generator GPU: weights + activations + overhead ({_gib(generator['reserved'] - generator['kv_budget'])} GiB) "
                            f"leave no KV cache within gpu_memory_utilization x GPU = {_gib(generator['reserved'])} GiB "
                            "(raise vllm.tensor_parallel_size or vllm.gpu_memory_utilization)")
        elif generator["kv_needed"] > generator["kv_budget"]:
            per_seq = layout_g.max_model_len * generator["kv_per_token"]
            fit = generator["kv_budget"] // per_seq
            problems.append(f"generator KV cache: vllm.max_num_seqs ({layout_g.max_num_seqs}) x vllm.max_model_len "
                            f"({layout_g.max_model_len}) needs {_gib(generator['kv_needed'])} GiB > the "
                            f"{_gib(generator['kv_budget'])} GiB vLLM leaves; at most {fit} sequences of that length fit "
                            "(lower max_num_seqs, or raise tensor_parallel_size / gpu_memory_utilization)")
    elif generator["total"] > gpu_bytes:
        problems.append(f"generator GPU needs {_gib(generator['total'])} GiB > {_gib(gpu_bytes)} GiB "
                        f"(set {cfg.engine}.max_cache_tokens or lower {cfg.engine}.max_batch_size)")
    return problems


def plan_memory(cfg, inputs: PlanInputs, *, gpu_memory_gb: Optional[float] = None,
                prompt_tokens: int = DEFAULT_PROMPT_TOKENS, config_files: Sequence[str] = (),
                bindings: Sequence[str] = ()) -> MemoryPlan:
    """The memory plan of a run from its TrainConfig and `PlanInputs` (no gin read here)."""
    _check_plan_args(gpu_memory_gb, prompt_tokens)
    config, source, knobs = inputs.model_config, inputs.model_source, inputs.engine_knobs
    shape = ModelShape.from_config(config)
    files = list(config_files)
    cpu = str(cfg.device) == "cpu"
    checked = gpu_memory_gb is not None or not cpu
    gpu_bytes = int(float(gpu_memory_gb if gpu_memory_gb is not None else DEFAULT_GPU_MEMORY_GB) * GiB)
    problems: list[str] = []
    notes: list[str] = []

    # sequence lengths
    cap = int(cfg.max_tokens) if inputs.length_control_cap is None else inputs.length_control_cap
    if cap != int(cfg.max_tokens):  # the length control, not train.max_tokens, sets what the generators sample
        source = inputs.length_control_source or f"the length control {cfg.length_control!r}"
        notes.insert(0, f"WARNING: train.max_tokens = {cfg.max_tokens} is not the generation cap: train.length_control = "
                        f"{cfg.length_control!r} {'lowers' if cap < int(cfg.max_tokens) else 'raises'} it to {source} "
                        f"tokens, and the run samples at most {cap} per completion (planned with {cap}); to sample "
                        f"{cfg.max_tokens}, change those settings, or set train.max_tokens = {cap} to say what runs")
    max_pos = shape.max_position_embeddings
    is_vllm = engine_memory_model(cfg.engine) == "paged"  # vLLM's knobs and memory model
    max_model_len = knobs.get("max_model_len") if is_vllm else None
    context = max_model_len or max_pos or (cap + int(prompt_tokens))
    longest = min(context, cap + int(prompt_tokens))
    if is_vllm and max_model_len is not None and max_pos is not None and max_model_len > max_pos:
        problems.append(f"vllm.max_model_len ({max_model_len}) exceeds the model's max_position_embeddings ({max_pos}); vLLM refuses it")
    if is_vllm and max_model_len is not None and max_model_len <= cap:
        problems.append(f"vllm.max_model_len ({max_model_len}) leaves no room for a prompt before the generation cap "
                        f"({cap} tokens): completions would be cut; raise it to at least {cap + int(prompt_tokens)}")
    if not is_vllm and max_pos is not None and cap >= max_pos:
        problems.append(f"the generation cap ({cap} tokens) reaches the model's max_position_embeddings ({max_pos})")

    # the learner
    attention = planned_attention(cfg.attn_implementation, "cpu" if cpu else "cuda", cfg.precision, config)
    packed = cfg.max_tokens_per_micro_batch is not None
    if packed:
        budget = int(cfg.max_tokens_per_micro_batch)
        layout_l = LearnerLayout(ranks=cfg.learner_ranks, rows=1, row_length=budget, head_tokens=budget,
                                 activation_checkpointing=cfg.activation_checkpointing, logprob_chunk_size=cfg.logprob_chunk_size,
                                 precision=cfg.precision, attn_implementation=attention, device="cpu" if cpu else "cuda",
                                 lora_rank=cfg.lora_rank, lora_targets=cfg.lora_targets,
                                 kl_reference=cfg.kl_coef > 0)
        if budget < longest:
            problems.append(f"train.max_tokens_per_micro_batch ({budget}) is shorter than the longest sequence "
                            f"({longest} tokens: generation cap {cap} + prompt allowance, capped by the context); "
                            "the learner refuses such a sequence")
    else:
        layout_l = LearnerLayout(ranks=cfg.learner_ranks, rows=min(cfg.micro_batch_size, cfg.batch_sequences), row_length=longest,
                                 head_tokens=min(cfg.micro_batch_size, cfg.batch_sequences) * min(cap, longest),
                                 activation_checkpointing=cfg.activation_checkpointing, logprob_chunk_size=cfg.logprob_chunk_size,
                                 precision=cfg.precision, attn_implementation=attention, device="cpu" if cpu else "cuda",
                                 lora_rank=cfg.lora_rank, lora_targets=cfg.lora_targets,
                                 kl_reference=cfg.kl_coef > 0)
        notes.append(f"padded micro-batches: {layout_l.rows} sequences x {longest} tokens (set train.max_tokens_per_micro_batch to pack)")
    learner = learner_memory(shape, layout_l)

    # the generators
    if is_vllm:
        seqs = knobs.get("max_num_seqs") or knobs.get("max_batch_size")
        if seqs is None:
            from components.engines.vllm_engine import DEFAULT_MAX_NUM_SEQS

            seqs = DEFAULT_MAX_NUM_SEQS
        tp = int(knobs.get("tensor_parallel_size") or 1)
        if shape.num_heads % tp:
            problems.append(f"vllm.tensor_parallel_size ({tp}) does not divide the {shape.num_heads} attention heads")
        layout_g = GeneratorLayout(
            engine=cfg.engine, precision=cfg.precision, device="cpu" if cpu else "cuda", tensor_parallel_size=tp,
            gpu_memory_utilization=float(knobs.get("gpu_memory_utilization") or 0.9), max_num_seqs=int(seqs),
            max_model_len=int(max_model_len or max_pos or longest),
            max_num_batched_tokens=knobs.get("max_num_batched_tokens"),
            enforce_eager=bool(knobs.get("enforce_eager") if knobs.get("enforce_eager") is not None else cpu),
            cpu_kv_cache_gib=int(knobs.get("kv_cache_space_gib") or 1),
        )
        if max_model_len is None:
            notes.append(f"vllm.max_model_len is not set: vLLM uses the model's context ({layout_g.max_model_len} tokens)")
    else:
        tp = 1
        layout_g = GeneratorLayout(engine=cfg.engine, precision=cfg.precision,
                                   device="cpu" if cpu else "cuda", max_num_seqs=int(knobs.get("max_batch_size") or 256),
                                   max_model_len=longest, max_cache_tokens=knobs.get("max_cache_tokens"))
    generator = generator_memory(shape, layout_g, gpu_bytes)

    if checked:  # length problems are real on a CPU too; memory is checked on a GPU (or a given size)
        problems += _fit_problems(cfg, learner, generator, layout_g, gpu_bytes, is_vllm)
    return MemoryPlan(
        config_files=list(files), bindings=list(bindings), model_source=source, shape=shape, cpu=cpu, checked=checked,
        gpu_bytes=gpu_bytes, learner_ranks=cfg.learner_ranks, num_generators=cfg.num_generators, engine=cfg.engine,
        tensor_parallel_size=tp, learner_layout=layout_l, generator_layout=layout_g, learner=learner, generator=generator,
        longest_sequence=longest, generation_cap=cap, packed=packed, problems=problems, notes=notes,
    )


# ---------------------------------------------------------------------------------------------
# output
def render(plan: MemoryPlan) -> str:
    """The plan as text: the layout, one table per learner GPU and per generator GPU, the verdict."""
    s, ll, gl, lm, gm = plan.shape, plan.learner_layout, plan.generator_layout, plan.learner, plan.generator
    counts = parameter_counts(s, untie_head=has_fp32_head(ll.precision))
    T, tp = plan.learner_ranks, plan.tensor_parallel_size
    dev = "CPU" if plan.cpu else "GPU"
    lines = [
        f"model: {plan.model_source}",
        f"  {s.model_type}: {counts['total'] / 1e9:.3f}B parameters (hidden {s.hidden_size}, {s.num_layers} layers, "
        f"{s.num_heads} heads / {s.num_kv_heads} KV heads of {s.head_dim}, MLP {s.intermediate_size}, vocab {s.vocab_size})",
        f"layout: {T} learner {dev}(s) (FSDP2 ranks) + {plan.num_generators} generator(s) x {tp} {dev} "
        f"({plan.engine}) = {plan.gpus} {dev}s"
        + ("" if plan.cpu and not plan.checked else f"; {_gib(plan.gpu_bytes)} GiB per GPU"),
        f"sequences: generation cap {plan.generation_cap} tokens, longest sequence planned {plan.longest_sequence} tokens",
        f"learner micro-batch: {'packed' if plan.packed else 'padded'} {ll.rows} x {ll.row_length} = {ll.tokens} tokens, "
        f"precision {ll.precision}, activation checkpointing {'on' if ll.activation_checkpointing else 'off'}, "
        f"log-prob chunk {min(ll.logprob_chunk_size, ll.head_tokens or ll.tokens)} tokens, attention {ll.attn_implementation or 'sdpa'}",
        f"trained: LoRA rank {ll.lora_rank} on {ll.lora_targets if isinstance(ll.lora_targets, str) else ', '.join(ll.lora_targets)}, "
        f"{lm['trainable_parameters'] / 1e6:.3f}M adapter parameters (the {counts['total'] / 1e9:.3f}B base frozen)"
        if ll.lora_rank > 0 else f"trained: every parameter (full fine-tuning, {counts['total'] / 1e9:.3f}B)",
        "",
    ]

    unit, scale = ("GiB", GiB) if max(lm["total"], gm["total"]) >= GiB else ("MiB", 2**20)

    def row(label: str, value: float, width: int = 64) -> str:
        return f"  {label:<{width}}{value / scale:>9.2f}"

    lines += [
        f"{f'per learner {dev} (1 of {T})':<66}{unit:>9}",
        row(f"parameters (fp32 master{', base + adapters' if ll.lora_rank > 0 else ''}, 1/{T})", lm["parameters"]),
        *([row(f"KL reference policy (frozen fp32 copy, 1/{T})", lm["reference"])] if lm.get("reference") else []),
        row(f"gradients (fp32, 1/{T}{', adapters only' if ll.lora_rank > 0 else ''})", lm["gradients"]),
        row(f"optimizer state (AdamW 2 x fp32, 1/{T}{', adapters only' if ll.lora_rank > 0 else ''})", lm["optimizer"]),
        row("compute copies (unsharded blocks/root + their grads)" if T > 1 else "compute copies (autocast weights, head grad)", lm["compute_copies"]),
        row(f"activations at {ll.tokens} tokens ({'checkpointed' if ll.activation_checkpointing else 'all saved'})", lm["activations"]),
        row("  kept for backward", lm["act_saved"]),
        row("  one block recomputed", lm["act_recompute"]),
        row("  backward working set", lm["act_backward"]),
        row("logits chunk (3 x chunk x vocab x fp32)", lm["logits_chunk"]),
        row("overhead (CUDA context, NCCL, fragmentation)", lm["overhead"]),
        row("total", lm["total"]),
        "",
    ]
    if engine_memory_model(plan.engine) == "paged":
        lines += [
            f"per generator {dev} (vllm, tensor_parallel_size {tp}, max_num_seqs {gl.max_num_seqs}, max_model_len {gl.max_model_len}"
            + (")" if plan.cpu else f", gpu_memory_utilization {gl.gpu_memory_utilization})"),
            row(f"weights ({ll.precision}, 1/{tp})", gm["weights"]),
            row("activations (profiling forward + sampler logits)", gm["activations"]),
            row("overhead (CUDA context, NCCL" + ("" if gl.enforce_eager else ", CUDA graphs") + ")", gm["overhead"]),
            row("KV cache budget (vllm-cpu: vllm.kv_cache_space_gib)" if plan.cpu else
                f"KV cache budget ({gl.gpu_memory_utilization} x GPU - the above)", gm["kv_budget"]),
            row(f"KV cache needed ({gl.max_num_seqs} seqs x {gl.max_model_len} tok x {gm['kv_per_token'] // 1024} KiB)", gm["kv_needed"]),
            row("total" if plan.cpu else "total (vLLM reserves gpu_memory_utilization x GPU)", gm["total"]),
        ]
    else:
        lines += [
            f"per generator {dev} ({plan.engine}, max_batch_size {gl.max_num_seqs}, "
            f"max_cache_tokens {gl.max_cache_tokens if gl.max_cache_tokens is not None else 'unset'})",
            row("weights", gm["weights"]),
            row(f"KV cache ({'max_cache_tokens' if gl.max_cache_tokens is not None else 'max_batch_size x longest'}, "
                f"{gm['kv_per_token'] // 1024} KiB/token)", gm["kv_needed"]),
            row("sampling logits + KV merge copy", gm["activations"]),
            row("overhead", gm["overhead"]),
            row("total", gm["total"]),
        ]
    lines.append("")
    for note in plan.notes:
        lines.append(f"note: {note}")
    if not plan.checked:
        lines.append("CPU run (train.device = \"cpu\"): estimated, not checked (pass --gpu-memory-gb to check)")
    if plan.problems:
        lines.append("DOES NOT FIT:")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        lines.append("fits" if plan.checked else "no problems found")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# sweeps (`scalerl sweep` calls this before submitting)
def sweep_memory(configs: Mapping[str, Any], gpu_memory_gb: Optional[float] = None, *,
                 prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> dict:
    """{run name: (fits: True | False | None, one-line summary)} for a sweep's runs, from their
    parsed configs (`experiments.run_config.RunConfig`: the TrainConfig and `PlanInputs`, read when
    the run was parsed; nothing is parsed again).

    None: not checked (a CPU run without --gpu-memory-gb, or a model whose config.json cannot
    be read before submission).
    """
    out = {}
    for name, rc in configs.items():
        if rc.plan_inputs is None:
            out[name] = (None, f"not checked: {rc.plan_error}")
            continue
        try:
            p = plan_memory(rc.train, rc.plan_inputs, gpu_memory_gb=gpu_memory_gb, prompt_tokens=prompt_tokens)
        except PlanError as err:
            out[name] = (None, f"not checked: {err}")
            continue
        out[name] = (p.fits if p.checked or p.problems else None, p.summary())
    return out


def print_sweep_memory(memory: Mapping[str, tuple], console=None) -> None:
    """The per-run memory plan of a sweep as a table (rich), after `scalerl sweep`'s run table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="memory plan per run (scalerl plan)")
    table.add_column("run", overflow="fold")
    table.add_column("memory per GPU", overflow="fold")
    for name, (fits, text) in memory.items():
        style = "" if fits is None else ("green" if fits else "red")
        table.add_row(name, f"[{style}]{text}[/{style}]" if style else text)
    console.print(table)


# ---------------------------------------------------------------------------------------------
# CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="+", metavar="CONFIG", help="gin config file(s), e.g. experiments/configs/scalerl.gin")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING",
                        help="extra gin binding, e.g. 'model.path = \"/ckpt/8b\"' (repeatable)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GB",
                        help=f"memory of one GPU in GiB (default {DEFAULT_GPU_MEMORY_GB:g}; CPU runs are only checked when given)")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, metavar="N",
                        help=f"longest prompt to plan for (default {DEFAULT_PROMPT_TOKENS}, the paper's prompt budget)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes) instead of a table")


def main(args: argparse.Namespace) -> int:
    try:
        plan = plan_config(args.configs, args.gin, gpu_memory_gb=args.gpu_memory_gb, prompt_tokens=args.prompt_tokens)
    except PlanError as err:
        print(f"scalerl plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "fits": plan.fits, "checked": plan.checked, "problems": plan.problems, "notes": plan.notes,
            "gpu_bytes": plan.gpu_bytes, "gpus": plan.gpus, "learner_ranks": plan.learner_ranks,
            "num_generators": plan.num_generators, "tensor_parallel_size": plan.tensor_parallel_size,
            "longest_sequence": plan.longest_sequence, "model_source": plan.model_source,
            "shape": dataclasses.asdict(plan.shape), "learner_layout": dataclasses.asdict(plan.learner_layout),
            "generator_layout": dataclasses.asdict(plan.generator_layout), "learner": plan.learner, "generator": plan.generator,
        }, indent=1))
    else:
        print(render(plan))
    return 0 if plan.fits else 1
