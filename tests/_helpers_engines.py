"""Test helpers shared by the torch-engine tests and the vllm checks (tests/_vllm_checks.py)."""

import torch

from components.engines.logprobs import build_batch, sequence_logprobs


def recompute_logprobs(model, completions, temperature):
    """Trainer-side log-probs [N, T] of each completion, plus gen_logp [N, T] and a mask of sampled tokens."""
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], pad_id=0)
    with torch.no_grad():
        logp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_start"], temperature)
    gen = torch.zeros_like(logp)
    sampled = torch.zeros_like(batch["completion_mask"])
    for i, c in enumerate(completions):
        gen[i, : c.num_tokens] = torch.tensor(c.gen_logp)
        sampled[i, : c.num_tokens] = ~torch.tensor(c.forced)
    return logp, gen, sampled
