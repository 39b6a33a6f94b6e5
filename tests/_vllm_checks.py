"""vLLM engine checks, run by tests/test_engines_vllm.py with the vllm python ($SCALERL_VLLM_PYTHON).

    python tests/_vllm_checks.py fp32,bf16_fp32_head MODEL_DIR

Each check asserts inside and reports its measured numbers (the protocol: tests/_helpers_vllm.py).
vLLM needs the `if __name__ == "__main__":` guard; `checks_main` sets the in-process engine env vars.
"""

from __future__ import annotations


def _recompute(model, comps, temperature):
    from _helpers_engines import recompute_logprobs  # tests/ is this script's directory

    return recompute_logprobs(model, comps, temperature)


def _gap(model, comps, temperature):
    from components.engines.logprobs import logprob_gap_stats

    logp, gen, mask = _recompute(model, comps, temperature)
    return logprob_gap_stats(logp, gen, mask)


def _all(groups):
    return [c for g in groups for c in g.completions]


def check_fp32(model_dir: str) -> dict:
    import torch

    from components.engines import GenerationRequest, Interruption, SamplingParams, make_engine
    from components.models import load_causal_lm
    from components.precision import get_precision

    torch.manual_seed(0)
    res: dict = {}
    eng = make_engine("vllm", model_dir, precision="fp32", seed=0, max_batch_size=64)
    eos = eng.tokenizer.eos_token_id
    trainer = get_precision("fp32").prepare_model(load_causal_lm(model_dir)).eval()

    # 1. generation + gen_logp vs trainer recomputation (T != 1 and top-p < 1: the hook matters)
    stops = (50, 51)
    prompts = [[9 + i, 10, 11 + i, 12][: 2 + i % 3] for i in range(6)]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=24, stop_token_ids=stops)
    comps = _all(eng.generate([GenerationRequest(group_id=i, prompt_ids=p, n=3) for i, p in enumerate(prompts)], params))
    assert len(comps) == 18
    for c in comps:
        assert len(c.token_ids) == len(c.gen_logp) == len(c.versions) == len(c.forced) >= 1
        assert not any(t in (*stops, eos) for t in c.token_ids[:-1])
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in (*stops, eos), c
        else:
            assert c.finish_reason == "length" and c.num_tokens == 24, c
    gap = _gap(trainer, comps, 0.7)
    res["gap_fp32"] = gap
    assert gap["logp_gap_max_abs"] < 1e-4, gap

    # 2. determinism with SamplingParams.seed
    sp = SamplingParams(max_tokens=30, stop_token_ids=(), seed=123)
    long_prompts = [[9, 10, 11], [12, 13]]
    ref = _all(eng.generate([GenerationRequest(group_id=i, prompt_ids=p, n=2) for i, p in enumerate(long_prompts)], sp))
    again = _all(eng.generate([GenerationRequest(group_id=i, prompt_ids=p, n=2) for i, p in enumerate(long_prompts)], sp))
    assert [c.token_ids for c in ref] == [c.token_ids for c in again]

    # 3. in-flight weight update: same seeds, update after 5 steps
    new = load_causal_lm(model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    state = {k: v.detach().clone() for k, v in new.state_dict().items()}
    eng.add_requests([GenerationRequest(group_id=i, prompt_ids=p, n=2) for i, p in enumerate(long_prompts)], sp)
    done = []
    for _ in range(5):
        done += eng.step()
    eng.update_weights(state, version=1)
    late = [GenerationRequest(group_id=100 + i, prompt_ids=p, n=2) for i, p in enumerate([[20, 21, 22], [23, 24]])]
    eng.add_requests(late, SamplingParams(max_tokens=20, stop_token_ids=()))
    while eng.has_unfinished():
        done += eng.step()
    upd = {(c.group_id, c.sample_index): c for c in _all(done)}
    spans = 0
    for c in ref:
        u = upd[(c.group_id, c.sample_index)]
        if 1 not in u.versions:  # finished (EOS) before the update
            assert u.num_tokens <= 5 and u.token_ids == c.token_ids
            continue
        k = u.versions.index(1)
        assert set(u.versions[:k]) == {0} and set(u.versions[k:]) == {1}
        assert 1 <= k < u.num_tokens
        spans += 1
        assert u.token_ids[:k] == c.token_ids[:k]  # same seed: identical before the update
    assert spans >= 1, "some sequences must be in flight across the update"
    changed = sum(upd[(c.group_id, c.sample_index)].token_ids != c.token_ids for c in ref)
    assert changed >= 1, "the new weights must change later tokens"
    res["update_spanning"], res["update_changed"] = spans, changed
    late_comps = [upd[(g.group_id, s)] for g in late for s in range(2)]
    assert all(set(c.versions) == {1} for c in late_comps)
    gap_new = _gap(new.eval(), late_comps, 1.0)
    res["gap_after_update"] = gap_new
    assert gap_new["logp_gap_max_abs"] < 2e-4, gap_new

    # 4. streaming: the short group is handed over while the long one is still running
    eng.add_requests([GenerationRequest(group_id="long", prompt_ids=[9, 10], n=2)], SamplingParams(max_tokens=40, stop_token_ids=()))
    eng.add_requests([GenerationRequest(group_id="short", prompt_ids=[11, 12], n=2)], SamplingParams(max_tokens=3))
    order, steps = [], 0
    while eng.has_unfinished():
        steps += 1
        order += [(g.request.group_id, steps) for g in eng.step()]
    assert [o[0] for o in order] == ["short", "long"], order
    assert order[0][1] < order[1][1] - 10, order
    res["stream_steps"] = order

    # 5. forced interruption
    phrase = tuple(eng.tokenizer.encode(" time is up </think>", add_special_tokens=False))
    its = [Interruption(at_token=a, phrase_ids=phrase, answer_budget=4) for a in (0, 3)]
    (g,) = list(eng.generate([GenerationRequest(group_id="i", prompt_ids=[9, 10], n=2, interruptions=its)],
                             SamplingParams(max_tokens=40, stop_token_ids=())))
    for c, it in zip(g.completions, its):
        k = len(phrase)
        assert c.forced == [False] * it.at_token + [True] * k + [False] * (c.num_tokens - it.at_token - k), c
        assert tuple(c.token_ids[it.at_token : it.at_token + k]) == phrase
        assert c.finish_reason in ("interrupted", "length")
        assert c.num_tokens - it.at_token - k == 4 or c.finish_reason == "interrupted"
    res["interruption_reasons"] = [c.finish_reason for c in g.completions]
    eng.close()  # the next check in this process starts its own engine
    return res


def check_bf16_fp32_head(model_dir: str) -> dict:
    import tempfile

    from components.engines import GenerationRequest, SamplingParams, make_engine
    from components.models import build_tiny_policy, load_causal_lm
    from components.precision import get_precision

    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:  # tied checkpoint: refused before vLLM starts
        tied = build_tiny_policy(tmp, tie_word_embeddings=True)
        try:
            make_engine("vllm", str(tied), precision="bf16_fp32_head")
        except NotImplementedError as err:
            assert "tie" in str(err)
            res["tied_refused"] = True
        else:
            raise AssertionError("a tied checkpoint with bf16_fp32_head must be refused")
    eng = make_engine("vllm", model_dir, precision="bf16_fp32_head", seed=0)
    assert eng.head_dtype() == "torch.float32"
    trainer = get_precision("bf16_fp32_head").prepare_model(load_causal_lm(model_dir)).eval()
    params = SamplingParams(temperature=1.0, max_tokens=24)
    prompts = [[9, 10, 11], [12, 13], [14, 15, 16, 17]]
    comps = _all(eng.generate([GenerationRequest(group_id=i, prompt_ids=p, n=4) for i, p in enumerate(prompts)], params))
    res["gap_bf16_fp32_head"] = _gap(trainer, comps, 1.0)
    assert res["gap_bf16_fp32_head"]["logp_gap_max_abs"] < 0.1
    eng.update_weights(trainer.state_dict(), 1)
    assert eng.head_dtype() == "torch.float32"  # reload keeps the fp32 head
    comps = _all(eng.generate([GenerationRequest(group_id=0, prompt_ids=[9, 10], n=2)], params))
    assert all(set(c.versions) == {1} for c in comps)
    eng.close()
    return res


CHECKS = {"fp32": check_fp32, "bf16_fp32_head": check_bf16_fp32_head}

if __name__ == "__main__":
    from _helpers_vllm import checks_main  # tests/ is this script's directory

    checks_main(CHECKS)  # python tests/_vllm_checks.py fp32,bf16_fp32_head MODEL_DIR
