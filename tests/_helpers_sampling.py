"""Float64 references for the sampling knobs (issue 43 item 5), shared by tests/test_sampling_knobs.py
(torch engine) and tests/_vllm_knob_checks.py (vLLM, run with the vllm python: no pytest here).

`ref_distribution` is written from vLLM's definitions in plain Python, not from either engine's
tensor code: the repetition penalty on the raw logits, softmax(z / T), min-p, top-k, then top-p on
the renormalised rest.
"""

from __future__ import annotations

import math

import torch

# knobs for the first-token frequency checks: a cold temperature makes the tiny random model's
# distribution peaked enough for every knob to matter
SAMPLE_KNOBS = dict(temperature=0.1, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=3.0)
SAMPLE_PROMPT = list(range(8, 40))  # 32 distinct tokens: the penalty hits part of the likely ones


def ref_distribution(logits, seen, temperature, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0):
    """({token: probability} of the distribution sampled from, the smallest relative margin to a threshold).

    1. repetition penalty on the raw logits of the tokens in `seen`: z / penalty if z > 0 else z * penalty;
    2. softmax(z / T); 3. min-p: keep p >= min_p * max p; 4. top-k among those: keep the k largest;
    5. renormalise; 6. top-p: in decreasing order keep a token while the mass before it is < top_p;
    7. renormalise. The margin guards the test data (a probability on a threshold makes the support
    depend on rounding).
    """
    z = [float(x) for x in logits]
    for v in seen:
        z[v] = z[v] / penalty if z[v] > 0 else z[v] * penalty
    m = max(x / temperature for x in z)
    e = [math.exp(x / temperature - m) for x in z]
    total = sum(e)
    p = [x / total for x in e]
    margins = []
    kept = list(range(len(p)))
    if min_p > 0:
        bar = min_p * max(p)
        margins += [abs(x - bar) / bar for x in p]
        kept = [v for v in kept if p[v] >= bar]
    if 0 < top_k < len(kept):
        ranked = sorted(kept, key=lambda v: -p[v])
        margins.append(abs(p[ranked[top_k - 1]] - p[ranked[top_k]]) / p[ranked[top_k - 1]])
        kept = ranked[:top_k]
    mass = sum(p[v] for v in kept)
    q = {v: p[v] / mass for v in kept}
    if top_p < 1.0:
        nucleus, before = {}, 0.0
        for v in sorted(q, key=lambda v: -q[v]):
            margins.append(abs(before - top_p))
            if before >= top_p:
                break
            nucleus[v] = q[v]
            before += q[v]
        mass = sum(nucleus.values())
        q = {v: x / mass for v, x in nucleus.items()}
    return q, min(margins, default=1.0)


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(v, 0.0) - b.get(v, 0.0)) for v in set(a) | set(b))


def next_logits(model, ids) -> torch.Tensor:
    """The model's next-token logits after `ids` (one unpadded sequence), as float64.  [V]"""
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0, -1].double()


def penalised_argmax_check(model, comp, penalty: float) -> int:
    """Assert every sampled token of `comp` is the argmax of the penalised logits of its context (prompt and
    completion so far, forced tokens included); near ties are skipped. Returns how many positions were checked."""
    checked = 0
    for j, (tok, forced) in enumerate(zip(comp.token_ids, comp.forced)):
        if forced:
            continue
        context = list(comp.prompt_ids) + list(comp.token_ids[:j])
        z = next_logits(model, context).tolist()
        for v in set(context):
            z[v] = z[v] / penalty if z[v] > 0 else z[v] * penalty
        top = sorted(range(len(z)), key=lambda v: -z[v])
        if z[top[0]] - z[top[1]] < 1e-5:
            continue  # a near tie: an engine's KV-cache logits may order it either way
        assert tok == top[0], (comp.group_id, j, tok, top[:3])
        checked += 1
    return checked
