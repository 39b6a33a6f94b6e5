"""vLLM loads an exported policy: run by tests/test_export.py with the vllm python ($SCALERL_VLLM_PYTHON).

    python tests/_vllm_export_check.py export OUT_DIR [OUT_DIR ...]

For each exported directory, a plain `vllm.LLM(model=OUT_DIR)` (fp32, in-process engine)
scores fixed prompts (the log-prob of every prompt token after the first) and decodes a
few greedy tokens. Reports {out_dir: {"prompt_logprobs": [[...]], "greedy": [[...]]}} (the
protocol: tests/_helpers_vllm.py); the test compares them with transformers on the same directory.
"""

from __future__ import annotations

import gc

PROMPTS = [[9, 10, 11, 12, 13, 14], [20, 31, 42, 15, 9]]  # token ids of the tiny char tokenizer
GREEDY_TOKENS = 6


def check(out_dir: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=out_dir, dtype="float32", max_model_len=64, seed=0, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    res = {"prompt_logprobs": [], "greedy": []}
    for prompt, out in zip(PROMPTS, outs):
        # prompt_logprobs[0] is None (no context); entry t maps the prompt token at t to its Logprob
        res["prompt_logprobs"].append([entry[tok].logprob for tok, entry in zip(prompt[1:], out.prompt_logprobs[1:])])
        res["greedy"].append(list(out.outputs[0].token_ids))
    del llm
    gc.collect()
    return res


if __name__ == "__main__":
    from _helpers_vllm import checks_main  # tests/ is this script's directory

    checks_main({"export": lambda *out_dirs: {d: check(d) for d in out_dirs}})
