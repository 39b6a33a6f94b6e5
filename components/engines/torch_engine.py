"""`torch` engine: a transformers causal LM with a KV cache and batched sampling (CPU or GPU).

Scheduling: CONTINUOUS BATCHING. Each `step()` does exactly
  1. one decode step (one forward of shape [B, 1]) for every in-flight sequence, then
  2. admission of queued requests while the batch has room (`max_batch_size` sequences, and
     at most `max_cache_tokens` KV-cache slots, see below; to amortise the cache copy a merge
     waits until an eighth of the batch, or all that is queued, fits):
     their prompts are prefilled together (left-padded, one forward), each prompt once
     however many samples it has; the prompt's KV cache is then repeated for its `n`
     samples and merged into the running cache (shorter caches are left-padded and the
     padding is masked).
Finished sequences leave the batch at once (their rows are dropped from the cache and
leading all-padding columns are trimmed), and a group is returned by the `step()` in which
its last sample finished (streaming). Caches whose layers are not plain `DynamicLayer`s
(sliding-window models) cannot be merged; for those the engine admits in waves (only when
the batch is empty) — same results, less throughput.

KV-cache size (`max_cache_tokens`): the cache is one buffer per layer of shape
[rows, kv_heads, columns, head_dim]; every row shares the column count (left padding), and
each buffer is allocated once per admission with room for the longest remaining generation
(columns = current length + most tokens any row may still add, at least 32). Its size in
"cache tokens" is rows x columns (padding included; one cache token = 2 x layers x kv_heads x
head_dim values). Admission stops before a merge would make that exceed `max_cache_tokens`,
so the cache never grows past it (the transient copy while merging aside); a request whose
samples alone would exceed it is refused in `add_requests`.

Weight updates (`update_weights`) copy the new tensors into the existing parameters
(`Tensor.copy_`, no reallocation, dtype converted to this engine's precision). The KV cache
is kept, so sequences in flight continue under the new weights (PipelineRL); every token
records the version of the weights that produced it.

Forced interruption (`Interruption` on a request): once a sequence has sampled `at_token`
tokens without stopping, and only if it is still thinking (`base.still_thinking`: no
``</think>`` sampled yet, and a thinking part open), the phrase tokens are fed one per decode
step (forced=True, gen_logp 0.0, version = version at injection), then up to `answer_budget`
more tokens are sampled. A sequence no longer thinking there is not interrupted and samples
on. `SamplingParams.max_tokens` stays a hard cap on sampled tokens.

Sampling: probabilities softmax(logits / T) (float32), optional top-p (nucleus) filtering,
then `torch.multinomial` with the engine's seeded generator; temperature <= 0 is greedy.
gen_logp = log_softmax(logits / T)[token] before top-p (`logprobs.token_logprobs`).
The other knobs of `SamplingParams` follow vLLM's order (`sampling.sampling_probs`): the repetition
penalty on the raw logits (`repetition_penalized`, over the prompt and every completion token
so far, forced ones included, tracked in a [rows, vocab] bool tensor only while some row uses
it), then / T, min-p, top-k, then top-p on the renormalised rest. gen_logp stays the
log-prob of the raw logits / T, as with top-p. With every knob at its default the sampling
path is exactly the top-p one above (no extra operation).
"""

from __future__ import annotations

import logging
import numbers
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

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
    finish_sample,
    max_observation_tokens,
    still_thinking,
)
from components.engines.kv_cache import cache_columns, growable_layer_class, kv_cache_name, left_pad, left_pad_mask
from components.engines.logprobs import scaled_log_softmax
from components.engines.sampling import repetition_penalized, sampling_probs
from components.precision import get_precision
from components.registry import ENGINES

log = logging.getLogger(__name__)

__all__ = ["TorchEngine", "eos_token_ids", "kv_cache_name"]

_STRIP_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def eos_token_ids(model_config, tokenizer) -> set[int]:
    """Every EOS id the config or tokenizer names (always stop tokens)."""
    ids: set[int] = set()
    for src in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        if isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
        else:
            ids.add(int(src))
    gen_cfg = getattr(model_config, "generation_config", None)
    if gen_cfg is not None and getattr(gen_cfg, "eos_token_id", None) is not None:
        e = gen_cfg.eos_token_id
        ids.update(int(i) for i in (e if isinstance(e, (list, tuple)) else [e]))
    return ids


@dataclass
class _Row:
    """One in-flight sequence (one sample of one request)."""

    group: PendingGroup
    sample_index: int
    prompt_len: int
    temperature: float
    top_p: float
    cap: int  # hard cap on sampled tokens
    stop_ids: frozenset
    interruption: Optional[Interruption]
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    tokens: list = field(default_factory=list)
    logps: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    forced: list = field(default_factory=list)
    sampled: int = 0
    pending: deque = field(default_factory=deque)  # forced tokens still to feed
    injected_version: int = 0
    interrupted: bool = False
    finish_reason: Optional[str] = None
    # multi-turn (GenerationRequest.conversations): the episode, its observation tokens still to feed,
    # which tokens are observations, where the current assistant turn starts, its sampled tokens
    conversation: Optional[Conversation] = None
    observation: deque = field(default_factory=deque)
    observed: list = field(default_factory=list)
    turn_start: int = 0
    turn_sampled: int = 0

    def turn_over(self) -> bool:
        """The current assistant turn has used its own budget (Conversation.max_tokens_per_turn)."""
        per_turn = self.conversation.max_tokens_per_turn if self.conversation is not None else None
        return per_turn is not None and self.turn_sampled >= per_turn

    def wants_injection(self) -> bool:
        it = self.interruption
        if it is None or self.interrupted or self.sampled != it.at_token or self.sampled >= self.cap:
            return False
        if not still_thinking(it, self.group.request.prompt_ids, self.tokens):
            self.interruption = None  # thinking closed (or never opened): no interruption; sample on to the cap
            return False
        return True


@ENGINES.register("torch", ranges={"max_batch_size": ">= 1", "max_cache_tokens": ">= 1"})
class TorchEngine(Engine):
    """transformers causal LM + KV cache + continuous batching (see module docstring).

    Args:
        model_path: a local checkpoint directory (save_pretrained).
        precision: a PRECISIONS name (fp32, bf16, bf16_fp32_head), resolved for `device` (bf16 is emulated
            in float32 on CPU unless ``precision.emulate = "off"``) and applied with prepare_model.
        device: "cpu", "cuda", "cuda:1", ...
        seed: seed of the sampling generator (reseeded by SamplingParams.seed when given).
        max_batch_size: most sequences in flight at once (a request with more samples than
            this is admitted alone, when the batch is empty).
        max_cache_tokens: most KV-cache slots (rows x columns, padding included; see the module
            docstring), or None for no cap. Admission stops when the cache would exceed it; a
            request whose n samples need more (n x max(32, prompt + max_tokens + forced tokens))
            is refused with a ValueError.
        attn_implementation: passed to from_pretrained (default: transformers' choice, sdpa).
        model, tokenizer: an already loaded model / tokenizer to use instead of loading
            `model_path` (the engine applies the precision policy to the model in place).
    """

    memory_model = "dense"

    def __init__(
        self,
        model_path: str,
        *,
        precision: str = "fp32",
        device: str = "cpu",
        seed: int = 0,
        max_batch_size: int = 256,
        max_cache_tokens: Optional[int] = None,
        attn_implementation: Optional[str] = None,
        model: Optional[torch.nn.Module] = None,
        tokenizer: Any = None,
    ):
        from transformers import DynamicCache  # noqa: F401  (fail early if transformers is missing)

        from components.models import load_causal_lm, load_tokenizer

        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"torch engine: max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if max_cache_tokens is not None and (not _is_int(max_cache_tokens) or max_cache_tokens < 1):
            raise ValueError(
                f"torch engine: max_cache_tokens must be an int >= 1 (KV-cache slots: rows x columns) or None "
                f"(no cap), got {max_cache_tokens!r}"
            )
        self.policy = get_precision(precision, device=device)  # real bf16, or emulated on CPU (precision.emulate)
        self.device = torch.device(device)
        self.max_batch_size = int(max_batch_size)
        self.max_cache_tokens = None if max_cache_tokens is None else int(max_cache_tokens)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        if model is None:
            if attn_implementation:
                from transformers import AutoModelForCausalLM

                from components.models import check_model_path
                from components.quiet import quiet_libraries

                quiet_libraries()
                model = AutoModelForCausalLM.from_pretrained(
                    str(check_model_path(model_path)),
                    dtype=torch.float32,
                    local_files_only=True,
                    attn_implementation=attn_implementation,
                )
            else:
                model = load_causal_lm(model_path, dtype=torch.float32)
        self.model = self.policy.prepare_model(model).to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.version = 0
        self.eos_ids = frozenset(eos_token_ids(self.model.config, self.tokenizer))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else next(iter(self.eos_ids), 0))
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self._params = list(self.model.named_parameters())  # deduplicated (tied weights once)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(int(seed))
        self._queue: deque = deque()  # (request, params)
        self._rows: list[_Row] = []
        self._cache = None
        self._mask: Optional[torch.Tensor] = None  # [B, L] long
        self._seen: Optional[torch.Tensor] = None  # [B, V] bool: tokens each row has seen (only with a repetition penalty)
        self._mergeable: Optional[bool] = None
        self._done: list[CompletedGroup] = []

    # ------------------------------------------------------------------ interface
    def add_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        if params.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {params.max_tokens}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
        check_sampling_knobs(params)
        for req in requests:
            check_prompt_length(req, params)  # every prompt of the call before any is queued
        if params.seed is not None:
            self._generator.manual_seed(int(params.seed))
        for req in requests:
            if req.n < 1:
                raise ValueError(f"request {req.group_id!r}: n must be >= 1, got {req.n}")
            if not req.prompt_ids:
                raise ValueError(f"request {req.group_id!r}: empty prompt")
            if req.interruptions is not None and len(req.interruptions) != req.n:
                raise ValueError(
                    f"request {req.group_id!r}: {len(req.interruptions)} interruptions for n={req.n} samples"
                )
            check_conversations(req)
            longest = len(req.prompt_ids) + params.max_tokens + self._max_forced(req)
            if self.max_positions is not None and longest > self.max_positions:
                raise ValueError(
                    f"request {req.group_id!r}: prompt ({len(req.prompt_ids)} tokens) + max_tokens "
                    f"({params.max_tokens}) + forced tokens ({self._max_forced(req)}: an interruption phrase, or a "
                    f"multi-turn episode's observations, train.max_observation_tokens x (train.max_turns - 1)) exceeds "
                    f"the model's max_position_embeddings ({self.max_positions})"
                )
            if self.max_cache_tokens is not None:
                need = req.n * cache_columns(longest)
                if need > self.max_cache_tokens:
                    raise ValueError(
                        f"request {req.group_id!r}: its {req.n} samples need {need} KV-cache slots "
                        f"(n x max(32, prompt {len(req.prompt_ids)} + max_tokens {params.max_tokens} + forced "
                        f"{self._max_forced(req)})), more than the engine's max_cache_tokens = {self.max_cache_tokens}; "
                        f"raise torch.max_cache_tokens or lower n / max_tokens"
                    )
            self._queue.append((req, params))

    def has_unfinished(self) -> bool:
        return bool(self._queue or self._done or any(r.finish_reason is None for r in self._rows))

    @torch.inference_mode()
    def step(self) -> list[CompletedGroup]:
        if self._rows:
            self._decode()
        self._admit()
        done, self._done = self._done, []
        return done

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Copy `state_dict` into the loaded parameters (in place); tokens from now on get `version`."""
        sd = state_dict
        if any(k.startswith(_STRIP_PREFIXES) for k in sd):
            sd = {_strip(k): v for k, v in sd.items()}
        missing = [name for name, _ in self._params if name not in sd]
        if missing:
            raise KeyError(
                f"update_weights: the state dict lacks {len(missing)} parameter(s) of the engine's model, "
                f"e.g. {missing[:5]}; is it the same architecture (and the same precision policy, which unties "
                f"the head for bf16_fp32_head)?"
            )
        with torch.no_grad():
            for name, param in self._params:
                src = sd[name]
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(f"update_weights: {name} has shape {tuple(src.shape)}, engine has {tuple(param.shape)}")
                param.copy_(src, non_blocking=True)
        self.policy.round_weights_(self.model)  # emulated bf16: fp32 sources become bf16 values (no-op otherwise)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = int(version)

    def abort_all(self) -> list[CompletedGroup]:
        """Finish every in-flight sequence now (finish reason "length") and drop queued requests."""
        self._queue.clear()
        for row in self._rows:
            if row.finish_reason is None:
                self._finish(row, "length")
        self._rows, self._cache, self._mask, self._seen = [], None, None, None
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._queue.clear()
        self._rows, self._cache, self._mask, self._seen = [], None, None, None

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _max_forced(req: GenerationRequest) -> int:
        """Most forced tokens a sample of `req` may get: its interruption phrase, or its observations."""
        phrases = max((len(i.phrase_ids) for i in req.interruptions or () if i is not None), default=0)
        return max(phrases, max_observation_tokens(req))

    def _new_cache(self, reserve: int = 0):
        """A DynamicCache; with growable (preallocated) layers when every layer is a plain DynamicLayer.

        `reserve`: columns to allocate at the first write (prompt + most remaining tokens), so the
        batch's cache is allocated once, at its final size, instead of doubling while it decodes.
        """
        global _GROWABLE
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if self._can_merge():
            if _GROWABLE is None:
                _GROWABLE = growable_layer_class()
            cache.layers = [_GROWABLE() for _ in cache.layers]
            for layer in cache.layers:
                layer._hint = int(reserve)
        return cache

    def _decode(self) -> None:
        """One decoding step. A row with a queued observation (multi-turn) feeds its last token and the whole
        observation in this one forward (a prefill of the appended tokens; `_chunks`); the others feed their
        last token, left-padded (masked) to the same width. Every row's next token comes from its last column."""
        rows = self._rows
        ids, chunk_mask, positions = self._chunks(rows)  # [B, W] each
        self._mask = torch.cat([self._mask, chunk_mask.to(self._mask.dtype)], dim=1)  # [B, L+W]
        name = kv_cache_name(self.model)
        out = self.model(
            input_ids=ids,
            attention_mask=self._mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{name: self._cache},
        )
        self._cache = getattr(out, name)
        self._choose(out.logits[:, -1, :], rows, self._seen)
        self._drop_finished()

    def _chunks(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens each row feeds this step, left-padded to a common width W: input ids, mask (0 on the
        padding) and positions, [B, W] each. A row feeds its last token (finished rows a pad token, output
        ignored), then its queued observation tokens, if any (fed whole: `_choose` appends them). The padding
        columns cost the other rows KV-cache slots: when rows' observations fall on different steps the cache may
        outgrow `_cache_fits`' projection (one column per step) by the observations of the other rows."""
        pad = self.pad_id
        chunks = [[r.tokens[-1] if r.finish_reason is None else pad] + (list(r.observation) if r.finish_reason is None else [])
                  for r in rows]
        W = max(len(c) for c in chunks)
        ids = torch.full((len(rows), W), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), W), dtype=torch.long)
        positions = torch.zeros((len(rows), W), dtype=torch.long)
        for i, (r, c) in enumerate(zip(rows, chunks)):
            start = r.prompt_len + len(r.tokens) - 1  # the position of the row's last token
            ids[i, W - len(c) :] = torch.as_tensor(c, dtype=torch.long)
            mask[i, W - len(c) :] = 1
            positions[i, W - len(c) :] = torch.arange(start, start + len(c))
        return ids.to(self.device), mask.to(self.device), positions.to(self.device)

    def _admit(self) -> None:
        if not self._queue:
            return
        if self._rows and not self._can_merge():
            if all(r.finish_reason is not None for r in self._rows):
                self._drop_finished(force=True)
            if self._rows:
                return
        if self._rows:
            # Merging copies the whole KV cache: admit only when a worthwhile amount fits
            # (an eighth of the batch, or everything that is queued).
            room = self.max_batch_size - self._num_live()
            demand = sum(req.n for req, _ in self._queue)
            if room < max(self._queue[0][0].n, min(demand, max(1, self.max_batch_size // 8))):
                return
            if not self._cache_fits([self._queue[0]]):
                return  # the KV-cache cap: wait until sequences finish
            self._drop_finished(force=True)  # make room for queued requests
        free = self.max_batch_size - len(self._rows)
        admitted: list[tuple[GenerationRequest, SamplingParams]] = []
        while self._queue:
            req, params = self._queue[0]
            if req.n > free and (admitted or self._rows):
                break
            if (admitted or self._rows) and not self._cache_fits(admitted + [self._queue[0]]):
                break
            self._queue.popleft()
            admitted.append((req, params))
            free -= req.n
            if free <= 0:
                break
        if not admitted:
            return
        # Prefill each prompt once: [Bp, P] left-padded.
        prompts = [req.prompt_ids for req, _ in admitted]
        P = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, P - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [Bp, P]
        # an empty batch: this prefill cache becomes the batch's cache, so size it for the whole generation
        cache = self._new_cache(reserve=P + self._new_remaining(admitted) if not self._rows else 0)
        name = kv_cache_name(self.model)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{name: cache},
        )
        cache = getattr(out, name)
        logits = out.logits[:, -1, :]  # [Bp, V]
        # Expand prompt i to its n samples.
        expand = torch.tensor(
            [i for i, (req, _) in enumerate(admitted) for _ in range(req.n)], dtype=torch.long, device=self.device
        )  # [Bn]
        if expand.numel() != len(admitted):
            cache.batch_select_indices(expand)
            mask = mask.index_select(0, expand)
            logits = logits.index_select(0, expand)
        new_rows: list[_Row] = []
        for req, params in admitted:
            group = PendingGroup(request=req)
            stop = frozenset(self.eos_ids | set(int(t) for t in params.stop_token_ids))
            for s in range(req.n):
                it = req.interruptions[s] if req.interruptions is not None else None
                conv = req.conversations[s] if req.conversations is not None else None
                new_rows.append(
                    _Row(
                        group=group,
                        sample_index=s,
                        prompt_len=len(req.prompt_ids),
                        temperature=float(params.temperature),
                        top_p=float(params.top_p),
                        cap=int(params.max_tokens),
                        stop_ids=stop,
                        interruption=it,
                        top_k=int(params.top_k),
                        min_p=float(params.min_p),
                        repetition_penalty=float(params.repetition_penalty),
                        conversation=conv,
                    )
                )
        penalised = self._seen is not None or any(r.repetition_penalty != 1.0 for r in new_rows)
        seen = self._seen_of(new_rows, logits.shape[-1]) if penalised else None  # [Bn, V] bool, or None
        self._choose(logits, new_rows, seen)
        self._merge(new_rows, cache, mask, seen)
        self._drop_finished()

    def _seen_of(self, rows: list[_Row], vocab: int) -> torch.Tensor:
        """Which tokens each row has seen: its prompt and its completion so far.  [len(rows), V] bool"""
        seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=self.device)  # [B, V]
        for i, row in enumerate(rows):
            ids = list(row.group.request.prompt_ids) + list(row.tokens)
            seen[i, torch.as_tensor(ids, dtype=torch.long, device=self.device)] = True
        return seen

    def _sampling_distribution(self, logits: torch.Tensor, rows: list[_Row], temperature, seen: Optional[torch.Tensor],
                               logp_all: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(what each row samples from [B, V], the penalised logits [B, V] or None without a penalty)."""
        penalised = None
        sample_logp = logp_all  # [B, V]
        if seen is not None and any(r.repetition_penalty != 1.0 for r in rows):
            penalty = torch.tensor([r.repetition_penalty for r in rows], dtype=torch.float32, device=logits.device)  # [B]
            penalised = repetition_penalized(logits.float(), seen, penalty)  # [B, V]
            sample_logp = scaled_log_softmax(penalised, temperature)  # [B, V]
        top_k = min_p = top_p = None
        if any(r.top_k > 0 for r in rows):
            top_k = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=logits.device)  # [B]
        if any(r.min_p > 0.0 for r in rows):
            min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=logits.device)  # [B]
        if any(r.top_p < 1.0 for r in rows):
            top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=logits.device)  # [B]
        return sampling_probs(sample_logp, top_k=top_k, top_p=top_p, min_p=min_p), penalised  # [B, V], [B, V] | None

    def _choose(self, logits: torch.Tensor, rows: list[_Row], seen: Optional[torch.Tensor] = None) -> None:
        """Pick each row's next token (sampled or forced) from logits [B, V]; update the rows (and `seen` [B, V],
        the tokens each row has seen, when a repetition penalty tracks them)."""
        temps = [r.temperature if r.temperature > 0 else 1.0 for r in rows]
        if all(t == temps[0] for t in temps):
            temperature = temps[0]
        else:
            temperature = torch.tensor(temps, dtype=torch.float32, device=logits.device)  # [B]
        logp_all = scaled_log_softmax(logits, temperature)  # [B, V], the shared definition (gen_logp)
        probs, penalised = self._sampling_distribution(logits, rows, temperature, seen, logp_all)  # [B, V]
        sampled = torch.multinomial(probs, 1, generator=self._generator).squeeze(-1)  # [B]
        if any(r.temperature <= 0 for r in rows):
            greedy = torch.tensor([r.temperature <= 0 for r in rows], device=probs.device)
            sampled = torch.where(greedy, (logits if penalised is None else penalised).argmax(dim=-1), sampled)  # [B]
        gen_logp = logp_all.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)  # [B]
        tok_list = sampled.tolist()
        logp_list = gen_logp.tolist()
        version = self.version
        lengths = [len(r.tokens) for r in rows] if seen is not None else None
        for row, tok, lp in zip(rows, tok_list, logp_list):
            if row.finish_reason is not None:
                continue
            if row.wants_injection():
                row.interrupted = True
                row.pending.extend(row.interruption.phrase_ids)
                row.injected_version = version
                row.cap = min(row.cap, row.interruption.at_token + row.interruption.answer_budget)
            if row.pending:
                row.tokens.append(row.pending.popleft())
                row.logps.append(0.0)
                row.versions.append(row.injected_version)
                row.forced.append(True)
                if not row.pending and row.sampled >= row.cap:
                    self._finish(row, "length")
                continue
            if row.observation:  # multi-turn: the observation `_decode` fed whole; the logits follow it
                n = len(row.observation)
                row.tokens.extend(row.observation)
                row.logps.extend([0.0] * n)
                row.versions.extend([row.injected_version] * n)
                row.forced.extend([True] * n)
                row.observed.extend([True] * n)
                row.observation.clear()
                row.turn_start, row.turn_sampled = len(row.tokens), 0  # the next turn starts with this token
            row.tokens.append(tok)
            row.logps.append(lp)
            row.versions.append(version)
            row.forced.append(False)
            row.sampled += 1
            if row.conversation is not None:
                row.observed.append(False)
                row.turn_sampled += 1
                if tok in row.stop_ids:
                    self._end_turn(row, "stop", version)
                elif row.sampled >= row.cap or row.turn_over():
                    self._end_turn(row, "length", version)
                continue
            if tok in row.stop_ids:
                self._finish(row, "interrupted" if row.interrupted else "stop")
            elif row.sampled >= row.cap:
                self._finish(row, "length")
        if seen is not None:
            self._mark_seen(seen, rows, lengths)

    def _mark_seen(self, seen: torch.Tensor, rows: list[_Row], lengths: list[int]) -> None:
        """Record in `seen` [B, V] the tokens each row added this step (sampled, forced or observed)."""
        added = [(i, t) for i, row in enumerate(rows) for t in row.tokens[lengths[i] :]]
        if added:
            index = torch.tensor(added, dtype=torch.long, device=seen.device)  # [n, 2]
            seen[index[:, 0], index[:, 1]] = True

    def _end_turn(self, row: _Row, reason: str, version: int) -> None:
        """A multi-turn row's assistant turn ended (`reason` "stop" or "length"): its observation is queued
        (fed whole by the next step, tagged with this `version`), or the episode is over and the row finishes."""
        obs = row.conversation.on_turn_end(row.tokens[row.turn_start :], reason, row.cap - row.sampled)
        if obs:
            row.observation.extend(int(t) for t in obs)
            row.injected_version = version
            return
        self._finish(row, row.conversation.finish_reason(reason))

    def _finish(self, row: _Row, reason: str) -> None:
        row.finish_reason = reason
        done = finish_sample(row, reason)
        if done is not None:
            self._done.append(done)

    def _can_merge(self) -> bool:
        if self._mergeable is None:
            from transformers.cache_utils import DynamicLayer

            from transformers import DynamicCache

            probe = DynamicCache(config=self.model.config)
            layers = getattr(probe, "layers", None)
            self._mergeable = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
            if not self._mergeable:
                log.warning("torch engine: this model's KV cache cannot be merged; admitting requests in waves")
        return self._mergeable

    def _merge(self, new_rows: list[_Row], cache, mask: torch.Tensor, seen: Optional[torch.Tensor] = None) -> None:
        """Append new rows (cache, mask [Bn, Ln], seen [Bn, V] or None) to the running batch, left-padding the shorter."""
        if not self._rows:
            self._rows, self._cache, self._mask, self._seen = new_rows, cache, mask, seen
            return
        if seen is not None or self._seen is not None:  # a repetition penalty in the batch: track every row
            vocab = (seen if seen is not None else self._seen).shape[1]
            old_seen = self._seen if self._seen is not None else self._seen_of(self._rows, vocab)  # [B, V]
            new_seen = seen if seen is not None else self._seen_of(new_rows, vocab)  # [Bn, V]
            self._seen = torch.cat([old_seen, new_seen], dim=0)  # [B + Bn, V]
        L_old, L_new = self._mask.shape[1], mask.shape[1]
        L = max(L_old, L_new)
        headroom = max(self._max_remaining(self._rows + new_rows), 1)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers):
            keys = torch.cat([left_pad(old_layer.keys, L), left_pad(new_layer.keys, L)], dim=0)
            values = torch.cat([left_pad(old_layer.values, L), left_pad(new_layer.values, L)], dim=0)
            old_layer.set_kv(keys, values, headroom=headroom)
        self._mask = torch.cat([left_pad_mask(self._mask, L), left_pad_mask(mask, L)], dim=0)
        self._rows = self._rows + new_rows

    def _num_live(self) -> int:
        return sum(1 for r in self._rows if r.finish_reason is None)

    def _max_remaining(self, rows: Optional[list] = None) -> int:
        """Most decode steps any in-flight row (of `rows`, default the batch) may still take (sampled + forced)."""
        return max((r.cap - r.sampled + len(r.pending) + (len(r.interruption.phrase_ids) if r.interruption and not r.interrupted else 0)
                    + _observation_room(r)
                    for r in (self._rows if rows is None else rows) if r.finish_reason is None), default=0)

    def _new_remaining(self, admitted) -> int:
        """Most tokens (sampled + forced) any sample of the `admitted` (request, params) pairs may add."""
        return max((params.max_tokens + self._max_forced(req) for req, params in admitted), default=0)

    def cache_tokens(self) -> int:
        """KV-cache slots allocated now: rows x columns of the first layer's buffer (0 when empty)."""
        if self._cache is None or not getattr(self._cache, "layers", None):
            return 0
        layer = self._cache.layers[0]
        buf = getattr(layer, "_kbuf", None)
        if buf is None:
            buf = getattr(layer, "keys", None)
        return 0 if buf is None or buf.dim() != 4 else int(buf.shape[0] * buf.shape[2])

    def _cache_fits(self, admitted) -> bool:
        """True when merging `admitted` into the live rows keeps the cache within max_cache_tokens.

        Projected size: (live rows + new samples) x max(32, max(current columns, longest new
        prompt) + most remaining tokens of any row): the buffer `_merge` allocates (an upper
        bound: dropping finished rows may trim columns).
        """
        if self.max_cache_tokens is None:
            return True
        live = [r for r in self._rows if r.finish_reason is None]
        width = self._mask.shape[1] if live and self._mask is not None else 0
        prompt = max(len(req.prompt_ids) for req, _ in admitted)
        remaining = max(self._max_remaining(live), self._new_remaining(admitted))
        rows = len(live) + sum(req.n for req, _ in admitted)
        return rows * cache_columns(max(width, prompt) + remaining) <= self.max_cache_tokens

    def _drop_finished(self, force: bool = False) -> None:
        """Remove finished rows from the batch.

        Lazy: finished rows stay (as dead rows fed a pad token) until they are a quarter of the
        batch, or room is needed for queued requests (`force`), because every removal copies the
        whole KV cache.
        """
        keep = [i for i, r in enumerate(self._rows) if r.finish_reason is None]
        dead = len(self._rows) - len(keep)
        if dead == 0 or (keep and not force and 4 * dead < len(self._rows)):
            return
        if not keep:
            self._rows, self._cache, self._mask, self._seen = [], None, None, None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._cache.batch_select_indices(idx)
        self._mask = self._mask.index_select(0, idx)
        if self._seen is not None:
            self._seen = self._seen.index_select(0, idx)  # [B', V]
        self._rows = [self._rows[i] for i in keep]
        # Trim leading columns that are padding in every remaining row.
        used = self._mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        if start > 0 and self._can_merge():
            self._mask = self._mask[:, start:]
            headroom = max(self._max_remaining(), 1)
            for layer in self._cache.layers:
                layer.set_kv(layer.keys[:, :, start:, :], layer.values[:, :, start:, :], headroom=headroom)

    # ------------------------------------------------------------------ weight sync (components/trainer/weight_sync.py)
    def receive_weights(self, receiver, update) -> None:
        """Copy each received tensor into its parameter in place, bucket by bucket; tokens from now on get
        `update.version`. The KV cache is kept: in-flight sequences continue under the new weights.

        The update must name exactly this engine's parameters with its shapes and dtypes (the same
        precision policy on both sides); otherwise the broadcast is drained, to keep the weight group
        in step, and a ValueError names the difference.
        """
        params = dict(self._params)
        problem = _weights_mismatch(params, update.params, self.policy)
        if problem:
            receiver.discard(update)
            raise ValueError(f"receive_weights: update v{update.version} does not fit the torch engine's model: {problem}")
        with torch.no_grad():
            for name, tensor in receiver.receive(update):
                params[name].copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = int(update.version)


def _observation_room(row: _Row) -> int:
    """Observation tokens a row may still be fed: those queued, and what its episode's budget has left."""
    if row.conversation is None:
        return 0
    return max(len(row.observation), int(row.conversation.max_observation_tokens) - sum(row.observed))


def _weights_mismatch(params: Mapping[str, torch.Tensor], specs, policy) -> Optional[str]:
    """Why `specs` (ParamSpecs) cannot be loaded into `params` under `policy`, or None.

    A tensor may arrive in the parameter's dtype, or as bf16 into an emulating engine's float32
    storage (`PrecisionPolicy.accepts_wire_dtype`: exact)."""
    names = [s.name for s in specs]
    known = set(names)
    missing = [n for n in params if n not in known]
    extra = [n for n in names if n not in params]
    if missing or extra:
        return (f"it lacks {len(missing)} of the engine's parameters (e.g. {missing[:3]}) and has {len(extra)} unknown "
                f"(e.g. {extra[:3]}); same architecture, and the same precision policy (bf16_fp32_head unties the head)?")
    for s in specs:
        p = params[s.name]
        if tuple(s.shape) != tuple(p.shape) or not policy.accepts_wire_dtype(s.torch_dtype, p.dtype):
            return (f"{s.name} arrives as {tuple(s.shape)} {s.torch_dtype}, the engine holds {tuple(p.shape)} {p.dtype} "
                    "(precision policies differ?)")
    return None


_GROWABLE = None


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _STRIP_PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p) :], True
    return key
