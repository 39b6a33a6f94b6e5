"""The torch engine against the Engine contract (components/engines/base.py)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from _helpers_engines import recompute_logprobs
from components.engines import Engine, GenerationRequest, Interruption, SamplingParams, make_engine
from components.engines.logprobs import build_batch
from components.engines.sampling import top_p_filter
from components.models import build_tiny_policy, load_causal_lm
from components.precision import get_precision
from components.registry import ENGINES

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_engine")))


def _prompts(k, seed=0, lo=3, hi=12):
    rng = random.Random(seed)
    return [[rng.randrange(8, 100) for _ in range(rng.randint(lo, hi))] for _ in range(k)]


def _requests(prompts, n, **kw):
    return [GenerationRequest(group_id=i, prompt_ids=p, n=n, **kw) for i, p in enumerate(prompts)]


_recompute = recompute_logprobs


def _all(groups):
    return [c for g in groups for c in g.completions]


def test_registered_and_make_engine(tiny):
    assert "torch" in ENGINES.names()
    eng = make_engine("torch", tiny, precision="fp32", seed=1, max_batch_size=8)
    assert isinstance(eng, Engine) and type(eng).__name__ == "TorchEngine" and eng.version == 0


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_gen_logp_matches_trainer_recomputation_fp32(tiny, temperature, top_p):
    # small batch so that requests are admitted while others decode (cache merging, padding, trimming)
    eng = make_engine("torch", tiny, precision="fp32", seed=3, max_batch_size=6)
    prompts = _prompts(7)
    groups = list(eng.generate(_requests(prompts, n=3), SamplingParams(temperature=temperature, top_p=top_p, max_tokens=30)))
    comps = _all(groups)
    assert len(comps) == 21
    model = get_precision("fp32").prepare_model(load_causal_lm(tiny)).eval()
    logp, gen, mask = _recompute(model, comps, temperature)
    gap = (logp - gen).abs()[mask]
    assert gap.numel() > 200
    assert float(gap.max()) < 2e-5, float(gap.max())
    for c in comps:
        assert len(c.gen_logp) == len(c.token_ids) == len(c.versions) == len(c.forced)
        assert all(isinstance(x, float) for x in c.gen_logp)
        assert c.prompt_ids == prompts[c.group_id]


@pytest.mark.parametrize("emulate", ["off", "auto"])  # real bf16, and bf16 emulated in fp32 (the CPU default)
def test_precision_policies_apply_to_engine(tiny, emulate):
    from components.precision import emulation_override, is_bf16_valued

    bf16_storage = torch.bfloat16 if emulate == "off" else torch.float32
    with emulation_override(emulate):
        for name, body, head in [("fp32", torch.float32, torch.float32), ("bf16", bf16_storage, bf16_storage),
                                 ("bf16_fp32_head", bf16_storage, torch.float32)]:
            eng = make_engine("torch", tiny, precision=name, max_batch_size=8)
            assert eng.policy.emulated == (emulate == "auto" and name != "fp32")
            assert eng.model.get_input_embeddings().weight.dtype == body
            assert eng.model.get_output_embeddings().weight.dtype == head
            assert is_bf16_valued(eng.model.get_input_embeddings().weight) == (name != "fp32")
            comps = _all(eng.generate(_requests(_prompts(2), n=2), SamplingParams(max_tokens=8)))
            model = get_precision(name, device="cpu").prepare_model(load_causal_lm(tiny)).eval()
            logp, gen, mask = _recompute(model, comps, 1.0)
            # bf16 bodies differ between KV-cache decode and one full pass; the gap table is in BENCHMARKS.md
            assert float((logp - gen).abs()[mask].max()) < (2e-5 if name == "fp32" else 0.1)


def test_in_flight_weight_update_versions_and_outputs(tiny):
    params = SamplingParams(max_tokens=24)
    prompts = _prompts(4, seed=5)
    ref = make_engine("torch", tiny, seed=11, max_batch_size=64)
    ref_out = {(c.group_id, c.sample_index): c.token_ids for c in _all(ref.generate(_requests(prompts, n=2), params))}

    eng = make_engine("torch", tiny, seed=11, max_batch_size=64)
    ptr_before = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    trainer = load_causal_lm(tiny)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    new_state = {k: v.detach().clone() for k, v in trainer.state_dict().items()}

    eng.add_requests(_requests(prompts, n=2), params)
    done = []
    for _ in range(6):  # prefill + 5 decode steps under version 0
        done += eng.step()
    eng.update_weights(new_state, version=1)
    # a second wave admitted after the update runs entirely under version 1
    late = [GenerationRequest(group_id=100 + i, prompt_ids=p, n=2) for i, p in enumerate(_prompts(2, seed=9))]
    eng.add_requests(late, params)
    while eng.has_unfinished():
        done += eng.step()
    comps = _all(done)
    assert {n: p.data_ptr() for n, p in eng.model.named_parameters()} == ptr_before  # copied in place
    spanning = [c for c in comps if c.group_id < 100 and c.num_tokens > 6]
    assert spanning, "some sequences must be in flight across the update"
    for c in spanning:
        assert c.versions[:6] == [0] * 6 and set(c.versions[6:]) == {1}
        assert c.min_version == 0 and c.max_version == 1
    late_comps = [c for c in comps if c.group_id >= 100]
    assert late_comps and all(set(c.versions) == {1} for c in late_comps)
    changed = sum(c.token_ids != ref_out[(c.group_id, c.sample_index)] for c in comps if c.group_id < 100)
    assert changed >= 1, "new weights must change what is sampled after the update"
    # tokens of sequences started after the update agree with a recomputation under the new weights
    logp, gen, mask = _recompute(trainer.eval(), late_comps, 1.0)
    assert float((logp - gen).abs()[mask].max()) < 1e-4  # perturbed weights: larger logits, larger fp32 rounding


def test_update_weights_errors_and_dtype_conversion(tiny):
    eng = make_engine("torch", tiny, precision="bf16_fp32_head")
    trainer = get_precision("bf16_fp32_head").prepare_model(load_causal_lm(tiny))
    eng.update_weights(trainer.state_dict(), 3)
    assert eng.version == 3
    fp32_state = load_causal_lm(tiny).state_dict()  # fp32 tensors into a bf16 engine: converted by copy_
    eng.update_weights({"module." + k: v for k, v in fp32_state.items()}, 4)
    assert torch.equal(eng.model.get_output_embeddings().weight, fp32_state["lm_head.weight"])
    bad = dict(fp32_state)
    del bad["lm_head.weight"]
    with pytest.raises(KeyError, match="lm_head.weight"):
        eng.update_weights(bad, 5)


def test_finish_reasons_stop_and_length(tiny):
    eng = make_engine("torch", tiny, seed=2)
    stops = tuple(range(8, 40))  # about a third of the vocabulary: stops are common but not certain
    comps = _all(eng.generate(_requests(_prompts(6), n=4), SamplingParams(max_tokens=5, stop_token_ids=stops)))
    stop_set = set(stops) | {eng.tokenizer.eos_token_id}
    reasons = {c.finish_reason for c in comps}
    assert reasons == {"stop", "length"}
    for c in comps:
        assert not any(t in stop_set for t in c.token_ids[:-1]), "generation must end at the first stop token"
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in stop_set
        else:
            assert c.num_tokens == 5 and c.token_ids[-1] not in stop_set


def test_interruption_forced_phrase(tiny):
    eng = make_engine("torch", tiny, seed=4)
    phrase = tuple(eng.tokenizer.encode(" time is up </think>", add_special_tokens=False))
    stops = tuple(range(8, 60))
    its = [Interruption(at_token=a, phrase_ids=phrase, answer_budget=4) for a in (0, 2, 3, 50)]
    req = GenerationRequest(group_id="g", prompt_ids=[9, 10, 11], n=4, interruptions=its)
    (group,) = list(eng.generate([req], SamplingParams(max_tokens=40, stop_token_ids=stops)))
    stop_set = set(stops) | {eng.tokenizer.eos_token_id}
    seen_interrupted = False
    for c, it in zip(group.completions, its):
        n_sampled_before = next((i for i, f in enumerate(c.forced) if f), None)
        if n_sampled_before is None:  # stopped before the interruption point, or it lies beyond max_tokens
            assert (c.finish_reason == "stop" and c.num_tokens <= it.at_token) or (
                c.finish_reason == "length" and c.num_tokens == 40 and it.at_token >= 40
            ), c
            continue
        assert n_sampled_before == it.at_token
        k = len(phrase)
        assert tuple(c.token_ids[it.at_token : it.at_token + k]) == phrase
        assert c.forced[it.at_token : it.at_token + k] == [True] * k
        assert c.gen_logp[it.at_token : it.at_token + k] == [0.0] * k
        answer = c.token_ids[it.at_token + k :]
        assert 1 <= len(answer) <= it.answer_budget
        if c.finish_reason == "interrupted":
            seen_interrupted = True
            assert answer[-1] in stop_set
        else:
            assert c.finish_reason == "length" and len(answer) == it.answer_budget
    assert seen_interrupted
    # sampled tokens of an interrupted completion still agree with a recomputation (phrase is context)
    model = load_causal_lm(tiny).eval()
    logp, gen, mask = _recompute(model, group.completions, 1.0)
    assert float((logp - gen).abs()[mask].max()) < 2e-5


def test_top_p_filter_reference():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 30, generator=g, dtype=torch.float64), -1)
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.999, 1.0], dtype=torch.float64)
    out = top_p_filter(probs, top_p)
    for b in range(5):
        order = sorted(range(30), key=lambda v: -float(probs[b, v]))
        kept, mass = set(), 0.0
        for v in order:  # smallest prefix of the sorted vocabulary whose mass reaches top_p
            if mass >= float(top_p[b]):
                break
            kept.add(v)
            mass += float(probs[b, v])
        assert {v for v in range(30) if out[b, v] > 0} == kept
        assert torch.allclose(out[b][list(kept)], probs[b][list(kept)])


def test_top_p_and_temperature_behaviour(tiny):
    prompts = _prompts(3, seed=8)
    greedy = make_engine("torch", tiny, seed=0)
    g_out = _all(greedy.generate(_requests(prompts, n=2), SamplingParams(temperature=0.0, max_tokens=12)))
    model = load_causal_lm(tiny).eval()
    # greedy: every token is the argmax of the model
    batch = build_batch([c.prompt_ids for c in g_out], [c.token_ids for c in g_out], 0)
    with torch.no_grad():
        P = batch["completion_start"]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, P - 1 : -1]
    am = logits.argmax(-1)
    for i, c in enumerate(g_out):
        assert c.token_ids == am[i, : c.num_tokens].tolist()
    # a tiny nucleus keeps only the most likely token: identical to greedy
    nucleus = make_engine("torch", tiny, seed=123)
    n_out = _all(nucleus.generate(_requests(prompts, n=2), SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12)))
    assert [c.token_ids for c in n_out] == [c.token_ids for c in g_out]
    # gen_logp is NOT renormalised after top-p: it is log_softmax(logits/T), so below 0 here
    assert max(max(c.gen_logp) for c in n_out) < 0.0
    # low temperature concentrates mass: mean gen_logp is much closer to 0 than at T=1
    cold = _all(make_engine("torch", tiny, seed=1).generate(_requests(prompts, n=4), SamplingParams(temperature=0.1, max_tokens=12)))
    hot = _all(make_engine("torch", tiny, seed=1).generate(_requests(prompts, n=4), SamplingParams(temperature=1.0, max_tokens=12)))
    mean = lambda cs: sum(sum(c.gen_logp) for c in cs) / sum(c.num_tokens for c in cs)  # noqa: E731
    assert mean(cold) > mean(hot) + 1.0


def test_streaming_short_group_before_long_group(tiny):
    eng = make_engine("torch", tiny, seed=0)
    eng.add_requests([GenerationRequest(group_id="long", prompt_ids=[9, 10, 11], n=2)], SamplingParams(max_tokens=40, stop_token_ids=()))
    eng.add_requests([GenerationRequest(group_id="short", prompt_ids=[12, 13], n=2)], SamplingParams(max_tokens=3))
    order, steps = [], 0
    while eng.has_unfinished():
        steps += 1
        for g in eng.step():
            order.append((g.request.group_id, steps))
            assert len(g.completions) == 2 and all(c is not None for c in g.completions)
    assert [o[0] for o in order] == ["short", "long"], order
    short_step = order[0][1]
    assert short_step <= 3 < order[1][1]  # handed over as soon as it finished, not at the end


def test_determinism_with_seed(tiny):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95)
    prompts = _prompts(4, seed=2)
    a = [c.token_ids for c in _all(make_engine("torch", tiny, seed=7).generate(_requests(prompts, n=3), params))]
    b = [c.token_ids for c in _all(make_engine("torch", tiny, seed=7).generate(_requests(prompts, n=3), params))]
    c = [c.token_ids for c in _all(make_engine("torch", tiny, seed=8).generate(_requests(prompts, n=3), params))]
    assert a == b and a != c
    seeded = SamplingParams(max_tokens=16, seed=99)
    d = [x.token_ids for x in _all(make_engine("torch", tiny, seed=1).generate(_requests(prompts, n=3), seeded))]
    e = [x.token_ids for x in _all(make_engine("torch", tiny, seed=2).generate(_requests(prompts, n=3), seeded))]
    assert d == e  # SamplingParams.seed reseeds the engine


def test_continuous_batching_respects_max_batch_size(tiny):
    eng = make_engine("torch", tiny, seed=0, max_batch_size=5)
    eng.add_requests(_requests(_prompts(9), n=2), SamplingParams(max_tokens=10))
    peak, groups = 0, []
    while eng.has_unfinished():
        groups += eng.step()
        peak = max(peak, sum(r.finish_reason is None for r in eng._rows))
    assert peak <= 5
    assert sorted(g.request.group_id for g in groups) == list(range(9))


def test_tied_embeddings_with_fp32_head(tmp_path):
    path = build_tiny_policy(tmp_path / "tied", tie_word_embeddings=True)
    eng = make_engine("torch", str(path), precision="bf16_fp32_head")
    head, emb = eng.model.get_output_embeddings(), eng.model.get_input_embeddings()
    assert head.weight is not emb.weight and head.weight.dtype == torch.float32
    assert emb.weight.dtype == eng.policy.storage_dtype  # bf16, or fp32 holding bf16 values (emulated on CPU)
    trainer = get_precision("bf16_fp32_head").prepare_model(load_causal_lm(path))
    eng.update_weights(trainer.state_dict(), 1)
    comps = _all(eng.generate(_requests(_prompts(2), n=2), SamplingParams(max_tokens=6)))
    assert all(c.num_tokens >= 1 for c in comps)


def test_request_validation(tiny):
    eng = make_engine("torch", tiny)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.add_requests([GenerationRequest(group_id=0, prompt_ids=[9] * 10, n=1)], SamplingParams(max_tokens=600))
    with pytest.raises(ValueError, match="interruptions"):
        eng.add_requests([GenerationRequest(group_id=0, prompt_ids=[9], n=2, interruptions=[None])], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        eng.add_requests([GenerationRequest(group_id=0, prompt_ids=[9], n=1)], SamplingParams(top_p=0.0))


@pytest.mark.slow
def test_faster_than_transformers_generate(tiny):
    """A loose in-process ratio (the measurement is benchmarks/generation.py)."""
    eng = make_engine("torch", tiny, seed=0, max_batch_size=256)
    model = load_causal_lm(tiny).eval()
    prompts = _prompts(32, seed=1, lo=8, hi=16)
    P = max(map(len, prompts))
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :], mask[i, P - len(p) :] = torch.tensor(p), 1

    def engine_rate():
        t = time.perf_counter()
        n = sum(c.num_tokens for c in _all(eng.generate(_requests(prompts, n=4), SamplingParams(max_tokens=48))))
        return n / (time.perf_counter() - t)

    def generate_rate():
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=48,
                                 num_return_sequences=4, pad_token_id=0, top_k=0)
        dt = time.perf_counter() - t
        new = out[:, P:]
        n = int((new != 0).sum())
        return n / dt

    engine_rate(), generate_rate()  # warm up
    ratios = [engine_rate() / generate_rate() for _ in range(3)]
    assert max(ratios) >= 0.9, ratios


def test_abort_all_returns_in_flight_groups(tiny):
    eng = make_engine("torch", tiny, seed=0, max_batch_size=4)
    eng.add_requests(_requests(_prompts(4), n=2), SamplingParams(max_tokens=40, stop_token_ids=()))
    for _ in range(3):
        eng.step()
    groups = eng.abort_all()
    assert len(groups) == 2  # the two admitted groups; the queued ones are dropped
    assert all(c.finish_reason in ("length", "stop") and 1 <= c.num_tokens <= 3 for g in groups for c in g.completions)
    assert not eng.has_unfinished()
