"""Precision policies (components/precision.py) and the shared log-prob function (engines/logprobs.py)."""

from __future__ import annotations

import math

import pytest
import torch

from components.engines.logprobs import (
    build_batch,
    logprob_gap_stats,
    scaled_log_softmax,
    sequence_logprobs,
    token_logprobs,
)
from components.models import build_tiny_policy, load_causal_lm
from components.precision import PrecisionPolicy, get_precision, heads_are_tied, vllm_dtype
from components.registry import PRECISIONS, UnknownComponentError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("tiny_prec"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("tiny_tied"), tie_word_embeddings=True)


def test_registry_names_and_unknown():
    assert {"fp32", "bf16", "bf16_fp32_head"} <= set(PRECISIONS.names())
    with pytest.raises(UnknownComponentError, match="bf16_fp32_head"):
        PRECISIONS.get("bf16_fp32head")
    pol = PRECISIONS.get("bf16_fp32_head")()
    assert isinstance(pol, PrecisionPolicy) and pol.name == "bf16_fp32_head"
    assert (pol.param_dtype, pol.logits_dtype) == (torch.bfloat16, torch.float32)
    assert vllm_dtype(pol) == "bfloat16" and vllm_dtype(get_precision("fp32")) == "float32"


@pytest.mark.parametrize(
    "name,body,head,logits",
    [
        ("fp32", torch.float32, torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16),
        ("bf16_fp32_head", torch.bfloat16, torch.float32, torch.float32),
    ],
)
def test_prepare_model_dtypes_and_logits(tiny, name, body, head, logits):
    pol = get_precision(name)
    model = pol.prepare_model(load_causal_lm(tiny))
    pol.check_model(model)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == body
    assert model.get_input_embeddings().weight.dtype == body
    assert model.get_output_embeddings().weight.dtype == head
    ids = torch.tensor([[9, 10, 11, 12]])
    with torch.no_grad():
        out = model(input_ids=ids)
    assert out.logits.dtype == logits
    assert pol.prepare_model(model) is model  # idempotent
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, out.logits)


def test_fp32_head_computes_the_head_in_fp32(tiny):
    model = get_precision("bf16_fp32_head").prepare_model(load_causal_lm(tiny))
    ids = torch.tensor([[9, 10, 11, 12, 13]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # bf16
        ref = hidden.double() @ model.lm_head.weight.double().T  # float64 reference of the head
        logits = model(input_ids=ids).logits
    assert hidden.dtype == torch.bfloat16
    assert (logits.double() - ref).abs().max() < 1e-4
    # a bf16 head is visibly coarser than the fp32 one
    bf16_logits = (hidden @ model.lm_head.weight.to(torch.bfloat16).T).double()
    assert (bf16_logits - ref).abs().max() > (logits.double() - ref).abs().max()


def test_tied_embeddings_are_untied_for_fp32_head(tied, tmp_path):
    model = load_causal_lm(tied)
    assert heads_are_tied(model)
    emb_before = model.get_input_embeddings().weight.detach().clone()
    get_precision("bf16_fp32_head").prepare_model(model)
    assert not heads_are_tied(model)
    assert model.config.tie_word_embeddings is False
    assert torch.equal(model.get_output_embeddings().weight, emb_before)  # fp32 copy, exact
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    # the two now train separately
    with torch.no_grad():
        model.get_output_embeddings().weight.add_(1.0)
    assert not torch.equal(model.get_output_embeddings().weight.to(torch.bfloat16), model.get_input_embeddings().weight)
    sd = model.state_dict()
    assert "lm_head.weight" in sd and sd["lm_head.weight"].dtype == torch.float32
    # the other policies leave a tied model tied
    for name in ("fp32", "bf16"):
        m = get_precision(name).prepare_model(load_causal_lm(tied))
        assert heads_are_tied(m)


def test_token_logprobs_float64_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 17, generator=g).to(torch.bfloat16)
    tokens = torch.randint(0, 17, (3, 5), generator=g)
    for temp in (1.0, 0.7, 1.3):
        got = token_logprobs(logits, tokens, temp)
        assert got.dtype == torch.float32
        x = logits.double() / temp
        ref = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, -1)
        assert (got.double() - ref).abs().max() < 1e-5
    greedy = token_logprobs(logits, tokens, 0.0)
    assert torch.equal(greedy, token_logprobs(logits, tokens, 1.0))
    # one temperature per row (the engine's mixed batches): same as each row at its own temperature
    rows = logits[:, 0, :]  # [3, V]
    temps = torch.tensor([0.5, 0.0, 2.0])
    per_row = scaled_log_softmax(rows, temps)
    for i, t in enumerate(temps.tolist()):
        assert torch.allclose(per_row[i], scaled_log_softmax(rows[i], t), atol=1e-6)


def test_sequence_logprobs_matches_unpadded_float64_reference(tiny):
    model = load_causal_lm(tiny).double().eval()
    prompts = [[9, 10, 11], [12, 13, 14, 15, 16, 17], [20]]
    completions = [[30, 31, 32, 33], [40], [50, 51]]
    batch = build_batch(prompts, completions, pad_id=0)
    assert batch["completion_start"] == 6 and batch["input_ids"].shape == (3, 10)
    assert batch["completion_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    temp = 0.8
    got = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_start"], temp)
    assert got.shape == (3, 4) and got.dtype == torch.float32
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double() / temp  # unpadded, one sequence
        ref = [float(torch.log_softmax(logits[len(p) - 1 + t], -1)[tok]) for t, tok in enumerate(c)]
        assert torch.allclose(got[i, : len(c)].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6)


def test_sequence_logprobs_carries_gradient(tiny):
    model = load_causal_lm(tiny)
    batch = build_batch([[9, 10], [11]], [[12, 13], [14]], pad_id=0)
    logp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_start"])
    (logp * batch["completion_mask"]).sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_logprob_gap_stats():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, 9.0]])
    gen = torch.tensor([[-1.1, -2.0, -2.5], [-0.5, -0.3, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    s = logprob_gap_stats(logp, gen, mask)
    d = [0.1, 0.0, -0.5, 0.0, 0.2]
    assert math.isclose(s["logp_gap_mean_abs"], sum(map(abs, d)) / 5, rel_tol=1e-6)
    assert math.isclose(s["logp_gap_max_abs"], 0.5, rel_tol=1e-6)
    assert math.isclose(s["logp_gap_mean"], sum(d) / 5, abs_tol=1e-7)
    pa = [math.exp(x) for x in (-1.0, -2.0, -3.0, -0.5, -0.1)]
    pb = [math.exp(x) for x in (-1.1, -2.0, -2.5, -0.5, -0.3)]
    assert math.isclose(s["prob_gap_mean_abs"], sum(abs(a - b) for a, b in zip(pa, pb)) / 5, rel_tol=1e-6)
    assert logprob_gap_stats(logp, gen, torch.zeros_like(mask))["logp_gap_max_abs"] == 0.0
