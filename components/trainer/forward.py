"""The learner's forward pass at real sizes: token-budget packing, a chunked LM head, checkpointing.

Memory is a function of a token budget, never of (longest sequence x batch) or (tokens x vocabulary):

- `plan_micro_batches` splits a step's WHOLE sequences into micro-batches of at most
  `train.max_tokens_per_micro_batch` tokens (prompt + completion; first-fit decreasing).
- `pack` / `pack_batch` lay one micro-batch out as ONE row without padding: input_ids [1, N],
  position ids restarting at 0 for every sequence, NO attention mask, `use_cache=False`.
  transformers then keeps the sequences apart by itself (they cannot attend to each other):
  * sdpa / eager / flex: `transformers.masking_utils._preprocess_mask_arguments` calls
    `find_packed_sequence_indices(position_ids)` when the 2D attention mask is None and there is
    no cache; every position-id step that is not +1 starts a new sequence, and
    `packed_sequence_compatibility_function` makes the causal mask block-diagonal.
  * flash_attention_2/3/4: `transformers.modeling_flash_attention_utils._flash_attention_forward`
    sees `_is_packed_sequence(position_ids, batch_size=1)` and runs the varlen kernel with
    `cu_seqlens` from `prepare_fa_kwargs_from_position_ids` (a sequence starts where the
    position id equals its minimum, 0).
  Either an attention mask or a KV cache switches that detection off and the sequences of a
  row then attend to each other (measured with transformers on CPU), so neither is ever passed here.
- `chunked_token_logprobs` turns final hidden states [N, H] and the head weight [V, H] into
  the log-prob of each target [N] (and its entropy) `chunk_size` tokens at a time, with a
  backward that recomputes each chunk: no [tokens, vocab] tensor larger than one chunk exists,
  forward or backward. The log-prob is the engines' definition
  (`components.engines.logprobs.scaled_log_softmax`: float32, temperature-scaled, T <= 0 counts
  as 1) applied to what the model's own head computes: `F.linear(h.to(W.dtype), W, b)`, i.e.
  the head's input is cast to the head weight's dtype, exactly like the fp32-head pre-hook of
  `components.precision` (bypassed here because the weight is used directly). Autocast is off
  inside; a torch-function mode of the caller sees the head's `F.linear` (the trainer's
  precision context uses that to compute a bf16 head). Backward recomputes in the dtype the
  forward's logits came out in, so a mode that is active during forward only still gets the
  gradient of the logits forward used; a mode that only rounds fp32 values (bf16 emulation) is
  not re-applied there, so that recompute is plain fp32.
- `sequence_logprobs_packed(model, micro_batch, ...)` is the ONE entry point the learner
  calls, for packed rows (`PackedRow`) and for today's padded micro-batches (a
  `components.trainer.rollout.Batch`) alike. It returns logp [b, T] (carries grad) and
  entropy [b, T] (no grad, unless `entropy_grad` asks for it: an entropy bonus) in the padded
  completion layout, so the losses (which take [B, T]) are unchanged. The model's own forward
  is called (so FSDP2's root hooks run) with `logits_to_keep` = an empty index tensor (no
  logits at all), and the final hidden states are taken by a forward hook on the decoder stack
  (`model.get_decoder()`).
- `enable_activation_checkpointing` uses transformers' per-decoder-block checkpointing with
  `use_reentrant=False`: `GradientCheckpointingLayer` checkpoints the block's `forward`, not
  its `__call__`, so module hooks (FSDP2's unshard/reshard) stay outside the checkpoint and run
  once, it handles the `FSDP<Block>` subclass that `fully_shard` creates afterwards, and it
  leaves parameter names unchanged (torch's `checkpoint_wrapper` would insert
  `_checkpoint_wrapped_module.` into every state-dict key of the blocks).
- The attention kernel (`train.attn_implementation`: sdpa, flash_attention_N, torch_varlen,
  "auto") is chosen in attention.py (`resolve_attn_implementation`,
  `learner_attn_implementation`); with torch_varlen the forward here passes the varlen layout
  down to the blocks (`attention.varlen_kwargs`).
- `train.compile`: the chunked head's per-chunk math (`chunk_logprob_stats`, `chunk_logit_grad`)
  runs through `torch.compile` when a `compile_backend` is given (the matmuls stay outside);
  the learner compiles the decoder blocks (`components.trainer.learner.compile_blocks`).

FSDP2 note: the head weight is read AFTER the model's forward. With `fully_shard` per block +
root (the design), the head belongs to the root group, which FSDP2 does not reshard after
forward, so the weight is the unsharded parameter and its gradient is reduced by the root's
post-backward as usual. A head that is itself resharded after forward (a DTensor here) is
refused with a clear error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from components.engines.logprobs import position_ids_from_mask, scaled_log_softmax
from components.trainer.attention import varlen_kwargs

__all__ = [
    "PackedRow",
    "plan_micro_batches",
    "pack",
    "pack_batch",
    "batch_sequences",
    "sequence_lengths",
    "chunked_token_logprobs",
    "final_hidden_states",
    "sequence_logprobs_packed",
    "sequence_logprobs_padded",
    "enable_activation_checkpointing",
]

# Model configs whose forward transforms the head's logits (scale / soft-cap) after lm_head: the
# chunked head would silently skip that, so such models are refused.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


# --------------------------------------------------------------------------------------------
# 1. token-budget micro-batches
def plan_micro_batches(lengths: Sequence[int], max_tokens: int, *, allow_oversize: bool = False) -> list[list[int]]:
    """Split whole sequences into micro-batches of at most `max_tokens` tokens (first-fit decreasing).

    Args:
        lengths: tokens of each sequence (prompt + completion), all >= 1.
        max_tokens: the token budget of one micro-batch (`train.max_tokens_per_micro_batch`).
        allow_oversize: what to do with a sequence longer than the budget. False (default):
            raise a ValueError naming it, before anything runs (the budget is what the memory
            plan assumes; silently exceeding it would be an out-of-memory later). True: give
            it a micro-batch of its own.

    Returns:
        A list of micro-batches, each a sorted list of sequence indices; every index appears
        exactly once. Micro-batches are ordered by their largest sequence (largest first).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens (train.max_tokens_per_micro_batch) must be an int >= 1, got {max_tokens!r}")
    lengths = [int(n) for n in lengths]
    bad = [(i, n) for i, n in enumerate(lengths) if n < 1]
    if bad:
        raise ValueError(f"every sequence needs >= 1 token; sequence {bad[0][0]} has {bad[0][1]}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long and not allow_oversize:
        i, n = max(too_long, key=lambda x: x[1])
        raise ValueError(
            f"sequence {i} has {n} tokens (prompt + completion), more than the micro-batch budget "
            f"train.max_tokens_per_micro_batch = {max_tokens} ({len(too_long)} sequence(s) exceed it). "
            f"Raise the budget to at least {n}, or lower train.max_tokens / the prompt length."
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] = load + n
                break
        else:
            bins.append([i])
            loads.append(n)
    return [sorted(b) for b in bins]


# --------------------------------------------------------------------------------------------
# 2. packing
@dataclass
class PackedRow:
    """One micro-batch of b sequences laid out as a single row without padding (N tokens).

    Completion token j of sequence i (0-based) sits at row position offsets[i] + prompt_lens[i] + j
    and is predicted by the hidden state one position earlier; its log-prob goes to output
    cell [i, j] of the [b, T] layout the losses take.
    """

    input_ids: torch.Tensor  # [1, N] long
    position_ids: torch.Tensor  # [1, N] long, restarting at 0 per sequence
    predict_index: torch.Tensor  # [M] long: row positions whose hidden state predicts a completion token
    targets: torch.Tensor  # [M] long: the completion tokens they predict
    out_rows: torch.Tensor  # [M] long: sequence index i in 0..b-1
    out_cols: torch.Tensor  # [M] long: completion index j in 0..T-1
    seq_lens: torch.Tensor  # [b] long: prompt + completion tokens of each sequence
    cu_seqlens: torch.Tensor  # [b + 1] int32: sequence boundaries in the row (varlen layout)
    num_columns: int  # T of the [b, T] output layout

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def max_seqlen(self) -> int:
        return int(self.seq_lens.max()) if self.seq_lens.numel() else 0

    def to(self, device) -> "PackedRow":
        moved = {k: getattr(self, k).to(device) for k in self._TENSORS}
        return PackedRow(**moved, num_columns=self.num_columns)

    _TENSORS = ("input_ids", "position_ids", "predict_index", "targets", "out_rows", "out_cols", "seq_lens", "cu_seqlens")


def _as_id_list(ids, what: str) -> list[int]:
    if torch.is_tensor(ids):
        if ids.dim() != 1:
            raise ValueError(f"{what} must be a 1D sequence of token ids, got a tensor of shape {tuple(ids.shape)}")
        return [int(x) for x in ids.tolist()]
    return [int(x) for x in ids]


def pack(sequences: Sequence, *, num_columns: Optional[int] = None, device=None) -> PackedRow:
    """Lay out (prompt_ids, completion_ids) pairs as one unpadded row.

    Args:
        sequences: b pairs of token-id sequences (lists or 1D tensors); every prompt non-empty,
            completions may be empty.
        num_columns: T of the [b, T] output layout (default: the longest completion, >= 1); must
            be >= every completion length.
        device: where the tensors go.
    """
    if len(sequences) == 0:
        raise ValueError("pack needs at least one sequence")
    prompts, completions = [], []
    for i, pair in enumerate(sequences):
        if len(pair) != 2:
            raise ValueError(f"sequence {i} must be a (prompt_ids, completion_ids) pair, got {len(pair)} items")
        p = _as_id_list(pair[0], f"prompt {i}")
        c = _as_id_list(pair[1], f"completion {i}")
        if not p:
            raise ValueError(f"sequence {i} has an empty prompt (a prompt token must predict the first completion token)")
        prompts.append(p)
        completions.append(c)
    longest = max(len(c) for c in completions)
    T = max(1, longest) if num_columns is None else int(num_columns)
    if T < longest:
        raise ValueError(f"num_columns = {T} is shorter than the longest completion ({longest} tokens)")
    ids: list[int] = []
    pos: list[int] = []
    predict: list[int] = []
    targets: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    seq_lens: list[int] = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        offset = len(ids)
        n = len(p) + len(c)
        ids.extend(p)
        ids.extend(c)
        pos.extend(range(n))
        first = offset + len(p)  # row position of completion token 0
        predict.extend(range(first - 1, first - 1 + len(c)))
        targets.extend(c)
        rows.extend([i] * len(c))
        cols.extend(range(len(c)))
        seq_lens.append(n)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.long)  # [b]
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)  # [b + 1]
    cu[1:] = seq_lens_t.cumsum(0).to(torch.int32)
    row = PackedRow(
        input_ids=torch.tensor(ids, dtype=torch.long).unsqueeze(0),  # [1, N]
        position_ids=torch.tensor(pos, dtype=torch.long).unsqueeze(0),  # [1, N]
        predict_index=torch.tensor(predict, dtype=torch.long),  # [M]
        targets=torch.tensor(targets, dtype=torch.long),  # [M]
        out_rows=torch.tensor(rows, dtype=torch.long),  # [M]
        out_cols=torch.tensor(cols, dtype=torch.long),  # [M]
        seq_lens=seq_lens_t,
        cu_seqlens=cu,
        num_columns=T,
    )
    return row if device is None else row.to(device)


def batch_sequences(batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (prompt_ids, completion_ids) of every row of a padded `Batch` (padding removed).

    Completion ids include forced tokens (their log-probs are computed; the batch's `mask`
    leaves them out of the loss), exactly as the padded path computes them.
    """
    P = int(batch.completion_start)
    am = batch.attention_mask.bool()  # [B, P+T]
    out = []
    for i in range(batch.input_ids.shape[0]):
        prompt = batch.input_ids[i, :P][am[i, :P]]  # [p_i]
        n = int(am[i, P:].sum())
        if not bool(am[i, P : P + n].all()):
            raise ValueError(f"row {i}: the completion is not right-padded (attention mask has holes after column {P})")
        out.append((prompt, batch.input_ids[i, P : P + n]))
    return out


def sequence_lengths(batch) -> list[int]:
    """Tokens (prompt + completion) of every row of a padded `Batch`: the lengths `plan_micro_batches` takes."""
    return [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]


def pack_batch(batch, rows=None) -> PackedRow:
    """Pack rows of a padded `Batch` (all rows, or the indices `rows`) into one `PackedRow`.

    The output layout keeps the batch's completion width T, so the packed log-probs line up with
    `batch.select(rows)`'s gen_logp / mask / aggregation weights.
    """
    device = batch.input_ids.device
    input_ids, attention_mask = batch.input_ids.cpu(), batch.attention_mask.cpu()  # one copy each: no per-row syncs
    if rows is not None:
        idx = torch.as_tensor(rows, dtype=torch.long)
        input_ids, attention_mask = input_ids[idx], attention_mask[idx]
    P = int(batch.completion_start)
    view = _Rows(input_ids=input_ids, attention_mask=attention_mask, completion_start=P)
    return pack(batch_sequences(view), num_columns=int(input_ids.shape[1]) - P, device=device)


@dataclass
class _Rows:
    """The padded layout `batch_sequences` reads (a `Batch`'s input_ids, attention_mask, completion_start)."""

    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    completion_start: int


# --------------------------------------------------------------------------------------------
# 3. the chunked head
def _no_autocast(device_type: str):
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know
        return contextlib.nullcontext()


def _temperature_rows(temperature, start: int, stop: int):
    """The temperature of rows start..stop: a float, or a [n] slice of a per-token tensor."""
    return temperature[start:stop] if torch.is_tensor(temperature) else temperature


def _effective_temperature(temperature, like: torch.Tensor):
    """Temperature as divided by `scaled_log_softmax`: <= 0 counts as 1. A float or [n, 1] float32."""
    if torch.is_tensor(temperature):
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(like)  # [n]
        return t.unsqueeze(-1)  # [n, 1]
    return float(temperature) if temperature > 0 else 1.0


def chunk_logprob_stats(logits: torch.Tensor, targets: torch.Tensor, temperature, with_entropy: bool):
    """One chunk's log-prob of each target and entropy, from its logits.

    logits [n, V] (any float dtype), targets [n] long, temperature a float or [n] (<= 0 counts
    as 1). Returns logp [n] float32 and entropy [n] float32 (zeros when not `with_entropy`).
    """
    lp = scaled_log_softmax(logits, temperature)  # [n, V] float32
    logp = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [n]
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    p_lp = lp.exp().mul_(lp)  # [n, V]: p log p
    del lp
    return logp, -p_lp.sum(-1)  # [n], [n]


def chunk_logit_grad(logits: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor, temperature) -> torch.Tensor:
    """The gradient of sum(grad_logp * logp) w.r.t. one chunk's logits, in the logits' dtype.

    logits [n, V], targets [n] long, grad_logp [n] (d loss / d logp), temperature as in
    `chunk_logprob_stats`. d logp[target] / d scaled = onehot(target) - softmax, and
    d scaled / d logits = 1 / T. Returns [n, V].
    """
    go = grad_logp.float().unsqueeze(-1)  # [n, 1]
    g = scaled_log_softmax(logits, temperature)  # [n, V] float32 log-probs
    g.exp_().mul_(-go)  # [n, V]: -p * go
    g.scatter_add_(-1, targets.unsqueeze(-1), go)  # [n, V]: (onehot - p) * go
    t = _effective_temperature(temperature, g)
    if torch.is_tensor(t) or t != 1.0:
        g.div_(t)
    return g.to(logits.dtype)  # [n, V]


def chunk_entropy_logit_grad(logits: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor,
                             grad_entropy: torch.Tensor, temperature) -> torch.Tensor:
    """The gradient of sum(grad_logp * logp + grad_entropy * entropy) w.r.t. one chunk's logits.

    `chunk_logit_grad` plus the entropy's own term, for a loss with an entropy bonus
    (``train.entropy_coef``): with H = -sum_j p_j log p_j of the scaled logits,
    d H / d scaled_j = -p_j (log p_j + H). grad_entropy [n] (d loss / d entropy); the rest as in
    `chunk_logit_grad`. Returns [n, V] in the logits' dtype.
    """
    go = grad_logp.float().unsqueeze(-1)  # [n, 1]
    ge = grad_entropy.float().unsqueeze(-1)  # [n, 1]
    g = scaled_log_softmax(logits, temperature)  # [n, V] float32 log-probs
    p = g.exp()  # [n, V]
    entropy = -(p * g).sum(-1, keepdim=True)  # [n, 1]
    g.add_(entropy).mul_(ge).add_(go).mul_(p).neg_()  # [n, V]: -p * (go + ge * (log p + H))
    del p
    g.scatter_add_(-1, targets.unsqueeze(-1), go)  # [n, V]: + onehot * go
    t = _effective_temperature(temperature, g)
    if torch.is_tensor(t) or t != 1.0:
        g.div_(t)
    return g.to(logits.dtype)  # [n, V]


_COMPILED: dict = {}


def _chunk_math(fn, backend: Optional[str]):
    """`fn` itself (backend None), or `torch.compile(fn, backend=backend)` (`train.compile`): with
    inductor the log-softmax, gather, entropy and softmax-gradient passes over a [chunk, V] tensor
    become a few fused kernels. The head's matmuls stay outside, in the caller. One compiled
    function per (fn, backend) per process, with dynamic shapes from the start: the last chunk of
    a micro-batch is shorter (one of a single token compiles once more: sizes 0 and 1 are always
    specialised)."""
    if backend is None:
        return fn
    if (fn, backend) not in _COMPILED:
        _COMPILED[fn, backend] = torch.compile(fn, backend=backend, dynamic=True)
    return _COMPILED[fn, backend]


class _ChunkedHeadLogprob(torch.autograd.Function):
    """logp[n] = scaled_log_softmax(F.linear(hidden[n].to(W.dtype), W, b), T)[target[n]], chunk by chunk.

    Forward keeps only hidden, weight, bias and targets (no logits); backward recomputes each
    chunk's logits and log-softmax, so at most one chunk of [chunk, V] tensors is alive. The
    entropy is differentiable only with `entropy_grad` (an entropy bonus in the loss); otherwise
    it is marked non-differentiable and backward runs the log-prob gradient alone.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, compile_backend=None,
                entropy_grad=False):
        N = hidden.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)  # [N]
        entropy = torch.empty(N, dtype=torch.float32, device=hidden.device) if with_entropy else None  # [N]
        logits_dtype = weight.dtype
        stats = _chunk_math(chunk_logprob_stats, compile_backend)
        with torch.no_grad(), _no_autocast(hidden.device.type):
            for s in range(0, N, chunk_size):
                e = min(s + chunk_size, N)
                logits = F.linear(hidden[s:e].to(weight.dtype), weight, bias)  # [n, V] in the head's dtype
                logits_dtype = logits.dtype  # the caller's torch-function mode may compute the head in bf16
                lp, ent = stats(logits, targets[s:e], _temperature_rows(temperature, s, e), with_entropy)  # [n], [n]
                del logits
                logp[s:e] = lp
                if with_entropy:
                    entropy[s:e] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, temperature if torch.is_tensor(temperature) else None)
        ctx.temperature = None if torch.is_tensor(temperature) else temperature
        ctx.chunk_size = chunk_size
        ctx.logits_dtype = logits_dtype
        ctx.compile_backend = compile_backend
        ctx.entropy_grad = bool(with_entropy and entropy_grad)
        if with_entropy:
            if not ctx.entropy_grad:
                ctx.mark_non_differentiable(entropy)
            return logp, entropy
        return logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, bias, targets, t_tensor = ctx.saved_tensors
        temperature = t_tensor if t_tensor is not None else ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        N = hidden.shape[0]
        # Recompute in the dtype the forward's logits came out in. Normally that is the weight's
        # dtype; a torch-function mode active during forward only (e.g. the trainer's real-bf16
        # context, which computes a bf16 head from fp32 master weights) is no longer active here,
        # so its cast is redone explicitly: backward then differentiates the logits forward used.
        compute = ctx.logits_dtype
        w_c = weight if compute == weight.dtype else weight.to(compute)  # [V, H]
        b_c = bias if bias is None or compute == bias.dtype else bias.to(compute)  # [V]
        grad_h = torch.zeros_like(hidden) if need_h else None  # [N, H]
        # the head's gradient is accumulated over chunks in float32, cast to its dtype at the end
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None  # [V]
        with_entropy_grad = ctx.entropy_grad and grad_entropy is not None  # an entropy bonus in the loss
        logit_grad = _chunk_math(chunk_entropy_logit_grad if with_entropy_grad else chunk_logit_grad, ctx.compile_backend)
        with torch.no_grad(), _no_autocast(hidden.device.type):
            for s in range(0, N, ctx.chunk_size):
                e = min(s + ctx.chunk_size, N)
                h = hidden[s:e].to(compute)  # [n, H]
                logits = F.linear(h, w_c, b_c)  # [n, V]
                t_rows = _temperature_rows(temperature, s, e)
                if with_entropy_grad:
                    g_logits = logit_grad(logits, targets[s:e], grad_logp[s:e], grad_entropy[s:e], t_rows)  # [n, V]
                else:
                    g_logits = logit_grad(logits, targets[s:e], grad_logp[s:e], t_rows)  # [n, V]
                del logits
                if need_h:
                    grad_h[s:e] = (g_logits @ w_c).to(hidden.dtype)  # [n, H]
                if need_w and compute == torch.float32:
                    grad_w.addmm_(g_logits.t(), h)  # [V, H], accumulated in place (no [V, H] temporary)
                elif need_w:
                    grad_w += (g_logits.t() @ h).float()  # [V, H]
                if need_b:
                    grad_b += g_logits.sum(0).float()  # [V]
                del g_logits
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: "float | torch.Tensor" = 1.0,
    chunk_size: int = 1024,
    bias: Optional[torch.Tensor] = None,
    with_entropy: bool = False,
    compile_backend: Optional[str] = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of each target and entropy, from final hidden states, `chunk_size` tokens at a time.

    Args:
        hidden: [N, H] final hidden states (after the final norm), any float dtype; carries grad.
        weight: [V, H] the LM head weight (`model.get_output_embeddings().weight`); carries grad.
        targets: [N] long, the token each hidden state predicts.
        temperature: the sampling temperature (float, or a [N] tensor); <= 0 counts as 1, as in
            `components.engines.logprobs.scaled_log_softmax`.
        chunk_size: tokens per chunk (`train.logprob_chunk_size`); the largest [tokens, V]
            tensor ever alive is [chunk_size, V].
        bias: optional [V] head bias.
        with_entropy: also return the entropy of each position's distribution (no grad).
        compile_backend: None (eager), or a torch.compile backend ("inductor") that each
            chunk's log-softmax, gather, entropy and gradient run through (`train.compile`);
            the values are the same up to float32 round-off.
        entropy_grad: make the entropy differentiable too (an entropy bonus, ``train.entropy_coef``);
            off, it carries no grad and backward computes the log-prob gradient alone.

    Returns:
        logp [N] float32 (differentiable w.r.t. hidden, weight and bias), and entropy [N]
        float32 (differentiable only with `entropy_grad`) or None.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size (train.logprob_chunk_size) must be an int >= 1, got {chunk_size!r}")
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[1]} does not match the head weight's {weight.shape[1]} (weight is [V, H])")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.long:
        raise ValueError(f"targets must be a long tensor of shape [{hidden.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if torch.is_tensor(temperature) and temperature.shape != hidden.shape[:1]:
        raise ValueError(f"a temperature tensor must be [{hidden.shape[0]}] (one per token), got {tuple(temperature.shape)}")
    if not torch.is_tensor(temperature):
        temperature = float(temperature)
    if targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"target ids must lie in [0, {weight.shape[0]}) (the head's vocabulary), got [{lo}, {hi}]")
    if _is_dtensor(weight):
        raise ValueError(
            "the LM head weight is a DTensor (a shard): read it while it is unsharded. With FSDP2 keep the "
            "head in the root's group (fully_shard per block + root), whose parameters stay unsharded after forward"
        )
    out = _ChunkedHeadLogprob.apply(hidden, weight, bias, targets, temperature, chunk_size, bool(with_entropy),
                                    compile_backend, bool(entropy_grad))
    if with_entropy:
        return out[0], out[1]
    return out, None


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


# --------------------------------------------------------------------------------------------
# 4. the model forward without logits
def _decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    get = getattr(model, "get_decoder", None)
    decoder = None
    if callable(get):
        try:
            decoder = get()
        except (AttributeError, ValueError, NotImplementedError):
            decoder = None
    if decoder is None:
        decoder = getattr(model, "base_model", None)
    if decoder is None or decoder is model:
        raise ValueError(
            f"{type(model).__name__}: cannot find the decoder stack (get_decoder() / base_model) whose "
            "last_hidden_state feeds the LM head; a transformers *ForCausalLM model is needed"
        )
    return decoder


def _check_plain_head(model: torch.nn.Module) -> None:
    """Refuse models whose forward changes the logits after lm_head (soft-capping, scaling)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and callable(getattr(config, "get_text_config", None)) else config
    for cfg in {id(c): c for c in (config, text) if c is not None}.values():
        for name in _LOGIT_TRANSFORMS:
            value = getattr(cfg, name, None)
            if value is None:
                continue
            active = float(value) != 1.0 if name.endswith(("scale", "scaling")) else bool(value)
            if active:
                raise ValueError(
                    f"{type(model).__name__} transforms its logits after the LM head (config.{name} = {value!r}); "
                    "the chunked head computes F.linear(hidden, W, b) only, so this model is not supported"
                )


def final_hidden_states(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """Call `model(**inputs)` (its top-level forward, hooks included) without computing any logits.

    `logits_to_keep` is an empty index tensor, so the LM head sees zero positions; the decoder
    stack's `last_hidden_state` (after the final norm) is captured by a forward hook.
    Returns it: [B, L, H].
    """
    decoder = _decoder_of(model)
    captured: dict = {}

    def hook(module, args, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    device = inputs["input_ids"].device
    handle = decoder.register_forward_hook(hook)
    try:
        out = model(**inputs, use_cache=False, logits_to_keep=torch.empty(0, dtype=torch.long, device=device))
    finally:
        handle.remove()
    if "hidden" not in captured:
        raise RuntimeError(f"{type(model).__name__}: the decoder stack {type(decoder).__name__} did not run in forward")
    logits = getattr(out, "logits", None)
    if logits is not None and logits.numel() != 0:
        raise RuntimeError(
            f"{type(model).__name__} computed logits of shape {tuple(logits.shape)} despite logits_to_keep = []; "
            "its forward does not honour logits_to_keep"
        )
    return captured["hidden"]


def _head(model: torch.nn.Module):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head) with a weight")
    return head.weight, getattr(head, "bias", None)


def _check_args(temperature, chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size (train.logprob_chunk_size) must be an int >= 1, got {chunk_size!r}")
    if torch.is_tensor(temperature) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number (the sampling temperature), got {temperature!r}")


def _scatter(flat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, b: int, T: int) -> torch.Tensor:
    """[M] values -> [b, T] with zeros elsewhere (differentiable)."""
    out = flat.new_zeros(b, T)  # [b, T]
    return out.index_put((rows, cols), flat)  # [b, T]


def _head_logprobs(model, hidden_flat, predict_index, targets, rows, cols, b, T, temperature, chunk_size, with_entropy,
                   compile_backend, entropy_grad=False):
    weight, bias = _head(model)  # read AFTER the forward (FSDP2: the unsharded parameter)
    h = hidden_flat.index_select(0, predict_index)  # [M, H]
    logp, entropy = chunked_token_logprobs(
        h, weight, targets, temperature=float(temperature), chunk_size=chunk_size, bias=bias, with_entropy=with_entropy,
        compile_backend=compile_backend, entropy_grad=entropy_grad,
    )  # [M], [M] | None
    logp_bt = _scatter(logp, rows, cols, b, T)  # [b, T]
    entropy_bt = _scatter(entropy, rows, cols, b, T) if with_entropy else None  # [b, T]
    return logp_bt, entropy_bt


def sequence_logprobs_packed(model, micro_batch, *, temperature: float, chunk_size: int, with_entropy: bool,
                             compile_backend: Optional[str] = None, entropy_grad: bool = False):
    """The learner's one forward: log-prob (and entropy) of every completion token of a micro-batch.

    Args:
        model: a transformers causal LM (plain, or wrapped by FSDP2 per block + root); its
            precision policy decides the head's dtype.
        micro_batch: a `PackedRow` (one unpadded row: `pack` / `pack_batch`), or a padded
            `components.trainer.rollout.Batch` (prompts left-padded, completions right-padded),
            which runs today's padded forward through the same chunked head.
        temperature: the sampling temperature of the engines (<= 0 counts as 1).
        chunk_size: tokens per head chunk (`train.logprob_chunk_size`).
        with_entropy: also return the entropy (no grad).
        compile_backend: None, or the torch.compile backend of the head's per-chunk math
            (`train.compile`; the learner compiles the decoder blocks, `learner.compile_blocks`).
        entropy_grad: the entropy carries grad too (an entropy bonus, ``train.entropy_coef > 0``).

    Returns:
        logp [b, T] float32 (carries grad; 0 on padding) and entropy [b, T] float32 (no grad unless
        `entropy_grad`; 0 on padding) or None. T: `micro_batch.num_columns` for a PackedRow, the batch's
        completion width for a Batch.
    """
    if not isinstance(micro_batch, PackedRow):
        return sequence_logprobs_padded(
            model, micro_batch, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
            compile_backend=compile_backend, entropy_grad=entropy_grad,
        )
    _check_args(temperature, chunk_size)
    _check_plain_head(model)
    row = micro_batch
    hidden = final_hidden_states(model, input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=None,
                                 **varlen_kwargs(model, row.position_ids, None))  # [1, N, H]
    return _head_logprobs(
        model, hidden[0], row.predict_index, row.targets, row.out_rows, row.out_cols,
        row.num_sequences, row.num_columns, temperature, chunk_size, with_entropy, compile_backend, entropy_grad,
    )


def sequence_logprobs_padded(model, batch, *, temperature: float, chunk_size: int, with_entropy: bool,
                             compile_backend: Optional[str] = None, entropy_grad: bool = False):
    """`sequence_logprobs_packed` for a padded micro-batch (`Batch` layout): same head, same outputs.

    The forward is today's padded one (attention mask, positions from the mask, no cache);
    only the completion positions that hold a token go through the chunked head.
    """
    _check_args(temperature, chunk_size)
    _check_plain_head(model)
    P = int(batch.completion_start)
    B, L = batch.input_ids.shape
    T = L - P
    if P < 1 or T < 1:
        raise ValueError(f"a padded micro-batch needs completion_start >= 1 and >= 1 completion column, got P={P}, L={L}")
    position_ids = position_ids_from_mask(batch.attention_mask)  # [B, L]
    hidden = final_hidden_states(
        model,
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        **varlen_kwargs(model, position_ids, batch.attention_mask),
    )  # [B, L, H]
    valid = batch.attention_mask[:, P:].bool()  # [B, T]: completion cells that hold a token
    rows, cols = valid.nonzero(as_tuple=True)  # [M], [M]
    predict_index = rows * L + (P - 1) + cols  # [M]: column P-1+t predicts token P+t
    targets = batch.input_ids[:, P:][valid]  # [M]
    return _head_logprobs(
        model, hidden.reshape(B * L, -1), predict_index, targets, rows, cols, B, T, temperature, chunk_size, with_entropy,
        compile_backend, entropy_grad,
    )


# --------------------------------------------------------------------------------------------
# 5. activation checkpointing
def enable_activation_checkpointing(model: torch.nn.Module) -> int:
    """Recompute every decoder block in backward (transformers' checkpointing, use_reentrant=False).

    Call it on the plain model BEFORE `fully_shard`: transformers' `GradientCheckpointingLayer`
    checkpoints each block's `forward` (not `__call__`), so FSDP2's per-block hooks stay outside
    the checkpoint, and it checkpoints only the outermost forward of the `FSDP<Block>` subclass
    that `fully_shard` creates. Parameter names are unchanged. Takes effect in train() mode only.
    Returns the number of checkpointed blocks.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing (supports_gradient_checkpointing is False)")
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5.23
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)
    if blocks == 0:
        raise ValueError(f"{type(model).__name__}: activation checkpointing is on but no decoder block is checkpointed")
    return blocks
