"""The learner's forward at real sizes (issue 11, items 1-3 and 6): packing, chunked head, checkpointing.

References are independent of components/trainer/forward.py:
- log-probs: today's padded path, `components.trainer.learner.token_logprobs` (attention mask,
  full [B, T, V] logits, `components.engines.logprobs.token_logprobs`);
- the head: plain autograd through `F.linear` + `token_logprobs` on the whole [N, V] logits;
- a step's gradient: one padded batch, full logits, the registered aggregation called directly
  on the whole batch (not `weighted_sum`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import components.losses  # noqa: F401  (fills LOSSES)
from components.aggregation import token_weights, weighted_sum
import components.trainer.attention as forward_mod
from components.engines.logprobs import build_batch, position_ids_from_mask, scaled_log_softmax
from components.engines.logprobs import token_logprobs as shared_token_logprobs
from components.precision import get_precision
from components.registry import ADVANTAGE_NORMS, AGGREGATIONS, LOSSES
from components.trainer.attention import ATTN_IMPLEMENTATIONS, resolve_attn_implementation, varlen_layout
from components.trainer.forward import (
    PackedRow,
    chunked_token_logprobs,
    enable_activation_checkpointing,
    final_hidden_states,
    pack,
    pack_batch,
    plan_micro_batches,
    sequence_lengths,
    sequence_logprobs_packed,
    sequence_logprobs_padded,
)
from components.trainer.learner import token_logprobs as padded_token_logprobs
from components.trainer.rollout import Batch

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]

VOCAB = 97


# ------------------------------------------------------------------------------------------
# tiny models and batches, built in memory from transformers configs
def tiny_model(arch: str, *, vocab: int = VOCAB, hidden: int = 32, layers: int = 2, attn: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    model.set_attn_implementation(attn)
    return model


# (prompt length, completion length, group): unequal lengths, an empty completion, 3 prompts
SHAPES = [(3, 5, 7), (7, 1, 7), (1, 9, 7), (4, 0, 2), (2, 6, 2), (5, 4, 2), (6, 7, 4), (2, 3, 4)]


def make_batch(shapes=SHAPES, *, seed: int = 1, vocab: int = VOCAB) -> Batch:
    """A padded step batch (the learner's layout) with forced tokens, rewards and groups."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (p,), generator=g) for p, _, _ in shapes]
    completions = [torch.randint(0, vocab, (c,), generator=g) for _, c, _ in shapes]
    bb = build_batch(prompts, completions, pad_id=0)
    B, T = bb["completion_mask"].shape
    mask = bb["completion_mask"].clone()  # [B, T]
    mask[0, 1] = False  # a forced token: computed, not trained on
    mask[6, 0] = False
    return Batch(
        input_ids=bb["input_ids"],
        attention_mask=bb["attention_mask"],
        mask=mask,
        gen_logp=torch.zeros(B, T),
        versions=torch.zeros(B, T, dtype=torch.long),
        rewards=torch.tensor([1.0, -1, -1, 1, 1, -1, 1, 1])[:B],
        passed=torch.zeros(B, dtype=torch.bool),
        group_ids=torch.tensor([s[2] for s in shapes], dtype=torch.long),
        truncated=torch.zeros(B, dtype=torch.bool),
        num_tokens=bb["completion_mask"].sum(1),
        completion_start=int(bb["completion_start"]),
    )


def completion_cells(batch: Batch) -> torch.Tensor:
    return batch.attention_mask[:, batch.completion_start :].bool()  # [B, T]


# ------------------------------------------------------------------------------------------
# 1. planning and packing
def test_plan_micro_batches_respects_the_budget_and_covers_every_sequence():
    lengths = [9, 3, 7, 1, 5, 5, 2, 8, 4]
    plan = plan_micro_batches(lengths, 10)
    flat = sorted(i for mb in plan for i in mb)
    assert flat == list(range(len(lengths)))  # every sequence exactly once
    assert all(sum(lengths[i] for i in mb) <= 10 for mb in plan)
    assert all(mb == sorted(mb) for mb in plan)
    assert len(plan) == 5  # first-fit decreasing: 44 tokens in 5 bins of 10 (4 would need a perfect fit)
    assert plan_micro_batches(lengths, 100) == [list(range(len(lengths)))]
    assert plan_micro_batches([4, 4, 4], 4) == [[0], [1], [2]]


def test_plan_micro_batches_refuses_an_oversize_sequence_unless_allowed():
    with pytest.raises(ValueError, match=r"sequence 2 has 12 tokens.*max_tokens_per_micro_batch = 10.*at least 12"):
        plan_micro_batches([3, 11, 12, 4], 10)
    plan = plan_micro_batches([3, 11, 12, 4], 10, allow_oversize=True)
    assert [2] in plan and [1] in plan and sorted(i for mb in plan for i in mb) == [0, 1, 2, 3]
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="max_tokens"):
            plan_micro_batches([1, 2], bad)
    with pytest.raises(ValueError, match="sequence 1 has 0"):
        plan_micro_batches([1, 0], 4)


def test_pack_layout():
    row = pack([([5, 6], [7, 8, 9]), ([1], []), ([2, 3, 4], [10])], num_columns=4)
    assert row.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 10]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 0, 1, 2, 3]]
    assert row.predict_index.tolist() == [1, 2, 3, 8]  # the position before each completion token
    assert row.targets.tolist() == [7, 8, 9, 10]
    assert row.out_rows.tolist() == [0, 0, 0, 2] and row.out_cols.tolist() == [0, 1, 2, 0]
    assert row.cu_seqlens.tolist() == [0, 5, 6, 10] and row.max_seqlen == 5 and row.num_sequences == 3
    with pytest.raises(ValueError, match="num_columns = 2 is shorter than the longest completion"):
        pack([([5], [7, 8, 9])], num_columns=2)
    with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
        pack([([5], [7]), ([], [1])])
    with pytest.raises(ValueError, match="at least one sequence"):
        pack([])


def test_pack_batch_recovers_the_unpadded_sequences():
    batch = make_batch()
    assert sequence_lengths(batch) == [p + c for p, c, _ in SHAPES]
    row = pack_batch(batch, rows=[2, 0, 5])
    p2, c2, _ = SHAPES[2]
    assert row.num_columns == batch.mask.shape[1] and row.num_sequences == 3
    assert row.num_tokens == sum(SHAPES[i][0] + SHAPES[i][1] for i in (2, 0, 5))
    P = batch.completion_start
    assert row.input_ids[0, :p2].tolist() == batch.input_ids[2, P - p2 : P].tolist()
    assert row.input_ids[0, p2 : p2 + c2].tolist() == batch.input_ids[2, P : P + c2].tolist()


# ------------------------------------------------------------------------------------------
# 1. packed vs padded, and no cross-sequence attention
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_match_padded(arch, attn):
    model = tiny_model(arch, attn=attn).eval()
    batch = make_batch()
    with torch.no_grad():
        ref_logp, ref_entropy = padded_token_logprobs(model, batch, 0.7)  # [B, T] full logits, attention mask
        logp, entropy = sequence_logprobs_packed(model, pack_batch(batch), temperature=0.7, chunk_size=5, with_entropy=True)
        logp_pad, entropy_pad = sequence_logprobs_packed(model, batch, temperature=0.7, chunk_size=5, with_entropy=True)
    cells = completion_cells(batch)
    assert logp.shape == ref_logp.shape and logp.dtype == torch.float32
    assert (logp[cells] - ref_logp[cells]).abs().max() < 1e-6
    assert (logp_pad[cells] - ref_logp[cells]).abs().max() < 1e-6
    # entropy: a sum over the 97-token vocabulary of values ~4.6 in float32
    assert (entropy[cells] - ref_entropy[cells]).abs().max() < 5e-6
    assert (entropy_pad[cells] - ref_entropy[cells]).abs().max() < 5e-6
    assert bool((logp[~cells] == 0).all()) and bool((entropy[~cells] == 0).all())


def _row_logprobs(model, row: PackedRow, attention_mask=None):
    """log-probs of a packed row computed by hand from the hidden states (optionally WITH a mask)."""
    with torch.no_grad():
        hidden = final_hidden_states(model, input_ids=row.input_ids, position_ids=row.position_ids,
                                     attention_mask=attention_mask)[0]  # [N, H]
        logits = model.get_output_embeddings()(hidden[row.predict_index])  # [M, V]
        flat = shared_token_logprobs(logits, row.targets)  # [M]
    out = torch.zeros(row.num_sequences, row.num_columns)
    out[row.out_rows, row.out_cols] = flat
    return out  # [b, T]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_sequences_do_not_attend_to_each_other(arch, attn):
    model = tiny_model(arch, attn=attn).eval()
    g = torch.Generator().manual_seed(3)
    a, b, c = [(torch.randint(0, VOCAB, (p,), generator=g), torch.randint(0, VOCAB, (n,), generator=g)) for p, n in [(4, 6), (3, 5), (2, 7)]]
    a2 = (torch.randint(0, VOCAB, (4,), generator=g), torch.randint(0, VOCAB, (6,), generator=g))  # A with new tokens
    row, row2 = pack([a, b, c], num_columns=7), pack([a2, b, c], num_columns=7)
    lp, lp2 = _row_logprobs(model, row), _row_logprobs(model, row2)
    assert (lp[0] - lp2[0]).abs().max() > 1e-2  # A changed
    assert (lp[1:] - lp2[1:]).abs().max() < 1e-7  # B and C did not move
    # the same through the learner's entry point
    with torch.no_grad():
        e1, _ = sequence_logprobs_packed(model, row, temperature=1.0, chunk_size=4, with_entropy=False)
        e2, _ = sequence_logprobs_packed(model, row2, temperature=1.0, chunk_size=4, with_entropy=False)
    assert (e1[1:] - e2[1:]).abs().max() < 1e-7 and (e1[0] - e2[0]).abs().max() > 1e-2
    # control: an attention mask switches transformers' packed-sequence detection off and B, C leak
    ones = torch.ones_like(row.input_ids)
    leaky, leaky2 = _row_logprobs(model, row, ones), _row_logprobs(model, row2, ones)
    assert (leaky[1:] - leaky2[1:]).abs().max() > 1e-3
    # control: so does a KV cache (use_cache=True), even without a mask
    with torch.no_grad():
        cached = [model(input_ids=r.input_ids, position_ids=r.position_ids, use_cache=True).logits[0, r.predict_index]
                  for r in (row, row2)]  # [M, V] each
    b_cells = row.out_rows > 0  # B's and C's tokens
    assert (cached[0][b_cells] - cached[1][b_cells]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------
# 2. the chunked head
def _head_reference(hidden, weight, targets, temperature, bias=None):
    """Unchunked autograd reference: full [N, V] logits in the head's dtype, the engines' log-prob."""
    logits = F.linear(hidden.to(weight.dtype), weight, bias)  # [N, V]
    logp = shared_token_logprobs(logits, targets, temperature)  # [N]
    lp = torch.log_softmax(logits.detach().float() / (temperature if temperature > 0 else 1.0), dim=-1)  # [N, V]
    return logp, -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 10, 37, 40, 1000])  # N = 40: dividing, not dividing, >= N
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_chunked_head_matches_unchunked_values_and_gradients(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    N, H, V = 40, 16, 300
    hidden = (torch.randn(N, H, generator=g)).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    bias = (torch.randn(V, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g)  # a generic d loss / d logp

    ref_logp, ref_entropy = _head_reference(hidden, weight, targets, temperature, bias)
    ref_grads = torch.autograd.grad((ref_logp * upstream).sum(), [hidden, weight, bias])
    logp, entropy = chunked_token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk,
                                           bias=bias, with_entropy=True)
    grads = torch.autograd.grad((logp * upstream).sum(), [hidden, weight, bias])
    assert logp.dtype == torch.float32 and not entropy.requires_grad
    assert (logp - ref_logp).abs().max() < 1e-6
    # entropy: a float32 sum over V = 300 terms, so reduction order moves it by some ulps (|H| ~ 4
    # here; seen: 1.04e-6 relative, ~7 ulps, in one CI run). A sequential float32 sum may err by up
    # to V·eps ≈ 1.8e-5 relative; 4e-6 (~30 ulps) still fails any real error (>= 1e-4).
    assert ((entropy - ref_entropy).abs() / ref_entropy.abs().clamp_min(1.0)).max() < 4e-6
    # gradients: float32 sums over N tokens (weight, bias) or V entries (hidden) whose order the
    # chunking changes: equal to 1e-6 absolute + 1e-6 relative
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_chunked_head_per_token_temperature_and_no_bias():
    g = torch.Generator().manual_seed(1)
    N, H, V = 23, 8, 50
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    temps = torch.rand(N, generator=g) + 0.3
    temps[3] = 0.0  # greedy: counts as 1
    logits = F.linear(hidden, weight)  # [N, V]
    ref = scaled_log_softmax(logits, temps).gather(-1, targets[:, None]).squeeze(-1)  # [N]
    ref_grads = torch.autograd.grad(ref.sum(), [hidden, weight])
    logp, none = chunked_token_logprobs(hidden, weight, targets, temperature=temps, chunk_size=6)
    grads = torch.autograd.grad(logp.sum(), [hidden, weight])
    assert none is None
    assert (logp - ref).abs().max() < 1e-6
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_chunked_head_upcasts_a_bf16_input_to_an_fp32_head():
    """bf16_fp32_head: the head's input is cast to fp32 and the gradient comes back in bf16."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(30, 16, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(200, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 200, (30,), generator=g)
    ref, _ = _head_reference(hidden, weight, targets, 1.0)
    ref_grads = torch.autograd.grad(ref.sum(), [hidden, weight])
    logp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=8)
    grads = torch.autograd.grad(logp.sum(), [hidden, weight])
    assert (logp - ref).abs().max() < 1e-6
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    # the hidden state's gradient: fp32, rounded to bf16 once on both sides (at most one bf16 ulp apart)
    assert bool(((grads[0].float() - ref_grads[0].float()).abs() <= 2**-7 * ref_grads[0].float().abs() + 1e-6).all())
    assert (grads[1] - ref_grads[1]).abs().max() < 1e-6


class _Bf16HeadMode(TorchFunctionMode):
    """Computes F.linear with `weight` in bf16 (what the trainer's real-bf16 context does to the head)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) > 1 and args[1] is self.weight:
            args = tuple(a.to(torch.bfloat16) if torch.is_tensor(a) else a for a in args)
        return func(*args, **kwargs)


def test_chunked_head_backward_recomputes_in_the_dtype_forward_used():
    """A mode active in forward only (bf16 head from fp32 weights): backward differentiates the bf16 logits."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (40,), generator=g)
    with _Bf16HeadMode(weight):
        ref = shared_token_logprobs(F.linear(hidden, weight), targets)  # bf16 logits
        logp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=7)
    ref_grads = torch.autograd.grad(ref.sum(), [hidden, weight])  # backward outside the mode, as in the learner
    grads = torch.autograd.grad(logp.sum(), [hidden, weight])
    fp32_grad_h = torch.autograd.grad(shared_token_logprobs(F.linear(hidden, weight), targets).sum(), hidden)[0]
    assert (logp - ref).abs().max() < 1e-6
    assert (grads[0] - ref_grads[0]).abs().max() < 1e-6  # from the same bf16 logits, not fp32 ones:
    assert (fp32_grad_h - ref_grads[0]).abs().max() > 1e-2  # (which would differ this much)
    # the weight's gradient: the reference rounds the whole sum to bf16 once, the chunked head
    # sums the chunks' bf16 products in fp32: equal to a few bf16 ulps of the largest entry
    assert (grads[1] - ref_grads[1]).abs().max() <= 2**-6 * ref_grads[1].abs().max()


def test_chunked_head_bad_input():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="hidden size 8 does not match the head weight's 7"):
        chunked_token_logprobs(h, torch.randn(10, 7), t)
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 10\)"):
        chunked_token_logprobs(h, w, torch.tensor([1, 2, 3, 10]))
    with pytest.raises(ValueError, match="targets must be a long tensor"):
        chunked_token_logprobs(h, w, t[:3])


class _LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor any op produces whose last dimension is the vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_larger_than_one_chunk_of_the_vocabulary_in_forward_or_backward():
    V, chunk = 3001, 16  # hidden 8 < chunk, so the [H, V] view of the head weight is smaller than a chunk
    model = tiny_model("llama", vocab=V, hidden=8, layers=1)
    batch = make_batch(vocab=V)
    row = pack_batch(batch)
    assert row.targets.numel() > 2 * chunk  # several chunks
    with _LargestVocabTensor(V) as probe:
        logp, entropy = sequence_logprobs_packed(model, row, temperature=0.9, chunk_size=chunk, with_entropy=True)
        logp.sum().backward()
    assert probe.largest == chunk * V
    # control: today's padded path materialises [B, T+1, V] logits
    model.zero_grad()
    with _LargestVocabTensor(V) as probe:
        ref, _ = padded_token_logprobs(model, batch, 0.9)
        ref.sum().backward()
    assert probe.largest >= len(batch) * batch.mask.shape[1] * V


# ------------------------------------------------------------------------------------------
# 1 + 2: a packed step's gradient equals the padded one-batch step's
def _padded_reference_grads(model, batch, loss, aggregation, advantages):
    model.zero_grad(set_to_none=True)
    logp, _ = padded_token_logprobs(model, batch, 0.8)  # [B, T]
    per_token = LOSSES.get(loss)(logp, batch.gen_logp, advantages, batch.mask)  # [B, T]
    AGGREGATIONS.get(aggregation)(per_token, batch.mask, batch.group_ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _micro_batched_grads(model, batch, loss, aggregation, advantages, mode: str, chunk: int, budget: int = 16):
    model.zero_grad(set_to_none=True)
    weights = token_weights(aggregation, batch.mask, batch.group_ids)  # [B, T] on the whole batch
    if mode == "packed":
        plan = plan_micro_batches(sequence_lengths(batch), budget)
    else:  # padded micro-batches of 3 sequences
        plan = [list(range(s, min(s + 3, len(batch)))) for s in range(0, len(batch), 3)]
    assert len(plan) >= 3
    for idx in plan:
        rows = torch.tensor(idx)
        mb = batch.select(rows)
        micro = pack_batch(mb) if mode == "packed" else mb
        logp, _ = sequence_logprobs_packed(model, micro, temperature=0.8, chunk_size=chunk, with_entropy=True)
        per_token = LOSSES.get(loss)(logp, mb.gen_logp, advantages[rows], mb.mask)  # [b, T]
        weighted_sum(per_token, weights[rows]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["packed", "padded"])
@pytest.mark.parametrize("loss", ["cispo", "grpo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "sample_mean", "prompt_mean"])
def test_micro_batched_step_gradient_equals_padded_step(arch, mode, loss, aggregation):
    model = tiny_model(arch)
    model.train()
    batch = make_batch()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        logp0, _ = padded_token_logprobs(model, batch, 0.8)
    batch.gen_logp = torch.where(batch.mask, logp0 + 0.3 * torch.randn(logp0.shape, generator=g), 0.0)  # stale generator
    advantages = ADVANTAGE_NORMS.get("batch")(batch.rewards.double(), batch.group_ids).float()  # [B]
    ref = _padded_reference_grads(model, batch, loss, aggregation, advantages)
    got = _micro_batched_grads(model, batch, loss, aggregation, advantages, mode, chunk=7)
    assert max(float(g.abs().max()) for g in ref.values()) > 1e-3  # a real gradient
    for name in ref:
        err = float((got[name] - ref[name]).abs().max())
        assert err < 1e-6, f"{name}: max abs difference {err:.3g}"


def test_a_micro_batch_without_completion_tokens_runs_forward_and_backward():
    """A dummy micro-batch (rank balancing under FSDP2) gives zero gradients on every parameter."""
    model = tiny_model("qwen2").train()
    row = pack([([1, 2], []), ([3], [])])
    logp, entropy = sequence_logprobs_packed(model, row, temperature=1.0, chunk_size=4, with_entropy=True)
    assert logp.shape == (2, 1) and logp.requires_grad and bool((entropy == 0).all())
    (logp * 0.5).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and float(p.grad.abs().max()) == 0.0, name


def test_precision_policies_through_the_chunked_head():
    """bf16_fp32_head (fp32 head, its input upcast) and bf16: same log-probs as the model's own head."""
    batch = make_batch()
    cells = completion_cells(batch)
    # bf16: the logits themselves are bf16, so a chunk's matmul may round one logit differently
    # (one bf16 ulp of a logit of size < 2 is < 1e-2); the fp32 head is fp32 throughout
    for name, tol in [("bf16_fp32_head", 1e-6), ("bf16", 1e-2)]:
        model = get_precision(name).prepare_model(tiny_model("llama"))
        with torch.no_grad():
            ref, _ = padded_token_logprobs(model, batch, 1.0)  # lm_head (with the fp32 pre-hook) on full logits
        logp, _ = sequence_logprobs_padded(model, batch, temperature=1.0, chunk_size=4, with_entropy=False)
        diff = float((logp.detach() - ref)[cells].abs().max())
        assert diff <= tol, (name, diff)
        logp[cells].sum().backward()
        head = model.get_output_embeddings().weight
        assert head.grad is not None and head.grad.dtype == head.dtype and float(head.grad.abs().max()) > 0
        assert model.model.layers[0].mlp.up_proj.weight.grad.dtype == torch.bfloat16


def test_models_that_transform_logits_are_refused():
    model = tiny_model("llama")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        sequence_logprobs_packed(model, pack_batch(make_batch()), temperature=1.0, chunk_size=4, with_entropy=False)
    model.config.final_logit_softcapping = None
    with pytest.raises(ValueError, match="chunk_size"):
        sequence_logprobs_packed(model, pack_batch(make_batch()), temperature=1.0, chunk_size=0, with_entropy=False)


# ------------------------------------------------------------------------------------------
# 3. activation checkpointing
def test_activation_checkpointing_gives_bit_identical_gradients():
    batch = make_batch()
    advantages = ADVANTAGE_NORMS.get("batch")(batch.rewards.double(), batch.group_ids).float()

    def step(model):
        # count the first block's MLP forwards (module hooks do not fire in checkpoint's recompute)
        calls = {"n": 0}
        mlp = model.model.layers[0].mlp
        plain_forward = type(mlp).forward

        def counted(self, x):
            calls["n"] += 1
            return plain_forward(self, x)

        mlp.forward = counted.__get__(mlp)
        grads = _micro_batched_grads(model, batch, "cispo", "prompt_mean", advantages, "packed", chunk=5)
        return grads, calls["n"]

    plain, plain_calls = step(tiny_model("llama", layers=3).train())
    model = tiny_model("llama", layers=3).train()
    assert enable_activation_checkpointing(model) == 3
    ckpt, ckpt_calls = step(model)
    assert ckpt_calls == 2 * plain_calls  # each block really ran again in backward
    for name in plain:
        assert torch.equal(plain[name], ckpt[name]), name


# ------------------------------------------------------------------------------------------
# 5. attention implementation
def test_resolve_attn_implementation():
    assert resolve_attn_implementation(None, "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", torch.device("cpu")) == "eager"
    assert resolve_attn_implementation("sdpa", "cuda") == "sdpa"
    with pytest.raises(ValueError, match=r"'flash_attn' is not one of \['auto', 'sdpa', 'eager', 'flash_attention_2'"):
        resolve_attn_implementation("flash_attn", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device.*'cpu'"):
        resolve_attn_implementation("flash_attention_2", "cpu")
    with pytest.raises(ValueError, match="bf16 or fp16 only.*torch.float32"):
        resolve_attn_implementation("flash_attention_2", "cuda", torch.float32)
    with pytest.raises(ValueError, match="is not one of"):
        resolve_attn_implementation(2, "cpu")
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:  # this machine: no flash-attn
        with pytest.raises(ValueError, match="flash-attn is not installed"):
            resolve_attn_implementation("flash_attention_2", "cuda", torch.bfloat16)
    else:
        assert resolve_attn_implementation("flash_attention_2", "cuda", torch.bfloat16) == "flash_attention_2"
    assert set(ATTN_IMPLEMENTATIONS) >= {"sdpa", "eager", "flash_attention_2"}


def test_resolve_torch_varlen_needs_cuda_and_half_precision_and_registers_it():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with pytest.raises(ValueError, match="'torch_varlen' needs a CUDA device.*'cpu'"):
        resolve_attn_implementation("torch_varlen", "cpu")
    with pytest.raises(ValueError, match="'torch_varlen' computes in bf16 or fp16 only.*torch.float32"):
        resolve_attn_implementation("torch_varlen", "cuda", torch.float32)
    assert resolve_attn_implementation("torch_varlen", "cuda", torch.bfloat16) == "torch_varlen"
    assert AttentionInterface._global_mapping["torch_varlen"] is forward_mod.torch_varlen_attention
    assert "torch_varlen" in AttentionMaskInterface._global_mapping


def test_auto_attention_is_torch_varlen_only_where_it_runs(monkeypatch):
    """train.attn_implementation = "auto": torch_varlen on CUDA with bf16/fp16 compute, a torch that
    has the kernel, and a model whose every layer attends fully and causally without dropout;
    sdpa everywhere else (this machine's torch has torch.nn.attention.varlen)."""
    from transformers import AttentionInterface, LlamaConfig, Qwen2Config

    bf16 = torch.bfloat16
    assert resolve_attn_implementation("auto", "cpu", bf16) == "sdpa"
    assert resolve_attn_implementation("auto", "cuda", torch.float32) == "sdpa"
    assert resolve_attn_implementation("auto", "cuda", None) == "sdpa"  # compute dtype unknown
    assert resolve_attn_implementation("auto", "cuda", bf16) == "torch_varlen"
    assert resolve_attn_implementation("auto", torch.device("cuda", 1), torch.float16) == "torch_varlen"
    assert AttentionInterface._global_mapping["torch_varlen"] is forward_mod.torch_varlen_attention  # registered
    full = LlamaConfig(num_hidden_layers=2)
    assert resolve_attn_implementation("auto", "cuda", bf16, full) == "torch_varlen"
    assert resolve_attn_implementation("auto", "cuda", bf16, full.to_dict()) == "torch_varlen"  # config.json
    windowed = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert "sliding_attention" in windowed.layer_types
    assert resolve_attn_implementation("auto", "cuda", bf16, windowed) == "sdpa"
    assert resolve_attn_implementation("auto", "cuda", bf16, windowed.to_dict()) == "sdpa"
    assert resolve_attn_implementation("auto", "cuda", bf16, {"sliding_window": 4096}) == "sdpa"  # Mistral-style
    assert resolve_attn_implementation("auto", "cuda", bf16, {"sliding_window": 4096, "use_sliding_window": False}) == "torch_varlen"
    assert resolve_attn_implementation("auto", "cuda", bf16, LlamaConfig(attention_dropout=0.1)) == "sdpa"
    assert resolve_attn_implementation("auto", "cuda", bf16, {"text_config": {"sliding_window": 8}}) == "sdpa"
    assert resolve_attn_implementation("auto", "cuda", bf16, full, capability=(9, 0)) == "torch_varlen"
    assert resolve_attn_implementation("auto", "cuda", bf16, full, capability=(8, 0)) == "torch_varlen"
    assert resolve_attn_implementation("auto", "cuda", bf16, full, capability=(7, 5)) == "sdpa"  # T4: no sm_80 flash kernel
    real = forward_mod.importlib.util.find_spec
    monkeypatch.setattr(forward_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch.nn.attention.varlen" else real(name, *a))
    assert resolve_attn_implementation("auto", "cuda", bf16) == "sdpa"  # an older torch


def test_learner_attn_implementation_reads_the_run_config_and_the_models_config(tmp_path, monkeypatch):
    """The learner's call sites resolve "auto" with the run's precision and the model's config.json."""
    from types import SimpleNamespace

    from transformers import AutoConfig, Qwen2Config

    from components.trainer.attention import learner_attn_implementation

    Qwen2Config(num_hidden_layers=2).save_pretrained(tmp_path / "full")
    Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=32, max_window_layers=0).save_pretrained(tmp_path / "win")

    def cfg(path, precision="bf16", attn="auto"):
        return SimpleNamespace(model_path=str(tmp_path / path), precision=precision, attn_implementation=attn)

    assert learner_attn_implementation(cfg("full"), "cuda") == "torch_varlen"
    assert learner_attn_implementation(cfg("full", "bf16_fp32_head"), "cuda") == "torch_varlen"
    assert learner_attn_implementation(cfg("win"), "cuda") == "sdpa"
    assert learner_attn_implementation(cfg("full", "fp32"), "cuda") == "sdpa"
    assert learner_attn_implementation(cfg("full"), "cpu") == "sdpa"
    assert learner_attn_implementation(cfg("missing"), "cuda") == "torch_varlen"  # unreadable: the model load reports it
    assert learner_attn_implementation(cfg("full", attn=None), "cuda") == "sdpa"
    with pytest.raises(ValueError, match="bf16 or fp16 only"):
        learner_attn_implementation(cfg("full", "fp32", attn="torch_varlen"), "cuda")
    from components.precision import emulation_override

    with emulation_override("on"):  # bf16 emulated in fp32 on the GPU too: the flash kernel would get fp32
        assert learner_attn_implementation(cfg("full"), "cuda") == "sdpa"
        with pytest.raises(ValueError, match="bf16 or fp16 only.*torch.float32"):
            learner_attn_implementation(cfg("full", attn="torch_varlen"), "cuda")
    seen = []
    real = AutoConfig.from_pretrained

    def spy(path, **kwargs):
        seen.append(kwargs)
        return real(path, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", spy)
    assert learner_attn_implementation(cfg("win"), "cuda") == "sdpa"
    assert learner_attn_implementation(SimpleNamespace(model_path="no-such-org/no-such-model", precision="bf16",
                                                       attn_implementation="auto"), "cuda") == "torch_varlen"
    assert seen == [{"local_files_only": True}] * 2  # a hub name is never fetched here (the model load reports it)


def test_varlen_layout_finds_the_sequences_of_packed_and_padded_rows():
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # [1, 9]: three packed sequences
    keep, cu, max_len = varlen_layout(packed, None)
    assert keep is None and cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and max_len == 4
    two_rows = torch.tensor([[0, 1, 2, 0], [0, 1, 0, 1]])  # rows start sequences too
    assert varlen_layout(two_rows, None)[1].tolist() == [0, 3, 4, 6, 8]
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)  # left/right padding
    pos = position_ids_from_mask(mask.long())
    keep, cu, max_len = varlen_layout(pos, mask)
    assert keep.tolist() == [2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14] and cu.tolist() == [0, 3, 7, 11] and max_len == 4


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """float64 causal attention within each [cu[i], cu[i+1]) span; q [n, Hq, D], k/v [n, Hkv, D]."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    n, Hq, D = q.shape
    Hkv = k.shape[1]
    assert enable_gqa == (Hq != Hkv) and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(n, Hq, D, dtype=torch.float64)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs = q[a:b].double().transpose(0, 1)  # [Hq, l, D]
        ks = k[a:b].double().transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)  # [Hq, l, D]
        vs = v[a:b].double().transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
        scores = qs @ ks.transpose(1, 2) * scale  # [Hq, l, l]
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out.to(q.dtype)


@pytest.mark.parametrize("signature", [
    ("window_size", "enable_gqa", "scale", "return_aux"),  # torch 2.13
    ("window_size", "scale", "return_aux"),  # no enable_gqa: key and value heads are repeated
    ("is_causal", "return_aux"),  # older still: is_causal, and no scale (the default 1/sqrt(D) is asked for)
])
def test_varlen_call_speaks_each_torch_versions_keywords(signature):
    """The GPU machine may carry another torch than the pinned one: `varlen_call` passes only the
    keywords that torch's varlen_attn has, and gives the same attention (q [n, 4, D], k/v [n, 2, D])."""
    torch.manual_seed(0)
    n, D = 9, 8
    q, k, v = torch.randn(n, 4, D), torch.randn(n, 2, D), torch.randn(n, 2, D)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    want = _reference_varlen(q, k, v, cu, cu, 5, 5, scale=D ** -0.5, window_size=(-1, 0), enable_gqa=True)
    seen = {}

    def kernel(q_, k_, v_, cu_q, cu_k, max_q, max_k, **kw):
        assert set(kw) <= set(signature), kw  # nothing this torch would reject
        seen.update(kw, heads=k_.shape[1])
        causal = kw.pop("is_causal", None)
        if causal is not None:
            assert causal is True
            kw["window_size"] = (-1, 0)
        gqa = q_.shape[1] != k_.shape[1]
        return _reference_varlen(q_, k_, v_, cu_q, cu_k, max_q, max_k, **{**kw, "enable_gqa": gqa})

    got = forward_mod.varlen_call(kernel, q, k, v, cu, 5, D ** -0.5, params=frozenset(signature))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert seen["heads"] == (2 if "enable_gqa" in signature else 4)
    with pytest.raises(TypeError, match=r"takes no scale, and this model's attention scale 0\.5 is not 1/sqrt"):
        forward_mod.varlen_call(kernel, q, k, v, cu, 5, 0.5, params=frozenset(("is_causal",)))
    with pytest.raises(TypeError, match=r"neither window_size nor is_causal \(keywords: no torch.nn.attention.varlen\)"):
        forward_mod.varlen_call(kernel, q, k, v, cu, 5, None, params=frozenset())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_torch_varlen_attention_gives_sdpas_logprobs_and_gradients(monkeypatch, arch):
    """The model through attn_implementation "torch_varlen" (torch's kernel has no CPU version; a
    float64 reference stands in for it, so what is tested is this repo's glue: token selection,
    sequence boundaries, layout, GQA, scale) gives sdpa's log-probs and gradients, on a packed
    row and on a padded micro-batch, and packed sequences do not attend to each other."""
    forward_mod.register_torch_varlen()
    calls = []

    def kernel(*args, **kwargs):
        assert kwargs["scale"] == pytest.approx(8 ** -0.5)  # the attention module's own scaling (head_dim 8)
        calls.append(args[3].tolist())
        return _reference_varlen(*args, **kwargs)

    monkeypatch.setattr(forward_mod, "_varlen_kernel", lambda: kernel)
    batch = make_batch()
    assert_varlen_gives_sdpas(batch, lambda attn: tiny_model(arch, attn=attn))
    assert len(calls) == 2 * 2  # two layers x (packed, padded): the kernel ran for the varlen model only
    packed_cu = pack_batch(batch).cu_seqlens.tolist()
    assert calls[0] == packed_cu  # the packed row's own sequence boundaries


def assert_varlen_gives_sdpas(batch: Batch, make_model, compile_backend=None) -> None:
    """The models `make_model("sdpa")` and `make_model("torch_varlen")` (same weights) give the same
    log-probs and gradients, on `batch` packed and padded (the varlen one's head through
    `compile_backend`)."""
    cells = completion_cells(batch)
    results = {}
    for attn in ("sdpa", "torch_varlen"):
        model = make_model(attn)
        for layout, rows in (("packed", pack_batch(batch)), ("padded", batch)):
            model.zero_grad(set_to_none=True)
            logp, _ = sequence_logprobs_packed(model, rows, temperature=0.7, chunk_size=5, with_entropy=False,
                                               compile_backend=compile_backend if attn == "torch_varlen" else None)
            (logp[cells] * torch.linspace(-1, 1, int(cells.sum()))).sum().backward()
            results[attn, layout] = (logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    for layout in ("packed", "padded"):
        ref_logp, ref_grads = results["sdpa", layout]
        logp, grads = results["torch_varlen", layout]
        assert (logp[cells] - ref_logp[cells]).abs().max() < 1e-5, layout
        for name, g in ref_grads.items():
            assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6), (layout, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel runs on CUDA only (run on a GPU lease)")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_torch_varlen_kernel_on_cuda_gives_fp32_sdpas_logprobs_and_gradients(arch):
    """The real kernel (GPU only; the CPU test above checks the glue with a float64 stand-in): under
    bf16 autocast, "torch_varlen" on a packed row and on a padded micro-batch matches fp32 sdpa to
    bf16's precision. A sequence attending across a packed boundary, or a wrong causal window,
    moves log-probs by O(1), far beyond these tolerances."""
    forward_mod.register_torch_varlen()
    batch = make_batch()
    cells = completion_cells(batch).cuda()
    weights = torch.linspace(-1, 1, int(cells.sum()), device="cuda")

    def run(attn, rows, bf16):
        model = tiny_model(arch, hidden=64, attn=attn).cuda()
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else torch.autocast("cuda", enabled=False)
        with ctx:
            logp, _ = sequence_logprobs_packed(model, rows.to("cuda"), temperature=0.7, chunk_size=5, with_entropy=False)
        (logp[cells].float() * weights).sum().backward()
        return logp.detach().float(), torch.cat([p.grad.flatten() for p in model.parameters()])

    ref_logp, ref_grad = run("sdpa", batch, bf16=False)
    for layout, rows in (("packed", pack_batch(batch)), ("padded", batch)):
        logp, grad = run("torch_varlen", rows, bf16=True)
        assert (logp[cells] - ref_logp[cells]).abs().max() < 0.05, layout  # bf16 rounding: ~1e-2
        cos = F.cosine_similarity(grad, ref_grad, dim=0)
        assert cos > 0.999 and (grad.norm() / ref_grad.norm() - 1).abs() < 0.02, (layout, cos)


def test_torch_varlen_attention_computes_its_own_layout_when_the_forward_passes_none(monkeypatch):
    """The learner's forward hands every layer the precomputed layout (`varlen_kwargs`); any other
    caller of the model gets the same boundaries and hidden states from the per-forward fallback."""
    forward_mod.register_torch_varlen()
    calls = []

    def kernel(*args, **kwargs):
        calls.append(args[3].tolist())
        return _reference_varlen(*args, **kwargs)

    fallback = []
    own_layout = forward_mod._cached_varlen_layout

    def counted(*args):
        fallback.append(1)
        return own_layout(*args)

    monkeypatch.setattr(forward_mod, "_varlen_kernel", lambda: kernel)
    monkeypatch.setattr(forward_mod, "_cached_varlen_layout", counted)
    model = tiny_model("qwen2", attn="torch_varlen")
    batch = make_batch()
    for rows in (pack_batch(batch), batch):
        if isinstance(rows, PackedRow):
            inputs = dict(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=None)
        else:
            inputs = dict(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                          position_ids=position_ids_from_mask(rows.attention_mask))
        extra = forward_mod.varlen_kwargs(model, inputs["position_ids"], inputs["attention_mask"])
        assert list(extra) == [forward_mod.VARLEN_LAYOUT_KWARG]
        calls.clear()
        fallback.clear()
        with torch.no_grad():
            given = final_hidden_states(model, **inputs, **extra)
            assert not fallback, "the precomputed layout did not reach the attention"
            given_calls = list(calls)
            calls.clear()
            own = final_hidden_states(model, **inputs)
        assert len(fallback) == 2  # each layer asks; the second gets the first's (cached)
        assert calls == given_calls and len(calls) == 2  # two layers, the same sequence boundaries
        assert torch.equal(own, given)
    assert forward_mod.varlen_kwargs(tiny_model("qwen2"), batch.attention_mask.long(), None) == {}  # sdpa: none


def test_torch_varlen_attention_gives_the_kernel_one_half_dtype_under_autocast(monkeypatch):
    """One learner rank computes under autocast over fp32 weights: the projections come out bf16, the
    rotary embedding promotes query and key to fp32. The kernel (which autocast does not cast)
    gets q, k, v in the autocast dtype, and the log-probs stay close to sdpa's under the same
    autocast."""
    forward_mod.register_torch_varlen()
    seen = []

    def kernel(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return _reference_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(forward_mod, "_varlen_kernel", lambda: kernel)
    batch = make_batch()
    cells = completion_cells(batch)
    out = {}
    for attn in ("sdpa", "torch_varlen"):
        model = tiny_model("qwen2", attn=attn)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out[attn], _ = sequence_logprobs_packed(model, pack_batch(batch), temperature=1.0, chunk_size=5,
                                                    with_entropy=False)
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen)
    assert (out["torch_varlen"][cells] - out["sdpa"][cells]).abs().max() < 0.05  # bf16 attention either way


def test_torch_varlen_attention_refuses_dropout_and_sliding_windows():
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="no attention dropout"):
        forward_mod.torch_varlen_attention(None, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding window of 64"):
        forward_mod.torch_varlen_attention(None, q, kv, kv, None, sliding_window=64)


# ------------------------------------------------------------------------------------------
# 2. peak memory: 32k vocabulary, 4k tokens (a fresh process, peak RSS)
MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource
    import torch
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM
    from components.engines.logprobs import build_batch
    from components.trainer.forward import pack, sequence_logprobs_packed
    from components.trainer.learner import token_logprobs
    from components.trainer.rollout import Batch

    V, seqs, prompt, completion = 32000, 4, 24, 1000   # 4 x 1024 = 4096 tokens
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048))
    model.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(0, V, (prompt,), generator=g), torch.randint(0, V, (completion,), generator=g)) for _ in range(seqs)]

    def step(mode, pairs):
        if mode == "chunked":  # packed row, chunked head, entropy on
            logp, ent = sequence_logprobs_packed(model, pack(pairs), temperature=1.0, chunk_size=512, with_entropy=True)
        else:  # today's padded path: full [B, T+1, V] logits and a full entropy pass
            bb = build_batch([p for p, _ in pairs], [c for _, c in pairs], pad_id=0)
            B, T = bb["completion_mask"].shape
            batch = Batch(input_ids=bb["input_ids"], attention_mask=bb["attention_mask"], mask=bb["completion_mask"],
                          gen_logp=torch.zeros(B, T), versions=torch.zeros(B, T, dtype=torch.long), rewards=torch.zeros(B),
                          passed=torch.zeros(B, dtype=torch.bool), group_ids=torch.zeros(B, dtype=torch.long),
                          truncated=torch.zeros(B, dtype=torch.bool), num_tokens=torch.full((B,), T),
                          completion_start=bb["completion_start"])
            logp, ent = token_logprobs(model, batch, 1.0)
        logp.sum().backward()
        model.zero_grad(set_to_none=False)

    def status_bytes(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    def step_increase(mode):
        # (upper, lower) bounds of the step's peak RSS minus the RSS before it (equal on Linux >= 4.0)
        before = status_bytes("VmRSS")
        prior_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        try:
            open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
        except OSError:
            step(mode, pairs)
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return after - before, after - prior_peak
        step(mode, pairs)
        exact = status_bytes("VmHWM") - before
        return exact, exact

    for mode in ("chunked", "unchunked"):  # warm-up on 32 tokens: kernels, thread pools, grad buffers
        step(mode, [(p[:4], c[:4]) for p, c in pairs])
    chunked_upper, _ = step_increase("chunked")
    _, unchunked_lower = step_increase("unchunked")
    print(json.dumps({"chunked": chunked_upper, "unchunked_at_least": unchunked_lower}))
    """
)


@pytest.mark.slow
def test_peak_memory_of_a_4k_token_step_with_a_32k_vocabulary_stays_below_one_logits_tensor():
    one_logits = 4096 * 32000 * 4  # a [4096, 32000] float32 tensor: 524 MB
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"memory probe failed:\n{out.stderr[-3000:]}"
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"peak RSS increase: chunked <= {peaks['chunked'] / 1e6:.0f} MB, unchunked >= {peaks['unchunked_at_least'] / 1e6:.0f} MB, "
          f"one [4096, 32000] fp32 tensor {one_logits / 1e6:.0f} MB")
    assert peaks["unchunked_at_least"] > one_logits
    assert peaks["chunked"] < one_logits


# ------------------------------------------------------------------------------------------
# composition with FSDP2 (fully_shard per block + root, applied after checkpointing)
FSDP_WORLD = 2
FSDP_BUDGET = 20  # tokens per packed micro-batch: 4 micro-batches of the test batch, 2 per rank


def _fsdp_worker(rank: int, port: int, out_dir: str) -> None:
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=FSDP_WORLD)
        from torch.distributed.fsdp import fully_shard

        model = tiny_model("llama", layers=2).train()
        enable_activation_checkpointing(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        batch = make_batch()
        advantages = ADVANTAGE_NORMS.get("batch")(batch.rewards.double(), batch.group_ids).float()  # [B]
        weights = token_weights("prompt_mean", batch.mask, batch.group_ids)  # [B, T], whole batch
        plan = plan_micro_batches(sequence_lengths(batch), FSDP_BUDGET)
        for idx in plan[rank::FSDP_WORLD]:
            rows = torch.tensor(idx)
            mb = batch.select(rows)
            logp, _ = sequence_logprobs_packed(model, pack_batch(mb), temperature=0.8, chunk_size=5, with_entropy=True)
            per_token = LOSSES.get("cispo")(logp, mb.gen_logp, advantages[rows], mb.mask)  # [b, T]
            (weighted_sum(per_token, weights[rows]) * FSDP_WORLD).backward()  # FSDP2 averages over ranks
        grads = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, os.path.join(out_dir, "grads.pt"))
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.slow
def test_packed_chunked_checkpointed_step_under_fsdp2_matches_one_process(tmp_path):
    import socket

    import torch.multiprocessing as mp

    batch = make_batch()
    plan = plan_micro_batches(sequence_lengths(batch), FSDP_BUDGET)
    assert len(plan) % FSDP_WORLD == 0  # every rank runs the same number of forwards
    advantages = ADVANTAGE_NORMS.get("batch")(batch.rewards.double(), batch.group_ids).float()
    ref = _micro_batched_grads(tiny_model("llama", layers=2).train(), batch, "cispo", "prompt_mean", advantages, "packed",
                               chunk=5, budget=FSDP_BUDGET)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_fsdp_worker, args=(r, port, str(tmp_path)), name=f"fsdp-rank{r}") for r in range(FSDP_WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    hung = [p.name for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    errors = {f.name: f.read_text()[-2000:] for f in tmp_path.glob("rank*.err")}
    assert not hung, f"{hung} did not finish within 300 s (killed); errors: {errors}"
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}; errors: {errors}"
    got = torch.load(tmp_path / "grads.pt")
    assert sorted(got) == sorted(ref)
    for name in ref:
        err = float((got[name] - ref[name]).abs().max())
        assert err < 1e-6, f"{name}: max abs difference {err:.3g}"
