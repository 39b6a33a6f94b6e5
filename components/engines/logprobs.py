"""The ONE implementation of "log-prob of the sampled tokens", shared by engines and trainer.

`token_logprobs` is what an engine records at sampling time (gen_logp) and what
`sequence_logprobs` recomputes for a whole batch in the trainer, so the two differ only
by the numerics of the forward passes (KV-cache decode vs. one full-sequence pass, batch
shapes, precision) and by policy staleness, which is exactly the gap PAPER.md §5 folds into
the importance ratio.

Batch layout used by `build_batch` / `sequence_logprobs` (the trainer's layout):
prompts LEFT-padded to a common length P, completions RIGHT-padded to a common length T::

    input_ids      [B, P + T]   pad | prompt | completion | pad
    attention_mask [B, P + T]   0   | 1      | 1          | 0
    completion_mask[B, T]       True on completion tokens

Position ids are derived from the attention mask (cumsum − 1), as the engines do, so a
left-padded row sees the same positions as the unpadded sequence.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

__all__ = [
    "scaled_log_softmax",
    "token_logprobs",
    "sequence_logprobs",
    "build_batch",
    "logprob_gap_stats",
    "position_ids_from_mask",
]


def scaled_log_softmax(logits: torch.Tensor, temperature: "float | torch.Tensor" = 1.0) -> torch.Tensor:
    """log_softmax(logits.float() / temperature) over the vocabulary, float32.

    logits [..., V]; temperature a float, or a tensor [...] with one temperature per row.
    A temperature <= 0 (greedy decoding) counts as 1.
    """
    scaled = logits.float()
    if torch.is_tensor(temperature):
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(scaled)
        scaled = scaled / t.unsqueeze(-1)
    elif temperature > 0 and temperature != 1.0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[token] in float32.

    logits [..., V] (any float dtype), tokens [...] (long) -> [...] float32.
    temperature <= 0 means greedy decoding; its log-prob is taken at temperature 1.
    Not renormalised after top-p (the gen_logp contract in engines/base.py).
    """
    logp = scaled_log_softmax(logits, temperature)  # [..., V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] 0/1 mask -> [B, L] positions counting only real tokens (pads get 0)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_start: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Trainer log-prob of every completion token (carries grad if the model does).

    Args:
        model: a transformers causal LM (prepared by the run's precision policy).
        input_ids: [B, L] long, prompts left-padded to `completion_start`, completions
            right-padded after it (see `build_batch`).
        attention_mask: [B, L] 0/1.
        completion_start: P, the column where completions start (>= 1).
        temperature: the sampling temperature the engine used.

    Returns:
        [B, L - P] float32: log_softmax(logits / temperature)[token] for input_ids[:, P:].
        Values at padded positions are meaningless; mask them with the completion mask.
    """
    if completion_start < 1:
        raise ValueError(f"completion_start must be >= 1 (a prompt token is needed), got {completion_start}")
    length = input_ids.shape[1]
    num_completion = length - completion_start  # T
    if num_completion <= 0:
        raise ValueError(f"no completion columns: input length {length}, completion_start {completion_start}")
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=num_completion + 1,  # logits at columns P-1 .. L-1
    )
    logits = out.logits[:, :-1, :]  # [B, T, V]: column P-1+t predicts token P+t
    targets = input_ids[:, completion_start:]  # [B, T]
    return token_logprobs(logits, targets, temperature)


def build_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    device: Optional[torch.device | str] = None,
) -> dict:
    """Pack prompt/completion token lists into the layout `sequence_logprobs` expects.

    Returns dict(input_ids [B, P+T], attention_mask [B, P+T], completion_mask [B, T] bool,
    completion_start P).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        raise ValueError("build_batch needs at least one sequence")
    P = max(len(p) for p in prompts)
    T = max(1, max(len(c) for c in completions))
    B = len(prompts)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    completion_mask = torch.zeros((B, T), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if len(p) == 0:
            raise ValueError(f"sequence {i} has an empty prompt")
        input_ids[i, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long)
        attention_mask[i, P - len(p) : P] = 1
        if len(c):
            input_ids[i, P : P + len(c)] = torch.as_tensor(list(c), dtype=torch.long)
            attention_mask[i, P : P + len(c)] = 1
            completion_mask[i, : len(c)] = True
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask, completion_start=P)
    if device is not None:
        batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    return batch


def logprob_gap_stats(logp: torch.Tensor, gen_logp: torch.Tensor, mask: torch.Tensor) -> Mapping[str, float]:
    """Trainer-vs-generator log-prob gap over the masked tokens (a metric to log every step).

    logp, gen_logp [B, T]; mask [B, T] bool (completion tokens that are not forced).
    Returns mean_abs, max_abs, mean (signed logp − gen_logp) and the mean |p − p_gen|
    (probability-space gap, the quantity the paper's Figs 21–23 discuss), as floats.
    """
    m = mask.bool()
    if not bool(m.any()):
        return {"logp_gap_mean_abs": 0.0, "logp_gap_max_abs": 0.0, "logp_gap_mean": 0.0, "prob_gap_mean_abs": 0.0}
    a = logp.detach().double()[m]
    b = gen_logp.detach().double()[m]
    d = a - b
    return {
        "logp_gap_mean_abs": float(d.abs().mean()),
        "logp_gap_max_abs": float(d.abs().max()),
        "logp_gap_mean": float(d.mean()),
        "prob_gap_mean_abs": float((a.exp() - b.exp()).abs().mean()),
    }
